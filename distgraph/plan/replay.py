"""Replaying a schedule: the check that it completes, and its clock.

:func:`replay` runs each process's actions (a :class:`~distgraph.plan.schedule.Schedule`'s
orders) on a clock: an action starts when its inputs are done (``Problem.deps``, in the
same micro-batch), every process holding its chunk has reached it and those processes are
free. Each action lasts its kind's unit cost (:data:`COST`: F 1, B 2, I 1, W 1), or the
seconds given for its (chunk, kind). It raises a :class:`PlanError` naming the waiting
actions where the orders cannot complete, and gives each action's finish, the finish of
the last and the most micro-batches each process holds in flight.

The planner makes the schedule on the unit clock and checks it here
(:mod:`distgraph.passes.pipeline.schedule`); a plan's report (:mod:`.report`) lays it out
at the seconds the estimate gives each task. :class:`Problem` is what both read of a
task graph (:func:`problem_of`).

Example::

    problem = problem_of(plan.task_graph())
    replay(plan.order.orders, problem).makespan                    # unit clock
    replay(plan.order.orders, problem, {(0, "F"): 0.1, (0, "B"): 0.2}).finish
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType

from distgraph.errors import PlanError
from distgraph.plan.schedule import Action

COST = {"F": 1, "B": 2, "I": 1, "W": 1}


@dataclass(frozen=True)
class Problem:
    """What the rules need to know about a plan. ``holders[c]``: the processes that run
    chunk ``c``; ``kinds[c]``: its action kinds (e.g. ``("F", "B")``); ``deps[(c,
    kind)]``: the (chunk, kind) pairs whose results it reads, in the same micro-batch;
    ``schedule`` one of :data:`SCHEDULES`; ``stages`` S stage meshes; ``virtual`` v
    chunks per stage mesh."""

    micro_batches: int
    holders: tuple
    kinds: tuple
    deps: MappingProxyType
    schedule: str = "1F1B"
    stages: int = 1
    virtual: int = 1

    @property
    def chunks(self) -> int:
        return len(self.holders)

    def processes(self) -> list:
        return sorted({p for hs in self.holders for p in hs})

    def chunks_of(self, pid: int) -> tuple:
        return self._chunks_by_process().get(pid, ())

    def _chunks_by_process(self) -> dict:
        # {process: its chunks}, built once: a scan of every chunk's holders per
        # process is chunks x processes x holders (20 s for 16,384 processes)
        index = self.__dict__.get("_by_process")
        if index is None:
            index = {}
            for c, hs in enumerate(self.holders):
                for p in hs:
                    index.setdefault(p, []).append(c)
            index = {p: tuple(cs) for p, cs in index.items()}
            object.__setattr__(self, "_by_process", index)
        return index

    def last_kind(self, chunk: int) -> str | None:
        """The backward that frees chunk's micro-batch (None: it has no backward)."""
        for kind in ("W", "B", "I"):
            if kind in self.kinds[chunk]:
                return kind
        return None


def problem_of(graph) -> Problem:
    """What the rules need to know about a task graph
    (:class:`~distgraph.plan.tasks.TaskGraph`)."""
    holders, kinds = [], []
    by_chunk: dict = {}
    for t in graph.tasks:
        by_chunk.setdefault(t.chunk, []).append(t)
    for c in range(len(graph.chunks)):
        mine = by_chunk.get(c, [])
        holders.append(tuple(sorted({t.process for t in mine})))
        kinds.append(tuple(k for k in "FBIW"
                           if any(t.kind.per_micro_batch and t.kind.action == k
                                  for t in mine)))
    return Problem(graph.micro_batches, tuple(holders), tuple(kinds), graph.deps,
                   graph.schedule, len(graph.stages), graph.virtual)



@dataclass(frozen=True)
class Timing:
    """A replayed schedule: ``makespan`` (when the last action ends, on the clock it was
    replayed on), ``finish[action]``, and ``peak[pid]``: the most chunk-micro-batches a
    process holds in flight."""

    makespan: float
    finish: MappingProxyType
    peak: MappingProxyType


