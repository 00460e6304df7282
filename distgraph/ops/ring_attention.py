"""Ring attention: the context-parallel kernels of causal attention when the sequence is
split over a group of n processes (the ring), each holding one block of queries, keys
and values; the k, v blocks travel the ring and every process attends its queries to
each block as it passes (Liu et al., "Ring Attention with Blockwise Transformers", 2023).

**Forward.** At step t = 0 .. n-1 member i holds the k, v block of member i - t. Before
it computes on that block it starts sending it to member i + 1 and receiving the next
one from member i - 1 (non-blocking), so the transfer runs while it computes; between
pieces of the computation it polls the requests (MPI moves a large message only while
its ranks call into it). Each block updates the queries' running max ``m``, sum ``l``
and unnormalised output ``o`` (online softmax: a new maximum rescales what was summed
so far by exp(m_old - m_new)); at the end y = o / l and lse = m + log l.

**Backward.** From the saved y and lse (probabilities recomputed, as flash attention
does): the k, v blocks travel the ring again, each process adds its queries'
contributions to dq (kept) and to the block's dk, dv, which travel one hop behind their
block: member i receives the block's partial dk, dv (from the members that held it
before) while it computes its own contribution, adds them and passes them on, and after
n steps every block's dk, dv arrive home complete (n - 1 hops of k, v and n of dk, dv).

**Causal load balance.** Each process's block may hold several runs of consecutive
positions (``positions(i)``: member i's global positions); in the balanced order the
sequence is cut into 2n chunks and member i holds chunks i and 2n-1-i, so every member
has the same share of the causal triangle. Per pair (query run, key run) the kernel
skips it when every key lies in the future (or, with a sliding ``window``, too far in
the past), computes it without a mask when every key is visible and with the causal
mask otherwise (the diagonal).

Grouped-query attention: k, v may carry g heads, fewer than q's h (g divides h; query
head j reads key/value head j // (h / g)); only g heads travel the ring.

``blocking=True`` runs the same algorithm with each exchange started after the block's
computation and waited for at once (send and receive together, so the ring cannot
deadlock): the reference that measures how much of the communication is hidden.

The interface (:mod:`distgraph.ops.context_parallel` calls it)::

    y, lse = forward(ctx, q, k, v, scale, causal, window, positions)
    dq, dk, dv = backward(ctx, q, k, v, y, lse, dy, scale, causal, window, positions)

q, y, dy ``[b, h, s, d]``, k, v ``[b, g, s, d]``, lse ``[b, h, s]`` (float, -inf for a
query that sees no key); ``ctx`` a :class:`~distgraph.registry.KernelContext` whose
``group_ranks()`` is the ring in block order; ``positions(i)`` int64 ``[s]`` (None: the
natural order, member i holding positions i·s .. i·s + s - 1). The messages use the
tags :data:`TAGS`, which the plan's tag scheme leaves to kernels; a GPU
plan's NCCL pairs for them are :func:`ring_pairs`.

Example (on each rank of a 4-rank job)::

    ctx = KernelContext(np, comm=MPICommunicator(), group=(0, 1, 2, 3))
    y, lse = forward(ctx, q, k, v, 0.125, True, None, balanced_positions(4, 256))
"""

from __future__ import annotations

import numpy as np

ROWS = 256          # queries per piece of computation (requests are polled between)
MAX_RUNS = 8        # more runs of consecutive positions in a block: one run of the whole
# The messages' tags: the top of the communicators' [0, 2**14), which the plan's tag
# scheme leaves to kernels (distgraph.plan.tags.KERNEL_TAGS; the core cannot import it)
RING_KV_TAG, RING_DKV_TAG = (1 << 14) - 1, (1 << 14) - 2
TAGS = (RING_KV_TAG, RING_DKV_TAG)


def comm(n: int, qbytes: int, kbytes: int, grad: bool = False) -> tuple:
    """The messages one member sends, ``((kind, members, bytes), ...)`` as
    :func:`distgraph.plan.kinds.collective_bytes` counts them: n - 1 hops of its k, v
    block (``kbytes`` each) forward; in the gradient n - 1 hops of k, v and n of dk, dv
    (none for a ring of one)."""
    hop = ("send_recv", 2, 2 * kbytes)
    if n == 1:
        return ()
    return (hop,) * (2 * n - 1 if grad else n - 1)


