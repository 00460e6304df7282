"""Run training steps of any plan on this process: the one runtime.

:class:`PlanRunner` binds a :class:`~distgraph.plan.plan.Plan` to a communicator and an
array backend. It reads the plan contract and nothing else: its process's compiled
program (:class:`~distgraph.plan.program.ProcessProgram`: tasks, schedule, tags, feed
rows, communicator groups, gathers), made whole by the planner. It lays out the initial
state, cuts each batch into the plan's micro-batches (one without ``micro_batches``) and
this process's block of each (or takes a feed that holds only that block, read so by the
Engine's data loader), and runs the step with a
:class:`~distgraph.runtime.execution.carrier.Carrier`. The fetched values are global and
the same on every process, as host (numpy) arrays: a loss summed over the micro-batches,
per-sample outputs concatenated. The array backend (numpy, or CuPy on a GPU) and the
communicator are the two seams a device plugs into: a plan whose devices are GPUs runs on
CuPy on the GPU its rank's device names, its groups over NCCL or host-staged MPI.
Every step counts the bytes of the arrays the process holds (:mod:`.memory`):
:attr:`PlanRunner.memory` lists each step's peak and where it was reached, and
:meth:`PlanRunner.check_memory` compares it with the plan's estimate.
:func:`relayout` moves held values from one plan's layout to another's by the reshard
points the planner made for the move.

Example (inside a rank)::

    p = dg.passes.plan(built, dg.Strategy(micro_batches=4, schedule="1F1B"))
    runner = PlanRunner(p, comm)
    scope = runner.shard_scope(global_arrays)
    out = runner.run(scope, feed=global_batch, step=0)      # {"loss": global loss}
    runner.last_memory.peak                                 # bytes held at the step's peak
"""

from __future__ import annotations

import socket
import sys
import time
import zlib

import numpy as np

from distgraph.errors import DistGraphError, PlanError
from distgraph.plan.devices import NUMPY
from distgraph.registry import KernelContext
from distgraph.runtime.backend import backend_for, backend_of
from distgraph.runtime.comm.device import DeviceCommunicator
from distgraph.runtime.execution.carrier import Carrier
from distgraph.runtime.execution.executor import call_kernel
from distgraph.runtime.execution.memory import CHECK_MARGIN, check_peak, predicted_peak
from distgraph.runtime.execution.reshard import apply_reshard, run_point
from distgraph.runtime.execution.timeline import Timeline


def check_world(plan, world_size: int) -> None:
    """Fail fast, saying how to launch, when the job has the wrong number of ranks."""
    ids = list(plan.process_ids)
    if len(ids) != world_size:
        # the path as the user gave it, so that the hint runs from where they are
        script = sys.argv[0] if sys.argv and sys.argv[0].endswith(".py") else "SCRIPT.py"
        raise PlanError(f"this plan needs {len(ids)} processes (process ids {ids}) but the job "
                        f"has {world_size}; launch it with `distgraph run -n {len(ids)} "
                        f"{script}` (or `mpiexec -n {len(ids)} python {script}`)")
    if plan.rank_of is None and ids != list(range(world_size)):
        raise PlanError(f"the plan's meshes number their processes {ids}, but process p runs "
                        f"on rank p, and this job's ranks are 0..{world_size - 1}: number "
                        f"the ProcessMesh processes 0..{world_size - 1}, or map each process "
                        f"onto a device with Engine(..., rank_mapping={{process: device "
                        f"id}})")


