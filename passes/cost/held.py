"""What a micro-batch holds between the actions of a known schedule, per chunk: the
figures the estimate's :func:`~distgraph.passes.cost.stage.held_by_action` replays a
process's schedule with (:mod:`distgraph.passes.cost.estimate`).

:func:`action_holds` reads them off the process's tasks (the task graph): which action
each op runs in, which chunk and action make each value, and the bytes a micro-batch
keeps from its I to its W under zero bubble (what the deferred weight gradients read);
:func:`run_order` the order in which one micro-batch runs the program's items (a chunk's
W after its whole I, wherever the program puts each layer's weight gradient);
:func:`kernels_keep` what kernels keep for their gradients beyond any Value.

Example::

    task_of, made, after_input = action_holds(plan, pid, local, nbytes)
    task_of[12]              # (1, "I"): local op 12 runs in chunk 1's input gradient
"""

from __future__ import annotations

from distgraph.ir import Role
from distgraph.plan.instructions import keeps_nothing
from distgraph.plan.kinds import ItemKind
from distgraph.registry import TensorType, get_op


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


def run_order(order, tasks: list, roles: list) -> list:
    """The indices of a local program's items (``tasks[k]``: the (chunk, letter) of item
    k, None outside the micro-batches' tasks; ``roles[k]``: its role) in the order one
    micro-batch runs them under ``order`` (the process's schedule): by its first
    micro-batch's actions, the program's order within a task. An item outside the tasks
    goes with the item before it, an update after them all. Under 1F1B this is the
    program's order; under zero bubble the W items of a chunk follow its I items.

    Example::

        run_order(order, [(0, "F"), (0, "W"), (0, "I")], ["forward"] + ["backward"] * 2)
        # [0, 2, 1]: 0F, 0I, 0W
    """
    first = order[0].micro_batch
    rank = {}
    for a in order:
        if a.micro_batch == first:
            rank.setdefault((a.chunk, a.kind), len(rank))
    keys, at = [], -1
    for k, (task, role) in enumerate(zip(tasks, roles)):
        if role == Role.OPTIMIZE and task is None:
            keys.append((len(rank), k))
            continue
        at = rank.get(task, at)
        keys.append((at, k))
    return [k for _, k in sorted(keys)]


def kernels_keep(local, scale) -> tuple[dict, dict]:
    """What kernels keep for their gradients beyond any Value (an op's ``saved`` hook:
    ``moe_ffn``'s routes, rows and activations), as a name live from the op to its
    gradient: ({op index: (names read, names written)}, {name: bytes}). The runtime
    keeps them per layer and op (``KernelContext.saved``): the forward writes them and
    ``<type>_grad`` of the same layer takes them, except where they could never serve
    that gradient (a recomputed segment's: :func:`~distgraph.plan.instructions.
    keeps_nothing`, the gradient then recomputes them). ``scale``: the estimate's rows
    per process (``rows``, and ``axis(name)``: the dim a Value carries samples on)."""
    out: dict = {}
    sizes: dict = {}
    keeping_nothing = keeps_nothing(local.program.ops)
    for i, op in enumerate(local.program.ops):
        hook = get_op(op.type).saved
        if hook is not None and i not in keeping_nothing:
            name = f"{op.layer}@KEPT@{op.type}"
            ins = [TensorType(v.shape, v.dtype) for v in op.inputs]
            rows = scale.rows if scale.axis(op.inputs[0].name) is not None else 1.0
            sizes[name] = hook(op.attrs, local.op_context.get(i, {}), ins) * rows
            out[i] = ((), (name,))
        elif op.type.endswith("_grad"):
            name = f"{op.layer}@KEPT@{op.type[:-len('_grad')]}"
            if name in sizes:
                out[i] = ((name,), ())
    return out, sizes
