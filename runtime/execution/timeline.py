"""Timeline of a pipelined run: what every rank computed and sent, and when.

Each :class:`Event` is one task instance (``forward``, ``backward`` or, split,
``backward_input`` / ``backward_weight``, ``update``) or one message (``send``: posted
until delivered; ``recv``: posted until every tile of a micro-batch arrived), with
the rank, the chunk it ran (``Action.chunk``, torch's stage index, in the field
``stage``; for sends and the update the rank's lowest chunk), the micro-batch (None for
the update), the step and start and end in seconds since the job's profiling started
(every rank's clock starts at one barrier). A :class:`MemorySample` after each task
(the update too) records the activations the rank keeps between tasks and the bytes of
every array it holds (:mod:`.memory`: state, activations, gradients, buffers), now and
at their highest during the task; :meth:`Timeline.peak_memory` gives each rank's peak
and the action that reached it.

:meth:`Timeline.gather` merges every rank's records (a collective), so every rank holds
the whole timeline; :meth:`save` writes a Chrome trace (open it in Perfetto or
chrome://tracing) and :meth:`plot` a per-rank Gantt chart (needs matplotlib, the
``plot`` extra).

Example::

    tl = engine.timeline()
    tl.save("t.json"); tl.plot("t.png")
    tl.idle_fraction()          # {rank: idle share of the pipeline's span}
    tl.peak_memory(step=1)      # {rank: the sample of its peak}: .peak, .action
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np

from distgraph.errors import DistGraphError
from distgraph.plan.kinds import PER_MICRO_BATCH, ItemKind, TaskKind

EVENT_KINDS = (*PER_MICRO_BATCH, TaskKind.UPDATE, ItemKind.SEND, ItemKind.RECV)
COMPUTE_KINDS = PER_MICRO_BATCH
COMM_KINDS = (ItemKind.SEND, ItemKind.RECV)
_COLORS = {"forward": "#4c9be8", "backward": "#e8874c", "backward_input": "#e8874c",
           "backward_weight": "#b05cc6", "update": "#59a14f", "send": "#9c9c9c",
           "recv": "#c9c9c9"}


@dataclass(frozen=True)
class Event:
    rank: int
    stage: int
    kind: str
    micro_batch: int | None
    step: int
    start: float
    end: float
    peer: int | None = None       # the other rank of a send or receive

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class MemorySample:
    """After a task (``kind`` on chunk ``stage`` and micro-batch ``micro_batch``; the
    update: None) on ``rank``: ``bytes`` of activations held for later tasks, by
    ``micro_batches`` micro-batches; ``held``: the bytes of every array the rank holds
    then; ``peak``: the most it held during the task (and the receives posted for it)."""

    rank: int
    stage: int
    step: int
    time: float
    bytes: int
    micro_batches: int
    held: int = 0
    peak: int = 0
    kind: str = "forward"
    micro_batch: int | None = None

    @property
    def action(self) -> str:
        """The task in the schedule's notation (``"0F3"``), or ``"update"``."""
        if self.micro_batch is None:
            return str(self.kind)
        return f"{self.stage}{TaskKind(self.kind).action}{self.micro_batch}"


