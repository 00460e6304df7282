"""Unit prices of the cost model: what one op, one reshard step, one collective inside an
op and one overlapped (MeshSlice) op cost on a device and its links.

The formulas are :mod:`.formulas` (alpha-beta on a ring, the pipeline of K slices); the
figures are the resource graph's (device rates, link bandwidths and latencies, the
measured software costs of ``distgraph cluster calibrate``). The search, completion's
conflict resolution, MeshSlice's autotuner, the balanced split and the plan estimate
(:mod:`.estimate`) all price with these functions, so they agree.

**One ring model.** Every collective, whether a reshard step's, an op's own (the
vocab-parallel cross-entropy's over its class-split group) or a sliced pipeline's
(MeshSlice), is priced on the ring of the group it actually runs in, as :class:`Rings`
gives it: the ring's slowest hop sets the bandwidth and the latency, and a hop between
two machines shares the machines' network with the hops of the other groups of the same
mesh dims that cross between the same machines in the same direction at once (every
group of a mesh dim runs the step together), spread over the machines' network
interfaces: k hops over m NICs take k/m of a hop's bandwidth each when k > m (a DGX's
eight HCAs, one per GPU, carry eight groups' hops at full speed; one NIC carries them
in turn). Where fewer hops cross than there are NICs, a group with g members on each
machine stripes its hop over up to min(g, m / k) of them, as NCCL does: its channels
are rings in other orders, each crossing at another member and so through another
member's NIC (a data-parallel ring over 4 DGX nodes crosses at 8 GPUs, over 8 HCAs, at
8 x one HCA's bandwidth; its NVLink hops still bound it). A machine without NICs, whose
devices the file links across machines directly, has one network: its links stand for
the one machine link they share (the emulated clusters). Groups of CPUs inside one
machine are marked ``copied``: shared-memory transfers are the processes' own copies (a
sliced pipeline counts them as processor time). Groups of CPUs over several machines
carry their ``cuts``: MPI (the CPU runtime's) does not run the ring, and its all-reduce,
reduce-scatter and short all-gather put other bytes on the links between machines
(:func:`~.formulas.mpi_cut`), which scale the bytes on the ring's slowest hop
(:meth:`Ring.seconds`, every price of a collective's wire).

Example::

    rings = Rings(cluster, device_of=lambda p: p)
    t = reshard_step_time(step, process=0, rings=rings)
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from distgraph import dtypes
from distgraph.passes.cost.compute import gemm_seconds, gemm_shape
from distgraph.passes.cost.formulas import (Cuts, collective_time, link_rates, mpi_cuts,
                                             pipeline_time, tree_all_reduce_time)
from distgraph.plan.kinds import ALL_TO_ALLV, RING_ROUND, StepKind
from distgraph.registry import VIEWS, cast_cost_key, get_op, op_work, size

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
    The one price of an op, for the estimate and every search: a GEMM on a device with a
    GEMM curve by its shape (:func:`~distgraph.passes.cost.compute.gemm_seconds`) with
    its launch (the measured per-call cost of the op type where there is one); any other
    op at the device's measured cost of its type where it has one (per call + per unit
    of work), else the roofline with the device's launch cost (element-wise and
    normalisation ops: their bytes at the memory bandwidth). A launch and the work it
    starts add up on a CPU; an accelerator queues launches (:func:`with_launch`). On a
    CPU an op on 16-bit operands also pays their casts (:func:`widening_time`), and a
    cast between float32 and a 16-bit dtype is priced by its direction where the device
    has measured it."""
    costs = device.op_costs.get(op_type) if device.op_costs else None
    shape = gemm_shape(op_type, ins, outs, attrs) if device.gemm is not None else None
    mem_bw, overhead = device_rates(device)
    widening = widening_time(op_type, ins, outs, device)
    if shape is not None:
        launch = costs[0] * 1e-6 if costs is not None else overhead
        return widening + with_launch(device, launch, gemm_seconds(
            *shape, dtypes.itemsize(outs[0].dtype), _rate(device, compute_dtype(
                op_type, ins, outs)),
            device.gemm, mem_bw))
    if op_type == "cast" and device.op_costs and \
            cast_cost_key(ins[0].dtype, outs[0].dtype) in device.op_costs:
        launch = costs[0] * 1e-6 if costs is not None else overhead
        return with_launch(device, launch, cast_time(ins[0].dtype, outs[0].dtype,
                                                     size(outs[0]), device))
    if costs is not None:
        return widening + costs[0] * 1e-6 + costs[1] * 1e-9 * op_work(op_type, ins, outs,
                                                                       attrs)
    return widening + roofline_time(op_type, ins, outs, attrs, device)


