"""Kernels a GPU runs in one pass where the ``xp`` form of an op takes many.

An update op's ``xp`` form is a dozen array expressions, each a kernel launch and a pass
over the parameter's bytes; numpy runs them a block at a time so that the passes after
the first read the cache. A GPU has no such cache to reuse but pays each launch, and
over a GPT's 150 parameters the launches outnumber the work. :func:`adam` is Adam's
step as one CuPy elementwise kernel: each element read and written once, the step
counter and the learning rate read on the device (no copy to the host, which would
wait for the GPU). :func:`gelu` and :func:`gelu_grad` are GELU's (tanh form) array
expressions, 7 and 14 passes over an activation, as one each. The row softmax and layer
norm, and their gradients, are one block of threads per row (layer norm's weight and bias
gradients, sums over rows, a second kernel of column sums). Their arithmetic is the
``xp`` forms', in the operands' dtype, so a float64 step equals numpy's to rounding.
:func:`batched_matmul` is a stack of 16-bit GEMMs (attention's) as one cuBLAS call on
the matrix units, which CuPy's matmul does not make of 16-bit operands. :func:`widened`
is a 16-bit add, subtract, multiply or scale computed in float32 and rounded once, as
the host computes it, in one kernel.
"""

from __future__ import annotations

import functools
import math

C = repr(math.sqrt(2.0 / math.pi))

# m = beta1 m + (1 - beta1) g as m -= g; m *= beta1; m += g (the xp form's order), and v
# alike; then p -= (lr sqrt(c2) / c1) m / (sqrt(v) + eps sqrt(c2)), c1 = 1 - beta1^n,
# c2 = 1 - beta2^n (distgraph.ops.optim_ops._adam_block)
ADAM = """
double count = (double)step, rate = (double)lr;
double root_c2 = sqrt(1.0 - pow(b2, count));
if (wd != 0.0) p = p * (T)(1.0 - rate * wd);
m = m - g; m = m * (T)b1; m = m + g;
T sq = g * g;
v = v - sq; v = v * (T)b2; v = v + sq;
T den = (T)sqrt(v) + (T)(eps * root_c2);
T change = m / den;
change = change * (T)(rate * root_c2 / (1.0 - pow(b1, count)));
p = p - change;
"""


@functools.lru_cache(maxsize=None)
def _kernel(in_params: str, out_params: str, body: str, name: str):
    """One CuPy elementwise kernel object per source, made once (making one parses its
    parameters, a cost every call would pay on the host)."""
    import cupy

    return cupy.ElementwiseKernel(in_params, out_params, body, name)


def adam(param, grad, m, v, step, lr, beta1, beta2, epsilon, weight_decay) -> None:
    """One Adam / AdamW step on CuPy arrays ``param``, ``m``, ``v`` in place, from
    ``grad`` of their dtype and the 0-d ``step`` (after its increment) and ``lr``."""
    kernel = _kernel("T g, S step, L lr, float64 b1, float64 b2, float64 eps, float64 wd",
                     "T p, T m, T v", ADAM, "distgraph_adam")
    kernel(grad, step, lr, float(beta1), float(beta2), float(epsilon), float(weight_decay),
           param, m, v)


# tanh(c (x + 0.044715 x^3)), c = sqrt(2 / pi) (distgraph.ops.elementwise._gelu_tanh)
GELU_TANH = f"T th = tanh((T){C} * (x + (T)0.044715 * x * x * x));"
GELU = GELU_TANH + "y = (T)0.5 * x * ((T)1 + th);"
# dy (1 + th) (0.5 + 0.5 x d (1 - th)), d = c (1 + 3 0.044715 x^2) (elementwise._gelu_grad)
GELU_GRAD = GELU_TANH + f"""
T half_xd = (T)0.5 * x * (T){C} * ((T)1 + (T)(3 * 0.044715) * x * x);
dx = dy * ((T)1 + th) * ((T)0.5 + half_xd * ((T)1 - th));
"""


def gelu(x):
    """GELU (tanh form) of CuPy array ``x``, in a new array."""
    return _kernel("T x", "T y", GELU, "distgraph_gelu")(x)


