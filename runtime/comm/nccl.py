"""NCCL collectives and messages between a plan's GPUs (CuPy's ``cupy.cuda.nccl``).

:class:`NcclPath` offers the ``_``-prefixed calls of
:class:`~distgraph.runtime.comm.base.Communicator` on CuPy arrays for the groups that
:class:`~distgraph.runtime.comm.device.DeviceCommunicator` routes to NCCL. It needs the
rank's :class:`~distgraph.runtime.comm.mpi.MPICommunicator` (``host``) to set groups up
and to carry the small headers of point-to-point messages.

**Communicators.** One NCCL communicator per group of ranks a plan's collectives use
(in the group's order: NCCL rank i is the group's i-th rank) and one per ordered pair
(sender, receiver) of its point-to-point transfers, made by :meth:`open` when a plan's
runner is made, in one order on every rank (so no two ranks wait for each other's
set-up), and kept for the next plans: a rank has one NcclPath per host communicator
(``host.nccl_path``), whatever the number of plans, so the headers of its messages have
one reader. The group's
first rank makes NCCL's unique id and sends it to the others over MPI, under the
communication timeout. A pair is warmed up with a one-byte message when it is made, so
that NCCL connects it then, in that same order, and not inside a step.

**Streams.** Each NCCL communicator has its own CUDA stream. A call records an event on
the compute stream (the current one) and makes the communicator's stream wait for it,
so NCCL reads what compute wrote; when the call's completion event has fired, the compute
stream waits for that event before it uses the result.

**Completion and failures.** A blocking collective waits on the host for its completion
event; nonblocking collectives and messages are :class:`Request` s whose ``test()``
queries it. Every wait polls ``ncclCommGetAsyncError`` (``check_async_error``): an
error, or a wait past the communication timeout, aborts this rank's NCCL communicators
(``ncclCommAbort``, so no kernel is left spinning) and raises RuntimeFault naming the
rank, the call and the peers that did not reach it; the rank then fails and the launcher
ends the job.

**Messages.** NCCL matches a pair's messages by order, not by tag. The sender orders
them: it queues each message on its pair's stream as it sends it, and sends the
receiver a header (tag, dtype, shape) over MPI on one tag, so the headers arrive in the
same order. The receiver, whenever it polls, takes the headers that arrived, queues a
receive of each into a new buffer (in header order, hence the sender's) and gives the
buffer to the receive request MPI would match it with: the first one posted for that
source and tag and not matched yet (or the next one posted). A sender never waits for its receiver on
the host, and the two directions of a pair are separate communicators, so two stages
sending to each other do not block each other.

Example (inside a rank of a GPU job; DeviceCommunicator does this)::

    path = NcclPath(MPICommunicator(), CupyBackend(0))
    path.open("collective", (0, 1))
    total = path._all_reduce(cupy.ones(4), (0, 1), "sum")
"""

from __future__ import annotations

import os
import time
import zlib
from collections import deque

import numpy as np

from distgraph.errors import RuntimeFault
from distgraph.resources.gpus import NoGPU
from distgraph.runtime.comm.base import MAX_TAG, Request

_ID_TAG = MAX_TAG + 3          # a group's unique id (MPI tags above MAX_TAG are internal)
_HEADER_TAG = MAX_TAG + 4      # headers of point-to-point messages
MAX_NDIM = 8
DTYPES = ("float16", "float32", "float64", "int8", "uint8", "int32", "int64", "uint32",
          "uint64", "bool")
SPIN_SECONDS = 0.05