def widening_time(op_type: str, ins, outs, device) -> float:
    """Seconds a CPU spends on an op's 16-bit operands and results beyond its float32
    kernel: numpy has no 16-bit kernels, so the executor
    (``distgraph.runtime.execution.executor.call_kernel``) widens each 16-bit operand
    to float32 and rounds each 16-bit result back, unless the op takes them as they are
    (``takes_16bit``). A GPU computes in 16 bits (as the published runs did): 0 there.
    Measured on this 2-core machine (one process): bfloat16's casts cost 0.07-0.2 ns
    per element to widen and 0.4-0.55 to round, against 0.09-0.2 for a float32 add; a
    GPT's amp step (8 blocks of 128) widened 28 M elements and rounded 15 M in 328 ops,
    and ran 1.17 x its float32 step."""
    if device.type != "CPU" or get_op(op_type).takes_16bit:
        return 0.0
    return sum(cast_time(t.dtype, "float32", size(t), device)
               for t in ins if t.dtype in dtypes.HALF_DTYPES) + \
        sum(cast_time("float32", t.dtype, size(t), device)
            for t in outs if t.dtype in dtypes.HALF_DTYPES)


def cast_time(src: str, dst: str, elements: int, device) -> float:
    """Seconds to cast an array of ``elements`` from ``src`` to ``dst`` inside an op:
    the device's measured cost of that direction where it has one
    (:func:`~distgraph.registry.cast_cost_key`), else its bytes read and written at the
    memory bandwidth."""
    costs = device.op_costs.get(cast_cost_key(src, dst)) if device.op_costs else None
    if costs is not None:
        return costs[0] * 1e-6 + costs[1] * 1e-9 * elements
    return elements * (dtypes.itemsize(src) + dtypes.itemsize(dst)) / device_rates(device)[0]


def compute_dtype(op_type: str, ins, outs) -> str:
    """The dtype an op computes in, whose rate prices its FLOPs: its results', a
    matmul's its operands' (its ``out_dtype`` only widens what it writes)."""
    if op_type == "matmul" or not outs:
        return ins[0].dtype if ins else "float32"
    return outs[0].dtype


def _rate(device, dtype: str) -> float:
    """FLOP/s of ``device`` for ``dtype``: its figure for the dtype, else float32's, else
    its fastest."""
    return device.flops(dtype) or device.flops("float32") or max(device.gflops.values()) * 1e9


def roofline_time(op_type: str, ins, outs, attrs: dict, device) -> float:
    """Seconds for one op from the device's GFLOP/s, memory bandwidth and launch cost
    alone (what :func:`op_time` falls back to without a measured cost of the op type); a
    view (:data:`~distgraph.registry.VIEWS`) moves nothing and costs its launch."""
    if op_type in VIEWS:
        return device_rates(device)[1]
    flops = get_op(op_type).flops(ins, outs, **attrs)
    touched = sum(_nbytes(t) for t in ins) + sum(_nbytes(t) for t in outs)
    rate = _rate(device, compute_dtype(op_type, ins, outs))
    mem_bw, overhead = device_rates(device)
    return with_launch(device, overhead, max(flops / rate, touched / mem_bw))


def with_launch(device, launch: float, work: float) -> float:
    """Seconds of an op whose launch costs ``launch`` and whose work on the device
    ``work``. A CPU runs one after the other. An accelerator (a GPU) queues its work: the
    host launches the next op while the device runs this one, so an op costs the longer
    of the two. Measured on an H200 (CuPy, bench/gpu_profile.py), calibrated: GPT-2
    small's step predicted at 0.93 x the measured 241 ms (1.04 x with the sum), 24 layers
    of 1,024 at 0.99 x 320 ms (1.13 x), seq 256 at 1.02 x 54 ms (1.25 x)."""
    return launch + work if device.type == "CPU" else max(launch, work)


def feed_time(nbytes: int, device) -> float:
    """Seconds to copy ``nbytes`` of a feed into a process (its memory bandwidth)."""
    return nbytes / device_rates(device)[0]


