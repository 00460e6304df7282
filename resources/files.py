"""Reading and writing resource files (YAML or JSON, chosen by suffix).

Loading parses the text, builds a key-path -> line map (so schema errors can say where
they are), detects Paddle's cluster JSON and otherwise applies the distgraph schema.
Syntax errors report the parser's line and column.

Example::

    >>> from distgraph.resources.cluster import Cluster
    >>> Cluster.from_file("resources/clusters/gpu_2x8.yaml").device_meshes[0].shape  # doctest: +SKIP
    (2, 8)
"""

from __future__ import annotations

import json
import os

import yaml

from distgraph.errors import ResourceFileError
from distgraph.resources.paddle_format import cluster_from_paddle, is_paddle_format
from distgraph.resources.reader import Reader, join
from distgraph.resources.schema import cluster_from_dict, cluster_to_dict

YAML_SUFFIXES = (".yaml", ".yml")
# libyaml's loader where PyYAML was built with it: the same documents and marks, about
# ten times faster (a 1,024-GPU file has some 5,000 lines).
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
JSON_SUFFIXES = (".json",)


def load_cluster(path, make):
    """Read ``path`` and return the Cluster ``make`` (the Cluster class) builds; any problem
    raises ResourceFileError."""
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ResourceFileError(f"{source}: no such resource file; expected a path to a "
                                ".yaml or .json file (examples in resources/clusters/)") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ResourceFileError(f"{source}: cannot read the file ({err}); expected a readable "
                                "UTF-8 text file") from None
    data = _parse(source, text)
    return cluster_from_data(data, make, source, lambda: line_map(text))


def cluster_from_data(data, make, source: str = "<dict>", lines=None):
    """Build a Cluster with ``make`` from parsed content, in Paddle's format or distgraph's;
    ``lines``: key path -> line, or the function that makes that map (see Reader)."""
    if is_paddle_format(data):
        return cluster_from_paddle(data, Reader(source, lines, lenient_numbers=True), make)
    return cluster_from_dict(data, Reader(source, lines), make)


def _parse(source: str, text: str):
    if not text.strip():
        raise ResourceFileError(f"{source}: <top level>: the file is empty; expected a mapping "
                                "with a 'machines' list (see resources/README.md)")
    if source.lower().endswith(JSON_SUFFIXES):
        try:
            return json.loads(text)
        except json.JSONDecodeError as err:
            raise ResourceFileError(f"{source} (line {err.lineno}, column {err.colno}): invalid "
                                    f"JSON: {err.msg}; expected valid JSON syntax") from None
    try:
        return yaml.load(text, Loader=_LOADER)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ResourceFileError(f"{source}{where}: invalid YAML: {problem}; expected valid "
                                "YAML syntax") from None


def line_map(text: str) -> dict[str, int]:
    """Key path -> 1-based line, from PyYAML's node tree (JSON is parsed as YAML here).

    Returns {} when the text does not compose as YAML (the error then names no line).
    """
    try:
        root = yaml.compose(text, Loader=_LOADER)
    except yaml.YAMLError:
        return {}
    lines: dict[str, int] = {}
    seen: set[int] = set()

    def walk(node, key: str, depth: int):
        # An alias repeats a node: walk it once, so that nested aliases cannot blow up.
        if depth > 64 or id(node) in seen:
            return
        seen.add(id(node))
        lines.setdefault(key, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                name = k.value if isinstance(k, yaml.ScalarNode) else "?"
                child = join(key, name)
                lines.setdefault(child, k.start_mark.line + 1)
                walk(v, child, depth + 1)
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                walk(v, join(key, i), depth + 1)

    if root is not None:
        walk(root, "", 0)
    return lines


class _Dumper(yaml.SafeDumper):
    """Block style, one figure per line, so people can read and edit the file; a list of
    plain numbers or names (a mesh shape, a link group) stays on one line."""

    def represent_list(self, data):
        flat = all(isinstance(x, (int, float, str, bool)) or x is None for x in data)
        return self.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flat)


_Dumper.add_representer(list, _Dumper.represent_list)


# Clusters of this many machines or more are saved with node groups (groups.py) unless
# asked otherwise: 16,384 GPUs written out node by node are some 7 MB and a minute to read.
COMPACT_MACHINES = 256


def save_cluster(cluster, path, compact: bool | None = None) -> None:
    """Write ``cluster`` in the distgraph schema; the suffix picks YAML or JSON.
    ``compact``: runs of identical machines as node groups (default: for clusters of
    :data:`COMPACT_MACHINES` machines or more)."""
    target = os.fspath(path)
    if compact is None:
        compact = len(cluster.machines) >= COMPACT_MACHINES
    data = cluster_to_dict(cluster, compact)
    lower = target.lower()
    if lower.endswith(JSON_SUFFIXES):
        text = json.dumps(data, indent=1) + "\n"
    elif lower.endswith(YAML_SUFFIXES):
        text = yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False,
                         width=100)
    else:
        raise ResourceFileError(f"{target}: cannot tell the format from the suffix; expected "
                                "a name ending in .yaml, .yml or .json")
    with open(target, "w", encoding="utf-8") as f:
        f.write(text)
