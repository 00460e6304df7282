"""Import of Paddle's auto-parallel cluster JSON.

Paddle describes a cluster as ``{"machines": [{"hostname", "addr", "port", "devices":
[{global_id, local_id, type, model, sp_gflops, dp_gflops, memory}, ...], "links":
[{source_global_id, target_global_id, type, bandwidth, latency}, ...]}, ...]}``.
Differences from the distgraph schema, and how they are bridged:

- numbers are often strings (``"memory": "32"``): numeric strings are accepted;
- ``sp_gflops`` / ``dp_gflops`` / ``hp_gflops`` become ``gflops`` for float32 / float64 /
  float16;
- NICs are devices of type ``NIC`` (their ``width`` and ``ip`` are ignored);
- links are directed and usually listed in both directions: the two directions of a
  pair merge into one undirected link with the smaller bandwidth and the larger latency
  (the conservative reading); a missing latency is 0 (Paddle's default);
- a link listed under one machine may point into another machine (NIC to NIC "NET"
  links): it becomes a link between machines;
- keys distgraph does not use (``alpha_latency``, ``arch``, ``vendor``, ...) are ignored;
  a device may add distgraph's ``reserved_memory`` (GB its process cannot fill; without
  it, the default for its type: resources/README.md);
- machine ids are the positions in ``machines``; device meshes are inferred.

Detection: a file is Paddle's when some device has ``sp_gflops``/``dp_gflops``/
``hp_gflops`` or some link has ``source_global_id``.

Example::

    >>> from distgraph.resources.cluster import Cluster
    >>> from distgraph.resources.reader import Reader
    >>> data = {"machines": [{"hostname": "h", "devices": [{"global_id": 0, "local_id": 0,
    ...     "type": "GPU", "model": "V100", "memory": "32", "sp_gflops": "15700"}]}]}
    >>> is_paddle_format(data)
    True
    >>> cluster_from_paddle(data, Reader("p.json", lenient_numbers=True), Cluster).devices[0].memory
    32.0
"""

from __future__ import annotations

from distgraph.resources.elements import (COMPUTE_TYPES, Device, InvalidCluster, Link,
                                         Machine)
from distgraph.resources.reader import Reader, join
from distgraph.resources.schema import reserved_memory

GFLOPS_KEYS = {"sp_gflops": "float32", "dp_gflops": "float64", "hp_gflops": "float16"}


def is_paddle_format(data) -> bool:
    """True when ``data`` looks like Paddle's cluster JSON (see the module docstring)."""
    machines = data.get("machines") if isinstance(data, dict) else None
    if not isinstance(machines, list):
        return False
    for m in machines:
        if not isinstance(m, dict):
            continue
        devices, links = m.get("devices"), m.get("links")
        for d in devices if isinstance(devices, list) else []:
            if isinstance(d, dict) and GFLOPS_KEYS.keys() & d.keys():
                return True
        for ln in links if isinstance(links, list) else []:
            if isinstance(ln, dict) and "source_global_id" in ln:
                return True
    return False