class Ring(NamedTuple):
    """A group's ring as its collectives see it (module docstring): ``bandwidth`` GB/s
    and ``latency`` µs of its slowest hop (inf and 0 for a group on one device),
    ``copied``: CPUs inside one machine, whose transfers the processes copy themselves,
    and ``cuts``: CPUs over several machines, whose MPI collectives put other bytes than
    the ring on the links between them (:func:`~.formulas.mpi_cuts`; None: the ring's);
    ``tree``: GPUs over several machines, whose all-reduces NCCL runs on the ring or on
    its tree, the faster (:func:`~.formulas.tree_all_reduce_time`)."""

    bandwidth: float
    latency: float
    copied: bool
    cuts: Cuts | None = None
    tree: bool = False

    def seconds(self, kind, n: int, nbytes: float) -> float:
        """The alpha-beta seconds of a collective of ``kind`` over the ``n`` members on a
        buffer of ``nbytes`` (:func:`~.formulas.collective_time`), its bytes on the
        slowest hop as the runtime's library sends them (``cuts``)."""
        bandwidth = self.bandwidth
        if self.cuts is not None:
            bandwidth /= self.cuts.ratio(kind, nbytes)
        ring = collective_time(kind, n, nbytes, bandwidth, self.latency)
        if self.tree and StepKind.parse(kind) is StepKind.ALL_REDUCE:
            return min(ring, tree_all_reduce_time(n, nbytes, bandwidth, self.latency))
        return ring


def groups_along(mesh, dims) -> list:
    """The process groups of ``mesh`` along mesh dims ``dims`` (a name or a tuple of
    names), each ordered row-major over ``dims`` as given: ``mesh.groups(dim)`` for one
    dim, the blocks of a tensor dim split over several."""
    dims = (dims,) if isinstance(dims, str) else tuple(dims)
    axes = [mesh.dim_index(d) for d in dims]
    others = [k for k in range(mesh.ndim) if k not in axes]
    size = 1
    for k in axes:
        size *= mesh.shape[k]
    grid = np.transpose(np.asarray(mesh.mesh), others + axes).reshape(-1, size)
    return [tuple(int(p) for p in row) for row in grid]


def dims_of_group(mesh, group) -> tuple:
    """The mesh dims along which the processes of ``group`` differ, in mesh order."""
    coords = [mesh.coord(q) for q in group]
    return tuple(d for k, d in enumerate(mesh.dim_names)
                 if len({c[k] for c in coords}) > 1)


