"""Ring attention on real MPI ranks, run by tests/test_ring_attention.py (cp = the job's
size): forward and gradients equal a serial causal attention of the whole sequence
(numpy, fp64, 1e-10) in the balanced and the natural order, with chunks of 1-3 tokens,
grouped-query heads, a sliding window, 1 to 4 blocks received ahead and the blocking
reference; the bytes sent equal
:func:`ring_attention.comm`; and no chunk attends to a later one (changing a later
chunk's keys and values leaves every earlier query's output bit for bit). Prints
``ring OK`` on rank 0.
"""

from __future__ import annotations

import numpy as np

from distgraph.ops import ring_attention as ra
from distgraph.registry import KernelContext
from distgraph.runtime.comm.mpi import MPICommunicator

TOL = 1e-10
SCALE = 0.35


def serial(q, k, v, dy, scale, causal=True, window=None):
    """Causal attention of the whole sequence (natural order) and its gradients."""
    h, g = q.shape[1], k.shape[1]
    kk, vv = np.repeat(k, h // g, axis=1), np.repeat(v, h // g, axis=1)
    s = q @ kk.swapaxes(-1, -2) * scale
    i = np.arange(q.shape[2])
    mask = i[:, None] >= i[None, :] if causal else np.ones((i.size, i.size), bool)
    if window is not None:
        mask &= i[:, None] - i[None, :] < window
    s = np.where(mask, s, -np.inf)
    top = s.max(axis=-1, keepdims=True)
    p = np.exp(s - top)
    total = p.sum(axis=-1, keepdims=True)
    p /= total
    y, lse = p @ vv, (top + np.log(total))[..., 0]
    dv = p.swapaxes(-1, -2) @ dy
    dp = dy @ vv.swapaxes(-1, -2)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True)) * scale
    dq, dk = ds @ kk, ds.swapaxes(-1, -2) @ q

    def per_kv_head(a):
        return a.reshape(a.shape[0], g, h // g, *a.shape[2:]).sum(axis=2)
    return y, lse, dq, per_kv_head(dk), per_kv_head(dv)


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def inputs(seed, b, h, g, seq, d):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((b, h, seq, d)), rng.standard_normal((b, g, seq, d)),
            rng.standard_normal((b, g, seq, d)), rng.standard_normal((b, h, seq, d)))


def mine(positions, ctx, s):
    return positions(ctx.comm.rank) if positions else np.arange(ctx.comm.rank * s,
                                                                (ctx.comm.rank + 1) * s)


def equal_serial(ctx, case):
    n, (b, h, g, s, d) = ctx.comm.size, case["shape"]
    positions = ra.balanced_positions(n, s) if case["order"] == "balanced" else None
    q, k, v, dy = inputs(s + h + g, b, h, g, n * s, d)
    want = serial(q, k, v, dy, SCALE, window=case.get("window"))
    p = mine(positions, ctx, s)
    local = [a[:, :, p] for a in (q, k, v, dy)]
    opts = dict(blocking=case.get("blocking", False), rows=case.get("rows", ra.ROWS),
                depth=case.get("depth", 2))
    ctx.comm.reset_counters()
    y, lse = ra.forward(ctx, *local[:3], SCALE, True, case.get("window"), positions, **opts)
    grads = ra.backward(ctx, *local[:3], y, lse, local[3], SCALE, True, case.get("window"),
                        positions, **opts)
    for name, got, ref in zip(("y", "lse", "dq", "dk", "dv"), (y, lse, *grads), want):
        err = np.abs(got - ref[:, :, p]).max()
        check(err < TOL, f"rank {ctx.comm.rank} {case}: {name} differs from serial by {err}")
    kbytes = local[1].nbytes
    expected = sum(nbytes for _, _, nbytes in ra.comm(n, 0, kbytes) + ra.comm(n, 0, kbytes, True))
    check(ctx.comm.bytes_sent["send_recv"] == expected,
          f"rank {ctx.comm.rank} {case}: sent {ctx.comm.bytes_sent['send_recv']} bytes, "
          f"comm() says {expected}")


def no_peeking(ctx, causal):
    """For each chunk c, new keys and values in chunks after c: every query of chunks up
    to c gets the same y, lse and dq bit for bit (no query attends to a later chunk).
    Returns whether that held everywhere (it must not without the causal mask)."""
    n, s = ctx.comm.size, 4
    positions = ra.balanced_positions(n, s)
    q, k, v, dy = inputs(7, 1, 2, 2, n * s, 4)
    p = mine(positions, ctx, s)
    chunk = s // 2

    def run(k, v):
        y, lse = ra.forward(ctx, q[:, :, p], k[:, :, p], v[:, :, p], SCALE, causal, None,
                            positions)
        dq, _, _ = ra.backward(ctx, q[:, :, p], k[:, :, p], v[:, :, p], y, lse,
                               dy[:, :, p], SCALE, causal, None, positions)
        return y, lse, dq

    base = run(k, v)
    same = True
    for c in range(2 * n - 1):
        later = slice((c + 1) * chunk, None)
        k2, v2 = k.copy(), v.copy()
        k2[:, :, later] += 5.0
        v2[:, :, later] -= 3.0
        got = run(k2, v2)
        early = p < (c + 1) * chunk
        same &= all(np.array_equal(a[:, :, early], b[:, :, early])
                    for a, b in zip(got, base))
    return same


def main():
    comm = MPICommunicator()
    n = comm.size
    ctx = KernelContext(np, comm=comm, group=tuple(range(n)))
    cases = []
    for order in ("balanced", "natural"):
        for s in (2, 4, 6):            # chunks of 1, 2, 3 tokens in the balanced order
            cases.append(dict(order=order, shape=(2, 4, 2, s, 8)))
        cases.append(dict(order=order, shape=(1, 2, 2, 6, 4), blocking=True))
    cases += [dict(order="balanced", shape=(1, 4, 1, 10, 4), window=5),
              dict(order="balanced", shape=(1, 3, 3, 16, 4), rows=3),
              dict(order="balanced", shape=(1, 2, 2, 4, 4), depth=1),
              dict(order="natural", shape=(1, 2, 2, 4, 4), depth=4, rows=1),
              dict(order="natural", shape=(1, 2, 1, 8, 4), window=3, blocking=True)]
    for case in cases:
        equal_serial(ctx, case)
    check(no_peeking(ctx, causal=True), f"rank {comm.rank}: a query attends to a later chunk")
    check(not no_peeking(ctx, causal=False), f"rank {comm.rank}: the no-peeking check "
          "cannot tell (without the causal mask queries do see later chunks)")
    comm.barrier()
    if comm.rank == 0:
        print(f"ring OK on {n} ranks: {len(cases)} cases equal serial")


if __name__ == "__main__":
    main()
