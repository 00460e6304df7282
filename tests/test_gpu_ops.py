"""Every registered op's kernel on CuPy equals numpy's, fp64, forward and gradient
(``gpu`` marker; skipped, saying why, without a GPU).

Each case of ``test_op_grads.CASES`` (one per differentiable op and more: every op their
traces emit, the backward's grad ops included) is traced with its backward and run twice
by ``ProgramRunner``: on numpy and on CuPy with the same parameters and feeds. The loss
and every parameter's gradient agree to 1e-10 (relative to the largest entry)."""

from __future__ import annotations

import os
import sys
import zlib

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from distgraph.resources.gpus import NoGPU, detect_gpus  # noqa: E402
from distgraph.runtime.execution.executor import ProgramRunner  # noqa: E402

from gradcheck import GradCheck  # noqa: E402
from test_op_grads import CASES  # noqa: E402


def _why_not() -> str:
    try:
        detect_gpus()
        return ""
    except NoGPU as e:
        return str(e)


WHY = _why_not()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(WHY), reason=f"no GPU: {WHY}")]
TOL = 1e-10


def _close(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / max(1.0, float(np.max(np.abs(b)))))


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_cupy_kernels_equal_numpys(c):
    import cupy

    rng = np.random.default_rng([0, zlib.crc32(c.id.encode())])
    fn, params, feeds = c.make(rng)
    check = GradCheck(fn, params, feeds)
    loss, grads = check.analytic()
    fetch = [check.loss.name] + [g.name for g in check.grads.values()]
    on_gpu = ProgramRunner(check.program, xp=cupy)
    out = on_gpu.run({n: cupy.asarray(a) for n, a in check.params.items()},
                     {n: cupy.asarray(a) for n, a in check.feeds.items()}, fetch,
                     step=check.step)
    assert _close(cupy.asnumpy(out[check.loss.name]), loss) < TOL, c.id
    for name, g in check.grads.items():
        got = cupy.asnumpy(out[g.name])
        assert got.shape == grads[name].shape, (c.id, name)
        assert _close(got, grads[name]) < TOL, (c.id, name, _close(got, grads[name]))


@pytest.mark.parametrize("dtype, tol", [("float64", 1e-12), ("float32", 1e-5)])
def test_the_fused_adam_step_equals_numpys(dtype, tol):
    """Adam on a GPU is one kernel (distgraph.ops.fused_gpu); numpy's runs a block at a
    time. Three AdamW steps of a parameter larger than numpy's block agree."""
    import cupy

    from distgraph.ops.optim_ops import CHUNK, _adam_step

    rng = np.random.default_rng(0)
    p, m, v = (rng.standard_normal(3 * CHUNK + 5).astype(dtype) for _ in range(3))
    v = np.abs(v)
    on_gpu = [cupy.asarray(a) for a in (p, m, v)]
    for step in (1, 2, 3):
        grad = rng.standard_normal(p.shape).astype(dtype)
        args = (0.9, 0.95, 1e-8, 0.1)
        _adam_step(np, p, grad, m, v, np.asarray(step), np.asarray(1e-3), *args)
        _adam_step(cupy, *on_gpu[:1], cupy.asarray(grad), *on_gpu[1:], cupy.asarray(step),
                   cupy.asarray(1e-3), *args)
    for host, device in zip((p, m, v), on_gpu):
        assert _close(cupy.asnumpy(device), host) < tol


@pytest.mark.parametrize("dtype, tol", [("float64", 1e-12), ("float32", 1e-6)])
@pytest.mark.parametrize("cols", [1, 3, 300, 1030])
def test_the_row_softmax_kernels_equal_numpys(cols, dtype, tol):
    """Softmax over the last dim and its gradient: one block of threads per row on a GPU
    (distgraph.ops.fused_gpu), numpy's array expressions on the host; rows longer than a
    block and masked (-inf) entries included."""
    import cupy

    from distgraph.ops.nn_ops import _softmax, _softmax_grad
    from distgraph.registry import KernelContext

    rng = np.random.default_rng(cols)
    x = (rng.standard_normal((2, 3, 5, cols)) * 4).astype(dtype)
    x[..., 1:][rng.random((2, 3, 5, cols - 1)) < 0.3] = -np.inf
    dy = rng.standard_normal(x.shape).astype(dtype)
    host, device = KernelContext(np, 0), KernelContext(cupy, 0)
    y = _softmax(host, x)
    y_gpu = _softmax(device, cupy.asarray(x))
    assert _close(cupy.asnumpy(y_gpu), y) < tol
    dx = _softmax_grad(host, y, dy)
    assert _close(cupy.asnumpy(_softmax_grad(device, cupy.asarray(y), cupy.asarray(dy))),
                  dx) < tol


@pytest.mark.parametrize("dtype, tol", [("float64", 1e-12), ("float32", 1e-5)])
@pytest.mark.parametrize("shape", [(7, 1), (2, 3, 300), (130, 1030)])
def test_the_layer_norm_kernels_equal_numpys(shape, dtype, tol):
    """Layer norm and its gradient: one block of threads per row on a GPU, the weight's
    and the bias' gradients as column sums over chunks of rows (distgraph.ops.fused_gpu);
    numpy's array expressions on the host. Rows longer than a block, more rows than a
    chunk and a last chunk cut short included."""
    import cupy

    from distgraph.registry import KernelContext, get_op

    rng = np.random.default_rng(shape[-1])
    x = (rng.standard_normal(shape) * 3 + 1).astype(dtype)
    w, b = (rng.standard_normal(shape[-1]).astype(dtype) for _ in range(2))
    dy = rng.standard_normal(shape).astype(dtype)
    host, device = KernelContext(np, 0), KernelContext(cupy, 0)
    forward, backward = get_op("layer_norm").kernel, get_op("layer_norm_grad").kernel
    want = forward(host, x, w, b, epsilon=1e-5)
    got = forward(device, *map(cupy.asarray, (x, w, b)), epsilon=1e-5)
    for a, e in zip(got, want):
        assert a.dtype == e.dtype and _close(cupy.asnumpy(a), e) < tol
    want = backward(host, x, w, want[1], want[2], dy)
    got = backward(device, cupy.asarray(x), cupy.asarray(w), *got[1:], cupy.asarray(dy))
    for a, e in zip(got, want):
        assert a.shape == e.shape and a.dtype == e.dtype and _close(cupy.asnumpy(a), e) < tol


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("transpose_x, transpose_y", [(False, False), (True, False),
                                                      (False, True), (True, True)])