class Rings:
    """The rings of process groups on ``cluster`` with process p on device
    ``device_of(p)``: the one ring model of the cost model (module docstring), memoised
    for one pricing (an estimate, a search, a completion), never shared between them.

    Example::

        rings = Rings(cluster, lambda p: p)
        rings.along(mesh, 0, "x")          # process 0's ring along mesh dim x
        rings.of_group(mesh, (0, 2))       # a group an op's kernel names
    """

    def __init__(self, cluster, device_of):
        self.cluster = cluster
        self.device_of = device_of
        self._nics = {m.id: max(1, len(m.nics)) for m in cluster.machines}
        self._machines: dict = {}
        self._groups: dict = {}
        self._sharings: dict = {}
        self._rings: dict = {}

    def device(self, process: int):
        """The Device process ``process`` runs on."""
        return self.cluster.device(self.device_of(process))

    def along(self, mesh, process: int, dims) -> Ring:
        """The ring of ``process``'s group along ``dims`` (a mesh dim or a tuple of
        them) while every group along them runs the same collective."""
        dims = (dims,) if isinstance(dims, str) else tuple(dims)
        return self._ring(mesh, dims, self._group_of(mesh, dims)[process])

    def of_group(self, mesh, group) -> Ring:
        """The ring of ``group`` (processes of ``mesh``, in ring order): a group along
        the mesh dims its processes span, all of which run at once; any other set of
        processes runs alone."""
        group = tuple(group)
        dims = dims_of_group(mesh, group)
        if set(self._group_of(mesh, dims)[group[0]]) != set(group):
            return self._ring(mesh, None, group)
        return self._ring(mesh, dims, group)

    def of_op(self, mesh, process: int, context) -> Ring:
        """The ring an op's own collectives run on at ``process``: the group its kernel
        context names (``group``: e.g. the class-split group of the vocab-parallel
        cross-entropy), else the op's whole mesh."""
        group = (context or {}).get("group")
        return self.of_group(mesh, tuple(group) if group else tuple(mesh.process_ids))

    def _group_of(self, mesh, dims: tuple) -> dict:
        """{process: its group along ``dims``} (:func:`groups_along`)."""
        key = (mesh, dims)
        if key not in self._groups:
            self._groups[key] = {q: g for g in groups_along(mesh, dims) for q in g}
        return self._groups[key]

    def _machine(self, device: int) -> int:
        if device not in self._machines:
            self._machines[device] = self.cluster.device(device).machine_id
        return self._machines[device]

    def _sharing(self, mesh, dims) -> dict:
        """{(machine, machine): what divides a hop's bandwidth between them}: k / m where
        the k hops of the groups along ``dims`` that cross from the first to the second
        at once share m network interfaces (those of the machine with fewer, at least
        1), and where k < m, 1 / min(g, m / k) for groups of g members on each side
        striped over the interfaces (module docstring); none for a group that runs
        alone."""
        if dims is None:
            return {}
        key = (mesh, dims)
        if key not in self._sharings:
            crossing: dict = {}     # (a, b) -> [hops at once, fewest members of a group]
            for group in set(self._group_of(mesh, dims).values()):
                ring = [self._machine(self.device_of(q)) for q in group]
                members = {m: ring.count(m) for m in set(ring)}
                for a, b in zip(ring, ring[1:] + ring[:1]):
                    if a != b:
                        hops = crossing.setdefault((a, b), [0, len(ring)])
                        hops[0] += 1
                        hops[1] = min(hops[1], members[a], members[b])
            self._sharings[key] = {
                (a, b): 1.0 / min(g, min(self._nics[a], self._nics[b]) / k)
                for (a, b), (k, g) in crossing.items()}
        return self._sharings[key]

    def _ring(self, mesh, dims, group: tuple) -> Ring:
        key = (mesh, dims, group)
        if key not in self._rings:
            sharing = self._sharing(mesh, dims)
            devices = [self.device_of(q) for q in group]
            hops = [(a, b) for a, b in zip(devices, devices[1:] + devices[:1]) if a != b]
            cluster = self.cluster
            bw, lat = float("inf"), 0.0
            if hops:
                # every hop's figures in one look-up; min and max are exact in any order
                bws, lats = cluster.pairs([a for a, _ in hops], [b for _, b in hops])
                if sharing:
                    bws = bws / np.array([sharing.get((self._machine(a), self._machine(b)),
                                                      1.0) for a, b in hops])
                bw, lat = float(bws.min()), float(lats.max())
            cpu = all(cluster.device(d).type == "CPU" for d in devices)
            machines = tuple(self._machine(d) for d in devices)
            one = len(set(machines)) == 1
            self._rings[key] = Ring(bw, lat, cpu and one, mpi_cuts(machines) if cpu else None,
                                    not cpu and not one)
        return self._rings[key]


def reshard_step_time(step, process: int, rings: Rings, scale: float = 1.0) -> float:
    """Seconds that reshard ``step`` costs ``process`` (0 where it takes no part): the
    alpha-beta of its messages (their bytes times ``scale``; a collective on the ring of
    the process's group, :class:`Rings`) plus the software cost of a step of its kind
    and buffer on the process's device (:func:`software_time`; a collective over one
    process costs what a local step does)."""
    return _step_time(step, process, rings, scale, None)


def steps_time(steps, processes, rings: Rings, scale: float = 1.0) -> list:
    """Seconds each of ``processes`` spends on reshard ``steps``, one after another:
    ``[sum(reshard_step_time(s, p, rings, scale) for s in steps) for p in processes]``,
    the same floats, with each send_recv step's messages (the busiest sender's, whoever
    asks) priced once instead of once per process."""
    total = [0.0] * len(processes)
    for step in steps:
        message = None
        for k, p in enumerate(processes):
            if step.kind is StepKind.SEND_RECV and message is None and _involved(step, p):
                message = _message_time(step, p, rings, scale)
            total[k] += _step_time(step, p, rings, scale, message)
    return total


def _involved(step, process: int) -> bool:
    return process in step.mesh or (step.dst_mesh is not None and process in step.dst_mesh)


def _step_time(step, process: int, rings: Rings, scale: float, message) -> float:
    """:func:`reshard_step_time`, a send_recv's messages given (``message``) or priced."""
    if not _involved(step, process):
        return 0.0
    if step.kind is StepKind.SEND_RECV:
        if message is None:
            message = _message_time(step, process, rings, scale)
        return message + software_time(
            rings.device(process), step.kind, step.buffer_bytes * scale, step.group_size)
    n = step.group_size
    ring = rings.along(step.mesh, process, step.mesh_dim) \
        if step.kind.is_collective and n > 1 else None
    return mesh_step_time(step.kind, n, step.buffer_bytes * scale, ring, rings.device(process))


