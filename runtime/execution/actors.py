"""The actor runtime: one process's tasks run as message-driven actors (Paddle's
carrier and interceptors).

A :class:`Carrier` holds an actor per task of its process (forward, backward — or
backward_input and backward_weight —, update) and runs one training step:

- a per-micro-batch actor may run instance ``m`` when its previous instance is done,
  the instances it depends on in its process are done, the tiles it receives from
  other processes have arrived (*data-ready*: posted receives that completed), and
  every edge out of it has a free slot: locally, its consumer has caught up to within the
  edge's buffer; remotely, the consumer has sent a *buffer-freed* message for instance
  ``m - buffer``;
- among the actors that may run, the first in the schedule's priority order runs;
  the update actor runs once, when every per-micro-batch instance is done;
- sends are posted without waiting and receives are posted as soon as a buffer slot is
  free, so a stage computes while its activations travel; every message's tag carries
  its point and micro-batch. There is no global order: each process follows only its
  own actors' messages.

The schedule is nothing but buffers and priorities (see
:mod:`distgraph.passes.pipeline.task_graph`): 1F1B, GPipe (FThenB) and zero-bubble (ZB)
emerge from them. Processes of a stage that communicate inside their tasks
(tensor parallelism) must meet their collectives in one order: the stage's first
process picks, and tells the others each choice (a *decision* message).

Failure contract: an error in a task is a RuntimeFault naming the rank, the task and the
micro-batch; a message that does not arrive within the communicator's timeout is a
RuntimeFault naming what each waiting actor needs.
"""

from __future__ import annotations

import os
import time

import numpy as np

from distgraph.errors import DistGraphError, RuntimeFault
from distgraph.registry import rank_lookup
from distgraph.passes.pipeline.task_graph import PER_MICRO_BATCH
from distgraph.runtime.execution.executor import OpInstr
from distgraph.runtime.execution.tasks import (Accumulator, GatherStep, PointStep, ProcessTasks,
                                         RecvStep, SendStep, StepRunner)

_KIND_CODES = {k: i for i, k in enumerate(PER_MICRO_BATCH)}


