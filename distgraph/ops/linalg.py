"""Matrix multiplication with optional transposes and broadcast batch dims.

Sharding: einsum notation built from ranks and flags, e.g. ``"bmk,kn->bmn"``:
S(m) x R -> S(m); R x S(n) -> S(n); S(k) x S(k) -> P; a broadcast batch dim is never split.
``rows=True`` contracts every leading dim, ``x^T y`` over the rows of ``x [..., m]`` and
``y [..., n]`` (a Linear layer's weight gradient), ``"abm,abn->mn"``: the rows keep any
split (batch over dp, sequence over cp), S(a) x S(a) -> P, the pending sum that the
gradient reduction settles, where folding them to ``[rows, m]`` first would gather a split
that the fold cannot keep (the sequence's inside the batch).
With the ``meshslice`` attribute set (``Strategy(meshslice=...)`` or ``shard_op(...,
meshslice=...)`` set it), also MeshSlice's 2-D layouts, e.g. OS on mesh dims (x, y):
[x, y] x [x, y] -> [x, y], run by :mod:`distgraph.ops.meshslice` with K sliced,
overlapped collectives (:mod:`distgraph.spmd.meshslice` lists the layouts).
"""

from __future__ import annotations

import numpy as np

from distgraph import dtypes
from distgraph.ops import fused_gpu
from distgraph.ops import meshslice as ms
from distgraph.ops.common import broadcast_shapes, reduce_to_shape, same_dtype
from distgraph.ops.elementwise import cast
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
    if attrs.get("rows"):
        lead = BATCH[:len(x) - 1]
        return f"{lead}m,{lead}n->mn"
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
    the cost model picks. ``rows``: ``x [..., m]``, ``y [..., n]`` with the same leading
    dims give ``[m, n]``, the sum over every row of ``x_row^T y_row``. ``out_dtype``
    (16-bit operands only): float32, the product as the GEMM accumulated it, not rounded
    to the operands' dtype (a weight's gradient for its float32 master under amp:
    :func:`distgraph.program_builder.widened_gradients`)."""

    def infer(x, y, transpose_x=False, transpose_y=False, meshslice=None, rows=False,
              out_dtype=None):
        try:
            slices_setting(meshslice)
        except SpmdRuleError as e:
            raise ShapeError(str(e)) from None
        if len(x.shape) < 2 or len(y.shape) < 2:
            raise ShapeError("matmul needs operands of rank >= 2")
        dtype = same_dtype(x, y)
        if out_dtype is not None:
            if out_dtype != "float32" or dtype not in dtypes.HALF_DTYPES:
                raise ShapeError(f"matmul(out_dtype={out_dtype!r}) writes float32 products of "
                                 f"16-bit operands, not of {dtype}")
            dtype = out_dtype
        if rows:
            if x.shape[:-1] != y.shape[:-1] or transpose_x or transpose_y or meshslice:
                raise ShapeError(f"matmul(rows=True) contracts the leading dims of x "
                                 f"{tuple(x.shape)} and y {tuple(y.shape)}: they must be the "
                                 "same, without transposes or meshslice")
            return TensorType((x.shape[-1], y.shape[-1]), dtype)
        m, k = _mk(x.shape, transpose_x)
        k2, n = _mk(y.shape, not transpose_y)[::-1]
        if k != k2:
            raise ShapeError(f"contracted dims differ: {k} vs {k2} (transpose_x={transpose_x}, "
                             f"transpose_y={transpose_y})")
        batch = broadcast_shapes(x.shape[:-2], y.shape[:-2])
        return TensorType(batch + (m, n), dtype)

    def kernel(ctx, x, y, transpose_x=False, transpose_y=False, meshslice=None, rows=False,
               out_dtype=None):
        if rows:        # one GEMM over every row, as a Linear layer's forward
            return ctx.xp.matmul(x.reshape(-1, x.shape[-1]).T, y.reshape(-1, y.shape[-1]))
        if isinstance(meshslice, ms.LocalMeshSlice):
            return ms.run(ctx, x, y, transpose_x, transpose_y, meshslice)
        xp = ctx.xp
        if xp is not np and fused_gpu.stacked_16bit(x, y):
            return fused_gpu.batched_matmul(x, y, transpose_x, transpose_y)
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

    def flops(ins, outs, transpose_x=False, transpose_y=False, meshslice=None, rows=False,
              out_dtype=None):
        if rows:
            return 2 * size(outs[0]) * (size(ins[0]) // ins[0].shape[-1])
        k = ins[0].shape[-2] if transpose_x else ins[0].shape[-1]
        return 2 * size(outs[0]) * k

    localize = ms.localize
    comm = ms.comm
    overlap = ms.overlap

    def grad(op, dz):
        x, y = op.inputs
        if op.attrs.get("out_dtype") is not None:      # its gradient in the operands' dtype
            dz = cast(dz, x.dtype)
        tx, ty = op.attrs.get("transpose_x", False), op.attrs.get("transpose_y", False)
        # the backward GeMMs run as MeshSlice too (other dataflows on the same layouts)
        slices = op.attrs.get("meshslice")
        if op.attrs.get("rows"):        # z = x^T y over the rows
            return [_matmul(y, dz, False, True), _matmul(x, dz, False, False)]
        if len(y.shape) == 2 and len(x.shape) > 2 and not tx and slices is None:
            # Linear layers: dW contracts the rows (batch and sequence) in one GEMM, their
            # splits left pending sums (the module docstring)
            dy = matmul_rows(dz, x) if ty else matmul_rows(x, dz)
        elif len(y.shape) == 2 and len(x.shape) > 2 and not tx:
            # MeshSlice's layouts are 2-D: fold the batch dims first
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


def matmul_rows(x, y):
    """``[m, n]``: x_row^T y_row summed over every row of ``x [..., m]``, ``y [..., n]``
    (the same leading dims), e.g. a Linear layer's weight gradient ``bsh,bso->ho``."""
    return emit1("matmul", [x, y], {"transpose_x": False, "transpose_y": False, "rows": True})


def _matmul(x, y, transpose_x, transpose_y, meshslice=None):
    attrs = {"transpose_x": bool(transpose_x), "transpose_y": bool(transpose_y)}
    if meshslice is not None:
        attrs["meshslice"] = meshslice
    return emit1("matmul", [x, y], attrs)
