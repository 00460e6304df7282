"""Elementwise ops with numpy broadcasting, constants, activations, where/mask, dropout.

The ops alike are rows of three tables, each a family with one ``infer``, sharding rule
and FLOP count: ``ARITHMETIC`` (binary, broadcasting), ``UNARY`` (math and activations)
and ``GRADS`` (the gradient ops of ``UNARY``). A new unary op is one row of ``UNARY``
(and its gradient op, if it has one, a row of ``GRADS``); ``unary_function`` makes its
functional form. The ops that differ (attributes, several outputs, randomness) are classes.

Sharding: every entry here uses the broadcasting einsum family (``elementwise_rule``):
S(i) x S(i) -> S(i) per letter, a stretched size-1 dim is never split.
"""

from __future__ import annotations

import math

import numpy as np

from distgraph import dtypes
from distgraph.ops import fused_gpu
from distgraph.ops.common import (Row, as_tensor_pair, broadcast_infer, elementwise_flops,
                                  reduce_to_shape, register_rows)
from distgraph.registry import ShapeError, TensorType, nbytes, register_op, size
from distgraph.spmd import EinsumRule, elementwise_rule
from distgraph.trace import emit, emit1

GELU_C = math.sqrt(2.0 / math.pi)
DRAW = 1 << 16         # dropout's numbers drawn at a time (float64: 512 KiB)


# -- arithmetic --------------------------------------------------------------------------------
# Gradients sum each operand's back over the dims it was broadcast along.
def _add_grad(op, dz):
    x, y = op.inputs
    return [reduce_to_shape(dz, x.shape), reduce_to_shape(dz, y.shape)]


def _subtract_grad(op, dz):
    x, y = op.inputs
    return [reduce_to_shape(dz, x.shape), reduce_to_shape(neg(dz), y.shape)]


def _multiply_grad(op, dz):
    x, y = op.inputs
    return [reduce_to_shape(multiply(dz, y), x.shape), reduce_to_shape(multiply(dz, x), y.shape)]


def _divide_grad(op, dz):
    x, y = op.inputs
    z = op.outputs[0]
    dx = divide(dz, y)
    return [reduce_to_shape(dx, x.shape), reduce_to_shape(neg(multiply(dx, z)), y.shape)]


# Row(name, kernel, grad): each writes into a dying operand's buffer (donate), 1 FLOP per
# element. S(i) x S(i) -> S(i); S(i) x R -> S(i) where the other operand's dim i is 1.
# add and subtract are linear: P x P -> P (the sum of pending sums is one pending sum).
LINEAR = elementwise_rule(linear=True)
ARITHMETIC = (
    Row("add", lambda ctx, x, y: ctx.xp.add(x, y, out=ctx.out), _add_grad, donate=True,
        spmd=LINEAR),
    Row("subtract", lambda ctx, x, y: ctx.xp.subtract(x, y, out=ctx.out), _subtract_grad,
        donate=True, spmd=LINEAR),
    Row("multiply", lambda ctx, x, y: ctx.xp.multiply(x, y, out=ctx.out), _multiply_grad,
        donate=True),
    Row("divide", lambda ctx, x, y: ctx.xp.divide(x, y, out=ctx.out), _divide_grad,
        donate=True),
)
register_rows(ARITHMETIC, infer=broadcast_infer, spmd=elementwise_rule())


@register_op("scale", spmd=elementwise_rule(), donate=True)
class Scale:
    """``x * scale + bias`` with Python-number attributes."""

    flops = elementwise_flops(2)

    def infer(x, scale=1.0, bias=0.0):
        return x

    def kernel(ctx, x, scale=1.0, bias=0.0):
        out = ctx.xp.multiply(x, x.dtype.type(scale), out=ctx.out)
        if bias:
            out += x.dtype.type(bias)
        return out

    def grad(op, dz):
        return [scale_(dz, op.attrs["scale"])]


# -- unary math and activations ----------------------------------------------------------------
def same(x):
    """A unary op's result: its operand's shape and dtype."""
    return x


def grad_infer(y, dy):
    """A gradient op's result: its operands' (broadcast) shape and common dtype."""
    return broadcast_infer(y, dy)


# The activations' kernels run in place on one array of the result's size (and their
# gradients on one more), not as array expressions: an expression allocates an array per
# operation (numpy elides some of them, CuPy none), 3 to 5 the size of the result for
# GELU's.
def _result(ctx, *arrays):
    """An uninitialised array of the broadcast shape of ``arrays``, in their dtype."""
    shape = ctx.xp.broadcast_shapes(*(a.shape for a in arrays))
    return ctx.xp.empty(shape, arrays[0].dtype)


