"""Run a weight-gradient task on several micro-batches at once, on their rows joined.

The planner decided which tasks can (:mod:`distgraph.passes.pipeline.batched`) and which
runs of consecutive actions do (``ProcessProgram.batched``); :func:`run_batched` runs one
such run: each operand joined as the plan's :class:`~distgraph.plan.instructions.BatchedTask`
says (rows concatenated along their sample dim, per-micro-batch sums added up, the rest
taken from the first micro-batch), then the task's ops once.

Example::

    grads = run_batched(task, envs, [5, 6, 7], scope, ctx, backend, point)
"""

from __future__ import annotations

from distgraph.plan.instructions import PointInstr
from distgraph.plan.kinds import AccumulationMode
from distgraph.runtime.execution.executor import call_kernel
from distgraph.runtime.execution.memory import Counted, Ledger


def run_batched(task, envs, micro_batches, scope, ctx, backend, point, ledger=None) -> dict:
    """{name: sum over ``micro_batches``} of ``task``'s results (a
    :class:`~distgraph.plan.instructions.BatchedTask`), read from their environments
    ``envs[m]`` (and ``scope`` for persistables); ``point(instr, env)`` runs a reshard
    point on the joined values and returns its result. ``ledger`` (the step's
    :class:`~distgraph.runtime.execution.memory.Ledger`; None: one of its own) counts the
    joined operands while their op runs, and the results until the task ends."""
    ledger = Ledger(backend) if ledger is None else ledger
    joined = Counted(ledger)
    first = envs[micro_batches[0]]
    action = ledger.at[0]
    for op in task.ops:
        ledger.at = (action, op.instr)
        args, made = [], []
        for name, (mode, axis) in zip(op.instr.reads, op.joins):
            if name in joined:
                args.append(joined[name])
            elif mode is AccumulationMode.CONCAT:
                made.append(backend.concatenate([envs[m][name] for m in micro_batches], axis))
                args.append(made[-1])
            elif mode is AccumulationMode.SUM:
                total = backend.copy(envs[micro_batches[0]][name])
                for m in micro_batches[1:]:
                    total += envs[m][name]
                made.append(total)
                args.append(total)
            else:
                args.append(first[name] if name in first else scope[name])
        ledger.hold(made)
        if isinstance(op.instr, PointInstr):
            out = point(op.instr, dict(zip(op.instr.reads, args)))
            joined.update((name, out) for name in op.instr.writes)
        else:
            attrs = op.instr.attrs
            if op.grow is not None:
                shape = list(attrs["shape"])
                shape[op.grow] *= len(micro_batches)
                attrs = {**attrs, "shape": tuple(shape)}
            result = call_kernel(op.instr, ctx, args, attrs)
            joined.update(zip(op.instr.outs, result))
        ledger.drop(made)
    sums = {name: joined[name] for name in task.sums}
    joined.clear()
    return sums
