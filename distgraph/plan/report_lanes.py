"""The pipeline's timeline in a plan's report: one lane per stage as the estimate
predicts it, one per rank as a run measured it.

**Predicted** (:func:`predicted`). The estimate gives each process the seconds its step
spends in each task (``ProcessEstimate.tasks``: the prices of the ops, reshard points and
collectives the task runs). An action of chunk ``c`` (``F``, ``B``, ``I``, ``W`` of a
micro-batch) lasts its task's seconds over the micro-batches, at the slowest process
that holds the chunk (processes meet at every collective); the plan's schedule is
replayed with those durations (:func:`~distgraph.plan.replay.replay`: an action starts
when its inputs are done and its processes are free), so each lane shows when the
stage's actions run, how much of each is communication, and where it waits: the
bubble. Whole-batch sums that belong to no task (each stage's prologue) end before the
first action of any stage; each stage's update follows its last action. The lanes end at
the replayed step, which the page shows beside the estimate's step time (the estimate
sums the stages' work by a closed form, :mod:`distgraph.passes.cost.estimate`; the two
agree where the stages are even).

**Measured** (:func:`measured`): the runtime's timeline of a run
(``engine.timeline()`` with ``Strategy(profile=True)``, or the Chrome trace
``Timeline.save`` wrote): its last step, one lane per rank, each task and message where
it ran.

Example::

    predicted(plan, plan.estimate)["lanes"][0]["spans"][:2]
    # [[0.0, 0.0123, 0, 0, 0, 0.0002], [0.0123, 0.0123, 0, 0, 1, 0.0002]]
    #   start, seconds, kind (F B I W), chunk, micro-batch, of which communication
"""

from __future__ import annotations

import json
import math

from distgraph.errors import DistGraphError
from distgraph.plan.kinds import TaskKind
from distgraph.plan.protocols import TimelineLike
from distgraph.plan.replay import problem_of, replay
from distgraph.units import fmt_ids

LETTERS = "FBIW"
MEASURED_KINDS = ("forward", "backward", "backward_input", "backward_weight", "update",
                  "send", "recv")
MEASURED_LANES = 64      # ranks drawn at most; the rest counted
DIGITS = 6


def _r(x: float) -> float:
    return float(f"{x:.{DIGITS}g}") if math.isfinite(x) else 0.0


def predicted(plan, estimate) -> dict | None:
    """The stages' lanes at the estimate's seconds (module docstring); None where the
    plan has no schedule or the estimate no seconds by task."""
    if plan.graph is None or plan.order is None or \
            not any(p.tasks for p in estimate.processes):
        return None
    per: dict = {}       # (chunk, letter) -> (seconds a run, of which communication)
    after: dict = {}     # stage -> its update's seconds (its slowest process)
    first: dict = {}     # stage -> its prologue's seconds (its slowest process)
    seen: set = set()
    for p in estimate.processes:
        runs = plan.micro_batches_of(p.process)
        alike = (id(p.tasks), runs, p.stage)      # processes estimated alike share tasks
        if alike in seen:
            continue
        seen.add(alike)
        for t in p.tasks:
            kind = TaskKind(t.kind)
            total = t.compute + t.communication
            if kind.per_micro_batch:
                key = (t.chunk, kind.action)
                if total / runs > per.get(key, (-1.0,))[0]:
                    per[key] = (total / runs, t.communication / runs)
            else:
                into = after if kind is TaskKind.UPDATE else first
                into[p.stage] = max(into.get(p.stage, 0.0), total)
    problem = problem_of(plan.graph)
    seconds = {(c, k): per.get((c, k), (0.0,))[0]
               for c in range(problem.chunks) for k in problem.kinds[c]}
    finish = replay(plan.order.orders, problem, seconds).finish
    before = max(first.values(), default=0.0)   # the schedule starts after every prologue
    lanes = []
    for s, mesh in enumerate(plan.stages):
        for acts, pids in _by_order(plan, mesh.process_ids):
            spans = []
            for a in acts:
                key = (a.chunk, a.kind)
                took, comm = per.get(key, (0.0, 0.0))
                spans.append([_r(before + finish[a] - took), _r(took),
                              LETTERS.index(a.kind), a.chunk, a.micro_batch, _r(comm)])
            end = before + max((finish[a] for a in acts), default=0.0)
            own = first.get(s, 0.0)
            lanes.append({"stage": s, "processes": fmt_ids(pids, limit=4), "spans": spans,
                          "prologue": [_r(before - own), _r(own)],
                          "update": [_r(end), _r(after.get(s, 0.0))],
                          "busy": _r(own + sum(x[1] for x in spans) + after.get(s, 0.0))})
    makespan = max((lane["update"][0] + lane["update"][1] for lane in lanes), default=0.0)
    return {"lanes": lanes, "makespan": makespan, "step_time": estimate.step_time,
            "micro_batches": plan.micro_batches, "schedule": plan.order.name}


