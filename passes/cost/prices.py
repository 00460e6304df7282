"""Unit prices of the cost model: what one op, one reshard step, one collective inside an
op and one overlapped (MeshSlice) op cost on a device and its links.

The formulas are :mod:`.formulas` (alpha-beta on a ring, the pipeline of K slices); the
figures are the resource graph's (device rates, link bandwidths and latencies, the
measured software costs of ``distgraph cluster calibrate``). The search, completion's
conflict resolution, MeshSlice's autotuner, the balanced split and the plan estimate
(:mod:`.estimate`) all price with these functions, so they agree.

Example::

    t = reshard_step_time(step, process=0, cluster=cluster, device_of=lambda p: p)
"""

from __future__ import annotations

from distgraph import dtypes
from distgraph.passes.cost.formulas import COLLECTIVES, collective_time, pipeline_time
from distgraph.registry import get_op, op_work

# (memory bandwidth GB/s, op overhead µs) by device type when the file gives none.
DEFAULTS = {"CPU": (10.0, 20.0), "GPU": (1000.0, 10.0), "XPU": (500.0, 10.0),
            "NPU": (500.0, 10.0), "DCU": (500.0, 10.0)}


def device_rates(device) -> tuple[float, float]:
    """(memory bandwidth bytes/s, op overhead s) of a device, defaults filled in."""
    bw, overhead = DEFAULTS.get(device.type, DEFAULTS["CPU"])
    if device.memory_bandwidth is not None:
        bw = device.memory_bandwidth
    if device.op_overhead is not None:
        overhead = device.op_overhead
    return bw * 1e9, overhead * 1e-6


def op_time(op_type: str, ins, outs, attrs: dict, device) -> float:
    """Seconds for one op on ``device``; ``ins``/``outs`` are TensorTypes (local shapes).
    The device's measured cost of the op type where it has one (per call + per unit of
    work), else the roofline with the device's launch cost."""
    costs = device.op_costs.get(op_type) if device.op_costs else None
    if costs is not None:
        return costs[0] * 1e-6 + costs[1] * 1e-9 * op_work(op_type, ins, outs, attrs)
    return roofline_time(op_type, ins, outs, attrs, device)


def roofline_time(op_type: str, ins, outs, attrs: dict, device) -> float:
    """Seconds for one op from the device's GFLOP/s, memory bandwidth and launch cost
    alone (what :func:`op_time` falls back to without a measured cost of the op type)."""
    flops = get_op(op_type).flops(ins, outs, **attrs)
    touched = sum(_nbytes(t) for t in ins) + sum(_nbytes(t) for t in outs)
    dtype = outs[0].dtype if outs else (ins[0].dtype if ins else "float32")
    rate = device.flops(dtype) or device.flops("float32") or max(device.gflops.values()) * 1e9
    mem_bw, overhead = device_rates(device)
    return overhead + max(flops / rate, touched / mem_bw)


def feed_time(nbytes: int, device) -> float:
    """Seconds to copy ``nbytes`` of a feed into a process (its memory bandwidth)."""
    return nbytes / device_rates(device)[0]


def ring_links(cluster, devices) -> tuple[float, float]:
    """(bandwidth GB/s, latency µs) of a ring over ``devices``: its bottleneck hop and
    its slowest hop's latency."""
    hops = list(zip(devices, devices[1:] + devices[:1]))
    return (min(cluster.bandwidth(a, b) for a, b in hops),
            max(cluster.latency(a, b) for a, b in hops))


def reshard_step_time(step, process: int, cluster, device_of, scale: float = 1.0) -> float:
    """Seconds that reshard ``step`` costs ``process`` (0 where it takes no part): the
    alpha-beta of its messages (their bytes times ``scale``) plus the software cost of a
    step of its kind and buffer on the process's device (:func:`software_time`; a
    collective over one process costs what a local step does)."""
    involved = process in step.mesh or (step.dst_mesh is not None and process in step.dst_mesh)
    if not involved:
        return 0.0
    # over one process a collective meets no one: the runtime runs it as a local step
    kind = "slice" if step.kind in COLLECTIVES and step.group_size == 1 else step.kind
    return _message_time(step, process, cluster, device_of, scale) + \
        software_time(cluster.device(device_of(process)), kind, step.buffer_bytes * scale)


