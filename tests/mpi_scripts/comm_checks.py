"""MPICommunicator checks on 4 ranks, run by tests/test_comm.py through the launcher.

Every collective on world and sub-groups against a numpy oracle, the byte counters
against the cost model, p2p, and the timeouts (a receive nobody sends, a group one
member never joins). Prints ``comm-mpi OK`` on rank 0.
"""

from __future__ import annotations

import numpy as np

from distgraph.errors import RuntimeFault
from distgraph.passes.cost.formulas import collective_bytes
from distgraph.runtime.comm.mpi import _HANDSHAKE_TAG, MPICommunicator


def value(rank: int, shape=(4, 6)) -> np.ndarray:
    return np.arange(np.prod(shape), dtype=np.float64).reshape(shape) * (rank + 1)


def check(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


def main() -> None:
    comm = MPICommunicator()
    r = comm.rank
    check(comm.size == 4, "run me on 4 ranks")
    pairs = (0, 2) if r % 2 == 0 else (1, 3)
    for group in [(0, 1, 2, 3), pairs, (3, 2, 1, 0)]:
        n = len(group)
        x = value(r)
        comm.reset_counters()
        out = comm.all_gather(x, group, axis=1)
        check(np.array_equal(out, np.concatenate([value(g) for g in group], axis=1)),
              f"all_gather {group}")
        out = comm.all_reduce(x, group)
        check(np.array_equal(out, sum(value(g) for g in group)), f"all_reduce {group}")
        out = comm.reduce_scatter(x, group, axis=0)
        total = sum(value(g) for g in group)
        check(np.array_equal(out, np.split(total, n, axis=0)[group.index(r)]),
              f"reduce_scatter {group}")
        y = value(r, (4, 4))
        out = comm.all_to_all(y, group, split_axis=1, concat_axis=0)
        want = np.concatenate([np.split(value(g, (4, 4)), n, axis=1)[group.index(r)]
                               for g in group], axis=0)
        check(np.array_equal(out, want), f"all_to_all {group}")
        b = x.nbytes
        expected = {"all_gather": collective_bytes("all_gather", n, b * n),
                    "all_reduce": collective_bytes("all_reduce", n, b),
                    "reduce_scatter": collective_bytes("reduce_scatter", n, b),
                    "all_to_all": collective_bytes("all_to_all", n, y.nbytes),
                    "send_recv": 0.0}
        check(comm.bytes_sent == expected, f"counters {comm.bytes_sent} != {expected}")
        # variable counts: (src + dst) % 3 rows from src to dst, some pairs none
        rows = [np.full(((r + g) % 3, 2), 10.0 * r + g) for g in group]
        out = comm.all_to_allv(np.concatenate(rows), [len(x) for x in rows],
                               [(g + r) % 3 for g in group], group)
        want = np.concatenate([np.full(((g + r) % 3, 2), 10.0 * g + r) for g in group])
        check(np.array_equal(out, want), f"all_to_allv {group}")
    # p2p around a ring, two tags, sends before receives (nonblocking sends)
    comm.reset_counters()
    big = np.full((256, 256), float(r))
    comm.send(big, (r + 1) % 4, tag=3)
    comm.send(np.array([r]), (r + 1) % 4, tag=4)
    small = comm.recv((1,), np.int64, (r - 1) % 4, tag=4)
    got = comm.recv((256, 256), np.float64, (r - 1) % 4, tag=3)
    comm.wait_sends()
    check(small[0] == (r - 1) % 4 and got[0, 0] == (r - 1) % 4, "ring p2p")
    check(comm.bytes_sent["send_recv"] == big.nbytes + 8, "p2p counter")
    comm.barrier()
    # a receive that nobody sends times out and names the rank and the message
    short = MPICommunicator(timeout=0.5)
    if r == 0:
        try:
            short.recv((2,), np.float64, src=1, tag=7)
        except RuntimeFault as exc:
            check("rank 0" in str(exc) and "rank 1" in str(exc) and "tag 7" in str(exc),
                  f"timeout message: {exc}")
        else:
            raise AssertionError("recv without a sender did not time out")
    comm.barrier()
    # a group that rank 2 never joins: ranks 0 and 1 fail in the set-up handshake
    if r in (0, 1):
        try:
            short.all_reduce(np.ones(2), (0, 1, 2))
        except RuntimeFault as exc:
            check(f"rank {r}" in str(exc) and "(0, 1, 2)" in str(exc),
                  f"handshake message: {exc}")
        else:
            raise AssertionError("a collective with a missing member did not time out")
    elif r == 2:
        for src in (0, 1):  # drain the set-up messages that were never answered
            short._comm.Recv(np.empty(2, dtype=np.int64), source=src, tag=_HANDSHAKE_TAG)
    comm.barrier()
    if r == 0:
        print("comm-mpi OK", flush=True)


if __name__ == "__main__":
    main()
