"""The distgraph resource-file schema: plain data <-> Cluster (see resources/README.md).

Parsing checks every key, type and reference and reports the key path of the first
problem; the Cluster constructor then checks what needs the whole picture (device meshes,
connectivity). ``cluster_to_dict`` writes the canonical form: one entry per link or
link group (a ``group`` stays one entry, whatever its size), every optional key that
carries information.

Example::

    >>> from distgraph.resources.cluster import Cluster
    >>> from distgraph.resources.reader import Reader
    >>> data = {"machines": [{"hostname": "h", "devices": [
    ...     {"global_id": 0, "type": "CPU", "memory": 4, "gflops": {"float32": 50}}]}]}
    >>> cluster_from_dict(data, Reader("inline"), Cluster).devices[0].memory
    4.0
"""

from __future__ import annotations

from dataclasses import replace

from distgraph.ops import registered_ops     # the package: every op registered
from distgraph.plan.kinds import RING_ROUND
from distgraph.registry import CAST_COSTS
from distgraph.resources.elements import (COMPUTE_TYPES, OVERLAP_EXPECTED, RESERVE_EXPECTED,
                                          SOFTWARE_KINDS, Device, DeviceMesh, GemmCurve,
                                          InvalidCluster, Link, LinkGroup, Machine, Overlaps,
                                          Switch, clique)
from distgraph.resources.groups import compact as _compact, expand as _expand_group
from distgraph.resources.reader import Reader, join

TOP_KEYS = ("name", "machines", "node_groups", "links", "switches", "device_meshes",
            "calibration", "figures")
MACHINE_KEYS = ("id", "hostname", "addr", "port", "devices", "nics", "links")
DEVICE_KEYS = ("global_id", "local_id", "type", "model", "gflops", "memory",
               "reserved_memory", "memory_bandwidth", "op_overhead", "op_costs",
               "reshard_overhead", "gemm", "overlap_efficiency")
GEMM_KEYS = ("units", "tile", "k_fill", "reuse")
NIC_KEYS = ("global_id", "local_id", "type", "model")
LINK_KEYS = ("source", "target", "group", "bandwidth", "latency", "type")
SWITCH_KEYS = ("global_id", "name")
MESH_KEYS = ("name", "shape", "device_ids")
DTYPES = ("float16", "bfloat16", "float32", "float64", "int8")


class _Ids:
    """Where each global id was defined, and by which machine (None for switches)."""

    def __init__(self, reader: Reader):
        self.reader = reader
        self.where: dict[int, str] = {}
        self.machine: dict[int, int | None] = {}

    def define(self, gid: int, key: str, machine: int | None, node: str = ""):
        if gid in self.where:
            self.reader.fail(join(key, "global_id"), f"global id {gid}{node} is already used "
                             f"at {self.where[gid]}", "ids unique across devices, NICs and "
                             "switches (in a node group: an id_step larger than node 0's "
                             "ids span)")
        self.where[gid] = key + node
        self.machine[gid] = machine


