"""Optimizer update ops. They write into their operands (``inplace``), as a hand-written
training loop would, so a step needs no second copy of parameters or moments. The
learning rate is an operand (a 0-d array the Engine sets before each step), not an
attribute, so a schedule needs no new program.

Sharding: elementwise over the parameter's dims; the 0-d step counter and learning rate
are replicated. S(i) x S(i) x S(i) x S(i) x R x R -> S(i) x S(i) x S(i).

Each update (and the step counter) takes an optional last operand ``apply``, a 0-d bool:
False leaves everything as it was — float16 training skips a step whose gradients
overflowed (:mod:`distgraph.optim.amp`, with the loss-scaling ops below).
"""

from __future__ import annotations

import math

import numpy as np

from distgraph import dtypes
from distgraph.ops import fused_gpu
from distgraph.ops.common import elementwise_flops
from distgraph.registry import ShapeError, TensorType, register_op, size
from distgraph.spmd import EinsumRule, LETTERS


def _same_shapes(*ts):
    if len({tuple(t.shape) for t in ts}) != 1:
        raise ShapeError(f"update operands must share a shape, got {[list(t.shape) for t in ts]}")


def _scalar(what, t):
    if tuple(t.shape) != ():
        raise ShapeError(f"the {what} must be 0-d, got shape {list(t.shape)}")


def _update_notation(n_tensor_in, n_out):
    def notation(in_shapes, attrs):
        word = LETTERS[:len(in_shapes[0])]
        ins = [word] * n_tensor_in + [""] * (len(in_shapes) - n_tensor_in)   # the scalars
        return ",".join(ins) + "->" + ",".join([word] * n_out)
    notation.__name__ = f"update{n_tensor_in}x{n_out}"
    return notation


def _skipped(apply) -> bool:
    """Whether an update's ``apply`` operand says to leave everything as it is."""
    return apply is not None and not bool(apply)


def _flag(apply) -> None:
    if apply is not None and (tuple(apply.shape) != () or apply.dtype != "bool"):
        raise ShapeError(f"an update's apply flag is a 0-d bool, got {apply.dtype} "
                         f"{list(apply.shape)}")


@register_op("increment", spmd=EinsumRule(lambda shapes, attrs: ",".join([""] * len(shapes))
                                          + "->"), inplace=((0, 0),), differentiable=False)
class Increment:
    """step += 1 on a 0-d counter (unless ``apply`` is False)."""

    def infer(step, apply=None):
        _flag(apply)
        return step

    def kernel(ctx, step, apply=None):
        if not _skipped(apply):
            step += 1
        return step


@register_op("sgd_update", spmd=EinsumRule(_update_notation(3, 2)),
             inplace=((0, 0), (1, 2)), differentiable=False)
class SgdUpdate:
    """velocity = momentum * velocity + grad; param -= lr * velocity (PyTorch's form).
    With momentum 0 the velocity is never read again, so it is left alone (zero, as
    PyTorch keeps no buffer then) and the update is param -= lr * grad."""

    flops = elementwise_flops(4)

    def infer(param, grad, velocity, lr, apply=None, *, momentum):
        _same_shapes(param, grad, velocity)
        _scalar("sgd learning rate", lr)
        _flag(apply)
        return param, velocity

    def kernel(ctx, param, grad, velocity, lr, apply=None, *, momentum):
        if _skipped(apply):
            return param, velocity
        t, lr = param.dtype.type, float(lr)

        def step(param, grad, velocity, tmp):
            if momentum == 0:
                # two parameter-sized passes instead of four
                ctx.xp.multiply(grad, t(lr), out=tmp)
            else:
                velocity *= t(momentum)
                velocity += grad
                ctx.xp.multiply(velocity, t(lr), out=tmp)
            param -= tmp

        by_blocks(ctx.xp, step, param, grad, velocity)
        return param, velocity

    def workspace(ins, outs, momentum):
        return block_bytes(ins[0])


@register_op("adam_update", spmd=EinsumRule(_update_notation(4, 3)),
             inplace=((0, 0), (1, 2), (2, 3)), differentiable=False)