class PlanRunner:
    """This process's part of ``plan`` (``comm`` None: a plan of one process), its arrays
    made by ``backend``: by default the plan's (:func:`backend_for`: CuPy on the rank's GPU
    when the plan's devices are GPUs, else the communicator's, numpy). On a GPU plan the
    runner talks through a :class:`DeviceCommunicator` over ``comm`` (NCCL, or MPI with
    host staging where ranks share a GPU) whose groups it makes here, once; ``host_comm``
    stays ``comm``, for what is the host's (the clock, the timeline)."""

    def __init__(self, plan, comm=None, backend=None):
        if comm is not None:
            check_world(plan, comm.size)
            self.pid = plan.ranks.process(comm.rank)
        elif plan.world_size != 1:
            check_world(plan, 1)
        else:
            self.pid = plan.process_ids[0]
        self.plan, self.program = plan, plan.program_of(self.pid)
        self.local = self.program.local
        devices = plan.devices
        on_gpu = devices is not None and devices.backend != NUMPY
        self.backend = backend or (backend_for(devices, comm.rank if comm else 0)
                                   if on_gpu else backend_of(comm))
        self.host_comm = comm
        if comm is not None and on_gpu:
            comm = DeviceCommunicator(comm, devices, self.backend)
            comm.prepare(self.program.comm_groups)
        self.comm = comm
        self.fetch = list(self.program.fetch)
        self.profile = plan.strategy.profile
        self._t0 = None
        self.carrier = Carrier(self.program, plan.ranks, comm, self.backend, self.profile,
                               clock=self._clock)
        self._checked = False

    @property
    def memory(self) -> list:
        """The :class:`~distgraph.runtime.execution.memory.StepMemory` of the steps this
        runner ran (the last 256), in order: this process's peak bytes, where it was
        reached, the bytes held when the step began and once it ended."""
        return list(self.carrier.steps)

    @property
    def last_memory(self):
        """The last step's :class:`~distgraph.runtime.execution.memory.StepMemory` (None
        before the first)."""
        return self.carrier.steps[-1] if self.carrier.steps else None

    def check_memory(self) -> tuple | None:
        """Under ``Strategy(memory_check=True)``, what to say once about the last step's
        measured peak: ``(line, about this rank alone)``, or None (nothing to say, or
        said already). The line names the rank, where the peak was reached, the measured
        and the plan's predicted bytes (``plan.estimate``) when the measured peak exceeds
        the prediction by more than 10 %; a plan without an estimate says that it has none,
        once."""
        if self._checked or not self.plan.strategy.memory_check or not self.carrier.steps:
            return None
        predicted = predicted_peak(self.plan, self.pid)
        if predicted is None:
            self._checked = True
            return ("Strategy(memory_check=True) compares each rank's measured peak with "
                    "the plan's estimate, but this plan has none: give the Engine a cluster "
                    "(dg.Cluster.local(n) prices this machine) or plan with "
                    "auto_mode='full'", False)
        rank = self.host_comm.rank if self.host_comm is not None else 0
        who = f"rank {rank}" + (f" (process {self.pid})" if self.pid != rank else "")
        said = check_peak(self.last_memory, predicted, who, CHECK_MARGIN)
        if said is None:
            return None
        self._checked = True
        return said, True

    def _clock(self) -> float:
        return time.perf_counter() - (self._t0 or 0.0)

    # -- state ------------------------------------------------------------------------------
    def lay_out(self, names, block_of) -> dict:
        """This process's blocks of the plan's persistables ``names`` (in that order; those
        it holds), on the runner's array backend, C-contiguous in each Value's dtype:
        {name: array}. ``block_of(value, index)`` gives the block of Value ``value`` at
        ``index`` (this process's slices of the global value) as a host array, and whether
        that array is the block's own (taken without a copy where its dtype and order
        are right). The one way state is laid out: the Engine's held state
        (``HeldState.bind``) gives its blocks from where each value is held, and
        :meth:`shard_scope` from global arrays. A value stored padded (ZeRO's,
        ``Value.padded_from``) is asked for the part of its block inside its logical
        shape, and the rest of the block is zeros."""
        values = self.plan.program.values
        out = {}
        for name in names:
            v = values[name]
            if self.pid not in v.dist_attr.mesh:
                continue
            index = v.dist_attr.local_slices(v.shape, self.pid)
            if v.padded_from is None:
                block, own = block_of(v, index)
                block = np.array(block, dtype=v.dtype, order="C", copy=None if own else True)
            else:
                block = padded_block(v, index, block_of)
            out[name] = self.backend.from_host(block)
        return out

    def shard_scope(self, global_values: dict) -> dict:
        """This process's blocks of every persistable of the plan, cut from their global
        arrays ``global_values`` ({name: array}) and laid out by :meth:`lay_out`."""

        def block_of(v, index):
            if v.name not in global_values:
                raise PlanError(f"no initial value for {v.name}")
            if v.dist_attr.spec.partial:
                raise PlanError(f"cannot shard {v.name}: a stored or fed value cannot be "
                                "Partial")
            return np.asarray(global_values[v.name])[index], False

        return self.lay_out([v.name for v in self.local.program.persistables], block_of)

    def gather(self, scope: dict, names) -> dict:
        """Global values of persistables ``names`` on every process, as host (numpy)
        arrays (a collective: every rank passes the same names). Between steps no message
        is in flight, so the gathers' tags count from 0."""
        out = {}
        points = self.program.state_gathers
        values = self.plan.program.values
        for i, name in enumerate(names):
            point = points[name]
            local = scope[point.value] if point.reads else None
            whole = self.backend.to_host(apply_reshard(
                point.steps, local, self.comm, self.pid, self.plan.ranks, i))
            logical = values[point.value].padded_from
            if logical is not None:         # ZeRO's padding cut off
                whole = np.ascontiguousarray(whole[tuple(slice(0, n) for n in logical)])
            out[point.value] = whole
        return out

    # -- feeding ---------------------------------------------------------------------------------
    def _micro_feeds(self, feed: dict, local: bool) -> list:
        """One feed per micro-batch this process runs: its rows of each input it reads
        (:attr:`ProcessProgram.feeds <distgraph.plan.program.ProcessProgram.feeds>`). From
        global batches they are cut here; a ``local`` feed holds them already (the rows
        of every micro-batch one after the other, and only this process's slices of the
        other dims), so each micro-batch is the next run of rows, a view."""
        runs = self.program.micro_batches
        feeds = [dict() for _ in range(runs)]
        for f in self.program.feeds:
            name, ranges, rest = f.name, f.rows, f.rest
            if name not in feed:
                raise DistGraphError(f"input {name!r} was not fed; feed it by name")
            batch = np.asarray(feed[name])
            at = 0
            for m in range(runs):
                if ranges is None:
                    feeds[m][name] = self.backend.from_host(batch)
                    continue
                start, stop = ranges[m]
                cut = (slice(at, at + stop - start),) if local else (slice(start, stop),) + rest
                at += stop - start
                feeds[m][name] = self.backend.from_host(batch[cut])
        return feeds

    # -- running ----------------------------------------------------------------------------------
    def run(self, scope: dict, feed: dict, step: int = 0, local: bool = False) -> dict:
        """One step; returns the global fetched values. ``feed`` holds global batches, or
        with ``local`` only what this process reads of each (see :meth:`_micro_feeds`)."""
        if self.profile and self._t0 is None:
            self._t0 = self._start_clock()
        feeds = self._micro_feeds(feed, local)
        if self.program.prologue_ops or self.program.prologue is not None:
            self._run_prologue(feeds, step)
        fetched = self.carrier.run(scope, feeds, step)
        return {name: self.backend.to_host(value) for name, value in fetched.items()}

    def _run_prologue(self, feeds: list, step: int) -> None:
        """The accumulation's prologue: its ops on every micro-batch, its sums added up
        over the micro-batches and given to every micro-batch as the whole batch's (under
        an uneven split, reduced over the data-parallel groups first: the plan's
        ``prologue`` task)."""
        wanted = self.program.prologue_sums
        ctx = KernelContext(self.backend.xp, step)
        totals: dict = {}
        for micro in feeds:
            env = dict(micro)
            for op in self.program.prologue_ops:
                outs = call_kernel(op, ctx, [env[n] for n in op.ins])
                env.update(zip(op.outs, outs))
            for name in wanted & env.keys():
                totals[name] = env[name] + totals[name] if name in totals else env[name]
        block = self.program.prologue
        for instr in block.instrs if block is not None else ():
            self.carrier.runner.point(instr, totals, {}, 0)
        for micro in feeds:
            micro.update(totals)

    def _start_clock(self) -> float:
        """The time every rank's records count from: the end of one barrier. Ranks on one
        machine share its monotonic clock, so they take one start (exact alignment);
        another machine's ranks start at their own end of the barrier."""
        comm = self.host_comm
        if comm is None or comm.size == 1:
            return time.perf_counter()
        self.comm.barrier()
        host = float(zlib.crc32(socket.gethostname().encode()))
        mine = np.array([[host, time.perf_counter()]])
        everyone = comm.all_gather(mine, tuple(range(comm.size)), axis=0)
        return float(everyone[everyone[:, 0] == host, 1].min())

    def timeline(self) -> Timeline:
        """The timeline of every step run so far, merged over all ranks (a collective:
        call it on every rank)."""
        if not self.profile:
            raise DistGraphError("no timeline was recorded: use Strategy(profile=True)")
        return Timeline.gather(self.carrier.events, self.carrier.memory, self.host_comm)


