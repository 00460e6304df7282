"""Cost model estimate of a Plan on a Cluster: step time split into compute,
communication and bubble, and peak memory per process.

- **Compute**: each op of a process's local program takes
  ``op_overhead + max(FLOPs / GFLOP/s of its dtype, bytes touched / memory bandwidth)``
  on the process's device: a roofline plus the cost of launching an op (framework
  dispatch and kernel launch), which dominates small tensors; and each process copies
  in its part of the feeds (bytes / memory bandwidth).
- **Communication**: every reshard step and every collective inside an op, with the
  alpha-beta formulas of :mod:`distgraph.passes.cost.formulas` plus the device's measured
  software cost of a step of that kind, per step and per byte of its buffer
  (``reshard_overhead``: the runtime's calls, copies and meeting), on the ring of the
  group it runs in (:class:`~distgraph.passes.cost.prices.Rings`: the ring's bottleneck
  bandwidth, shared between machines with the other groups of its mesh dims, and its
  largest hop latency; an op's own collectives on the group its kernel names, e.g. the
  class-split group of the vocab-parallel cross-entropy); a p2p step takes as long as its
  busiest sender's messages, each ``α + B/β`` of its pair.
- **Overlapped ops** (an op's ``overlap`` hook: MeshSlice) take
  :func:`~distgraph.passes.cost.formulas.pipeline_time` over K slices of three stages: the
  incoming collectives on the links of their mesh dims (collectives on different mesh
  dims at once), the processor (the slice's compute, with what every slice reads again
  — the operand it does not cut, or the result it accumulates into — at the device's
  measured ``sliced`` rate per byte, else its memory bandwidth; and each collective's
  software cost: the measured ``sliced`` figure per step where there is one), the
  outgoing collectives. Their compute counts as compute, the rest of their time (what
  the pipeline does not hide) as communication. On CPUs a collective
  inside one machine is memory copies the processes make themselves: it takes the
  processor's stage, not a link's.
- **Overlap** (``Strategy(overlap=True)``): the gradients' reductions the runtime
  starts in buckets during the backward pay their software where they start and what
  the ops after the backward (the update, in the order the backward made its
  gradients) wait for of their wires, once a step
  (:mod:`~distgraph.passes.cost.overlap`, the accountant's
  :func:`~distgraph.passes.cost.exposed.finishes`); under ZeRO-3 each parameter gather
  started a layer ahead pays its software's copies and what its reader still waits for
  of it after the layer before computed.
- **Step**: processes meet at every collective, so a stage takes as long as its busiest
  process. Without micro-batches the stages run one after another, ``T = Σ t_s``. With M
  micro-batches, the accountant's :func:`~distgraph.passes.cost.stage.step_time` of the
  stages' forward + backward seconds per micro-batch and their seconds once a step (the
  update, the values made once; a micro-batched plan's local programs are one
  micro-batch's). The bottleneck process's compute and communication are reported, and
  ``bubble`` is its idle time.
- **Uneven splits.** With a balanced batch split (``Plan.batch_split``,
  ``Strategy(balance=True)``) each process is priced on its share: without micro-batches
  every dim that carries the samples (:mod:`distgraph.passes.samples`) and is split over
  the split's mesh dims takes the process's rows instead of the even share (its ops,
  feeds, activations, and the reshards of such values along other mesh dims scale; a
  collective along the split dims moves the same total and keeps its price); with
  micro-batches a process runs its own number of them, ``c_p``, and the step is
  ``T = Σ u_s + max_s (c_s - 1) u_s + max update_s`` over each stage's busiest process.
  So a data-parallel group of mixed devices is priced at each device's share, not at the
  slowest device's even share.
- **Memory** per process: parameters, optimizer states, and the transient values
  (gradients, activations) live at the peak of the executor's free-after-last-use order,
  with what a kernel keeps for its gradient beyond any Value (an op's ``saved`` hook:
  ``moe_ffn``'s routes, rows and expert activations at the expected load) live from the
  op to its gradient, and, while an op runs, its kernel's temporaries (its
  ``workspace`` hook, measured against the allocator by tests/test_workspace.py).
  Under a pipeline schedule a stage holds the micro-batches in flight (M for FThenB,
  S - s for 1F1B on stage s): one at its peak, each other one with the activations it
  keeps from its forward to its backward (``saved_activations``: what is live when the
  backward starts, before the gradient from the next stage arrives), read off the
  plan's schedule where it has one (:func:`~distgraph.passes.cost.stage.held_by_action`:
  per chunk, and under ZB / ZBV what the deferred weight gradients read from each I to
  its W; interleaved 1F1B by ``in_flight``'s chunks, as the stage search prices it),
  the running micro-batch's items walked in the order the runtime runs its tasks
  (:func:`~distgraph.passes.cost.held.run_order`: a chunk's W after its whole I, so
  what W reads lives through I);
  with micro-batches the gradients of the parameters are
  accumulated in buffers that live through the step (a micro-batch's gradient is added
  to its buffer as it is made, as the runtime does, and not held to the update), each
  made by the first backward that makes its gradient
  (:func:`~distgraph.passes.cost.stage.buffers_by_action`: FThenB peaks in its first
  backward, before most are made) where a process runs one chunk, as the stage search
  prices it (:func:`~distgraph.passes.cost.stage.held`); with several (virtual stages,
  ZBV) all from the start, as the search prices in_flight's chunks.
- **Alike processes are estimated once.** Processes on the same meshes whose devices
  are alike and whose groups along every set of mesh dims have the same rings run the
  same local program at the same speed: the first of them is partitioned
  and estimated, the others take its figures. A 1,024-process plan of 16 stages is
  estimated from a few processes.

Devices that do not give ``memory_bandwidth`` or ``op_overhead`` in the resource file get
the defaults of :data:`DEFAULTS` for their type; ``distgraph cluster calibrate`` measures
both.

Example::

    est = dg.passes.estimate(plan, cluster)
    print(est)                # step, compute / communication / bubble, memory per group
    est.per_process()         # ... per process
    est.step_time, est.processes[0].peak_memory
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from itertools import combinations

from distgraph.errors import PlanError
from distgraph.ir import Role
from distgraph.plan.accumulation import made_once
from distgraph.plan.kinds import TaskKind
from distgraph.passes.cost.held import action_holds, kernels_keep, run_order
from distgraph.passes.cost.overlap import bucket_seconds, prefetch_seconds, prefetched_order
from distgraph.passes.cost.stage import (buffers_by_action, held_by_action, in_flight,
                                         step_time)
from distgraph.passes.cost.prices import (Rings, best_overlap, feed_time, op_comm_time, op_time,
                                          reshard_step_time)
from distgraph.passes.cost.by_task import TaskSpent
from distgraph.passes.cost.shares import Scale, Share, share_of
from distgraph.registry import comm_workspace, get_op, op_workspace
from distgraph.resources.cluster import Cluster
from distgraph.units import fmt_bytes, fmt_ids


WORKSPACE = " workspace"     # the running kernel's, among the names live at a peak


@dataclass(frozen=True)
class ProcessEstimate:
    """One process: its device, seconds of compute and communication per step, and
    bytes at its memory peak (``peak_memory`` = parameters + states + gradients +
    activations live then + the running kernel's ``workspace``); of the ``gradients``,
    ``gradient_buffers`` bytes are the step's accumulation buffers (with micro-batches:
    one per parameter gradient, in that gradient's dtype, ``buffer_dtypes``; the rest
    are the running micro-batch's own gradients, of parameters and activations, live
    then); ``tasks``: those seconds by the task that spends them
    (:class:`~distgraph.passes.cost.by_task.TaskSeconds`; none without a task graph)."""

    process: int
    device: int
    stage: int
    compute: float
    communication: float
    parameters: int
    states: int
    gradients: int
    activations: int
    saved_activations: int = 0
    workspace: int = 0
    gradient_buffers: int = 0
    buffer_dtypes: tuple = ()
    tasks: tuple = ()

    @property
    def busy(self) -> float:
        return self.compute + self.communication

    @property
    def peak_memory(self) -> int:
        return (self.parameters + self.states + self.gradients + self.activations +
                self.workspace)


@dataclass(frozen=True)
class Estimate:
    """A plan's predicted step: ``step_time`` = ``compute`` + ``communication`` +
    ``bubble`` of the bottleneck process (seconds), and every process's figures."""

    step_time: float
    compute: float
    communication: float
    bubble: float
    processes: tuple

    @property
    def peak_memory(self) -> int:
        return max(p.peak_memory for p in self.processes)

    def to_dict(self) -> dict:
        return {"step_time": self.step_time, "compute": self.compute,
                "communication": self.communication, "bubble": self.bubble,
                "peak_memory": self.peak_memory,
                "processes": [dict(asdict(p), peak_memory=p.peak_memory)
                              for p in self.processes]}

    def groups(self) -> list:
        """The processes in groups of equal figures (stage, compute, communication and
        memory; alike processes are estimated once, so theirs are equal), each a list of
        ProcessEstimates, in the order of their first process."""
        groups: dict = {}
        for p in self.processes:
            key = (p.stage, p.compute, p.communication, p.parameters, p.states, p.gradients,
                   p.activations, p.workspace)
            groups.setdefault(key, []).append(p)
        return list(groups.values())

    def __str__(self) -> str:
        """The step, then one line per group of processes with equal figures
        (:meth:`groups`); :meth:`per_process` has a line per process."""
        lines = [self._head()]
        for group in self.groups():
            p = group[0]
            who = (f"processes {fmt_ids(q.process for q in group)} (devices "
                   f"{fmt_ids(q.device for q in group)}" if len(group) > 1 else
                   f"process {p.process} (device {p.device}")
            lines.append(f"  {who}, stage {p.stage}): compute {p.compute * 1e3:.3f} ms, "
                         f"communication {p.communication * 1e3:.3f} ms")
            lines.append(f"    {_memory(p)}")
        return "\n".join(lines)

    def per_process(self) -> str:
        """The step, then every process's figures on a line of its own."""
        lines = [self._head()]
        for p in self.processes:
            lines.append(f"  process {p.process} (device {p.device}, stage {p.stage}): "
                         f"{_figures(p)}")
        return "\n".join(lines)

    def _head(self) -> str:
        return (f"step {self.step_time * 1e3:.3f} ms = compute {self.compute * 1e3:.3f} + "
                f"communication {self.communication * 1e3:.3f} + bubble "
                f"{self.bubble * 1e3:.3f} ms")