class AdamUpdate:
    """Adam / AdamW (decoupled ``weight_decay``), PyTorch's formulation:
    m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
    p -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps), after p *= 1 - lr * wd."""

    flops = elementwise_flops(12)

    def infer(param, grad, m, v, step, lr, apply=None, *, beta1, beta2, epsilon, weight_decay):
        _same_shapes(param, grad, m, v)
        _scalar("adam step counter", step)
        _scalar("adam learning rate", lr)
        _flag(apply)
        return param, m, v

    def kernel(ctx, param, grad, m, v, step, lr, apply=None, *, beta1, beta2, epsilon,
               weight_decay):
        if _skipped(apply):
            return param, m, v
        return _adam_step(ctx.xp, param, grad, m, v, step, lr, beta1, beta2, epsilon,
                          weight_decay)

    def workspace(ins, outs, beta1, beta2, epsilon, weight_decay):
        return block_bytes(ins[0])


@register_op("mixed_adam_update", spmd=EinsumRule(_update_notation(5, 4)),
             inplace=((0, 0), (1, 2), (2, 3), (3, 4)), differentiable=False, takes_16bit=True)
class MixedAdamUpdate:
    """Adam / AdamW of a 16-bit parameter as mixed-precision training runs it (ZeRO's
    2 + 2 + 12 bytes per parameter): the step is taken on the float32 ``master`` copy
    with float32 moments, and the 16-bit parameter is the master rounded. It takes the
    16-bit parameter and gradient as they are (``takes_16bit``): the gradient is widened
    a block at a time, the parameter written in place."""

    flops = elementwise_flops(13)

    def infer(param, grad, master, m, v, step, lr, beta1, beta2, epsilon, weight_decay):
        _same_shapes(param, grad, master, m, v)
        _scalar("adam step counter", step)
        _scalar("adam learning rate", lr)
        return param, master, m, v

    def kernel(ctx, param, grad, master, m, v, step, lr, beta1, beta2, epsilon,
               weight_decay):
        _adam_step(ctx.xp, master, grad, m, v, step, lr, beta1, beta2, epsilon,
                   weight_decay)
        param[...] = master
        return param, master, m, v

    def workspace(ins, outs, beta1, beta2, epsilon, weight_decay):
        param, grad, master = ins[:3]
        wide = TensorType(grad.shape, master.dtype)
        return block_bytes(master) + (block_bytes(wide) if grad.dtype != master.dtype else 0)


CHUNK = 1 << 16     # elements per block of a host update (5 such arrays fit in L2)


def block_bytes(t: TensorType) -> int:
    """Bytes of one block of an update over ``t``: its scratch array (``by_blocks``)."""
    return min(size(t), CHUNK) * dtypes.itemsize(t.dtype)


def by_blocks(xp, step, param, *arrays) -> None:
    """``step(param, *arrays, tmp)`` on blocks of CHUNK elements of the same-shape
    ``param`` and ``arrays`` (all at once where they are small or not C-contiguous),
    ``tmp`` a scratch block of ``param``'s dtype; an operand of another dtype (a 16-bit
    gradient) is widened into a second scratch block first. Blocks read each array from
    memory once, the step's other passes from cache, and the scratch is one block."""
    arrays = (param,) + arrays
    if param.size == 0:
        return
    whole = param.size <= CHUNK or not all(getattr(a, "flags", None) is not None
                                           and a.flags.c_contiguous for a in arrays)
    flat = arrays if whole else [a.reshape(-1) for a in arrays]
    n = param.size if whole else CHUNK
    tmp = xp.empty(n, param.dtype)
    wide = xp.empty(n, param.dtype) if any(a.dtype != param.dtype for a in arrays) else None
    for start in range(0, param.size, n):
        block = [a[start:start + n] if not whole else a for a in flat]
        count = block[0].size
        for i, a in enumerate(block):
            if a.dtype != param.dtype:
                block[i] = wide[:count].reshape(a.shape)
                block[i][...] = a
        step(*block, tmp[:count].reshape(block[0].shape))


