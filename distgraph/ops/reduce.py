"""Reductions: sum, mean (linear: a split reduced dim gives a Partial result) and max
(non-linear: the reduced dims are never split).

Sharding: ``"abc->ac"`` for sum over axis 1: S(b) -> P; ``"aBc->ac"`` for max.
"""

from __future__ import annotations

from distgraph.ops.common import Row, elementwise_flops, normalize_axes, register_rows
from distgraph.ops.elementwise import scale_
from distgraph.ops.shape import broadcast_to, reshape
from distgraph.registry import TensorType, register_op, size
from distgraph.spmd import LETTERS, EinsumRule, axes_of
from distgraph.trace import emit1


def _reduced_shape(shape, axes, keepdim):
    if keepdim:
        return tuple(1 if i in axes else n for i, n in enumerate(shape))
    return tuple(n for i, n in enumerate(shape) if i not in axes)


def reduce_notation(upper: bool):
    def notation(in_shapes, attrs):
        rank = len(in_shapes[0])
        axes = set(axes_of(attrs["axis"], rank))
        word = "".join(LETTERS[i].upper() if (upper and i in axes) else LETTERS[i]
                       for i in range(rank))
        if attrs.get("keepdim"):
            out = "".join("1" if i in axes else c for i, c in enumerate(word))
        else:
            out = "".join(c for i, c in enumerate(word) if i not in axes)
        return f"{word}->{out}"
    notation.__name__ = "max_reduce" if upper else "sum_reduce"
    return notation


def _reduce_flops(ins, outs, **attrs):
    return size(ins[0])


def _reduce_infer(x, axis, keepdim=False):
    return TensorType(_reduced_shape(x.shape, axis, keepdim), x.dtype)


def _sum_grad(op, dz):
    x = op.inputs[0]
    axes = op.attrs["axis"]
    if not op.attrs.get("keepdim"):
        dz = reshape(dz, [1 if i in axes else n for i, n in enumerate(x.shape)])
    return [broadcast_to(dz, x.shape)]


def _max_grad(op, dz):
    x, y = op.inputs[0], op.outputs[0]
    axes = op.attrs["axis"]
    if not op.attrs.get("keepdim"):
        keep = [1 if i in axes else n for i, n in enumerate(x.shape)]
        dz, y = reshape(dz, keep), reshape(y, keep)
    return [emit1("max_grad", [x, y, dz])]


# Row(name, kernel, grad, spmd); one FLOP per element read.
REDUCE = (
    # "abc->ac" over axis 1: S(1) -> P (a split reduced dim leaves partial sums)
    Row("sum", lambda ctx, x, axis, keepdim=False: ctx.xp.sum(x, axis=axis, keepdims=keepdim),
        _sum_grad, spmd=EinsumRule(reduce_notation(upper=False))),
    # "aBc->ac" over axis 1: S(0) -> S(0); the reduced dim is never split
    Row("max", lambda ctx, x, axis, keepdim=False: ctx.xp.max(x, axis=axis, keepdims=keepdim),
        _max_grad, spmd=EinsumRule(reduce_notation(upper=True))),
)
register_rows(REDUCE, infer=_reduce_infer, flops=_reduce_flops)


@register_op("max_grad", spmd=EinsumRule(lambda s, a: _max_grad_notation(s)), differentiable=False)
class MaxGrad:
    """dx = dy where x equals the (kept-dim) maximum, else 0."""

    flops = elementwise_flops(2)

    def infer(x, y, dy):
        return x

    def kernel(ctx, x, y, dy):
        out = ctx.xp.equal(x, y, out=ctx.xp.empty(x.shape, dy.dtype))
        out *= dy
        return out


def _max_grad_notation(in_shapes):
    x, y, _ = in_shapes
    word = "".join(LETTERS[i] if n == y[i] else LETTERS[i].upper() for i, n in enumerate(x))
    kept = "".join("1" if c.isupper() else c for c in word)
    return f"{word},{kept},{kept}->{word}"


def sum(x, axis=None, keepdim=False):  # noqa: A001  (Paddle's name)
    return emit1("sum", [x], {"axis": normalize_axes(axis, len(x.shape)), "keepdim": bool(keepdim)})


def mean(x, axis=None, keepdim=False):
    axes = normalize_axes(axis, len(x.shape))
    n = 1
    for a in axes:
        n *= x.shape[a]
    return scale_(sum(x, axes, keepdim), 1.0 / n)


def max(x, axis=None, keepdim=False):  # noqa: A001
    return emit1("max", [x], {"axis": normalize_axes(axis, len(x.shape)), "keepdim": bool(keepdim)})
