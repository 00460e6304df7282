"""Context parallelism: the distributed forms of ``attention`` and ``attention_grad``
when q, k and v are split along the sequence over mesh dim(s) ``m``
(:mod:`distgraph.ops.attention`); each process of the group holds one contiguous block
of the stored sequence (block order = storage order).

- **Ulysses** (DeepSpeed): one all-to-all turns the sequence-split q, k, v
  ``[b, h, s/n, d]`` into head-split ``[b, h/n, s, d]``; each process runs the serial
  kernel on its heads over the whole sequence, and one all-to-all brings ``y`` (with
  ``lse`` as one more column) back to the sequence split. The gradient sends
  ``[q | k | v | y | dy | lse]`` there and ``[dq | dk | dv]`` back. Needs the local
  heads to divide by n (grouped-query key/value heads are already repeated to the
  query heads, so they are copied whatever their count).
- **Ring** attention: k, v blocks passed around the ring with non-blocking sends, the
  kernels of :mod:`distgraph.ops.ring_attention` (online softmax; the load-balanced
  order of 2n chunks is the data's, ``sequence_chunks``).

Both take each token's place from :func:`~distgraph.ops.attention.positions`, so the
causal mask is right in any stored order. The kernel interface of the ring module::

    ring_attention.forward(ctx, q, k, v, scale, causal, window, positions) -> (y, lse)
    ring_attention.backward(ctx, q, k, v, y, lse, dy, scale, causal, window, positions)
        -> (dq, dk, dv)

``ctx.group`` the ring (process ids in block order; ``ctx.group_ranks()`` their ranks),
``positions(i)`` the global positions (int64) of member i's block.

The choice (``context_parallel`` attribute, else :func:`choose`): what the op asks for;
unset, the one sending fewer bytes per process at this op (the cost model's all-to-all
and point-to-point formulas, as :func:`distgraph.plan.kinds.collective_bytes` has them), Ulysses on
a tie, among those that can run here.

Example (what a plan's process runs; ``ctx`` carries the communicator and group)::

    y, lse = forward(ctx, q, k, v, 0.125, True, None, 4, "ulysses")
"""

from __future__ import annotations

from distgraph import dtypes
from distgraph.errors import PlanError
from distgraph.ops.attention_blocks import attend, attend_grad, positions
from distgraph.spmd import DimsSpec, EinsumPlan, EinsumRule, entry_dims

# The ring kernels land from their own branch (RING_MODULE); until they are merged
# and imported here, only Ulysses runs and asking for "ring" is a PlanError.
ring_attention = None

IMPLEMENTATIONS = ("ring", "ulysses")
RING_MODULE = "distgraph.ops.ring_attention"


def _ring():
    return ring_attention


def ring_available() -> bool:
    """Whether the ring kernels are there (:data:`RING_MODULE`)."""
    return ring_attention is not None


def split(site) -> bool:
    """Whether ``site`` splits the sequence (q's dim 2): the op runs context parallel."""
    attr = site.in_attrs[0]
    return bool(attr.spec.entry(2)) and len(site.split_group(0, 2)) > 1


def _sizes(site) -> tuple:
    """(group size n, local q bytes B, local heads, head dim)."""
    n = len(site.split_group(0, 2))
    b, h, s, d = site.in_attrs[0].local_shape(site.in_shapes[0])
    item = dtypes.itemsize(site.in_dtypes[0]) if site.in_dtypes else 4
    return n, b * h * s * d * item, h, d


def _comm_of(impl: str, n: int, nbytes: int, d: int, grad: bool) -> tuple:
    if impl == "ulysses":
        col = nbytes // d
        if grad:
            return (("all_to_all", n, 5 * nbytes + col), ("all_to_all", n, 3 * nbytes))
        return (("all_to_all", n, 3 * nbytes), ("all_to_all", n, nbytes + col))
    ring = _ring() if ring_available() else None
    if ring is not None and hasattr(ring, "comm"):
        return tuple(ring.comm(n, nbytes, grad))
    # k and v blocks travel n - 1 hops; in the gradient dk and dv travel with them and
    # come home (one hop more)
    hops = (("send_recv", 2, 2 * nbytes),) * (n - 1)
    return hops + ((("send_recv", 2, 2 * nbytes),) * n if grad else ())


def _sent(comm: tuple) -> float:
    """Bytes one process sends (the plan's formulas: an all-to-all sends (n-1)/n of its
    buffer, a point-to-point step its buffer)."""
    return sum(b if kind == "send_recv" else (n - 1) * b / n for kind, n, b in comm)


def choose(attrs: dict, site) -> str:
    """The implementation the op at ``site`` runs (module docstring); a PlanError when the
    one asked for cannot run here."""
    n, nbytes, heads, d = _sizes(site)
    can = {"ulysses": heads % n == 0, "ring": ring_available()}
    asked = attrs.get("context_parallel")
    why = {"ulysses": f"Ulysses needs the {heads} local heads to divide over the {n} "
                      f"processes that split the sequence",
           "ring": f"the ring kernels ({RING_MODULE}) are not in this build"}
    if asked is not None:
        if not can[asked]:
            raise PlanError(f"attention at process {site.process_id}: context_parallel="
                            f"{asked!r} cannot run: {why[asked]}; choose the other or "
                            f"change the sequence split")
        return asked
    options = [i for i in ("ulysses", "ring") if can[i]]
    if not options:
        raise PlanError(f"attention at process {site.process_id}: the sequence is split "
                        f"{n} ways but no context-parallel form can run: {why['ulysses']}, "
                        f"and {why['ring']}")
    return min(options, key=lambda i: _sent(_comm_of(i, n, nbytes, d, False)))