def cluster_from_dict(data, reader: Reader, make):
    """Validate ``data`` (parsed YAML/JSON) against the schema and build the Cluster with
    ``make`` (the Cluster class, which calls this module: it is passed, not imported)."""
    if data is None:
        reader.fail("", "the file is empty", "a mapping with a 'machines' list")
    top = reader.mapping(data, "", TOP_KEYS, "a mapping with a 'machines' list")
    ids = _Ids(reader)
    # (machine dict, its key, a note naming the node of a group) in file order: the
    # machines written out, then each node group expanded (see groups.py)
    entries = []
    if "machines" in top or "node_groups" not in top:
        raw_machines = reader.sequence(reader.get(top, "machines", ""), "machines",
                                       "a list of machines", nonempty=True)
        entries = [(raw, join("machines", i), "", i) for i, raw in enumerate(raw_machines)]
    uplinks = []
    for g, raw in enumerate(reader.sequence(top.get("node_groups", []), "node_groups",
                                            "a list of node groups")):
        gkey = join("node_groups", g)
        nodes, links = _expand_group(reader, raw, gkey, len(entries))
        entries += [(m, gkey, f" (node {k})" if k else "", len(entries) + k)
                    for m, k in nodes]
        uplinks += [(ln, lkey, f" (node {k})") for ln, lkey, k in links]
    # A group's node k > 0 is its node 0 moved by k id steps: node 0 is validated in full,
    # the others only for what moving can break (unique ids), which keeps 16,384 GPUs fast.
    parsed = []
    for raw, key, node, index in entries:
        if node and key.startswith("node_groups"):
            parsed.append((_moved(parsed[-1][0], raw, ids, key, node), key, node))
        else:
            parsed.append((_machine(reader, raw, key, index, ids, node), key, node))
    machine_ids: dict[int, str] = {}
    for (mid, *_rest), key, node in parsed:
        if mid in machine_ids:
            reader.fail(join(key, "id"), f"machine id {mid}{node} is already used by "
                        f"{machine_ids[mid]}", "unique machine ids")
        machine_ids[mid] = key + node
    switches = []
    for k, raw in enumerate(reader.sequence(top.get("switches", []), "switches")):
        key = join("switches", k)
        s = reader.mapping(raw, key, SWITCH_KEYS)
        gid = reader.integer(s, "global_id", key)
        ids.define(gid, key, None)
        switches.append(Switch(gid, reader.string(s, "name", key, default="")))
    pairs = Overlaps()          # every pair of endpoints linked once
    machines = []
    for (mid, hostname, addr, port, devices, nics, raw_links), key, node in parsed:
        if isinstance(raw_links, tuple):          # a moved node: node 0's links moved
            shift = raw_links[0]
            links = tuple(_shifted_link(ln, shift) for ln in machines[-1].links.elements)
        else:
            links = _links(reader, raw_links, join(key, "links"), mid, ids, pairs, node)
        machines.append(Machine(mid, hostname, devices, links, nics, addr, port))
    # the groups' uplinks first, node by node, then the links written out
    inter = tuple(ln for raw, lkey, node in uplinks
                  for ln in _link(reader, raw, lkey, None, ids, pairs, node))
    inter += _links(reader, reader.sequence(top.get("links", []), "links"), "links", None,
                    ids, pairs)
    meshes = None
    if "device_meshes" in top:
        meshes = [_mesh(reader, raw, join("device_meshes", k)) for k, raw in
                  enumerate(reader.sequence(top["device_meshes"], "device_meshes"))]
    calibration = {}
    raw_cal = reader.mapping(top.get("calibration", {}), "calibration", None,
                             "a mapping of name to number")
    for name in raw_cal:
        calibration[str(name)] = reader.number(raw_cal, name, "calibration")
    try:
        return make(tuple(machines), tuple(inter), tuple(switches),
                       None if meshes is None else tuple(meshes),
                       reader.string(top, "name", "", default=reader.default_name), calibration,
                       reader.string(top, "figures", "", default="",
                                     choices=("measured", "published")))
    except InvalidCluster as err:
        reader.fail(err.key, err.problem, err.expected)


