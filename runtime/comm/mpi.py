"""MPICommunicator: the Communicator interface over mpi4py.

Buffer-based (uppercase) nonblocking calls on contiguous numpy arrays, completed by
polling against a deadline, so that a peer that never arrives turns into a RuntimeFault
(and, under the launcher's bootstrap, an aborted job) instead of a hang.

Groups run on sub-communicators created on first use with ``Comm.Create_group``, which
is collective over the group's members only, and cached per communicator instance.
Before creating one, the members exchange a small handshake under the timeout, so a
member that never asks for the group is reported rather than waited for.

Under the launcher a waiting rank keeps its progress record up to date (what it waits
for, see :mod:`distgraph.runtime.launch.progress`); it gives up early when a peer has finished
its script, and on a timeout it names the peers that did not reach the call and where
they are.

Example (under ``mpiexec -n 4``)::

    comm = MPICommunicator()
    x = np.full(2, float(comm.rank))
    comm.all_gather(x, group=(0, 2) if comm.rank % 2 == 0 else (1, 3))
"""

from __future__ import annotations

import os
import time
import zlib

import numpy as np

from distgraph.dtypes import numpy_dtype
from distgraph.errors import RuntimeFault
from distgraph.runtime.comm.base import MAX_TAG, Communicator, Request
from distgraph.runtime.launch.bootstrap import install_abort_hook
from distgraph.runtime.launch.progress import Progress, behind, read_where
from distgraph.runtime.launch.status import status_folder

BF16 = numpy_dtype("bfloat16")
_HANDSHAKE_TAG = MAX_TAG + 1
_CREATE_TAG = MAX_TAG + 2
SPIN_SECONDS = 0.1   # how long a wait polls without sleeping (see MPICommunicator._wait)
PEER_CHECK_SECONDS = 1.0   # how often a long wait looks at its peers' progress


