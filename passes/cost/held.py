"""What a micro-batch holds between the actions of a known schedule, per chunk: the
figures the estimate's :func:`~distgraph.passes.cost.terms.held_by_order` replays a
process's schedule with (:mod:`distgraph.passes.cost.estimate`).

:func:`action_holds` reads them off the process's tasks (the task graph): which action
each op runs in, which chunk and action make each value, and the bytes a micro-batch
keeps from its I to its W under zero bubble (what the deferred weight gradients read).

Example::

    task_of, made, after_input = action_holds(plan, pid, local, nbytes)
    task_of[12]              # (1, "I"): local op 12 runs in chunk 1's input gradient
"""

from __future__ import annotations

from distgraph.plan.kinds import ItemKind


def action_holds(plan, pid: int, local, nbytes) -> tuple:
    """({local op: its (chunk, action letter)}, {value: the (chunk, letter) that makes
    it}, {chunk: bytes a micro-batch keeps from its I to its W}) of process ``pid`` (its group's first where its own tasks
    were not cut), ``local`` its local program, ``nbytes(value)`` the bytes of a Value.
    A value made by a forward or I action and read by chunk c's W is kept to c's W (the
    state is not counted: it persists)."""
    graph = plan.graph
    tasks = graph.tasks_of(pid) or graph.tasks_of(plan.group_of(pid)[0])
    ops, values = local.program.ops, local.program.values
    points = {p.seq: p for p in local.points()}      # as this process runs them
    task_of, made, read = {}, {}, {}
    for (chunk, kind), task in tasks.items():
        if chunk is None or not kind.per_micro_batch:
            continue
        key = (chunk, kind.action)
        for it in task.items:
            if it.kind is ItemKind.OP:
                task_of[it.index] = key
                ins = [v.name for v in ops[it.index].inputs]
                outs = [o.name for o in ops[it.index].outputs if not o.alias_of]
            elif it.kind in (ItemKind.POINT, ItemKind.SEND, ItemKind.RECV):
                point = points[it.index]
                ins = point.reads if it.kind is not ItemKind.RECV else ()
                outs = point.writes if it.kind is not ItemKind.SEND else ()
            else:
                continue
            for name in outs:
                made.setdefault(name, key)
            for name in ins:
                read.setdefault(name, set()).add(key)
    keep = {v.name for v in local.program.persistables}
    after_input: dict = {}
    for name, (_, letter) in made.items():
        later = [c for c, kind in read.get(name, ()) if kind == "W"]
        if letter in "FI" and later and name not in keep and name in values:
            after_input[min(later)] = after_input.get(min(later), 0) + nbytes(values[name])
    return task_of, made, after_input