def _machine(reader: Reader, raw, key: str, index: int, ids: _Ids, node: str = ""):
    m = reader.mapping(raw, key, MACHINE_KEYS)
    mid = reader.integer(m, "id", key, default=index)
    hostname = reader.string(m, "hostname", key, nonempty=True)
    addr = reader.string(m, "addr", key, default="")
    port = reader.integer(m, "port", key, default=None)
    devices = []
    local_seen: dict = {}
    per_type: dict = {}          # devices of each type so far: the default local id
    raw_devices = reader.sequence(reader.get(m, "devices", key), join(key, "devices"),
                                  "a list of devices", nonempty=True)
    for j, raw_dev in enumerate(raw_devices):
        dkey = join(join(key, "devices"), j)
        d = reader.mapping(raw_dev, dkey, DEVICE_KEYS)
        gid = reader.integer(d, "global_id", dkey)
        dtype = reader.string(d, "type", dkey, choices=COMPUTE_TYPES)
        local = reader.integer(d, "local_id", dkey, default=per_type.get(dtype, 0))
        per_type[dtype] = per_type.get(dtype, 0) + 1
        model = reader.string(d, "model", dkey, default="")
        _shared_local(reader, local_seen, (dtype, local), model, join(dkey, "local_id"))
        memory = reader.number(d, "memory", dkey, strict=True, unit="GB")
        gkey = join(dkey, "gflops")
        raw_gflops = reader.mapping(reader.get(d, "gflops", dkey), gkey, DTYPES,
                                    "a mapping of dtype to GFLOP/s, e.g. {float32: 19500}")
        if not raw_gflops:
            reader.fail(gkey, "got an empty mapping", "at least one dtype, e.g. {float32: 19500}")
        gflops = {k: reader.number(raw_gflops, k, gkey, strict=True, unit="GFLOP/s")
                  for k in raw_gflops}
        ids.define(gid, dkey, mid, node)
        mem_bw = reader.number(d, "memory_bandwidth", dkey, default=None, strict=True,
                               unit="GB/s")
        overhead = reader.number(d, "op_overhead", dkey, default=None, unit="µs")
        costs = _op_costs(reader, d, dkey)
        reshard = _reshard_overhead(reader, d, dkey)
        hides = reader.number(d, "overlap_efficiency", dkey, default=None)
        if hides is not None and not 0 <= hides <= 1:
            reader.fail(join(dkey, "overlap_efficiency"), f"got {hides:g}", OVERLAP_EXPECTED)
        devices.append(Device(gid, local, mid, dtype, model, gflops, memory, mem_bw, overhead,
                              costs, reshard, _gemm(reader, d, dkey),
                              reserved_memory(reader, d, dkey, memory), hides))
    nics = []
    for j, raw_nic in enumerate(reader.sequence(m.get("nics", []), join(key, "nics"))):
        nkey = join(join(key, "nics"), j)
        n = reader.mapping(raw_nic, nkey, NIC_KEYS)
        gid = reader.integer(n, "global_id", nkey)
        reader.string(n, "type", nkey, default="NIC", choices=("NIC",))
        local = reader.integer(n, "local_id", nkey, default=len(nics))
        _unique_local(reader, local_seen, ("NIC", local), join(nkey, "local_id"))
        ids.define(gid, nkey, mid, node)
        nics.append(Device(gid, local, mid, "NIC", reader.string(n, "model", nkey, default="")))
    raw_links = reader.sequence(m.get("links", []), join(key, "links"))
    return mid, hostname, addr, port, tuple(devices), tuple(nics), raw_links


def _moved(previous, raw: dict, ids: _Ids, key: str, node: str):
    """The parsed machine of a group's next node: ``previous`` (the node before) with its
    ids moved by one id step (``raw`` is the expanded dict of the node)."""
    _mid, _host, _addr, _port, devices, nics, _links_ = previous
    shift = raw["devices"][0]["global_id"] - devices[0].global_id
    moved = []
    for kind, group in (("devices", devices), ("nics", nics)):
        out = []
        for j, d in enumerate(group):
            gid = d.global_id + shift
            ids.define(gid, join(join(key, kind), j), raw["id"], node)
            out.append(replace(d, global_id=gid, machine_id=raw["id"]))
        moved.append(tuple(out))
    return (raw["id"], raw["hostname"], raw.get("addr", ""), raw.get("port"), moved[0],
            moved[1], (shift,))


def _shared_local(reader: Reader, seen: dict, slot: tuple[str, int], model: str, key: str):
    """Compute devices with the same type and local id are one device that several ranks
    share (ranks on one GPU): they must be the same model."""
    first = seen.setdefault(slot, (key, model))
    if first[1] != model:
        reader.fail(key, f"local id {slot[1]} of a {slot[0]} is the {first[1]!r} at "
                    f"{first[0]}, not a {model!r}", "devices that share a local id (ranks on "
                    "one device) of the same model, or another local id")


def _unique_local(reader: Reader, seen: dict, slot: tuple[str, int], key: str):
    if slot in seen:
        reader.fail(key, f"local id {slot[1]} of a {slot[0]} is already used at {seen[slot]}",
                    "local ids unique per device type within a machine")
    seen[slot] = key


