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
from distgraph.ops.common import dot_along, elementwise_flops
from distgraph.registry import ShapeError, TensorType, nbytes, register_op
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
        # in place on the result; the squares summed as an einsum
        xp = ctx.xp
        xf = x.astype(_compute_dtype(str(x.dtype)), copy=False)
        t = xf.dtype.type
        rstd = 1.0 / xp.sqrt(dot_along(xp, xf, xf)[..., 0] / t(x.shape[-1]) + t(epsilon))
        y = xp.multiply(xf, rstd[..., None], out=xp.empty(x.shape, xf.dtype))
        y = y.astype(x.dtype, copy=False)
        y *= w
        return y, rstd

    def workspace(ins, outs, epsilon=1e-6):
        return 2 * nbytes(outs[1])          # the row statistic's intermediates

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
        """In place on dx beside one array, xhat; the sums of products as einsums."""
        xp = ctx.xp
        ct, h = rstd.dtype, x.shape[-1]
        xhat = xp.multiply(x, rstd[..., None], out=xp.empty(x.shape, ct))
        dyf = dy.astype(ct, copy=False)
        # the forward rounds xhat to x's dtype before the weight
        rounded = xhat if x.dtype == ct else xhat.astype(x.dtype).astype(ct)
        dw = xp.einsum("ni,ni->i", dyf.reshape(-1, h), rounded.reshape(-1, h))
        del rounded
        wf = w.astype(ct, copy=False)
        mean = xp.einsum("ni,i,ni->n", dyf.reshape(-1, h), wf, xhat.reshape(-1, h))
        xhat *= (mean / ct.type(h)).reshape(x.shape[:-1] + (1,))
        dx = xp.multiply(dyf, wf, out=xp.empty(x.shape, ct))
        dx -= xhat
        dx *= rstd[..., None]
        return dx.astype(x.dtype, copy=False), dw.astype(w.dtype, copy=False)

    def workspace(ins, outs):
        x, rstd = ins[0], ins[2]
        return nbytes(TensorType(x.shape, rstd.dtype)) + 2 * nbytes(rstd)     # xhat


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
        # the halves' products into the result's halves, each beside one half-size array
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        out = xp.empty_like(x)
        lo, hi = out[..., :half], out[..., half:]
        tmp = xp.empty(x1.shape, x.dtype)
        xp.multiply(x1, cos, out=lo)
        lo -= xp.multiply(x2, sin, out=tmp)
        xp.multiply(x2, cos, out=hi)
        hi += xp.multiply(x1, sin, out=tmp)
        return out

    def workspace(ins, outs, seq_axis, theta, scaling=(), inverse=False, sequence_chunks=1):
        # a half of the result; the angles (float64) and their cos, sin
        x = ins[0]
        angles = x.shape[seq_axis % len(x.shape)] * (x.shape[-1] // 2)
        return nbytes(x) // 2 + angles * (2 * 8 + 2 * dtypes.itemsize(x.dtype))

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
