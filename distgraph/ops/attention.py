"""Fused causal attention: ``attention(q, k, v, scale, causal, sliding_window)`` on
``[batch, heads, seq, head_dim]``, with its exact gradient, its FLOPs and its
distributed forms over a split sequence (context parallelism).

- The op has two results, ``y = softmax(scale q k^T + mask) v`` and the log-sum-exp
  of each query's scores (``lse``, ``[b, h, s]``); :func:`attention` returns ``y``. The probabilities
  ``[b, h, s, s]`` are not kept: ``attention_grad`` recomputes them from ``lse``
  (flash attention's backward), so the op's saved activations grow with the sequence,
  not its square. ``lse`` has no gradient (nothing but the backward reads it).
- The mask: key j is seen by query i where ``pos(j) <= pos(i)`` (``causal``) and
  ``pos(i) - pos(j) < sliding_window`` (Mistral's, with ``causal``). ``pos`` is the
  token's place in the sequence: its storage index, or, with ``sequence_chunks`` c > 1,
  its place when the sequence is stored in the load-balanced order of c chunks
  (:func:`~distgraph.ops.attention_blocks.positions`: chunk r then chunk c-1-r for
  r < c/2), as ``shard_dataloader(..., sequence_dim=...)`` stores it for context
  parallelism (a loss over tokens does not see the order).
- Grouped-query attention: k, v may carry fewer heads than q (query head j reads
  key/value head j / (heads / kv_heads)); one letter ``h`` names both head dims, so a
  split of the heads divides both alike (a model whose key/value heads do not divide a
  split repeats them first, as Llama's does under such a tensor parallelism).

Sharding, ``bhsD,bhsD,bhsD -> bhsD,bhs``: batch and heads split as any einsum letter
(tensor parallelism over heads); the head dim never. A split ``s`` splits q, k and v
alike over mesh dim(s) ``m``: context parallelism, whose collectives run inside the op
(:mod:`distgraph.ops.context_parallel`): Ulysses (all-to-all from sequence-split to
head-split and back) or ring attention (k, v blocks passed around the ring), chosen by
the ``context_parallel`` attribute (``Strategy(context_parallel=...)``) or, unset, by
their cost at each op. ``comm(site)`` declares those collectives to the plan.

FLOPs count the (query, key) pairs the mask lets through, as a flash kernel skips the
masked blocks: ``4 d`` per pair (two products) and 5 for the softmax; the gradient
``10 d`` per pair (recomputed scores and four products) and 8.

Example::

    y = attention(q, k, v, scale=1 / math.sqrt(hd), causal=True)   # k, v: kv heads
"""

from __future__ import annotations

from distgraph import dtypes
from distgraph.ops import context_parallel as cp
from distgraph.ops.attention_blocks import attend, attend_bytes, attend_grad, positions
from distgraph.registry import ShapeError, TensorType, register_op
from distgraph.ops.transformer import sequence_chunks
from distgraph.trace import active_builder, emit

IMPLEMENTATIONS = cp.IMPLEMENTATIONS


def _pairs(s: int, causal: bool, window) -> int:
    """The (query, key) pairs of a sequence of ``s`` the mask lets through."""
    if not causal:
        return s * s
    if window is None or window >= s:
        return s * (s + 1) // 2
    return window * (window + 1) // 2 + (s - window) * window


def _flops(per_pair_d: int, per_pair: int):
    def flops(ins, outs, scale=1.0, causal=True, sliding_window=None, sequence_chunks=1,
              context_parallel=None, sequence_parts=1, sequence_dims=(), key_blocks=1):
        # a process of a sequence split n ways (sequence_parts, set by localize) computes
        # its queries against every key: 1/n of the whole sequence's pairs (the balanced
        # order makes that exact for causal masks; natural order, on average); one of
        # the ring's steps against one of its key_blocks blocks, that over key_blocks
        b, h, s, d = ins[0].shape
        pairs = _pairs(s * sequence_parts, causal, sliding_window) / sequence_parts
        return b * h * pairs * (per_pair_d * d + per_pair) / key_blocks
    return flops


