"""Run one training step of a plan on this process, talking to the others.

The planner side (:func:`distgraph.passes.plan`, partition, reshard plans) is pure; this
module binds a Plan to a Communicator: each reshard point of the process's local program
becomes an instruction that runs its steps with :func:`apply_reshard`, interleaved with
the local kernels in the global op order.

Example (inside a rank)::

    p = dg.passes.plan(built, strategy)
    runner = SpmdRunner(p, p.process_of(comm.rank), comm, fetch=["loss"])
    scope = runner.shard_scope(global_arrays)
    out = runner.run(scope, feed=global_batch, step=0)    # {"loss": global loss}
"""

from __future__ import annotations

import sys

import numpy as np

from distgraph.errors import PlanError
from distgraph.passes.partition import gather_points
from distgraph.runtime.backend import backend_of
from distgraph.runtime.execution.executor import ProgramRunner
from distgraph.runtime.comm.base import MAX_TAG
from distgraph.runtime.execution.reshard import apply_reshard, run_point


class BoundReshard:
    """A reshard point bound to a communicator: an instruction of the executor, which
    may donate the array it reads (see ProgramRunner)."""

    can_donate = True

    def __init__(self, point, comm, process_id, rank_of, tag):
        self.point, self.comm, self.pid, self.rank_of, self.tag = point, comm, process_id, rank_of, tag
        self.reads, self.writes, self.stores = point.reads, point.writes, point.stores

    def execute(self, env, donate: bool = False) -> None:
        p = self.point
        out = run_point(p, env[p.reads[0]] if p.reads else None, self.comm, self.pid,
                        self.rank_of, self.tag, donate)
        if p.writes:
            env[p.writes[0]] = out


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
        raise PlanError(f"process ids {ids} are not 0..{world_size - 1}; give a rank mapping")


class SpmdRunner:
    """Process ``process_id``'s part of ``plan``, with communication bound to ``comm``.
    ``fetch`` names values whose *global* value every process receives after the step.
    Arrays are made by ``backend`` (the communicator's, numpy by default)."""

    def __init__(self, plan, process_id: int, comm, fetch=(), backend=None):
        program = plan.program
        self.program, self.pid, self.comm = program, process_id, comm
        self.backend = backend or backend_of(comm)
        xp = self.backend.xp
        self.rank_of = rank_of = plan.rank_of
        self.local = plan.local(process_id)
        # Message tags: program points count up from 0, gathers down from MAX_TAG - 1,
        # both from global sequence numbers so every process agrees.
        points: dict = {}
        for index, plist in self.local.comm_points.items():
            points[index] = [self._bind(p, p.seq % (MAX_TAG // 2)) for p in plist]
        end = len(self.local.program.ops)
        for p in gather_points(program, fetch, process_id):
            points.setdefault(end, []).append(self._bind(p, MAX_TAG - 1 - p.seq % (MAX_TAG // 2)))
        self.fetch = list(fetch)
        self.runner = ProgramRunner(self.local.program, xp, op_context=self.local.op_context,
                                    comm_points=points, comm=comm, rank_of=rank_of)

    def _bind(self, point, tag):
        return BoundReshard(point, self.comm, self.pid, self.rank_of, tag)

    def local_slice(self, name: str, global_array):
        """This process's shard of a global array of Value ``name`` (None if it holds none)."""
        return local_slice(self.program, self.pid, name, global_array)

    def shard_scope(self, global_values: dict) -> dict:
        """Local shards of persistable values from their global arrays."""
        return shard_scope(self.program, self.local.program, self.pid, global_values,
                           self.backend)

    def batch_rows(self):
        """The rows of dim 0 of each batch this process reads, when all inputs it holds
        want the same ones (a data-parallel rank loads only its samples; other dims are
        sliced after); None: it reads whole batches."""
        program = self.program
        slices = [program.values[v.name].dist_attr.local_slices(program.values[v.name].shape,
                                                                 self.pid)
                  for v in self.local.program.inputs]
        if not slices or any(not s or s[0] != slices[0][0] for s in slices):
            return None
        return slices[0][0]

    def run(self, scope: dict, feed: dict, step: int = 0, rows: slice | None = None) -> dict:
        """One step; returns the global fetched values. ``feed`` holds global batches, or,
        with ``rows``, only those rows of dim 0 (what this process reads of the batch)."""
        local_feed = {}
        for v in self.local.program.inputs:
            g = self.program.values[v.name]
            index = g.dist_attr.local_slices(g.shape, self.pid)
            if rows is not None:
                index = (slice(None),) + tuple(index[1:])
            local_feed[v.name] = self.backend.from_host(np.asarray(feed[v.name])[index])
        out = self.runner.run(scope, local_feed, [f"{n}@GLOBAL" for n in self.fetch], step)
        return {n: out[f"{n}@GLOBAL"] for n in self.fetch}

    def gather(self, scope: dict, names) -> dict:
        """Global values of persistables ``names`` on every process."""
        return gather_scope(self.program, scope, names, self.comm, self.pid, self.rank_of)


def gather_scope(program, scope: dict, names, comm, pid: int, rank_of) -> dict:
    """Global values of persistables ``names`` of a completed ``program`` on every
    process (a collective of all of them), from their local blocks in ``scope``."""
    out = {}
    for point in gather_points(program, names, pid):
        local = scope[point.value] if point.reads else None
        out[point.value] = apply_reshard(point.steps, local, comm, pid, rank_of,
                                         MAX_TAG - 1 - point.seq % (MAX_TAG // 2))
    return out


def local_slice(program, pid: int, name: str, global_array):
    """Process ``pid``'s block of the global (host) array of Value ``name`` of a completed
    ``program``, as a C-contiguous host array (None if it holds none)."""
    attr = program.values[name].dist_attr
    if pid not in attr.mesh:
        return None
    if attr.spec.partial:
        raise PlanError(f"cannot shard {name}: a stored or fed value cannot be Partial")
    return np.array(global_array[attr.local_slices(global_array.shape, pid)], order="C")


def shard_scope(program, local_program, pid: int, global_values: dict, backend) -> dict:
    """Process ``pid``'s blocks of the persistables of ``local_program``, from their
    global arrays, as arrays of ``backend``."""
    scope = {}
    for v in local_program.persistables:
        if v.name not in global_values:
            raise PlanError(f"no initial value for {v.name}")
        block = local_slice(program, pid, v.name, np.asarray(global_values[v.name]))
        scope[v.name] = backend.from_host(block)
    return scope
