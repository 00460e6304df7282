"""The task graph: what each process runs per micro-batch, and what flows between tasks.

Per chunk of the forward (torch's *stage* index; with virtual stages several chunks share
a stage mesh) a process has a ``forward`` and a ``backward`` task (or, under the
zero-bubble schedules, ``backward_input`` and ``backward_weight``), each run once per
micro-batch; one ``update`` per step; and under an uneven split by micro-batches a
``prologue``. A task is a list of :class:`Item`: a local op, a reshard point run in place,
the send or receive half of a point that crosses tasks, or the gather of a fetched value.
The planner builds the graph (:mod:`distgraph.passes.pipeline.task_graph`); the schedule
is made from ``deps`` and checked against it.

Example::

    graph = dg.passes.plan(built, dg.Strategy(micro_batches=4)).task_graph()
    print(graph.pretty())
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from distgraph.plan.kinds import ItemKind, StepKind, TaskKind, collective_bytes
from distgraph.plan.tags import TagScheme

COMMUNICATING = (ItemKind.POINT, ItemKind.SEND, ItemKind.RECV)


@dataclass(frozen=True)
class Item:
    """One item of a task: ``op`` (local op ``index``), ``point`` (reshard point ``index``
    = its seq, run in place), ``send`` / ``recv`` (the two halves of a point crossing
    chunks) or ``gather`` (fetched value number ``index``, in the update)."""

    kind: ItemKind
    index: int

    def __str__(self) -> str:
        return f"{self.kind}#{self.index}"


@dataclass(frozen=True)
class Task:
    """Process ``process``'s ``kind`` task of chunk ``chunk`` (None: the update and the
    prologue). ``accumulates``: names it makes that the update reads (accumulated over
    the micro-batches)."""

    process: int
    chunk: int | None
    kind: TaskKind
    items: tuple
    accumulates: tuple = ()

    @property
    def key(self) -> tuple:
        return (self.chunk, self.kind)

    @property
    def per_micro_batch(self) -> bool:
        return self.kind.per_micro_batch

    def __str__(self) -> str:
        where = "" if self.chunk is None else f" of chunk {self.chunk}"
        return f"{self.kind}{where} (process {self.process})"


@dataclass(frozen=True)
class Flow:
    """Tiles of reshard points ``points`` go from task ``src`` to task ``dst`` (each a
    (process, chunk, kind) triple) in every micro-batch."""

    src: tuple
    dst: tuple
    points: tuple

    def __str__(self) -> str:
        return (f"{self.src[0]}:{self.src[2]}@{self.src[1]} -> "
                f"{self.dst[0]}:{self.dst[2]}@{self.dst[1]} points {list(self.points)}")


@dataclass(frozen=True)
class TaskGraph:
    """Tasks of every process and what flows between them. ``schedule``: the schedule's
    name; ``stages``: the stage meshes; ``chunks[c]``: the mesh chunk ``c`` runs on;
    ``deps[(c, letter)]``: the (chunk, action letter) pairs it reads in the same
    micro-batch; ``points[seq]``: every reshard point (as the first process that runs it
    holds it); ``tags``: the tag scheme; ``fetch``: the values every process receives
    after a step, ``gathers[pid]`` the reshard points that bring them."""

    schedule: str
    micro_batches: int
    virtual: int
    stages: tuple
    chunks: tuple
    tasks: tuple
    flows: tuple
    deps: MappingProxyType
    points: MappingProxyType
    tags: TagScheme
    fetch: tuple
    gathers: MappingProxyType

    def __post_init__(self):
        # each process's tasks, indexed once: a scan of every task per process is
        # quadratic (a 16,384-process plan holds 278,528 tasks)
        by_process: dict = {}
        for t in self.tasks:
            by_process.setdefault(t.process, {})[t.key] = t
        object.__setattr__(self, "_by_process", by_process)

    def tasks_of(self, process: int) -> dict:
        """{(chunk, kind): Task} of ``process``; the update under (None, "update")."""
        return dict(self._by_process.get(process, {}))

    def processes(self) -> list:
        return sorted({t.process for t in self.tasks})

    def step_bytes(self, local, process: int, micro_batches: int) -> dict:
        """Bytes ``process`` sends in one step, by kind: each reshard point and each op's
        own collectives once per micro-batch in a per-micro-batch task (``micro_batches``
        of them), once in the update (the fetched values' gathers left out, as in
        ``LocalProgram.bytes_sent``). ``local``: the process's local program, or one of
        its group's (their ops communicate alike)."""
        sent: dict = {}
        for task in self.tasks_of(process).values():
            times = micro_batches if task.per_micro_batch else 1
            for it in task.items:
                if it.kind in COMMUNICATING:        # each half counts its own
                    for step in self.points[it.index].steps:
                        b = step.bytes_sent_by(process)
                        if b:
                            sent[step.kind] = sent.get(step.kind, 0.0) + times * b
                elif it.kind is ItemKind.OP:
                    for kind, n, nbytes in local.op_comm.get(it.index, ()):
                        kind = StepKind.parse(kind)
                        sent[kind] = sent.get(kind, 0.0) + times * float(
                            collective_bytes(kind, n, nbytes))
        return sent

    def pretty(self) -> str:
        lines = [f"TaskGraph: schedule {self.schedule}, {self.micro_batches} micro-batch(es), "
                 f"{len(self.stages)} stage mesh(es), {len(self.chunks)} chunk(s)"]
        for c, mesh in enumerate(self.chunks):
            lines.append(f"  chunk {c} on {list(mesh.process_ids)}")
        for pid in self.processes():
            lines.append(f"  process {pid}:")
            for task in self.tasks_of(pid).values():
                counts: dict = {}
                for it in task.items:
                    counts[it.kind] = counts.get(it.kind, 0) + 1
                what = ", ".join(f"{n} {k}" for k, n in counts.items()) or "nothing"
                per = "per micro-batch" if task.per_micro_batch else "once"
                where = "" if task.chunk is None else f" {task.chunk}"
                lines.append(f"    {task.kind + where:<18} {per:<15} {what}")
                for it in task.items:
                    if it.kind in (ItemKind.SEND, ItemKind.RECV):
                        p = self.points[it.index]
                        lines.append(f"      {it.kind} {p.value} {p.src.spec} -> {p.dst.spec}"
                                     f" (point {it.index})")
                if task.accumulates:
                    lines.append(f"      accumulates {', '.join(task.accumulates)}")
        lines.append("  flows:")
        lines.extend(f"    {f}" for f in self.flows)
        return "\n".join(lines)
