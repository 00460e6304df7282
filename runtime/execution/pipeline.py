"""Run training steps of a micro-batched (or profiled) plan on this process.

:class:`PipelineRunner` is the pipeline's counterpart of
:class:`~distgraph.runtime.execution.spmd.SpmdRunner`, with the same interface: it shards the
initial state, cuts each batch into the plan's micro-batches and this process's block of
each, and runs the step with a :class:`~distgraph.runtime.execution.actors.Carrier` (the actors of
its tasks). The fetched values are global and the same on every process: a loss summed
over the micro-batches, per-sample outputs concatenated.

Example (inside a rank)::

    p = dg.passes.plan(built, dg.Strategy(micro_batches=4, schedule="1F1B"))
    runner = PipelineRunner(p, p.process_of(comm.rank), comm, fetch=["loss"])
    scope = runner.shard_scope(global_arrays)
    out = runner.run(scope, feed=global_batch, step=0)
"""

from __future__ import annotations

import socket
import time
import zlib

import numpy as np

from distgraph.errors import DistGraphError, PlanError
from distgraph.registry import KernelContext, get_op
from distgraph.runtime.execution.actors import Carrier
from distgraph.runtime.backend import backend_of
from distgraph.runtime.execution.executor import call_kernel
from distgraph.runtime.execution.spmd import gather_scope, shard_scope
from distgraph.runtime.execution.timeline import Timeline


class PipelineRunner:
    """Process ``process_id``'s actors for ``plan`` (``comm`` None: a one-process plan).
    ``fetch`` must name values the plan fetches (its loss, or its outputs)."""

    def __init__(self, plan, process_id: int, comm, fetch=(), backend=None):
        self.plan, self.pid, self.comm = plan, process_id, comm
        self.backend = backend or backend_of(comm)
        self.program = plan.program
        self.local = plan.local(process_id)
        graph = plan.task_graph()
        missing = [n for n in fetch if n not in graph.fetch]
        if missing:
            raise PlanError(f"a pipelined step fetches {list(graph.fetch)}, not {missing}")
        self.fetch = list(fetch)
        self.profile = plan.strategy.profile
        self._t0 = None
        self.carrier = Carrier(plan, process_id, comm, self.backend, self.profile,
                               clock=self._clock)
        acc = plan.accumulation
        self.micro_batches = plan.micro_batches
        inputs = self.local.program.inputs
        self.rows_per_micro_batch = (acc.micro_batch_rows if acc is not None else
                                     (self.program.values[inputs[0].name].shape[0]
                                      if inputs else 0))
        made = acc.prologue_values if acc is not None else frozenset()
        self.prologue = [op for op in self.local.program.ops
                         if op.outputs and all(o.name in made for o in op.outputs)]

    def _clock(self) -> float:
        return time.perf_counter() - (self._t0 or 0.0)

    # -- state ------------------------------------------------------------------------------
    def shard_scope(self, global_values: dict) -> dict:
        """Local shards of persistable values from their global arrays."""
        return shard_scope(self.program, self.local.program, self.pid, global_values,
                           self.backend)

    def gather(self, scope: dict, names) -> dict:
        """Global values of persistables ``names`` on every process (a collective)."""
        return gather_scope(self.program, scope, names, self.comm, self.pid, self.plan.rank_of)

    # -- feeding ---------------------------------------------------------------------------------
    def _blocks(self) -> list:
        """(name, index of this process's block of a micro-batch) per local input."""
        out = []
        for v in self.local.program.inputs:
            g = self.program.values[v.name]
            out.append((v.name, g.dist_attr.local_slices(g.shape, self.pid)))
        return out

    def batch_rows(self):
        """The rows of each batch this process reads (an index array over the batch's
        rows, micro-batch after micro-batch), when all its inputs want the same rows of
        their micro-batch; None: it reads whole batches."""
        blocks = self._blocks()
        if not blocks or any(not idx or idx[0] != blocks[0][1][0] for _, idx in blocks):
            return None
        rows = blocks[0][1][0]
        b = self.rows_per_micro_batch
        return np.concatenate([np.arange(m * b + rows.start, m * b + rows.stop)
                               for m in range(self.micro_batches)])

    def _micro_feeds(self, feed: dict, rows) -> list:
        feeds = [dict() for _ in range(self.micro_batches)]
        b = self.rows_per_micro_batch
        for name, index in self._blocks():
            if name not in feed:
                raise DistGraphError(f"input {name!r} was not fed; feed it by name")
            batch = np.asarray(feed[name])
            if rows is not None:
                n = index[0].stop - index[0].start
                cut = lambda m: (slice(m * n, (m + 1) * n),) + tuple(index[1:])  # noqa: E731
            else:
                cut = lambda m: (slice(m * b + index[0].start,  # noqa: E731
                                       m * b + index[0].stop),) + tuple(index[1:])
            for m in range(self.micro_batches):
                feeds[m][name] = self.backend.from_host(batch[cut(m)])
        return feeds

    # -- running ----------------------------------------------------------------------------------
    def run(self, scope: dict, feed: dict, step: int = 0, rows=None) -> dict:
        """One step; returns the global fetched values. ``feed`` holds global batches, or,
        with ``rows`` (from :meth:`batch_rows`), only those rows."""
        if self.profile and self._t0 is None:
            self._t0 = self._start_clock()
        feeds = self._micro_feeds(feed, rows)
        if self.prologue:
            self._run_prologue(feeds, step)
        out = self.carrier.run(scope, feeds, step)
        return {n: out[n] for n in self.fetch}

    def _run_prologue(self, feeds: list, step: int) -> None:
        """The accumulation's prologue: its ops on every micro-batch, its sums added up
        over the micro-batches and given to every micro-batch as the whole batch's."""
        wanted = self.plan.accumulation.prologue
        ctx = KernelContext(self.backend.xp, step)
        totals: dict = {}
        for micro in feeds:
            env = dict(micro)
            for op in self.prologue:
                outs = call_kernel(get_op(op.type).kernel, op.type, op.layer, ctx,
                                   [env[v.name] for v in op.inputs], op.attrs)
                env.update(zip((o.name for o in op.outputs), outs))
            for name in wanted & env.keys():
                totals[name] = env[name] + totals[name] if name in totals else env[name]
        for micro in feeds:
            micro.update(totals)

    def _start_clock(self) -> float:
        """The time every rank's records count from: the end of one barrier. Ranks on one
        machine share its monotonic clock, so they take one start (exact alignment);
        another machine's ranks start at their own end of the barrier."""
        if self.comm is None or self.comm.size == 1:
            return time.perf_counter()
        self.comm.barrier()
        host = float(zlib.crc32(socket.gethostname().encode()))
        mine = np.array([[host, time.perf_counter()]])
        everyone = self.comm.all_gather(mine, tuple(range(self.comm.size)), axis=0)
        return float(everyone[everyone[:, 0] == host, 1].min())

    def timeline(self) -> Timeline:
        """The timeline of every step run so far, merged over all ranks (a collective:
        call it on every rank)."""
        if not self.profile:
            raise DistGraphError("no timeline was recorded: use Strategy(profile=True)")
        return Timeline.gather(self.carrier.events, self.carrier.memory, self.comm)
