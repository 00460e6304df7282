"""The choices and arguments of distgraph.ops.fused_gpu, on the CPU: which arrays its row
kernels take, and the column-major arguments its strided-batched GEMM gives cuBLAS (the
kernels themselves run in tests/test_gpu_ops.py, on a GPU)."""

from __future__ import annotations

import numpy as np
import pytest


def test_which_arrays_a_gpus_row_kernels_take():
    """distgraph.ops.fused_gpu.by_rows_of, the layer-norm kernels' predicate (numpy arrays
    stand in for CuPy's: only shapes, dtypes and contiguity count): rows of float32 or
    float64, C-contiguous, with weights a row long and statistics one per row."""
    from distgraph.ops.fused_gpu import by_rows_of

    x = np.zeros((4, 3, 8))
    w, stat = np.zeros(8), np.zeros((4, 3))
    assert by_rows_of(x, w, w)
    assert by_rows_of(x, x, w, stat, stat)                    # the gradient's operands
    assert by_rows_of(x.astype(np.float32), *(a.astype(np.float32) for a in (x, w, stat)))
    assert not by_rows_of(x, w.astype(np.float32), w)         # two dtypes
    assert not by_rows_of(x.astype(np.float16), w.astype(np.float16), w.astype(np.float16))
    assert not by_rows_of(x.transpose(1, 0, 2), w, w)         # not C-contiguous
    assert not by_rows_of(x, x.transpose(1, 0, 2).copy(), w)  # another shape
    assert not by_rows_of(x, np.zeros(16)[::2], w)            # a strided weight
    assert not by_rows_of(x, np.zeros(5), w)                  # neither a row nor a statistic
    assert not by_rows_of(np.zeros((4, 0)), np.zeros(0), np.zeros(0))


@pytest.mark.parametrize("transpose_x", [False, True])
@pytest.mark.parametrize("transpose_y", [False, True])
def test_the_strided_gemm_arguments_compute_the_row_major_product(transpose_x, transpose_y):
    """distgraph.ops.fused_gpu.strided_gemm_args against cuBLAS's definition of a
    column-major strided-batched GEMM (element (i, j) of matrix b at
    ``buffer[b * stride + i + j * ld]``, op T transposing), here in numpy on the two
    operands' buffers: its result buffer, read row-major, is ``op(x) @ op(y)``."""
    from distgraph.ops.fused_gpu import CUBLAS_OP_N, strided_gemm_args

    rng = np.random.default_rng(int(transpose_x) * 2 + int(transpose_y))
    m, n, k, batch = 5, 3, 4, (2, 3)
    x = rng.standard_normal(batch + ((k, m) if transpose_x else (m, k)))
    y = rng.standard_normal(batch + ((n, k) if transpose_y else (k, n)))
    want = np.matmul(np.swapaxes(x, -1, -2) if transpose_x else x,
                     np.swapaxes(y, -1, -2) if transpose_y else y)
    (ta, tb, cm, cn, ck, lda, sa, ldb, sb, ldc, sc, count,
     shape) = strided_gemm_args(x.shape, y.shape, transpose_x, transpose_y)

    def matrix(buffer, b, stride, ld, op, rows, cols):     # op(matrix b), rows x cols
        stored = (rows, cols) if op == CUBLAS_OP_N else (cols, rows)
        got = np.array([[buffer[b * stride + i + j * ld] for j in range(stored[1])]
                        for i in range(stored[0])])
        return got if op == CUBLAS_OP_N else got.T

    out = np.zeros(count * sc)
    for b in range(count):
        c = matrix(y.ravel(), b, sa, lda, ta, cm, ck) @ matrix(x.ravel(), b, sb, ldb, tb, ck, cn)
        for i in range(cm):
            for j in range(cn):
                out[b * sc + i + j * ldc] = c[i, j]
    assert shape == want.shape and count == 6
    np.testing.assert_allclose(out.reshape(shape), want, rtol=1e-12)
