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

from distgraph.ops.common import elementwise_flops
from distgraph.registry import ShapeError, TensorType, register_op
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
        if momentum == 0:
            # two parameter-sized passes instead of four
            param -= t(lr) * grad
            return param, velocity
        velocity *= t(momentum)
        velocity += grad
        param -= t(lr) * velocity
        return param, velocity


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
        return _adam_step(ctx.xp, param, grad, m, v, float(step), float(lr), beta1, beta2,
                          epsilon, weight_decay)


@register_op("mixed_adam_update", spmd=EinsumRule(_update_notation(5, 4)),
             inplace=((0, 0), (1, 2), (2, 3), (3, 4)), differentiable=False)
class MixedAdamUpdate:
    """Adam / AdamW of a 16-bit parameter as mixed-precision training runs it (ZeRO's
    2 + 2 + 12 bytes per parameter): the step is taken on the float32 ``master`` copy
    with float32 moments, and the 16-bit parameter is the master rounded."""

    flops = elementwise_flops(13)

    def infer(param, grad, master, m, v, step, lr, beta1, beta2, epsilon, weight_decay):
        _same_shapes(param, grad, master, m, v)
        _scalar("adam step counter", step)
        _scalar("adam learning rate", lr)
        return param, master, m, v

    def kernel(ctx, param, grad, master, m, v, step, lr, beta1, beta2, epsilon,
               weight_decay):
        _adam_step(ctx.xp, master, grad.astype(master.dtype), m, v, float(step), float(lr),
                   beta1, beta2, epsilon, weight_decay)
        param[...] = master
        return param, master, m, v


CHUNK = 1 << 16     # elements per block of a host Adam step (5 such arrays fit in L2)


def _adam_step(xp, param, grad, m, v, n, lr, beta1, beta2, epsilon, weight_decay):
    """One Adam step on ``param`` and its moments, in place (see AdamUpdate). On the host
    (C-contiguous numpy arrays) it runs block by block, so that its dozen passes read
    each array from memory once and the rest from cache."""
    arrays = (param, grad, m, v)
    if param.size <= CHUNK or not all(getattr(a, "flags", None) is not None
                                      and a.flags.c_contiguous for a in arrays):
        _adam_block(xp, *arrays, n, lr, beta1, beta2, epsilon, weight_decay)
        return param, m, v
    flat = [a.reshape(-1) for a in arrays]
    tmp = xp.empty(CHUNK, param.dtype)
    for start in range(0, param.size, CHUNK):
        block = [a[start:start + CHUNK] for a in flat]
        _adam_block(xp, *block, n, lr, beta1, beta2, epsilon, weight_decay,
                    tmp[:len(block[0])])
    return param, m, v


def _adam_block(xp, param, grad, m, v, n, lr, beta1, beta2, epsilon, weight_decay,
                tmp=None):
    """:func:`_adam_step` on arrays of one block; ``tmp`` a scratch array of their shape.
    With bias corrections c1 = 1 - beta1^n, c2 = 1 - beta2^n the update is
    lr / c1 * m / (sqrt(v / c2) + eps) = (lr sqrt(c2) / c1) * m / (sqrt(v) + eps sqrt(c2))."""
    t = param.dtype.type
    if weight_decay:
        param *= t(1.0 - lr * weight_decay)
    root_c2 = math.sqrt(1.0 - beta2 ** n)
    tmp = xp.empty_like(param) if tmp is None else tmp
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


@register_op("nonfinite_count", spmd=EinsumRule(_all_letters), differentiable=False)
class NonfiniteCount:
    """How many entries of ``x`` are inf or NaN (float32, 0-d)."""

    flops = elementwise_flops(1)

    def infer(x):
        return TensorType((), "float32")

    def kernel(ctx, x):
        xp = ctx.xp
        return xp.asarray(x.size - xp.count_nonzero(xp.isfinite(x)), dtype="float32")


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