def _check(q, k, v, causal, sliding_window, sequence_chunks):
    if len(q.shape) != 4 or len(k.shape) != 4 or tuple(v.shape) != tuple(k.shape) or \
            tuple(k.shape[::2]) != tuple(q.shape[::2]) or k.shape[1] > q.shape[1] or \
            q.shape[1] % k.shape[1]:
        raise ShapeError(f"attention: q [batch, heads, seq, head_dim] and k, v [batch, "
                         f"kv_heads, seq, head_dim] with kv_heads dividing heads expected, "
                         f"got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    if not dtypes.is_float(q.dtype) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ShapeError(f"attention: q, k, v of one float dtype, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    if sliding_window is not None and (not causal or sliding_window < 1):
        raise ShapeError(f"attention: sliding_window {sliding_window} needs causal=True and "
                         f"must be at least 1")
    c = sequence_chunks
    if c < 1 or (c > 1 and (c % 2 or q.shape[2] % c)):
        raise ShapeError(f"attention: sequence_chunks {c} must be 1 or an even divisor of "
                         f"the sequence {q.shape[2]}")


def _workspace(ins, attrs, grad: bool) -> int:
    """The serial kernel's workspace (:func:`attend_bytes`): its largest block's scores
    and products. The context-parallel forms (``sequence_parts`` > 1) are not counted."""
    if attrs.get("sequence_parts", 1) > 1:
        return 0
    q, k = ins[0], ins[1]
    return attend_bytes(q.shape, k.shape, dtypes.itemsize(q.dtype), attrs.get("causal", True),
                        attrs.get("sliding_window"), attrs.get("sequence_chunks", 1), grad)


@register_op("attention", spmd=cp.ContextRule("bhsD,bhsD,bhsD->bhsD,bhs"))
class Attention:
    """S(b|h|s) x S(b|h|s) x S(b|h|s) -> S(b|h|s), S(b|h|s); a split s runs context
    parallel (collectives inside the op)."""

    flops = _flops(4, 5)

    def infer(q, k, v, scale=1.0, causal=True, sliding_window=None, sequence_chunks=1,
              context_parallel=None, sequence_parts=1,
              sequence_dims=(), key_blocks=1):
        _check(q, k, v, causal, sliding_window, sequence_chunks)
        if context_parallel not in (None,) + IMPLEMENTATIONS:
            raise ShapeError(f"attention: context_parallel {context_parallel!r} is not one of "
                             f"{IMPLEMENTATIONS} (or None: the cost model chooses)")
        return q, TensorType(tuple(q.shape[:3]), q.dtype)

    def kernel(ctx, q, k, v, scale=1.0, causal=True, sliding_window=None, sequence_chunks=1,
               context_parallel=None, sequence_parts=1, sequence_dims=(),
               key_blocks=1):
        if ctx.group is not None:
            return cp.forward(ctx, q, k, v, scale, causal, sliding_window, sequence_chunks,
                              context_parallel)
        xp = ctx.xp
        pos = positions(xp, 0, q.shape[2], q.shape[2], sequence_chunks)
        return attend(xp, q, k, v, scale, pos, pos, causal, sliding_window)

    localize = cp.localize
    comm = cp.comm
    overlap = cp.overlap

    def workspace(ins, outs, **attrs):
        return _workspace(ins, attrs, grad=False)

    def grad(op, dy, dlse=None):
        return emit("attention_grad", [*op.inputs, *op.outputs, dy], dict(op.attrs))


@register_op("attention_grad", differentiable=False,
             spmd=cp.ContextRule("bhsD,bhsD,bhsD,bhsD,bhs,bhsD->bhsD,bhsD,bhsD"))
class AttentionGrad:
    """(dq, dk, dv) from the recomputed probabilities. S(b|h|s) x ... -> S(b|h|s) x 3."""

    flops = _flops(10, 8)

    def infer(q, k, v, y, lse, dy, scale=1.0, causal=True, sliding_window=None,
              sequence_chunks=1, context_parallel=None, sequence_parts=1,
              sequence_dims=(), key_blocks=1):
        return q, k, v

    def kernel(ctx, q, k, v, y, lse, dy, scale=1.0, causal=True, sliding_window=None,
               sequence_chunks=1, context_parallel=None, sequence_parts=1,
               sequence_dims=(), key_blocks=1):
        if ctx.group is not None:
            return cp.backward(ctx, q, k, v, y, lse, dy, scale, causal, sliding_window,
                               sequence_chunks, context_parallel)
        xp = ctx.xp
        pos = positions(xp, 0, q.shape[2], q.shape[2], sequence_chunks)
        return attend_grad(xp, q, k, v, y, lse, dy, scale, pos, pos, causal, sliding_window)

    localize = cp.localize
    overlap = cp.overlap

    def workspace(ins, outs, **attrs):
        return _workspace(ins, attrs, grad=True)

    def comm(site):
        return cp.comm(site, grad=True)


def attention(q, k, v, scale: float, causal: bool = True, sliding_window=None,
              context_parallel=None):
    """Fused attention of q, k, v [b, heads, seq, head_dim] (module docstring): y.
    ``context_parallel`` ("ring", "ulysses", None: the trace's strategy, else the cost
    model) is how a sequence split over a mesh dim runs."""
    builder = active_builder()
    impl = context_parallel or getattr(builder, "context_parallel", None)
    attrs = {"scale": float(scale), "causal": bool(causal)}
    if sequence_chunks() > 1:
        attrs["sequence_chunks"] = sequence_chunks()
    if sliding_window is not None:
        attrs["sliding_window"] = int(sliding_window)
    if impl is not None:
        attrs["context_parallel"] = impl
    return emit("attention", [q, k, v], attrs)[0]