def _links(reader: Reader, raw_links: list, key: str, machine: int | None, ids: _Ids,
           pairs: Overlaps, node: str = "") -> tuple:
    """Links of one machine (``machine`` = its id) or between machines (None)."""
    return tuple(ln for j, raw in enumerate(raw_links)
                 for ln in _link(reader, raw, join(key, j), machine, ids, pairs, node))


def _link(reader: Reader, raw, lkey: str, machine: int | None, ids: _Ids, pairs: Overlaps,
          node: str = "") -> list:
    """The link one entry at ``lkey`` gives: a Link, or a LinkGroup (all pairs of a
    group: one value, whatever its size)."""
    ln = reader.mapping(raw, lkey, LINK_KEYS)
    bandwidth = reader.number(ln, "bandwidth", lkey, strict=True, unit="GB/s")
    latency = reader.number(ln, "latency", lkey, unit="µs")
    ltype = reader.string(ln, "type", lkey, default="")
    if "group" in ln:
        if "source" in ln or "target" in ln:
            reader.fail(lkey, "has both 'group' and 'source'/'target'",
                        "either a source/target pair or a group (all pairs)")
        gkey = join(lkey, "group")
        members = reader.sequence(ln["group"], gkey, "a list of at least two global ids")
        ends = [(_endpoint(reader, {i: g}, i, gkey, machine, ids), join(gkey, i))
                for i, g in enumerate(members)]
        if len({e for e, _ in ends}) != len(ends) or len(ends) < 2:
            reader.fail(gkey, f"got {members}", "at least two different global ids")
    else:
        a = (_endpoint(reader, ln, "source", lkey, machine, ids), join(lkey, "source"))
        b = (_endpoint(reader, ln, "target", lkey, machine, ids), join(lkey, "target"))
        if a[0] == b[0]:
            reader.fail(b[1], f"source and target are both {a[0]}", "two different ids")
        ends = [a, b]
    if machine is None:
        inside: dict = {}          # machine -> an end in it, and its key
        for e, ekey in ends:
            m = ids.machine[e]
            if m is not None and m in inside:
                first, fkey = inside[m]
                reader.fail(fkey, f"both ends of link {first}-{e}{node} are in machine "
                            f"{m}", "links inside a machine under that machine's 'links'")
            if m is not None:
                inside[m] = (e, ekey)
    out = clique([e for e, _ in ends], bandwidth, latency, ltype) if "group" in ln \
        else Link(ends[0][0], ends[1][0], bandwidth, latency, ltype)
    found = pairs.add(out, lkey + node)
    if found is not None:
        other, (a, b) = found
        reader.fail(lkey, f"link {a}-{b}{node} is also given at {other}",
                    "each pair of endpoints linked once")
    return [out]


def _shifted_link(ln, shift: int):
    """Link (or group) ``ln`` of node 0 of a node group, for the node ``shift`` ids on."""
    if isinstance(ln, LinkGroup):
        return LinkGroup(tuple(m + shift for m in ln.members), ln.bandwidth, ln.latency,
                         ln.type)
    return Link(ln.source + shift, ln.target + shift, ln.bandwidth, ln.latency, ln.type)


def _endpoint(reader: Reader, data: dict, name, key: str, machine: int | None, ids: _Ids) -> int:
    gid = reader.integer(data, name, key)
    path = join(key, name)
    if gid not in ids.where:
        reader.fail(path, f"global id {gid} is not defined",
                    "the global_id of a device, NIC" + (" or switch" if machine is None else ""))
    if machine is not None and ids.machine[gid] != machine:
        reader.fail(path, f"global id {gid} is not in machine {machine} "
                    f"(defined at {ids.where[gid]})",
                    "a device or NIC of this machine; links between machines go under the "
                    "top-level 'links'")
    return gid


