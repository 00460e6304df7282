"""The kinds of the plan contract, as enums, and the bytes formula of a collective.

Each is a ``str`` enum: a member equals, hashes and prints as its value
(``StepKind.ALL_GATHER == "all_gather"``), so plans print and serialise as before while
code compares members, never spelled strings.

=============== ====================================== ===============================
step kind       B (``nbytes``) is                      bytes sent per process
=============== ====================================== ===============================
all_gather      the gathered (output) local buffer     (n-1)/n * B
reduce_scatter  the input local buffer                 (n-1)/n * B
all_reduce      the local buffer                       2 (n-1)/n * B
all_to_all      the local buffer (input = output size) (n-1)/n * B
send_recv       the message                            B
slice           (local)                                0
make_partial    (local)                                0
=============== ====================================== ===============================

all_to_all is n-1 rounds in which each process sends one of its n chunks (B/n bytes) to
a different peer. An op may run it with variable counts per pair (:data:`ALL_TO_ALLV`,
MoE's dropless dispatch): it declares its buffer at the expected load and takes
all_to_all's formula; only its software cost is calibrated apart. The reshard planner's step bytes and the communicators' byte counters
both use :func:`collective_bytes`, so a plan's bytes are what the runtime counts.

Example::

    >>> collective_bytes(StepKind.ALL_GATHER, 4, 4096)   # 4 x 1 KiB pieces -> 4 KiB
    3072.0
    >>> StepKind("all_to_all").is_collective
    True
"""

from __future__ import annotations

from distgraph.errors import PlanError
from distgraph.ir import Kind

class StepKind(Kind):
    """One step of a reshard (:class:`~distgraph.plan.reshard.ReshardStep`)."""

    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    ALL_TO_ALL = "all_to_all"
    SLICE = "slice"
    MAKE_PARTIAL = "make_partial"
    SEND_RECV = "send_recv"

    @classmethod
    def parse(cls, kind) -> "StepKind":
        """``kind`` as a StepKind (:data:`ALL_TO_ALLV` is an all_to_all); a PlanError
        naming the known kinds for anything else."""
        if kind.__class__ is cls:       # already one (every step and price asks)
            return kind
        if kind == ALL_TO_ALLV:
            return cls.ALL_TO_ALL
        try:
            return cls(kind)
        except ValueError:
            raise PlanError(f"unknown communication kind {kind!r}; known kinds are "
                            f"{[k.value for k in cls]}") from None

    @property
    def is_collective(self) -> bool:
        return self in COLLECTIVES

    @property
    def is_local(self) -> bool:
        return self in (StepKind.SLICE, StepKind.MAKE_PARTIAL)


ALL_TO_ALLV = "all_to_allv"
"""An op's all-to-all with variable counts per pair (``Communicator.all_to_allv``): priced
by all_to_all's formula at the declared (expected) buffer, and by its own measured
software cost (``distgraph cluster calibrate``)."""

RING_ROUND = "ring_round"
"""The ``reshard_overhead`` entry of a device that gives the µs each further round of a
collective's ring costs beyond a 2-process step's (``distgraph cluster calibrate``,
measured on groups of 2 and of every rank); without it each round costs a 2-process
step's µs (:func:`~distgraph.passes.cost.prices.software_time`)."""

COLLECTIVES = (StepKind.ALL_GATHER, StepKind.REDUCE_SCATTER, StepKind.ALL_REDUCE,
               StepKind.ALL_TO_ALL)
"""The collectives over a mesh dim's group, the one list."""


class TaskKind(Kind):
    """What a task of the task graph runs (:mod:`distgraph.plan.tasks`)."""

    FORWARD = "forward"
    BACKWARD = "backward"
    BACKWARD_INPUT = "backward_input"      # zero bubble's I: gradients towards the inputs
    BACKWARD_WEIGHT = "backward_weight"    # zero bubble's W: parameter gradients only
    UPDATE = "update"                      # once per step, after the micro-batches
    PROLOGUE = "prologue"                  # whole-batch sums before the step's tasks

    @property
    def per_micro_batch(self) -> bool:
        return self in PER_MICRO_BATCH

    @property
    def action(self) -> str:
        """The letter of torch.distributed.pipelining's actions (F, B, I, W)."""
        return _ACTION_LETTER[self]

    @classmethod
    def of_action(cls, letter: str) -> "TaskKind":
        return {v: k for k, v in _ACTION_LETTER.items()}[letter]


PER_MICRO_BATCH = (TaskKind.FORWARD, TaskKind.BACKWARD, TaskKind.BACKWARD_INPUT,
                   TaskKind.BACKWARD_WEIGHT)
_ACTION_LETTER = {TaskKind.FORWARD: "F", TaskKind.BACKWARD: "B",
                  TaskKind.BACKWARD_INPUT: "I", TaskKind.BACKWARD_WEIGHT: "W"}


class ItemKind(Kind):
    """One item of a task: a local op, a reshard point run in place, the send or the
    receive half of a point that crosses tasks, or the gather of a fetched value."""

    OP = "op"
    POINT = "point"
    SEND = "send"
    RECV = "recv"
    GATHER = "gather"


class AccumulationMode(Kind):
    """How a value the update reads combines over the micro-batches."""

    SUM = "sum"          # a sum over the samples (a gradient): added up
    CONCAT = "concat"    # per-sample (an output): joined along its sample dim
    KEEP = "keep"        # the same in every micro-batch: the first one's


def collective_bytes(kind, n: int, nbytes: float) -> float:
    """Bytes one process sends for a step of ``kind`` over ``n`` processes with buffer
    ``nbytes`` (the module table says which buffer)."""
    kind = StepKind.parse(kind)
    if n < 1:
        raise PlanError(f"{kind} over {n} processes: a group has at least one process")
    if nbytes < 0:
        raise PlanError(f"{kind} of {nbytes} bytes: the size cannot be negative")
    if kind.is_local:
        return 0.0
    if kind is StepKind.SEND_RECV:
        return float(nbytes)
    factor = 2 if kind is StepKind.ALL_REDUCE else 1
    return factor * (n - 1) * nbytes / n
