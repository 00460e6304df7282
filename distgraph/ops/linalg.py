"""Matrix multiplication with optional transposes and broadcast batch dims.

Sharding: einsum notation built from ranks and flags, e.g. ``"bmk,kn->bmn"``:
S(m) x R -> S(m); R x S(n) -> S(n); S(k) x S(k) -> P; a broadcast batch dim is never split.
With the ``meshslice`` attribute set (``Strategy(meshslice=...)`` or ``shard_op(...,
meshslice=...)`` set it), also MeshSlice's 2-D layouts, e.g. OS on mesh dims (x, y):
[x, y] x [x, y] -> [x, y], run by :mod:`distgraph.ops.meshslice` with K sliced,
overlapped collectives (:mod:`distgraph.spmd.meshslice` lists the layouts).
"""

from __future__ import annotations

from distgraph.ops import meshslice as ms
from distgraph.ops.common import broadcast_shapes, reduce_to_shape, same_dtype
from distgraph.ops.shape import reshape
from distgraph.registry import ShapeError, TensorType, register_op, size
from distgraph.spmd import SpmdRuleError
from distgraph.spmd.meshslice import MatmulRule, slices_setting
from distgraph.trace import emit1

BATCH = "abcdefgh"


def _mk(shape, trans):
    m, k = shape[-2:]
    return (k, m) if trans else (m, k)


def matmul_notation(in_shapes, attrs) -> str:
    x, y = in_shapes
    bx, by = x[:-2], y[:-2]
    rank = max(len(bx), len(by))
    out_b = broadcast_shapes(bx, by) if rank else ()
    batch = BATCH[:rank]

    def word(b):
        off = rank - len(b)
        return "".join("1" if n == 1 and out_b[off + i] != 1 else batch[off + i]
                       for i, n in enumerate(b))

    wx = word(bx) + ("km" if attrs.get("transpose_x") else "mk")
    wy = word(by) + ("nk" if attrs.get("transpose_y") else "kn")
    return f"{wx},{wy}->{batch}mn"


@register_op("matmul", spmd=MatmulRule(matmul_notation))
class Matmul:
    """``x @ y`` (``transpose_x`` / ``transpose_y`` swap the last two dims first).
    ``meshslice`` (None: off; ``"auto"`` or K) lets the op run as MeshSlice where its
    operands come in one of MeshSlice's layouts; the planner turns ``"auto"`` into the K
    the cost model picks."""

    def infer(x, y, transpose_x=False, transpose_y=False, meshslice=None):
        try:
            slices_setting(meshslice)
        except SpmdRuleError as e:
            raise ShapeError(str(e)) from None
        if len(x.shape) < 2 or len(y.shape) < 2:
            raise ShapeError("matmul needs operands of rank >= 2")
        m, k = _mk(x.shape, transpose_x)
        k2, n = _mk(y.shape, not transpose_y)[::-1]
        if k != k2:
            raise ShapeError(f"contracted dims differ: {k} vs {k2} (transpose_x={transpose_x}, "
                             f"transpose_y={transpose_y})")
        batch = broadcast_shapes(x.shape[:-2], y.shape[:-2])
        return TensorType(batch + (m, n), same_dtype(x, y))

    def kernel(ctx, x, y, transpose_x=False, transpose_y=False, meshslice=None):
        if isinstance(meshslice, ms.LocalMeshSlice):
            return ms.run(ctx, x, y, transpose_x, transpose_y, meshslice)
        xp = ctx.xp
        if transpose_y:
            y = xp.swapaxes(y, -1, -2)
        if x.ndim > 2 and y.ndim == 2 and not transpose_x:
            # A Linear layer: one GEMM over all rows. The array libraries run a stacked
            # matmul as one GEMM per batch entry, each packing the whole weight again: with
            # few rows per entry (a sequence split) that is several times slower.
            rows = x.reshape(-1, x.shape[-1])
            return xp.matmul(rows, y).reshape(x.shape[:-1] + (y.shape[-1],))
        if transpose_x:
            x = xp.swapaxes(x, -1, -2)
        return xp.matmul(x, y)

    def flops(ins, outs, transpose_x=False, transpose_y=False, meshslice=None):
        k = ins[0].shape[-2] if transpose_x else ins[0].shape[-1]
        return 2 * size(outs[0]) * k

    localize = ms.localize
    comm = ms.comm
    overlap = ms.overlap

    def grad(op, dz):
        x, y = op.inputs
        tx, ty = op.attrs.get("transpose_x", False), op.attrs.get("transpose_y", False)
        # the backward GeMMs run as MeshSlice too (other dataflows on the same layouts)
        slices = op.attrs.get("meshslice")
        if len(y.shape) == 2 and len(x.shape) > 2 and not tx:
            # Linear layers: fold the batch dims so dW is one 2-D matmul, not a batched one
            # followed by a sum.
            x2 = reshape(x, [-1, x.shape[-1]])
            dz2 = reshape(dz, [-1, dz.shape[-1]])
            dy = _matmul(dz2, x2, True, False, slices) if ty else _matmul(x2, dz2, True, False,
                                                                         slices)
        elif ty:
            dy = _matmul(dz, x, True, tx, slices)
        else:
            dy = _matmul(x, dz, not tx, False, slices)
        if tx:
            dx = _matmul(y, dz, ty, True, slices)
        else:
            dx = _matmul(dz, y, False, not ty, slices)
        return [reduce_to_shape(dx, x.shape), reduce_to_shape(dy, y.shape)]


def matmul(x, y, transpose_x=False, transpose_y=False):
    return _matmul(x, y, transpose_x, transpose_y)


def _matmul(x, y, transpose_x, transpose_y, meshslice=None):
    attrs = {"transpose_x": bool(transpose_x), "transpose_y": bool(transpose_y)}
    if meshslice is not None:
        attrs["meshslice"] = meshslice
    return emit1("matmul", [x, y], attrs)
