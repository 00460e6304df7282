"""Compute priced by shape: the seconds of a GEMM from its m, n, k, its dtype and the
device's GEMM curve (:class:`~distgraph.resources.elements.GemmCurve`).

A device runs a GEMM ``[b, m, k] @ [b, k, n]`` as output tiles, ``units`` at a time:

1. it picks the tile that finishes first among its tile and the halves and quarters of
   each side (a tile is cut to the matrix where the matrix is smaller): a small tile
   wastes less of the last tile row and column (tile quantisation) and leaves fewer
   units idle in the last wave (wave quantisation), but reuses each element it loads
   fewer times, ``r x c / (r + c)`` FLOPs per element, and below the curve's ``reuse``
   runs at that fraction of a unit's rate;
2. with several units and fewer tiles than units it may split k over ``s`` tiles
   (split-K), each keeping at least :data:`SPLIT_MIN_K` steps, whose partial sums (32 bit)
   are then added at the memory bandwidth;
3. a tile of ``r x c`` takes ``2 r c (k / s + k_fill) / (unit rate x efficiency)``, and
   the tiles run in ``ceil(tiles / units)`` waves;
4. the GEMM takes at least what moving its operands and result at the memory bandwidth
   takes (below the roofline's ridge a GEMM is memory-bound).

Without a curve a GEMM runs at the GFLOP/s of its dtype, or at the memory bandwidth
where that is slower (the roofline).

Example::

    >>> from distgraph.resources.elements import GemmCurve
    >>> h100 = GemmCurve(132, (256, 128), 160, 56)
    >>> big = gemm_seconds(1, 8192, 8192, 8192, 2, 856e12, h100, 2.9e12)
    >>> round(2 * 8192 ** 3 / big / 1e12)                  # TFLOP/s of a large GEMM
    778
    >>> small = gemm_seconds(1, 256, 256, 4096, 2, 856e12, h100, 2.9e12)
    >>> round(2 * 256 * 256 * 4096 / small / 1e12)         # 4 tiles: split-K fills units
    78
"""

from __future__ import annotations

import math

# split-K keeps at least this many steps of k per split (cuBLAS's split-K kernels run at
# a few hundred: the split that XLA's published H100 table fits best)
SPLIT_MIN_K = 256
SPLITS = (1, 2, 4, 8, 16)
PARTIAL_BYTES = 4          # split-K's partial sums are 32-bit


def gemm_shape(op_type: str, ins, outs, attrs: dict):
    """``(b, m, n, k)`` of the GEMMs an op runs (``b`` of them, each ``[m, k] @ [k, n]``,
    local shapes), or None for an op that is not a GEMM. A Linear layer's product (a
    stacked ``x`` with a 2-d weight) is one GEMM over every row, as the kernel runs it.

    >>> from distgraph.registry import TensorType as T
    >>> gemm_shape("matmul", [T((4, 8, 16), "float32"), T((16, 32), "float32")],
    ...            [T((4, 8, 32), "float32")], {})
    (1, 32, 32, 16)
    >>> gemm_shape("matmul", [T((2, 3, 8, 16), "float32"), T((2, 3, 8, 16), "float32")],
    ...            [T((2, 3, 8, 8), "float32")], {"transpose_y": True})
    (6, 8, 8, 16)
    """
    if op_type != "matmul" or len(ins) != 2 or not outs:
        return None
    x, y = ins[0].shape, ins[1].shape
    out = outs[0].shape
    if attrs.get("rows"):           # [..., m] x [..., n] -> [m, n], contracting every row
        return 1, out[-2], out[-1], math.prod(x[:-1])
    k = x[-2] if attrs.get("transpose_x") else x[-1]
    m, n = out[-2], out[-1]
    if len(x) > 2 and len(y) == 2 and not attrs.get("transpose_x"):
        return 1, math.prod(x[:-1]), n, k
    return math.prod(out[:-2]), m, n, k


def gemm_seconds(b: int, m: int, n: int, k: int, itemsize: int, rate: float, curve,
                 memory_bandwidth: float) -> float:
    """Seconds of ``b`` GEMMs ``[m, k] @ [k, n]`` of ``itemsize``-byte elements on a
    device of ``rate`` FLOP/s for their dtype, GEMM curve ``curve`` (None: the roofline)
    and ``memory_bandwidth`` bytes/s (module docstring), launch cost not included."""
    moved = b * (m * k + k * n + m * n) * itemsize / memory_bandwidth
    if min(b, m, n, k) <= 0:
        return moved
    if curve is None:
        return max(2.0 * b * m * n * k / rate, moved)
    per_unit = rate / curve.units
    best = math.inf
    for r, c in _tiles(curve.tile, m, n):
        efficiency = 1.0 if curve.reuse <= 0 else min(1.0, r * c / (r + c) / curve.reuse)
        tiles = b * -(-m // r) * -(-n // c)
        for s in SPLITS:
            if s > 1 and (curve.units == 1 or k < s * SPLIT_MIN_K or tiles >= curve.units):
                break
            waves = -(-tiles * s // curve.units)
            t = waves * 2.0 * r * c * (-(-k // s) + curve.k_fill) / (per_unit * efficiency)
            if s > 1:
                t += s * b * m * n * PARTIAL_BYTES / memory_bandwidth
            best = min(best, t)
    return max(best, moved)


def _tiles(tile, m: int, n: int) -> set:
    """The tiles a device chooses among for an ``m x n`` result: sides among its tile's
    two and their halves and quarters, either way round, no larger in area than its
    tile, cut to the matrix."""
    rows, cols = tile
    sides = {s for side in tile for s in (side, side // 2, side // 4) if s >= 1}
    return {(min(r, m), min(c, n)) for r in sides for c in sides if r * c <= rows * cols}
