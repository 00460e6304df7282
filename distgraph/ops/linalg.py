"""Matrix multiplication with optional transposes and broadcast batch dims.

Sharding: einsum notation built from ranks and flags, e.g. ``"bmk,kn->bmn"``:
S(m) x R -> S(m); R x S(n) -> S(n); S(k) x S(k) -> P; a broadcast batch dim is never split.
"""

from __future__ import annotations

from distgraph.ops.common import broadcast_shapes, reduce_to_shape, same_dtype
from distgraph.ops.shape import reshape
from distgraph.registry import ShapeError, TensorType, register_op, size
from distgraph.spmd import EinsumRule
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


@register_op("matmul", spmd=EinsumRule(matmul_notation))
class Matmul:
    def infer(x, y, transpose_x=False, transpose_y=False):
        if len(x.shape) < 2 or len(y.shape) < 2:
            raise ShapeError("matmul needs operands of rank >= 2")
        m, k = _mk(x.shape, transpose_x)
        k2, n = _mk(y.shape, not transpose_y)[::-1]
        if k != k2:
            raise ShapeError(f"contracted dims differ: {k} vs {k2} (transpose_x={transpose_x}, "
                             f"transpose_y={transpose_y})")
        batch = broadcast_shapes(x.shape[:-2], y.shape[:-2])
        return TensorType(batch + (m, n), same_dtype(x, y))

    def kernel(ctx, x, y, transpose_x=False, transpose_y=False):
        xp = ctx.xp
        if transpose_x:
            x = xp.swapaxes(x, -1, -2)
        if transpose_y:
            y = xp.swapaxes(y, -1, -2)
        return xp.matmul(x, y)

    def flops(ins, outs, transpose_x=False, transpose_y=False):
        k = ins[0].shape[-2] if transpose_x else ins[0].shape[-1]
        return 2 * size(outs[0]) * k

    def grad(op, dz):
        x, y = op.inputs
        tx, ty = op.attrs.get("transpose_x", False), op.attrs.get("transpose_y", False)
        if len(y.shape) == 2 and len(x.shape) > 2 and not tx:
            # Linear layers: fold the batch dims so dW is one 2-D matmul, not a batched one
            # followed by a sum.
            x2 = reshape(x, [-1, x.shape[-1]])
            dz2 = reshape(dz, [-1, dz.shape[-1]])
            dy = matmul(dz2, x2, transpose_x=True) if ty else matmul(x2, dz2, transpose_x=True)
        elif ty:
            dy = matmul(dz, x, transpose_x=True, transpose_y=tx)
        else:
            dy = matmul(x, dz, transpose_x=not tx)
        if tx:
            dx = matmul(y, dz, transpose_x=ty, transpose_y=True)
        else:
            dx = matmul(dz, y, transpose_y=not ty)
        return [reduce_to_shape(dx, x.shape), reduce_to_shape(dy, y.shape)]


def matmul(x, y, transpose_x=False, transpose_y=False):
    return emit1("matmul", [x, y], {"transpose_x": bool(transpose_x), "transpose_y": bool(transpose_y)})
