"""Node groups: a resource file's compact form for many identical machines.

A group is one machine written once (node 0's ids) with a ``count``; loading expands it
into ``count`` machines whose global ids are node 0's plus ``k * id_step`` for node k, and
its ``uplinks`` (links from the node to switches, which live between machines) into one
link per node whose switch end advances by ``target_step`` every ``every`` nodes (a leaf
switch per rail and pod of a rail-optimised fat tree)::

    node_groups:
      - count: 2048
        hostname: "h100-{index:04d}"     # {index}: the node's place in the group
        id_step: 16                      # node k's ids: node 0's + 16 k
        devices: [...]                   # as in a machine, node 0's global ids
        nics: [...]
        links: [...]                     # inside the node
        uplinks:
          - {source: 8, target: 32768, bandwidth: 48, latency: 2, every: 384, target_step: 8}

The expanded machines and links are validated by the schema like written ones; an error
names the group's own key (``node_groups[0].devices[3].memory``) and, where it depends
on the node, the node (``node 5``). Machine ids are ``id`` (default: the number of
machines before the group) plus k.

Example::

    >>> from distgraph.resources.reader import Reader
    >>> g = {"count": 2, "hostname": "n{index}", "id_step": 1,
    ...      "devices": [{"global_id": 0, "type": "CPU", "memory": 4, "gflops": {"float32": 1}}]}
    >>> [(m["hostname"], m["devices"][0]["global_id"]) for m, _ in expand(Reader("x"), g,
    ...  "node_groups[0]", 0)[0]]
    [('n0', 0), ('n1', 1)]
"""

from __future__ import annotations

from distgraph.resources.reader import Reader, join

GROUP_KEYS = ("count", "id", "hostname", "id_step", "devices", "nics", "links", "uplinks",
              "addr", "port")
UPLINK_KEYS = ("source", "target", "bandwidth", "latency", "type", "every", "target_step")


def expand(reader: Reader, raw, key: str, first_machine_id: int):
    """``(machines, uplinks)``: ``machines`` a list of ``(machine dict, node index)``, the
    dicts in the schema's machine form with every id shifted; ``uplinks`` a list of
    ``(link dict, key of the uplink, node index)`` for the top-level links."""
    g = reader.mapping(raw, key, GROUP_KEYS, "a node group (count, hostname, id_step, "
                       "devices, ...)")
    count = reader.integer(g, "count", key, minimum=1)
    step = reader.integer(g, "id_step", key, minimum=1)
    first = reader.integer(g, "id", key, default=first_machine_id)
    pattern = reader.string(g, "hostname", key, nonempty=True)
    names = [_hostname(reader, pattern, join(key, "hostname"), k) for k in range(count)]
    if count > 1 and len(set(names)) != count:
        reader.fail(join(key, "hostname"), f"{pattern!r} gives the same name to two nodes",
                    "a pattern with {index}, e.g. 'node{index:04d}'")
    devices = reader.sequence(reader.get(g, "devices", key), join(key, "devices"),
                              "a list of devices", nonempty=True)
    nics = reader.sequence(g.get("nics", []), join(key, "nics"), "a list of NICs")
    links = reader.sequence(g.get("links", []), join(key, "links"), "a list of links")
    for where, entries in (("devices", devices), ("nics", nics)):
        for j, entry in enumerate(entries):
            ekey = join(join(key, where), j)
            reader.integer(reader.mapping(entry, ekey), "global_id", ekey)
    uplinks = [_uplink(reader, ln, join(join(key, "uplinks"), j), count)
               for j, ln in enumerate(reader.sequence(g.get("uplinks", []),
                                                      join(key, "uplinks")))]
    machines = []
    for k in range(count):
        shift = k * step
        machine = {"id": first + k, "hostname": names[k],
                   "devices": [dict(d, global_id=d["global_id"] + shift) for d in devices],
                   "nics": [dict(n, global_id=n["global_id"] + shift) for n in nics],
                   "links": [_shifted(ln, shift) for ln in links]}
        for name in ("addr", "port"):
            if name in g:
                machine[name] = g[name]
        machines.append((machine, k))
    out_links = []
    for j, (ln, every, target_step) in enumerate(uplinks):
        ukey = join(join(key, "uplinks"), j)
        for k in range(count):
            out_links.append((dict(ln, source=_plus(ln.get("source"), k * step),
                                   target=_plus(ln.get("target"), (k // every) * target_step)),
                              ukey, k))
    return machines, out_links


def _hostname(reader: Reader, pattern: str, key: str, index: int) -> str:
    try:
        return pattern.format(index=index)
    except (KeyError, IndexError, ValueError) as err:
        reader.fail(key, f"{pattern!r} does not format ({type(err).__name__}: {err})",
                    "a Python format string whose only field is {index}, e.g. 'node{index:04d}'")


def _uplink(reader: Reader, raw, key: str, count: int):
    ln = reader.mapping(raw, key, UPLINK_KEYS)
    if "group" in ln:
        reader.fail(join(key, "group"), "an uplink is one link per node", "source and target")
    every = reader.integer(ln, "every", key, default=count, minimum=1)
    target_step = reader.integer(ln, "target_step", key, default=0)
    for end in ("source", "target"):
        reader.integer(ln, end, key)
    rest = {k: v for k, v in ln.items() if k not in ("every", "target_step")}
    return rest, every, target_step


def _plus(value, shift: int):
    # Validated before (an integer); a bool or other junk is left for the schema to name.
    return value + shift if isinstance(value, int) and not isinstance(value, bool) else value


def _shifted(link, shift: int):
    if not isinstance(link, dict):
        return link
    out = dict(link)
    for end in ("source", "target"):
        if end in out:
            out[end] = _plus(out[end], shift)
    if isinstance(out.get("group"), list):
        out["group"] = [_plus(g, shift) for g in out["group"]]
    return out