class NcclPath:
    """This rank's NCCL communicators and the calls over them (module docstring)."""

    def __init__(self, host, backend):
        from cupy.cuda import nccl

        if not getattr(nccl, "available", False):
            raise NoGPU(f"rank {host.rank}: NCCL cannot be loaded (CuPy finds no libnccl); "
                        "pip install nvidia-nccl-cu12 (nvidia-nccl-cu13 for CUDA 13)")
        if not hasattr(host, "_comm"):
            raise RuntimeFault(f"NCCL groups are set up over MPI; {type(host).__name__} is "
                               "not an MPICommunicator")
        self.host, self.xb, self.nc = host, backend, nccl
        self.cupy = backend.xp
        self.rank, self.timeout = host.rank, host.timeout
        self.comms: dict = {}             # (kind, ranks) -> _Comm
        self.sends: list = []             # sends started by _send, not known done
        self._arrived: dict = {}          # (source, tag) -> messages no receive took yet
        self._posted: dict = {}           # (source, tag) -> receives no message matched yet
        self._types = {np.dtype(k): getattr(nccl, v) for k, v in (
            ("float16", "NCCL_FLOAT16"), ("float32", "NCCL_FLOAT32"),
            ("float64", "NCCL_FLOAT64"), ("int8", "NCCL_INT8"), ("uint8", "NCCL_UINT8"),
            ("int32", "NCCL_INT32"), ("int64", "NCCL_INT64"), ("uint32", "NCCL_UINT32"),
            ("uint64", "NCCL_UINT64"), ("bool", "NCCL_UINT8"))}
        self._ops = {"sum": nccl.NCCL_SUM, "max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN}

    # ---- communicators -----------------------------------------------------------------
    def open(self, kind: str, ranks: tuple) -> "_Comm":
        """The NCCL communicator of ``ranks`` ("collective" group or "p2p" pair), made
        now if it is not yet (a collective call of the group's ranks)."""
        key = (kind, tuple(ranks))
        if key not in self.comms:
            self.comms[key] = self._make(kind, tuple(ranks))
        return self.comms[key]

    def has_pair(self, src: int, dst: int) -> bool:
        return ("p2p", (src, dst)) in self.comms

    def _make(self, kind: str, ranks: tuple) -> "_Comm":
        uid = self._unique_id(kind, ranks)
        try:
            comm = self.nc.NcclCommunicator(len(ranks), uid, ranks.index(self.rank))
        except self.nc.NcclError as e:
            raise RuntimeFault(f"rank {self.rank}: cannot make the NCCL communicator of "
                               f"ranks {ranks}: {e}") from None
        made = _Comm(comm, self.cupy.cuda.Stream(non_blocking=True), ranks, kind)
        if kind == "p2p":
            self._warm_up(made)
        return made

    def _unique_id(self, kind: str, ranks: tuple):
        """NCCL's unique id of the group, made by its first rank and sent to the others
        (with a checksum of the group, so ranks setting up different groups fail)."""
        check = np.frombuffer(np.int64(zlib.crc32(repr((kind, ranks)).encode())).tobytes(),
                              np.uint8)
        mpi, what = self.host._comm, f"the NCCL id of ranks {ranks} from rank {ranks[0]}"
        if self.rank == ranks[0]:
            uid = self.nc.get_unique_id()
            raw = uid if isinstance(uid, bytes) else bytes(b & 0xFF for b in uid)
            payload = np.concatenate([check, np.frombuffer(raw, np.uint8)])
            sends = [mpi.Isend(payload, dest=r, tag=_ID_TAG) for r in ranks[1:]]
            self.host._wait(sends, f"ranks {ranks[1:]} to take {what}", peers=ranks)
            return uid
        payload = np.empty(8 + 128, np.uint8)
        req = mpi.Irecv(payload, source=ranks[0], tag=_ID_TAG)
        self.host._wait([req], what, receives=[req], peers=ranks)
        if not np.array_equal(payload[:8], check):
            raise RuntimeFault(f"rank {self.rank}: set up NCCL for ranks {ranks} while rank "
                               f"{ranks[0]} set up another group; the ranks make their "
                               "groups in different orders (do they run the same plan?)")
        raw = payload[8:].tobytes()
        # CuPy 14 takes the id as bytes; earlier versions as a tuple of signed chars
        if int(self.cupy.__version__.split(".")[0]) >= 14:
            return raw
        return tuple(np.frombuffer(raw, np.int8).tolist())

    def _warm_up(self, c: "_Comm") -> None:
        byte = self.xb.zeros((1,), "uint8")
        sender = c.ranks[0] == self.rank
        done = self._launch(c, "warm-up", lambda s: (
            c.comm.send if sender else c.comm.recv)(byte.data.ptr, 1, self.nc.NCCL_UINT8,
                                                    1 if sender else 0, s))
        self._wait_events([(c, done)], f"the first message between ranks {c.ranks}", c.ranks)

    # ---- launching and waiting -----------------------------------------------------------
    def _launch(self, c: "_Comm", what: str, call):
        """Queue ``call(stream pointer)`` on ``c``'s stream after the compute stream's
        work so far; its completion event."""
        ready = self.cupy.cuda.Event(disable_timing=True)
        ready.record()
        c.stream.wait_event(ready)
        try:
            call(c.stream.ptr)
        except self.nc.NcclError as e:
            self.abort()
            raise RuntimeFault(f"rank {self.rank}: NCCL {what} on ranks {c.ranks} failed: "
                               f"{e}") from None
        done = self.cupy.cuda.Event(disable_timing=True)
        done.record(c.stream)
        return done

    def _fired(self, c: "_Comm", event, what: str) -> bool:
        """Whether ``event`` fired; RuntimeFault (NCCL aborted) on an asynchronous error."""
        if event.done:
            return True
        try:
            c.comm.check_async_error()
        except self.nc.NcclError as e:
            self.abort()
            raise RuntimeFault(f"rank {self.rank}: NCCL reported an error during {what} on "
                               f"ranks {c.ranks}: {e}") from None
        return False

    def _wait_events(self, items, what: str, peers) -> None:
        """Wait on the host until every (communicator, event) of ``items`` fired, taking
        the headers of incoming messages meanwhile; past the timeout abort NCCL and
        raise RuntimeFault naming the peers that did not come."""
        start = time.monotonic()
        delay = 0.0
        while not all([self._fired(c, e, what) for c, e in items]):
            self._take_headers()
            now = time.monotonic()
            if now - start > self.timeout:
                self.abort()
                raise RuntimeFault(self.host._gave_up(
                    f"timed out after {self.timeout:g} s waiting for NCCL {what} "
                    f"(NCCL communicators aborted)", peers, True), timed_out=True)
            if now - start < SPIN_SECONDS:
                os.sched_yield()
            else:
                time.sleep(delay)
                delay = min(delay * 2 or 1e-5, 1e-3)
        compute = self.cupy.cuda.get_current_stream()
        for _, event in items:
            compute.wait_event(event)

    def abort(self) -> None:
        """End every NCCL communicator of this rank at once (kernels stop waiting)."""
        for c in self.comms.values():
            c.comm.abort()
        self.comms = {}

    def close(self) -> None:
        self.wait_sends()
        for c in self.comms.values():
            c.comm.destroy()
        self.comms = {}

    # ---- collectives ---------------------------------------------------------------------
    def _type(self, arr):
        try:
            return self._types[arr.dtype]
        except KeyError:
            raise RuntimeFault(f"rank {self.rank}: NCCL carries no {arr.dtype} arrays; "
                               f"use one of {', '.join(DTYPES)}") from None

    def _collective(self, group, what, call) -> None:
        """Run ``call(c)(stream)`` on the group's communicator ``c`` and wait for it (the
        caller holds the buffers until then)."""
        c = self.open("collective", tuple(group))
        what = f"{what} on ranks {tuple(group)}"
        done = self._launch(c, what, call(c))
        self._wait_events([(c, done)], what, group)

    def _all_gather(self, arr, group, axis):
        out = self.xb.empty((len(group),) + arr.shape, arr.dtype)
        t = self._type(arr)
        self._collective(group, "all_gather", lambda c: lambda s: c.comm.allGather(
            arr.data.ptr, out.data.ptr, arr.size, t, s))
        return self.xb.joined(out, axis)

    def _all_reduce(self, arr, group, op):
        out = self.xb.empty(arr.shape, arr.dtype)
        return self._all_reduce_into(arr, out, group, op)

    def _all_reduce_inplace(self, arr, group, op):
        return self._all_reduce_into(arr, arr, group, op)

    def _all_reduce_into(self, arr, out, group, op):
        t = self._type(arr)
        self._collective(group, "all_reduce", lambda c: lambda s: c.comm.allReduce(
            arr.data.ptr, out.data.ptr, arr.size, t, self._ops[op], s))
        return out

    def _reduce_scatter(self, arr, group, axis):
        send = self.xb.chunks(arr, len(group), axis)
        out = self.xb.empty(send.shape[1:], arr.dtype)
        t = self._type(arr)
        self._collective(group, "reduce_scatter", lambda c: lambda s: c.comm.reduceScatter(
            send.data.ptr, out.data.ptr, out.size, t, self.nc.NCCL_SUM, s))
        return out

    def _all_to_all(self, arr, group, split_axis, concat_axis):
        xb, n = self.xb, len(group)
        send = xb.stack(xb.split(arr, n, split_axis))
        out = xb.empty(send.shape, send.dtype)
        me = group.index(self.rank)
        out[me] = send[me]
        t, count = self._type(arr), send[0].size

        def exchange(c):
            def call(s):
                self.nc.groupStart()
                try:
                    for j in range(n):
                        if j != me:
                            c.comm.send(send[j].data.ptr, count, t, j, s)
                            c.comm.recv(out[j].data.ptr, count, t, j, s)
                finally:
                    self.nc.groupEnd()
            return call

        self._collective(group, "all_to_all", exchange)
        return xb.concatenate(list(out), axis=concat_axis)

    def _all_to_allv(self, arr, send_counts, recv_counts, group):
        raise NotImplementedError(
            f"rank {self.rank}: NCCL's all_to_allv (variable counts) is not implemented; "
            f"give moe_ffn a capacity (fixed-size buffers, an all_to_all) or run on MPI")

    def _iall_gather(self, arr, group, axis):
        c = self.open("collective", tuple(group))
        out = self.xb.empty((len(group),) + arr.shape, arr.dtype)
        t, what = self._type(arr), f"all_gather on ranks {tuple(group)}"
        done = self._launch(c, what, lambda s: c.comm.allGather(arr.data.ptr, out.data.ptr,
                                                                 arr.size, t, s))
        return _Started(self, c, done, what, lambda: self.xb.joined(out, axis),
                        (arr, out))

    def _ireduce_scatter(self, arr, group, axis):
        c = self.open("collective", tuple(group))
        send = self.xb.chunks(arr, len(group), axis)
        out = self.xb.empty(send.shape[1:], arr.dtype)
        t, what = self._type(arr), f"reduce_scatter on ranks {tuple(group)}"
        done = self._launch(c, what, lambda s: c.comm.reduceScatter(
            send.data.ptr, out.data.ptr, out.size, t, self.nc.NCCL_SUM, s))
        return _Started(self, c, done, what, lambda: out, (send, out))

    # ---- messages --------------------------------------------------------------------------
    def _isend(self, arr, dst, tag):
        c = self.comms[("p2p", (self.rank, dst))]
        if arr.ndim > MAX_NDIM or str(arr.dtype) not in DTYPES:
            raise RuntimeFault(f"rank {self.rank}: a message of {arr.ndim} dims of "
                               f"{arr.dtype}: NCCL messages carry up to {MAX_NDIM} dims of "
                               f"{', '.join(DTYPES)}")
        header = np.zeros(3 + MAX_NDIM, np.int64)
        header[:3] = (tag, DTYPES.index(str(arr.dtype)), arr.ndim)
        header[3:3 + arr.ndim] = arr.shape
        t, what = self._type(arr), f"a message to rank {dst} with tag {tag}"
        done = self._launch(c, what, lambda s: c.comm.send(arr.data.ptr, arr.size, t, 1, s))
        sent = self.host._comm.Isend(header, dest=dst, tag=_HEADER_TAG)
        return _Started(self, c, done, what, lambda: None, (arr, header), sent)

    def _send(self, arr, dst, tag):
        self.sends = [r for r in self.sends if not r.test()]
        self.sends.append(self._isend(arr, dst, tag))

    def wait_sends(self) -> None:
        pending = [r for r in self.sends if not r.test()]
        if pending:
            peers = sorted({r.comm.ranks[1] for r in pending})
            self._wait_requests(pending, f"rank(s) {peers} to receive this rank's messages",
                                peers)
        self.sends = []

    def _irecv(self, shape, dtype, src, tag):
        """A receive, matched as MPI matches: to the first message from ``src`` with
        ``tag`` not taken by a receive posted before it."""
        req = _Incoming(self, src, tag, tuple(shape), np.dtype(dtype))
        self._take_from(src)
        unexpected = self._arrived.get((src, tag))
        if unexpected:
            req.match(unexpected.popleft())
        else:
            self._posted.setdefault((src, tag), deque()).append(req)
        return req

    def _recv(self, shape, dtype, src, tag):
        req = self._irecv(shape, dtype, src, tag)
        self._wait_requests([req], req.what, (src,))
        return req.value

    def _wait_requests(self, requests, what, peers) -> None:
        start = time.monotonic()
        while not all([r.test() for r in requests]):
            if time.monotonic() - start > self.timeout:
                self.abort()
                raise RuntimeFault(self.host._gave_up(
                    f"timed out after {self.timeout:g} s waiting for {what} over NCCL "
                    f"(NCCL communicators aborted)", peers, False), timed_out=True)
            time.sleep(1e-4)

    def _take_headers(self) -> None:
        for src, dst in [k[1] for k in self.comms if k[0] == "p2p"]:
            if dst == self.rank:
                self._take_from(src)

    def _take_from(self, src: int) -> None:
        """Queue a receive for every header from ``src`` that arrived, in their order
        (probed, not posted for: no receive is left pending when the job ends)."""
        c = self.comms[("p2p", (src, self.rank))]
        mpi = self.host._comm
        while mpi.Iprobe(source=src, tag=_HEADER_TAG):
            header = np.empty(3 + MAX_NDIM, np.int64)
            mpi.Recv(header, source=src, tag=_HEADER_TAG)
            tag, code, ndim = (int(v) for v in header[:3])
            out = self.xb.empty(tuple(int(v) for v in header[3:3 + ndim]), DTYPES[code])
            t, what = self._type(out), f"a message from rank {src} with tag {tag}"
            done = self._launch(c, what, lambda s, out=out, t=t: c.comm.recv(
                out.data.ptr, out.size, t, 0, s))
            waiting = self._posted.get((src, tag))
            if waiting:
                waiting.popleft().match((out, done, c))
            else:
                self._arrived.setdefault((src, tag), deque()).append((out, done, c))


class _Comm:
    """One NCCL communicator: its stream and its ranks (in NCCL's order)."""

    def __init__(self, comm, stream, ranks, kind):
        self.comm, self.stream, self.ranks, self.kind = comm, stream, ranks, kind


class _Started(Request):
    """A queued NCCL call: done when its completion event fired (the compute stream then
    waits for it); ``finish()`` makes the value; ``keep`` holds its buffers until then."""

    def __init__(self, path, comm, event, what, finish, keep, host_request=None):
        super().__init__(what)
        self.path, self.comm, self.event = path, comm, event
        self.finish, self.keep, self.host_request = finish, keep, host_request
        self.group = comm.ranks

    def test(self) -> bool:
        if self.done:
            return True
        self.path._take_headers()
        if self.host_request is not None and not self.host_request.Test():
            return False
        if not self.path._fired(self.comm, self.event, self.what):
            return False
        self.path.cupy.cuda.get_current_stream().wait_event(self.event)
        self.value, self.done = self.finish(), True
        self.keep = self.finish = None
        return True


class _Incoming(Request):
    """A receive: given the message (buffer, completion event, communicator) that MPI's
    rules match it with (:meth:`NcclPath._irecv`), done once NCCL filled the buffer."""

    def __init__(self, path, src, tag, shape, dtype):
        super().__init__(f"a message from rank {src} with tag {tag} ({shape} {dtype})")
        self.path, self.src, self.tag, self.shape, self.dtype = path, src, tag, shape, dtype
        self.matched = None

    def match(self, message) -> None:
        out = message[0]
        if tuple(out.shape) != self.shape or out.dtype != self.dtype:
            raise RuntimeFault(f"rank {self.path.rank}: expected {self.what}, rank "
                               f"{self.src} sent {tuple(out.shape)} {out.dtype} with that tag")
        self.matched = message

    def test(self) -> bool:
        if self.done:
            return True
        path = self.path
        if self.matched is None:
            path._take_from(self.src)
            if self.matched is None:
                return False
        out, event, comm = self.matched
        if not path._fired(comm, event, self.what):
            return False
        path.cupy.cuda.get_current_stream().wait_event(event)
        self.value, self.done = out, True
        return True

    def cancel(self) -> None:
        waiting = self.path._posted.get((self.src, self.tag))
        if self.matched is None and waiting and self in waiting:
            waiting.remove(self)