def cluster_from_paddle(data, reader: Reader, make):
    """Validate Paddle's cluster JSON and convert it with ``make`` (the Cluster class);
    errors name Paddle's key paths."""
    top = reader.mapping(data, "", None, "a mapping with a 'machines' list")
    raw_machines = reader.sequence(reader.get(top, "machines", ""), "machines",
                                   "a list of machines", nonempty=True)
    owner: dict[int, tuple[int, str]] = {}
    headers = []
    for i, raw in enumerate(raw_machines):
        key = join("machines", i)
        m = reader.mapping(raw, key)
        devices, nics = _devices(reader, m, key, i, owner)
        port = m.get("port")
        port = reader.integer(m, "port", key) if port not in (None, "") else None
        headers.append((reader.string(m, "hostname", key, nonempty=True),
                        str(m.get("addr", "") or ""), port, devices, nics))
    merged: dict[tuple[int, int], list] = {}
    for i, raw in enumerate(raw_machines):
        key = join(join("machines", i), "links")
        for j, raw_link in enumerate(reader.sequence(raw.get("links", []), key)):
            _link(reader, raw_link, join(key, j), owner, merged)
    intra: dict[int, list[Link]] = {i: [] for i in range(len(raw_machines))}
    inter = []
    for (s, t), (bandwidth, latency, ltype) in merged.items():
        link = Link(s, t, bandwidth, latency, ltype)
        if owner[s][0] == owner[t][0]:
            intra[owner[s][0]].append(link)
        else:
            inter.append(link)
    machines = tuple(Machine(i, host, devices, tuple(intra[i]), nics, addr, port)
                     for i, (host, addr, port, devices, nics) in enumerate(headers))
    try:
        return make(machines, tuple(inter), name=str(top.get("name", "") or reader.default_name))
    except InvalidCluster as err:
        reader.fail(err.key, err.problem, err.expected)


def _devices(reader: Reader, m: dict, key: str, machine: int, owner: dict):
    devices, nics = [], []
    local_seen: set[tuple[str, int]] = set()
    dlist = reader.sequence(reader.get(m, "devices", key), join(key, "devices"),
                            "a list of devices", nonempty=True)
    for j, raw in enumerate(dlist):
        dkey = join(join(key, "devices"), j)
        d = reader.mapping(raw, dkey)
        gid = reader.integer(d, "global_id", dkey)
        if gid in owner:
            reader.fail(join(dkey, "global_id"), f"global id {gid} is already used at "
                        f"{owner[gid][1]}", "unique global ids")
        owner[gid] = (machine, dkey)
        dtype = reader.string(d, "type", dkey, choices=COMPUTE_TYPES + ("NIC",))
        local = reader.integer(d, "local_id", dkey)
        if (dtype, local) in local_seen:
            reader.fail(join(dkey, "local_id"), f"local id {local} of a {dtype} is used twice "
                        "in this machine", "local ids unique per device type")
        local_seen.add((dtype, local))
        model = str(d.get("model", "") or "").strip()
        if dtype == "NIC":
            nics.append(Device(gid, local, machine, "NIC", model))
            continue
        memory = reader.number(d, "memory", dkey, strict=True, unit="GB")
        gflops = {dt: reader.number(d, k, dkey, strict=True, unit="GFLOP/s")
                  for k, dt in GFLOPS_KEYS.items() if k in d}
        if not gflops:
            reader.fail(dkey, "no sp_gflops, dp_gflops or hp_gflops",
                        "at least sp_gflops (float32 GFLOP/s)")
        devices.append(Device(gid, local, machine, dtype, model, gflops, memory,
                              reserved_memory=reserved_memory(reader, d, dkey, memory)))
    if not devices:
        reader.fail(join(key, "devices"), "only NICs", "at least one compute device")
    return tuple(devices), tuple(nics)


def _link(reader: Reader, raw, key: str, owner: dict, merged: dict):
    ln = reader.mapping(raw, key)
    ends = []
    for name in ("source_global_id", "target_global_id"):
        gid = reader.integer(ln, name, key)
        if gid not in owner:
            reader.fail(join(key, name), f"global id {gid} is not a device of any machine",
                        "the global_id of a listed device")
        ends.append(gid)
    s, t = ends
    if s == t:
        reader.fail(join(key, "target_global_id"), f"source and target are both {s}",
                    "two different devices")
    bandwidth = reader.number(ln, "bandwidth", key, strict=True, unit="GB/s")
    latency = reader.number(ln, "latency", key, default=0.0, unit="µs")
    ltype = reader.string(ln, "type", key, default="")
    pair = (min(s, t), max(s, t))
    if pair in merged:
        old = merged[pair]
        merged[pair] = [min(old[0], bandwidth), max(old[1], latency), old[2] or ltype]
    else:
        merged[pair] = [bandwidth, latency, ltype]
