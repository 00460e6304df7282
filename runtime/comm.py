"""Communicators over logical ranks: the interface, byte counters, and a simulated world.

A :class:`Communicator` offers the collectives reshard and training need on *groups*
(tuples of ranks; a rank's position in the tuple is its coordinate), plus p2p
send/recv. Every call adds to ``bytes_sent[kind]`` the bytes this rank sends under the
ring model of :mod:`distgraph.passes.cost_model`, computed from the buffers actually
passed, so tests can compare a plan's bytes with what ran.

Semantics (identical for every implementation):

- ``all_gather(arr, group, axis)``: concatenation of the members' arrays along ``axis``
  in group order.
- ``all_reduce(arr, group, op="sum", inplace=False)``: elementwise sum (or max/min) of the
  members' arrays. With ``inplace`` the caller hands ``arr`` over: the result may be
  written into it and returned, which saves a buffer of its size and a pass over it.
- ``reduce_scatter(arr, group, axis)``: the sum, split along ``axis`` into ``len(group)``
  equal chunks; member i gets chunk i.
- ``all_to_all(arr, group, split_axis, concat_axis)``: member i splits its array along
  ``split_axis`` into n chunks and sends chunk j to member j; each member concatenates
  what it receives along ``concat_axis`` in group order.
- ``send(arr, dst, tag)`` never blocks (the array is copied); ``wait_sends()`` waits
  until this rank's sends are delivered. ``recv(shape, dtype, src, tag)`` returns the
  next message from ``src`` with that tag.
- ``isend(arr, dst, tag)`` and ``irecv(shape, dtype, src, tag)`` start a send or a
  receive and return a :class:`Request` at once; ``request.test()`` says whether it is
  done (a receive's array is then ``request.value``). The caller must not change a sent
  array until its request is done. They never wait, so whoever polls them (the pipeline
  actors) owns the timeout.

Nothing waits forever: a receive or collective that waits longer than ``timeout``
seconds (default 60, or the env var ``DISTGRAPH_COMM_TIMEOUT``) raises RuntimeFault
naming the rank and what it waited for.

API calls that are collective (``Engine.fit``, ``Engine.state_dict``, ...) run inside
``collective_call(name)``: the ranks first compare the name of the call they are in, so
ranks calling different ones fail at once, and a rank waiting for peers that never call
says "NAME is collective: call it on every rank".

:class:`SimulatedWorld` runs N ranks as N threads of one process::

    >>> world = SimulatedWorld(2)
    >>> world.run(lambda comm: comm.all_reduce(np.array([comm.rank + 1.0]), (0, 1)))
    [array([3.]), array([3.])]

:class:`MPICommunicator` (module :mod:`distgraph.runtime.mpi_comm`, importable from here)
runs them over mpi4py.
"""

from __future__ import annotations

import os
import threading
import time
from abc import ABC, abstractmethod
from collections import defaultdict, deque
from contextlib import contextmanager

import numpy as np

from distgraph.errors import RuntimeFault
from distgraph.passes.cost_model import COLLECTIVES, collective_bytes
from distgraph.runtime.backend import NUMPY
from distgraph.runtime.progress import NO_PROGRESS

DEFAULT_TIMEOUT = 60.0
MAX_TAG = 1 << 14  # user tags are [0, MAX_TAG); MPI's upper tags are kept for internals
COUNTED_KINDS = COLLECTIVES + ("send_recv",)
REDUCE_OPS = {"sum": np.add, "max": np.maximum, "min": np.minimum}
CALL_NAME_BYTES = 64


