"""Communicators over logical ranks: the interface and its byte counters.

A :class:`Communicator` offers the collectives reshard and training need on *groups*
(tuples of ranks; a rank's position in the tuple is its coordinate), plus p2p
send/recv. Every call adds to ``bytes_sent[kind]`` the bytes this rank sends under the
ring model of the plan contract (:func:`distgraph.plan.kinds.collective_bytes`), computed
from the buffers actually passed, so tests can compare a plan's bytes with what ran.

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
- ``all_to_allv(arr, send_counts, recv_counts, group)``: all_to_all with variable counts
  (MPI's ``Alltoallv``) along axis 0: member i sends rows ``send_counts[:j].sum() ..``
  (``send_counts[j]`` of them) to member j; each member concatenates what it receives in
  group order, ``recv_counts[j]`` rows from member j (the counts are exchanged first,
  e.g. by an ``all_to_all`` of them). Rows are the array's trailing shape.
- ``send(arr, dst, tag)`` never blocks (the array is copied); ``wait_sends()`` waits
  until this rank's sends are delivered. ``recv(shape, dtype, src, tag)`` returns the
  next message from ``src`` with that tag.
- ``isend(arr, dst, tag)`` and ``irecv(shape, dtype, src, tag)`` start a send or a
  receive and return a :class:`Request` at once; ``request.test()`` says whether it is
  done (a receive's array is then ``request.value``). The caller must not change a sent
  array until its request is done. They never wait, so whoever polls them (the pipeline
  actors) owns the timeout.
- ``iall_gather(arr, group, axis)``, ``iall_reduce(arr, group, op, inplace)`` and
  ``ireduce_scatter(arr, group, axis)`` start the collective and return a
  :class:`Request` at once (MPI's ``Iallgather`` / ``Iallreduce`` /
  ``Ireduce_scatter``; a communicator without a nonblocking form runs the blocking one
  and returns a request that is done): its ``value`` is what the blocking call returns, once
  ``test()`` is True. As with ``isend``, the caller must not change ``arr`` until the
  request is done (the collective may read it in place). Every member starts the same collectives on a group in the same
  order; several may be in flight at once, on one group or on several, while the caller
  computes (calling ``test()`` now and then lets MPI move them). ``wait(requests)``
  blocks until all are done (under the timeout) and returns their values. They count
  their bytes when started, as the blocking kinds they are.

Nothing waits forever: a receive or collective that waits longer than ``timeout``
seconds (default 60, or the env var ``DISTGRAPH_COMM_TIMEOUT``) raises RuntimeFault
naming the rank and what it waited for.

API calls that are collective (``Engine.fit``, ``Engine.state_dict``, ...) run inside
``collective_call(name, detail)``: the ranks first compare the name of the call they are
in, so ranks calling different ones fail at once, and a rank waiting for peers that never
call says "NAME is collective: call it on every rank"; and the call's ``detail`` (the
arguments every rank must give alike: ``fit``'s batch size, epochs, dataset length), so
ranks that would run different plans or step counts fail at once, naming each one's.

:class:`~distgraph.runtime.comm.simulated.SimulatedWorld` runs N ranks as threads of one
process; :class:`~distgraph.runtime.comm.mpi.MPICommunicator` runs them over mpi4py.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from contextlib import contextmanager

import numpy as np

from distgraph.errors import RuntimeFault
from distgraph.plan.kinds import COLLECTIVES, StepKind, collective_bytes
# user tags are [0, MAX_TAG), the plan's one tag scheme; MPI's upper ones are internal
from distgraph.plan.tags import MAX_TAG
from distgraph.runtime.backend import NUMPY
from distgraph.runtime.launch.progress import NO_PROGRESS
# the timeout is the launcher's too (it bounds the wait in MPI's start): defined there
from distgraph.runtime.launch.status import DEFAULT_TIMEOUT, default_timeout  # noqa: F401

COUNTED_KINDS = COLLECTIVES + (StepKind.SEND_RECV,)
REDUCE_OPS = {"sum": np.add, "max": np.maximum, "min": np.minimum}
CALL_NAME_BYTES = 64
CALL_DETAIL_BYTES = 192
DETAIL_SEP = "\x1f"     # between the arguments of a call's detail


def _padded(text: str, size: int) -> bytes:
    return text.encode()[:size].ljust(size, b"\0")


def _item(items: list, i: int) -> str:
    return items[i] if i < len(items) else "(none)"


def _text(row) -> str:
    return bytes(row).rstrip(b"\0").decode(errors="replace")


class Communicator(ABC):
    """Collectives and p2p over logical ranks, with per-kind counters of bytes sent.

    Subclasses implement the ``_``-prefixed methods; the public ones validate, handle
    one-member groups locally and count bytes. ``backend`` (an
    :class:`~distgraph.runtime.backend.ArrayBackend`, numpy by default) makes every array
    a communicator allocates, copies or cuts. ``progress`` is where this rank records
    what it runs and waits for (see :mod:`distgraph.runtime.launch.progress`); ``phase`` names
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
    def collective_call(self, name: str, detail: str = ""):
        """Run the block as the collective call ``name`` of every rank: the ranks first
        check that all of them are in the same call, with the same ``detail`` (the
        arguments that must agree; "" agrees with any; uncounted: it is no step traffic);
        nested calls are checked once."""
        if self.phase or self.size == 1:
            yield
            return
        mine = np.frombuffer(_padded(name, CALL_NAME_BYTES) + _padded(detail, CALL_DETAIL_BYTES),
                             dtype=np.uint8)
        width = CALL_NAME_BYTES + CALL_DETAIL_BYTES
        self.phase = name
        try:
            with self.progress.phase(name):
                rows = self._all_gather(mine, tuple(range(self.size)), 0).reshape(self.size,
                                                                                   width)
                names = [_text(row[:CALL_NAME_BYTES]) for row in rows]
                others = {r: n for r, n in enumerate(names) if n != names[self.rank]}
                if others:
                    raise RuntimeFault(f"rank {self.rank}: {name} is collective: call it on "
                                       f"every rank; here "
                                       + ", ".join(f"rank {r} called {n}"
                                                   for r, n in sorted(others.items())))
                # ranks that give no detail (a bare collective_call) are not compared
                details = {r: _text(row[CALL_NAME_BYTES:]).split(DETAIL_SEP)
                           for r, row in enumerate(rows) if row[CALL_NAME_BYTES:].any()}
                differ = [i for i in range(max(map(len, details.values()), default=0))
                          if len({_item(d, i) for d in details.values()}) > 1]
                if differ:
                    raise RuntimeFault(f"rank {self.rank}: every rank must call {name} with "
                                       f"the same arguments (each does its share of the "
                                       f"same work); here "
                                       + "; ".join(", ".join(f"rank {r} {_item(d, i)}"
                                                             for r, d in details.items())
                                                   for i in differ))
                yield
        finally:
            self.phase = ""

    def broadcast_bytes(self, data: bytes | None, root: int = 0,
                        timeout: float | None = None) -> bytes:
        """``data``, given on rank ``root`` (the others give None), on every rank; a
        collective of every rank, uncounted (it is no step traffic): its length, then its
        bytes, each an all-reduce of the root's numpy array with the others' zeros.
        ``timeout``: how long the others may wait for the root (at least the
        communicator's)."""
        if self.size == 1:
            return data
        everyone = tuple(range(self.size))
        mine = np.frombuffer(data if self.rank == root else b"", dtype=np.uint8)
        before, self.timeout = self.timeout, max(self.timeout, timeout or 0.0)
        try:
            n = self._all_reduce(np.array([mine.size], dtype=np.int64), everyone, "sum")
            buffer = np.zeros(int(self.backend.to_host(n)[0]), dtype=np.uint8)
            buffer[:mine.size] = mine
            return self.backend.to_host(self._all_reduce(buffer, everyone, "sum")).tobytes()
        finally:
            self.timeout = before

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
        inplace = inplace and self.backend.writeable(arr)
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

    def all_to_allv(self, arr, send_counts, recv_counts, group):
        arr = self._c(arr)
        group = self._group(group, "all_to_allv")
        send = [int(c) for c in send_counts]
        recv = [int(c) for c in recv_counts]
        if len(send) != len(group) or len(recv) != len(group) or sum(send) != len(arr) \
                or min(send + recv, default=0) < 0:
            raise RuntimeFault(f"rank {self.rank}: all_to_allv on group {group}: {len(arr)} "
                               f"rows sent as counts {send}, received as {recv}; give one "
                               f"non-negative count per member, the sent ones summing to "
                               f"the rows")
        me = group.index(self.rank)
        row = arr.nbytes // max(len(arr), 1)
        self.calls["all_to_all"] += 1       # the bytes this rank sends to the others
        self.bytes_sent["all_to_all"] += float((sum(send) - send[me]) * row)
        if len(group) == 1:
            return arr.copy()
        return self._all_to_allv(arr, tuple(send), tuple(recv), group)

    def send(self, arr, dst: int, tag: int = 0) -> None:
        """Send a copy of ``arr`` to rank ``dst`` without blocking."""
        self._peer(dst, tag, "send to")
        arr = self.backend.copy(arr)
        self._count(StepKind.SEND_RECV, 2, arr.nbytes)
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
            self._count(StepKind.SEND_RECV, 2, arr.nbytes)
        return self._isend(arr, dst, tag)

    def irecv(self, shape, dtype, src: int, tag: int = 0) -> "Request":
        """Start receiving the next array from rank ``src`` with ``tag``."""
        self._peer(src, tag, "irecv from")
        return self._irecv(tuple(int(s) for s in shape), np.dtype(dtype), src, tag)

    def iall_gather(self, arr, group, axis: int = 0) -> "Request":
        """Start an all-gather (the module docstring); ``arr`` must stay unchanged until
        the request is done."""
        arr = self._c(arr)
        group = self._group(group, "iall_gather")
        axis = axis + arr.ndim if axis < 0 else axis
        self._count("all_gather", len(group), arr.nbytes * len(group))
        if len(group) == 1:
            return Request.completed(arr.copy(), f"all_gather on group {group}")
        return self._iall_gather(arr, group, axis)

    def iall_reduce(self, arr, group, op: str = "sum", inplace: bool = False) -> "Request":
        """Start an all-reduce (the module docstring); with ``inplace`` the caller hands
        ``arr`` over and the result may be written into it. ``arr`` must stay unchanged
        until the request is done."""
        arr = self._c(arr)
        group = self._group(group, "iall_reduce")
        if op not in REDUCE_OPS:
            raise RuntimeFault(f"rank {self.rank}: iall_reduce op {op!r}; use one of "
                               f"{sorted(REDUCE_OPS)}")
        self._count("all_reduce", len(group), arr.nbytes)
        inplace = inplace and self.backend.writeable(arr)
        if len(group) == 1:
            return Request.completed(arr if inplace else arr.copy(),
                                     f"all_reduce on group {group}")
        return self._iall_reduce(arr, group, op, inplace)

    def ireduce_scatter(self, arr, group, axis: int = 0) -> "Request":
        """Start a reduce-scatter (sum; the module docstring); ``arr`` must stay unchanged
        until the request is done."""
        arr = self._c(arr)
        group = self._group(group, "ireduce_scatter")
        axis = self._split_axis(arr, axis, len(group), "ireduce_scatter")
        self._count("reduce_scatter", len(group), arr.nbytes)
        if len(group) == 1:
            return Request.completed(arr.copy(), f"reduce_scatter on group {group}")
        return self._ireduce_scatter(arr, group, axis)

    def wait(self, requests) -> list:
        """Block until every request is done; their values, in order. RuntimeFault
        after the timeout, naming what was not done."""
        requests = list(requests)
        start = time.monotonic()
        delay = 0.0
        while not all([r.test() for r in requests]):
            if time.monotonic() - start > self.timeout:
                late = "; ".join(r.what for r in requests if not r.done)
                raise RuntimeFault(f"rank {self.rank}: timed out after {self.timeout:g} s "
                                   f"waiting for {late}; this call is collective: call it "
                                   "on every rank of the group (check that every rank runs "
                                   "the same plan)", timed_out=True)
            time.sleep(delay)
            delay = min(delay * 2 or 1e-5, 1e-3)
        return [r.value for r in requests]

    def _iall_gather(self, arr, group, axis) -> "Request":
        raise RuntimeFault(f"{type(self).__name__} has no nonblocking all_gather")

    def _ireduce_scatter(self, arr, group, axis) -> "Request":
        raise RuntimeFault(f"{type(self).__name__} has no nonblocking reduce_scatter")

    def _iall_reduce(self, arr, group, op, inplace) -> "Request":
        """The blocking all-reduce, as a request that is done (a communicator with a
        nonblocking one overrides this)."""
        out = (self._all_reduce_inplace(arr, group, op) if inplace
               else self._all_reduce(arr, group, op))
        return Request.completed(out, f"all_reduce on group {group}")

    def _isend(self, arr, dst, tag) -> "Request":
        raise RuntimeFault(f"{type(self).__name__} has no nonblocking send")

    def _irecv(self, shape, dtype, src, tag) -> "Request":
        raise RuntimeFault(f"{type(self).__name__} has no nonblocking receive")

    def wait_sends(self) -> None:
        """Block (up to the timeout) until this rank's pending sends are delivered."""

    def finished_peers(self, peers, seen: set, what: str) -> set:
        """For a rank that polls its own requests (the carrier) while it waits for
        ``peers`` (ranks): those that have finished their script. One found finished at
        this check and at the last (``seen``) will never send: a RuntimeFault saying
        ``what`` was awaited and where the peers are. Without the launcher's status
        records nothing is known (an empty set)."""
        return set()

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

    def _all_to_allv(self, arr, send_counts, recv_counts, group):
        raise RuntimeFault(f"rank {self.rank}: {type(self).__name__} has no all_to_allv "
                           f"(variable counts); run on MPI or the simulated world")

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

    @classmethod
    def completed(cls, value, what: str = "") -> "Request":
        """A request that is done from the start, with ``value``."""
        req = cls(what)
        req.value, req.done = value, True
        return req

    def test(self) -> bool:
        return self.done

    def ready(self) -> bool:
        """Whether it is done, for a communicator's ``wait`` (by default ``test()``)."""
        return self.test()

    def cancel(self) -> None:
        """Give up the request if it is not done."""