class Timeline:
    """Events and memory samples of one or more ranks (see the module docstring)."""

    def __init__(self, events=(), memory=()):
        self.events = sorted(events, key=lambda e: (e.start, e.rank))
        self.memory = sorted(memory, key=lambda s: (s.time, s.rank))

    def __len__(self) -> int:
        return len(self.events)

    @property
    def ranks(self) -> list:
        return sorted({e.rank for e in self.events} | {s.rank for s in self.memory})

    @property
    def steps(self) -> list:
        return sorted({e.step for e in self.events})

    # -- merging --------------------------------------------------------------------------
    @classmethod
    def gather(cls, events, memory, comm) -> "Timeline":
        """Every rank's raw records merged, on every rank (a collective over ``comm``'s
        world; ``comm`` None: this process alone). ``events`` are tuples (rank, chunk,
        kind, micro-batch, step, start, end, peer); ``memory`` tuples (rank, chunk,
        step, time, bytes, micro-batches, held, peak, kind, micro-batch)."""
        ev = np.array([(r, s, EVENT_KINDS.index(k), -1 if m is None else m, st, a, b,
                        -1 if p is None else p) for r, s, k, m, st, a, b, p in events],
                      dtype=np.float64).reshape(-1, 8)
        mem = np.array([(*row[:8], EVENT_KINDS.index(row[8]), -1 if row[9] is None
                         else row[9]) for row in memory], dtype=np.float64).reshape(-1, 10)
        if comm is not None and comm.size > 1:
            ev, mem = _all_rows(comm, ev), _all_rows(comm, mem)
        out_events = [Event(int(r), int(s), EVENT_KINDS[int(k)], None if m < 0 else int(m),
                            int(st), float(a), float(b), None if p < 0 else int(p))
                      for r, s, k, m, st, a, b, p in ev]
        out_memory = [MemorySample(int(r), int(s), int(st), float(t), int(b), int(n), int(h),
                                   int(pk), EVENT_KINDS[int(k)], None if m < 0 else int(m))
                      for r, s, st, t, b, n, h, pk, k, m in mem]
        return cls(out_events, out_memory)

    # -- measures -----------------------------------------------------------------------------
    def window(self, step: int) -> tuple:
        """(start, end) of ``step``'s pipeline: the first forward to the last backward
        over all ranks (the update is left out: it is no part of the schedule)."""
        comp = [e for e in self.events if e.step == step and e.kind in COMPUTE_KINDS]
        if not comp:
            raise DistGraphError(f"the timeline has no forward or backward of step {step}")
        return min(e.start for e in comp), max(e.end for e in comp)

    def idle_fraction(self, step: int | None = None) -> dict:
        """{rank: share of the pipeline window its forwards and backwards leave idle},
        averaged over ``step`` or every step: the measured bubble."""
        steps = self.steps if step is None else [step]
        out = {}
        for rank in self.ranks:
            fractions = []
            for st in steps:
                a, b = self.window(st)
                busy = sum(e.duration for e in self.events
                           if e.step == st and e.rank == rank and e.kind in COMPUTE_KINDS)
                fractions.append(1.0 - busy / (b - a))
            out[rank] = float(np.mean(fractions))
        return out

    def peak_activations(self, step: int | None = None) -> dict:
        """{rank: (peak bytes, peak micro-batches)} of activations held between tasks."""
        out = {}
        for s in self.memory:
            if step is not None and s.step != step:
                continue
            b, n = out.get(s.rank, (0, 0))
            out[s.rank] = (max(b, s.bytes), max(n, s.micro_batches))
        return out

    def peak_memory(self, step: int | None = None) -> dict:
        """{rank: the sample of the task in which the rank held the most bytes} in
        ``step`` or over every step: its ``peak`` bytes and ``action``."""
        out = {}
        for s in self.memory:
            if (step is None or s.step == step) and (s.rank not in out
                                                     or s.peak > out[s.rank].peak):
                out[s.rank] = s
        return out

    # -- output ---------------------------------------------------------------------------------
    def to_chrome(self) -> dict:
        """The Chrome trace-event form: one process per rank, compute on thread 0 and
        messages on thread 1, memory as a counter."""
        trace = []
        chunks: dict = {}
        for e in self.events:
            chunks.setdefault(e.rank, set()).add(e.stage)
        for rank in self.ranks:
            trace.append({"name": "process_name", "ph": "M", "pid": rank,
                          "args": {"name": f"rank {rank} ({_chunks(chunks.get(rank))})"}})
            trace.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": 0,
                          "args": {"name": "compute"}})
            trace.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": 1,
                          "args": {"name": "messages"}})
        for e in self.events:
            name = e.kind if e.micro_batch is None else f"{e.kind} {e.micro_batch}"
            trace.append({"name": name, "cat": e.kind, "ph": "X", "pid": e.rank,
                          "tid": 1 if e.kind in COMM_KINDS else 0,
                          "ts": e.start * 1e6, "dur": max(e.duration, 0.0) * 1e6,
                          "args": asdict(e)})
        for s in self.memory:
            trace.append({"name": "activations", "ph": "C", "pid": s.rank, "ts": s.time * 1e6,
                          "args": {"bytes": s.bytes, "micro_batches": s.micro_batches}})
            trace.append({"name": "memory", "ph": "C", "pid": s.rank, "ts": s.time * 1e6,
                          "args": {"held": s.held, "peak": s.peak}})
        return {"traceEvents": trace, "displayTimeUnit": "ms"}

    def save(self, path) -> None:
        """Write the Chrome trace JSON to ``path``."""
        with open(path, "w") as f:
            json.dump(self.to_chrome(), f)

    def plot(self, path, step: int | None = None) -> None:
        """A Gantt chart, one row per rank (messages in a thinner row under it), of every
        step or of ``step``, written to ``path`` (PNG, SVG, ... by its suffix)."""
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise DistGraphError("Timeline.plot needs matplotlib: pip install "
                                 "'distgraph[plot]' (or pip install matplotlib); "
                                 "Timeline.save writes a Chrome trace without it") from None
        events = [e for e in self.events if step is None or e.step == step]
        if not events:
            raise DistGraphError("the timeline has no events to plot")
        t0 = min(e.start for e in events)
        ranks = self.ranks
        fig, ax = plt.subplots(figsize=(12, 0.9 * len(ranks) + 1.2))
        for row, rank in enumerate(ranks):
            y = len(ranks) - 1 - row
            for e in events:
                if e.rank != rank:
                    continue
                comm = e.kind in COMM_KINDS
                lo, height = (y - 0.42, 0.18) if comm else (y - 0.2, 0.55)
                ax.broken_barh([((e.start - t0) * 1e3, max(e.duration, 0) * 1e3)],
                               (lo, height), facecolors=_COLORS[e.kind], edgecolor="black",
                               linewidth=0.3)
                if not comm and e.micro_batch is not None:
                    ax.text((e.start - t0 + e.duration / 2) * 1e3, y + 0.07, str(e.micro_batch),
                            ha="center", va="center", fontsize=7)
        ax.set_yticks(range(len(ranks)))
        ax.set_yticklabels([f"rank {r}" for r in reversed(ranks)])
        ax.set_xlabel("time (ms)")
        kinds = [k for k in EVENT_KINDS if any(e.kind == k for e in events)]
        ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=_COLORS[k]) for k in kinds],
                  labels=kinds, loc="upper right", fontsize=7, ncol=len(kinds))
        ax.set_title("pipeline timeline (number: micro-batch)")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def _chunks(chunks) -> str:
    """``"chunk 1"``, ``"chunks 1, 5"`` (virtual stages), ``"chunk ?"`` (no events)."""
    if not chunks:
        return "chunk ?"
    return f"chunk{'s' if len(chunks) > 1 else ''} {', '.join(map(str, sorted(chunks)))}"


def _all_rows(comm, rows):
    """Every rank's rows (a float64 [n, k] array, n per rank) stacked in rank order."""
    world = tuple(range(comm.size))
    counts = comm.all_gather(np.array([rows.shape[0]], dtype=np.float64), world)
    width = rows.shape[1]
    most = int(counts.max())
    padded = np.zeros((most, width))
    padded[:rows.shape[0]] = rows
    everyone = comm.all_gather(padded, world, axis=0).reshape(comm.size, most, width)
    return np.concatenate([everyone[r, :int(counts[r])] for r in range(comm.size)])
