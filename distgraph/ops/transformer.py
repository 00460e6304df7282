"""The ops of LLaMA-family transformers: RMSNorm and rotary position embedding (RoPE).

- ``rms_norm(x, weight, epsilon)``: ``x / sqrt(mean(x^2, -1) + eps) * weight`` over the
  last dim; outputs (y, rstd), rstd kept for the gradient. A 16-bit ``x`` is normalised in
  float32 and cast back before the weight (as transformers' LlamaRMSNorm does).
  ``abC,C -> abC, ab``: the normalised dim is never split.
- ``rotary(x, seq_axis, head_dim, theta, scaling)``: rotates each pair (i, i + d/2) of the
  last dim of ``x`` by ``position * inv_freq[i]`` (transformers' ``rotate_half`` form),
  where position is the element's global index along ``seq_axis``: a process holding a
  slice of the sequence rotates by its own positions (``localize`` gives the kernel the
  slice; ``sequence_chunks`` > 1: the sequence is stored in the load-balanced order of that many
  chunks, :func:`~distgraph.ops.attention_blocks.positions`). ``inverse`` rotates the
  other way: the gradient. Angles and their cos/sin are
  computed in float64 and cast to ``x``'s dtype. ``...D -> ...D``: the rotated dim is
  never split, every other dim may be.

:func:`rope_frequencies` is the inverse frequencies of a config's ``rope_theta`` and
``rope_scaling`` (none, ``linear``, ``llama3``).

Example::

    y, rstd = rms_norm(x, w, 1e-5)
    q = rotary(q, seq_axis=1, theta=500000.0)      # q [batch, seq, heads, head_dim]
"""

from __future__ import annotations

import math

import numpy as np

from distgraph import dtypes
from distgraph.ops.attention_blocks import positions
from distgraph.ops.common import elementwise_flops
from distgraph.registry import ShapeError, TensorType, register_op
from distgraph.spmd import LETTERS, EinsumRule
from distgraph.trace import active_builder, emit, emit1

SCALINGS = ("linear", "llama3")


