"""A simulated world: N ranks as N threads of one process, for tests and tools.

Example::

    >>> world = SimulatedWorld(2)
    >>> world.run(lambda comm: comm.all_reduce(np.array([comm.rank + 1.0]), (0, 1)))
    [array([3.]), array([3.])]
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque

import numpy as np


from distgraph.errors import RuntimeFault
from distgraph.runtime.comm.base import Communicator, Request

class SimulatedWorld:
    """N ranks in one process. ``run(fn)`` calls ``fn(comm)`` on N threads and returns the
    per-rank results, re-raising the first exception (the other ranks then stop waiting
    and raise RuntimeFault instead of hanging)."""

    def __init__(self, size: int, timeout: float | None = None, backend=None):
        if size < 1:
            raise RuntimeFault(f"SimulatedWorld({size}): a world has at least one rank")
        self.size = size
        self._cond = threading.Condition()
        self._comms = [SimulatedCommunicator(self, r, timeout, backend) for r in range(size)]
        self._reset()

    def _reset(self) -> None:
        self._mail: dict = defaultdict(deque)
        self._posted: dict = defaultdict(deque)     # box -> receives waiting, in posting order
        self._slots: dict = {}
        self._failed: tuple | None = None
        for comm in self._comms:
            comm._seq = {}

    def communicator(self, rank: int) -> "SimulatedCommunicator":
        return self._comms[rank]

    def run(self, fn, *args) -> list:
        """``[fn(comm_0, *args), ..., fn(comm_{N-1}, *args)]``, each on its own thread."""
        self._reset()
        results = [None] * self.size

        def body(rank):
            try:
                results[rank] = fn(self._comms[rank], *args)
            except BaseException as exc:  # noqa: BLE001 - re-raised by run()
                with self._cond:
                    if self._failed is None:
                        self._failed = (rank, exc)
                    self._cond.notify_all()

        threads = [threading.Thread(target=body, args=(r,), daemon=True,
                                    name=f"distgraph-sim-rank{r}") for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self._failed is not None:
            raise self._failed[1]
        return results

    def raise_if_peer_failed(self, rank: int, what: str) -> None:
        """Another rank's failure ends this rank's wait for ``what`` (condition held)."""
        if self._failed is not None and self._failed[0] != rank:
            failed, exc = self._failed
            raise RuntimeFault(f"rank {rank}: stopped waiting for {what}: rank {failed} "
                               f"failed with {type(exc).__name__}: {exc}")

    def _match(self, box) -> None:
        """Hand the messages in ``box`` to its posted receives, the first posted taking the
        first sent (MPI's order, whichever receive is tested first; condition held)."""
        mail, posted = self._mail[box], self._posted[box]
        while mail and posted:
            posted.popleft().arrived = mail.popleft()

    def _wait(self, ready, rank: int, timeout: float, what, fix: str = "") -> None:
        """Wait on the world condition (held by the caller) until ``ready()``; ``fix``
        ends the timeout message (default: the p2p advice)."""
        deadline = time.monotonic() + timeout
        while not ready():
            self.raise_if_peer_failed(rank, what())
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeFault(f"rank {rank}: timed out after {timeout:g} s waiting for "
                                   f"{what()}; " + (fix or "a peer did not make the matching "
                                                    "call (check that every rank runs the "
                                                    "same plan)"), timed_out=True)
            self._cond.wait(remaining)


class SimulatedCommunicator(Communicator):
    """One rank of a :class:`SimulatedWorld`; the same semantics as MPI, in threads."""

    def __init__(self, world: SimulatedWorld, rank: int, timeout: float | None = None,
                 backend=None):
        super().__init__(rank, world.size, timeout, backend)
        self._world = world
        self._seq: dict = {}

    def _exchange(self, kind: str, group, arr, meta=()) -> dict:
        """Deposit ``arr`` for the next ``kind`` on ``group``; return every member's."""
        slot, seq = self._deposit(kind, group, arr, meta)
        w = self._world
        with w._cond:
            w._wait(lambda: len(slot["data"]) == len(group), self.rank, self.timeout,
                    lambda: self._missing(kind, seq, group, slot),
                    f"{self.phase} is collective: call it on every rank" if self.phase else
                    "this call is collective: call it on every rank of the group (check "
                    "that every rank runs the same plan)")
            return self._collect(slot, group, seq)

    def _deposit(self, kind: str, group, arr, meta=()) -> tuple:
        """Put this rank's ``arr`` into the slot of the next ``kind`` on ``group``;
        (the slot, its number on the group)."""
        seq = self._seq.get(group, 0)
        self._seq[group] = seq + 1
        w = self._world
        with w._cond:
            slot = w._slots.setdefault((group, seq), {"call": (kind, meta), "data": {},
                                                      "left": len(group)})
            if slot["call"] != (kind, meta):
                raise RuntimeFault(f"rank {self.rank}: called {kind}{meta} as call #{seq} on "
                                   f"group {group}, but another member called "
                                   f"{slot['call'][0]}{slot['call'][1]}; the ranks run "
                                   f"different plans")
            slot["data"][self.rank] = None if arr is None else arr.copy()
            w._cond.notify_all()
        return slot, seq

    @staticmethod
    def _missing(kind, seq, group, slot) -> str:
        return (f"{kind} #{seq} on group {group} (missing ranks "
                f"{sorted(set(group) - set(slot['data']))})")

    def _collect(self, slot, group, seq) -> dict:
        """Every member's array of a full slot (the world's condition held); the last
        member to collect frees the slot."""
        w = self._world
        data = dict(slot["data"])
        slot["left"] -= 1
        if slot["left"] == 0:
            del w._slots[(group, seq)]
        return data

    def _all_gather(self, arr, group, axis):
        data = self._exchange("all_gather", group, arr, (axis,))
        return self.backend.concatenate([data[r] for r in group], axis=axis)

    def _reduced(self, kind, arr, group, op, meta=()):
        data = self._exchange(kind, group, arr, (op, *meta))
        out = data[group[0]].copy()
        reduce = self.backend.reducer(op)
        for r in group[1:]:
            reduce(out, data[r], out=out)
        return out

    def _iall_gather(self, arr, group, axis):
        slot, seq = self._deposit("all_gather", group, arr, (axis,))
        return _SimulatedCollective(
            self, slot, group, seq, "all_gather",
            lambda data: self.backend.concatenate([data[r] for r in group], axis=axis))

    def _iall_reduce(self, arr, group, op, inplace):
        slot, seq = self._deposit("all_reduce", group, arr, (op,))

        def finish(data):
            out = data[group[0]].copy()
            reduce = self.backend.reducer(op)
            for r in group[1:]:
                reduce(out, data[r], out=out)
            if inplace:
                arr[...] = out
                return arr
            return out

        return _SimulatedCollective(self, slot, group, seq, "all_reduce", finish)

    def _ireduce_scatter(self, arr, group, axis):
        slot, seq = self._deposit("reduce_scatter", group, arr, ("sum", axis))

        def finish(data):
            total = data[group[0]].copy()
            for r in group[1:]:
                total += data[r]
            return self.backend.chunk(total, len(group), axis, group.index(self.rank)).copy()

        return _SimulatedCollective(self, slot, group, seq, "reduce_scatter", finish)

    def wait(self, requests) -> list:
        requests = list(requests)
        w = self._world
        with w._cond:
            w._wait(lambda: all([r.ready() for r in requests]), self.rank, self.timeout,
                    lambda: "; ".join(r.what for r in requests if not r.ready()),
                    "this call is collective: call it on every rank of the group (check "
                    "that every rank runs the same plan)")
        return [r.value if r.test() else None for r in requests]

    def _all_reduce(self, arr, group, op):
        return self._reduced("all_reduce", arr, group, op)

    def _reduce_scatter(self, arr, group, axis):
        total = self._reduced("reduce_scatter", arr, group, "sum", (axis,))
        return self.backend.chunk(total, len(group), axis, group.index(self.rank)).copy()

    def _all_to_all(self, arr, group, split_axis, concat_axis):
        data = self._exchange("all_to_all", group, arr, (split_axis, concat_axis))
        me = group.index(self.rank)
        chunks = [self.backend.split(data[r], len(group), split_axis)[me] for r in group]
        return self.backend.concatenate(chunks, axis=concat_axis)

    def _all_to_allv(self, arr, send_counts, recv_counts, group):
        data = self._exchange("all_to_allv", group, arr)
        counts = self._exchange("all_to_allv counts", group, np.asarray(send_counts))
        me = group.index(self.rank)
        chunks = []
        for r, want in zip(group, recv_counts):
            start = int(counts[r][:me].sum())
            got = int(counts[r][me])
            if got != want:
                raise RuntimeFault(f"rank {self.rank}: all_to_allv on group {group}: rank "
                                   f"{r} sends {got} rows here, this rank expects {want}")
            chunks.append(data[r][start:start + got])
        return self.backend.concatenate(chunks, axis=0)

    def _send(self, arr, dst, tag):
        w = self._world
        with w._cond:
            w._mail[(self.rank, dst, tag)].append(arr)
            w._cond.notify_all()

    def _recv(self, shape, dtype, src, tag):
        req = self._irecv(shape, dtype, src, tag)      # after the receives posted before it
        w = self._world
        with w._cond:
            w._wait(req.test, self.rank, self.timeout, lambda: req.what)
        return req.value

    def barrier(self) -> None:
        self._exchange("barrier", tuple(range(self.size)), None)

    def _isend(self, arr, dst, tag):
        self._send(arr.copy(), dst, tag)      # the receiver owns its copy, as over MPI
        req = Request(f"a message to rank {dst} with tag {tag}")
        req.done = True
        return req

    def _irecv(self, shape, dtype, src, tag):
        return _SimulatedReceive(self, shape, dtype, src, tag)


class _SimulatedReceive(Request):
    """A receive from the world's mailbox, matched as MPI matches: to the first message
    from ``src`` with ``tag`` that no receive posted before it takes (whichever of them is
    tested first). ``test`` raises RuntimeFault once another rank of the world has
    failed (as a real job would be ended)."""

    def __init__(self, comm, shape, dtype, src, tag):
        super().__init__(f"a message from rank {src} with tag {tag} ({shape} {dtype})")
        self._comm, self._shape, self._dtype = comm, shape, dtype
        self._box = (src, comm.rank, tag)
        self.arrived = None             # the message matched to it (by the world)
        w = comm._world
        with w._cond:
            w._posted[self._box].append(self)
            w._match(self._box)

    def test(self) -> bool:
        if self.done:
            return True
        w, rank = self._comm._world, self._comm.rank
        with w._cond:
            w.raise_if_peer_failed(rank, self.what)
            w._match(self._box)
            if self.arrived is None:
                return False
            arr, self.arrived = self.arrived, None
        if arr.shape != self._shape or arr.dtype != self._dtype:
            raise RuntimeFault(f"rank {rank}: expected {self._shape} {self._dtype} from rank "
                               f"{self._box[0]} (tag {self._box[2]}) but received "
                               f"{arr.shape} {arr.dtype}")
        self.value, self.done = arr, True
        return True

    def cancel(self) -> None:
        """Stop waiting: a receive not yet matched leaves the queue (no message is lost)."""
        w = self._comm._world
        with w._cond:
            if self.arrived is None and self in w._posted[self._box]:
                w._posted[self._box].remove(self)


class _SimulatedCollective(Request):
    """A started collective of the simulated world: done once every member of its group
    has deposited its array; ``finish(data)`` then makes this rank's result."""

    def __init__(self, comm, slot, group, seq, kind, finish):
        super().__init__(f"{kind} #{seq} on group {group}")
        self._comm, self._slot, self._group, self._seq = comm, slot, group, seq
        self._finish = finish

    def ready(self) -> bool:
        """Whether every member has deposited (the world's condition held, or not)."""
        return self.done or len(self._slot["data"]) == len(self._group)

    def test(self) -> bool:
        if self.done:
            return True
        w, rank = self._comm._world, self._comm.rank
        with w._cond:
            w.raise_if_peer_failed(rank, self.what)
            if len(self._slot["data"]) < len(self._group):
                return False
            data = self._comm._collect(self._slot, self._group, self._seq)
        self.value, self.done = self._finish(data), True
        return True
