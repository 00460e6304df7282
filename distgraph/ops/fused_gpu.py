"""Kernels a GPU runs in one pass where the ``xp`` form of an op takes many.

An update op's ``xp`` form is a dozen array expressions, each a kernel launch and a pass
over the parameter's bytes; numpy runs them a block at a time so that the passes after
the first read the cache. A GPU has no such cache to reuse but pays each launch, and
over a GPT's 150 parameters the launches outnumber the work. :func:`adam` is Adam's
step as one CuPy elementwise kernel: each element read and written once, the step
counter and the learning rate read on the device (no copy to the host, which would
wait for the GPU). :func:`gelu` and :func:`gelu_grad` are GELU's (tanh form) array
expressions, 7 and 14 passes over an activation, as one each. Their arithmetic is the
``xp`` forms', in the operands' dtype, so a float64 step equals numpy's to rounding.
"""

from __future__ import annotations

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


def adam(param, grad, m, v, step, lr, beta1, beta2, epsilon, weight_decay) -> None:
    """One Adam / AdamW step on CuPy arrays ``param``, ``m``, ``v`` in place, from
    ``grad`` of their dtype and the 0-d ``step`` (after its increment) and ``lr``."""
    import cupy

    kernel = cupy.ElementwiseKernel(
        "T g, S step, L lr, float64 b1, float64 b2, float64 eps, float64 wd",
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
    import cupy

    return cupy.ElementwiseKernel("T x", "T y", GELU, "distgraph_gelu")(x)


def gelu_grad(x, dy):
    """GELU's gradient at ``x`` times ``dy`` (CuPy arrays of one dtype), in a new array."""
    import cupy

    return cupy.ElementwiseKernel("T x, T dy", "T dx", GELU_GRAD, "distgraph_gelu_grad")(x, dy)


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

extern "C" __global__ void distgraph_softmax(const T* x, T* y, long long cols) {
    __shared__ T shared[33];
    const T* xr = x + blockIdx.x * cols;
    T* yr = y + blockIdx.x * cols;
    T top = xr[0];
    for (long long j = threadIdx.x; j < cols; j += blockDim.x) top = xr[j] > top ? xr[j] : top;
    top = block_reduce(top, shared, true);
    T total = 0;
    for (long long j = threadIdx.x; j < cols; j += blockDim.x) total += exp(xr[j] - top);
    total = block_reduce(total, shared, false);
    for (long long j = threadIdx.x; j < cols; j += blockDim.x) yr[j] = exp(xr[j] - top) / total;
}

extern "C" __global__ void distgraph_softmax_grad(const T* y, const T* dy, T* dx,
                                                  long long cols) {
    __shared__ T shared[33];
    const long long start = blockIdx.x * cols;
    T dot = 0;
    for (long long j = threadIdx.x; j < cols; j += blockDim.x)
        dot += dy[start + j] * y[start + j];
    dot = block_reduce(dot, shared, false);
    for (long long j = threadIdx.x; j < cols; j += blockDim.x)
        dx[start + j] = y[start + j] * (dy[start + j] - dot);
}
"""
ROW_THREADS = 256          # a multiple of 32, at most 32 warps (block_reduce's shared)
ROW_TYPES = {"float32": "float", "float64": "double"}


def by_rows(*arrays) -> bool:
    """Whether the row kernels take ``arrays``: C-contiguous, of one float32 or float64
    dtype and shape, with rows."""
    a = arrays[0]
    return (a.dtype.name in ROW_TYPES and a.ndim >= 1 and a.size > 0
            and all(b.dtype == a.dtype and b.shape == a.shape and b.flags.c_contiguous
                    for b in arrays))


def _row_kernel(name: str, dtype):
    import cupy

    source = f"typedef {ROW_TYPES[dtype.name]} T;\n" + ROWS
    return cupy.RawModule(code=source).get_function(name)


def softmax(x):
    """Softmax over the last dim of CuPy array ``x`` (:func:`by_rows`), in a new array."""
    import cupy

    y = cupy.empty_like(x)
    cols = x.shape[-1]
    _row_kernel("distgraph_softmax", x.dtype)(
        (x.size // cols,), (ROW_THREADS,), (x, y, cupy.int64(cols)))
    return y


def softmax_grad(y, dy):
    """``y (dy - sum(dy y))`` over the last dim (:func:`by_rows`), in a new array."""
    import cupy

    dx = cupy.empty_like(y)
    cols = y.shape[-1]
    _row_kernel("distgraph_softmax_grad", y.dtype)(
        (y.size // cols,), (ROW_THREADS,), (y, dy, dx, cupy.int64(cols)))
    return dx
