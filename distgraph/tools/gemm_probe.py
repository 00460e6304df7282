"""The GEMM curve of this process's device, measured: what ``distgraph cluster calibrate``
writes as a device's ``gemm`` and its GFLOP/s.

GEMMs of a sweep of shapes (:data:`CPU_SHAPES`; on a GPU :data:`GPU_SHAPES`, larger)
are each timed many times and the fastest time kept (on a machine other processes load,
the fastest run is the one they left alone: what the device can do, run after run).
The curve of :mod:`distgraph.passes.cost.compute` is then fitted to those times by
least squares on their logarithms (each shape's relative error counts alike): the rate
of full tiles, the tile's cost in steps of k (``k_fill``) and the reuse below which a
tile slows (``reuse``), for each of the device kind's tile sizes, the best fit kept,
with a launch cost per GEMM that the resource file's ``op_overhead`` stands for. ``units``: one on a
CPU (one BLAS thread per rank), the GPU's SMs. The other dtypes' rates are the fitted
rate times how much faster or slower a large GEMM of theirs runs.

Example::

    >>> from distgraph.runtime.backend import NUMPY
    >>> rates, curve = gemm_curve(NUMPY, ("float32",), repeats=1)   # doctest: +SKIP
    >>> curve.units, rates["float32"] > 0                            # doctest: +SKIP
    (1, True)
"""

from __future__ import annotations

import time

import numpy as np

from distgraph.dtypes import numpy_dtype
from distgraph.passes.cost.compute import gemm_seconds
from distgraph.resources.elements import GemmCurve

# (m, n, k): square ones from cache-sized to past the caches, flat ones, thin ones (the
# tile's reuse), short k (its fill); a sweep of a few milliseconds per timing
CPU_SHAPES = ((512, 512, 512), (256, 256, 256), (128, 128, 128), (64, 64, 64),
              (32, 32, 32), (256, 256, 32), (256, 256, 1024), (1024, 64, 256),
              (64, 1024, 256), (8, 512, 512), (512, 8, 512), (2048, 128, 16),
              (4096, 64, 64), (200, 300, 100))
CPU_TILES = ((64, 64),)     # one BLAS thread: the reuse term, not the tile, shapes the curve
GPU_SHAPES = tuple((m, n, k) for m in (256, 1024, 4096) for n in (256, 1024, 4096)
                   for k in (256, 1024, 4096))
GPU_TILES = ((256, 128),)
BUDGET = 2e-3          # seconds of one timing: enough calls of a small GEMM to time it
GUESS = 50e9           # FLOP/s the number of calls per timing is sized with


def fastest_seconds(xb, shape, dtype, repeats: int, window: float = 0.0, sync=None) -> float:
    """The fastest of ``repeats`` timings of one ``[m, k] @ [k, n]`` of ``dtype`` on
    random operands on backend ``xb`` (each the mean of as many calls as fit
    :data:`BUDGET`, or ``window`` seconds where larger, timed to the end of the device's
    work; ``sync`` lines the ranks up before each)."""
    m, n, k = shape
    dtype = numpy_dtype(dtype)
    # random operands, as training's: a GPU's matrix units multiply ones faster (less
    # power drawn, a higher clock held): an H200's float16 curve was fitted at 875 and
    # 934 TFLOP/s on ones, 807 on random operands (float32 alike: 60-62 either way)
    a = xb.xp.random.standard_normal((m, k)).astype(dtype)
    b = xb.xp.random.standard_normal((k, n)).astype(dtype)
    c = xb.xp.empty((m, n), dtype=dtype)
    calls = max(1, int(max(BUDGET, window) / (2.0 * m * n * k / GUESS + 2e-6)))
    xb.xp.matmul(a, b, out=c)
    xb.synchronize()
    best = np.inf
    for _ in range(repeats):
        if sync is not None:
            sync()
        start = time.perf_counter()
        for _ in range(calls):
            xb.xp.matmul(a, b, out=c)
        xb.synchronize()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def fit_curve(shapes, seconds, itemsize: int, units: int, tiles, memory_bandwidth: float):
    """(FLOP/s, GemmCurve, launch seconds, median relative error) of the curve that fits
    the measured ``seconds`` of GEMMs of ``shapes`` best (module docstring)."""
    from scipy.optimize import least_squares

    seconds = np.asarray(seconds, dtype=float)
    flops = np.array([2.0 * m * n * k for m, n, k in shapes])
    start = float(np.max(flops / seconds))
    best = None
    for tile in tiles:
        def predicted(p, tile=tile):
            curve = GemmCurve(units, tile, p[1], p[2])
            return p[3] * 1e-6 + np.array([gemm_seconds(1, m, n, k, itemsize, p[0] * 1e9,
                                                        curve, memory_bandwidth)
                                           for m, n, k in shapes])

        fit = least_squares(lambda p: np.log(predicted(p)) - np.log(seconds),
                            (start / 1e9, 8.0, 4.0, 1.0), diff_step=1e-3,
                            bounds=([start / 1e9 / 4, 0, 0, 0], [start / 1e9 * 4, 4096, 512, 100]))
        error = float(np.median(np.abs(predicted(fit.x) / seconds - 1)))
        if best is None or fit.cost < best[0]:
            rate, fill, reuse, launch = (float(v) for v in fit.x)
            best = (fit.cost, rate * 1e9, GemmCurve(units, tile, round(fill, 2),
                                                    round(reuse, 2)), launch * 1e-6, error)
    return best[1:]


def gemm_curve(xb, dtypes, repeats: int = 5, units: int = 1,
               memory_bandwidth: float = 20e9, window: float = 0.0, sync=None) -> tuple:
    """({dtype: GFLOP/s}, GemmCurve, median relative error of the fit) of this process's
    device on backend ``xb``: the curve fitted to the first dtype's sweep, the others'
    rates scaled by a large GEMM's time (module docstring). With ``window`` > 0 each
    timing is a sustained one of ``window`` seconds, the ranks lined up by ``sync``
    (the rates of ranks that share cores or a CPU quota, all computing), once."""
    gpu = units > 1
    shapes = GPU_SHAPES if gpu else CPU_SHAPES
    first = dtypes[0]
    itemsize = np.dtype(first).itemsize
    if window > 0:
        repeats = 1

    def timed(shape, dtype, rounds=repeats):
        return fastest_seconds(xb, shape, dtype, rounds, window, sync)

    large = shapes[0] if not gpu else (4096, 4096, 4096)
    cases = [(s, first) for s in shapes] + [(large, dtype) for dtype in dtypes[1:]]
    # the cases in turn, round after round: a spell of load slows few runs of any one
    seconds = np.full(len(cases), np.inf)
    for _ in range(repeats):
        seconds = np.minimum(seconds, [timed(shape, dtype, 1) for shape, dtype in cases])
    swept = seconds[:len(shapes)]
    rate, curve, _, error = fit_curve(shapes, swept, itemsize, units,
                                      GPU_TILES if gpu else CPU_TILES, memory_bandwidth)
    reference = swept[shapes.index(large)] if large in shapes else timed(large, first)
    rates = {first: rate / 1e9}
    for dtype, t in zip(dtypes[1:], seconds[len(shapes):]):
        rates[dtype] = rate / 1e9 * reference / t
    return rates, curve, error