def mesh_step_time(kind: StepKind, n: int, nbytes: float, ring, device) -> float:
    """Seconds a reshard step on one mesh (a collective over a group of ``n`` along a mesh
    dim, or a local step) on a buffer of ``nbytes`` costs a process on ``device`` whose
    group's ring is ``ring`` (:meth:`Rings.along`; unused, may be None, for a local step
    or a group of one): :func:`reshard_step_time` of such a step, from its figures alone.
    """
    if kind.is_collective and n > 1:
        return ring.seconds(kind, n, nbytes) + software_time(device, kind, nbytes, n)
    # over one process a collective meets no one: the runtime runs it as a local step
    return software_time(device, StepKind.SLICE if kind.is_collective else kind, nbytes, n)


def slowest_reshard_step_time(step, rings: Rings) -> float:
    """Seconds reshard ``step`` takes as a whole: its slowest group's (a collective:
    the first process of each group) or its slowest sender's (send_recv)."""
    if step.kind.is_collective and step.group_size > 1:
        who = [group[0] for group in step.mesh.groups(step.mesh_dim)]
    elif step.kind is StepKind.SEND_RECV:
        who = sorted({t.src for t in step.transfers if t.src != t.dst}) or \
            step.mesh.process_ids[:1]
        # its messages take the busiest sender's time whoever asks: priced once
        message = _message_time(step, who[0], rings)
        return max(message + software_time(rings.device(p), step.kind, step.buffer_bytes,
                                           step.group_size) for p in who)
    else:
        who = step.mesh.process_ids[:1]
    return max(reshard_step_time(step, p, rings) for p in who)


def software_time(device, kind: str, nbytes: float = 0.0, n: int = 2) -> float:
    """Seconds of software a communication step of ``kind`` over ``n`` processes on a
    buffer of ``nbytes`` (the cost formula's B) costs on ``device`` beyond its messages:
    ``µs per step + µs per further round x (rounds - 1) + ns per byte x nbytes`` of
    ``Device.reshard_overhead`` (0 where not measured), what ``distgraph cluster
    calibrate`` measured through the runtime between ops: its calls, its copies (a
    gather's concatenation, a reduce-scatter's packing) and the wait for the group to
    meet. The µs per step are a step's over two processes; a collective over ``n`` has
    n - 1 rounds (``software_rounds``), each a wait for a neighbour to reach it, and pays
    each further one the ``ring_round`` entry's µs (calibrated on groups of 2 and of
    every rank: with more ranks than cores, 4 ranks on 2 cores, a 2-rank group's step
    costs most of a 4-rank one's, since the wait for a descheduled peer is most of
    either), or, in a file without it, the step's µs again. Local steps pay them once.

    >>> from distgraph.resources.elements import Device
    >>> d = Device(0, 0, 0, "CPU", reshard_overhead={"all_gather": (30.0, 0.5)})
    >>> round(software_time(d, "all_gather", 1e6) * 1e6, 3)     # 30 µs + 0.5 ns x 1e6 B
    530.0
    >>> round(software_time(d, "all_gather", 1e6, n=4) * 1e6, 3)   # 3 rounds of 30 µs
    590.0
    >>> d = Device(0, 0, 0, "CPU", reshard_overhead={"all_gather": (30.0, 0.5),
    ...                                               "ring_round": 10.0})
    >>> round(software_time(d, "all_gather", 1e6, n=4) * 1e6, 3)   # 30 + 2 x 10 µs
    550.0
    """
    software = device.reshard_overhead
    if kind == ALL_TO_ALLV and software and kind not in software:
        kind = StepKind.ALL_TO_ALL         # a file calibrated before the variable one was
    if not software or kind not in software:
        return 0.0
    per_step, per_byte = software[kind]
    further = software_rounds(kind, n) - 1
    per_round = software[RING_ROUND][0] if RING_ROUND in software else per_step
    return (per_step + per_round * further) * 1e-6 + per_byte * 1e-9 * nbytes


def software_rounds(kind: str, n: int) -> int:
    """How many rounds of a step of ``kind`` over ``n`` processes wait for a peer
    (:func:`software_time`): a collective's ring has n - 1 (at least 1); any other step
    one."""
    return max(n - 1, 1) if StepKind.parse(kind).is_collective else 1


