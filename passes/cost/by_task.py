"""The seconds of a process's step by the task that spends them.

The estimate (:mod:`distgraph.passes.cost.estimate`) prices every op, reshard point and
collective of a process once; :class:`TaskSpent` adds each price, as often as the step
runs it, to the task of the plan's task graph that runs it. So the tasks' seconds add up
to the process's compute and communication, and a plan's report lays the schedule out
in time at the estimate's own prices (``ProcessEstimate.tasks``).

Example::

    est = dg.passes.estimate(plan, cluster)
    est.processes[0].tasks    # (TaskSeconds(chunk=0, kind='forward', compute=..., ...), ...)
"""

from __future__ import annotations

from dataclasses import dataclass

from distgraph.plan.kinds import ItemKind, TaskKind


@dataclass(frozen=True)
class TaskSeconds:
    """Seconds a step spends in one of a process's tasks: its chunk (None: the update,
    the prologue), kind (``forward``, ``backward``, ``backward_input``,
    ``backward_weight``, ``update``, ``prologue``: what runs before the step's first task
    and belongs to none), compute and communication, over all its runs (a task of the
    micro-batches runs once per micro-batch). Feeding the inputs counts in the first
    chunk's forward."""

    chunk: int | None
    kind: str
    compute: float
    communication: float


class TaskSpent:
    """The seconds of each task of process ``pid`` (:class:`TaskSeconds`), as the
    estimate adds them up: each op, reshard point and op collective in the task the
    plan's task graph runs it in, an op of no task in the prologue (none without a task
    graph: the planner prices plans before it builds one). ``add`` takes the key that
    ``of_op``, ``of_point``, ``first_forward`` or ``update`` gives (None: no task,
    nothing added)."""

    def __init__(self, plan, pid: int):
        self.items: dict = {}        # ("op" | "point", index) -> the task's (chunk, kind)
        self.spent: dict = {}        # (chunk, kind) -> [compute, communication]
        self.first_forward = self.update = self.prologue = None
        graph = plan.graph
        if graph is None:
            return
        for key, task in graph.tasks_of(pid).items():
            self.spent[key] = [0.0, 0.0]
            for it in task.items:
                self.items.setdefault(("op" if it.kind is ItemKind.OP else "point",
                                       it.index), key)
        forwards = [c for c, kind in self.spent if kind is TaskKind.FORWARD]
        self.first_forward = (min(forwards), TaskKind.FORWARD) if forwards else None
        self.update = next((k for k in self.spent if k[1] is TaskKind.UPDATE), None)
        self.prologue = (None, TaskKind.PROLOGUE)

    def of_op(self, index: int):
        return self.items.get(("op", index), self.prologue)

    def of_point(self, seq: int):
        return self.items.get(("point", seq), self.prologue)

    def add(self, key, compute: float, communication: float) -> None:
        if key is not None and (key in self.spent or compute or communication):
            spent = self.spent.setdefault(key, [0.0, 0.0])
            spent[0] += compute
            spent[1] += communication

    def seconds(self) -> tuple:
        return tuple(TaskSeconds(c, str(kind), a, b)
                     for (c, kind), (a, b) in self.spent.items())
