"""Which weight-gradient tasks run on several micro-batches at once, on their rows joined.

Zero-bubble schedules leave weight-gradient (W) actions of one stage back to back, most
at the end of a step (``0W5 0W6 0W7``). A W task reads its micro-batch's activations and
output gradients and sums over the samples into parameter gradients, so run once on the
micro-batches' rows joined along their sample dim it gives the sum of their results: one
GEMM of g·b rows instead of g GEMMs of b rows, whose cost per row is higher. The planner
decides here which W tasks can run so (:func:`batched_task`), and the compiler which runs
of consecutive W actions do; the runtime runs them
(:mod:`distgraph.runtime.execution.batched`).

What each operand is comes from the plan's accumulation (the same analysis that split
the batch, :mod:`.accumulate`): a Value carrying samples (``split_axis``) is joined
along that dim (``concat``), a per-micro-batch sum over samples (``partial``) is added up
(``sum``), anything else is the same in every micro-batch (``keep``). An op runs on
joined rows when it treats rows alike and keeps them apart or sums over them
(:data:`ROW_OPS`; a ``reshape`` gets its sample dim's size times g), and on added-up sums
when it is linear in its one operand (``LINEAR_UNARY``), as is a reshard point on a sum
(a data-parallel stage's all-reduce: once for the group); its results must then carry
samples or be sums over them. The task's results the update reads are sums over the
samples: the group's sum is accumulated once. A task with a reshard point on rows, a
random or communicating op (kernel context), or an op outside these lists is not
batched.

Example::

    batched = batched_task(block, plan.accumulation, source_of)   # None: not batchable
"""

from __future__ import annotations

import dataclasses

from distgraph.passes.pipeline.accumulate import LINEAR_UNARY
from distgraph.plan.instructions import BatchedOp, BatchedTask, OpInstr, PointInstr
from distgraph.plan.kinds import AccumulationMode, TaskKind

# ops that treat the rows of a sample dim alike: on joined rows they give the joined
# results, or, where they sum over the samples (a weight gradient's matmul, a bias
# gradient's sum, embedding_grad's scatter-add), the sum of the results
ROW_OPS = ("matmul", "sum", "embedding_grad", "reshape", "transpose", "add", "subtract",
           "multiply", "neg", "scale")
CONCAT, SUM, KEEP = AccumulationMode.CONCAT, AccumulationMode.SUM, AccumulationMode.KEEP


def batched_task(block, acc, source_of) -> BatchedTask | None:
    """``block`` (a compiled W task) as a task on several micro-batches, or None where it
    cannot run so (module docstring); ``source_of`` says which Value each local name
    holds."""
    if acc is None or block.task.kind is not TaskKind.BACKWARD_WEIGHT:
        return None

    def join(name):
        source = source_of.get(name, name)
        if source in acc.split_axis:
            return CONCAT, acc.split_axis[source]
        return (SUM, None) if source in acc.partial else (KEEP, None)

    ops, made = [], {}
    for instr in block.instrs:
        if isinstance(instr, PointInstr):
            joins = tuple(made.get(n) or join(n) for n in instr.reads)
            if len(joins) != 1 or joins[0][0] is not SUM or instr.stores:
                return None
            made.update((n, (SUM, None)) for n in instr.writes)
            ops.append(BatchedOp(instr, joins, None))
            continue
        if not isinstance(instr, OpInstr) or instr.ctx or instr.writeback:
            return None
        joins = tuple(made.get(n) or join(n) for n in instr.ins)
        used = {k for k, _ in joins}
        outs = [join(n) for n in instr.outs]
        if used <= {KEEP}:
            if any(k is not KEEP for k, _ in outs):
                return None
        elif SUM in used:
            if instr.op_type not in LINEAR_UNARY or len(joins) != 1 or \
                    (instr.op_type == "scale" and instr.attrs.get("bias", 0.0)) or \
                    any(k is not SUM for k, _ in outs):
                return None
        elif instr.op_type not in ROW_OPS or any(k is KEEP for k, _ in outs):
            return None
        grow = None
        if instr.op_type == "reshape" and outs[0][0] is CONCAT:
            grow = outs[0][1]
            if list(instr.attrs.get("shape", ())).count(-1):
                return None
        made.update(zip(instr.outs, outs))
        ops.append(BatchedOp(dataclasses.replace(instr, donors=()), joins, grow))
    written = [n for op in ops for n in op.instr.writes]
    sums = tuple(n for n in written if n in block.task.accumulates)
    dies_here = {n for names in block.last for n in names if not block.others.get(n)}
    if any(made[n][0] is not SUM for n in sums) or \
            any(n not in dies_here for n in written if n not in sums):
        return None
    return BatchedTask(tuple(ops), sums)
