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

**Progress.** MPICH (ch4) copies an intranode message of 8 KB or more once, by the
receiver (CMA), and only inside an MPI call of its ranks: a 4 MB Isend/Irecv pair left
alone through 165 ms of compute was complete after it in 0 of 20 tries, and in 20 of 20
when the compute tested the requests every 2 ms. Hence the polls between pieces of at
most ``rows`` queries (without them the ring waits for blocks at the start of its
steps). MPICH's progress thread (``MPIR_CVAR_ASYNC_PROGRESS=1``, which needs
MPI_THREAD_MULTIPLE, what mpi4py asks for) moves messages without polls but spins a
core of its own: on 2 ranks over 2 cores it doubled the compute's time, so the ring does
not rely on it. The copy stays CPU work of the receiving rank either way.

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

from collections import deque

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
    """This process's place in the ring and its messages: the k, v blocks (block t is
    the one computed on at step t, member ``me - t``'s) and, in the backward, the blocks'
    dk, dv partial sums.

    Overlapped, receives are posted ``depth`` blocks ahead and a block is sent on as soon
    as it has arrived (found by :meth:`poll`, between pieces of computation), so the
    blocks travel the ring at the links' pace, whatever a member's compute; a block's
    dk, dv go on once this member's share is added and the earlier holders' sum has
    arrived. ``blocking``: each exchange starts when the block is needed and is waited
    for at once (sends and receives together, so that the ring cannot deadlock)."""

    def __init__(self, ctx, blocking: bool, depth: int = 2):
        self.comm = ctx.comm
        self.ranks = tuple(ctx.group_ranks())
        self.n = len(self.ranks)
        self.me = self.ranks.index(self.comm.rank)
        self.next = self.ranks[(self.me + 1) % self.n]
        self.prev = self.ranks[(self.me - 1) % self.n]
        self.blocking, self.depth = blocking, max(1, depth)
        self.sends: list = []
        self.blocks: dict = {}          # step -> k, v block (arrived, or this member's)
        self.coming: dict = {}          # step -> receive of its block
        self.forwarded = 0              # blocks 0 .. forwarded - 1 have been sent on
        self.partials: dict = {}        # step -> receive of its block's dk, dv so far
        self.queue: deque = deque()     # (step, this member's share) waiting to go on

    def member(self, t: int) -> int:
        """The member whose k, v block this process computes on at step t."""
        return (self.me - t) % self.n

    def _send(self, arr, tag: int) -> None:
        self.sends.append(self.comm.isend(arr, self.next, tag))

    def _receive(self, like, tag: int):
        return self.comm.irecv(like.shape, like.dtype, self.prev, tag)

    def _sendrecv(self, arr, tag: int):
        """Blocking exchange: ``arr`` to the next member, the previous one's back."""
        self._send(arr, tag)
        got = self.comm.wait([self._receive(arr, tag)] + self.sends)[0]
        self.sends = []
        return got

    # ---- k, v blocks ----
    def start(self, kv) -> None:
        """Step 0: this member's block, sent on at once (overlapped)."""
        self.blocks[0], self.like = kv, kv
        if not self.blocking:
            self._ahead(0)
            self._forward()

    def _ahead(self, t: int) -> None:
        for j in range(t + 1, min(t + self.depth, self.n - 1) + 1):
            if j not in self.blocks and j not in self.coming:
                self.coming[j] = self._receive(self.like, RING_KV_TAG)

    def _forward(self) -> None:
        """Send on, in order, every block that has arrived (all but the last step's)."""
        while self.forwarded < self.n - 1:
            f = self.forwarded
            req = self.coming.get(f)
            if req is not None and req.test():
                self.blocks[f] = self.coming.pop(f).value
            if f not in self.blocks:
                return
            self._send(self.blocks[f], RING_KV_TAG)
            self.forwarded += 1

    def block(self, t: int):
        """The k, v block of step t, waiting for it if it has not arrived."""
        if t not in self.blocks:
            if self.blocking:
                self.blocks[t] = self._sendrecv(self.blocks[t - 1], RING_KV_TAG)
            else:
                self.blocks[t] = self.comm.wait([self.coming.pop(t)])[0]
        done = t if self.blocking else min(t, self.forwarded)
        for j in [j for j in self.blocks if j < done]:
            del self.blocks[j]                 # computed on and sent on
        if not self.blocking:
            self._ahead(t)
            self._forward()
        return self.blocks[t]

    # ---- dk, dv of the blocks (backward) ----
    def expect(self, t: int, like) -> None:
        """Start receiving block t's dk, dv summed by its earlier holders (t = n: this
        member's own, complete)."""
        if not self.blocking and 0 < t and self.n > 1:
            self.partials[t] = self._receive(like, RING_DKV_TAG)

    def pass_on(self, t: int, share):
        """Add this member's ``share`` of block t's dk, dv to its earlier holders' and
        send it on. Blocking: at once (receiving the next block's sum, returned);
        overlapped: queued until the sum has arrived (:meth:`poll` sends it)."""
        if self.blocking:
            if t > 0:
                share += self.carried
            self.carried = self._sendrecv(share, RING_DKV_TAG)
            return
        self.queue.append((t, share))
        self._flush(wait=False)

    def _flush(self, wait: bool) -> None:
        while self.queue:
            t, share = self.queue[0]
            if t > 0:
                req = self.partials[t]
                if not (self.comm.wait([req]) if wait else req.test()):
                    return
                share += self.partials.pop(t).value
            self._send(share, RING_DKV_TAG)
            self.queue.popleft()

    def own(self):
        """This member's block's complete dk, dv (after every step's :meth:`pass_on`)."""
        if self.blocking:
            return self.carried
        self._flush(wait=True)
        return self.comm.wait([self.partials.pop(self.n)])[0]

    def poll(self) -> None:
        """Let the transfers in flight move (MPI progresses while its ranks call it) and
        send on what has arrived."""
        for req in self.sends + list(self.coming.values()) + list(self.partials.values()):
            req.test()
        if not self.blocking:
            self._forward()
            self._flush(wait=False)

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
            blocking: bool = False, rows: int = ROWS, depth: int = 2):
    """(y [b, h, s, d], lse [b, h, s]) of this member's queries against the whole
    sequence's keys (module docstring)."""
    xp = ctx.xp
    ring = _Ring(ctx, blocking, depth)
    lay = _Layout(xp, q, k, positions, ring.n, ring.me)
    qg = lay.group(q * q.dtype.type(scale))
    m = xp.full(lay.grouped[:4] + (1,), -xp.inf, dtype=q.dtype)
    l_ = xp.zeros_like(m)
    o = xp.zeros(lay.grouped, dtype=q.dtype)
    pq = lay.pos(ring.me)
    ring.start(xp.stack([k, v])[:, :, :, None])          # [2, b, g, 1, s, d]
    for t in range(ring.n):
        kv = ring.block(t)
        for qs, ks, mask in _pieces(_meetings(xp, pq, lay.pos(ring.member(t)), causal,
                                              window), rows):
            _forward_piece(xp, qg[..., qs, :], kv[0][..., ks, :], kv[1][..., ks, :], mask,
                           m[..., qs, :], l_[..., qs, :], o[..., qs, :])
            ring.poll()
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
             positions=None, blocking: bool = False, rows: int = ROWS, depth: int = 2):
    """(dq, dk, dv) of :func:`forward` for the upstream gradient ``dy``, from its saved
    ``y`` and ``lse`` (module docstring)."""
    xp = ctx.xp
    ring = _Ring(ctx, blocking, depth)
    lay = _Layout(xp, q, k, positions, ring.n, ring.me)
    sc = q.dtype.type(scale)
    qg, dyg = lay.group(q * sc), lay.group(dy)
    delta = lay.rows(xp.sum(dy * y, axis=-1))
    # a query that saw no key has lse -inf; its scores are all masked, so p = 0 anyway
    lse_g = lay.rows(xp.where(xp.isfinite(lse), lse, 0))
    dq = xp.zeros(lay.grouped, dtype=q.dtype)
    pq = lay.pos(ring.me)
    ring.start(xp.stack([k, v])[:, :, :, None])          # [2, b, g, 1, s, d]
    for t in range(ring.n):
        kv = ring.block(t)
        ring.expect(t, kv)
        if t == ring.n - 1:
            ring.expect(ring.n, kv)
        dkv = xp.zeros_like(kv)
        for qs, ks, mask in _pieces(_meetings(xp, pq, lay.pos(ring.member(t)), causal,
                                              window), rows):
            _backward_piece(xp, qg[..., qs, :], kv[0][..., ks, :], kv[1][..., ks, :],
                            dyg[..., qs, :], lse_g[..., qs, :], delta[..., qs, :], mask,
                            dq[..., qs, :], dkv[0][..., ks, :], dkv[1][..., ks, :])
            ring.poll()
        if ring.n > 1:
            ring.pass_on(t, dkv)
    if ring.n > 1:
        dkv = ring.own()
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
