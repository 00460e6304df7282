"""Making the schedule: each process's compute actions, in the order it runs them.

The schedule is a value of the plan contract (:mod:`distgraph.plan.schedule`): per
process, :class:`~distgraph.plan.schedule.Action` s — a chunk, a kind (``F`` forward,
``B`` whole backward, ``I`` input gradient, ``W`` weight gradient) and a micro-batch,
printed in torch's notation (``"0F3"``).

:func:`make_schedule` is pure and deterministic, so every rank computes the same
schedule. It runs a few priority and buffer rules on a clock where each action costs its
share of a chunk's work (F 1, B 2, I 1, W 1), processes that hold the same chunks
deciding as one (so tensor-parallel peers agree without messages):

- forwards first, while the micro-batches in flight stay within the cap (a chunk's
  micro-batch is in flight from its F until its last backward): ``S - s`` on stage ``s``
  under 1F1B (Schedule1F1B's warm-up), ``(v-1)G + 2(S-1-s) + 1`` interleaved over ``v``
  chunks per process (Megatron's warm-up, ``G`` micro-batches per round); zero bubble
  caps F..W at ``(v-1)G + S`` and F..I at ``(v-1)G + S - s``; ZBV at ``2S``;
- then input gradients (B or I) — under FThenB only once every forward is done (GPipe's
  flush) —, then weight gradients: W fills what is left, unless more than ``S`` wait;
- among ready forwards the earliest round, then the earliest chunk (depth first within a
  round of ``G`` micro-batches; V: the later chunk first), backwards the other way round.

The rules reproduce Schedule1F1B and, in the unit-cost model, finish no later than
torch's Interleaved1F1B, InterleavedZeroBubble and ZBVZeroBubble while holding no more
micro-batches in flight (``tests/test_schedule.py`` compares them). A plan without
micro-batches has one F and one B (or I and W) per chunk, ordered by the data flow.

:func:`~distgraph.plan.replay.replay` (in the plan contract, which a plan's report
reads too) runs given orders on the same clock (an action starts when its inputs are
done, every process holding its chunk has reached it and those processes are free): it
is the check that a schedule completes — a :class:`PlanError` naming the waiting actions
when it cannot — and gives the finish time and the peak in flight. What the rules and
the replay read of a task graph is a :class:`~distgraph.plan.replay.Problem`.
:func:`schedule_of` is what the planner calls: a task graph's schedule, made and checked.

Example::

    problem = chain(stages=4, virtual=2, micro_batches=8, schedule="1F1B")
    sched = make_schedule(problem)
    print(sched.pretty())          # process 0: 0F0 0F1 0F2 0F3 4F0 ...
    replay(sched.orders, problem).makespan          # distgraph.plan.replay
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from distgraph.errors import PlanError
from distgraph.plan.replay import COST, Problem, problem_of, replay
from distgraph.plan.schedule import Action, Schedule

SCHEDULES = ("FThenB", "1F1B", "ZB", "ZBV")


def chain(stages: int, virtual: int, micro_batches: int, schedule: str) -> Problem:
    """The textbook pipeline: chunk c reads chunk c-1's forward, its backward reads chunk
    c+1's (and its own forward); chunks placed in a loop (c on process c mod S) or, under
    ZBV, in a V."""
    split = schedule in ("ZB", "ZBV")
    chunks = stages * (2 if schedule == "ZBV" else virtual)
    back = "I" if split else "B"
    kinds = ("F", "I", "W") if split else ("F", "B")
    deps: dict = {}
    for c in range(chunks):
        deps[(c, "F")] = frozenset({(c - 1, "F")} if c else ())
        deps[(c, back)] = frozenset({(c, "F")} | ({(c + 1, back)} if c < chunks - 1 else set()))
        if split:
            deps[(c, "W")] = frozenset({(c, "I")})
    holders = tuple((v_place(c, stages) if schedule == "ZBV" else c % stages,)
                    for c in range(chunks))
    return Problem(micro_batches, holders, (kinds,) * chunks, MappingProxyType(deps),
                   schedule, stages, 2 if schedule == "ZBV" else virtual)


def v_place(chunk: int, stages: int) -> int:
    """The process (stage mesh) of ``chunk`` in the V: p holds chunks p and 2S-1-p."""
    return chunk if chunk < stages else 2 * stages - 1 - chunk


def schedule_of(graph) -> Schedule:
    """The schedule of task graph ``graph`` (a plan's), checked to complete."""
    return checked_schedule(problem_of(graph))


def checked_schedule(problem: Problem) -> Schedule:
    """:func:`make_schedule` of ``problem``, replayed: a PlanError naming the waiting
    actions where it cannot complete."""
    order = make_schedule(problem)
    replay(order.orders, problem)
    return order


# ---- the rules ------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Rules:
    cap: int            # chunk-micro-batches in flight, F until the last backward
    input_cap: int      # in flight, F until the input gradient
    flush: bool         # backwards only once every forward is done (GPipe)
    lag: int            # weight gradients that may wait before one must run
    depth_first: bool   # V: later chunks first


def _rules(problem: Problem, chunks: tuple) -> _Rules:
    m, S, v = problem.micro_batches, problem.stages, problem.virtual
    many = m * len(chunks)
    s = min(chunks) if chunks else 0
    name = problem.schedule
    # one stage (gradient accumulation) follows the rules of S = 1: under 1F1B one
    # micro-batch in flight (F0 B0 F1 B1 ...), as the estimate counts it
    if m == 1 or name == "FThenB":
        return _Rules(many, many, name == "FThenB" and m > 1, many, name == "ZBV")
    g = m // max(1, m // S)
    if name == "ZBV":
        cap = min(2 * S, m + 1 + s, 2 * m)
        return _Rules(cap, cap, False, S, True)
    if name == "ZB":
        return _Rules(min((v - 1) * g + S, many), min((v - 1) * g + S - s, many), False, S,
                      False)
    cap = S - s if v == 1 else (v - 1) * g + 2 * (S - 1 - s) + 1
    return _Rules(min(cap, many), many, False, many, False)


def _keys(rules: _Rules, problem: Problem):
    """Sort keys of ready forwards and of ready backwards (an action as (c, kind, m))."""
    if rules.depth_first:
        return (lambda a: (-a[0], a[2])), (lambda a: (-a[0], a[2]))
    m = problem.micro_batches
    g = max(1, m // max(1, m // max(1, problem.stages)))
    return (lambda a: (a[2] // g, a[0], a[2])), (lambda a: (a[2] // g, -a[0], a[2]))


class _Group:
    """Processes that hold the same chunks, deciding as one worker of the clock."""

    def __init__(self, chunks, pids, problem: Problem):
        self.chunks, self.pids = chunks, pids
        self.rules = _rules(problem, chunks)
        self.fkey, self.bkey = _keys(self.rules, problem)
        self.next = {(c, k): 0 for c in chunks for k in problem.kinds[c]}
        self.last = {c: problem.last_kind(c) for c in chunks}
        self.forwards = sum(1 for c in chunks if "F" in problem.kinds[c]) * problem.micro_batches
        self.free = 0.0
        self.live = self.live_input = self.waiting_w = self.done_f = 0
        self.order: list = []

    def heads(self, m_total):
        for (c, k), m in self.next.items():
            if m < m_total:
                yield (c, k, m)

    def pick(self, ready: list, force: bool):
        r = self.rules
        fs = [a for a in ready if a[1] == "F"]
        backs = [a for a in ready if a[1] in ("B", "I")]
        ws = [a for a in ready if a[1] == "W"]
        if ws and self.waiting_w > r.lag:
            return min(ws, key=self.bkey)
        if fs and (force or (self.live < r.cap and self.live_input < r.input_cap)):
            return min(fs, key=self.fkey)
        if backs and not (r.flush and self.done_f < self.forwards):
            return min(backs, key=self.bkey)
        if ws:
            return min(ws, key=self.bkey)
        return None

    def ran(self, a) -> None:
        c, k, _ = a
        self.next[(c, k)] += 1
        self.order.append(a)
        last = self.last[c]
        if k == "F":
            self.done_f += 1
            if last is not None:
                self.live += 1
                self.live_input += 1
        if k in ("B", "I"):
            self.live_input -= 1
        if k == "I" and last == "W":
            self.waiting_w += 1
        if k == "W":
            self.waiting_w -= 1
        if k == last:
            self.live -= 1


def make_schedule(problem: Problem) -> Schedule:
    """Each process's actions under ``problem.schedule``'s rules (module docstring)."""
    m = problem.micro_batches
    by_chunks: dict = {}
    for pid in problem.processes():
        by_chunks.setdefault(problem.chunks_of(pid), []).append(pid)
    groups = [_Group(cs, pids, problem) for cs, pids in sorted(by_chunks.items())]
    holders_of = {c: [g for g in groups if c in g.chunks] for c in range(problem.chunks)}
    total = sum(len(problem.kinds[c]) * m * len(holders_of[c]) for c in range(problem.chunks))
    finish: dict = {}          # action -> when its last holder group finishes it
    count: dict = {}           # action -> holder groups that ran it
    done: dict = {}            # action -> finish time, once every holder group ran it
    state = {"ran": 0, "t": 0.0}

    def tick(force: bool) -> bool:
        """Let each free group start its next action at time t (with ``force``, the first
        group that can, past its caps); whether any started."""
        t, started = state["t"], False
        for g in groups:
            if g.free > t:
                continue
            ready = [a for a in g.heads(m)
                     if all(done.get((c, k, a[2]), t + 1) <= t
                            for c, k in problem.deps.get((a[0], a[1]), ()))]
            a = g.pick(ready, force)
            if a is None:
                continue
            end = t + COST[a[1]]
            g.free = end
            g.ran(a)
            finish[a] = max(finish.get(a, 0.0), end)
            count[a] = count.get(a, 0) + 1
            if count[a] == len(holders_of[a[0]]):
                done[a] = finish[a]
            state["ran"] += 1
            started = True
            if force:
                break
        return started

    while state["ran"] < total:
        if tick(False):
            continue
        later = [g.free for g in groups if g.free > state["t"]]
        if later:
            state["t"] = min(later)
            continue
        # nothing runs and nothing can: let a forward past its cap rather than stop
        if tick(True):
            continue
        heads = {g.pids[0]: [Action(c, k, mb) for c, k, mb in g.heads(m)][:3] for g in groups}
        raise PlanError("the pipeline's tasks depend on each other in a circle, so no "
                        "schedule can run them; waiting: " + "; ".join(
                            f"process {p} at {', '.join(map(str, h))}"
                            for p, h in heads.items() if h))
    orders = {}
    for g in groups:
        acts = tuple(Action(c, k, mb) for c, k, mb in g.order)
        for pid in g.pids:
            orders[pid] = acts
    return Schedule(problem.schedule, m, MappingProxyType(dict(sorted(orders.items()))))