def software_time(device, kind: str, nbytes: float = 0.0) -> float:
    """Seconds of software a communication step of ``kind`` on a buffer of ``nbytes``
    (the cost formula's B) costs on ``device`` beyond its messages: ``µs per step + ns
    per byte x nbytes`` of ``Device.reshard_overhead`` (0 where not measured), what
    ``distgraph cluster calibrate`` measured through the runtime between ops: its calls,
    its copies (a gather's concatenation, a reduce-scatter's packing) and the wait for
    the group to meet.

    >>> from distgraph.resources.elements import Device
    >>> d = Device(0, 0, 0, "CPU", reshard_overhead={"all_gather": (30.0, 0.5)})
    >>> round(software_time(d, "all_gather", 1e6) * 1e6, 3)     # 30 µs + 0.5 ns x 1e6 B
    530.0
    """
    software = device.reshard_overhead
    if not software or kind not in software:
        return 0.0
    per_step, per_byte = software[kind]
    return per_step * 1e-6 + per_byte * 1e-9 * nbytes


def sliced_software_time(device, kind: str, nbytes: float = 0.0) -> float:
    """Seconds of software one collective of ``kind`` on ``nbytes`` costs inside a sliced
    pipeline (:class:`~distgraph.registry.Overlap`): per step, the device's measured
    ``sliced`` figure (each more slice of MeshSlice's kernel, ``distgraph cluster
    calibrate``) where it has one, and per byte what a reshard step of that kind costs
    (:func:`software_time`)."""
    software = device.reshard_overhead
    if not software or "sliced" not in software:
        return software_time(device, kind, nbytes)
    per_byte = software[kind][1] if kind in software else 0.0
    return software["sliced"][0] * 1e-6 + per_byte * 1e-9 * nbytes


def reread_time(device, nbytes: float) -> float:
    """Seconds a slice of a sliced op takes to move ``nbytes`` through memory beyond its
    share (:class:`~distgraph.registry.Overlap`'s ``reread``): the device's measured
    ``sliced`` figure per byte (``distgraph cluster calibrate``: partial GeMMs against the
    whole one, every process at once) where it has one, else its memory bandwidth."""
    software = device.reshard_overhead
    if software and "sliced" in software and software["sliced"][1] > 0:
        return software["sliced"][1] * 1e-9 * nbytes
    return nbytes / device_rates(device)[0]


def op_collective_time(kind: str, n: int, nbytes: float, ring: tuple, device) -> float:
    """Seconds of a collective an op runs itself over ``n`` processes on ``ring``
    (bandwidth GB/s, latency µs): its alpha-beta plus the software cost a reshard step
    of that kind and buffer pays on ``device``."""
    if n == 1:
        return 0.0
    return collective_time(kind, n, nbytes, *ring) + software_time(device, kind, nbytes)


def dim_ring(cluster, mesh, process: int, mesh_dim: str, device_of) -> tuple:
    """(bandwidth GB/s, latency µs, copied by the processor) of ``process``'s ring along
    ``mesh_dim``, while every group of that dim runs the same collective: a hop between
    two machines shares the machines' link with the hops of the other groups that cross
    it in the same direction at once (the file lists a link per pair of devices; the
    machines' network carries them all). The last is True for a group of CPUs inside one
    machine (module docstring: shared-memory transfers are the processes' own copies)."""
    devices = [device_of(q) for q in mesh.group_of(process, mesh_dim)]
    machine = {}

    def machine_of(d):
        if d not in machine:
            machine[d] = cluster.machine_of(d).id
        return machine[d]

    crossing: dict = {}
    for group in mesh.groups(mesh_dim):
        ring = [device_of(q) for q in group]
        for a, b in zip(ring, ring[1:] + ring[:1]):
            if len(ring) > 1 and machine_of(a) != machine_of(b):
                key = (machine_of(a), machine_of(b))
                crossing[key] = crossing.get(key, 0) + 1
    hops = list(zip(devices, devices[1:] + devices[:1]))
    bw = min((cluster.bandwidth(a, b) / crossing.get((machine_of(a), machine_of(b)), 1)
              for a, b in hops if a != b), default=float("inf"))
    lat = max((cluster.latency(a, b) for a, b in hops if a != b), default=0.0)
    cpu = all(cluster.device(d).type == "CPU" for d in devices)
    return bw, lat, cpu and len({machine_of(d) for d in devices}) == 1