def _gelu_tanh(ctx, x):
    """tanh(sqrt(2/pi) (x + 0.044715 x^3)), in a new array."""
    t = x.dtype.type
    out = ctx.xp.multiply(x, x, out=_result(ctx, x))
    out *= x
    out *= t(0.044715)
    out += x
    out *= t(GELU_C)
    return ctx.xp.tanh(out, out=out)


def _gelu(ctx, x):
    """GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))); one
    kernel on a GPU (:mod:`distgraph.ops.fused_gpu`)."""
    if ctx.xp is not np:
        return fused_gpu.gelu(x)
    out = _gelu_tanh(ctx, x)
    out += 1
    out *= x
    out *= x.dtype.type(0.5)
    return out


def _sigmoid(ctx, x):
    """sigmoid(x) = (1 + tanh(x / 2)) / 2 (no overflow), in a new array."""
    half = x.dtype.type(0.5)
    out = ctx.xp.multiply(x, half, out=_result(ctx, x))
    ctx.xp.tanh(out, out=out)
    out *= half
    out += half
    return out


def _silu(ctx, x):
    """SiLU (swish): x sigmoid(x)."""
    out = _sigmoid(ctx, x)
    out *= x
    return out


def _silu_grad(ctx, x, dy):
    """dy s (1 + x (1 - s)), s = sigmoid(x)."""
    s = _sigmoid(ctx, x)
    out = _result(ctx, s, dy)
    ctx.xp.subtract(1, s, out=out)
    out *= x
    out += 1
    out *= s
    out *= dy
    return out


def _gelu_grad(ctx, x, dy):
    """dy (0.5 (1 + th) + 0.5 x (1 - th^2) d), th = tanh(inner), d = inner' =
    sqrt(2/pi) (1 + 3 0.044715 x^2); computed as dy (1 + th) (0.5 + 0.5 x d (1 - th)),
    in one kernel on a GPU where ``x`` and ``dy`` share a dtype."""
    t, xp = x.dtype.type, ctx.xp
    if xp is not np and x.dtype == dy.dtype:
        return fused_gpu.gelu_grad(x, dy)
    th = _gelu_tanh(ctx, x)
    half_xd = _result(ctx, x, dy)
    xp.multiply(x, x, out=half_xd)
    half_xd *= t(3 * 0.044715)
    half_xd += 1
    half_xd *= t(GELU_C)
    half_xd *= x
    half_xd *= t(0.5)
    xp.subtract(1, th, out=th)          # 1 - th
    half_xd *= th
    half_xd += t(0.5)
    xp.subtract(2, th, out=th)          # 1 + th
    half_xd *= th
    half_xd *= dy
    return half_xd


# Row(name, kernel, grad, flops per element=1, donate=False); rule S(i) -> S(i).
# A new unary op (silu, rsqrt, ...) is a row here and a name for unary_function below; a
# gradient that needs its own kernel is a row of GRADS, emitted by this row's grad.
UNARY = (
    Row("neg", lambda ctx, x: -x, lambda op, dz: [neg(dz)]),
    Row("exp", lambda ctx, x: ctx.xp.exp(x), lambda op, dz: [multiply(dz, op.outputs[0])]),
    Row("log", lambda ctx, x: ctx.xp.log(x), lambda op, dz: [divide(dz, op.inputs[0])]),
    Row("sqrt", lambda ctx, x: ctx.xp.sqrt(x),
        lambda op, dz: [scale_(divide(dz, op.outputs[0]), 0.5)]),
    Row("tanh", lambda ctx, x: ctx.xp.tanh(x),
        lambda op, dz: [emit1("tanh_grad", [op.outputs[0], dz])]),
    Row("relu", lambda ctx, x: ctx.xp.maximum(x, x.dtype.type(0), out=ctx.out),
        lambda op, dz: [emit1("relu_grad", [op.outputs[0], dz])], donate=True),
    Row("gelu", _gelu, lambda op, dz: [emit1("gelu_grad", [op.inputs[0], dz])], flops=8),
    Row("silu", _silu, lambda op, dz: [emit1("silu_grad", [op.inputs[0], dz])], flops=5),
)
register_rows(UNARY, infer=same, spmd=elementwise_rule())

def _of_x(ins, outs):
    """The workspace of a gradient of an activation of x: one array of x's shape (th, s)."""
    return nbytes(ins[0])