def ring_pairs(ranks) -> tuple:
    """The (sender, receiver) rank pairs of the ring ``ranks`` (in block order), for a
    GPU plan to open NCCL pairs before its first step."""
    n = len(ranks)
    return tuple((ranks[i], ranks[(i + 1) % n]) for i in range(n)) if n > 1 else ()


def balanced_positions(n: int, s: int):
    """``positions(i)`` of the load-balanced order: the sequence of ``2 n`` chunks of
    ``s / 2`` tokens, member i holding chunks i and 2n-1-i (``s`` even)."""
    if s % 2:
        raise ValueError(f"the balanced order of {n} members cuts each block of {s} tokens "
                         "into two chunks: give an even block")
    c = s // 2

    def positions(i):
        return np.concatenate([np.arange(i * c, (i + 1) * c),
                               np.arange((2 * n - 1 - i) * c, (2 * n - i) * c)])
    return positions


# ---- the ring's messages -----------------------------------------------------------------

class _Ring:
    """This process's place in the ring and its requests in flight."""

    def __init__(self, ctx, blocking: bool):
        self.comm = ctx.comm
        self.ranks = tuple(ctx.group_ranks())
        self.n = len(self.ranks)
        self.me = self.ranks.index(self.comm.rank)
        self.next = self.ranks[(self.me + 1) % self.n]
        self.prev = self.ranks[(self.me - 1) % self.n]
        self.blocking = blocking
        self.sends: list = []
        self.receives: list = []

    def member(self, t: int) -> int:
        """The member whose k, v block this process holds at step t."""
        return (self.me - t) % self.n

    def send(self, arr, tag: int) -> None:
        """Start sending ``arr`` (left unchanged until :meth:`done`) to the next member."""
        self.sends.append(self.comm.isend(arr, self.next, tag))

    def receive(self, like, tag: int):
        """Start receiving an array shaped as ``like`` from the previous member."""
        req = self.comm.irecv(like.shape, like.dtype, self.prev, tag)
        self.receives.append(req)
        return req

    def exchange(self, arr, tag: int):
        """Send ``arr`` on and receive the previous member's array in its place."""
        self.send(arr, tag)
        return self.receive(arr, tag)

    def poll(self) -> None:
        """Let the transfers in flight move (MPI progresses while its ranks call it)."""
        for req in self.sends + self.receives:
            req.test()

    def take(self, req):
        """The array of a started receive, waiting for it. ``blocking``: and for the
        sends started so far (the reference ring waits for each exchange). Otherwise
        sends are waited for at :meth:`done`: a member waiting for its own send to be
        received would wait for its neighbour, which waits for its own, round the ring."""
        value = self.comm.wait([req] + (self.sends if self.blocking else []))[0]
        self.receives.remove(req)
        if self.blocking:
            self.sends = []
        return value

    def done(self) -> None:
        self.comm.wait(self.sends)
        self.sends = []


# ---- which blocks meet -------------------------------------------------------------------

def _host(a) -> np.ndarray:
    return np.asarray(a.get() if hasattr(a, "get") else a, dtype=np.int64)


def _runs(pos: np.ndarray) -> list:
    """[(storage slice, first position, last position)] of the block's runs of
    consecutive positions (one run of the whole block, bounded by its extremes, when
    there are more than MAX_RUNS)."""
    if pos.size == 0:
        return []
    cuts = [0, *(np.nonzero(np.diff(pos) != 1)[0] + 1).tolist(), pos.size]
    if len(cuts) - 1 > MAX_RUNS:
        cuts = [0, pos.size]
    return [(slice(a, b), int(pos[a:b].min()), int(pos[a:b].max()))
            for a, b in zip(cuts, cuts[1:])]