def gelu_grad(x, dy):
    """GELU's gradient at ``x`` times ``dy`` (CuPy arrays of one dtype), in a new array."""
    return _kernel("T x, T dy", "T dx", GELU_GRAD, "distgraph_gelu_grad")(x, dy)


# 16-bit element-wise ops as the host computes them (executor.call_kernel: float32 copies
# of the operands, the op in float32, its result rounded once to the dtype), in one kernel
# where that is four passes (two copies, the op, the rounding). Each float32 operation is
# rounded as a pass of its own is (the _rn intrinsics: no fused multiply-add), so the
# result equals the host's bit for bit. scale: ``x * scale + bias`` (elementwise.Scale).
WIDENED = {
    "add": ("T x, T y", "z = (T)__fadd_rn((float)x, (float)y)"),
    "subtract": ("T x, T y", "z = (T)__fsub_rn((float)x, (float)y)"),
    "multiply": ("T x, T y", "z = (T)__fmul_rn((float)x, (float)y)"),
    "scale": ("T x, float32 s, float32 b",
              "float t = __fmul_rn((float)x, s); z = (T)(b != 0.0f ? __fadd_rn(t, b) : t)"),
}


def widened(op_type: str, args, attrs: dict, out=None):
    """Op ``op_type`` of :data:`WIDENED` on CuPy arrays ``args`` of one 16-bit dtype,
    computed in float32 and rounded once, in one kernel (into ``out`` where given, an
    array of the result's shape and dtype)."""
    import numpy

    if op_type == "scale":
        args = (args[0], numpy.float32(attrs.get("scale", 1.0)),
                numpy.float32(attrs.get("bias", 0.0)))
    params, body = WIDENED[op_type]
    kernel = _kernel(params, "T z", body, f"distgraph_widened_{op_type}")
    return kernel(*args) if out is None else kernel(*args, out)