def _figures(p: ProcessEstimate) -> str:
    return (f"compute {p.compute * 1e3:.3f} ms, communication {p.communication * 1e3:.3f} ms, "
            f"{_memory(p)}")


def _memory(p: ProcessEstimate) -> str:
    buffers = (f" ({fmt_bytes(p.gradient_buffers)} of them {'/'.join(p.buffer_dtypes)} "
               f"accumulation buffers)" if p.gradient_buffers else "")
    return (f"peak {fmt_bytes(p.peak_memory)} (parameters {fmt_bytes(p.parameters)}, states "
            f"{fmt_bytes(p.states)}, gradients {fmt_bytes(p.gradients)}{buffers}, activations "
            f"{fmt_bytes(p.activations)}, workspace {fmt_bytes(p.workspace)})")


def estimate(plan, cluster=None) -> Estimate:
    """The plan's predicted step time and memory on ``cluster`` (default: the plan's own
    cluster, else ``Cluster.local`` of its size). See the module docstring."""
    cluster = cluster or plan.cluster or Cluster.local(plan.world_size)
    devices = _devices(plan, cluster)
    rings = Rings(cluster, lambda q: devices[plan.ranks(q)].global_id)
    alike = _alike(plan, rings)
    per_process, update_time, counts, done = [], {}, {}, {}
    for pid in plan.process_ids:
        share = share_of(plan, pid)
        key = (alike[pid], share)
        if key not in done:
            done[key] = price_process(plan, pid, cluster, share, rings)
        p, update_time[pid] = done[key]
        per_process.append(replace(p, process=pid,
                                   device=devices[plan.ranks(pid)].global_id))
        counts[pid] = share.micro_batches or plan.micro_batches
    return _combine(plan, per_process, update_time, counts)


