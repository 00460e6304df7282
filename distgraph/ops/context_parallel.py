"""Context parallelism: the distributed forms of ``attention`` and ``attention_grad``
when q, k and v are split along the sequence over mesh dim(s) ``m``
(:mod:`distgraph.ops.attention`); each process of the group holds one contiguous block
of the stored sequence (block order = storage order).

- **Ulysses** (DeepSpeed): all-to-alls turn the sequence-split q ``[b, h, s/n, d]``
  and k, v ``[b, g, s/n, d]`` into head-split ``[b, h/n, s, d]`` and
  ``[b, g·c/n, s, d]``; each process runs the serial kernel on its heads over the whole
  sequence, and one all-to-all brings ``y`` (with ``lse`` as one more column) back to
  the sequence split. Grouped-query key/value heads fewer than n (or not dividing it)
  are copied c = n / gcd(g, n) times first (:func:`copies`), so each process gets the
  heads its query heads read. The gradient sends ``[q | y | dy | lse]`` and ``[k | v]``
  there and ``dq`` and ``[dk | dv]`` back (a copied head's gradient: the sum of its
  copies'). Needs the local query heads to divide by n.
- **Ring** attention: k, v blocks (only the g key/value heads) passed around the ring
  with non-blocking sends, the kernels of :mod:`distgraph.ops.ring_attention` (online
  softmax; the load-balanced order of 2n chunks is the data's, ``sequence_chunks``).
  Runs whatever the heads.

Both take each token's place from :func:`~distgraph.ops.attention_blocks.positions`, so
the causal mask is right in any stored order. The kernel interface of the ring module::

    ring_attention.forward(ctx, q, k, v, scale, causal, window, positions) -> (y, lse)
    ring_attention.backward(ctx, q, k, v, y, lse, dy, scale, causal, window, positions)
        -> (dq, dk, dv)

``ctx.group`` the ring (process ids in block order; ``ctx.group_ranks()`` their ranks),
``positions(i)`` the global positions (int64) of member i's block; k, v may carry
fewer heads than q (grouped-query attention).

The choice (``context_parallel`` attribute, else :func:`choose`): what the op asks for;
unset, the one sending fewer bytes per process at this op (the cost model's all-to-all
and point-to-point formulas, as :func:`distgraph.plan.kinds.collective_bytes` has
them), Ulysses on a tie, among those that can run here; once processes have devices the
planner prices both on them and may choose again (:mod:`distgraph.passes.context`).

Example (what a plan's process runs; ``ctx`` carries the communicator and group)::

    y, lse = forward(ctx, q, k, v, 0.125, True, None, 4, "ulysses")
"""

from __future__ import annotations

import math

from distgraph import dtypes
from distgraph.errors import PlanError
from distgraph.ops import ring_attention
from distgraph.ops.attention_blocks import attend, attend_grad, positions, repeat_heads
from distgraph.registry import Overlap
from distgraph.spmd import DimsSpec, EinsumPlan, EinsumRule, entry_dims


IMPLEMENTATIONS = ("ring", "ulysses")


def split(site) -> bool:
    """Whether ``site`` splits the sequence (q's dim 2): the op runs context parallel."""
    attr = site.in_attrs[0]
    return bool(attr.spec.entry(2)) and len(site.split_group(0, 2)) > 1


def copies(kv_heads: int, n: int) -> int:
    """How many times Ulysses copies each key/value head so that the copies divide over
    the n processes (1 when the kv heads do): n / gcd(kv heads, n)."""
    return n // math.gcd(kv_heads, n)


def _sizes(site) -> tuple:
    """(group size n, local q bytes, local k bytes, local q heads, local kv heads, head
    dim)."""
    n = len(site.split_group(0, 2))
    b, h, s, d = site.in_attrs[0].local_shape(site.in_shapes[0])
    g = site.in_attrs[1].local_shape(site.in_shapes[1])[1]
    item = dtypes.itemsize(site.in_dtypes[0]) if site.in_dtypes else 4
    return n, b * h * s * d * item, b * g * s * d * item, h, g, d


def _comm_of(impl: str, site, grad: bool) -> tuple:
    n, qbytes, kbytes, _, g, d = _sizes(site)
    if impl == "ulysses":
        col = qbytes // d                            # lse: one column beside y
        kv = 2 * kbytes * copies(g, n)               # k and v, heads copied to divide
        if grad:
            return (("all_to_all", n, 3 * qbytes + col), ("all_to_all", n, kv),
                    ("all_to_all", n, qbytes), ("all_to_all", n, kv))
        return (("all_to_all", n, qbytes), ("all_to_all", n, kv),
                ("all_to_all", n, qbytes + col))
    return tuple(ring_attention.comm(n, qbytes, kbytes, grad))