class MPICommunicator(Communicator):
    """A Communicator over an mpi4py communicator (default ``MPI.COMM_WORLD``).
    ``poll_spin_seconds``: how long a poller of nonblocking requests (the pipeline's
    actors) polls back to back before it sleeps, as :meth:`_wait` does."""

    poll_spin_seconds = SPIN_SECONDS

    def __init__(self, comm=None, timeout: float | None = None, backend=None):
        from mpi4py import MPI


        self._MPI = MPI
        self._comm = MPI.COMM_WORLD if comm is None else comm
        super().__init__(self._comm.Get_rank(), self._comm.Get_size(), timeout, backend)
        install_abort_hook()     # one failing rank must end the job, however it was started
        # Progress records are per world rank: a sub-communicator's ranks are not.
        world = MPI.Comm.Compare(self._comm, MPI.COMM_WORLD) in (MPI.IDENT, MPI.CONGRUENT)
        self._status = status_folder() if world else None
        self.progress = Progress.open(self._status, self.rank)
        self._subcomms: dict = {}
        self._pending: list = []
        # the NCCL communicators of the GPU plans run over this one
        # (runtime/comm/nccl.py), made by the first that needs them
        self.nccl_path = None
        self._ops = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}

    # ---- waiting with a deadline -----------------------------------------------------
    def _wait(self, requests, what: str, receives=(), peers=None,
              collective: bool = True) -> None:
        """Poll ``requests`` until done; on timeout cancel ``receives`` (so MPI never
        writes into a buffer given up on) and raise RuntimeFault naming ``peers`` (the
        ranks this call waits on; default all) that did not reach it.

        A nonblocking collective or large message moves only while its ranks call into
        MPI, so for the first ``SPIN_SECONDS`` the loop polls back to back, yielding the
        core between polls, as MPI's own blocking calls spin. Sleeping there stalls
        every transfer behind the sleeper. Only a longer wait (a slow peer, an idle
        pipeline stage) backs off with sleeps of up to 1 ms, so that it does not hold a
        core. The spin stays with more ranks than cores too: the yield hands the core
        to a waiting peer at once, where a short sleep makes it wait out the nap (tutorial
        02 on 4 ranks and 2 cores trained slower with sleeps of up to 0.2 ms there)."""
        self.progress.wait_begin(what)
        self._poll(requests, what, receives, peers, collective)
        self.progress.wait_end()     # a wait given up on stays on record until the end

    def _poll(self, requests, what, receives, peers, collective) -> None:
        start = time.monotonic()
        deadline = start + self.timeout
        check = start + PEER_CHECK_SECONDS
        finished: set = set()
        delay = 0.0
        while True:
            try:
                done = self._MPI.Request.Testall(requests)
            except self._MPI.Exception as exc:
                raise RuntimeFault(f"rank {self.rank}: MPI error while waiting for {what}: "
                                   f"{exc}") from None
            if done:
                return
            now = time.monotonic()
            if now > deadline:
                self._cancel(receives)
                raise RuntimeFault(self._gave_up(f"timed out after {self.timeout:g} s "
                                                 f"waiting for {what}", peers, collective),
                                   timed_out=True)
            if now - start < SPIN_SECONDS:
                os.sched_yield()
                continue
            if self._status and now > check:
                check = now + PEER_CHECK_SECONDS
                finished = self._finished_peers(peers, finished, what, receives, collective)
            time.sleep(delay)
            delay = min(delay * 2 or 1e-5, 1e-3)

    def _cancel(self, receives) -> None:
        for req in receives:
            if req != self._MPI.REQUEST_NULL:
                req.Cancel()
                req.Wait()

    def _finished_peers(self, peers, seen: set, what, receives, collective) -> set:
        """Peers that have finished their script; one seen so at two checks in a row
        (a message it sent before finishing has had a second to arrive) will never make
        the call: give up now instead of at the timeout."""
        ranks = range(self.size) if peers is None else peers
        now = {r for r in ranks if r != self.rank
               and read_where(self._status, r).state == "finished"}
        if now & seen:
            self._cancel(receives)
            raise RuntimeFault(self._gave_up(f"waiting for {what}", peers, collective))
        return now

    def finished_peers(self, peers, seen: set, what: str) -> set:
        if not self._status:
            return set()
        return self._finished_peers(peers, seen, what, (), collective=False)

    def _gave_up(self, waited: str, peers, collective: bool) -> str:
        """The message of a wait given up on: what it waited for, who did not come and
        where they are, and the fix."""
        ranks = range(self.size) if peers is None else peers
        lagging, states = behind(self._status, self.rank, ranks)
        where = f"; {lagging}" if lagging else ""
        ended = [w for w in (read_where(self._status, r) for r in ranks if r != self.rank)
                 if w.state in ("finished", "ended")] if self._status else []
        if self.phase and ended and all(w.phase == self.phase for w in ended):
            fix = (f"{'they' if len(ended) > 1 else 'it'} ended inside {self.phase}, which "
                   "every rank must run to its end: a rank whose script ends (sys.exit, "
                   "os._exit) while its peers still need it ends the job")
        elif self.phase:
            fix = f"{self.phase} is collective: call it on every rank"
            if states & {"computing", "not started"}:
                fix += (f" (if every rank does, the ranks named are stuck or slower than the "
                        f"timeout, {self.timeout:g} s; DISTGRAPH_COMM_TIMEOUT sets it)")
        elif ended:
            fix = ("a rank whose script ends while its peers still run collectives ends the "
                   "job: every rank must make the same collective calls before its script "
                   "ends")
        elif "computing" in states:
            fix = (f"it is stuck there or slower than the timeout ({self.timeout:g} s; "
                   "DISTGRAPH_COMM_TIMEOUT sets it)")
        elif collective:
            fix = ("this call is collective: call it on every rank of the group (check "
                   "that every rank runs the same plan)")
        else:
            fix = ("a peer did not make the matching call (check that every rank runs the "
                   "same plan)")
        return f"rank {self.rank}: {waited}{where}; {fix}"

    # ---- sub-communicators -------------------------------------------------------------
    def _sub(self, group: tuple[int, ...]):
        if group == tuple(range(self.size)):
            return self._comm
        sub = self._subcomms.get(group)
        if sub is None:
            self._handshake(group)
            world_group = self._comm.Get_group()
            mpi_group = world_group.Incl(list(group))
            sub = self._comm.Create_group(mpi_group, tag=_CREATE_TAG)
            mpi_group.Free()
            world_group.Free()
            self._subcomms[group] = sub
        return sub

    def _handshake(self, group) -> None:
        token = np.array([len(group), zlib.crc32(repr(group).encode())], dtype=np.int64)
        peers = [r for r in group if r != self.rank]
        inbox = {r: np.empty(2, dtype=np.int64) for r in peers}
        sends = [self._comm.Isend(token, dest=r, tag=_HANDSHAKE_TAG) for r in peers]
        recvs = [self._comm.Irecv(inbox[r], source=r, tag=_HANDSHAKE_TAG) for r in peers]
        self._wait(recvs, f"the members of group {group} to set it up (some rank never "
                          f"called a collective on this group)", receives=recvs, peers=group)
        self._wait(sends, f"the members of group {group} to take the set-up message",
                   peers=group)
        for r, got in inbox.items():
            if not np.array_equal(got, token):
                raise RuntimeFault(f"rank {self.rank}: set up group {group} while rank {r} "
                                   f"set up a different group; the ranks run collectives "
                                   f"in different orders")

    # ---- collectives --------------------------------------------------------------------
    def _all_gather(self, arr, group, axis):
        xb = self.backend
        out = xb.empty((len(group),) + arr.shape, arr.dtype)
        self._wait([self._sub(group).Iallgather(_wire(arr), _wire(out))],
                   f"all_gather on group {group}", peers=group)
        return xb.joined(out, axis)

    def _all_reduce(self, arr, group, op):
        if arr.dtype == BF16:
            return self._all_reduce(arr.astype(np.float32), group, op).astype(BF16)
        out = self.backend.empty(arr.shape, arr.dtype)
        self._wait([self._sub(group).Iallreduce(arr, out, op=self._ops[op])],
                   f"all_reduce on group {group}", peers=group)
        return out

    def _all_reduce_inplace(self, arr, group, op):
        if arr.dtype == BF16:
            arr[...] = self._all_reduce(arr, group, op)
            return arr
        self._wait([self._sub(group).Iallreduce(self._MPI.IN_PLACE, arr, op=self._ops[op])],
                   f"all_reduce on group {group}", peers=group)
        return arr

    def _reduce_scatter(self, arr, group, axis):
        if arr.dtype == BF16:
            return self._reduce_scatter(arr.astype(np.float32), group, axis).astype(BF16)
        xb = self.backend
        send = xb.chunks(arr, len(group), axis)
        out = xb.empty(send.shape[1:], arr.dtype)
        self._wait([self._sub(group).Ireduce_scatter_block(send, out, op=self._MPI.SUM)],
                   f"reduce_scatter on group {group}", peers=group)
        return out

    def _all_to_all(self, arr, group, split_axis, concat_axis):
        xb = self.backend
        send = xb.stack(xb.split(arr, len(group), split_axis))
        out = xb.empty(send.shape, send.dtype)
        self._wait([self._sub(group).Ialltoall(_wire(send), _wire(out))],
                   f"all_to_all on group {group}", peers=group)
        return xb.concatenate(list(out), axis=concat_axis)

    def _all_to_allv(self, arr, send_counts, recv_counts, group):
        xb = self.backend
        row = 1
        for n in arr.shape[1:]:
            row *= n
        out = xb.empty((sum(recv_counts),) + arr.shape[1:], arr.dtype)

        def layout(counts):
            sizes = [c * row for c in counts]
            return sizes, [sum(sizes[:j]) for j in range(len(sizes))]

        send, recv = _wire(arr), _wire(out)
        self._wait([self._sub(group).Ialltoallv((send, layout(send_counts)),
                                                (recv, layout(recv_counts)))],
                   f"all_to_allv on group {group}", peers=group)
        return out

    def _iall_gather(self, arr, group, axis):
        xb = self.backend
        out = xb.empty((len(group),) + arr.shape, arr.dtype)
        request = self._sub(group).Iallgather(_wire(arr), _wire(out))
        return _MPICollective(self, request, (arr, out), group, f"all_gather on group {group}",
                              lambda: xb.joined(out, axis))

    def _iall_reduce(self, arr, group, op, inplace):
        if arr.dtype == BF16:        # summed in float32, as the blocking kind is
            request = self._iall_reduce(arr.astype(np.float32), group, op, True)
            finish = request._finish

            def rounded():
                out = finish().astype(BF16)
                if inplace:
                    arr[...] = out
                    return arr
                return out
            request._finish = rounded
            return request
        what = f"all_reduce on group {group}"
        if inplace:
            request = self._sub(group).Iallreduce(self._MPI.IN_PLACE, arr, op=self._ops[op])
            return _MPICollective(self, request, (arr,), group, what, lambda: arr)
        out = self.backend.empty(arr.shape, arr.dtype)
        request = self._sub(group).Iallreduce(arr, out, op=self._ops[op])
        return _MPICollective(self, request, (arr, out), group, what, lambda: out)

    def _ireduce_scatter(self, arr, group, axis):
        if arr.dtype == BF16:
            request = self._ireduce_scatter(arr.astype(np.float32), group, axis)
            finish = request._finish
            request._finish = lambda: finish().astype(BF16)
            return request
        xb = self.backend
        send = xb.chunks(arr, len(group), axis)
        out = xb.empty(send.shape[1:], arr.dtype)
        request = self._sub(group).Ireduce_scatter_block(send, out, op=self._MPI.SUM)
        return _MPICollective(self, request, (send, out), group,
                              f"reduce_scatter on group {group}", lambda: out)

    def wait(self, requests) -> list:
        requests = list(requests)
        pending = [r for r in requests if not r.done]
        if pending:
            mpi = [r._request for r in pending if isinstance(r, (_MPICollective, _MPIRequest))]
            receives = [r._request for r in pending
                        if isinstance(r, _MPIRequest) and r._receive]
            peers = sorted({p for r in pending for p in getattr(r, "group", ())})
            self._wait(mpi, "; ".join(r.what for r in pending), receives=receives,
                       peers=peers or None,
                       collective=any(isinstance(r, _MPICollective) for r in pending))
        return [r.value if r.test() else None for r in requests]

    def barrier(self) -> None:
        self.wait_sends()
        self._wait([self._comm.Ibarrier()], "a barrier of all ranks")

    # ---- point to point -----------------------------------------------------------------
    def _send(self, arr, dst, tag):
        self._pending = [p for p in self._pending if not p[0].Test()]
        self._pending.append((self._comm.Isend(_wire(arr), dest=dst, tag=tag), arr, dst, tag))

    def wait_sends(self) -> None:
        if self._pending:
            targets = sorted({(p[2], p[3]) for p in self._pending})
            self._wait([p[0] for p in self._pending],
                       f"rank(s)/tag(s) {targets} to receive this rank's sends",
                       peers=sorted({t[0] for t in targets}), collective=False)
            self._pending = []

    def _recv(self, shape, dtype, src, tag):
        out = self.backend.empty(shape, dtype)
        req = self._comm.Irecv(_wire(out), source=src, tag=tag)
        self._wait([req], f"a message from rank {src} with tag {tag} ({shape} {dtype})",
                   receives=[req], peers=(src,), collective=False)
        return out

    def _isend(self, arr, dst, tag):
        return _MPIRequest(self, self._comm.Isend(_wire(arr), dest=dst, tag=tag), arr,
                           f"a message to rank {dst} with tag {tag}", peer=dst)

    def _irecv(self, shape, dtype, src, tag):
        out = self.backend.empty(shape, dtype)
        return _MPIRequest(self, self._comm.Irecv(_wire(out), source=src, tag=tag), out,
                           f"a message from rank {src} with tag {tag} ({shape} {dtype})",
                           receive=True, peer=src)

    def free(self) -> None:
        """Wait for pending sends and free the cached sub-communicators."""
        self.wait_sends()
        for sub in self._subcomms.values():
            sub.Free()
        self._subcomms = {}