def _devices(plan, cluster) -> tuple:
    """The cluster's devices, rank r's at index r: as many as the plan has processes."""
    if len(cluster.devices) < plan.world_size:
        raise PlanError(f"the plan has {plan.world_size} processes but the cluster has "
                        f"{len(cluster.devices)} devices")
    return cluster.devices


def price_process(plan, pid: int, cluster, share: Share = Share(), rings=None) -> tuple:
    """(ProcessEstimate, seconds of its update ops) of process ``pid`` on ``cluster``
    with ``share`` of the batch (see the module docstring); ``rings``: the
    :class:`~distgraph.passes.cost.prices.Rings` of the plan's processes on ``cluster``
    (made here when not given)."""
    if rings is None:
        devices = _devices(plan, cluster)
        rings = Rings(cluster, lambda q: devices[plan.ranks(q)].global_id)
    stage = next((s for s, mesh in enumerate(plan.stages) if pid in mesh.process_ids), 0)
    fetch = [plan.built.loss_name] if plan.built.loss_name else []
    device = rings.device(pid)
    scale = Scale(plan, share, pid)
    once = made_once(plan.program) if plan.accumulation is not None else frozenset()
    compute, comm, updates, tasks = _process_times(plan, pid, device, rings, fetch, scale,
                                                   once)
    memory = _peak_memory(plan, pid, stage, scale, once, widened=device.type == "CPU")
    return ProcessEstimate(pid, device.global_id, stage, compute, comm, *memory,
                           tasks=tasks), updates