def rope_frequencies(head_dim: int, theta: float, scaling=()) -> np.ndarray:
    """Inverse frequencies (float64, ``head_dim // 2`` of them) of RoPE with base
    ``theta`` and ``scaling``, a sorted tuple of (key, value) pairs of a
    ``rope_scaling`` config (``rope_type`` ``linear``: ``factor``; ``llama3``: ``factor``,
    ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``)."""
    inv = 1.0 / (float(theta) ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    conf = dict(scaling)
    kind = conf.get("rope_type")
    if kind is None:
        return inv
    if kind == "linear":
        return inv / float(conf["factor"])
    if kind != "llama3":
        raise ShapeError(f"rotary: rope_type {kind!r} is not implemented (known: {SCALINGS})")
    factor, low, high = (float(conf[k]) for k in ("factor", "low_freq_factor",
                                                  "high_freq_factor"))
    old = float(conf["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, smoothed, scaled)


# -- RMSNorm ----------------------------------------------------------------------------
def _norm_notation(in_shapes, attrs):
    batch = LETTERS[:len(in_shapes[0]) - 1]
    return f"{batch}C,C->{batch}C,{batch}"          # S(b) x R -> S(b), S(b)


def _norm_grad_notation(in_shapes, attrs):
    batch = LETTERS[:len(in_shapes[0]) - 1]
    return f"{batch}C,C,{batch},{batch}C->{batch}C,C"   # dw: Partial over split batch dims


def _compute_dtype(dtype: str) -> str:
    """The dtype a 16-bit value is normalised in (float32); others keep their own."""
    return "float32" if dtypes.itemsize(dtype) < 4 else dtype


@register_op("rms_norm", spmd=EinsumRule(_norm_notation))
class RMSNorm:
    flops = elementwise_flops(4)

    def infer(x, w, epsilon=1e-6):
        if not dtypes.is_float(x.dtype):
            raise ShapeError(f"rms_norm takes a float tensor, got {x.dtype}")
        if tuple(w.shape) != (x.shape[-1],):
            raise ShapeError(f"rms_norm: weight {list(w.shape)} must be [{x.shape[-1]}]")
        return x, TensorType(x.shape[:-1], _compute_dtype(x.dtype))

    def kernel(ctx, x, w, epsilon=1e-6):
        xp = ctx.xp
        xf = x.astype(_compute_dtype(str(x.dtype)), copy=False)
        rstd = 1.0 / xp.sqrt(xp.mean(xf * xf, axis=-1) + xf.dtype.type(epsilon))
        y = (xf * rstd[..., None]).astype(x.dtype, copy=False)
        return y * w, rstd

    def grad(op, dy, drstd=None):
        x, w = op.inputs
        return emit("rms_norm_grad", [x, w, op.outputs[1], dy])


@register_op("rms_norm_grad", spmd=EinsumRule(_norm_grad_notation), differentiable=False)
class RMSNormGrad:
    """dx = rstd (g - xhat mean(g xhat)), g = dy w; dw = sum over the batch of dy xhat."""

    flops = elementwise_flops(7)

    def infer(x, w, rstd, dy):
        return x, w

    def kernel(ctx, x, w, rstd, dy):
        xp = ctx.xp
        ct = rstd.dtype
        xhat = x.astype(ct, copy=False) * rstd[..., None]
        dyf = dy.astype(ct, copy=False)
        dw = xp.sum(dyf * xhat.astype(x.dtype).astype(ct, copy=False),
                    axis=tuple(range(x.ndim - 1)))
        g = dyf * w.astype(ct, copy=False)
        dx = rstd[..., None] * (g - xhat * xp.mean(g * xhat, axis=-1, keepdims=True))
        return dx.astype(x.dtype, copy=False), dw.astype(w.dtype, copy=False)


def rms_norm(x, weight, epsilon=1e-6):
    """RMSNorm over the last dim of ``x`` (see the module docstring)."""
    return emit("rms_norm", [x, weight], {"epsilon": float(epsilon)})[0]


# -- rotary position embedding -------------------------------------------------------------
def _rotary_notation(in_shapes, attrs):
    rank = len(in_shapes[0])
    word = LETTERS[:rank - 1] + LETTERS[rank - 1].upper()
    return f"{word}->{word}"                         # S(i) -> S(i), i not the rotated dim


@register_op("rotary", spmd=EinsumRule(_rotary_notation))
class Rotary:
    flops = elementwise_flops(3)

    def infer(x, seq_axis, theta, scaling=(), inverse=False, sequence_chunks=1):
        if not dtypes.is_float(x.dtype):
            raise ShapeError(f"rotary takes a float tensor, got {x.dtype}")
        if x.shape[-1] % 2:
            raise ShapeError(f"rotary: the rotated (last) dim {x.shape[-1]} must be even")
        if not -len(x.shape) < seq_axis < len(x.shape) - 1 and seq_axis != -len(x.shape):
            raise ShapeError(f"rotary: seq_axis {seq_axis} must name a dim before the last "
                             f"of {list(x.shape)}")
        return x

    def kernel(ctx, x, seq_axis, theta, scaling=(), inverse=False, sequence_chunks=1):
        xp = ctx.xp
        axis = seq_axis % x.ndim
        start = ctx.out_slices[axis].start if ctx.out_slices is not None else 0
        total = ctx.out_global_shape[axis] if ctx.out_global_shape is not None else \
            x.shape[axis]
        inv = xp.asarray(rope_frequencies(x.shape[-1], theta, scaling))
        place = positions(xp, start, x.shape[axis], total, sequence_chunks)
        angle = place.astype(inv.dtype)[:, None] * inv
        shape = [1] * x.ndim
        shape[axis], shape[-1] = x.shape[axis], inv.size
        cos = xp.cos(angle).reshape(shape).astype(x.dtype)
        sin = xp.sin(angle).reshape(shape).astype(x.dtype)
        if inverse:
            sin = -sin
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return xp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def localize(attrs, site):
        slices = site.out_slices(0)
        axis = attrs["seq_axis"] % len(slices)
        whole = slices[axis].stop - slices[axis].start == site.out_shapes[0][axis]
        if slices[axis].start == 0 and (whole or attrs.get("sequence_chunks", 1) == 1):
            return attrs, {}
        return attrs, {"out_global_shape": tuple(site.out_shapes[0]), "out_slices": slices}

    def grad(op, dz):
        attrs = dict(op.attrs)
        attrs["inverse"] = not attrs.get("inverse", False)
        return [emit1("rotary", [dz], attrs)]


def sequence_chunks() -> int:
    """The order the trace in progress stores its sequences in (``InputSpec``'s
    ``sequence_chunks``: 1 natural, c the balanced order of c chunks, whose positions
    :func:`~distgraph.ops.attention_blocks.positions` gives)."""
    return getattr(active_builder(), "sequence_chunks", 1)


def rotary(x, seq_axis, theta=10000.0, scaling=None):
    """RoPE on the last dim of ``x`` by the positions along ``seq_axis`` (module
    docstring); ``scaling`` is a ``rope_scaling`` dict or None."""
    items = tuple(sorted((scaling or {}).items()))
    attrs = {"seq_axis": int(seq_axis), "theta": float(theta), "scaling": items}
    if sequence_chunks() > 1:
        attrs["sequence_chunks"] = sequence_chunks()
    return emit1("rotary", [x], attrs)
