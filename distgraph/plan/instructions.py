"""The instruction set of the runtime, and the blocks that compiled tasks are.

An :class:`OpInstr` is one op compiled: its kernel and the names it reads and writes. A
:class:`PointInstr` is a reshard point run in place on every process it involves; a
:class:`SendInstr` the send half of a point that crosses tasks (its steps up to the
point-to-point transfer, then the tiles to post); a :class:`RecvInstr` the receive half
(the tiles that arrived, assembled, then the steps after the transfer); a
:class:`GatherInstr` brings a fetched value to every process. A :class:`Block` is one
task compiled, with the names each instruction uses for the last time. A
:class:`BatchedTask` is a weight-gradient task the planner found can run on several
micro-batches' rows joined, with how each operand joins.

Example::

    instr = op_instr(program.ops[0])      # the first op of a Program, compiled
    str(instr)                            # "op 'matmul' in layer 'fc1'"
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from distgraph import dtypes
from distgraph.plan.reshard import ReshardPoint, ReshardStep
from distgraph.plan.tasks import Task
from distgraph.registry import get_op


@dataclass(frozen=True)
class OpInstr:
    """One op, compiled: its kernel and the names it reads and writes."""

    kernel: Callable
    op_type: str
    layer: str
    ins: tuple
    outs: tuple
    attrs: dict
    writeback: tuple      # (output position, persistable name)
    ctx: dict             # KernelContext fields from partition (random ops, groups)
    donors: tuple = ()    # inputs whose buffer may become the result
    axis: int | None = None   # the result's sample dim, for random ops' micro-batch slice
    out_dtypes: tuple = ()    # numpy dtypes of the results (16-bit ones are rounded to)
    keeps: bool = True        # its kernel may keep for its gradient (KernelContext.saved)

    @property
    def reads(self) -> tuple:
        return self.ins

    @property
    def writes(self) -> tuple:
        return self.outs

    def __str__(self) -> str:
        return f"op '{self.op_type}'" + (f" in layer '{self.layer}'" if self.layer else "")

    def __reduce__(self):
        # pickled without its kernel (often a lambda), found again by its op type
        fields = [getattr(self, f.name) for f in dataclasses.fields(self)[1:]]
        return _unpickled_instr, tuple(fields)


def _unpickled_instr(op_type, *fields) -> OpInstr:
    return OpInstr(get_op(op_type).kernel, op_type, *fields)


@dataclass(frozen=True)
class PointInstr:
    """A reshard point run in place on every process it involves (blocking)."""

    point: ReshardPoint
    reads: tuple
    writes: tuple
    stores: tuple

    def __str__(self) -> str:
        return str(self.point)


@dataclass(frozen=True)
class SendInstr:
    """Steps before the transfer (on the source mesh), then the tiles to post."""

    point: ReshardPoint
    head: tuple
    transfer: ReshardStep       # the point's send_recv step
    reads: tuple
    writes: tuple = ()

    def __str__(self) -> str:
        return f"send of {self.point}"


@dataclass(frozen=True)
class RecvInstr:
    """The tiles of ``transfer`` that arrived, assembled, then the steps after it."""

    point: ReshardPoint
    transfer: ReshardStep
    tail: tuple
    incoming: tuple           # (source process, shape) in arrival order
    reads: tuple
    writes: tuple

    def __str__(self) -> str:
        return f"receive of {self.point}"


@dataclass(frozen=True)
class GatherInstr:
    """Bring fetched value number ``index`` to every process (in the update)."""

    point: ReshardPoint
    index: int
    reads: tuple
    writes: tuple = ()

    def __str__(self) -> str:
        return f"gather of {self.point.value}"


@dataclass(frozen=True)
class Block:
    """A task compiled: its instructions; ``last[i]``: the names instruction i uses for
    the last time in this task; ``others[name]``: the other tasks of the process that
    use ``name`` (it dies once they too are done for the micro-batch)."""

    task: Task
    instrs: tuple
    last: tuple
    others: dict


@dataclass(frozen=True)
class BatchedOp:
    """One instruction of a :class:`BatchedTask`: an OpInstr, or a PointInstr on a sum;
    ``joins[i]``: how operand i joins over the micro-batches (an
    :class:`~distgraph.plan.kinds.AccumulationMode` and, for ``concat``, the axis);
    ``grow``: for a reshape, the dim of its ``shape`` that holds the samples."""

    instr: OpInstr | PointInstr
    joins: tuple
    grow: int | None


@dataclass(frozen=True)
class BatchedTask:
    """A weight-gradient task that runs on several micro-batches at once: its ``ops``,
    and ``sums``, the results the update reads (sums over the joined micro-batches)."""

    ops: tuple
    sums: tuple


def op_instr(op, ctx=None, axis=None, keeps: bool = True) -> OpInstr:
    """The instruction of Operation ``op`` (``ctx``: its extra KernelContext fields;
    ``keeps``: whether its kernel may keep for its gradient, :func:`keeps_nothing`)."""
    writeback = tuple((k, o.alias_of) for k, o in enumerate(op.outputs) if o.alias_of)
    return OpInstr(get_op(op.type).kernel, op.type, op.layer, tuple(v.name for v in op.inputs),
                   tuple(o.name for o in op.outputs), dict(op.attrs), writeback,
                   dict(ctx or {}), axis=axis,
                   out_dtypes=tuple(dtypes.numpy_dtype(o.dtype) for o in op.outputs),
                   keeps=keeps)


def keeps_nothing(ops) -> frozenset:
    """Indices of the ops among ``ops`` (a local program's, in order) whose kernel may
    keep for its gradient (an op's ``saved`` hook) but whose gradient (``<type>_grad`` of
    the same layer, the first after it) does not read the very operands it ran on, or
    does not run: in a recomputed segment the gradient reads the copies of its operands
    (or a recomputed copy of the op runs and keeps instead), and in evaluation no
    gradient runs. What such an op kept could never serve (the kernels check that the
    operands are the same arrays), so its instruction keeps nothing (``OpInstr.keeps``)
    and the gradient recomputes: recomputation frees MoE's activations too. The memory
    model follows the same rule."""
    out = []
    for i, op in enumerate(ops):
        if get_op(op.type).saved is None:
            continue
        grad = next((g for g in ops[i + 1:] if g.type == op.type + "_grad"
                     and g.layer == op.layer), None)
        if grad is None or [v.name for v in grad.inputs[:len(op.inputs)]] != \
                [v.name for v in op.inputs]:
            out.append(i)
    return frozenset(out)


def with_donors(instr: OpInstr, dying, values, feeds=()) -> OpInstr:
    """``instr`` with the inputs among ``dying`` that may hold its result (its op
    registered with ``donate``; same shape and dtype as its first output in
    ``values``, a {name: Value} map; not fed)."""
    if not get_op(instr.op_type).donate:
        return instr
    out = values[instr.outs[0]]
    donors = tuple(n for n in dict.fromkeys(instr.ins)
                   if n in dying and n not in feeds
                   and values[n].shape == out.shape and values[n].dtype == out.dtype)
    return dataclasses.replace(instr, donors=donors)


def last_uses(instrs, keep) -> list:
    """For each instruction, the names (not in ``keep``) it uses for the last time."""
    last: dict = {}
    for i, instr in enumerate(instrs):
        for name in instr.reads + instr.writes:
            last[name] = i
    frees: list = [[] for _ in instrs]
    for name, i in last.items():
        if name not in keep:
            frees[i].append(name)
    return [tuple(sorted(f)) for f in frees]
