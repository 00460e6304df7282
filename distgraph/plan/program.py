"""One process's part of a plan, compiled: everything its rank runs, and nothing to decide.

A :class:`ProcessProgram` is made by the planner (:mod:`distgraph.passes.pipeline.compile`)
for each process it is asked for, and read by the runtime
(:mod:`distgraph.runtime.execution`): the compiled tasks (:class:`~.instructions.Block`
per chunk and task kind, the update, the prologue), the actions in the schedule's order
and which consecutive weight-gradient actions run as one (``batched``), the rows of each
input it reads per micro-batch, the communicator groups it meets, the tags of its
messages, and the gathers that bring fetched values and the state to every process.

Example::

    program = plan.program_of(1)
    [str(a) for a in program.actions]            # ['0F0', '0B0']
    program.feeds[0].rows                        # ((4, 8),): rows 4-8 of each batch
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType

from distgraph.plan.accumulation import Accumulation
from distgraph.plan.instructions import Block
from distgraph.plan.kinds import AccumulationMode
from distgraph.plan.local import LocalProgram
from distgraph.plan.tags import TagScheme


@dataclass(frozen=True)
class Feed:
    """Input ``name`` as this process reads it: ``rows``, the ``(start, stop)`` rows of
    the batch it reads, one range per micro-batch it runs in the order it runs them
    (None: a scalar, read whole); ``rest``, its slices along the dims after the first."""

    name: str
    rows: tuple | None
    rest: tuple


@dataclass(frozen=True)
class RowGather:
    """How a fetched value that carries samples comes back whole under an uneven split:
    each process pads its part (its micro-batches' parts joined) with zeros to ``pad``
    entries along ``axis``, the plan's gather brings the padded value of global shape
    ``shape`` to every process, and ``take`` lists, in the batch's order, the entries of
    the padded value along ``axis`` that hold the batch's rows.

    Example: rows 0-2 on one process and 3 on another, padded to 3 each: ``take`` is
    ``(0, 1, 2, 3)``; the padded value's entries 4 and 5 are padding."""

    value: str
    axis: int
    pad: int
    shape: tuple
    take: tuple


@dataclass(frozen=True)
class ProcessProgram:
    """Process ``process``'s part of a plan (module docstring). ``local`` is its local
    program; ``blocks[(chunk, kind)]`` its compiled per-micro-batch tasks, ``update`` and
    ``prologue`` (None: no points in a prologue) its once-per-step ones; ``actions`` the
    schedule's order; ``batched`` the runs of consecutive weight-gradient actions that
    run as one (tuples of action indices) and ``batched_tasks[key]`` how; ``env_slots``
    the micro-batches of a step in the task graph (the largest group's under an uneven
    split), ``micro_batches`` the number this process runs, ``batch_micro_batches`` the
    plan's count and ``positions`` where each of its micro-batches sits in the batch;
    ``prologue_ops`` the accumulation prologue's ops and ``prologue_sums`` the sums they
    make; ``step_ops`` the ops whose results the step makes once, before its first
    micro-batch, for all of them (:func:`~distgraph.plan.accumulation.made_once`: under
    amp the 16-bit copies of the parameters); ``accumulation`` the plan's (None without micro-batches) and ``source_of``
    which Value each local name holds; ``state_gathers[name]`` the point that brings
    persistable ``name`` whole to every process; ``first_chunk`` the lowest chunk it runs
    (where its sends and update are drawn in the timeline); ``starts`` where the
    update's reductions start during the backward
    (:class:`~distgraph.plan.buckets.StartAt`, ``Strategy(overlap=True)``) and
    ``prefetch[(chunk, kind)]`` the groups (instruction positions) of a task's ZeRO-3
    parameter gathers, each started while the group before it runs
    (:func:`~distgraph.plan.buckets.prefetch_groups`)."""

    process: int
    rank: int
    local: LocalProgram
    blocks: MappingProxyType
    update: Block
    prologue: Block | None
    actions: tuple
    batched: tuple
    batched_tasks: MappingProxyType
    env_slots: int
    micro_batches: int
    batch_micro_batches: int
    positions: tuple
    feeds: tuple
    batch_rows: tuple | None
    prologue_ops: tuple
    prologue_sums: frozenset
    accumulation: Accumulation | None
    source_of: MappingProxyType
    fetch: tuple
    row_gathers: MappingProxyType
    tags: TagScheme
    comm_groups: tuple
    state_gathers: MappingProxyType
    first_chunk: int = 0
    persistables: frozenset = field(default_factory=frozenset)
    step_ops: tuple = ()
    starts: tuple = ()
    prefetch: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))

    def mode(self, name: str) -> AccumulationMode:
        """How local value ``name`` combines over the micro-batches."""
        if self.accumulation is None:
            return AccumulationMode.KEEP
        return self.accumulation.mode(self.source_of.get(name, name))

    def split_axis(self, value: str) -> int:
        """The sample dim of Value ``value`` (one that carries samples)."""
        return self.accumulation.split_axis[value]

    def all_blocks(self) -> list:
        """(key, Block) of every compiled task, the update under "update", in order."""
        return list(self.blocks.items()) + [("update", self.update)]