def default_timeout() -> float:
    """Seconds a receive or collective may wait: $DISTGRAPH_COMM_TIMEOUT, else 60."""
    raw = os.environ.get("DISTGRAPH_COMM_TIMEOUT")
    if raw is None:
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        raise RuntimeFault(f"DISTGRAPH_COMM_TIMEOUT={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise RuntimeFault(f"DISTGRAPH_COMM_TIMEOUT={raw!r} must be positive")
    return value


class Communicator(ABC):
    """Collectives and p2p over logical ranks, with per-kind counters of bytes sent.

    Subclasses implement the ``_``-prefixed methods; the public ones validate, handle
    one-member groups locally and count bytes. ``backend`` (an
    :class:`~distgraph.runtime.backend.ArrayBackend`, numpy by default) makes every array
    a communicator allocates, copies or cuts. ``progress`` is where this rank records
    what it runs and waits for (see :mod:`distgraph.runtime.progress`); ``phase`` names
    the collective API call in progress.
    """

    poll_spin_seconds = 0.0   # how long a poller of requests spins before it sleeps
    progress = NO_PROGRESS

    def __init__(self, rank: int, size: int, timeout: float | None = None, backend=None):
        self.rank = rank
        self.size = size
        self.backend = backend or NUMPY
        self.timeout = default_timeout() if timeout is None else float(timeout)
        self.phase = ""
        self.reset_counters()

    # ---- collective API calls -----------------------------------------------------------
    @contextmanager
    def collective_call(self, name: str):
        """Run the block as the collective call ``name`` of every rank: the ranks first
        check that all of them are in the same call (uncounted: it is no step traffic);
        nested calls are checked once."""
        if self.phase or self.size == 1:
            yield
            return
        raw = name.encode()[:CALL_NAME_BYTES]
        mine = np.frombuffer(raw.ljust(CALL_NAME_BYTES, b"\0"), dtype=np.uint8)
        self.phase = name
        try:
            with self.progress.phase(name):
                names = self._all_gather(mine, tuple(range(self.size)), 0)
                names = [bytes(row).rstrip(b"\0").decode(errors="replace")
                         for row in names.reshape(self.size, CALL_NAME_BYTES)]
                others = {r: n for r, n in enumerate(names) if n != names[self.rank]}
                if others:
                    raise RuntimeFault(f"rank {self.rank}: {name} is collective: call it on "
                                       f"every rank; here "
                                       + ", ".join(f"rank {r} called {n}"
                                                   for r, n in sorted(others.items())))
                yield
        finally:
            self.phase = ""

    # ---- counters -------------------------------------------------------------------
    def reset_counters(self) -> None:
        self.bytes_sent = {k: 0.0 for k in COUNTED_KINDS}
        self.calls = {k: 0 for k in COUNTED_KINDS}

    @property
    def total_bytes_sent(self) -> float:
        return sum(self.bytes_sent.values())

    def _count(self, kind: str, n: int, nbytes: int) -> None:
        self.calls[kind] += 1
        self.bytes_sent[kind] += collective_bytes(kind, n, nbytes)

    # ---- validation -----------------------------------------------------------------
    def _group(self, group, what: str) -> tuple[int, ...]:
        group = tuple(int(r) for r in group)
        if len(set(group)) != len(group) or not all(0 <= r < self.size for r in group):
            raise RuntimeFault(f"rank {self.rank}: {what} on group {group}: a group holds "
                               f"distinct ranks in [0, {self.size})")
        if self.rank not in group:
            raise RuntimeFault(f"rank {self.rank}: {what} on group {group}, which does not "
                               f"contain this rank; only members call a collective")
        return group

    def _c(self, arr):
        """``arr`` as a C-contiguous array of the backend (0-d arrays stay 0-d)."""
        return self.backend.contiguous(self.backend.asarray(arr))

    def _split_axis(self, arr, axis: int, n: int, what: str) -> int:
        axis = axis + arr.ndim if axis < 0 else axis
        if not 0 <= axis < arr.ndim or arr.shape[axis] % n:
            raise RuntimeFault(f"rank {self.rank}: {what}: axis {axis} of an array of shape "
                               f"{arr.shape} cannot be split into {n} equal chunks")
        return axis

    def _peer(self, peer: int, tag: int, what: str) -> None:
        if not 0 <= peer < self.size:
            raise RuntimeFault(f"rank {self.rank}: {what} peer {peer} is not a rank in "
                               f"[0, {self.size})")
        if not 0 <= tag < MAX_TAG:
            raise RuntimeFault(f"rank {self.rank}: {what} tag {tag} is outside [0, {MAX_TAG})")

    # ---- public API -------------------------------------------------------------------
    def all_gather(self, arr, group, axis: int = 0):
        arr = self._c(arr)
        group = self._group(group, "all_gather")
        axis = axis + arr.ndim if axis < 0 else axis
        self._count("all_gather", len(group), arr.nbytes * len(group))
        if len(group) == 1:
            return arr.copy()
        return self._all_gather(arr, group, axis)

    def all_reduce(self, arr, group, op: str = "sum", inplace: bool = False):
        arr = self._c(arr)
        group = self._group(group, "all_reduce")
        if op not in REDUCE_OPS:
            raise RuntimeFault(f"rank {self.rank}: all_reduce op {op!r}; use one of "
                               f"{sorted(REDUCE_OPS)}")
        self._count("all_reduce", len(group), arr.nbytes)
        inplace = inplace and arr.flags.writeable
        if len(group) == 1:
            return arr if inplace else arr.copy()
        if inplace:
            return self._all_reduce_inplace(arr, group, op)
        return self._all_reduce(arr, group, op)

    def reduce_scatter(self, arr, group, axis: int = 0):
        arr = self._c(arr)
        group = self._group(group, "reduce_scatter")
        axis = self._split_axis(arr, axis, len(group), "reduce_scatter")
        self._count("reduce_scatter", len(group), arr.nbytes)
        if len(group) == 1:
            return arr.copy()
        return self._reduce_scatter(arr, group, axis)

    def all_to_all(self, arr, group, split_axis: int, concat_axis: int):
        arr = self._c(arr)
        group = self._group(group, "all_to_all")
        split_axis = self._split_axis(arr, split_axis, len(group), "all_to_all")
        concat_axis = concat_axis + arr.ndim if concat_axis < 0 else concat_axis
        self._count("all_to_all", len(group), arr.nbytes)
        if len(group) == 1:
            return arr.copy()
        return self._all_to_all(arr, group, split_axis, concat_axis)

    def send(self, arr, dst: int, tag: int = 0) -> None:
        """Send a copy of ``arr`` to rank ``dst`` without blocking."""
        self._peer(dst, tag, "send to")
        arr = self.backend.copy(arr)
        self._count("send_recv", 2, arr.nbytes)
        self._send(arr, dst, tag)

    def recv(self, shape, dtype, src: int, tag: int = 0):
        """The next array from rank ``src`` with ``tag``; RuntimeFault after the timeout."""
        self._peer(src, tag, "recv from")
        return self._recv(tuple(int(s) for s in shape), np.dtype(dtype), src, tag)

    def isend(self, arr, dst: int, tag: int = 0, count: bool = True) -> "Request":
        """Start sending ``arr`` to rank ``dst``; ``count=False`` for control messages that
        are no part of the plan's data (left out of ``bytes_sent``)."""
        self._peer(dst, tag, "isend to")
        arr = self._c(arr)
        if count:
            self._count("send_recv", 2, arr.nbytes)
        return self._isend(arr, dst, tag)

    def irecv(self, shape, dtype, src: int, tag: int = 0) -> "Request":
        """Start receiving the next array from rank ``src`` with ``tag``."""
        self._peer(src, tag, "irecv from")
        return self._irecv(tuple(int(s) for s in shape), np.dtype(dtype), src, tag)

    def _isend(self, arr, dst, tag) -> "Request":
        raise RuntimeFault(f"{type(self).__name__} has no nonblocking send")

    def _irecv(self, shape, dtype, src, tag) -> "Request":
        raise RuntimeFault(f"{type(self).__name__} has no nonblocking receive")

    def wait_sends(self) -> None:
        """Block (up to the timeout) until this rank's pending sends are delivered."""

    @abstractmethod
    def barrier(self) -> None: ...

    @abstractmethod
    def _all_gather(self, arr, group, axis): ...

    @abstractmethod
    def _all_reduce(self, arr, group, op): ...

    def _all_reduce_inplace(self, arr, group, op):
        """All-reduce that may reuse ``arr`` (a C-contiguous array the caller gave up)
        for its result; implementations with an in-place collective override it."""
        return self._all_reduce(arr, group, op)

    @abstractmethod
    def _reduce_scatter(self, arr, group, axis): ...

    @abstractmethod
    def _all_to_all(self, arr, group, split_axis, concat_axis): ...

    @abstractmethod
    def _send(self, arr, dst, tag): ...

    @abstractmethod
    def _recv(self, shape, dtype, src, tag): ...


class Request:
    """A started nonblocking send or receive: ``test()`` is True once it is done (then a
    receive's array is ``value``); ``cancel()`` gives up a receive that is not done.
    ``what`` says what it is, for error messages."""

    def __init__(self, what: str = ""):
        self.what = what
        self.value = None
        self.done = False

    def test(self) -> bool:
        return self.done

    def cancel(self) -> None:
        """Give up the request if it is not done."""


# ---- simulated: N threads, one rendezvous world ---------------------------------------

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

    def _wait(self, ready, rank: int, timeout: float, what, fix: str = "") -> None:
        """Wait on the world condition (held by the caller) until ``ready()``; ``fix``
        ends the timeout message (default: the p2p advice)."""
        deadline = time.monotonic() + timeout
        while not ready():
            if self._failed is not None and self._failed[0] != rank:
                failed, exc = self._failed
                raise RuntimeFault(f"rank {rank}: stopped waiting for {what()}: rank {failed} "
                                   f"failed with {type(exc).__name__}: {exc}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeFault(f"rank {rank}: timed out after {timeout:g} s waiting for "
                                   f"{what()}; " + (fix or "a peer did not make the matching "
                                                    "call (check that every rank runs the "
                                                    "same plan)"))
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
            w._wait(lambda: len(slot["data"]) == len(group), self.rank, self.timeout,
                    lambda: f"{kind} #{seq} on group {group} (missing ranks "
                            f"{sorted(set(group) - set(slot['data']))})",
                    f"{self.phase} is collective: call it on every rank" if self.phase else
                    "this call is collective: call it on every rank of the group (check "
                    "that every rank runs the same plan)")
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

    def _send(self, arr, dst, tag):
        w = self._world
        with w._cond:
            w._mail[(self.rank, dst, tag)].append(arr)
            w._cond.notify_all()

    def _recv(self, shape, dtype, src, tag):
        w = self._world
        box = (src, self.rank, tag)
        with w._cond:
            w._wait(lambda: bool(w._mail[box]), self.rank, self.timeout,
                    lambda: f"a message from rank {src} with tag {tag} ({shape} {dtype})")
            arr = w._mail[box].popleft()
        if arr.shape != shape or arr.dtype != dtype:
            raise RuntimeFault(f"rank {self.rank}: expected {shape} {dtype} from rank {src} "
                               f"(tag {tag}) but received {arr.shape} {arr.dtype}")
        return arr

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
    """A receive from the world's mailbox; ``test`` raises RuntimeFault once another
    rank of the world has failed (as a real job would be ended)."""

    def __init__(self, comm, shape, dtype, src, tag):
        super().__init__(f"a message from rank {src} with tag {tag} ({shape} {dtype})")
        self._comm, self._shape, self._dtype = comm, shape, dtype
        self._box = (src, comm.rank, tag)

    def test(self) -> bool:
        if self.done:
            return True
        w, rank = self._comm._world, self._comm.rank
        with w._cond:
            if w._failed is not None and w._failed[0] != rank:
                failed, exc = w._failed
                raise RuntimeFault(f"rank {rank}: stopped waiting for {self.what}: rank "
                                   f"{failed} failed with {type(exc).__name__}: {exc}")
            if not w._mail[self._box]:
                return False
            arr = w._mail[self._box].popleft()
        if arr.shape != self._shape or arr.dtype != self._dtype:
            raise RuntimeFault(f"rank {rank}: expected {self._shape} {self._dtype} from rank "
                               f"{self._box[0]} (tag {self._box[2]}) but received "
                               f"{arr.shape} {arr.dtype}")
        self.value, self.done = arr, True
        return True


def __getattr__(name):
    # MPICommunicator lives in its own module so that importing this one never
    # initialises MPI.
    if name == "MPICommunicator":
        from distgraph.runtime.mpi_comm import MPICommunicator
        return MPICommunicator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
