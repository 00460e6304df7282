"""The arithmetic of attention on blocks, shared by the serial kernel and the
distributed forms (Ulysses, ring): each token's place in a stored sequence, the mask,
and one query block against one key block, forward (with its log-sum-exp) and backward
(probabilities recomputed from the final log-sum-exp, as flash attention does).

Example::

    pos = positions(np, 0, 8, 8, chunks=4)        # [0, 1, 6, 7, 2, 3, 4, 5]
    y, lse = block_forward(np, q, k, v, 0.5, visible(np, pos, pos, True, None))
"""

from __future__ import annotations


def positions(xp, start: int, count: int, total: int, chunks: int = 1):
    """The sequence positions (int64) of storage indices ``start .. start+count-1`` of a
    sequence of ``total`` tokens stored in the balanced order of ``chunks`` chunks
    (1: natural order). Storage chunk m holds chunk m/2 for even m, chunks-1-(m-1)/2 for
    odd m: rank r of chunks/2 holds chunks r and chunks-1-r."""
    j = xp.arange(start, start + count, dtype="int64")
    if chunks <= 1:
        return j
    size = total // chunks
    m, r = j // size, j % size
    return xp.where(m % 2 == 0, m // 2, chunks - 1 - m // 2) * size + r


def visible(xp, pq, pk, causal: bool, window):
    """Bool [len(pq), len(pk)]: which keys each query sees (module docstring)."""
    if not causal:
        return xp.ones((pq.size, pk.size), dtype=bool)
    gap = pq[:, None] - pk[None, :]
    ok = gap >= 0
    if window is not None:
        ok &= gap < window
    return ok


def _groups(q, k) -> int:
    """Query heads per key/value head (grouped-query attention: k, v carry fewer heads;
    query head j reads key/value head j // groups)."""
    return q.shape[-3] // k.shape[-3]


def _by_group(a, groups: int):
    """[..., h, s, d] as [..., h / groups, groups, s, d] (query-side operands)."""
    return a.reshape(a.shape[:-3] + (a.shape[-3] // groups, groups) + a.shape[-2:])


def block_forward(xp, q, k, v, scale, mask):
    """(y, lse) of one query block against one key block under ``mask``; rows that see
    no key get y = 0 and lse = -inf (a ring step's block may hide every key). k and v
    may carry fewer heads than q (grouped-query attention)."""
    groups = _groups(q, k)
    if groups > 1:
        y, lse = _forward(xp, _by_group(q, groups), k[..., None, :, :], v[..., None, :, :],
                          scale, mask)
        return y.reshape(q.shape), lse.reshape(q.shape[:-1])
    return _forward(xp, q, k, v, scale, mask)


def _hide(xp, s, mask) -> None:
    """Set the hidden keys of scores ``s`` to -inf, in place. ``mask``: bool [queries,
    keys]; or (start, bool [queries, keys - start]) when every query sees the keys
    before ``start`` (only the diagonal part is masked); None: every key seen."""
    if mask is None:
        return
    if isinstance(mask, tuple):
        start, sub = mask
        xp.copyto(s[..., start:], -xp.inf, where=~sub)
    else:
        xp.copyto(s, -xp.inf, where=~mask)


# The blocks run in place on the scores' array (the probabilities, then in the backward
# their gradient beside a second one): as array expressions they held three or four
# arrays of the scores' size at once.
def _forward(xp, q, k, v, scale, mask):
    s = q @ k.swapaxes(-1, -2)
    s *= q.dtype.type(scale)
    _hide(xp, s, mask)
    top = xp.max(s, axis=-1, keepdims=True)
    safe = xp.where(xp.isfinite(top), top, 0)
    del top
    s -= safe
    p = xp.exp(s, out=s)
    total = xp.sum(p, axis=-1, keepdims=True)
    y = p @ v
    y /= xp.where(total > 0, total, 1)
    with_keys = total[..., 0] > 0
    lse = xp.where(with_keys, safe[..., 0] + xp.log(xp.where(with_keys, total[..., 0], 1)),
                   -xp.inf)
    return y, lse


def block_backward(xp, q, k, v, y, lse, dy, scale, mask):
    """(dq, dk, dv) of one query block against one key block, the probabilities
    recomputed from the rows' final ``lse`` (flash attention's backward); a key/value
    head's gradients sum over the query heads that read it."""
    groups = _groups(q, k)
    if groups > 1:
        dq, dk, dv = _backward(
            xp, _by_group(q, groups), k[..., None, :, :], v[..., None, :, :],
            _by_group(y, groups), lse.reshape(lse.shape[:-2] + (k.shape[-3], groups,
                                                                lse.shape[-1])),
            _by_group(dy, groups), scale, mask)
        return dq.reshape(q.shape), dk.sum(axis=-3), dv.sum(axis=-3)
    return _backward(xp, q, k, v, y, lse, dy, scale, mask)


def _backward(xp, q, k, v, y, lse, dy, scale, mask):
    sc = q.dtype.type(scale)
    p = q @ k.swapaxes(-1, -2)
    p *= sc
    _hide(xp, p, mask)
    p -= xp.where(xp.isfinite(lse), lse, 0)[..., None]
    xp.exp(p, out=p)
    dv = p.swapaxes(-1, -2) @ dy
    ds = dy @ v.swapaxes(-1, -2)
    ds -= xp.expand_dims(xp.einsum("...i,...i->...", dy, y), -1)     # sum(dy y, -1)
    ds *= p
    del p
    ds *= sc
    return ds @ k, ds.swapaxes(-1, -2) @ q, dv


def repeat_heads(xp, a, times: int):
    """Each head of ``a`` [..., heads, s, d] ``times`` times in a row (key/value heads
    copied: query head j of the result's groups still reads head j // groups)."""
    if times == 1:
        return a
    return xp.repeat(a, times, axis=-3)


ROWS = 512      # queries per block of attend/attend_grad: [b, h, ROWS, keys] scores at once


def _keys(xp, pq, pk, causal: bool, window):
    """The key indices a block of queries at positions ``pq`` can see (all of them, a
    contiguous slice, or an index array), so masked keys are not computed."""
    if not causal:
        return slice(None)
    need = pk <= pq.max()
    if window is not None:
        need &= pk > pq.min() - window
    idx = xp.nonzero(need)[0]
    if idx.size == pk.size:
        return slice(None)
    if idx.size and int(idx[-1]) - int(idx[0]) + 1 == idx.size:
        return slice(int(idx[0]), int(idx[-1]) + 1)
    return idx


def _mask(xp, pq, pk, causal: bool, window):
    """The mask of a query block at ``pq`` against keys at ``pk`` for block_forward:
    without a window and with increasing key positions, only the keys past the block's
    first query are masked (the (start, part) form); else the whole mask."""
    if not causal:
        return None
    if window is None and pk.size > 1 and bool(xp.all(pk[1:] > pk[:-1])):
        start = int(xp.searchsorted(pk, pq.min(), side="right"))
        if start == pk.size:
            return None
        return start, visible(xp, pq, pk[start:], causal, window)
    return visible(xp, pq, pk, causal, window)


def _sorting(xp, pq, pk):
    """The permutation into sequence order of a self-attention's queries and keys stored
    out of order (the balanced order of context parallelism); None when they are in
    order or are not the same positions."""
    if pq.shape != pk.shape or not bool(xp.all(pq == pk)) or \
            bool(xp.all(pq[1:] > pq[:-1])):
        return None
    return xp.argsort(pq)


def attend(xp, q, k, v, scale, pq, pk, causal: bool, window, rows: int = ROWS):
    """(y, lse) of queries ``q`` at positions ``pq`` against keys at ``pk``, ``rows``
    queries at a time over only the keys they can see (the scores never exceed
    [b, h, rows, keys]); a self-attention stored out of order runs in sequence order
    (gathered there and back), so each block's keys are one slice, masked only past its
    first query."""
    order = _sorting(xp, pq, pk)
    if order is not None:
        back = xp.argsort(order)
        y, lse = attend(xp, q[..., order, :], k[..., order, :], v[..., order, :], scale,
                        pq[order], pk[order], causal, window, rows)
        return y[..., back, :], lse[..., back]
    y = xp.empty_like(q)
    lse = xp.empty(q.shape[:-1], dtype=q.dtype)
    for r in range(0, q.shape[-2], rows):
        part = slice(r, r + rows)
        keys = _keys(xp, pq[part], pk, causal, window)
        y[..., part, :], lse[..., part] = block_forward(
            xp, q[..., part, :], k[..., keys, :], v[..., keys, :], scale,
            _mask(xp, pq[part], pk[keys], causal, window))
    return y, lse


def attend_grad(xp, q, k, v, y, lse, dy, scale, pq, pk, causal: bool, window,
                rows: int = ROWS):
    """(dq, dk, dv) of :func:`attend`, ``rows`` queries at a time."""
    order = _sorting(xp, pq, pk)
    if order is not None:
        back = xp.argsort(order)
        grads = attend_grad(xp, q[..., order, :], k[..., order, :], v[..., order, :],
                            y[..., order, :], lse[..., order], dy[..., order, :], scale,
                            pq[order], pk[order], causal, window, rows)
        return tuple(g[..., back, :] for g in grads)
    dq = xp.empty_like(q)
    dk, dv = xp.zeros_like(k), xp.zeros_like(v)
    for r in range(0, q.shape[-2], rows):
        part = slice(r, r + rows)
        keys = _keys(xp, pq[part], pk, causal, window)
        dq[..., part, :], dkb, dvb = block_backward(
            xp, q[..., part, :], k[..., keys, :], v[..., keys, :], y[..., part, :],
            lse[..., part], dy[..., part, :], scale,
            _mask(xp, pq[part], pk[keys], causal, window))
        dk[..., keys, :] += dkb
        dv[..., keys, :] += dvb
    return dq, dk, dv


def _block_bytes(b, h, hk, r, n, d, item, grad: bool, causal: bool) -> int:
    """What one block of ``r`` queries against ``n`` keys allocates beyond its results
    (:func:`_forward`, :func:`_backward`, their grouped-query sums): the scores (and
    their gradient), the products of the block, the mask, row statistics."""
    scores, stats, mask = b * h * r * n * item, b * h * r * item, r * n * causal
    rows_out, keys_out = b * h * r * d * item, b * h * n * d * item
    if not grad:
        return mask + scores + rows_out + 6 * stats
    grouped_sums = 2 * keys_out * (1 + hk / h) + rows_out if hk < h else 0
    return mask + max(2 * scores + keys_out + 2 * stats, scores + 2 * keys_out + rows_out,
                      grouped_sums)


def attend_bytes(q_shape, k_shape, item: int, causal: bool, window, chunks: int = 1,
                 grad: bool = False, rows: int = ROWS) -> int:
    """Bytes :func:`attend` (``grad``: :func:`attend_grad`) allocates beyond its results
    for q ``[b, h, s, d]`` and k, v ``[b, hk, s, d]`` of ``item`` bytes an element: its
    largest block's (the scores of ``rows`` queries against the keys they see, their
    products, mask and row statistics); stored in the balanced order of ``chunks`` > 1
    also the operands' copies in sequence order.

    Example: ``attend_bytes((8, 8, 128, 32), (8, 4, 128, 32), 4, True, None)`` is about
    the [8, 8, 128, 128] float32 scores (4 MiB) and one [8, 8, 128, 32] product (1 MiB).
    """
    b, h, s, d = q_shape
    hk = k_shape[1]
    worst = 0
    for start in range(0, s, rows):
        r = min(rows, s - start)
        first = 0 if window is None else max(0, start - window + 1)
        n = start + r - first if causal else k_shape[2]
        worst = max(worst, _block_bytes(b, h, hk, r, n, d, item, grad, causal))
    if chunks <= 1:
        return int(worst)
    q_bytes, k_bytes, lse_bytes = b * h * s * d * item, b * hk * s * d * item, b * h * s * item
    if grad:        # q, y, dy, k, v, lse in sequence order; the gradients back
        return int(max(3 * q_bytes + 2 * k_bytes + lse_bytes + worst, q_bytes + 2 * k_bytes))
    return int(max(q_bytes + 2 * k_bytes + worst, q_bytes + lse_bytes))