def overlap_time(ov, device, ring_of, compute_time=None) -> tuple[float, float]:
    """(compute, exposed communication) seconds of an op that runs as ``ov`` (an
    :class:`~distgraph.registry.Overlap`) on ``device``; ``ring_of(mesh dim)`` gives that
    dim's ring as :func:`dim_ring` does (module docstring); ``compute_time`` prices one
    slice's compute (default :func:`op_time`)."""
    price = compute_time or op_time
    compute = price(ov.op_type, ov.ins, ov.outs, dict(ov.attrs), device) + \
        reread_time(device, ov.reread)
    processor = compute

    def wires(collectives) -> float:
        nonlocal processor
        per_dim: dict = {}
        for kind, dim, n, nbytes in collectives:
            if n == 1:
                continue
            bw, lat, copied = ring_of(dim)
            t = collective_time(kind, n, nbytes, bw, lat)
            processor += sliced_software_time(device, kind, nbytes) + (t if copied else 0.0)
            if not copied:
                per_dim[dim] = per_dim.get(dim, 0.0) + t
        return max(per_dim.values(), default=0.0)

    stages = [wires(ov.before), 0.0, wires(ov.after)]
    stages[1] = processor
    total = pipeline_time(ov.slices, stages)
    return ov.slices * compute, total - ov.slices * compute


def collectives_time(ov, device, ring_of) -> float:
    """Seconds of all of ``ov``'s collectives run one after another, none hidden (the
    communication a pipeline has to hide)."""
    total = 0.0
    for kind, dim, n, nbytes in ov.before + ov.after:
        if n > 1:
            bw, lat, _ = ring_of(dim)
            total += (collective_time(kind, n, nbytes, bw, lat)
                      + sliced_software_time(device, kind, nbytes))
    return ov.slices * total


def best_overlap(overlaps, device, ring_of, compute_time=None) -> tuple:
    """(Overlap, compute, exposed) of the fastest of ``overlaps`` (fewer slices on ties)."""
    priced = [(sum(overlap_time(ov, device, ring_of, compute_time)), ov.slices, ov)
              for ov in overlaps]
    _, _, ov = min(priced, key=lambda t: t[:2])
    return (ov,) + overlap_time(ov, device, ring_of, compute_time)


def _message_time(step, process: int, cluster, device_of, scale: float = 1.0) -> float:
    if step.kind == "send_recv":
        per_sender: dict = {}
        for t in step.transfers:
            if t.src != t.dst:
                a, b = device_of(t.src), device_of(t.dst)
                per_sender[t.src] = (per_sender.get(t.src, 0.0) + cluster.latency(a, b) * 1e-6
                                     + t.nbytes * scale / (cluster.bandwidth(a, b) * 1e9))
        return max(per_sender.values(), default=0.0)
    if step.kind not in COLLECTIVES or step.group_size == 1:
        return 0.0
    group = [device_of(q) for q in step.mesh.group_of(process, step.mesh_dim)]
    bw, lat = ring_links(cluster, group)
    return collective_time(step.kind, step.group_size, step.buffer_bytes * scale, bw, lat)


def _nbytes(t) -> int:
    n = 1
    for d in t.shape:
        n *= d
    return n * dtypes.itemsize(t.dtype)