def replay(orders, problem: Problem, seconds=None) -> Timing:
    """Run ``orders`` ({pid: [Action]}) on the unit-cost clock, or with ``seconds``
    ({(chunk, kind letter): how long such an action lasts}) on that one. Raises PlanError
    naming the waiting actions when they cannot all run (an input no earlier action
    makes, or processes waiting for each other in a circle). Processes that hold the
    same chunks and run the same order move in step, so one of each such group is
    replayed."""
    chunks: dict = {pid: [] for pid in orders}
    for c, holders in enumerate(problem.holders):
        for q in holders:
            chunks.setdefault(q, []).append(c)
    orders = {pid: orders.get(pid, ()) for pid in chunks}     # a holder without an order
    alike: dict = {}
    interned: dict = {}     # id of an order -> (the order, its index among distinct ones)
    distinct: dict = {}     # order -> its index
    for pid, acts in sorted(orders.items()):
        entry = interned.get(id(acts))
        if entry is None:   # the processes of a group share one order: hashed once
            index = distinct.setdefault(tuple(acts), len(distinct))
            entry = interned[id(acts)] = (acts, index)
        alike.setdefault((tuple(chunks[pid]), entry[1]), []).append(pid)
    by_index = list(distinct)
    alike = {(held, by_index[n]): pids for (held, n), pids in alike.items()}
    expected = {(c, k, mb) for c in range(problem.chunks) for k in problem.kinds[c]
                for mb in range(problem.micro_batches)}
    for (held, acts), (pid, *_) in alike.items():
        mine = {(a.chunk, a.kind, a.micro_batch) for a in acts}
        want = {x for x in expected if x[0] in held}
        if len(mine) != len(acts) or mine != want:
            extra = sorted(Action(*x) for x in mine - want)
            missing = sorted(Action(*x) for x in want - mine)
            raise PlanError(f"process {pid}'s schedule does not run each of its actions once"
                            f" (missing {', '.join(map(str, missing[:6])) or 'none'}; "
                            f"not its own or repeated: "
                            f"{', '.join(map(str, extra[:6])) or 'none'})")
    firsts = {pids[0] for pids in alike.values()}
    orders = {pid: list(acts) for (_, acts), (pid, *_) in alike.items()}
    problem = dataclasses.replace(problem, holders=tuple(
        tuple(q for q in hs if q in firsts) for hs in problem.holders))
    pos = {pid: 0 for pid in orders}
    free = {pid: 0.0 for pid in orders}
    finish: dict = {}
    moved = True
    while moved:
        moved = False
        for pid, acts in orders.items():
            while pos[pid] < len(acts):
                a = acts[pos[pid]]
                holders = problem.holders[a.chunk]
                if any(orders[q][pos[q]] != a if pos[q] < len(orders[q]) else True
                       for q in holders if q != pid):
                    break
                deps = [Action(c, k, a.micro_batch)
                        for c, k in problem.deps.get((a.chunk, a.kind), ())]
                if not all(d in finish for d in deps):
                    break
                start = max([free[q] for q in holders] + [finish[d] for d in deps])
                finish[a] = start + (COST[a.kind] if seconds is None
                                     else seconds[(a.chunk, a.kind)])
                for q in holders:
                    free[q] = finish[a]
                    pos[q] += 1
                moved = True
    stuck = {pid: acts[pos[pid]] for pid, acts in orders.items() if pos[pid] < len(acts)}
    if stuck:
        raise PlanError("the schedule cannot complete: " + "; ".join(
            _waiting(pid, a, orders, pos, finish, problem) for pid, a in sorted(stuck.items()))
            + ". This plan's stages exchange data in a circle; place the model's parts so "
              "that data flows from each stage only to later ones")
    peak = {}
    for (_, acts), pids in alike.items():
        most = _peak(acts, problem)
        peak.update((pid, most) for pid in pids)
    return Timing(max(finish.values(), default=0.0), MappingProxyType(finish),
                  MappingProxyType(dict(sorted(peak.items()))))


def _waiting(pid, a, orders, pos, finish, problem) -> str:
    needs = [str(Action(c, k, a.micro_batch)) for c, k in problem.deps.get((a.chunk, a.kind), ())
             if Action(c, k, a.micro_batch) not in finish]
    peers = [f"process {q} at {orders[q][pos[q]] if pos[q] < len(orders[q]) else 'its end'}"
             for q in problem.holders[a.chunk]
             if q != pid and (pos[q] >= len(orders[q]) or orders[q][pos[q]] != a)]
    why = []
    if needs:
        why.append(f"for {', '.join(needs)}")
    if peers:
        why.append(f"for {', '.join(peers)}")
    return f"process {pid} waits at {a} " + " and ".join(why)


def _peak(acts, problem: Problem) -> int:
    live = peak = 0
    for a in acts:
        last = problem.last_kind(a.chunk)
        if last is None:
            continue
        live += a.kind == "F"
        peak = max(peak, live)
        live -= a.kind == last
    return peak