class ContextRule(EinsumRule):
    """attention's einsum rule whose strategies leave out the sequence splits no
    context-parallel form can run (Ulysses' heads do not divide, the ring is not asked
    for or not there): the search never picks a layout the op cannot run."""

    def bind(self, in_shapes, out_shapes, mesh, attrs: dict):
        base = super().bind(in_shapes, out_shapes, mesh, attrs)
        return ContextPlan(base.notation, base.in_shapes, base.out_shapes, mesh,
                           "".join(sorted(base.internal)), attrs.get("context_parallel"))


class ContextPlan(EinsumPlan):
    def __init__(self, notation, in_shapes, out_shapes, mesh, internal, asked):
        super().__init__(notation, in_shapes, out_shapes, mesh, internal)
        self.asked = asked

    def _runs(self, q: DimsSpec) -> bool:
        seq = entry_dims(q.dims[2])
        n = 1
        for m in seq:
            n *= self.sizes[m]
        if n == 1:
            return True
        heads = self.in_shapes[0][1]
        for m in entry_dims(q.dims[1]):
            heads //= self.sizes[m]
        can = {"ulysses": heads % n == 0, "ring": ring_available()}
        return can[self.asked] if self.asked else any(can.values())

    def strategies(self) -> list:
        return [s for s in super().strategies() if self._runs(DimsSpec.of(s.in_specs[0]))]


def localize(attrs, site):
    """The implementation (``context_parallel``), the number of sequence blocks
    (``sequence_parts``, for the FLOPs) and the group of a split sequence."""
    if not split(site):
        return attrs, {}
    group = site.split_group(0, 2)
    return {**attrs, "context_parallel": choose(attrs, site), "sequence_parts": len(group)}, \
        {"group": group}


def collectives(impl: str, site, grad: bool = False) -> tuple:
    """The collectives form ``impl`` runs at ``site`` (whether it can run or not):
    ``((kind, members, buffer bytes), ...)``."""
    n, nbytes, _, d = _sizes(site)
    return _comm_of(impl, n, nbytes, d, grad)


def runnable(site) -> tuple:
    """The forms that can run at ``site`` (a split sequence), in order of preference on
    a tie: Ulysses (its heads divide), ring (its kernels are in the build)."""
    n, _, heads, _ = _sizes(site)
    return tuple(f for f, ok in (("ulysses", heads % n == 0), ("ring", ring_available()))
                 if ok)


def comm(site, grad: bool = False) -> tuple:
    """The collectives of the distributed form at ``site``: ``((kind, members, buffer
    bytes), ...)``; empty when the sequence is whole."""
    if not split(site):
        return ()
    return collectives(choose(dict(site.attrs), site), site, grad)


def _positions_of(ctx, s_local: int, chunks: int):
    n = len(ctx.group)
    return lambda i: positions(ctx.xp, i * s_local, s_local, n * s_local, chunks)


def forward(ctx, q, k, v, scale, causal, window, chunks, impl):
    """attention's context-parallel form on this process's sequence block: (y, lse)."""
    xp = ctx.xp
    if impl == "ring":
        return _ring().forward(ctx, q, k, v, scale, causal, window,
                               _positions_of(ctx, q.shape[2], chunks))
    ranks = ctx.group_ranks()
    d = q.shape[3]
    heads = ctx.comm.all_to_all(xp.stack([q, k, v]), ranks, 2, 3)   # [3, b, h/n, s, d]
    s = heads.shape[3]
    pos = positions(xp, 0, s, s, chunks)
    y, lse = attend(xp, heads[0], heads[1], heads[2], scale, pos, pos, causal, window)
    back = ctx.comm.all_to_all(xp.concatenate([y, lse[..., None]], axis=-1), ranks, 2, 1)
    return back[..., :d], back[..., d]


def backward(ctx, q, k, v, y, lse, dy, scale, causal, window, chunks, impl):
    """attention_grad's context-parallel form: (dq, dk, dv) of this process's block."""
    xp = ctx.xp
    if impl == "ring":
        return _ring().backward(ctx, q, k, v, y, lse, dy, scale, causal, window,
                                _positions_of(ctx, q.shape[2], chunks))
    ranks = ctx.group_ranks()
    d = q.shape[3]
    there = xp.concatenate([q, k, v, y, dy, lse[..., None]], axis=-1)
    got = ctx.comm.all_to_all(there, ranks, 1, 2)                  # [b, h/n, s, 5d + 1]
    s = got.shape[2]
    pos = positions(xp, 0, s, s, chunks)
    parts = [got[..., i * d:(i + 1) * d] for i in range(5)]
    grads = attend_grad(xp, *parts[:4], got[..., 5 * d], parts[4], scale, pos, pos, causal,
                        window)
    back = ctx.comm.all_to_all(xp.concatenate(grads, axis=-1), ranks, 2, 1)
    return back[..., :d], back[..., d:2 * d], back[..., 2 * d:]