def _by_order(plan, pids) -> list:
    """[(order, processes)] of ``pids`` grouped by the order they run (the processes of
    a group share one tuple: grouped by identity first, then by value)."""
    by_id: dict = {}
    for q in pids:
        acts = plan.order.of(q)
        by_id.setdefault(id(acts), (acts, []))[1].append(q)
    out: dict = {}
    for acts, members in by_id.values():
        out.setdefault(tuple(acts), []).extend(members)
    return [(acts, sorted(members)) for acts, members in out.items()]


def measured(plan, timeline) -> dict:
    """The last step of a run's ``timeline`` (a
    :class:`~distgraph.plan.protocols.TimelineLike`, or the path of its Chrome trace), one
    lane per rank (module docstring)."""
    events = _events(timeline)
    compute = [e for e in events if e["kind"] in MEASURED_KINDS[:4]]
    if not compute:
        raise DistGraphError("the timeline has no forward or backward task to show: give "
                             "the timeline of a run that trained a step with "
                             "Strategy(profile=True) (engine.timeline())")
    step = max(e["step"] for e in compute)
    mine = [e for e in events if e["step"] == step and e["kind"] in MEASURED_KINDS]
    t0 = min(e["start"] for e in mine if e["kind"] in MEASURED_KINDS[:4])
    ranks = sorted({e["rank"] for e in mine})
    lanes = []
    for rank in ranks[:MEASURED_LANES]:
        process = plan.ranks.process(rank) if plan.distributed else 0
        stage = next((s for s, m in enumerate(plan.stages) if process in m.process_ids), -1)
        spans = [[_r(e["start"] - t0), _r(e["end"] - e["start"]),
                  MEASURED_KINDS.index(e["kind"]), e["stage"],
                  -1 if e["micro_batch"] is None else e["micro_batch"]]
                 for e in mine if e["rank"] == rank]
        lanes.append({"rank": rank, "process": process, "stage": stage, "spans": spans})
    end = max(e["end"] for e in mine) - t0
    return {"step": step, "lanes": lanes, "hidden": len(ranks) - len(lanes),
            "makespan": _r(end), "kinds": list(MEASURED_KINDS)}


def _events(timeline) -> list:
    """The events of ``timeline`` as dicts (rank, stage, kind, micro_batch, step, start,
    end): a Timeline's, or those of the Chrome trace at a path."""
    if isinstance(timeline, TimelineLike):
        return [{k: getattr(e, k) for k in ("rank", "stage", "kind", "micro_batch", "step",
                                            "start", "end")} for e in timeline.events]
    path = timeline
    try:
        with open(path, encoding="utf-8") as f:
            trace = json.load(f)
        events = [ev["args"] for ev in trace["traceEvents"] if ev.get("ph") == "X"]
        return [{k: ev[k] for k in ("rank", "stage", "kind", "micro_batch", "step", "start",
                                    "end")} for ev in events]
    except (OSError, TypeError) as e:
        raise DistGraphError(f"cannot read the timeline {path!r}: {e}; give "
                             "engine.timeline() or the file Timeline.save(path) wrote") from None
    except (ValueError, KeyError) as e:
        raise DistGraphError(f"{path} is not a timeline Timeline.save wrote (no task events "
                             f"with their rank, stage, kind, micro-batch and times: {e!r}); "
                             "give engine.timeline() or the file Timeline.save(path) "
                             "wrote") from None