def _sent(comm: tuple) -> float:
    """Bytes one process sends (the plan's formulas: an all-to-all sends (n-1)/n of its
    buffer, a point-to-point step its buffer)."""
    return sum(b if kind == "send_recv" else (n - 1) * b / n for kind, n, b in comm)


def choose(attrs: dict, site) -> str:
    """The form the op at ``site`` runs (module docstring); a PlanError when Ulysses is
    asked for and cannot run here."""
    asked = attrs.get("context_parallel")
    can = runnable(site)
    if asked is not None:
        if asked not in can:
            n, _, _, heads, _, _ = _sizes(site)
            raise PlanError(f"attention at process {site.process_id}: context_parallel="
                            f"{asked!r} cannot run: Ulysses needs the {heads} local query "
                            f"heads to divide over the {n} processes that split the "
                            f"sequence; use context_parallel='ring' (or None), or split "
                            f"the heads fewer ways")
        return asked
    return min(can, key=lambda f: _sent(_comm_of(f, site, False)))


class ContextRule(EinsumRule):
    """attention's einsum rule whose strategies leave out the sequence splits the form
    asked for cannot run (Ulysses where its heads do not divide): the search never
    picks a layout the op cannot run."""

    def bind(self, in_shapes, out_shapes, mesh, attrs: dict):
        base = super().bind(in_shapes, out_shapes, mesh, attrs)
        return ContextPlan(base.notation, base.in_shapes, base.out_shapes, mesh,
                           "".join(sorted(base.internal)), attrs.get("context_parallel"))


class ContextPlan(EinsumPlan):
    def __init__(self, notation, in_shapes, out_shapes, mesh, internal, asked):
        super().__init__(notation, in_shapes, out_shapes, mesh, internal)
        self.asked = asked

    def _runs(self, q: DimsSpec) -> bool:
        """Whether the form asked for can run where q is laid out as ``q`` (the ring
        always can; Ulysses where the local heads divide over the sequence's split)."""
        if self.asked != "ulysses":
            return True
        n = 1
        for m in entry_dims(q.dims[2]):
            n *= self.sizes[m]
        heads = self.in_shapes[0][1]
        for m in entry_dims(q.dims[1]):
            heads //= self.sizes[m]
        return heads % n == 0

    def strategies(self) -> list:
        return [s for s in super().strategies() if self._runs(DimsSpec.of(s.in_specs[0]))]


def localize(attrs, site):
    """The form (``context_parallel``), the number of sequence blocks and the mesh dims
    splitting them (``sequence_parts``, ``sequence_dims``: for the FLOPs and the ring's
    pipeline) and the group of a split sequence."""
    if not split(site):
        return attrs, {}
    group = site.split_group(0, 2)
    local = {**attrs, "context_parallel": choose(attrs, site), "sequence_parts": len(group),
             "sequence_dims": tuple(site.in_attrs[0].spec.entry(2))}
    return local, {"group": group}


def overlap(attrs: dict, ins) -> tuple:
    """The ring's pipeline for the cost model (the op's ``overlap`` hook): n slices, one
    per k, v block, each the attention of the local queries against one block (1/n of
    the op's pairs, as the balanced order makes them), with the block's hop before it
    and, in the gradient, its dk, dv hop after it; the hops run while the slices
    compute. Empty for Ulysses (its all-to-alls come before and after the compute:
    ``comm``), for a whole sequence, and for one split over several mesh dims (its hops
    priced unhidden). ``ins``: the local TensorTypes."""
    n = attrs.get("sequence_parts", 1)
    dims = tuple(attrs.get("sequence_dims", ()))
    if attrs.get("context_parallel") != "ring" or n == 1 or len(dims) != 1:
        return ()           # a split over several mesh dims is priced unhidden (comm)
    grad = len(ins) > 3
    q, k = ins[0], ins[1]
    kbytes = dtypes.itemsize(k.dtype) * math.prod(k.shape)
    hop = (("send_recv", dims[0], 2, 2 * kbytes),)
    block = tuple(sorted({**{a: v for a, v in attrs.items()
                             if a in ("scale", "causal", "sliding_window")},
                          "sequence_parts": n, "key_blocks": n}.items()))
    if grad:
        outs = tuple(ins[:3])
    else:
        outs = (q, type(q)(tuple(q.shape[:3]), q.dtype))
    return (Overlap(n, "attention_grad" if grad else "attention", tuple(ins), outs, hop,
                    hop if grad else (), block),)