def _tanh_grad(ctx, y, dy):
    """dy (1 - y^2)."""
    out = ctx.xp.multiply(y, y, out=_result(ctx, y, dy))
    ctx.xp.subtract(1, out, out=out)
    out *= dy
    return out


# Row(name, kernel(ctx, y or x, dy) -> dx, flops per element); rule S(i) x S(i) -> S(i).
GRADS = (
    Row("tanh_grad", _tanh_grad, flops=3),                               # dy (1 - y^2)
    Row("relu_grad", lambda ctx, y, dy: ctx.xp.multiply(dy, y > 0, out=ctx.out),
        donate=True, workspace=lambda ins, outs: size(ins[0])),        # dy where y > 0
    Row("gelu_grad", _gelu_grad, flops=14, workspace=_of_x,
        infer=lambda x, dy: broadcast_infer(x, dy)),                     # reads x, not y
    Row("silu_grad", _silu_grad, flops=8, workspace=_of_x,
        infer=lambda x, dy: broadcast_infer(x, dy)),                     # reads x, not y
)
register_rows(GRADS, infer=grad_infer, spmd=elementwise_rule(), differentiable=False)


# A cast is linear in its operand: a pending sum cast part by part sums to the cast sum
# (exactly where it widens; where it narrows, as a 16-bit sum's parts round anyway). So
# under amp a gradient's 16-bit parts, pending over the data-parallel dims, are cast to
# float32 and accumulated as they come, and reduced once a step, as Megatron's float32
# gradient buffers are (``S(0) P x -> S(0) P``).
@register_op("cast", spmd=elementwise_rule(linear=True), takes_16bit=True)
class Cast:
    def infer(x, dtype):
        return TensorType(x.shape, dtypes.canonical(dtype))

    def kernel(ctx, x, dtype):
        return x.astype(dtype)

    def grad(op, dz):
        x = op.inputs[0]
        return [cast(dz, x.dtype) if dtypes.is_float(x.dtype) else None]


# -- constants, where, masks --------------------------------------------------------------------
@register_op("full", spmd=EinsumRule(lambda shapes, attrs: "->" + "1" * len(attrs["shape"])),
             differentiable=False, takes_16bit=True)
class Full:
    """A constant tensor (replicated: its dims are never split)."""

    def infer(shape, value, dtype):
        return TensorType(tuple(shape), dtypes.canonical(dtype))

    def kernel(ctx, shape, value, dtype):
        return ctx.xp.full(shape, value, dtype=dtype)


@register_op("where", spmd=elementwise_rule(), takes_16bit=True)
class Where:
    """``cond ? x : y`` with broadcasting; ``cond`` is bool (a choice, exact in any
    dtype: 16-bit operands are taken as they are)."""

    flops = elementwise_flops(1)

    def infer(cond, x, y):
        if cond.dtype != "bool":
            raise ShapeError(f"where: condition must be bool, got {cond.dtype}")
        t = broadcast_infer(x, y)
        return TensorType(broadcast_infer(TensorType(cond.shape, t.dtype), t).shape, t.dtype)

    def kernel(ctx, cond, x, y):
        return ctx.xp.where(cond, x, y)

    def grad(op, dz):
        cond, x, y = op.inputs
        zero = constant_like(dz, 0.0)
        return [None, reduce_to_shape(where(cond, dz, zero), x.shape),
                reduce_to_shape(where(cond, zero, dz), y.shape)]


@register_op("causal_mask", spmd=EinsumRule("->AB"), differentiable=False)
class CausalMask:
    """Bool [size, size], True where query i may attend to key j: j <= i, and with a
    sliding ``window`` (Mistral's) also i - j < window."""

    def infer(size, window=None):
        if window is not None and window < 1:
            raise ShapeError(f"causal_mask: window {window} must be at least 1")
        return TensorType((size, size), "bool")

    def kernel(ctx, size, window=None):
        mask = ctx.xp.tri(size, size, 0, dtype=bool)
        if window is not None and window < size:
            # the keys a window hides, j <= i - window, are a part of those j <= i
            ctx.xp.logical_xor(mask, ctx.xp.tri(size, size, -window, dtype=bool), out=mask)
        return mask

    def workspace(ins, outs, size, window=None):
        return size * size if window is not None and window < size else 0


