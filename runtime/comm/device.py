"""The communicator of a rank whose arrays live on a GPU: each group goes its own way.

A :class:`DeviceCommunicator` takes device arrays (its ``backend``'s, CuPy) and sends each
call the way the plan's :class:`~distgraph.plan.devices.DeviceAssignment` routes the
group (:meth:`~distgraph.plan.devices.DeviceAssignment.route`):

- ``NCCL`` between distinct GPUs: :class:`~distgraph.runtime.comm.nccl.NcclPath`, one
  NCCL communicator per group, made when the runner :meth:`prepare` s the plan's groups;
- ``MPI (host staging)`` where two ranks of the group share a GPU (NCCL refuses two ranks
  on one device): :class:`HostStaging` copies the array to the host, runs the call on the
  host communicator (MPI) and copies the result back to the device.

A point-to-point pair NCCL would carry but that the plan did not prepare (the plan lists
every group of its steps and gathers: ``ProcessProgram.comm_groups``) goes through host
staging too: NCCL pairs are made up front, in one order on every rank,
so that no two ranks wait for each other's set-up.

Calls that are host matters (``collective_call``, ``barrier``, the launcher's progress
records, finished peers) go to the host communicator. Bytes are counted here, once, as
every communicator counts them (the host's own counters are not touched).

Example (inside a rank of a GPU plan; :class:`~distgraph.runtime.execution.runner.PlanRunner`
makes it)::

    comm = DeviceCommunicator(MPICommunicator(), plan.devices, backend)
    comm.prepare(plan.program_of(pid).comm_groups)
"""

from __future__ import annotations

from distgraph.errors import RuntimeFault
from distgraph.plan.devices import NCCL
from distgraph.runtime.comm.base import Communicator, Request


class HostStaging:
    """Collectives and messages of device arrays through a host communicator: the
    arrays go to the host, the host communicator runs the call, results come back to the
    device. Offers the ``_``-prefixed methods of :class:`Communicator`."""

    def __init__(self, host: Communicator, backend):
        self.host, self.xb = host, backend

    def _h(self, arr):
        return self.xb.to_host(arr)

    def _d(self, arr):
        return None if arr is None else self.xb.from_host(arr)

    def _all_gather(self, arr, group, axis):
        return self._d(self.host._all_gather(self._h(arr), group, axis))

    def _all_reduce(self, arr, group, op):
        return self._d(self.host._all_reduce(self._h(arr), group, op))

    def _all_reduce_inplace(self, arr, group, op):
        # the host copy is this call's own (on the numpy backend: the array handed over)
        return self._d(self.host._all_reduce_inplace(self._h(arr), group, op))

    def _reduce_scatter(self, arr, group, axis):
        return self._d(self.host._reduce_scatter(self._h(arr), group, axis))

    def _all_to_all(self, arr, group, split_axis, concat_axis):
        return self._d(self.host._all_to_all(self._h(arr), group, split_axis, concat_axis))

    def _all_to_allv(self, arr, send_counts, recv_counts, group):
        return self._d(self.host._all_to_allv(self._h(arr), send_counts, recv_counts, group))

    def _iall_gather(self, arr, group, axis):
        return _Staged(self.host._iall_gather(self._h(arr), group, axis), self.xb)

    def _ireduce_scatter(self, arr, group, axis):
        return _Staged(self.host._ireduce_scatter(self._h(arr), group, axis), self.xb)

    def _send(self, arr, dst, tag):
        self.host._send(self._h(arr), dst, tag)

    def _recv(self, shape, dtype, src, tag):
        return self._d(self.host._recv(shape, dtype, src, tag))

    def _isend(self, arr, dst, tag):
        return self.host._isend(self._h(arr), dst, tag)

    def _irecv(self, shape, dtype, src, tag):
        return _Staged(self.host._irecv(shape, dtype, src, tag), self.xb)

    def wait_sends(self) -> None:
        self.host.wait_sends()


class _Staged(Request):
    """A host request whose value comes back to the device once it is done."""

    def __init__(self, inner: Request, backend):
        super().__init__(inner.what)
        self.inner, self.xb = inner, backend
        self.group = getattr(inner, "group", ())

    def test(self) -> bool:
        if not self.done and self.inner.test():
            value = self.inner.value
            self.value = None if value is None else self.xb.from_host(value)
            self.done = True
        return self.done

    def cancel(self) -> None:
        self.inner.cancel()