def _adam_step(xp, param, grad, m, v, step, lr, beta1, beta2, epsilon, weight_decay):
    """One Adam step on ``param`` and its moments, in place (see AdamUpdate), a block at
    a time (:func:`by_blocks`); on a GPU in one kernel
    (:func:`distgraph.ops.fused_gpu.adam`) where the gradient is of the parameter's
    dtype. ``step`` and ``lr``: 0-d arrays."""
    if xp is not np and grad.dtype == param.dtype:
        fused_gpu.adam(param, grad, m, v, step, lr, beta1, beta2, epsilon, weight_decay)
        return param, m, v
    n, lr = float(step), float(lr)
    by_blocks(xp, lambda *block: _adam_block(xp, *block, n, lr, beta1, beta2, epsilon,
                                              weight_decay), param, grad, m, v)
    return param, m, v


def _adam_block(xp, param, grad, m, v, tmp, n, lr, beta1, beta2, epsilon, weight_decay):
    """:func:`_adam_step` on arrays of one block; ``tmp`` a scratch array of their shape.
    With bias corrections c1 = 1 - beta1^n, c2 = 1 - beta2^n the update is
    lr / c1 * m / (sqrt(v / c2) + eps) = (lr sqrt(c2) / c1) * m / (sqrt(v) + eps sqrt(c2))."""
    t = param.dtype.type
    if weight_decay:
        param *= t(1.0 - lr * weight_decay)
    root_c2 = math.sqrt(1.0 - beta2 ** n)
    m -= grad                                   # m = beta1 m + (1 - beta1) g
    m *= t(beta1)
    m += grad
    xp.multiply(grad, grad, out=tmp)            # v = beta2 v + (1 - beta2) g^2
    v -= tmp
    v *= t(beta2)
    v += tmp
    xp.sqrt(v, out=tmp)
    tmp += t(epsilon * root_c2)
    xp.divide(m, tmp, out=tmp)
    tmp *= t(lr * root_c2 / (1.0 - beta1 ** n))
    param -= tmp


# -- float16 loss scaling -------------------------------------------------------------------------
@register_op("loss_scale_of", spmd=EinsumRule("->"), differentiable=False)
class LossScaleOf:
    """The loss scale ``initial * 2 ** exponent`` (float32): the scale is kept as its
    exponent, so that a fresh state of zeros starts at ``initial``."""

    def infer(exponent, initial):
        _scalar("loss scale exponent", exponent)
        return TensorType((), "float32")

    def kernel(ctx, exponent, initial):
        return ctx.xp.asarray(initial * 2.0 ** float(exponent), dtype="float32")


def _all_letters(shapes, attrs):
    return LETTERS[:len(shapes[0])] + "->"          # S(i) -> P: a count over the shards


@register_op("nonfinite_count", spmd=EinsumRule(_all_letters), differentiable=False,
             takes_16bit=True)
class NonfiniteCount:
    """How many entries of ``x`` are inf or NaN (float32, 0-d); a 16-bit ``x`` is read
    as it is (``takes_16bit``: no float32 copy of each gradient float16 training checks)."""

    flops = elementwise_flops(1)

    def infer(x):
        return TensorType((), "float32")

    def kernel(ctx, x):
        xp = ctx.xp
        return xp.asarray(x.size - xp.count_nonzero(xp.isfinite(x)), dtype="float32")

    def workspace(ins, outs):
        return size(ins[0])             # isfinite's bool array


@register_op("loss_scale_update", spmd=EinsumRule(",,->,,"), differentiable=False)
class LossScaleUpdate:
    """After a step: (exponent, good steps, apply). A step whose gradients hold ``count``
    > 0 non-finite entries is not applied, the scale halves and the good steps restart;
    after ``window`` good steps in a row the scale doubles."""

    def infer(exponent, good, count, window):
        for what, t in (("exponent", exponent), ("good steps", good), ("count", count)):
            _scalar(f"loss scale {what}", t)
        return exponent, good, TensorType((), "bool")

    def kernel(ctx, exponent, good, count, window):
        xp = ctx.xp
        if float(count) > 0:
            return exponent - 1, xp.zeros_like(good), xp.asarray(False)
        good = good + 1
        if float(good) >= window:
            return exponent + 1, xp.zeros_like(good), xp.asarray(True)
        return exponent + 0, good, xp.asarray(True)