def _mesh(reader: Reader, raw, key: str) -> DeviceMesh:
    m = reader.mapping(raw, key, MESH_KEYS)
    name = reader.string(m, "name", key, nonempty=True)
    shape_raw = reader.sequence(reader.get(m, "shape", key), join(key, "shape"),
                                "a list of positive integers", nonempty=True)
    shape = [reader.integer({i: v}, i, join(key, "shape"), minimum=1)
             for i, v in enumerate(shape_raw)]
    ids_raw = reader.sequence(reader.get(m, "device_ids", key), join(key, "device_ids"),
                              "a list of device global ids", nonempty=True)
    ids = [reader.integer({i: v}, i, join(key, "device_ids")) for i, v in enumerate(ids_raw)]
    return DeviceMesh(name, tuple(shape), tuple(ids))


def _num(x: float):
    # Integral figures print as integers (300 rather than 300.0); they load back equal.
    return int(x) if float(x).is_integer() else float(x)


def cluster_to_dict(cluster, compact: bool = False) -> dict:
    """The canonical plain-data form of ``cluster`` (what ``Cluster.save`` writes);
    ``compact`` writes each run of machines alike as a node group (groups.py)."""
    out: dict = {}
    if cluster.name:
        out["name"] = cluster.name
    machines = [_machine_dict(m) for m in cluster.machines]
    links = [_link_dict(ln) for ln in cluster.links.elements]
    groups = []
    if compact:
        machines, groups, links = _compact(machines, links,
                                           {s.global_id for s in cluster.switches})
    if machines:
        out["machines"] = machines
    if groups:
        out["node_groups"] = groups
    if cluster.switches:
        out["switches"] = [{"global_id": s.global_id, **({"name": s.name} if s.name else {})}
                           for s in cluster.switches]
    if links:
        out["links"] = links
    # A compact file leaves out meshes that loading infers alike (16,384 ids otherwise).
    if not (compact and groups and cluster._infer_meshes() == cluster.device_meshes):
        out["device_meshes"] = [{"name": m.name, "shape": list(m.shape),
                                 "device_ids": list(m.ids)} for m in cluster.device_meshes]
    if cluster.calibration:
        out["calibration"] = {k: _num(v) for k, v in cluster.calibration.items()}
    if cluster.figures:
        out["figures"] = cluster.figures
    return out


def reserved_memory(reader: Reader, d: dict, dkey: str, memory: float) -> float | None:
    """A device's ``reserved_memory`` (GB of its ``memory`` its process cannot fill;
    :class:`~distgraph.resources.elements.Device`), or None where the file gives none."""
    reserve = reader.number(d, "reserved_memory", dkey, default=None, unit="GB")
    if reserve is not None and reserve >= memory:
        reader.fail(join(dkey, "reserved_memory"), f"got {reserve:g}, which leaves nothing "
                    f"of the device's {memory:g} GB", RESERVE_EXPECTED)
    return reserve


def _op_costs(reader: Reader, d: dict, dkey: str):
    """A device's ``op_costs``: {op type: [µs per call, ns per unit of work]}, or None;
    also the casts a CPU makes around 16-bit operands (:func:`~distgraph.registry.
    cast_cost_key`: ``cast bfloat16->float32``, µs per call and ns per element)."""
    raw = reader.get(d, "op_costs", dkey, default=None)
    if raw is None:
        return None
    key = join(dkey, "op_costs")
    known = {*registered_ops(), *CAST_COSTS}
    costs = {}
    for op_type, pair in reader.mapping(raw, key, known, "a mapping of op type to "
                                        "[µs per call, ns per unit of work]").items():
        pkey = join(key, op_type)
        pair = reader.sequence(pair, pkey, "[µs per call, ns per unit of work]")
        if len(pair) != 2:
            reader.fail(pkey, f"got {len(pair)} numbers", "two: [µs per call, ns per unit]")
        costs[op_type] = tuple(reader.number({str(i): v}, str(i), pkey)
                               for i, v in enumerate(pair))
    return costs


