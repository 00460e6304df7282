"""Compile one process's part of a plan: the :class:`~distgraph.plan.program.ProcessProgram`
its rank runs, with every decision made here, before any rank starts.

:func:`compile_process` turns each task of the plan's task graph into a
:class:`~distgraph.plan.instructions.Block` of instructions (kernels, reshard points run in
place, the send and receive halves of points that cross tasks, the gathers of fetched
values), each with the names it uses for the last time (a micro-batch's values die after
their last reader, and a ``donate`` op may then take their buffer); finds the runs of
consecutive weight-gradient actions that run as one (:mod:`.batched`); lists the
communicator groups the process meets; cuts the rows of every input it reads per
micro-batch; lists the ops whose results the step makes once (``step_ops``:
:func:`~distgraph.plan.accumulation.made_once`); says where communication starts ahead
(:mod:`.overlap`: the gradient buckets, the ZeRO-3 gathers prefetched); and plans the
gathers that bring each persistable whole to every process.

Example::

    program = compile_process(plan, pid=1)
    program.blocks[(0, TaskKind.FORWARD)].instrs
"""

from __future__ import annotations

from types import MappingProxyType

from distgraph.plan.buckets import overlapping, prefetching
from distgraph.plan.devices import COLLECTIVE, CommGroup, step_groups
from distgraph.plan.instructions import (Block, GatherInstr, OpInstr, PointInstr, RecvInstr,
                                         SendInstr, last_uses, op_instr, keeps_nothing,
                                         with_donors)
from distgraph.plan.kinds import ItemKind, TaskKind
from distgraph.plan.program import Feed, ProcessProgram
from distgraph.passes.pipeline.batched import batched_task
from distgraph.passes.pipeline.overlap import bucket_starts, prefetched


def compile_process(plan, pid: int, state_points) -> ProcessProgram:
    """The compiled program of process ``pid`` of ``plan`` (module docstring);
    ``state_points``: the points that bring every persistable whole to every process,
    as this process takes part in them."""
    graph = plan.task_graph()
    local = plan.local(pid)
    points = {p.seq: p for p in local.points()}       # with this process's names
    gathers = graph.gathers[pid]
    source_of: dict = {}        # local name -> the global Value it holds
    compiled: dict = {}
    keeping_nothing = keeps_nothing(local.program.ops)     # what they would keep could never serve
    for key, task in graph.tasks_of(pid).items():
        instrs = []
        for it in task.items:
            instr = _instr(it, points, gathers, local, plan.accumulation, pid, keeping_nothing)
            instrs.append(instr)
            for name in instr.writes:          # a point's result holds its point's Value
                source_of.setdefault(name, name if isinstance(instr, OpInstr)
                                     else instr.point.value)
        compiled[key] = (task, instrs)
    acc = plan.accumulation
    once = acc.made_once(plan.program) if acc is not None else frozenset()
    # a Value made once is every micro-batch's: none of them may take its buffer
    feeds = {v.name for v in local.program.inputs} | once
    persistable = frozenset(v.name for v in local.program.persistables)
    blocks = _blocks(compiled, feeds, persistable, local.program.values)
    update = blocks.pop((None, TaskKind.UPDATE))
    prologue = blocks.pop((None, TaskKind.PROLOGUE), None)
    actions = plan.order.of(pid)
    batched_tasks = {key: b for key, block in blocks.items()
                     if key[1] is TaskKind.BACKWARD_WEIGHT
                     and (b := batched_task(block, plan.accumulation, source_of)) is not None}
    made = acc.prologue_values if acc is not None else frozenset()
    prologue_ops = tuple(op_instr(op) for op in local.program.ops
                         if op.outputs and all(o.name in made for o in op.outputs))
    step_ops = []           # the once-made ops, each after its operands' reshards
    for i, op in enumerate(local.program.ops):
        if op.outputs and all(o.name in once for o in op.outputs):
            step_ops += [PointInstr(p, p.reads, p.writes, p.stores)
                         for p in local.comm_points.get(i, ())]
            step_ops.append(op_instr(op, local.op_context.get(i)))
    rows = feed_rows(plan, pid)
    found = set(rows.values())
    first_chunk = min((t.chunk for t in graph.tasks_of(pid).values() if t.chunk is not None),
                      default=0)
    runs = _runs(actions, blocks, batched_tasks)
    overlap = overlapping(plan)
    return ProcessProgram(
        process=pid, rank=plan.ranks(pid), local=local,
        blocks=MappingProxyType(blocks), update=update, prologue=prologue,
        actions=tuple(actions), batched=runs,
        batched_tasks=MappingProxyType(batched_tasks), env_slots=graph.micro_batches,
        micro_batches=plan.micro_batches_of(pid), batch_micro_batches=plan.micro_batches,
        positions=micro_batch_positions(plan, pid),
        feeds=tuple(Feed(v.name, rows[v.name], _rest(plan.program, v.name, pid))
                    for v in local.program.inputs),
        batch_rows=found.pop() if len(found) == 1 else None,
        prologue_ops=prologue_ops, prologue_sums=acc.prologue if acc is not None else frozenset(),
        step_ops=tuple(step_ops),
        accumulation=acc, source_of=MappingProxyType(source_of), fetch=tuple(graph.fetch),
        row_gathers=plan.row_gathers, tags=graph.tags,
        comm_groups=comm_groups(plan, pid, local, gathers, state_points),
        state_gathers=MappingProxyType({p.value: p for p in state_points}),
        first_chunk=first_chunk, persistables=persistable,
        starts=bucket_starts(plan, local, blocks, update, actions, runs) if overlap else (),
        prefetch=prefetched(local, blocks) if prefetching(plan) else MappingProxyType({}))


