"""Helpers shared by op entries: op tables, type inference, FLOP counts, gradient plumbing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from distgraph.errors import DistGraphError
from distgraph.registry import DTypeError, ShapeError, TensorType, nbytes, register, size
from distgraph.spmd import Rule
from distgraph.trace import current_builder, emit1


@dataclass(frozen=True)
class Row:
    """One op of a table of alike ops (elementwise, reductions, softmax): what sets it
    apart from its family. ``kernel(ctx, *arrays, **attrs)`` and ``grad(op, dz)`` as in
    :mod:`distgraph.registry`; ``flops``: FLOPs per element of the result, or the
    registry's ``flops(ins, outs, **attrs)``. ``infer`` and ``spmd`` override the
    family's (``None``: the family's). ``workspace``: the temporaries its kernel
    allocates beyond its result, in arrays of the result's size, or the registry's
    ``workspace(ins, outs, **attrs)`` (bytes).

    Example: ``Row("exp", lambda ctx, x: ctx.xp.exp(x), lambda op, dz: [...])``.
    """

    name: str
    kernel: Callable
    grad: Callable | None = None
    flops: int | Callable | None = None
    donate: bool = False
    infer: Callable | None = None
    spmd: Rule | None = None
    workspace: float | Callable = 0


def register_rows(rows, *, infer=None, spmd=None, flops=1, differentiable=True) -> None:
    """Register one registry entry per row of a table; the keywords are the family's:
    its ``infer``, its sharding rule ``spmd`` (rules hold no state: the rows share it), its
    ``flops``, and ``differentiable=False`` for a table of gradient ops (rows without
    ``grad``)."""
    for row in rows:
        count = flops if row.flops is None else row.flops
        register(row.name, spmd=spmd if row.spmd is None else row.spmd,
                 infer=infer if row.infer is None else row.infer, kernel=row.kernel, grad=row.grad,
                 flops=elementwise_flops(count) if isinstance(count, int) else count,
                 differentiable=differentiable, donate=row.donate,
                 workspace=row.workspace if callable(row.workspace) else
                 results_times(row.workspace))


def results_times(k: float):
    """A ``workspace`` hook: ``k`` arrays the size of the first result (None for 0)."""
    if not k:
        return None
    return lambda ins, outs, **attrs: k * nbytes(outs[0])


# Elements per buffer of numpy's ufunc loops that cast (np.getbufsize()): a buffer per
# operand; CuPy's kernels cast in registers.
BUFFER = 8192


def ufunc_buffers(*itemsizes) -> int:
    """Bytes of numpy's buffers for a casting ufunc of operands of ``itemsizes``."""
    return BUFFER * sum(itemsizes)


def reduced_bytes(t: TensorType, axis: int = -1) -> int:
    """Bytes of ``t`` reduced over ``axis`` (a row statistic: a max, a sum, a norm)."""
    return nbytes(t) // max(t.shape[axis], 1) if t.shape else nbytes(t)


def dot_along(xp, a, b, axis: int = -1):
    """``sum(a * b, axis, keepdims=True)`` of same-shape ``a`` and ``b`` as one einsum,
    without the product's array (a kernel's workspace)."""
    letters = "abcdefghijklmnopqrstuvwxyz"[:a.ndim]
    axis %= a.ndim
    out = letters[:axis] + letters[axis + 1:]
    return xp.expand_dims(xp.einsum(f"{letters},{letters}->{out}", a, b), axis)


def broadcast_shapes(*shapes) -> tuple:
    rank = max(len(s) for s in shapes)
    out = []
    for i in range(rank):
        dims = {s[i - rank + len(s)] for s in shapes if i - rank + len(s) >= 0}
        dims.discard(1)
        if len(dims) > 1:
            raise ShapeError(f"shapes {' and '.join(str(list(s)) for s in shapes)} do not "
                             f"broadcast (dim {i - rank})")
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def same_dtype(*ts: TensorType) -> str:
    dts = {t.dtype for t in ts}
    if len(dts) > 1:
        raise DTypeError(f"operand dtypes differ: {', '.join(sorted(dts))}; cast one first")
    return dts.pop()


def broadcast_infer(*ts: TensorType) -> TensorType:
    return TensorType(broadcast_shapes(*(t.shape for t in ts)), same_dtype(*ts))


def normalize_axes(axis, rank: int) -> tuple:
    if axis is None:
        return tuple(range(rank))
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    out = []
    for a in axes:
        if not -rank <= a < max(rank, 1):
            raise ShapeError(f"axis {a} is out of range for rank {rank}")
        out.append(a % rank if rank else 0)
    return tuple(sorted(set(out)))


def elementwise_flops(per_element: int):
    def flops(ins, outs, **attrs):
        return per_element * size(outs[0])
    return flops


def reduce_to_shape(g, shape):
    """Sum a broadcast gradient back to ``shape`` (the operand's shape). Emits the ops by
    name: the functional wrappers live in modules that import this one."""
    shape = tuple(shape)
    if tuple(g.shape) == shape:
        return g
    lead = len(g.shape) - len(shape)
    axes = list(range(lead))
    axes += [lead + i for i, n in enumerate(shape) if n == 1 and g.shape[lead + i] != 1]
    out = emit1("sum", [g], {"axis": tuple(axes), "keepdim": False}) if axes else g
    if tuple(out.shape) != shape:
        out = emit1("reshape", [out], {"shape": shape})
    return out


def zeros(shape, dtype: str):
    """A Value of zeros of ``shape`` (a gradient that no consumer gave)."""
    return emit1("full", [], {"shape": tuple(shape), "value": 0.0, "dtype": dtype})


def constant(value, dtype: str):
    """A 0-d constant Value (Python scalars in arithmetic become these)."""
    return emit1("full", [], {"shape": (), "value": float(value), "dtype": dtype})


def as_tensor_pair(x, y):
    """Turn a Python scalar operand into a 0-d constant of the other operand's dtype."""
    if isinstance(x, (int, float)) and isinstance(y, (int, float)):
        raise DistGraphError("at least one operand must be a traced tensor")
    b = current_builder()
    if isinstance(x, (int, float)):
        y = b.as_value(y)
        x = constant(x, y.dtype)
    elif isinstance(y, (int, float)):
        x = b.as_value(x)
        y = constant(y, x.dtype)
    return x, y
