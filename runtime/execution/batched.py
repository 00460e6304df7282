"""Weight-gradient actions of several micro-batches run as one, on their rows joined.

Zero-bubble schedules leave weight-gradient (W) actions of one stage back to back, most
at the end of a step (``0W5 0W6 0W7``). A W task reads its micro-batch's activations and
output gradients and sums over the samples into parameter gradients, so run once on the
micro-batches' rows joined along their sample dim it gives the sum of their results: one
GEMM of g·b rows instead of g GEMMs of b rows, whose cost per row is higher. The carrier
runs a run of consecutive W actions of one stage so when :func:`batched_block` accepts
the task; otherwise (and for a lone W) micro-batch by micro-batch, as every other task.

What each operand is comes from the plan's accumulation (the same analysis that split
the batch, :mod:`distgraph.passes.pipeline.accumulate`): a Value carrying samples
(``split_axis``) is joined along that dim, a per-micro-batch sum over samples
(``partial``) is added up, anything else is the same in every micro-batch. An op runs
on joined rows when it treats rows alike and keeps them apart or sums over them
(:data:`ROW_OPS`; a ``reshape`` gets its sample dim's size times g), and on added-up sums
when it is linear in its one operand (``LINEAR_UNARY``), as is a reshard point on a sum
(a data-parallel stage's all-reduce: once for the group); its results must then carry
samples or be sums over them. The task's results the update reads are sums over the
samples: the group's sum is accumulated once. A task with a reshard point on rows, a
random or communicating op (kernel context), or an op outside these lists is not
batched.

Example::

    group = batched_block(tasks.blocks[(0, "backward_weight")], tasks)
    grads = group.run(envs, [5, 6, 7], scope, ctx, backend, point)   # {name: summed gradient}
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from distgraph.passes.pipeline.accumulate import LINEAR_UNARY
from distgraph.runtime.execution.executor import OpInstr, call_kernel
from distgraph.runtime.execution.tasks import PointInstr

# ops that treat the rows of a sample dim alike: on joined rows they give the joined
# results, or, where they sum over the samples (a weight gradient's matmul, a bias
# gradient's sum, embedding_grad's scatter-add), the sum of the results
ROW_OPS = ("matmul", "sum", "embedding_grad", "reshape", "transpose", "add", "subtract",
           "multiply", "neg", "scale")
ROWS, SUM, SAME = "rows", "sum", "same"


@dataclass(frozen=True)
class _Op:
    instr: object          # an OpInstr, or a PointInstr on a sum
    kinds: tuple           # per input: (ROWS, axis), (SUM, None) or (SAME, None)
    grow: int | None       # reshape: the dim of ``shape`` that holds the samples


@dataclass(frozen=True)
class BatchedBlock:
    """A W task that runs on several micro-batches at once; ``sums`` are the results
    the update reads."""

    ops: tuple
    sums: tuple

    def run(self, envs, micro_batches, scope, ctx, backend, point) -> dict:
        """{name: sum over ``micro_batches``} of the task's results, read from their
        environments ``envs[m]`` (and ``scope`` for persistables); ``point(instr, env)``
        runs a reshard point on the joined values and returns its result."""
        joined: dict = {}
        first = envs[micro_batches[0]]
        for op in self.ops:
            args = []
            for name, (kind, axis) in zip(op.instr.reads, op.kinds):
                if name in joined:
                    args.append(joined[name])
                elif kind == ROWS:
                    args.append(backend.concatenate([envs[m][name] for m in micro_batches],
                                                    axis))
                elif kind == SUM:
                    total = backend.copy(envs[micro_batches[0]][name])
                    for m in micro_batches[1:]:
                        total += envs[m][name]
                    args.append(total)
                else:
                    args.append(first[name] if name in first else scope[name])
            if isinstance(op.instr, PointInstr):
                out = point(op.instr, dict(zip(op.instr.reads, args)))
                joined.update((name, out) for name in op.instr.writes)
                continue
            attrs = op.instr.attrs
            if op.grow is not None:
                shape = list(attrs["shape"])
                shape[op.grow] *= len(micro_batches)
                attrs = {**attrs, "shape": tuple(shape)}
            result = call_kernel(op.instr.kernel, op.instr.op_type, op.instr.layer, ctx, args,
                                 attrs)
            joined.update(zip(op.instr.outs, result))
        return {name: joined[name] for name in self.sums}


def batched_block(block, tasks) -> BatchedBlock | None:
    """``block`` (a compiled W task of ``tasks``, :class:`~.tasks.CompiledTasks`) as a
    task on several micro-batches, or None where it cannot run so (module docstring)."""
    acc = tasks.plan.accumulation
    if acc is None or block.task.kind != "backward_weight":
        return None

    def kind(name):
        source = tasks.source_of.get(name, name)
        if source in acc.split_axis:
            return ROWS, acc.split_axis[source]
        return (SUM, None) if source in acc.partial else (SAME, None)

    ops, made = [], {}
    for instr in block.instrs:
        if isinstance(instr, PointInstr):
            kinds = tuple(made.get(n) or kind(n) for n in instr.reads)
            if len(kinds) != 1 or kinds[0][0] != SUM or instr.stores:
                return None
            made.update((n, (SUM, None)) for n in instr.writes)
            ops.append(_Op(instr, kinds, None))
            continue
        if not isinstance(instr, OpInstr) or instr.ctx or instr.writeback:
            return None
        kinds = tuple(made.get(n) or kind(n) for n in instr.ins)
        used = {k for k, _ in kinds}
        outs = [kind(n) for n in instr.outs]
        if used <= {SAME}:
            if any(k != SAME for k, _ in outs):
                return None
        elif SUM in used:
            if instr.op_type not in LINEAR_UNARY or len(kinds) != 1 or \
                    (instr.op_type == "scale" and instr.attrs.get("bias", 0.0)) or \
                    any(k != SUM for k, _ in outs):
                return None
        elif instr.op_type not in ROW_OPS or any(k == SAME for k, _ in outs):
            return None
        grow = None
        if instr.op_type == "reshape" and outs[0][0] == ROWS:
            grow = outs[0][1]
            if list(instr.attrs.get("shape", ())).count(-1):
                return None
        made.update(zip(instr.outs, outs))
        ops.append(_Op(dataclasses.replace(instr, donors=()), kinds, grow))
    written = [n for op in ops for n in op.instr.writes]
    sums = tuple(n for n in written if n in block.task.accumulates)
    dies_here = {n for names in block.last for n in names if not block.others.get(n)}
    if any(made[n][0] != SUM for n in sums) or \
            any(n not in dies_here for n in written if n not in sums):
        return None
    return BatchedBlock(tuple(ops), sums)