def sliced_software_time(device, kind: str, nbytes: float = 0.0, n: int = 2) -> float:
    """Seconds of software one collective of ``kind`` on ``nbytes`` costs inside a sliced
    pipeline (:class:`~distgraph.registry.Overlap`): per step, the device's measured
    ``sliced`` figure (each more slice of MeshSlice's kernel, ``distgraph cluster
    calibrate``) where it has one, and per byte what a reshard step of that kind costs
    (:func:`software_time`; over ``n`` processes, without a ``sliced`` figure)."""
    software = device.reshard_overhead
    if not software or "sliced" not in software:
        return software_time(device, kind, nbytes, n)
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


def op_collective_time(kind: str, n: int, nbytes: float, ring: Ring, device) -> float:
    """Seconds of a collective an op runs itself over ``n`` processes on ``ring``
    (:meth:`Rings.of_op`): its alpha-beta plus the software cost a reshard step of that
    kind and buffer pays on ``device``."""
    if n == 1:
        return 0.0
    return ring.seconds(kind, n, nbytes) + software_time(device, kind, nbytes, n)


def op_comm_time(collectives, ring: Ring, device, scale: float = 1.0) -> float:
    """Seconds of an op's own ``((kind, n, nbytes), ...)`` (their bytes times
    ``scale``) run one after another on ``ring`` (:meth:`Rings.of_op`)."""
    return sum(op_collective_time(kind, n, nbytes * scale, ring, device)
               for kind, n, nbytes in collectives)


def overlap_time(ov, device, ring_of, compute_time=None) -> tuple[float, float]:
    """(compute, exposed communication) seconds of an op that runs as ``ov`` (an
    :class:`~distgraph.registry.Overlap`) on ``device``; ``ring_of(mesh dim)`` gives that
    dim's :class:`Ring` (:meth:`Rings.along`); ``compute_time`` prices one slice's
    compute (default :func:`op_time`)."""
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
            ring = ring_of(dim)
            t = ring.seconds(kind, n, nbytes)
            processor += sliced_software_time(device, kind, nbytes, n) + (t if ring.copied else 0.0)
            if not ring.copied:
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
            total += (ring_of(dim).seconds(kind, n, nbytes)
                      + sliced_software_time(device, kind, nbytes, n))
    return ov.slices * total


def best_overlap(overlaps, device, ring_of, compute_time=None) -> tuple:
    """(Overlap, compute, exposed) of the fastest of ``overlaps`` (fewer slices on ties)."""
    priced = [(sum(overlap_time(ov, device, ring_of, compute_time)), ov.slices, ov)
              for ov in overlaps]
    _, _, ov = min(priced, key=lambda t: t[:2])
    return (ov,) + overlap_time(ov, device, ring_of, compute_time)


def send_recv_time(step, cluster, device_of, scale: float = 1.0) -> float:
    """Seconds of a send_recv ``step``'s messages with process p on device
    ``device_of(p)``: the busiest sender's sum, over the tiles it sends to another
    process, of alpha + beta x bytes (times ``scale``) of the best path between the two
    devices (:func:`~.formulas.link_rates`; a local tile is free). The pairs' figures are
    looked up at once (:meth:`Cluster.pairs`); each sender's sum adds its tiles in
    transfer order, alpha then bytes, as a loop over the tiles would."""
    remote = [t for t in step.transfers if t.src != t.dst]
    if not remote:
        return 0.0
    bandwidth, latency = cluster.pairs([device_of(t.src) for t in remote],
                                       [device_of(t.dst) for t in remote])
    alphas, betas = link_rates(bandwidth, latency)
    per_sender: dict = {}
    for t, alpha, beta in zip(remote, alphas.tolist(), betas.tolist()):
        per_sender[t.src] = per_sender.get(t.src, 0.0) + alpha + beta * t.nbytes * scale
    return max(per_sender.values())


def _message_time(step, process: int, rings: Rings, scale: float = 1.0) -> float:
    if step.kind is StepKind.SEND_RECV:
        return send_recv_time(step, rings.cluster, rings.device_of, scale)
    if not step.kind.is_collective or step.group_size == 1:
        return 0.0
    ring = rings.along(step.mesh, process, step.mesh_dim)
    return ring.seconds(step.kind, step.group_size, step.buffer_bytes * scale)


def _nbytes(t) -> int:
    n = 1
    for d in t.shape:
        n *= d
    return n * dtypes.itemsize(t.dtype)