class DeviceCommunicator(Communicator):
    """Device arrays over NCCL or host-staged MPI, group by group (module docstring).
    ``host``: the rank's host communicator (an MPICommunicator for NCCL; any
    Communicator for host staging alone); ``devices``: the plan's DeviceAssignment;
    ``backend``: the array backend the rank computes with."""

    def __init__(self, host: Communicator, devices, backend):
        super().__init__(host.rank, host.size, host.timeout, backend)
        self.host, self.devices = host, devices
        self.progress = host.progress
        self.poll_spin_seconds = host.poll_spin_seconds
        self.staged = HostStaging(host, backend)
        self._nccl = None

    # ---- set-up ---------------------------------------------------------------------------
    def prepare(self, groups) -> None:
        """Make the NCCL communicator of every group (CommGroups, in their key order)
        that NCCL carries; every rank of a group calls it with the group in one order."""
        for g in groups:
            if self.devices.route(g.ranks) == NCCL:
                self.nccl.open(g.kind, g.ranks)

    @property
    def nccl(self):
        """The NCCL path of the host communicator, made by the first plan that needs it
        and shared by the next (it needs CuPy's NCCL and MPI)."""
        if self._nccl is None:
            path = getattr(self.host, "nccl_path", None)
            if path is None:
                from distgraph.runtime.comm.nccl import NcclPath   # only GPU jobs load NCCL
                path = self.host.nccl_path = NcclPath(self.host, self.backend)
            self._nccl = path
        return self._nccl

    def _path(self, ranks):
        if self.devices.route(ranks) != NCCL:
            return self.staged
        return self.nccl

    def _p2p(self, src: int, dst: int):
        if self.devices.route((src, dst)) != NCCL or not self.nccl.has_pair(src, dst):
            return self.staged
        return self.nccl

    # ---- host matters -------------------------------------------------------------------
    def collective_call(self, name: str, detail: str = ""):
        return self.host.collective_call(name, detail)

    def finished_peers(self, peers, seen: set, what: str) -> set:
        return self.host.finished_peers(peers, seen, what)

    def barrier(self) -> None:
        self.wait_sends()
        self.host.barrier()

    def wait_sends(self) -> None:
        if self._nccl is not None:
            self._nccl.wait_sends()
        self.staged.wait_sends()

    def close(self) -> None:
        """Free the NCCL communicators of the host communicator (after the job's last
        call on any plan)."""
        if self._nccl is not None:
            self._nccl.close()
            self.host.nccl_path = self._nccl = None

    # ---- routed calls ---------------------------------------------------------------------
    def _all_gather(self, arr, group, axis):
        return self._path(group)._all_gather(arr, group, axis)

    def _all_reduce(self, arr, group, op):
        return self._path(group)._all_reduce(arr, group, op)

    def _all_reduce_inplace(self, arr, group, op):
        return self._path(group)._all_reduce_inplace(arr, group, op)

    def _reduce_scatter(self, arr, group, axis):
        return self._path(group)._reduce_scatter(arr, group, axis)

    def _all_to_all(self, arr, group, split_axis, concat_axis):
        return self._path(group)._all_to_all(arr, group, split_axis, concat_axis)

    def _all_to_allv(self, arr, send_counts, recv_counts, group):
        return self._path(group)._all_to_allv(arr, send_counts, recv_counts, group)

    def _iall_gather(self, arr, group, axis):
        return self._path(group)._iall_gather(arr, group, axis)

    def _ireduce_scatter(self, arr, group, axis):
        return self._path(group)._ireduce_scatter(arr, group, axis)

    def _send(self, arr, dst, tag):
        self._p2p(self.rank, dst)._send(arr, dst, tag)

    def _recv(self, shape, dtype, src, tag):
        return self._p2p(src, self.rank)._recv(shape, dtype, src, tag)

    def _isend(self, arr, dst, tag):
        return self._p2p(self.rank, dst)._isend(arr, dst, tag)

    def _irecv(self, shape, dtype, src, tag):
        return self._p2p(src, self.rank)._irecv(shape, dtype, src, tag)

    def wait(self, requests) -> list:
        try:
            return super().wait(requests)
        except RuntimeFault:
            if self._nccl is not None:      # a collective that never completes: end NCCL
                self._nccl.abort()
            raise