def collectives(impl: str, site, grad: bool = False) -> tuple:
    """The collectives form ``impl`` runs at ``site`` (whether it can run or not):
    ``((kind, members, buffer bytes), ...)``."""
    return _comm_of(impl, site, grad)


def runnable(site) -> tuple:
    """The forms that can run at ``site`` (a split sequence), in order of preference on
    a tie: Ulysses (where its local query heads divide over the group), ring."""
    n, _, _, heads, _, _ = _sizes(site)
    return ("ulysses", "ring") if heads % n == 0 else ("ring",)


def comm(site, grad: bool = False) -> tuple:
    """The collectives of the distributed form at ``site``: ``((kind, members, buffer
    bytes), ...)``; empty when the sequence is whole."""
    if not split(site):
        return ()
    return collectives(choose(dict(site.attrs), site), site, grad)


def _positions_of(ctx, s_local: int, chunks: int):
    n = len(ctx.group)
    return lambda i: positions(ctx.xp, i * s_local, s_local, n * s_local, chunks)


def _heads(ctx, q, k, v):
    """Ulysses' first all-to-alls: q [b, h/n, s, d] and k, v [2, b, g·c/n, s, d] (the
    key/value heads copied c times where they do not divide over the group)."""
    xp, ranks = ctx.xp, ctx.group_ranks()
    c = copies(k.shape[1], len(ranks))
    kv = xp.stack([repeat_heads(xp, k, c), repeat_heads(xp, v, c)])
    return ctx.comm.all_to_all(q, ranks, 1, 2), ctx.comm.all_to_all(kv, ranks, 2, 3), c


def forward(ctx, q, k, v, scale, causal, window, chunks, impl):
    """attention's context-parallel form on this process's sequence block: (y, lse)."""
    xp = ctx.xp
    if impl == "ring":
        return ring_attention.forward(ctx, q, k, v, scale, causal, window,
                                      _positions_of(ctx, q.shape[2], chunks))
    d = q.shape[3]
    qh, kv, _ = _heads(ctx, q, k, v)
    s = qh.shape[2]
    pos = positions(xp, 0, s, s, chunks)
    y, lse = attend(xp, qh, kv[0], kv[1], scale, pos, pos, causal, window)
    back = ctx.comm.all_to_all(xp.concatenate([y, lse[..., None]], axis=-1),
                               ctx.group_ranks(), 2, 1)
    return back[..., :d], back[..., d]


def backward(ctx, q, k, v, y, lse, dy, scale, causal, window, chunks, impl):
    """attention_grad's context-parallel form: (dq, dk, dv) of this process's block; a
    copied key/value head's gradient is the sum of its copies'."""
    xp = ctx.xp
    if impl == "ring":
        return ring_attention.backward(ctx, q, k, v, y, lse, dy, scale, causal, window,
                                       _positions_of(ctx, q.shape[2], chunks))
    ranks = ctx.group_ranks()
    d = q.shape[3]
    there = xp.concatenate([q, y, dy, lse[..., None]], axis=-1)
    got = ctx.comm.all_to_all(there, ranks, 1, 2)                  # [b, h/n, s, 3d + 1]
    c = copies(k.shape[1], len(ranks))
    kv = xp.concatenate([repeat_heads(xp, k, c), repeat_heads(xp, v, c)], axis=-1)
    kv = ctx.comm.all_to_all(kv, ranks, 1, 2)                      # [b, g·c/n, s, 2d]
    s = got.shape[2]
    pos = positions(xp, 0, s, s, chunks)
    dq, dk, dv = attend_grad(xp, got[..., :d], kv[..., :d], kv[..., d:], got[..., d:2 * d],
                             got[..., 3 * d], got[..., 2 * d:3 * d], scale, pos, pos,
                             causal, window)
    dq = ctx.comm.all_to_all(dq, ranks, 2, 1)
    dkv = ctx.comm.all_to_all(xp.concatenate([dk, dv], axis=-1), ranks, 2, 1)
    if c > 1:
        b, gc, sl, _ = dkv.shape
        dkv = dkv.reshape(b, gc // c, c, sl, 2 * d).sum(axis=2)
    return dq, dkv[..., :d], dkv[..., d:]