@register_op("dropout", spmd=elementwise_rule(n_out=2))
class Dropout:
    """Outputs (y, keep mask). The mask is drawn for the whole global tensor from
    (seed, step) and sliced, so every partition of it sees the same numbers."""

    flops = elementwise_flops(2)

    def infer(x, p, seed):
        return x, TensorType(x.shape, "bool")

    def kernel(ctx, x, p, seed):
        shape = ctx.out_global_shape or x.shape
        rng = np.random.Generator(np.random.Philox(key=seed, counter=ctx.step))
        # drawn DRAW numbers at a time (the stream's same numbers as drawn at once)
        keep = np.empty(shape, dtype=bool)
        flat = keep.reshape(-1)
        for start in range(0, flat.size, DRAW):
            stop = min(start + DRAW, flat.size)
            np.greater_equal(rng.random(stop - start), p, out=flat[start:stop])
        if ctx.out_slices is not None and keep.shape != x.shape:
            keep = np.ascontiguousarray(keep[ctx.out_slices])
        keep = ctx.xp.asarray(keep)
        out = ctx.xp.multiply(x, keep, out=ctx.xp.empty_like(x))
        out *= x.dtype.type(1.0 / (1.0 - p))
        return out, keep

    def workspace(ins, outs, p, seed):
        # a block of draws (float64), before the result is made; a process that keeps a
        # slice of the mask (a split tensor, a micro-batch) also draws the whole mask (a
        # byte an element of the global tensor), which its local types do not say and
        # this leaves out
        return max(8 * min(size(ins[0]), DRAW) - nbytes(outs[0]), 0)

    def localize(attrs, site):
        return attrs, {"out_global_shape": tuple(site.out_shapes[0]),
                       "out_slices": site.out_slices(0)}

    def grad(op, dz, dmask=None):
        return [emit1("dropout_grad", [op.outputs[1], dz], {"p": op.attrs["p"]})]


@register_op("dropout_grad", spmd=elementwise_rule(), differentiable=False)
class DropoutGrad:
    flops = elementwise_flops(2)

    def infer(keep, dy, p):
        return dy

    def kernel(ctx, keep, dy, p):
        out = ctx.xp.multiply(dy, keep, out=ctx.xp.empty_like(dy))
        out *= dy.dtype.type(1.0 / (1.0 - p))
        return out


# -- functional API -----------------------------------------------------------------------------
def add(x, y):
    return emit1("add", as_tensor_pair(x, y))


def subtract(x, y):
    return emit1("subtract", as_tensor_pair(x, y))


def multiply(x, y):
    return emit1("multiply", as_tensor_pair(x, y))


def divide(x, y):
    return emit1("divide", as_tensor_pair(x, y))


def scale_(x, scale=1.0, bias=0.0):
    return emit1("scale", [x], {"scale": float(scale), "bias": float(bias)})


def unary_function(op_type: str):
    """The functional form of a UNARY row that takes no options: ``f(x)`` traces one
    ``op_type`` op on ``x``."""

    def function(x):
        return emit1(op_type, [x])

    function.__name__ = function.__qualname__ = op_type
    function.__doc__ = f"Elementwise ``{op_type}`` of ``x`` (one ``{op_type}`` op)."
    return function


neg, exp, log, sqrt, tanh, relu, silu = map(unary_function, ("neg", "exp", "log", "sqrt", "tanh",
                                                            "relu", "silu"))


def gelu(x, approximate=True):
    if not approximate:
        raise ShapeError("gelu: only the tanh approximation (approximate=True) is implemented")
    return emit1("gelu", [x])


def cast(x, dtype):
    return emit1("cast", [x], {"dtype": dtypes.canonical(dtype)})


def full(shape, value, dtype=None):
    return emit1("full", [], {"shape": tuple(shape), "value": float(value),
                              "dtype": dtypes.canonical(dtype or dtypes.get_default_dtype())})


def constant_like(x, value):
    return full((), value, x.dtype)


def where(cond, x, y):
    x, y = as_tensor_pair(x, y)
    return emit1("where", [cond, x, y])


def causal_mask(size, window=None):
    attrs = {"size": int(size)}
    if window is not None:
        attrs["window"] = int(window)
    return emit1("causal_mask", [], attrs)


def dropout(x, p=0.5, training=True, seed=0):
    """Zero each element with probability ``p`` and scale the rest by 1/(1-p)."""
    if not 0.0 <= p < 1.0:
        raise ShapeError(f"dropout: p must be in [0, 1), got {p}")
    if not training or p == 0.0:
        return x
    return emit("dropout", [x], {"p": float(p), "seed": int(seed)})[0]
