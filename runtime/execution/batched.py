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


def run_batched(task, envs, micro_batches, scope, ctx, backend, point, ledger=None,
                emit=None, release=None) -> dict:
    """{name: sum over ``micro_batches``} of ``task``'s results (a
    :class:`~distgraph.plan.instructions.BatchedTask`), read from their environments
    ``envs[m]`` (and ``scope`` for persistables); ``point(instr, env)`` runs a reshard
    point on the joined values and returns its result. ``ledger`` (the step's
    :class:`~distgraph.runtime.execution.memory.Ledger`; None: one of its own) counts the
    joined operands while their op runs and each result to its last use in the task.

    ``emit(name, value)``, if given, takes each sum at its last use in the task instead
    of the returned dict, so that the caller adds it to its accumulation while the task
    runs on; ``release(name)``, if given, is told when the task has read a micro-batch
    operand for the last time (a joined or added-up one as soon as its joined copy is
    made, before the op runs), so that the caller drops the micro-batches' own arrays
    then. With both, a run of g micro-batches holds what their W actions run one by one
    would, plus the copies one op joins; a run that held its results to its end and the
    originals to the group's end held every parameter gradient of the chunk a second
    time and each operand twice (ZB's last stage: 15% above the plan's estimate).
    Without ``emit`` the sums are handed back uncounted by the ledger."""
    ledger = Ledger(backend) if ledger is None else ledger
    joined = Counted(ledger)
    first = envs[micro_batches[0]]
    action = ledger.at[0]
    last = {}
    for k, op in enumerate(task.ops):
        for name in op.instr.reads:
            last[name] = k
    sums = {}
    for k, op in enumerate(task.ops):
        ledger.at = (action, op.instr)
        args, made, kept = [], [], []
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
            elif name in first:
                args.append(first[name])
                kept.append(name)
            else:
                args.append(scope[name])
        ledger.hold(made)
        if release is not None:
            # the joined copies stand in for the micro-batches' own arrays from here
            for name, (mode, _) in dict(zip(op.instr.reads, op.joins)).items():
                if mode is not AccumulationMode.KEEP and last[name] == k and \
                        name not in joined:
                    release(name)
        if isinstance(op.instr, PointInstr):
            out = point(op.instr, dict(zip(op.instr.reads, args)))
            results = [(name, out) for name in op.instr.writes]
        else:
            attrs = op.instr.attrs
            if op.grow is not None:
                shape = list(attrs["shape"])
                shape[op.grow] *= len(micro_batches)
                attrs = {**attrs, "shape": tuple(shape)}
            results = list(zip(op.instr.outs, call_kernel(op.instr, ctx, args, attrs)))
        joined.update(results)
        ledger.drop(made)
        if release is not None:
            for name in dict.fromkeys(kept):
                if last[name] == k:
                    release(name)
        for name in dict.fromkeys(op.instr.reads):
            if last[name] == k and name in joined and name not in task.sums:
                joined.pop(name)
        for name, _ in results:
            if name not in task.sums and name not in last:
                joined.pop(name, None)      # read by nothing after: dies here
        for name in task.sums:
            if name in joined and last.get(name, -1) <= k:
                value = joined.pop(name)
                if emit is not None:
                    emit(name, value)
                else:
                    sums[name] = value
    joined.clear()
    return sums
