"""Task graph: what each process runs per micro-batch, and what flows between tasks.

:func:`build_task_graph` is pure: from a :class:`~distgraph.passes.planner.Plan` it
cuts every process's local program into tasks by role (Paddle's task graph, one
instance per micro-batch, each with its own memory):

- ``forward`` (forward and loss ops), ``backward`` (backward ops) — under the zero-bubble
  schedule ``backward_input`` (the ops that carry gradients on towards the inputs, B) and
  ``backward_weight`` (the ops whose results only feed parameter gradients, W) — run
  once per micro-batch, in micro-batch order;
- ``update`` runs once per step, on the gradients accumulated over the micro-batches.

Ops of the accumulation's prologue (whole-batch sums that only the feeds make) belong to
no task: the runner makes their results before the step's first task (see
:class:`~distgraph.runtime.execution.pipeline.PipelineRunner`).

A reshard point of the plan becomes task items: run in place where all the processes
it involves belong to one stage (a collective inside the stage, e.g. Megatron's
all-reduce) or where it feeds the update; otherwise (an activation or gradient crossing
stages) a ``send`` half in the producer's task right after the value is made and a
``recv`` half in the consumer's task: the edge between the two tasks carries it.

Edges have buffers: a producer instance runs only when each edge out of its task has a
free slot, freed when the consumer instance is done (by a buffer-freed message when the
consumer is on another process). Within a stage the ``forward -> backward`` edge holds
the activations a micro-batch keeps for its backward; its buffer is the number of
micro-batches in flight: ``S - s`` on stage ``s`` of ``S`` under ``"1F1B"`` and
``"ZB"`` (so forward runs at most ``S - s`` micro-batches ahead and 1F1B emerges),
``M`` under ``"FThenB"`` (GPipe), where the backward starts when that buffer is full
(every forward done: the flush). Among ready tasks the runtime picks by
:attr:`TaskGraph.priority`; W tasks come last under ZB, so they fill the bubbles.

Example::

    graph = dg.passes.plan(built, dg.Strategy(micro_batches=4)).task_graph()
    print(graph.pretty())
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from distgraph.errors import PlanError
from distgraph.passes.cost_model import collective_bytes
from distgraph.passes.partition import gather_points

PER_MICRO_BATCH = ("forward", "backward", "backward_input", "backward_weight")
KINDS = PER_MICRO_BATCH + ("update",)
PROLOGUE = "prologue"      # ops the runner runs before the step's tasks (no task)
REMOTE_BUFFER = 2        # slots of an edge between processes (double buffering)
MAX_TAG = 1 << 14        # as distgraph.runtime.comm.base.MAX_TAG (passes import nothing above)

# Among ready tasks, the first kind in this order runs first.
PRIORITY = {
    "FThenB": ("forward", "backward"),
    "1F1B": ("backward", "forward"),
    "ZB": ("backward_input", "forward", "backward_weight"),
}


@dataclass(frozen=True)
class Item:
    """One step of a task: ``op`` (local op ``index``), ``point`` (reshard point ``index``
    = its seq, run in place), ``send`` / ``recv`` (the two halves of a point crossing
    stages) or ``gather`` (fetched value number ``index``, in the update)."""

    kind: str
    index: int

    def __str__(self) -> str:
        return f"{self.kind}#{self.index}"


@dataclass(frozen=True)
class Task:
    process: int
    stage: int
    kind: str
    items: tuple
    accumulates: tuple = ()      # names this task makes that the update reads

    @property
    def per_micro_batch(self) -> bool:
        return self.kind != "update"

    def __str__(self) -> str:
        return f"{self.kind} (stage {self.stage}, process {self.process})"


@dataclass(frozen=True)
class Edge:
    """``src`` task (process, kind) -> ``dst`` task. ``points`` are the seqs of the
    reshard points whose tiles it carries (remote edges); ``buffer`` its slots. With
    ``flush`` the consumer starts only once the buffer is full (every micro-batch made:
    GPipe's forward-then-backward)."""

    id: int
    src: tuple
    dst: tuple
    buffer: int
    points: tuple = ()
    flush: bool = False

    @property
    def remote(self) -> bool:
        return self.src[0] != self.dst[0]

    def __str__(self) -> str:
        where = "remote" if self.remote else "local"
        carried = f" points {list(self.points)}" if self.points else ""
        flush = ", released when full" if self.flush else ""
        return (f"{self.src[0]}:{self.src[1]} -> {self.dst[0]}:{self.dst[1]} {where} "
                f"buffer {self.buffer}{flush}{carried}")


@dataclass(frozen=True)
class TaskGraph:
    """Tasks of every process, edges, and the schedule's parameters. ``caps[s]``: the
    micro-batches stage s may have in flight; ``coordinated[s]``: whether stage s's
    processes communicate inside forward/backward tasks, so that its first process
    (``leaders[s]``) picks the order of tasks for all of them (collectives must meet in
    one order); ``channels[seq]``: the tag block of a point that sends messages."""

    schedule: str
    micro_batches: int
    stages: tuple
    stage_of: MappingProxyType
    tasks: tuple
    edges: tuple
    caps: tuple
    coordinated: tuple
    priority: tuple
    points: MappingProxyType
    channels: MappingProxyType
    fetch: tuple

    # -- queries ------------------------------------------------------------------------
    def tasks_of(self, process: int) -> dict:
        return {t.kind: t for t in self.tasks if t.process == process}

    def edges_out(self, process: int, kind: str) -> list:
        return [e for e in self.edges if e.src == (process, kind)]

    def edges_in(self, process: int, kind: str) -> list:
        return [e for e in self.edges if e.dst == (process, kind)]

    def leader(self, stage: int) -> int:
        return min(self.stages[stage].process_ids)

    def step_bytes(self, plan, process: int) -> dict:
        """Bytes ``process`` sends in one step, by kind: each reshard point and each op's
        own collectives once per micro-batch in a per-micro-batch task, once in the
        update (the fetched values' gathers left out, as in ``LocalProgram.bytes_sent``)."""
        local = plan.local(process)
        points = {p.seq: p for p in local.points()}
        sent: dict = {}
        for task in self.tasks_of(process).values():
            times = self.micro_batches if task.per_micro_batch else 1
            for it in task.items:
                if it.kind in ("point", "send", "recv"):    # each half counts its own
                    for step in points[it.index].steps:
                        b = step.bytes_sent_by(process)
                        if b:
                            sent[step.kind] = sent.get(step.kind, 0.0) + times * b
                elif it.kind == "op":
                    for kind, n, nbytes in local.op_comm.get(it.index, ()):
                        sent[kind] = sent.get(kind, 0.0) + times * float(
                            collective_bytes(kind, n, nbytes))
        return sent

    # -- tags ---------------------------------------------------------------------------
    def tag(self, seq: int, micro_batch: int) -> int:
        """Tag of the messages of point ``seq`` for ``micro_batch``."""
        return self.channels[seq] * self.micro_batches + micro_batch

    def gather_tag(self, index: int) -> int:
        return len(self.channels) * self.micro_batches + index

    def credit_tag(self, edge: Edge) -> int:
        return self.gather_tag(len(self.fetch)) + edge.id

    def decide_tag(self) -> int:
        return self.gather_tag(len(self.fetch)) + len(self.edges)

    # -- printing -----------------------------------------------------------------------
    def pretty(self, program=None) -> str:
        lines = [f"TaskGraph: schedule {self.schedule}, {self.micro_batches} micro-batch(es), "
                 f"{len(self.stages)} stage(s); priority {' > '.join(self.priority)}"]
        for s, mesh in enumerate(self.stages):
            how = "coordinated by process %d" % self.leader(s) if self.coordinated[s] \
                else "independent processes"
            lines.append(f"  stage {s} {list(mesh.process_ids)}: at most {self.caps[s]} "
                         f"micro-batch(es) in flight; {how}")
        for pid in sorted({t.process for t in self.tasks}):
            lines.append(f"  process {pid}:")
            for kind in KINDS:
                task = self.tasks_of(pid).get(kind)
                if task is None:
                    continue
                counts: dict = {}
                for it in task.items:
                    counts[it.kind] = counts.get(it.kind, 0) + 1
                what = ", ".join(f"{n} {k}" for k, n in counts.items()) or "nothing"
                per = "per micro-batch" if task.per_micro_batch else "once"
                lines.append(f"    {kind:<16} {per:<15} {what}")
                for it in task.items:
                    if it.kind in ("send", "recv"):
                        p = self.points[it.index]
                        lines.append(f"      {it.kind} {p.value} {p.src.spec} -> {p.dst.spec}"
                                     f" (point {it.index})")
                if task.accumulates:
                    lines.append(f"      accumulates {', '.join(task.accumulates)}")
        lines.append("  edges:")
        lines.extend(f"    {e}" for e in self.edges)
        return "\n".join(lines)


# ---- building ----------------------------------------------------------------------------

def build_task_graph(plan) -> TaskGraph:
    """The task graph of ``plan`` (see the module docstring)."""
    program = plan.program
    strategy = plan.strategy
    m = plan.micro_batches
    stages = plan.stages
    stage_of = stage_of_processes(plan)
    n_stages = len(stages)
    if strategy.schedule == "FThenB":
        caps = tuple(m for _ in stages)
    else:
        caps = tuple(max(1, min(m, n_stages - s)) for s in range(n_stages))
    kind_of = _op_kinds(program, split=strategy.schedule == "ZB")
    acc = plan.accumulation
    if acc is not None and acc.skipped:
        kind_of = [PROLOGUE if op.outputs and all(o.name in acc.skipped for o in op.outputs)
                   else kind for op, kind in zip(program.ops, kind_of)]
    producer = {o.name: k for k, op in enumerate(program.ops) for o in op.outputs}
    uses: dict = {}
    for k, op in enumerate(program.ops):
        for i, v in enumerate(op.inputs):
            uses.setdefault(v.name, []).append((k, i))
    fetch = _fetch_names(plan)
    points: dict = {}
    tasks, remote = [], []
    for pid in plan.process_ids:
        local = plan.local(pid)
        built = _ProcessTasks(plan, pid, local, stage_of, kind_of, producer, uses, fetch)
        tasks.extend(built.tasks())
        remote.extend(built.remote)
        for p in local.points():
            points.setdefault(p.seq, p)
    edges = _edges(tasks, remote, caps, stage_of, strategy.schedule == "FThenB", m)
    coordinated = tuple(_coordinated(s, stages, tasks, plan) for s in range(n_stages))
    p2p = sorted(seq for seq, p in points.items() if any(st.kind == "send_recv" for st in p.steps))
    channels = {seq: c for c, seq in enumerate(p2p)}
    graph = TaskGraph(strategy.schedule, m, stages, MappingProxyType(stage_of), tuple(tasks),
                      tuple(edges), caps, coordinated, PRIORITY[strategy.schedule],
                      MappingProxyType(points), MappingProxyType(channels), tuple(fetch))
    if graph.decide_tag() >= MAX_TAG:
        raise PlanError(f"the task graph needs {graph.decide_tag() + 1} message tags "
                        f"({len(channels)} point-to-point reshards x {m} micro-batches), more "
                        f"than the {MAX_TAG} available; use fewer micro-batches")
    return graph


def _fetch_names(plan) -> list:
    built = plan.built
    return [built.loss_name] if built.loss_name else list(built.output_names)


def stage_of_processes(plan) -> dict:
    """{process: its stage}; a process belongs to exactly one stage."""
    out = {}
    for pid in plan.process_ids:
        mine = [s for s, mesh in enumerate(plan.stages) if pid in mesh]
        if len(mine) > 1:
            raise PlanError(f"process {pid} belongs to stages {mine} (meshes "
                            f"{', '.join(str(plan.stages[s]) for s in mine)}); a pipelined "
                            f"plan needs every process in one stage: put the stages on "
                            f"disjoint meshes")
        out[pid] = mine[0] if mine else 0
    return out


def _op_kinds(program, split: bool) -> list:
    """Task kind of every op of the global program. With ``split`` (zero bubble), a
    backward op is ``backward_input`` (B) when a result of it is, or flows into, the
    gradient of an activation (the chain that carries gradients towards the inputs, and
    to the stage before), else ``backward_weight`` (W: it only computes parameter
    gradients from what B made, so it can wait)."""
    kinds = []
    for op in program.ops:
        if op.role in ("forward", "loss"):
            kinds.append("forward")
        elif op.role == "optimize":
            kinds.append("update")
        else:
            kinds.append("backward")
    if not split:
        return kinds
    values = program.values
    towards_inputs = {n for n in values if n.endswith("@GRAD") and n[:-5] in values
                      and not values[n[:-5]].is_parameter}
    consumers = program.consumers()
    for k in reversed(range(len(program.ops))):
        if kinds[k] != "backward":
            continue
        outs = [o.name for o in program.ops[k].outputs]
        carries = any(n in towards_inputs for n in outs) or any(
            c.role == "backward" and any(o.name in towards_inputs for o in c.outputs)
            for n in outs for c in consumers.get(n, ()))
        if carries:
            towards_inputs.update(outs)
        kinds[k] = "backward_input" if carries else "backward_weight"
    return kinds


class _ProcessTasks:
    """The tasks of one process, and the remote transfers its points make."""

    def __init__(self, plan, pid, local, stage_of, kind_of, producer, uses, fetch):
        self.plan, self.pid, self.local = plan, pid, local
        self.stage_of, self.kind_of, self.producer = stage_of, kind_of, producer
        self.uses = uses
        self.stage = stage_of[pid]
        self.global_index = [k for k, op in enumerate(plan.program.ops)
                             if pid in op.dist_attr.mesh]
        if len(self.global_index) != len(local.program.ops):
            raise PlanError(f"internal error: process {pid}'s local program does not match "
                            f"the plan; please report it")
        self.local_of = {k: i for i, k in enumerate(self.global_index)}
        self.fetch = fetch
        self.items: dict = {kind: [] for kind in KINDS + (PROLOGUE,)}
        self.remote: list = []       # (src process, src kind, dst process, dst kind, seq)
        self._place()

    def _kind_at(self, global_op: int) -> str:
        return self.kind_of[global_op]

    def _point_kind(self, p) -> str:
        """The task a point's result is made in: the first, in a micro-batch's order of
        tasks, whose ops read it in the point's layout (a resharded value is made once
        and reused by later consumers, say a backward_input and a backward_weight op)."""
        ops = self.plan.program.ops
        kinds = {self._kind_at(p.anchor)}
        for k, i in self.uses.get(p.value, ()):
            da = ops[k].dist_attr
            if da.mesh == p.dst.mesh and da.input_specs[i] == p.dst.spec:
                kinds.add(self._kind_at(k))
        if PROLOGUE in kinds:
            raise PlanError(f"the micro-batches' prologue (whole-batch sums of the feeds) "
                            f"would reshard {p.value} ({p.src} -> {p.dst}); lay the feeds "
                            f"out as the ops that sum them consume them, or use "
                            f"micro_batches=1")
        return min(kinds, key=KINDS.index)

    def _place(self) -> None:
        for i, k in enumerate(self.global_index):
            self.items[self._kind_at(k)].append(((i, 1, 0), Item("op", i)))
        first = min((kind for kind in PER_MICRO_BATCH if self.items[kind]),
                    key=PER_MICRO_BATCH.index, default="forward")
        for index, plist in self.local.comm_points.items():
            for p in plist:
                self._place_point(index, p, first)
        for g in range(len(self.fetch)):
            self.items["update"].append(((len(self.local.program.ops), 3, g), Item("gather", g)))

    def _place_point(self, index, p, first) -> None:
        consumer_kind = self._point_kind(p)
        involved = set(p.src.mesh.process_ids) | set(p.dst.mesh.process_ids)
        one_stage = len({self.stage_of.get(q, 0) for q in involved}) == 1
        p2p = any(st.kind == "send_recv" for st in p.steps)
        if consumer_kind == "update" or one_stage or not p2p:
            self.items[consumer_kind].append(((index, 0, p.seq), Item("point", p.seq)))
            return
        if self.pid in p.src.mesh:
            made = self.producer.get(p.value)
            if made is None or made not in self.local_of:
                kind, at = first, (-1, 2, p.seq)
            else:
                kind, at = self._kind_at(made), (self.local_of[made], 2, p.seq)
            self.items[kind].append((at, Item("send", p.seq)))
            step = next(st for st in p.steps if st.kind == "send_recv")
            for t in step.transfers:
                if t.src == self.pid and t.dst != self.pid:
                    self.remote.append((self.pid, kind, t.dst, consumer_kind, p.seq))
        if self.pid in p.dst.mesh:
            self.items[consumer_kind].append(((index, 0, p.seq), Item("recv", p.seq)))

    def tasks(self) -> list:
        out = []
        u_reads = self._update_reads()
        for kind in KINDS:
            items = [it for _, it in sorted(self.items[kind], key=lambda x: x[0])]
            if not items and kind != "update":
                continue
            made = self._made_by(items) if kind != "update" else set()
            acc = tuple(n for n in u_reads if n in made)
            out.append(Task(self.pid, self.stage, kind, tuple(items), acc))
        return out

    def _made_by(self, items) -> set:
        names = set()
        ops = self.local.program.ops
        points = {p.seq: p for p in self.local.points()}
        for it in items:
            if it.kind == "op":
                names.update(o.name for o in ops[it.index].outputs)
            elif it.kind in ("point", "recv"):
                names.update(points[it.index].writes)
        return names

    def _update_reads(self) -> list:
        """Names the update task reads (in order): what it must find accumulated."""
        ops = self.local.program.ops
        points = {p.seq: p for p in self.local.points()}
        made: set = set()
        reads: list = []
        for _, it in sorted(self.items["update"], key=lambda x: x[0]):
            if it.kind == "op":
                names, outs = [v.name for v in ops[it.index].inputs], \
                    [o.name for o in ops[it.index].outputs]
            elif it.kind == "point":
                names, outs = list(points[it.index].reads), list(points[it.index].writes)
            else:
                names, outs = [], []
            for n in names:
                if n not in made and n not in reads:
                    reads.append(n)
            made.update(outs)
        gathers = gather_points(self.plan.program, self.fetch, self.pid)
        for p in gathers:
            for n in p.reads:
                if n not in made and n not in reads:
                    reads.append(n)
        persist = {v.name for v in self.local.program.persistables}
        return [n for n in reads if n not in persist]


def _edges(tasks, remote, caps, stage_of, flush: bool, micro_batches: int) -> list:
    """Within a process, an edge from each per-micro-batch task to each later one, its
    buffer the stage's micro-batches in flight (under FThenB all of them, released when
    full); between processes, one edge per pair of tasks that exchange tiles, double
    buffered (under FThenB as many slots as micro-batches, so forwards stream)."""
    edges: list = []
    kinds_of: dict = {}
    for t in tasks:
        kinds_of.setdefault(t.process, set()).add(t.kind)
    for pid in sorted(kinds_of):
        have = [k for k in PER_MICRO_BATCH if k in kinds_of[pid]]
        cap = caps[stage_of[pid]]
        for a_i, a in enumerate(have):
            for b in have[a_i + 1:]:
                edges.append(Edge(len(edges), (pid, a), (pid, b), cap,
                                  flush=flush and a == "forward"))
    grouped: dict = {}
    for src, src_kind, dst, dst_kind, seq in remote:
        grouped.setdefault(((src, src_kind), (dst, dst_kind)), []).append(seq)
    slots = micro_batches if flush else REMOTE_BUFFER
    for (src, dst), seqs in sorted(grouped.items()):
        edges.append(Edge(len(edges), src, dst, slots, tuple(sorted(set(seqs)))))
    return edges


def _coordinated(stage, stages, tasks, plan) -> bool:
    """Whether the processes of ``stage`` communicate with each other inside per
    micro-batch tasks (collectives, or ops whose distributed form communicates)."""
    if len(stages[stage].process_ids) < 2:
        return False
    for t in tasks:
        if t.stage != stage or not t.per_micro_batch:
            continue
        local = plan.local(t.process)
        points = {p.seq: p for p in local.points()}
        for it in t.items:
            if it.kind == "op" and it.index in local.op_comm:
                return True
            if it.kind == "point" and points[it.index].steps:
                return True
            if it.kind in ("send", "recv"):
                p = points[it.index]
                if any(st.kind != "send_recv" for st in p.steps):
                    return True
    return False
