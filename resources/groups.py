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
    for k in range(count):          # node by node, as a file written out lists them
        for j, (ln, every, target_step) in enumerate(uplinks):
            ukey = join(join(key, "uplinks"), j)
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


def compact(machines: list[dict], links: list[dict], switch_ids: set[int]):
    """The inverse of :func:`expand` on canonical dicts: ``(machines, node_groups, links)``
    with each run of machines that are shifted copies of its first (ids advancing by one
    step, machine ids by one, hostnames ``prefix{index:0Nd}suffix``, each node's links to
    switches advancing alike) written as one group. Written-out machines load before
    the groups, so a machine that fits no group after a group keeps everything written
    out."""
    by_source: dict[int, list[tuple[int, dict]]] = {}
    for j, ln in enumerate(links):
        if "group" in ln:           # a group between machines: written as it is
            continue
        for end, other in (("source", "target"), ("target", "source")):
            if ln[other] in switch_ids and ln[end] not in switch_ids:
                by_source.setdefault(ln[end], []).append((j, ln))
    kept, groups, used = [], [], set()
    i = 0
    while i < len(machines):
        run = _run(machines, i, by_source)
        if run is None:
            if groups:      # loading puts written-out machines first: keep the order
                return machines, [], links
            kept.append(machines[i])
            i += 1
            continue
        group, count, taken = run
        groups.append(group)
        used |= taken
        i += count
    return kept, groups, [ln for j, ln in enumerate(links) if j not in used]


def _node_ids(m: dict) -> list[int]:
    return [d["global_id"] for d in m["devices"]] + [n["global_id"] for n in m.get("nics", [])]


def _shift_machine(m: dict, shift: int) -> dict:
    out = {**m, "devices": [dict(d, global_id=d["global_id"] + shift) for d in m["devices"]]}
    if "nics" in m:
        out["nics"] = [dict(n, global_id=n["global_id"] + shift) for n in m["nics"]]
    if "links" in m:
        out["links"] = [_shifted(ln, shift) for ln in m["links"]]
    return out


def _pattern(hostname: str):
    """``(prefix, width, suffix)`` of a hostname whose last run of digits is 0."""
    end = len(hostname)
    while end and not hostname[end - 1].isdigit():
        end -= 1
    start = end
    while start and hostname[start - 1].isdigit():
        start -= 1
    if start == end or int(hostname[start:end]) != 0:
        return None
    return hostname[:start], end - start, hostname[end:]


def _run(machines: list[dict], i: int, by_source: dict):
    """The longest group starting at machine ``i``, or None when it is too short."""
    first = machines[i]
    pattern = _pattern(first["hostname"])
    if pattern is None or i + 1 >= len(machines):
        return None
    prefix, width, suffix = pattern
    step = machines[i + 1]["devices"][0]["global_id"] - first["devices"][0]["global_id"]
    ids = _node_ids(first)
    if step <= 0 or step < max(ids) - min(ids) + 1:
        return None
    base = {k: v for k, v in first.items() if k not in ("id", "hostname")}
    # node 0's links to switches, by the node's own end
    ups = [(end, j, ln) for end in ids for j, ln in by_source.get(end, [])]
    count = 1
    while i + count < len(machines):
        m = machines[i + count]
        shifted = _shift_machine(base, count * step)
        if (m["id"] != first["id"] + count
                or m["hostname"] != f"{prefix}{count:0{width}d}{suffix}"
                or {k: v for k, v in m.items() if k not in ("id", "hostname")} != shifted):
            break
        count += 1
    if count < 2:
        return None
    uplinks, taken = [], set()
    for end, j, ln in ups:
        side = "source" if ln["source"] == end else "target"
        other = "target" if side == "source" else "source"
        found = []
        for k in range(count):
            mine = [(jj, x) for jj, x in by_source.get(end + k * step, [])
                    if {a: b for a, b in x.items() if a not in ("source", "target")} ==
                    {a: b for a, b in ln.items() if a not in ("source", "target")}]
            if len(mine) != 1:
                return None
            found.append(mine[0])
        targets = [x[other] for _, x in found]
        every = next((k for k in range(count) if targets[k] != targets[0]), count)
        target_step = targets[every] - targets[0] if every < count else 0
        if any(t != targets[0] + (k // every) * target_step for k, t in enumerate(targets)):
            return None
        entry = {"source": end, "target": ln[other],
                 **{a: b for a, b in ln.items() if a not in ("source", "target")}}
        if every < count:
            entry.update(every=every, target_step=target_step)
        uplinks.append(entry)
        taken |= {jj for jj, _ in found}
    group = {"count": count, "id": first["id"], "hostname": f"{prefix}{{index:0{width}d}}"
             f"{suffix}", "id_step": step, **base}
    if uplinks:
        group["uplinks"] = uplinks
    return group, count, taken
