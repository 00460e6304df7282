"""The import structure: layers import only downwards, and nothing imports in a circle.

Layers, bottom to top (DESIGN.md): the core (IR, ops, nn, optim, attributes) <-
``distgraph.resources`` <- ``distgraph.passes`` <- ``distgraph.runtime`` <- the
application (``distgraph.app``, ``distgraph.cli``, ``distgraph.tools`` and the
``distgraph`` facade). Every import counts, those inside functions included: they are read
from the source with ``ast``, not from a running interpreter.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"distgraph": "distgraph", "resources": "distgraph.resources",
           "passes": "distgraph.passes", "runtime": "distgraph.runtime"}
LAYER_ROOTS = set(FOLDERS.values())
LAYERS = ("core", "resources", "passes", "runtime", "application")
APPLICATION = ("distgraph.app", "distgraph.cli", "distgraph.tools")


def modules() -> dict:
    """{module name: source path} of the four package folders."""
    out = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def layer(name: str) -> int:
    if name == "distgraph" or any(_within(name, p) for p in APPLICATION):
        return LAYERS.index("application")
    for package, index in (("distgraph.runtime", 3), ("distgraph.passes", 2),
                           ("distgraph.resources", 1)):
        if _within(name, package):
            return index
    return 0


def group(name: str, mods: dict) -> str:
    """What a circle is counted between: a sub-package (``distgraph.passes.search``), or a
    module that sits directly in a layer's folder (``distgraph.passes.planner``)."""
    if mods[name].name == "__init__.py":
        return name
    parent = name.rsplit(".", 1)[0]
    return name if parent in LAYER_ROOTS else parent


def imports(path: Path, mods: dict) -> list:
    """(line, imported module) for every distgraph import in ``path``; ``from P import X``
    counts as an import of module ``P.X`` where that is one."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and _within(node.module, "distgraph"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.append((node.lineno, full if full in mods else node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if _within(a.name, "distgraph")]
    return out


def import_graph(mods: dict) -> nx.DiGraph:
    graph = nx.DiGraph()
    graph.add_nodes_from(mods)
    for name, path in mods.items():
        for line, target in imports(path, mods):
            if target != name:
                graph.add_edge(name, target, where=f"{path.relative_to(ROOT)}:{line}")
    return graph


def upward_imports(graph: nx.DiGraph) -> list:
    return [f"{d['where']}: {a} ({LAYERS[layer(a)]}) imports {b} ({LAYERS[layer(b)]})"
            for a, b, d in graph.edges(data=True) if layer(b) > layer(a)]


def circles(graph: nx.DiGraph, key=lambda name: name) -> list:
    """Each circle of ``graph`` with nodes merged by ``key``, as the imports that make it."""
    merged = nx.DiGraph()
    for a, b, d in graph.edges(data=True):
        if key(a) != key(b):
            merged.add_edge(key(a), key(b))
            merged.edges[key(a), key(b)].setdefault("why", []).append(
                f"{d['where']}: {a} imports {b}")
    found = []
    for component in nx.strongly_connected_components(merged):
        if len(component) > 1:
            sub = merged.subgraph(component)
            found.append("circle between " + ", ".join(sorted(component)) + ":\n    "
                         + "\n    ".join(w for _, _, d in sub.edges(data=True) for w in d["why"]))
    return found


@pytest.fixture(scope="module")
def graph():
    return import_graph(modules())


def test_every_module_of_the_four_folders_is_read():
    mods = modules()
    assert "distgraph.passes.search.ilp" in mods and "distgraph.runtime.comm.mpi" in mods
    assert "distgraph.app.engine" in mods and "distgraph.resources.cluster" in mods


def test_no_module_imports_a_higher_layer(graph):
    found = upward_imports(graph)
    assert not found, "imports against the layering:\n" + "\n".join(found)


def test_packages_do_not_import_each_other_in_a_circle(graph):
    mods = modules()
    found = circles(graph, key=lambda name: group(name, mods))
    assert not found, "\n".join(found)


def test_modules_do_not_import_each_other_in_a_circle(graph):
    found = circles(graph)
    assert not found, "\n".join(found)


def test_the_checks_see_an_upward_import_and_a_circle(tmp_path):
    """The checker itself: a resources module importing passes, and two modules importing
    each other inside functions, are both found."""
    (tmp_path / "a.py").write_text("def f():\n    from distgraph.passes.search import b\n")
    (tmp_path / "b.py").write_text("import os\n\ndef g():\n    import distgraph.resources.a\n")
    mods = {"distgraph.resources.a": tmp_path / "a.py", "distgraph.passes.search.b": tmp_path / "b.py"}
    fake = nx.DiGraph()
    for name, path in mods.items():
        for line, target in imports(path, mods):
            fake.add_edge(name, target, where=f"{path.name}:{line}")
    assert upward_imports(fake) == ["a.py:2: distgraph.resources.a (resources) imports "
                                    "distgraph.passes.search.b (passes)"]
    assert len(circles(fake)) == 1