def _alike(plan, rings: Rings) -> dict:
    """{process: a key equal for processes that run alike} (module docstring): the
    meshes they are on, their device's figures, and the rings of their group along every
    set of mesh dims (each dim, each pair, ..., the whole mesh)."""
    meshes = {op.dist_attr.mesh for op in plan.program.ops}
    meshes |= {v.dist_attr.mesh for v in plan.program.values.values()}
    meshes = sorted(meshes, key=lambda m: (m.process_ids, m.shape, m.dim_names))
    dim_sets = {mesh: [dims for k in range(1, mesh.ndim + 1)
                       for dims in combinations(mesh.dim_names, k)] for mesh in meshes}
    keys = {}
    for pid in plan.process_ids:
        key = [replace(rings.device(pid), global_id=0, local_id=0, machine_id=0)]
        for n, mesh in enumerate(meshes):
            if pid in mesh:
                key.append((n, tuple(rings.along(mesh, pid, dims) for dims in dim_sets[mesh])))
        keys[pid] = tuple(key)
    return keys


def _process_times(plan, pid, device, rings: Rings, fetch, scale: Scale, once=frozenset()):
    """(compute, communication, seconds of them once a step, seconds by task) of process
    ``pid`` a step: a micro-batched plan's local program is one micro-batch's, run M
    times, except its update and the values a step makes once (``once``), which run once
    with their reshards and collectives, and the fetched values' gathers (the update's
    task's end): what the accountant's step takes once (:func:`_combine`)."""
    local, tasks = plan.local_alike(pid), TaskSpent(plan, pid)
    m = scale.micro_batches

    def times(op) -> int:
        return 1 if op.role == Role.OPTIMIZE or (
            op.outputs and op.outputs[0].name in once) else m

    # each process copies in its part of every feed, once per micro-batch
    feeds = sum(feed_time(scale.nbytes(v), device) for v in local.program.inputs)
    compute = m * feeds
    tasks.add(tasks.first_forward, compute, 0.0)
    updates = comm = 0.0
    overlapped = set()
    op_seconds = {}
    for index, op in enumerate(local.program.ops):
        ins = [scale.tensor(v) for v in op.inputs]
        hook = get_op(op.type).overlap
        ways = hook(op.attrs, ins) if hook is not None else ()
        n = times(op)
        if ways:
            mesh = op.dist_attr.mesh
            _, work, hidden = best_overlap(ways, device,
                                           lambda dim: rings.along(mesh, pid, dim))
            compute += work * n
            comm += hidden * n
            updates += (work + hidden) * (n == 1)
            tasks.add(tasks.of_op(index), work * n, hidden * n)
            overlapped.add(index)
            continue
        t = op_seconds[index] = op_time(op.type, ins, [scale.tensor(v) for v in op.outputs],
                                        op.attrs, device)
        compute += t * n
        updates += t * (n == 1)
        tasks.add(tasks.of_op(index), t * n, 0.0)
    ops = plan.program.ops
    step_seconds = _StepTimes(pid, rings)
    # the ZeRO-3 gathers prefetched a layer ahead: the copies and the wait each pays
    prefetched, busy = prefetch_seconds(plan, local, pid, rings, scale, op_seconds)
    # the gradient buckets reduced during the backward: what stays exposed, once a step
    paid, _, bucketed = bucket_seconds(plan, local, pid, rings, scale, op_seconds, busy)
    comm += paid
    updates += paid
    tasks.add(tasks.update, 0.0, paid)
    for p in local.points():
        if p.seq in bucketed:
            continue
        n = times(ops[p.anchor])
        seconds = n * (prefetched[p.seq] if p.seq in prefetched else
                       sum(step_seconds(s, scale.of_step(p, s)) for s in p.steps))
        comm += seconds
        updates += seconds * (n == 1)
        tasks.add(tasks.of_point(p.seq), 0.0, seconds)
    if plan.distributed:
        seconds = sum(step_seconds(s, scale.of_step(p, s))
                      for p in _fetch_points(plan, fetch, pid) for s in p.steps)
        comm += seconds
        updates += seconds
        tasks.add(tasks.update, 0.0, seconds)
    ops = local.program.ops
    for index, collectives in local.op_comm.items():
        if index in overlapped:
            continue
        op = ops[index]
        ring = rings.of_op(op.dist_attr.mesh, pid, local.op_context.get(index))
        rows = scale.rows if any(scale.axis(v.name) is not None for v in op.inputs) else 1.0
        n = times(op)
        seconds = n * op_comm_time(collectives, ring, device, rows)
        comm += seconds
        updates += seconds * (n == 1)
        tasks.add(tasks.of_op(index), 0.0, seconds)
    return compute, comm, updates, tasks.seconds()