def _instr(it, points, gathers, local, acc, pid, keeping_nothing=frozenset()):
    if it.kind is ItemKind.OP:
        op = local.program.ops[it.index]
        axis = acc.split_axis.get(op.outputs[0].name) if acc is not None and op.outputs else None
        return op_instr(op, local.op_context.get(it.index), axis, it.index not in keeping_nothing)
    if it.kind is ItemKind.GATHER:
        g = gathers[it.index]
        return GatherInstr(g, it.index, g.reads)
    p = points[it.index]
    if it.kind is ItemKind.POINT:
        return PointInstr(p, p.reads, p.writes, p.stores)
    head, transfer, tail = p.split_at_transfer()
    keep = f"{p.value}@SRC{p.seq}"
    if it.kind is ItemKind.SEND:
        # the source also receives (overlapping meshes): keep it for the recv
        return SendInstr(p, head, transfer, p.reads, (keep,) if pid in p.dst.mesh else ())
    return RecvInstr(p, transfer, tail, transfer.incoming(pid),
                     (keep,) if pid in p.src.mesh else (), p.writes)


def _blocks(compiled, feeds, persistable, values) -> dict:
    users: dict = {}
    for key, (task, instrs) in compiled.items():
        if task.per_micro_batch:
            for instr in instrs:
                for name in instr.reads + instr.writes:
                    users.setdefault(name, set()).add(key)
    blocks = {}
    for key, (task, instrs) in compiled.items():
        keep = persistable if task.per_micro_batch else persistable | {
            n for i in instrs if isinstance(i, GatherInstr) for n in i.reads}
        last = last_uses(instrs, keep)
        # an accumulated value is held by the accumulator: never a donor
        dying_ok = [tuple(n for n in names if n not in task.accumulates) for names in last]
        instrs = [with_donors(i, dying, values, feeds) if isinstance(i, OpInstr) else i
                  for i, dying in zip(instrs, dying_ok)]
        others = {name: tuple(sorted(users.get(name, set()) - {key}, key=str))
                  for names in last for name in names}
        blocks[key] = Block(task, tuple(instrs), tuple(last), others)
    return blocks


def _runs(actions, blocks, batched_tasks) -> tuple:
    """Runs (tuples of action indices) of two or more consecutive actions of one
    batchable weight-gradient task."""
    keys = [(a.chunk, a.task) for a in actions]
    runs, run = [], []
    for i, key in enumerate(keys + [None]):
        if run and key == keys[run[0]]:
            run.append(i)
            continue
        if len(run) > 1:
            runs.append(tuple(run))
        run = [i] if key in batched_tasks else []
    return tuple(runs)


def comm_groups(plan, pid: int, local, gathers, state_points) -> tuple:
    """Every group process ``pid`` communicates in during a step, while gathering
    fetched values and while gathering the state, once each, in
    :attr:`~distgraph.plan.devices.CommGroup.key` order."""
    found: dict = {}
    seen: set = set()       # (mesh, mesh dim) of the collective steps met: the same groups
    scanned: set = set()    # ids of the p2p steps met (points share them; they stay alive)
    for point in list(local.points()) + list(gathers) + list(state_points):
        for step in point.steps:
            if step.kind.is_collective:
                where = (step.mesh, step.mesh_dim)
                if where in seen:       # (a world mesh's group costs ms to find: skipped)
                    continue
                seen.add(where)
            elif step.transfers:        # a p2p step's tiles are scanned once
                if id(step) in scanned:
                    continue
                scanned.add(id(step))
            for g in step_groups(step, pid, plan.ranks):
                found.setdefault(g.key, g)
    for index, members in local.op_groups():
        if pid in members and len(members) > 1:
            g = CommGroup(COLLECTIVE, plan.ranks.of(members),
                          f"op {local.program.ops[index].type}")
            found.setdefault(g.key, g)
    return tuple(found[k] for k in sorted(found))


def feed_rows(plan, pid: int) -> dict:
    """{input name: the ``(start, stop)`` rows of the batch ``pid`` reads of it, one range
    per micro-batch it runs in the order it runs them (None: a scalar)} for the inputs
    its local program has: its block of each micro-batch, or under an uneven split the
    rows the split gives it."""
    split = plan.batch_split
    mine = split is not None and any(pid in m for m in split.members)
    out = {}
    for v in plan.local(pid).program.inputs:
        value = plan.program.values[v.name]
        index = value.dist_attr.local_slices(value.shape, pid)
        if not index:
            out[v.name] = None
        elif mine:
            out[v.name] = split.rows(pid)
        else:
            acc = plan.accumulation
            b = acc.micro_batch_rows if acc is not None else value.shape[0]
            out[v.name] = tuple((m * b + index[0].start, m * b + index[0].stop)
                                for m in range(plan.micro_batches))
    return out


def micro_batch_positions(plan, pid: int) -> tuple:
    """Where each micro-batch ``pid`` runs sits in the batch, in micro-batches (0, 1, 2,
    ... unless an uneven split deals them otherwise)."""
    split = plan.batch_split
    if split is not None and split.micro_batched:
        return split.positions(pid)
    return tuple(range(plan.micro_batches))


def _rest(program, name: str, pid: int) -> tuple:
    """The slices of input ``name`` process ``pid`` holds along its dims after the first."""
    value = program.values[name]
    return tuple(value.dist_attr.local_slices(value.shape, pid)[1:])