def _meetings(xp, pq, pk, causal: bool, window) -> list:
    """[(query slice, key slice, mask or None)]: the pairs of runs with a visible key
    (a mask where some of their keys are hidden)."""
    out = []
    hq, hk = _host(pq), _host(pk)
    for qs, q0, q1 in _runs(hq):
        for ks, k0, k1 in _runs(hk):
            if causal and (k0 > q1 or (window is not None and q0 - k1 >= window)):
                continue                                    # every key hidden
            if not causal or (k1 <= q0 and (window is None or q1 - k0 < window)):
                out.append((qs, ks, None))                  # every key visible
                continue
            gap = pq[qs][:, None] - pk[ks][None, :]
            mask = gap >= 0
            if window is not None:
                mask &= gap < window
            out.append((qs, ks, mask))
    return out


def _pieces(meetings, rows: int):
    """The meetings cut into pieces of at most ``rows`` queries."""
    for qs, ks, mask in meetings:
        for r in range(qs.start, qs.stop, rows):
            part = slice(r, min(r + rows, qs.stop))
            yield part, ks, None if mask is None else mask[r - qs.start:part.stop - qs.start]


class _Layout:
    """Shapes of one call: q heads as [b, g, h / g, s, d] so each query head group meets
    its key/value head (grouped-query attention)."""

    def __init__(self, xp, q, k, positions, n, me):
        b, h, s, d = q.shape
        g = k.shape[1]
        if h % g or k.shape[2] != s:
            raise ValueError(f"ring attention: q {tuple(q.shape)} against k "
                             f"{tuple(k.shape)}: the key/value heads must divide the query "
                             "heads and the blocks hold the same number of tokens")
        self.xp, self.shape, self.grouped = xp, q.shape, (b, g, h // g, s, d)
        self.n, self.me, self.s = n, me, s
        self.positions = positions

    def pos(self, i: int):
        if self.positions is None:
            return self.xp.arange(i * self.s, (i + 1) * self.s, dtype="int64")
        return self.xp.asarray(self.positions(i), dtype="int64")

    def group(self, a):
        return a.reshape(self.grouped[:3] + a.shape[-2:])

    def rows(self, a):
        """[b, g, h/g, s] as [b, g, h/g, s, 1]."""
        return a.reshape(self.grouped[:4] + (1,))


# ---- the kernels ---------------------------------------------------------------------------

def forward(ctx, q, k, v, scale, causal: bool = True, window=None, positions=None,
            blocking: bool = False, rows: int = ROWS):
    """(y [b, h, s, d], lse [b, h, s]) of this member's queries against the whole
    sequence's keys (module docstring)."""
    xp = ctx.xp
    ring = _Ring(ctx, blocking)
    lay = _Layout(xp, q, k, positions, ring.n, ring.me)
    qg = lay.group(q * q.dtype.type(scale))
    m = xp.full(lay.grouped[:4] + (1,), -xp.inf, dtype=q.dtype)
    l_ = xp.zeros_like(m)
    o = xp.zeros(lay.grouped, dtype=q.dtype)
    pq = lay.pos(ring.me)
    kv = xp.stack([k, v])[:, :, :, None]                  # [2, b, g, 1, s, d]
    for t in range(ring.n):
        last = t == ring.n - 1
        coming = ring.exchange(kv, RING_KV_TAG) if not (last or blocking) else None
        for qs, ks, mask in _pieces(_meetings(xp, pq, lay.pos(ring.member(t)), causal,
                                              window), rows):
            _forward_piece(xp, qg[..., qs, :], kv[0][..., ks, :], kv[1][..., ks, :], mask,
                           m[..., qs, :], l_[..., qs, :], o[..., qs, :])
            ring.poll()
        if not last:
            kv = ring.take(coming if coming is not None else ring.exchange(kv, RING_KV_TAG))
    ring.done()
    seen = l_ > 0
    y = o / xp.where(seen, l_, 1)
    lse = xp.where(seen, m + xp.log(xp.where(seen, l_, 1)), -xp.inf)
    return y.reshape(lay.shape), lse.reshape(lay.shape[:3])


def _forward_piece(xp, q, k, v, mask, m, l_, o):
    """Online softmax: fold the scores of queries ``q`` (scaled) against ``k`` into the
    running max ``m``, sum ``l_`` and output ``o`` (views, updated in place)."""
    sc = q @ k.swapaxes(-1, -2)
    if mask is not None:
        sc = xp.where(mask, sc, -xp.inf)
    new = xp.maximum(m, sc.max(axis=-1, keepdims=True))
    safe = xp.where(xp.isfinite(new), new, 0)            # rows that saw no key yet
    sc -= safe
    p = xp.exp(sc, out=sc)
    alpha = xp.exp(m - safe)
    l_ *= alpha
    l_ += p.sum(axis=-1, keepdims=True)
    o *= alpha
    o += p @ v
    m[...] = new


def backward(ctx, q, k, v, y, lse, dy, scale, causal: bool = True, window=None,
             positions=None, blocking: bool = False, rows: int = ROWS):
    """(dq, dk, dv) of :func:`forward` for the upstream gradient ``dy``, from its saved
    ``y`` and ``lse`` (module docstring)."""
    xp = ctx.xp
    ring = _Ring(ctx, blocking)
    lay = _Layout(xp, q, k, positions, ring.n, ring.me)
    sc = q.dtype.type(scale)
    qg, dyg = lay.group(q * sc), lay.group(dy)
    delta = lay.rows(xp.sum(dy * y, axis=-1))
    # a query that saw no key has lse -inf; its scores are all masked, so p = 0 anyway
    lse_g = lay.rows(xp.where(xp.isfinite(lse), lse, 0))
    dq = xp.zeros(lay.grouped, dtype=q.dtype)
    pq = lay.pos(ring.me)
    kv = xp.stack([k, v])[:, :, :, None]                  # [2, b, g, 1, s, d]
    partial = carried = None          # the block's dk, dv from its earlier holders
    for t in range(ring.n):
        last = t == ring.n - 1
        if not blocking:
            coming = ring.exchange(kv, RING_KV_TAG) if not last else None
            partial = ring.receive(kv, RING_DKV_TAG) if t > 0 else None
        dkv = xp.zeros_like(kv)
        for qs, ks, mask in _pieces(_meetings(xp, pq, lay.pos(ring.member(t)), causal,
                                              window), rows):
            _backward_piece(xp, qg[..., qs, :], kv[0][..., ks, :], kv[1][..., ks, :],
                            dyg[..., qs, :], lse_g[..., qs, :], delta[..., qs, :], mask,
                            dq[..., qs, :], dkv[0][..., ks, :], dkv[1][..., ks, :])
            ring.poll()
        if ring.n == 1:
            break
        if partial is not None:
            dkv += ring.take(partial)
        if carried is not None:
            dkv += carried
        ring.send(dkv, RING_DKV_TAG)
        if blocking:
            # sent and received together (so the ring cannot deadlock): this block's
            # dk, dv on, the next block's partial sums (after the last step, this
            # member's own) and the next k, v in
            partial_in = ring.receive(kv, RING_DKV_TAG)
            coming = ring.exchange(kv, RING_KV_TAG) if not last else None
            carried = ring.take(partial_in)
        if not last:
            kv = ring.take(coming)
    if ring.n > 1:
        dkv = carried if blocking else ring.take(ring.receive(kv, RING_DKV_TAG))
        ring.done()
    dq *= sc
    return dq.reshape(lay.shape), dkv[0, :, :, 0], dkv[1, :, :, 0]


def _backward_piece(xp, q, k, v, dy, lse, delta, mask, dq, dk, dv):
    """Add one piece's gradients: to dq (its queries) and dk, dv (its keys; summed over
    the query heads of each key/value head). ``q`` is scaled, so dk = ds^T q already
    carries the scale; dq's is applied once at the end."""
    sc = q @ k.swapaxes(-1, -2)
    if mask is not None:
        sc = xp.where(mask, sc, -xp.inf)
    sc -= lse
    p = xp.exp(sc, out=sc)
    dv += (p.swapaxes(-1, -2) @ dy).sum(axis=2, keepdims=True)
    dp = dy @ v.swapaxes(-1, -2)
    dp -= delta
    dp *= p                                                # ds (without the scale)
    dq += dp @ k
    dk += (dp.swapaxes(-1, -2) @ q).sum(axis=2, keepdims=True)
