"""Task graph: what each process runs per micro-batch, and what flows between its tasks.

:func:`build_task_graph` is pure. From a plan's partitions it cuts every process's local
program into tasks (Paddle's task graph, one instance per micro-batch; a plan without
micro-batches is the same graph with M = 1):

- per chunk of the forward (a *stage* in torch's numbering, :mod:`.chunks`) a
  ``forward`` task (forward and loss ops) and a ``backward`` task — under the zero-bubble
  schedules ``backward_input`` (the ops that carry gradients on towards the inputs, I) and
  ``backward_weight`` (the ops whose results only feed parameter gradients, W) —, each run
  once per micro-batch;
- one ``update`` per process, once per step, on the gradients accumulated over the
  micro-batches, ending with the gathers that bring the fetched values to every process;
- under an uneven split by micro-batches (``Strategy(balance=True)``), a ``prologue``
  task: the reshards of the prologue's whole-batch sums, run once per step after the
  prologue's ops (every micro-batch reads the same result, and the data-parallel groups,
  which run different numbers of micro-batches, meet only there and in the update); the
  graph then counts micro-batches up to the largest group's.

Ops of the accumulation's prologue (whole-batch sums only the feeds make) and the ops
whose results a step makes once (:func:`~distgraph.plan.accumulation.made_once`: under amp
the 16-bit copies of the parameters) belong to no task: the runner makes their results
before the step's first task.

A reshard point of the plan becomes task items: run in place when the task that makes
its value also consumes it, when it has no point-to-point transfer or when it feeds the
update; otherwise (an activation or gradient crossing chunks) a ``send`` half in the
task that makes the value, right after it is made, and a ``recv`` half in the consumer's
task. Every message carries a tag from one scheme: point ``seq`` of micro-batch ``m``
has ``tag(seq, m)``, fetched value ``i`` ``gather_tag(i)``, all below ``MAX_TAG``
(points that no sender-receiver pair shares may share a channel).

``deps`` says which (chunk, action kind) each reads in the same micro-batch (a value it
receives, or one made by another task of its process): the schedule
(:mod:`.schedule`) is made from it and checked against it.

Example::

    graph = dg.passes.plan(built, dg.Strategy(micro_batches=4)).task_graph()
    print(graph.pretty())
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

from distgraph.errors import PlanError
from distgraph.ir import Role
from distgraph.plan.kinds import PER_MICRO_BATCH, ItemKind, StepKind, TaskKind
from distgraph.plan.tags import TagScheme
from distgraph.plan.tasks import Flow, Item, Task, TaskGraph

FORWARD, BACKWARD, UPDATE, PROLOGUE = (TaskKind.FORWARD, TaskKind.BACKWARD, TaskKind.UPDATE,
                                       TaskKind.PROLOGUE)
INPUT_GRAD, WEIGHT_GRAD = TaskKind.BACKWARD_INPUT, TaskKind.BACKWARD_WEIGHT


# ---- building ----------------------------------------------------------------------------

def op_kinds(program, split: bool) -> list:
    """Task kind of every op of the global program. With ``split`` (zero bubble), a
    backward op is ``backward_input`` (I) when a result of it is, or flows into, the
    gradient of an activation (the chain that carries gradients towards the inputs, and
    to the chunk before), else ``backward_weight`` (W: it only computes parameter
    gradients from what I made, so it can wait)."""
    kinds = []
    for op in program.ops:
        if op.role in (Role.FORWARD, Role.LOSS):
            kinds.append(FORWARD)
        elif op.role is Role.OPTIMIZE:
            kinds.append(UPDATE)
        else:
            kinds.append(BACKWARD)
    if not split:
        return kinds
    values = program.values
    towards_inputs = {n for n in values if n.endswith("@GRAD") and n[:-5] in values
                      and not values[n[:-5]].is_parameter}
    consumers = program.consumers()
    for k in reversed(range(len(program.ops))):
        if kinds[k] is not BACKWARD:
            continue
        outs = [o.name for o in program.ops[k].outputs]
        carries = any(n in towards_inputs for n in outs) or any(
            c.role is Role.BACKWARD and any(o.name in towards_inputs for o in c.outputs)
            for n in outs for c in consumers.get(n, ()))
        if carries:
            towards_inputs.update(outs)
        kinds[k] = INPUT_GRAD if carries else WEIGHT_GRAD
    return kinds


def build_task_graph(plan, parts, chunk_of: tuple, chunk_meshes: tuple) -> TaskGraph:
    """The task graph of ``plan`` from its partitions ``parts`` (a
    :class:`~distgraph.passes.partition.Partitions`), every op's chunk ``chunk_of`` and
    each chunk's mesh (module docstring). The processes of one partition group run the
    same tasks (only whom their transfers go to differs): one of each group is cut."""
    program = plan.program
    strategy = plan.strategy
    split = plan.batch_split
    uneven = split is not None and split.micro_batched and not split.is_even
    m = max(split.units) if uneven else plan.micro_batches
    kind_of = op_kinds(program, split=strategy.schedule in ("ZB", "ZBV"))
    acc = plan.accumulation
    once_ops = frozenset()
    if acc is not None:     # what the micro-batches do not run: the prologue's, made_once
        once = acc.made_once(program)
        once_ops = frozenset(k for k, op in enumerate(program.ops) if op.outputs and
                             all(o.name in once for o in op.outputs))
        kind_of = [PROLOGUE if k in once_ops or (op.outputs and all(
            o.name in acc.skipped for o in op.outputs)) else kind
                   for k, (op, kind) in enumerate(zip(program.ops, kind_of))]
    n_chunks = len(chunk_meshes)
    flow_rank = _flow_rank(n_chunks)
    uses: dict = {}         # value -> (mesh, spec) it is read in -> the reading ops
    for k, op in enumerate(program.ops):
        da = op.dist_attr
        for i, v in enumerate(op.inputs):
            layouts = uses.setdefault(v.name, {})
            layouts.setdefault((da.mesh, da.input_specs[i]), []).append(k)
    producer = {o.name: k for k, op in enumerate(program.ops) for o in op.outputs}
    fetch = tuple(plan.built.fetch_names)
    padded = {name: rg.shape for name, rg in plan.row_gathers.items()}
    persist = {v.name for v in program.persistables}
    points: dict = {}
    by_process, sends, recvs, makers, readers = {}, [], {}, {}, {}
    receivers = _Receivers()
    for group in parts.groups():
        first = group[0]
        local = parts[first]
        builder = _TaskBuilder(plan, first, local, kind_of, chunk_of, flow_rank, producer,
                               uses, parts.gather_points(fetch, first, padded), uneven,
                               once_ops)
        mine = builder.tasks()
        for p in local.points():
            points.setdefault(p.seq, p)
        made, read = builder.names(mine, persist | set(builder.feeds))
        makers[first], readers[first] = made, read     # alike for the whole group
        for pid in group:
            by_process[pid] = mine if pid == first else [
                dataclasses.replace(t, process=pid) for t in mine]
            for seq, key in builder.recvs.items():
                recvs[(pid, seq)] = key
            for key, seq in builder.sending:
                sends.extend((pid, key, dst, seq)
                             for dst in receivers.of(points[seq], pid) if dst != pid)
    tasks = [t for pid in sorted(by_process) for t in by_process[pid]]
    flows, deps = _flows_and_deps(tasks, sends, recvs, makers, readers, points)
    tags = TagScheme(m, MappingProxyType(_channels(points)))
    tags.check(len(fetch))
    graph = TaskGraph(strategy.schedule, m, 2 if strategy.schedule == "ZBV" else
                      strategy.virtual_stages, tuple(plan.stages), tuple(chunk_meshes),
                      tuple(tasks), tuple(flows), MappingProxyType(deps),
                      MappingProxyType(points), tags, fetch,
                      MappingProxyType({pid: tuple(parts.gather_points(fetch, pid, padded))
                                        for pid in plan.process_ids}))
    return graph


def _channels(points) -> dict:
    """{seq: channel} of the points with point-to-point transfers: the lowest channel no
    earlier point uses between the same sender and receiver. A tag only has to tell apart
    messages that one sender sends one receiver, so the tags grow with the points a pair
    of processes exchanges (a pipeline's boundary: two or three), not with all of them."""
    used: dict = {}
    channels = {}
    for seq in sorted(points):
        p2p = [st for st in points[seq].steps if st.kind is StepKind.SEND_RECV]
        if not p2p:
            continue
        pairs = {(t.src, t.dst) for st in p2p for t in st.transfers if t.src != t.dst}
        taken = set().union(*(used.get(pair, ()) for pair in pairs))
        channels[seq] = next(c for c in range(len(taken) + 1) if c not in taken)
        for pair in pairs:
            used.setdefault(pair, set()).add(channels[seq])
    return channels


class _Receivers:
    """Whom each process sends its tiles of a point's p2p step to, found once per point."""

    def __init__(self):
        self._by_point: dict = {}

    def of(self, point, pid: int) -> list:
        if point.seq not in self._by_point:
            step = next(st for st in point.steps if st.kind is StepKind.SEND_RECV)
            to: dict = {}
            for t in step.transfers:
                to.setdefault(t.src, set()).add(t.dst)
            self._by_point[point.seq] = {src: sorted(d) for src, d in to.items()}
        return self._by_point[point.seq].get(pid, [])


def _flow_rank(n_chunks: int):
    """Where a task comes in one micro-batch's data flow: forwards by chunk, then input
    gradients back down the chunks, then weight gradients, then the update."""
    def rank(key):
        chunk, kind = key
        if kind is FORWARD:
            return chunk
        if kind in (BACKWARD, INPUT_GRAD):
            return 2 * n_chunks - 1 - chunk
        if kind is WEIGHT_GRAD:
            return 3 * n_chunks - 1 - chunk
        return 3 * n_chunks
    return rank


class _TaskBuilder:
    """The tasks of one process, the transfers its points send, and where it receives."""

    def __init__(self, plan, pid, local, kind_of, chunk_of, flow_rank, producer, uses,
                 gathers, prologue_points=False, once_ops=frozenset()):
        self.plan, self.pid, self.local = plan, pid, local
        self.prologue_points = prologue_points
        self.once_ops = once_ops        # ops made once: they and their points run before
        self.kind_of, self.chunk_of, self.rank = kind_of, chunk_of, flow_rank
        self.producer, self.uses, self.gathers = producer, uses, gathers
        self.global_index = [k for k, op in enumerate(plan.program.ops)
                             if pid in op.dist_attr.mesh]
        if len(self.global_index) != len(local.program.ops):
            raise PlanError(f"internal error: process {pid}'s local program does not match "
                            f"the plan; please report it")
        self.local_of = {k: i for i, k in enumerate(self.global_index)}
        self.feeds = [v.name for v in local.program.inputs]
        self.items: dict = {}
        self.sending: list = []      # (its task key, seq) of the points it sends
        self.recvs: dict = {}        # seq -> task key of its recv half here
        self._place()

    def _key(self, global_op: int) -> tuple:
        kind = self.kind_of[global_op]
        if kind in (UPDATE, PROLOGUE):
            return (None, kind)
        return (self.chunk_of[global_op], kind)

    def _point_key(self, p) -> tuple:
        """The task a point's result is made in: the first, in a micro-batch's data flow,
        whose ops read it in the point's layout (a resharded value is made once and
        reused by later consumers, say an I and a W op). Only the ops that read this
        point's result count: a parameter gathered for the forward and gathered again for
        the backward (ZeRO-3, a searched plan's weight sharded over dp) is two points,
        and the backward's is made in the backward, not held from the forward's end."""
        keys = {self._key(p.anchor)}
        ops, made = self.local.program.ops, set(p.writes)
        for k in self.uses.get(p.value, {}).get((p.dst.mesh, p.dst.spec), ()):
            i = self.local_of.get(k)
            if i is None or any(v.name in made for v in ops[i].inputs):
                keys.add(self._key(k))
        if any(kind == PROLOGUE for _, kind in keys):
            raise PlanError(f"the micro-batches' prologue (whole-batch sums of the feeds) "
                            f"would reshard {p.value} ({p.src} -> {p.dst}); lay the feeds "
                            f"out as the ops that sum them consume them, or use "
                            f"micro_batches=1")
        if (self.prologue_points and p.value in self.plan.accumulation.prologue
                and not any(st.kind is StepKind.SEND_RECV for st in p.steps)):
            return (None, PROLOGUE)      # the whole batch's sum, reduced once per step
        return min(keys, key=self.rank)

    def _first_key(self) -> tuple:
        keys = [self._key(k) for k in self.global_index]
        keys = [key for key in keys if key[1] in PER_MICRO_BATCH]
        if not keys:
            raise PlanError(f"process {self.pid} runs no forward or backward op, but sends "
                            f"a value to another stage every micro-batch")
        return min(keys, key=self.rank)

    def _add(self, key, at, item) -> None:
        self.items.setdefault(key, []).append((at, item))

    def _place(self) -> None:
        for i, k in enumerate(self.global_index):
            self._add(self._key(k), (i, 1, 0), Item(ItemKind.OP, i))
        for index, plist in self.local.comm_points.items():
            for p in plist:
                if p.anchor not in self.once_ops:   # the step's once-made ops read it
                    self._place_point(index, p)
        end = len(self.local.program.ops)
        for g in range(len(self.gathers)):
            self._add((None, UPDATE), (end, 3, g), Item(ItemKind.GATHER, g))

    def _place_point(self, index, p) -> None:
        consumer = self._point_key(p)
        made = self.producer.get(p.value)
        source = self._key(made) if made is not None else None
        transfers = any(st.kind is StepKind.SEND_RECV for st in p.steps)
        if consumer[1] == UPDATE or not transfers or source == consumer:
            if self.pid in p.dst.mesh or self.pid in p.src.mesh and p.steps:
                self._add(consumer, (index, 0, p.seq), Item(ItemKind.POINT, p.seq))
            return
        if self.pid in p.src.mesh:
            if made is None or made not in self.local_of:
                key, at = self._first_key(), (-1, 2, p.seq)
            else:
                key, at = source, (self.local_of[made], 2, p.seq)
            self._add(key, at, Item(ItemKind.SEND, p.seq))
            self.sending.append((key, p.seq))
        if self.pid in p.dst.mesh:
            self._add(consumer, (index, 0, p.seq), Item(ItemKind.RECV, p.seq))
            self.recvs[p.seq] = consumer

    def tasks(self) -> list:
        out = []
        u_reads = self._update_reads()
        keys = sorted((k for k in self.items if k[1] != PROLOGUE),
                      key=lambda k: (self.rank(k), k[0] if k[0] is not None else -1))
        if (None, UPDATE) not in keys:
            keys.append((None, UPDATE))
        for key in keys:
            items = [it for _, it in sorted(self.items.get(key, ()), key=lambda x: x[0])]
            made = self._made_by(items) if key[1] != UPDATE else set()
            acc = tuple(n for n in u_reads if n in made)
            out.append(Task(self.pid, key[0], key[1], tuple(items), acc))
        points = [it for _, it in sorted(self.items.get((None, PROLOGUE), ()),
                                         key=lambda x: x[0]) if it.kind is ItemKind.POINT]
        if points:      # run by the runner after the prologue's ops
            out.append(Task(self.pid, None, PROLOGUE, tuple(points)))
        return out

    def _io(self, it) -> tuple:
        """(names read, names made) by one item."""
        ops = self.local.program.ops
        if it.kind is ItemKind.OP:
            op = ops[it.index]
            return [v.name for v in op.inputs], [o.name for o in op.outputs]
        if it.kind is ItemKind.GATHER:
            return list(self.gathers[it.index].reads), []
        p = self.plan_point(it.index)
        keep = f"{p.value}@SRC{p.seq}"
        if it.kind is ItemKind.SEND:
            return list(p.reads), [keep] if self.pid in p.dst.mesh else []
        if it.kind is ItemKind.RECV:
            return [keep] if self.pid in p.src.mesh else [], list(p.writes)
        return list(p.reads), list(p.writes)

    def plan_point(self, seq):
        if not hasattr(self, "_points"):
            self._points = {p.seq: p for p in self.local.points()}
        return self._points[seq]

    def _made_by(self, items) -> set:
        names = set()
        for it in items:
            names.update(self._io(it)[1])
        return names

    def _update_reads(self) -> list:
        """Names the update task reads (in order): what it must find accumulated."""
        made: set = set()
        reads: list = []
        for _, it in sorted(self.items.get((None, UPDATE), ()), key=lambda x: x[0]):
            names, outs = self._io(it)
            for n in names:
                if n not in made and n not in reads:
                    reads.append(n)
            made.update(outs)
        persist = {v.name for v in self.local.program.persistables}
        return [n for n in reads if n not in persist]

    def names(self, tasks, outside) -> tuple:
        """({name: task key that makes it}, {task key: names it reads}) for the names of
        one micro-batch (``outside``: persistables and feeds, made by no task)."""
        made, read = {}, {}
        for task in tasks:
            for it in task.items:
                ins, outs = self._io(it)
                for n in outs:
                    made.setdefault(n, task.key)
                read.setdefault(task.key, set()).update(n for n in ins if n not in outside)
        return made, read


def _flows_and_deps(tasks, sends, recvs, makers, readers, points) -> tuple:
    """The flows between processes, and ``deps`` per (chunk, action kind)."""
    deps: dict = {}

    def need(dst_key, src_key):
        if dst_key[1] not in PER_MICRO_BATCH or src_key[1] not in PER_MICRO_BATCH:
            return
        a = (dst_key[0], dst_key[1].action)
        b = (src_key[0], src_key[1].action)
        if a != b:
            deps.setdefault(a, set()).add(b)

    for t in tasks:
        if t.per_micro_batch:
            deps.setdefault((t.chunk, t.kind.action), set())
    for pid, read in readers.items():
        for key, names in read.items():
            for n in names:
                src = makers[pid].get(n)
                if src is not None:
                    need(key, src)
    grouped: dict = {}
    for pid, key, dst, seq in sends:
        dst_key = recvs.get((dst, seq))
        if dst_key is None:
            raise PlanError(f"internal error: process {pid} sends {points[seq].value} to "
                            f"process {dst}, which does not receive it; please report it")
        need(dst_key, key)
        grouped.setdefault(((pid,) + key, (dst,) + dst_key), []).append(seq)
    flows = [Flow(src, dst, tuple(sorted(set(seqs))))
             for (src, dst), seqs in sorted(grouped.items(), key=lambda x: str(x[0]))]
    return flows, {k: frozenset(v) for k, v in deps.items()}
