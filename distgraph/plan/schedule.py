"""The schedule as a value: each process's compute actions, in the order it runs them.

An :class:`Action` is one task instance: a *chunk* (a piece of the forward along the data
flow, torch.distributed.pipelining's stage index: with ``virtual_stages`` chunk ``c``
runs on stage mesh ``c mod S``, under ZBV process ``p`` holds chunks ``p`` and
``2S-1-p``), a kind — ``F`` forward, ``B`` whole backward, ``I`` input gradient, ``W``
weight gradient — and a micro-batch; ``str`` gives torch's notation (``"0F3"``). The
planner makes the :class:`Schedule` and checks that it completes
(:mod:`distgraph.passes.pipeline.schedule`); the runtime runs ``schedule.of(pid)``.

Example::

    >>> Action.parse("1W0"), Action.parse("1W0").task
    (1W0, <TaskKind.BACKWARD_WEIGHT: 'backward_weight'>)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import MappingProxyType

from distgraph.errors import PlanError
from distgraph.plan.kinds import TaskKind

LETTERS = ("F", "B", "I", "W")
_ACTION = re.compile(r"^(\d+)([FBIW])(\d+)$")


@dataclass(frozen=True, order=True, repr=False)
class Action:
    """Chunk ``chunk`` runs its ``kind`` task (a letter of :data:`LETTERS`) on
    micro-batch ``micro_batch``; printed as torch prints its actions (``0F3``)."""

    chunk: int
    kind: str
    micro_batch: int

    def __post_init__(self):
        if self.kind not in LETTERS:
            raise PlanError(f"an action's kind is one of {LETTERS}, not {self.kind!r}")

    def __str__(self) -> str:
        return f"{self.chunk}{self.kind}{self.micro_batch}"

    __repr__ = __str__

    @property
    def task(self) -> TaskKind:
        """The task kind it runs (``forward``, ``backward``, ...)."""
        return TaskKind.of_action(self.kind)

    @classmethod
    def parse(cls, text: str) -> "Action":
        """``Action.parse("1W0")`` == ``Action(1, "W", 0)``."""
        match = _ACTION.match(text.strip())
        if match is None:
            raise PlanError(f"{text!r} is not an action: write chunk, F/B/I/W, micro-batch "
                            f"(e.g. '0F3')")
        return cls(int(match[1]), match[2], int(match[3]))


@dataclass(frozen=True)
class Schedule:
    """``orders[pid]``: the actions process ``pid`` runs, in order (a tuple)."""

    name: str
    micro_batches: int
    orders: MappingProxyType

    def of(self, pid: int) -> tuple:
        return self.orders.get(pid, ())

    def as_dict(self) -> dict:
        """{process id: [Action, ...]} (what ``Plan.schedule()`` returns)."""
        return {pid: list(acts) for pid, acts in sorted(self.orders.items())}

    def pretty(self, limit: int = 48) -> str:
        """One line per process (processes with the same order share a line); at most
        ``limit`` actions each, then how many more."""
        lines: dict = {}
        for pid, acts in sorted(self.orders.items()):
            lines.setdefault(acts, []).append(pid)
        out = [f"schedule {self.name}, {self.micro_batches} micro-batch(es):"]
        for acts, pids in lines.items():
            shown = " ".join(map(str, acts[:limit]))
            more = f" ... (+{len(acts) - limit})" if len(acts) > limit else ""
            who = "process" if len(pids) == 1 else "processes"
            out.append(f"  {who} {', '.join(map(str, pids))}: {shown}{more}")
        return "\n".join(out)