def relayout(points, blocks: dict, comm, rank: int) -> dict:
    """Move values between the layouts of two plans: run the reshard points ``points``
    (over ranks: :func:`distgraph.passes.relayout.plan_relayout` makes them) on this rank's
    host blocks ``blocks`` ({value: block}, read where a point ``reads`` one) with the host
    communicator ``comm`` (None: a job of one rank). Returns {value: its new host block,
    or None where this rank holds none}. Collective: every rank runs the same points.
    Between steps no message is in flight, so the points' tags count from 0."""
    out = {}
    for tag, point in enumerate(points):
        local = blocks[point.value] if point.reads else None
        out[point.value] = run_point(point, local, comm, rank, None, tag)
    return out


def padded_block(v, index, block_of):
    """The block at ``index`` of Value ``v`` stored padded (``v.padded_from``): its part
    inside the logical shape from ``block_of`` (as :meth:`PlanRunner.lay_out` takes it),
    zeros past it, as a new C-contiguous host array."""
    inside = tuple(slice(min(s.start, n), min(s.stop, n)) for s, n in zip(index, v.padded_from))
    out = np.zeros(tuple(s.stop - s.start for s in index), dtype=v.dtype)
    if all(s.stop > s.start for s in inside):
        block, _ = block_of(v, inside)
        out[tuple(slice(0, s.stop - s.start) for s in inside)] = block
    return out


def local_slice(attr, pid: int, name: str, global_array):
    """Process ``pid``'s block of the global (host) array of Value ``name`` laid out as
    ``attr``, as a C-contiguous host array (None if it holds none)."""
    if pid not in attr.mesh:
        return None
    if attr.spec.partial:
        raise PlanError(f"cannot shard {name}: a stored or fed value cannot be Partial")
    return np.array(global_array[attr.local_slices(global_array.shape, pid)], order="C")