class Carrier:
    """The actors of process ``pid`` of ``plan``, bound to ``comm`` (None for a plan of
    one process). With ``profile``, every task, send and receive is recorded in
    :attr:`events` and the live activations after each task in :attr:`memory`."""

    def __init__(self, plan, pid: int, comm, backend, profile: bool = False, clock=None):
        self.graph = graph = plan.task_graph()
        self.tasks = ProcessTasks(plan, graph, pid)
        self.pid, self.comm, self.xb = pid, comm, backend
        self.rank = comm.rank if comm is not None else 0
        self.rank_of = plan.rank_of
        self.ranks = rank_lookup(plan.rank_of)
        self.runner = StepRunner(self.tasks, comm, backend, plan.rank_of)
        self.stage = graph.stage_of[pid]
        self.m = graph.micro_batches
        self.kinds = self.tasks.order
        self.order = [k for k in graph.priority if k in self.kinds] + \
            [k for k in self.kinds if k not in graph.priority]
        self.edges_in = {k: graph.edges_in(pid, k) for k in self.tasks.tasks}
        self.edges_out = {k: graph.edges_out(pid, k) for k in self.tasks.tasks}
        coordinated = graph.coordinated[self.stage]
        leader = graph.leader(self.stage)
        self.follows = self.ranks(leader) if coordinated and pid != leader else None
        self.followers = [self.ranks(q) for q in graph.stages[self.stage].process_ids
                          if q != pid] if coordinated and pid == leader else []
        self.profile = profile
        self.clock = clock or time.perf_counter
        self.events: list = []
        self.memory: list = []
        self.timeout = comm.timeout if comm is not None else 60.0
        self.spin = comm.poll_spin_seconds if comm is not None else 0.0
        self.feed_names: set = set()
        self._recv_at = self._recv_positions()

    # -- set-up --------------------------------------------------------------------------
    def _recv_positions(self) -> dict:
        """{(edge id, point seq): (kind, step index, [positions among its tiles])}."""
        out = {}
        for kind, steps in self.tasks.steps.items():
            for j, st in enumerate(steps):
                if not isinstance(st, RecvStep):
                    continue
                for e in self.edges_in.get(kind, ()):
                    if e.remote and st.point.seq in e.points:
                        pos = [i for i, (src, _) in enumerate(st.incoming) if src == e.src[0]]
                        out[(e.id, st.point.seq)] = (kind, j, pos)
        return out

    # -- one step ---------------------------------------------------------------------------
    def run(self, scope: dict, feeds: list, step: int) -> dict:
        """One training step on ``feeds`` (one dict of local inputs per micro-batch);
        returns the fetched values (global, on every process)."""
        self.step, self.scope = step, scope
        self.env = [dict(f) for f in feeds] + [{} for _ in range(self.m - len(feeds))]
        self.feed_names = set().union(*(f.keys() for f in feeds)) if feeds else set()
        self.acc = Accumulator(self.tasks, self.xb, self.m)
        self.done = {k: 0 for k in self.kinds}
        self.updated = "update" not in self.tasks.tasks
        self.fetched: dict = {}
        self.sends: list = []               # (request, what, start)
        self.tiles: dict = {}               # (seq, m) -> list of arrays (None: pending)
        self.arrived: dict = {}             # (edge id, m) -> tiles still missing
        self.recvs: list = []               # (request, edge, m, seq, position, start)
        self.recv_start: dict = {}
        self.credits = {e.id: 0 for es in self.edges_out.values() for e in es if e.remote}
        self.credit_reqs: dict = {}
        self.decisions: list = []
        self.decision_req = None
        self.decided = 0
        for es in self.edges_in.values():
            for e in es:
                if e.remote:
                    for m in range(min(e.buffer, self.m)):
                        self._post_receives(e, m)
        for e_id in self.credits:
            self._post_credit(e_id)
        if self.follows is not None:
            self._post_decision()
        self._loop()
        return self.fetched

    def _loop(self) -> None:
        last = self.clock()
        idle_since = None
        while True:
            progressed = self._poll()
            if self._finished():
                return
            choice = self._choose()
            if choice is not None:
                kind, m = choice
                if self.followers:
                    self._decide(kind, m)
                self._run_task(kind, m)
                last, idle_since = self.clock(), None
                continue
            now = self.clock()
            if progressed:
                last, idle_since = now, None
                continue
            if now - last > self.timeout:
                raise RuntimeFault(self._stalled(now - last))
            if self.comm is None:
                raise RuntimeFault(f"process {self.pid}: no task can run and none waits for a "
                                   f"message; this is a task-graph bug, please report it\n"
                                   + self._waiting())
            idle_since = idle_since or now
            if now - idle_since < self.spin:
                os.sched_yield()
            else:
                time.sleep(min(1e-3, max(1e-5, (now - idle_since) / 8)))

    def _finished(self) -> bool:
        return (self.updated and all(self.done[k] == self.m for k in self.kinds)
                and not self.sends and all(c == self.m for c in self.credits.values()))

    # -- choosing ------------------------------------------------------------------------------
    def _ready(self, kind: str, m: int) -> bool:
        if m >= self.m or self.done[kind] != m:
            return False
        for e in self.edges_in[kind]:
            if e.remote:
                if self.arrived.get((e.id, m), 1):
                    return False
            elif self.done[e.src[1]] <= (self.m - 1 if e.flush else m):
                return False
        for e in self.edges_out[kind]:
            if e.remote:
                if m >= self.credits[e.id] + e.buffer:
                    return False
            elif m - self.done[e.dst[1]] >= e.buffer:
                return False
        return True

    def _choose(self):
        if self.follows is not None:
            if self.decisions and self._ready(*self.decisions[0]):
                return self.decisions.pop(0)
        else:
            for kind in self.order:
                if self._ready(kind, self.done[kind]):
                    return kind, self.done[kind]
        if not self.updated and all(self.done[k] == self.m for k in self.kinds):
            return "update", 0
        return None

    def _decide(self, kind: str, m: int) -> None:
        if kind == "update":
            return
        msg = np.array([_KIND_CODES[kind], m], dtype=np.int64)
        for r in self.followers:
            req = self.comm.isend(msg, r, self.graph.decide_tag(), count=False)
            self.sends.append((req, None, None))

    # -- messages --------------------------------------------------------------------------------
    def _post_receives(self, e, m: int) -> None:
        missing = 0
        now = self.clock()
        for seq in e.points:
            kind, j, positions = self._recv_at[(e.id, seq)]
            st = self.tasks.steps[kind][j]
            buf = self.tiles.setdefault((seq, m), [None] * len(st.incoming))
            for pos in positions:
                shape = st.incoming[pos][1]
                req = self.comm.irecv(shape, st.point.dtype, self.ranks(e.src[0]),
                                      self.graph.tag(seq, m))
                self.recvs.append((req, e, m, seq, pos))
                buf[pos] = None
                missing += 1
        self.arrived[(e.id, m)] = missing
        self.recv_start[(e.id, m)] = now

    def _post_credit(self, e_id: int) -> None:
        e = self.graph.edges[e_id]
        self.credit_reqs[e_id] = self.comm.irecv((1,), np.int64, self.ranks(e.dst[0]),
                                                 self.graph.credit_tag(e))

    def _post_decision(self) -> None:
        if self.decided < self.m * len(self.kinds):
            self.decision_req = self.comm.irecv((2,), np.int64, self.follows,
                                                self.graph.decide_tag())

    def _poll(self) -> bool:
        progressed = False
        if self.recvs:
            still = []
            for item in self.recvs:
                req, e, m, seq, pos = item
                if req.test():
                    self.tiles[(seq, m)][pos] = req.value
                    self.arrived[(e.id, m)] -= 1
                    progressed = True
                    if self.profile and not self.arrived[(e.id, m)]:
                        self._event("recv", m, self.recv_start[(e.id, m)], self.clock(),
                                    peer=e.src[0])
                else:
                    still.append(item)
            self.recvs = still
        for e_id, req in list(self.credit_reqs.items()):
            if req.test():
                got = int(req.value[0])
                if got != self.credits[e_id]:
                    raise RuntimeFault(f"rank {self.rank}: buffer-freed message for micro-batch "
                                       f"{got} on edge {self.graph.edges[e_id]}, expected "
                                       f"{self.credits[e_id]}")
                self.credits[e_id] += 1
                progressed = True
                if self.credits[e_id] < self.m:
                    self._post_credit(e_id)
                else:
                    del self.credit_reqs[e_id]
        if self.decision_req is not None and self.decision_req.test():
            code, m = (int(x) for x in self.decision_req.value)
            self.decisions.append((PER_MICRO_BATCH[code], m))
            self.decided += 1
            self.decision_req = None
            self._post_decision()
            progressed = True
        if self.sends:
            still = []
            for item in self.sends:
                req, what, start = item
                if req.test():
                    progressed = True
                    if self.profile and what is not None:
                        self._event("send", what[1], start, self.clock(), peer=what[0])
                else:
                    still.append(item)
            self.sends = still
        return progressed

    # -- running a task ------------------------------------------------------------------------
    def _run_task(self, kind: str, m: int) -> None:
        start = self.clock()
        try:
            if kind == "update":
                self._run_update()
            else:
                self._run_instance(kind, m)
        except DistGraphError as e:
            where = f", micro-batch {m}" if kind != "update" else ""
            raise RuntimeFault(f"rank {self.rank} (process {self.pid}): task {kind} of stage "
                               f"{self.stage}{where} in step {self.step} failed: {e}") from e
        end = self.clock()
        if self.profile:
            self._event(kind, None if kind == "update" else m, start, end)

    def _run_instance(self, kind: str, m: int) -> None:
        env, scope, runner = self.env[m], self.scope, self.runner
        task = self.tasks.tasks[kind]
        accumulate = set(task.accumulates)
        frees = self.tasks.frees
        for j, st in enumerate(self.tasks.steps[kind]):
            if isinstance(st, OpInstr):
                runner.run_op(st, env, scope, self.step, m)
                made = st.outs
            elif isinstance(st, PointStep):
                runner.run_point(st, env, scope, self._tag(st.point.seq, m))
                made = st.writes
            elif isinstance(st, SendStep):
                tag = self.graph.tag(st.point.seq, m)
                for rank, tile in runner.send_tiles(st, env, scope, tag):
                    req = self.comm.isend(tile, rank, tag)
                    self.sends.append((req, (rank, m), self.clock()))
                made = st.writes
            else:
                runner.receive(st, env, self.tiles.pop((st.point.seq, m)),
                               self.graph.tag(st.point.seq, m))
                made = st.writes
            dropped = frees.get((kind, j), ())
            for name in made:
                if name in accumulate:
                    self.acc.add(name, env[name], m, owned=name in dropped)
            for name in dropped:
                env.pop(name, None)
        self.done[kind] += 1
        for e in self.edges_in[kind]:
            if e.remote:
                req = self.comm.isend(np.array([m], dtype=np.int64), self.ranks(e.src[0]),
                                      self.graph.credit_tag(e), count=False)
                self.sends.append((req, None, None))
                if m + e.buffer < self.m:
                    self._post_receives(e, m + e.buffer)
        if all(self.done[k] > m for k in self.kinds):
            env.clear()
        if self.profile:
            self._record_memory()

    def _run_update(self) -> None:
        env = self.acc.result()
        scope, runner = self.scope, self.runner
        for st in self.tasks.steps.get("update", ()):
            if isinstance(st, OpInstr):
                runner.run_op(st, env, scope, self.step, 0)
            elif isinstance(st, GatherStep):
                self.fetched[st.point.value] = self._gather(st, env)
            else:
                runner.run_point(st, env, scope, self._tag(st.point.seq, 0))
        self.updated = True

    def _gather(self, st: GatherStep, env):
        """The global value of a fetched name; per-sample outputs (kept per micro-batch)
        are gathered micro-batch by micro-batch and joined along their sample dim."""
        tag = self.graph.gather_tag(st.index)
        if self.tasks.mode(st.point.value) != "concat":
            return self.runner.run_point(st, env, self.scope, tag)
        parts = env.get(st.reads[0]) if st.reads else [None] * self.m
        out = []
        for part in parts:
            if st.reads:
                env[st.reads[0]] = part
            out.append(self.runner.run_point(st, env, self.scope, tag))
        axis = self.tasks.plan.accumulation.split_axis[st.point.value]
        return self.xb.concatenate(out, axis=axis)

    def _tag(self, seq: int, m: int) -> int:
        return self.graph.tag(seq, m) if seq in self.graph.channels else 0

    # -- records -----------------------------------------------------------------------------------
    def _event(self, kind, m, start, end, peer=None) -> None:
        self.events.append((self.rank, self.stage, kind, m, self.step, start, end, peer))

    def _record_memory(self) -> None:
        live_bytes, live = 0, 0
        for env in self.env:
            held = [a for n, a in env.items() if n not in self.feed_names]
            if held:
                live += 1
                live_bytes += sum(int(getattr(a, "nbytes", 0)) for a in held)
        self.memory.append((self.rank, self.stage, self.step, self.clock(), live_bytes, live))

    # -- diagnostics -------------------------------------------------------------------------------
    def _waiting(self) -> str:
        lines = []
        for kind in self.kinds:
            m = self.done[kind]
            if m >= self.m:
                continue
            needs = []
            for e in self.edges_in[kind]:
                if e.remote and self.arrived.get((e.id, m), 1):
                    pts = ", ".join(self.graph.points[s].value for s in e.points)
                    needs.append(f"{pts} from rank {self.ranks(e.src[0])} (tags "
                                 f"{[self.graph.tag(s, m) for s in e.points]})")
                elif not e.remote and self.done[e.src[1]] <= (self.m - 1 if e.flush else m):
                    needs.append(f"its {e.src[1]} of micro-batch "
                                 f"{self.m - 1 if e.flush else m}")
            for e in self.edges_out[kind]:
                if e.remote and m >= self.credits[e.id] + e.buffer:
                    needs.append(f"a buffer-freed message from rank {self.ranks(e.dst[0])} "
                                 f"(tag {self.graph.credit_tag(e)})")
            if self.follows is not None and not self.decisions:
                needs.append(f"the next decision of rank {self.follows}")
            lines.append(f"  {kind} micro-batch {m} waits for "
                         + ("; ".join(needs) or "its turn"))
        return "\n".join(lines)

    def _stalled(self, seconds: float) -> str:
        return (f"rank {self.rank} (process {self.pid}, stage {self.stage}): timed out after "
                f"{self.timeout:g} s in step {self.step} with no message arriving; a peer "
                f"did not send what this rank's tasks wait for:\n{self._waiting()}")