class _StepTimes:
    """``reshard_step_time(step, pid, rings, scale)`` of one process, kept per (step,
    scale): all else it reads is fixed here, and the layers of a stage reshard equal
    steps (equal by value: kind, meshes, specs, shape, dtype, tiles) layer after layer."""

    def __init__(self, pid: int, rings: Rings):
        self.pid, self.rings = pid, rings
        self.known: dict = {}

    def __call__(self, step, scale: float = 1.0) -> float:
        key = (step, scale)
        seconds = self.known.get(key)
        if seconds is None:
            seconds = self.known[key] = reshard_step_time(step, self.pid, self.rings, scale)
        return seconds


def _fetch_points(plan, fetch, pid) -> list:
    """The points that bring ``fetch`` to every process: the task graph's, or while the
    planner plans (no graph yet), its partitions'."""
    if plan.graph is None:
        return plan.locals.gather_points(fetch, pid)
    return [p for p in plan.graph.gathers[pid] if p.value in fetch]


def _peak_memory(plan, pid, stage, scale: Scale, once=frozenset(),
                 widened: bool = True) -> tuple:
    """(parameters, states, gradients, activations, saved activations, workspace, the
    gradients' accumulation buffers) bytes at the process's peak (module docstring), and
    the buffers' dtypes; ``once``: the Values the step makes once
    (:func:`~distgraph.plan.accumulation.made_once`), live from the step's start to its
    update and never among what a micro-batch in flight keeps; ``widened``: the device's
    backend computes 16-bit operands in float32 (:func:`~distgraph.registry.op_workspace`)."""
    local = plan.local_alike(pid)
    prog = local.program
    params = sum(v.nbytes for v in prog.persistables if v.is_parameter)
    states = sum(v.nbytes for v in prog.persistables if not v.is_parameter)
    roles = [op.role for op in plan.program.ops]
    items, item_roles = [], []        # a reshard point's role is the role of its consumer
    item_ops = []                     # the op an item runs before or is
    item_seqs = []                    # an item's reshard point (None: an op)
    spare = {}                        # an op's item: its kernel's workspace (bytes)
    kept, sizes = kernels_keep(local, scale)
    for i, op in enumerate(prog.ops + [None]):
        for point in local.comm_points.get(i, ()):
            items.append((point.reads, point.writes))
            item_roles.append(roles[point.anchor] if point.anchor >= 0 else None)
            item_ops.append(i)
            item_seqs.append(point.seq)
        if op is not None:
            reads, writes = kept.get(i, ((), ()))
            spare[len(items)] = op_workspace(op.type, [scale.tensor(v) for v in op.inputs],
                                             [scale.tensor(o) for o in op.outputs], op.attrs,
                                             widened) + \
                comm_workspace(local.op_comm.get(i, ()))
            items.append((tuple(v.name for v in op.inputs) + reads,
                          tuple(o.name for o in op.outputs if not o.alias_of) + writes))
            item_roles.append(op.role)
            item_ops.append(i)
            item_seqs.append(None)
    spare = [spare.get(k, 0) for k in range(len(items))]
    # a ZeRO-3 gather prefetched is held from where the runtime starts it
    moved = prefetched_order(plan, local, item_seqs)
    if moved is not None:
        items, item_roles, item_ops, spare = ([xs[k] for k in moved]
                                              for xs in (items, item_roles, item_ops, spare))
    # with a schedule: the micro-batch's peak in each of its actions (chunk, letter), to
    # which the others hold what the schedule has them hold then
    order = plan.order.of(pid) if plan.order is not None and plan.micro_batches > 1 else ()
    if order and plan.graph is not None:
        task_of, made, after_input = action_holds(plan, pid, local, scale.nbytes)
        # walked in the order the runtime runs them: a value a deferred weight gradient
        # (W) reads lives through the input gradient's (I) task, however the program
        # orders the two
        moved = run_order(order, [task_of.get(i) for i in item_ops], item_roles)
        items, item_roles, item_ops, spare = ([xs[k] for k in moved]
                                              for xs in (items, item_roles, item_ops, spare))
    else:       # interleaved 1F1B: in_flight's chunks, as the stage search prices them
        order, task_of = (), {}
    updating = [role == Role.OPTIMIZE for role in item_roles]
    # With micro-batches the runtime adds what a micro-batch makes for the update (its
    # gradients) to the step's buffers as it is made: the update reads the buffers
    # (counted below), so the micro-batch's own copy lives only to its last other use.
    accumulated = plan.micro_batches > 1
    made_before: set = set()
    last = {}
    for k, (reads, writes) in enumerate(items):
        for name in reads + writes:
            if not (accumulated and updating[k] and name in made_before):
                last[name] = k
        if not updating[k]:
            made_before.update(writes)
    # the Values made once are every micro-batch's, from the step's start to the update
    made_here = [v for v in prog.values.values() if v.name in once]
    if made_here:
        end = max((k for k, u in enumerate(updating) if not u), default=len(items) - 1)
        last.update((v.name, end) for v in made_here)
    keep = {v.name for v in prog.persistables}
    live = {v.name: scale.nbytes(v) for v in prog.inputs + made_here}
    peak, at_peak = sum(live.values()), dict(live)
    # the backward's first item: a stage's output is sent before it, the gradient from the
    # next stage received in it (neither is kept from the forward for the backward)
    first_backward = next((k for k, role in enumerate(item_roles) if role == Role.BACKWARD),
                          len(items))
    after_forward: dict = {}
    # with micro-batches a parameter's gradient buffer is made by the first run of the
    # task that makes its gradient (the runtime's Accumulator) and held to the update.
    # Counted so where a process runs one chunk, as the stage search prices a stage
    # (terms.held: where every forward runs first, the buffers from the backward that
    # makes them); with several (virtual stages, ZBV) the search prices in_flight's
    # chunks and every buffer from the start, and so does the estimate
    buffers = {g: prog.values[g].nbytes for g in plan.built.grad_names.values()
               if g in prog.values} if plan.micro_batches > 1 else {}
    lazy = len({a.chunk for a in order}) == 1
    by_task: dict = {}          # task: (most bytes over its items, live then)
    first_run: dict = {}        # task: (the same with the buffers its items made so far, live
    #                             then, those buffers' bytes): what its first run holds
    task_made: dict = {}        # task: bytes of the buffers its items make
    made_by: dict = {}          # the buffers made by the items so far: the task making it
    saved = 0
    for k, (reads, writes) in enumerate(items):
        if k == first_backward:
            saved = sum(b for n, b in live.items() if "@GRAD" not in n and n not in once)
            first = min(made.values())[0] if order and made else None
            for n, b in live.items():       # by the chunk that makes it (feeds: the first)
                if order and "@GRAD" not in n and n not in once:
                    chunk = made.get(n, (first,))[0]
                    after_forward[chunk] = after_forward.get(chunk, 0) + b
        for name in writes:
            if name in sizes:
                live[name] = sizes[name]
            elif name not in keep:
                live[name] = scale.nbytes(prog.values[name])
        # a kernel's workspace is held while it runs, beside its results
        total = sum(live.values()) + spare[k]
        if total > peak:
            peak, at_peak = total, dict(live, **{WORKSPACE: spare[k]})
        if order and not (writes and set(writes) <= once):    # made before the tasks
            task = task_of.get(item_ops[k])
            for name in writes if lazy else ():
                if name in buffers and name not in made_by:
                    made_by[name] = task
                    task_made[task] = task_made.get(task, 0) + buffers[name]
            if total > by_task.get(task, (-1,))[0]:
                by_task[task] = (total, dict(live, **{WORKSPACE: spare[k]}))
            # the runtime takes a buffer's first gradient array as the buffer: one
            # array while that gradient is live
            own = task_made.get(task, 0) - sum(buffers[n] for n in live
                                               if made_by.get(n, False) == task)
            if total + own > first_run.get(task, (-1,))[0]:
                first_run[task] = (total + own, dict(live, **{WORKSPACE: spare[k]}), own)
        for name in set(reads + writes):
            if last.get(name) == k:
                live.pop(name, None)
    others = 0
    made_now = sum(buffers.values())
    if order:
        # the most over the actions of the running micro-batch's own, the others' and the
        # buffers made by then; after the micro-batches' tasks (the update) every buffer
        always = made_now - sum(b for t, b in task_made.items() if t is not None)
        best = (by_task[None][0] + made_now, by_task[None][1], 0, made_now) \
            if None in by_task else (-1, {}, 0, made_now)
        for a, held, (before, first) in zip(order, held_by_action(
                order, after_forward, after_input), buffers_by_action(order, task_made)):
            key = (a.chunk, a.kind)
            if key not in by_task:
                continue
            # a task's first run holds the buffers it has made so far (in first_run),
            # a later one those made before it, its own among them
            (total, live_then, own) = first_run[key] if first else (*by_task[key], 0)
            if total + always + before + held > best[0]:
                best = (total + always + before + held, live_then, held,
                        always + before + own)
        _, at_peak, others, made_now = best
    workspace = at_peak.pop(WORKSPACE, 0)
    grads = sum(b for n, b in at_peak.items() if "@GRAD" in n)
    acts = sum(b for n, b in at_peak.items() if "@GRAD" not in n) + others
    m = scale.micro_batches
    if plan.micro_batches > 1:
        # the local program is one micro-batch's: the others in flight keep what they
        # saved for their backward (by the schedule, above; while the search plans, with
        # no schedule yet, by the in-flight term), and the parameters' gradients
        # accumulate in buffers
        if not order:
            acts += (in_flight(plan.strategy.schedule, m, len(plan.stages), stage,
                              plan.strategy.virtual_stages) - 1) * saved
        grads += made_now
    dtypes = tuple(sorted({prog.values[g].dtype for g in buffers})) if made_now else ()
    return (params, states, int(grads), int(acts), int(saved), int(workspace),
            int(made_now), dtypes)