# Softmax over the last dim of a C-contiguous array, one block of threads per row: the
# row's max, the sum of its exponentials and the result in three sweeps of the row (the
# later two from the cache), where the xp form makes eight passes through memory. The
# gradient alike: dx = y (dy - sum(dy y)), one sum and one sweep.
ROWS = r"""
__device__ T block_reduce(T v, T* shared, bool is_max) {
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int offset = 16; offset > 0; offset >>= 1) {
        T other = __shfl_xor_sync(0xffffffff, v, offset);
        v = is_max ? (other > v ? other : v) : v + other;
    }
    __syncthreads();                       // shared is free (a previous reduction read it)
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < (blockDim.x >> 5) ? shared[lane] : (is_max ? shared[0] : (T)0);
        for (int offset = 16; offset > 0; offset >>= 1) {
            T other = __shfl_xor_sync(0xffffffff, v, offset);
            v = is_max ? (other > v ? other : v) : v + other;
        }
        if (lane == 0) shared[32] = v;
    }
    __syncthreads();
    return shared[32];
}

extern "C" __global__ void distgraph_softmax(const S* x, S* y, long long cols) {
    __shared__ T shared[33];
    const S* xr = x + blockIdx.x * cols;
    S* yr = y + blockIdx.x * cols;
    T top = LOAD(xr[0]);
    for (long long j = threadIdx.x; j < cols; j += blockDim.x)
        top = LOAD(xr[j]) > top ? LOAD(xr[j]) : top;
    top = block_reduce(top, shared, true);
    T total = 0;
    for (long long j = threadIdx.x; j < cols; j += blockDim.x) total += exp(LOAD(xr[j]) - top);
    total = block_reduce(total, shared, false);
    for (long long j = threadIdx.x; j < cols; j += blockDim.x)
        yr[j] = STORE(exp(LOAD(xr[j]) - top) / total);
}

// Layer norm over the last dim, one block per row: the mean, then the sum of the squared
// deviations (from the cache), then y = (x - mean) rstd w + b; the xp form makes eight passes.
extern "C" __global__ void distgraph_layer_norm(const T* x, const T* w, const T* b, T* y,
                                                T* mean, T* rstd, long long cols, T eps) {
    __shared__ T shared[33];
    const T* xr = x + blockIdx.x * cols;
    T* yr = y + blockIdx.x * cols;
    T total = 0;
    for (long long j = threadIdx.x; j < cols; j += blockDim.x) total += xr[j];
    const T mu = block_reduce(total, shared, false) / (T)cols;
    T squares = 0;
    for (long long j = threadIdx.x; j < cols; j += blockDim.x) {
        T d = xr[j] - mu;
        squares += d * d;
    }
    const T rs = (T)1 / sqrt(block_reduce(squares, shared, false) / (T)cols + eps);
    for (long long j = threadIdx.x; j < cols; j += blockDim.x)
        yr[j] = (xr[j] - mu) * rs * w[j] + b[j];
    if (threadIdx.x == 0) { mean[blockIdx.x] = mu; rstd[blockIdx.x] = rs; }
}

// Its input gradient, one block per row: g = dy w and xhat = (x - mean) rstd summed, then
// dx = rstd / h (h g - sum(g) - xhat sum(g xhat)).
extern "C" __global__ void distgraph_layer_norm_grad(const T* x, const T* w, const T* mean,
                                                     const T* rstd, const T* dy, T* dx,
                                                     long long cols) {
    __shared__ T shared[33];
    const long long start = blockIdx.x * cols;
    const T mu = mean[blockIdx.x], rs = rstd[blockIdx.x];
    T g_sum = 0, gx_sum = 0;
    for (long long j = threadIdx.x; j < cols; j += blockDim.x) {
        T g = dy[start + j] * w[j];
        g_sum += g;
        gx_sum += g * ((x[start + j] - mu) * rs);
    }
    g_sum = block_reduce(g_sum, shared, false);
    gx_sum = block_reduce(gx_sum, shared, false);
    for (long long j = threadIdx.x; j < cols; j += blockDim.x) {
        T g = dy[start + j] * w[j];
        T xhat = (x[start + j] - mu) * rs;
        dx[start + j] = ((T)cols * g - g_sum - xhat * gx_sum) * (rs / (T)cols);
    }
}

// The weight's and the bias' gradients, sums over rows: thread j of block (c, r) sums
// column j over the r-th chunk of rows (a warp reads consecutive columns), into row r of
// the partial sums, which the caller adds up.
extern "C" __global__ void distgraph_layer_norm_grad_columns(
        const T* x, const T* mean, const T* rstd, const T* dy, T* dw_part, T* db_part,
        long long rows, long long cols, long long chunk) {
    const long long j = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (j >= cols) return;
    const long long first = blockIdx.y * chunk;
    const long long last = first + chunk < rows ? first + chunk : rows;
    T dw = 0, db = 0;
    for (long long r = first; r < last; ++r) {
        T d = dy[r * cols + j];
        dw += d * ((x[r * cols + j] - mean[r]) * rstd[r]);
        db += d;
    }
    dw_part[blockIdx.y * cols + j] = dw;
    db_part[blockIdx.y * cols + j] = db;
}

extern "C" __global__ void distgraph_softmax_grad(const S* y, const S* dy, S* dx,
                                                  long long cols) {
    __shared__ T shared[33];
    const long long start = blockIdx.x * cols;
    T dot = 0;
    for (long long j = threadIdx.x; j < cols; j += blockDim.x)
        dot += LOAD(dy[start + j]) * LOAD(y[start + j]);
    dot = block_reduce(dot, shared, false);
    for (long long j = threadIdx.x; j < cols; j += blockDim.x)
        dx[start + j] = STORE(LOAD(y[start + j]) * (LOAD(dy[start + j]) - dot));
}
"""
ROW_THREADS = 256          # a multiple of 32, at most 32 warps (block_reduce's shared)
ROW_TYPES = {"float32": "float", "float64": "double"}
# The softmax pair on bfloat16 rows: each entry widened to float32 as it is read and
# rounded to nearest even as it is written, the arithmetic the float32 kernel's (so the
# bits of the widened path: float32 copies, the float32 kernel, its result rounded; NaNs
# aside), in one pass where that is three. T computes, S is stored.
SAME_STORAGE = "typedef T S;\n#define LOAD(v) (v)\n#define STORE(v) (v)\n"
BFLOAT16_STORAGE = r"""typedef float T;
typedef unsigned short S;
__device__ __forceinline__ float LOAD(S v) { return __uint_as_float(((unsigned)v) << 16); }
__device__ __forceinline__ S STORE(float f) {
    unsigned b = __float_as_uint(f);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (S)((b >> 16) | 0x40u);    // NaN, quiet
    return (S)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}
"""