def _gemm(reader: Reader, d: dict, dkey: str):
    """A device's ``gemm`` curve ({units, tile: [rows, columns], k_fill, reuse}), or None."""
    raw = reader.get(d, "gemm", dkey, default=None)
    if raw is None:
        return None
    key = join(dkey, "gemm")
    g = reader.mapping(raw, key, GEMM_KEYS, "a mapping {units: N, tile: [rows, columns], "
                       "k_fill: steps, reuse: flops per element}")
    tile = reader.sequence(reader.get(g, "tile", key), join(key, "tile"), "[rows, columns]")
    if len(tile) != 2:
        reader.fail(join(key, "tile"), f"got {len(tile)} numbers", "two: [rows, columns]")
    units = reader.integer(g, "units", key, minimum=1)
    sizes = [reader.integer({str(i): v}, str(i), join(key, "tile"), minimum=1)
             for i, v in enumerate(tile)]
    return GemmCurve(units, tuple(sizes), reader.number(g, "k_fill", key, default=0.0),
                     reader.number(g, "reuse", key, default=0.0))


def _reshard_overhead(reader: Reader, d: dict, dkey: str):
    """A device's ``reshard_overhead``: {reshard step kind: µs per step, or [µs per step,
    ns per byte]}, or None."""
    raw = reader.get(d, "reshard_overhead", dkey, default=None)
    if raw is None:
        return None
    key = join(dkey, "reshard_overhead")
    raw = reader.mapping(raw, key, SOFTWARE_KINDS, "a mapping of reshard step kind to "
                         "µs per step or [µs per step, ns per byte]")
    out = {}
    for kind, cost in raw.items():
        if not isinstance(cost, (list, tuple)):
            out[kind] = reader.number(raw, kind, key, unit="µs")
            continue
        pkey = join(key, kind)
        if kind == RING_ROUND:
            reader.fail(pkey, f"got a list {cost!r}", "µs per further ring round alone "
                        "(a number: it has no cost per byte)")
        if len(cost) != 2:
            reader.fail(pkey, f"got {len(cost)} numbers", "two: [µs per step, ns per byte]")
        out[kind] = tuple(reader.number({str(i): v}, str(i), pkey) for i, v in enumerate(cost))
    return out


def _device_dict(d) -> dict:
    out = {"global_id": d.global_id, "local_id": d.local_id, "type": d.type, "model": d.model,
           "memory": _num(d.memory)}
    if d.reserved_memory is not None:           # None: the type's default, left to it
        out["reserved_memory"] = _num(d.reserved_memory)
    out["gflops"] = {k: _num(v) for k, v in d.gflops.items()}
    for key in ("memory_bandwidth", "op_overhead"):
        if getattr(d, key) is not None:
            out[key] = _num(getattr(d, key))
    if d.op_costs:
        out["op_costs"] = {k: [_num(a), _num(b)] for k, (a, b) in sorted(d.op_costs.items())}
    if d.reshard_overhead:
        out["reshard_overhead"] = {k: [_num(a), _num(b)] if b else _num(a)
                                   for k, (a, b) in sorted(d.reshard_overhead.items())}
    if d.gemm is not None:
        out["gemm"] = {"units": d.gemm.units, "tile": list(d.gemm.tile),
                       "k_fill": _num(d.gemm.k_fill), "reuse": _num(d.gemm.reuse)}
    if d.overlap_efficiency is not None:
        out["overlap_efficiency"] = _num(d.overlap_efficiency)
    return out


def _machine_dict(m: Machine) -> dict:
    out: dict = {"id": m.id, "hostname": m.hostname}
    if m.addr:
        out["addr"] = m.addr
    if m.port is not None:
        out["port"] = m.port
    out["devices"] = [_device_dict(d) for d in m.devices]
    if m.nics:
        out["nics"] = [{"global_id": n.global_id, "local_id": n.local_id,
                        **({"model": n.model} if n.model else {})} for n in m.nics]
    if m.links.elements:
        out["links"] = [_link_dict(ln) for ln in m.links.elements]
    return out


def _link_dict(ln) -> dict:
    ends = {"group": list(ln.members)} if isinstance(ln, LinkGroup) else \
        {"source": ln.source, "target": ln.target}
    out = {**ends, "bandwidth": _num(ln.bandwidth), "latency": _num(ln.latency)}
    if ln.type:
        out["type"] = ln.type
    return out
