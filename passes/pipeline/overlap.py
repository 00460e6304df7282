"""Where one process starts communication ahead (``Strategy(overlap=True)``), for its
compiled program: the action and instruction after which each gradient bucket's
reductions start (:class:`~distgraph.plan.buckets.StartAt`), and the groups of each
task's ZeRO-3 parameter gathers that are prefetched a layer ahead. The buckets and
groups themselves are :mod:`distgraph.plan.buckets`' (the estimate prices the same ones).

Example::

    starts = bucket_starts(plan, local, blocks, update, actions, runs)
    groups = prefetched(local, blocks)
"""

from __future__ import annotations

from types import MappingProxyType

from distgraph.plan.buckets import (AFTER_ACTION, StartAt, gradient_buckets, prefetch_groups,
                                    prefetch_unit, prefetchable)
from distgraph.plan.instructions import OpInstr, PointInstr
from distgraph.plan.kinds import ItemKind



def bucket_starts(plan, local, blocks: dict, update, actions, runs) -> tuple:
    """The :class:`StartAt` of every gradient bucket of ``local`` whose reductions the
    update (``update``, a Block) runs: after the last instruction, in the schedule's
    ``actions``, that makes one of its gradients (the last micro-batch's; for an action
    in a batched run of weight gradients, ``runs``, once that run is done)."""
    reductions = {instr.point.seq for instr in update.instrs if isinstance(instr, PointInstr)}
    op_at = {}
    for key, block in blocks.items():
        for j, it in enumerate(block.task.items):
            if it.kind is ItemKind.OP:
                op_at[it.index] = (key, j)
    last = {}
    for i, a in enumerate(actions):
        last[(a.chunk, a.task)] = i
    ends = {i: run[-1] for run in runs for i in run}
    producer = {o.name: i for i, op in enumerate(local.program.ops) for o in op.outputs}
    points = {p.seq: p for p in local.points()}
    out = []
    for bucket in gradient_buckets(local, plan.strategy.bucket_mb):
        seqs = tuple(s for s in bucket.points if s in reductions)
        when = []
        for seq in seqs:
            key, j = op_at.get(producer[points[seq].reads[0]], (None, None))
            if key not in last:
                break
            i = last[key]
            when.append((ends[i], float("inf")) if i in ends else (i, j))
        if seqs and len(when) == len(seqs):
            i, j = max(when)
            out.append(StartAt(seqs, i, AFTER_ACTION if j == float("inf") else j))
    return tuple(out)


def prefetched(local, blocks: dict) -> MappingProxyType:
    """{block key: groups of instruction positions} of the per-micro-batch tasks with two
    or more groups of ZeRO-3 parameter gathers (:func:`~distgraph.plan.buckets.
    prefetch_groups`; a group's layer is the :func:`~distgraph.plan.buckets.prefetch_unit`
    of the first op after it that reads one of its gathered values)."""
    out = {}
    for key, block in blocks.items():
        if not block.task.per_micro_batch:
            continue
        instrs = block.instrs
        found, layer_of, position = [], {}, {}
        for j, instr in enumerate(instrs):
            if isinstance(instr, PointInstr) and prefetchable(instr.point, local):
                name = instr.writes[0]
                reader = next((x for x in instrs[j + 1:]
                               if isinstance(x, OpInstr) and name in x.ins), None)
                if reader is None:
                    continue
                found.append(instr.point.seq)
                layer_of[instr.point.seq] = prefetch_unit(reader.layer)
                position[instr.point.seq] = j
        groups = prefetch_groups(found, layer_of)
        if len(groups) > 1:
            out[key] = tuple(tuple(position[s] for s in g) for g in groups)
    return MappingProxyType(out)