def _combine(plan, processes, update_time, counts) -> Estimate:
    by_stage: dict = {}
    for p in processes:
        by_stage.setdefault(p.stage, []).append(p)
    slowest = {s: max(ps, key=lambda p: p.busy) for s, ps in by_stage.items()}
    if plan.micro_batches == 1:
        total = sum(p.busy for p in slowest.values())
    else:
        upd = {s: update_time[p.process] for s, p in slowest.items()}
        per_mb = {s: (p.busy - upd[s]) / counts[p.process] for s, p in slowest.items()}
        # with v chunks per stage (interleaved 1F1B, ZBV's two) the pipeline fills and
        # drains one chunk at a time (the accountant's step_time); a zero-bubble
        # schedule runs the weight gradients (W) where the others idle
        virtual = 2 if plan.strategy.schedule == "ZBV" else plan.strategy.virtual_stages
        weights = [sum(t.compute + t.communication for t in p.tasks
                       if t.kind == TaskKind.BACKWARD_WEIGHT.value) / counts[p.process]
                   for p in slowest.values()]
        total = step_time(list(per_mb.values()), [counts[p.process] for p in slowest.values()],
                          virtual, plan.strategy.schedule, list(upd.values()),
                          weights if any(weights) else None)
    bottleneck = max(processes, key=lambda p: p.busy)
    return Estimate(total, bottleneck.compute, bottleneck.communication,
                    max(total - bottleneck.busy, 0.0), tuple(processes))