def by_rows(*arrays) -> bool:
    """Whether the row kernels take ``arrays``: C-contiguous, of one float32 or float64
    dtype and shape, with rows."""
    a = arrays[0]
    return (a.dtype.name in ROW_TYPES and a.ndim >= 1 and a.size > 0
            and all(b.dtype == a.dtype and b.shape == a.shape and b.flags.c_contiguous
                    for b in arrays))


def by_rows_of(x, *rowwise) -> bool:
    """Whether the layer-norm kernels take ``x`` (:func:`by_rows`, with its gradient
    among ``rowwise`` too) and ``rowwise``'s others: C-contiguous arrays of ``x``'s dtype,
    each the size of a row (a weight, a bias) or one entry per row (a statistic)."""
    if not by_rows(x, *(a for a in rowwise if a.shape == x.shape)):
        return False
    sizes = (x.shape[-1], x.size // x.shape[-1])
    return all(a.dtype == x.dtype and a.flags.c_contiguous and a.size in sizes
               for a in rowwise if a.shape != x.shape)


def rows_bf16(*arrays) -> bool:
    """Whether the softmax kernels take ``arrays`` as they are in bfloat16: C-contiguous,
    bfloat16, of one shape, with rows."""
    a = arrays[0]
    return (a.dtype.name == "bfloat16" and a.ndim >= 1 and a.size > 0
            and all(b.dtype == a.dtype and b.shape == a.shape and b.flags.c_contiguous
                    for b in arrays))


@functools.lru_cache(maxsize=None)
def _row_kernel(name: str, dtype):
    import cupy

    head = BFLOAT16_STORAGE if dtype.name == "bfloat16" else \
        f"typedef {ROW_TYPES[dtype.name]} T;\n" + SAME_STORAGE
    return cupy.RawModule(code=head + ROWS).get_function(name)


def softmax(x):
    """Softmax over the last dim of CuPy array ``x`` (:func:`by_rows` or
    :func:`rows_bf16`), in a new array."""
    import cupy

    y = cupy.empty_like(x)
    cols = x.shape[-1]
    _row_kernel("distgraph_softmax", x.dtype)(
        (x.size // cols,), (ROW_THREADS,), (x, y, cupy.int64(cols)))
    return y


def softmax_grad(y, dy):
    """``y (dy - sum(dy y))`` over the last dim (:func:`by_rows` or :func:`rows_bf16`),
    in a new array."""
    import cupy

    dx = cupy.empty_like(y)
    cols = y.shape[-1]
    _row_kernel("distgraph_softmax_grad", y.dtype)(
        (y.size // cols,), (ROW_THREADS,), (y, dy, dx, cupy.int64(cols)))
    return dx


def layer_norm(x, w, b, epsilon):
    """(y, mean, rstd) of layer norm over the last dim of CuPy array ``x`` with weight
    ``w`` and bias ``b`` (:func:`by_rows_of`), each in a new array."""
    import cupy

    cols = x.shape[-1]
    y = cupy.empty_like(x)
    mean = cupy.empty(x.shape[:-1], dtype=x.dtype)
    rstd = cupy.empty_like(mean)
    _row_kernel("distgraph_layer_norm", x.dtype)(
        (x.size // cols,), (ROW_THREADS,),
        (x, w, b, y, mean, rstd, cupy.int64(cols), x.dtype.type(epsilon)))
    return y, mean, rstd


COLUMN_ROWS = 64           # rows a thread of the column sums adds up (more where there
MAX_CHUNKS = 65535         # are more chunks than a grid's second dim holds)


def layer_norm_grad(x, w, mean, rstd, dy):
    """(dx, dw, db) of layer norm (:func:`by_rows_of`): dx one block per row, dw and db
    as partial column sums over chunks of :data:`COLUMN_ROWS` rows, added up."""
    import cupy

    cols = x.shape[-1]
    rows = x.size // cols
    dx = cupy.empty_like(x)
    _row_kernel("distgraph_layer_norm_grad", x.dtype)(
        (rows,), (ROW_THREADS,), (x, w, mean, rstd, dy, dx, cupy.int64(cols)))
    chunk = max(COLUMN_ROWS, -(-rows // MAX_CHUNKS))
    chunks = -(-rows // chunk)
    parts = cupy.empty((2, chunks, cols), dtype=x.dtype)
    _row_kernel("distgraph_layer_norm_grad_columns", x.dtype)(
        (-(-cols // ROW_THREADS), chunks), (ROW_THREADS,),
        (x, mean, rstd, dy, parts[0], parts[1], cupy.int64(rows), cupy.int64(cols),
         cupy.int64(chunk)))
    return dx, parts[0].sum(axis=0), parts[1].sum(axis=0)


# cuBLAS's names for what strided_gemm passes (cublas_api.h, library_types.h)
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUDA_TYPES = {"float16": 2, "bfloat16": 14}          # CUDA_R_16F, CUDA_R_16BF
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_POINTER_MODE_HOST = 0


def stacked_16bit(x, y) -> bool:
    """Whether :func:`batched_matmul` takes ``x`` and ``y``: one 16-bit float dtype, the
    same batch dims (attention's products; no broadcasting)."""
    return (x.dtype == y.dtype and x.dtype.name in CUDA_TYPES and x.ndim == y.ndim > 2
            and x.shape[:-2] == y.shape[:-2])


def strided_gemm_args(x_shape, y_shape, transpose_x: bool, transpose_y: bool) -> tuple:
    """cuBLAS's column-major arguments for the row-major batched product
    ``op(x) @ op(y)`` of C-contiguous ``x`` and ``y`` of one batch shape: (transa, transb,
    m, n, k, lda, stride_a, ldb, stride_b, ldc, stride_c, batch, result shape). A
    row-major matrix is its transpose in column-major order, so C = op(x) op(y) is
    computed as C^T = op(y)^T op(x)^T, with y's buffer as cuBLAS's A and x's as its B."""
    *batch, xr, xc = x_shape
    yr, yc = y_shape[-2:]
    m, k = (xc, xr) if transpose_x else (xr, xc)
    n = yr if transpose_y else yc
    count = 1
    for d in batch:
        count *= d
    return (CUBLAS_OP_T if transpose_y else CUBLAS_OP_N,
            CUBLAS_OP_T if transpose_x else CUBLAS_OP_N,
            n, m, k, yc, yr * yc, xc, xr * xc, n, m * n, count, (*batch, m, n))


def batched_matmul(x, y, transpose_x: bool, transpose_y: bool):
    """``op(x) @ op(y)`` of CuPy arrays of one 16-bit float dtype and one batch shape, as
    one strided-batched GEMM on the matrix units (float32 accumulation, the result rounded
    once), in a new array. CuPy's matmul has no such path for 16-bit operands."""
    import cupy
    import numpy as np
    from cupy.cuda import cublas, device

    x, y = cupy.ascontiguousarray(x), cupy.ascontiguousarray(y)
    (transa, transb, m, n, k, lda, stride_a, ldb, stride_b, ldc, stride_c, count,
     shape) = strided_gemm_args(x.shape, y.shape, transpose_x, transpose_y)
    out = cupy.zeros(shape, dtype=x.dtype) if k == 0 else cupy.empty(shape, dtype=x.dtype)
    if out.size == 0 or k == 0:
        return out
    kind = CUDA_TYPES[x.dtype.name]
    one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
    handle = device.get_cublas_handle()
    mode = cublas.getPointerMode(handle)
    cublas.setPointerMode(handle, CUBLAS_POINTER_MODE_HOST)
    try:
        cublas.gemmStridedBatchedEx(
            handle, transa, transb, m, n, k, one.ctypes.data,
            y.data.ptr, kind, lda, stride_a, x.data.ptr, kind, ldb, stride_b,
            zero.ctypes.data, out.data.ptr, kind, ldc, stride_c, count,
            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
    finally:
        cublas.setPointerMode(handle, mode)
    return out