def test_stacked_16bit_gemms_equal_the_float32_product_rounded(dtype, transpose_x,
                                                               transpose_y):
    """Attention's stacked 16-bit matmuls on a GPU: one strided-batched cuBLAS GEMM on
    the matrix units (distgraph.ops.fused_gpu.batched_matmul), equal to numpy's float32
    product of the same operands rounded to the dtype (within one rounding)."""
    import cupy

    from distgraph.dtypes import numpy_dtype
    from distgraph.registry import KernelContext, get_op

    dt = numpy_dtype(dtype)
    rng = np.random.default_rng(7)
    m, n, k = 33, 70, 129
    x = rng.standard_normal((2, 3) + ((k, m) if transpose_x else (m, k))).astype(dt)
    y = rng.standard_normal((2, 3) + ((n, k) if transpose_y else (k, n))).astype(dt)
    kernel = get_op("matmul").kernel
    flags = {"transpose_x": transpose_x, "transpose_y": transpose_y}
    want = kernel(KernelContext(np, 0), x.astype(np.float32), y.astype(np.float32), **flags)
    got = kernel(KernelContext(cupy, 0), cupy.asarray(x), cupy.asarray(y), **flags)
    assert got.dtype == dt and got.shape == want.shape
    assert _close(cupy.asnumpy(got).astype(np.float32), want.astype(dt).astype(np.float32)) \
        < 2 ** -7


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("op_type, shapes, attrs", [
    ("add", [(64, 333), (64, 333)], {}), ("add", [(8, 64, 333), (333,)], {}),
    ("subtract", [(64, 333), (1, 333)], {}), ("multiply", [(4, 64, 333), (4, 64, 333)], {}),
    ("scale", [(64, 333)], {"scale": 0.1234567, "bias": 0.0}),
    ("scale", [(64, 333)], {"scale": -3.3, "bias": 1.0e-3})])
def test_16bit_element_wise_ops_in_one_kernel_equal_the_hosts_bits(dtype, op_type, shapes,
                                                                   attrs):
    """A 16-bit add, subtract, multiply and scale on a GPU, one kernel each
    (distgraph.ops.fused_gpu.widened, as the executor runs them): bit for bit the host's
    result (numpy: float32 copies, the op, rounded once), over operands of every
    magnitude (sums of far apart exponents, products near the dtype's range) and
    broadcast shapes; and into a donated buffer."""
    import cupy

    from distgraph.dtypes import numpy_dtype
    from distgraph.ops import fused_gpu
    from distgraph.registry import KernelContext, get_op

    dt = numpy_dtype(dtype)
    rng = np.random.default_rng(zlib.crc32(f"{op_type}{shapes}{dtype}".encode()))
    args = [(rng.standard_normal(shape) * np.exp2(rng.integers(-14, 14, shape))).astype(dt)
            for shape in shapes]
    kernel = get_op(op_type).kernel
    want = kernel(KernelContext(np, 0), *(a.astype(np.float32) for a in args),
                  **attrs).astype(dt)
    got = fused_gpu.widened(op_type, [cupy.asarray(a) for a in args], attrs)
    assert got.dtype == dt and got.shape == want.shape
    assert np.array_equal(cupy.asnumpy(got).view(np.uint16), want.view(np.uint16))
    into = cupy.empty(want.shape, dt)
    assert fused_gpu.widened(op_type, [cupy.asarray(a) for a in args], attrs, into) is into
    assert np.array_equal(cupy.asnumpy(into).view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("cols", [1, 33, 1024, 5000])
def test_the_softmax_kernels_on_bfloat16_rows_equal_the_widened_kernels_bits(cols):
    """The row softmax and its gradient on bfloat16 rows as they are (read widened,
    written rounded to nearest even): bit for bit the float32 kernels' results on
    float32 copies, rounded to bfloat16 on the host (ml_dtypes), over rows with large and
    tiny entries."""
    import cupy

    from distgraph.dtypes import numpy_dtype
    from distgraph.ops import fused_gpu

    bf16 = numpy_dtype("bfloat16")
    rng = np.random.default_rng(cols)
    x = (rng.standard_normal((6, cols)) * np.exp2(rng.integers(-6, 6, (6, cols)))).astype(bf16)
    dy = rng.standard_normal((6, cols)).astype(bf16)
    gx, gdy = cupy.asarray(x), cupy.asarray(dy)
    y = fused_gpu.softmax(gx)
    want = cupy.asnumpy(fused_gpu.softmax(gx.astype(np.float32))).astype(bf16)
    assert y.dtype == bf16 and np.array_equal(cupy.asnumpy(y).view(np.uint16),
                                              want.view(np.uint16))
    dx = fused_gpu.softmax_grad(y, gdy)
    want = cupy.asnumpy(fused_gpu.softmax_grad(y.astype(np.float32),
                                               gdy.astype(np.float32))).astype(bf16)
    assert dx.dtype == bf16 and np.array_equal(cupy.asnumpy(dx).view(np.uint16),
                                               want.view(np.uint16))