def _wire(arr):
    """What MPI sends of ``arr``: bfloat16, which MPI does not know, as its 16-bit words
    (a view). Reductions of bfloat16 are summed in float32 instead (above)."""
    return arr.view(np.uint16) if arr.dtype == BF16 else arr


def _mpi_test(comm, request, what) -> bool:
    """``request.Test()``, an MPI error raised as this rank's RuntimeFault naming ``what``."""
    try:
        return request.Test()
    except comm._MPI.Exception as exc:
        raise RuntimeFault(f"rank {comm.rank}: MPI error on {what}: {exc}") from None


class _MPIRequest(Request):
    """An MPI request and the buffer it reads or fills (kept alive until it is done);
    ``group``: the peer, for :meth:`MPICommunicator.wait`'s messages."""

    def __init__(self, comm, request, buffer, what, receive=False, peer=None):
        super().__init__(what)
        self._comm, self._request, self._buffer, self._receive = comm, request, buffer, receive
        self.group = () if peer is None else (peer,)

    def test(self) -> bool:
        if self.done:
            return True
        done = _mpi_test(self._comm, self._request, self.what)
        if done:
            self.done = True
            self.value = self._buffer if self._receive else None
            self._buffer = None if not self._receive else self._buffer
        return done

    def cancel(self) -> None:
        if not self.done and self._receive:
            self._request.Cancel()
            self._request.Wait()


class _MPICollective(Request):
    """A started MPI collective and its buffers (kept alive until it is done);
    ``finish()`` makes the result from them."""

    def __init__(self, comm, request, buffers, group, what, finish):
        super().__init__(what)
        self._comm, self._request, self._buffers = comm, request, buffers
        self.group, self._finish = group, finish

    def test(self) -> bool:
        if self.done:
            return True
        done = _mpi_test(self._comm, self._request, self.what)
        if done:
            self.value, self.done = self._finish(), True
            self._buffers = self._finish = None
        return done
