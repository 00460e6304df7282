"""Communication started ahead of the op that needs it (``Strategy(overlap=True)``): which
collectives, in which groups, and where each one may start. Pure functions over a local
program, so the planner (:mod:`distgraph.passes.pipeline.compile`, which tells the
runtime where to start them) and the estimate (which prices what stays exposed) read the
same answer.

- **Gradient buckets** (:func:`gradient_buckets`). A reduction the update reads (a
  reshard point before an update op of one all-reduce or reduce-scatter step, of a value a
  backward op makes: a parameter's gradient over data parallel, reduce-scattered under
  ZeRO) may start as soon as that value is final: after the op that makes it, in the last
  micro-batch. The points go into buckets in the order their gradients are made, each
  closed once it holds ``bucket_mb`` MB (PyTorch DDP's ``bucket_cap_mb``, MB = 2^20
  bytes); a bucket's collectives start together once its last gradient is made, each on
  its own array, in place (no flat copy: a bucket costs no memory), and the update waits
  for each where it reads it.
- **Prefetched gathers** (:func:`prefetch_groups`, :func:`prefetching`). Under ZeRO-3 a parameter is gathered
  (one all-gather of the stored shard) before the ops of its layer; the gathers of one
  layer (:func:`prefetch_unit`: a repeated block as a whole, FSDP's unit) form a group,
  and while a layer's group runs the next group of the same task is started, so at most
  one layer ahead is held.

Example::

    buckets = gradient_buckets(plan.local(0), bucket_mb=25)
    [(b.points, b.after) for b in buckets]       # [((3, 4), 17), ((1, 2), 21)]
"""

from __future__ import annotations

from dataclasses import dataclass

from distgraph.ir import Role
from distgraph.plan.kinds import StepKind

MB = 1 << 20
REDUCTIONS = (StepKind.ALL_REDUCE, StepKind.REDUCE_SCATTER)
AFTER_ACTION = -1          # StartAt.instr: once the action (or its batched run) is done


@dataclass(frozen=True)
class Bucket:
    """Reduction points (``points``: their seqs, in the order their values are made)
    started together after local op ``after`` (the last of their producers) has run in
    the step's last micro-batch; ``nbytes``: their local buffers' bytes."""

    points: tuple
    after: int
    nbytes: int


@dataclass(frozen=True)
class StartAt:
    """Where a process's runtime starts a bucket's collectives: after instruction
    ``instr`` of its action number ``action`` (``instr`` -1: once the action, or the
    batched run it ends, is done); ``points``: the seqs of the update's reduction points
    (:class:`~distgraph.plan.instructions.PointInstr`) it starts."""

    points: tuple
    action: int
    instr: int


def overlapping(plan) -> bool:
    """Whether ``plan`` starts communication ahead: ``Strategy(overlap=True)``, and not
    under an uneven split by micro-batches (its data-parallel groups run different
    numbers of micro-batches, so their collectives would meet out of order)."""
    split = plan.batch_split
    return plan.strategy.overlap and not (split is not None and split.micro_batched
                                          and not split.is_even)


def prefetching(plan) -> bool:
    """Whether ``plan`` prefetches its parameter gathers: it overlaps
    (:func:`overlapping`) and was built for ZeRO-3 (``sharding_level`` 3 of
    ``dg.parallelize``'s ``dp_config``, FSDP's full sharding). A searched plan whose
    layouts split a weight over data parallel gathers it where it is used: the search
    prices its memory so."""
    return overlapping(plan) and getattr(plan.built, "sharding_level", 0) == 3


def reduction(point, local, producer: dict) -> int | None:
    """The local op that makes ``point``'s value when the point is a reduction the update
    reads that may start early (module docstring), else None."""
    if len(point.steps) != 1 or point.steps[0].kind not in REDUCTIONS or point.stores \
            or len(point.reads) != 1 or len(point.writes) != 1:
        return None
    ops = local.program.ops
    made = producer.get(point.reads[0])
    if made is None or ops[made].role is not Role.BACKWARD:
        return None
    return made


def gradient_buckets(local, bucket_mb: float) -> tuple:
    """The :class:`Bucket` s of ``local`` (a :class:`~distgraph.plan.local.LocalProgram`)
    for buckets of ``bucket_mb`` MB (module docstring)."""
    ops = local.program.ops
    producer = {o.name: i for i, op in enumerate(ops) for o in op.outputs}
    found = []
    for index, points in local.comm_points.items():
        if index >= len(ops) or ops[index].role is not Role.OPTIMIZE:
            continue
        for p in points:
            made = reduction(p, local, producer)
            if made is not None:
                found.append((made, p.seq, p.steps[0].buffer_bytes or _nbytes(p, local)))
    found.sort()
    return tuple(Bucket(tuple(s for _, s in items), items[-1][0], size) for items, size in
                 cut([((made, seq), nbytes) for made, seq, nbytes in found], bucket_mb))


def cut(sized, bucket_mb: float) -> list:
    """[(items, bytes)] of ``sized`` ([(item, bytes)], in order) cut into buckets of at
    least ``bucket_mb`` MB, in order, the last what is left (PyTorch DDP's cap)."""
    cap = bucket_mb * MB
    buckets, current, size = [], [], 0
    for item, nbytes in sized:
        current.append(item)
        size += nbytes
        if size >= cap:
            buckets.append((current, size))
            current, size = [], 0
    if current:
        buckets.append((current, size))
    return buckets


def _nbytes(point, local) -> int:
    value = local.program.values.get(point.reads[0])
    return int(value.nbytes) if value is not None else 0


def prefetchable(point, local) -> bool:
    """Whether ``point`` is a ZeRO-3 parameter gather: one all-gather of a stored value
    (a persistable) that an op of the forward or backward reads."""
    if len(point.steps) != 1 or point.steps[0].kind is not StepKind.ALL_GATHER \
            or point.stores or len(point.reads) != 1 or len(point.writes) != 1:
        return False
    value = local.program.values.get(point.reads[0])
    return value is not None and value.persistable


def prefetch_unit(layer: str) -> str:
    """The layer whose gathers a ZeRO-3 prefetch holds together: a module path up to its
    first index, the repeated block it is in (``"blocks.3.attn.qkv"`` -> ``"blocks.3"``,
    as FSDP wraps a transformer block), else the path itself (``"wte"``).

    >>> prefetch_unit("blocks.3.attn.qkv"), prefetch_unit("ln_f")
    ('blocks.3', 'ln_f')
    """
    parts = (layer or "").split(".")
    for k, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:k + 1])
    return layer


def prefetch_groups(seqs_in_order, layer_of: dict) -> list:
    """The prefetchable gathers of one task (``seqs_in_order``: their seqs in the order
    the task runs them; ``layer_of[seq]``: the layer of the op that reads the result)
    cut into groups of consecutive gathers of one layer."""
    groups: list = []
    for seq in seqs_in_order:
        if groups and layer_of.get(seq) == layer_of.get(groups[-1][-1]):
            groups[-1].append(seq)
        else:
            groups.append([seq])
    return [tuple(g) for g in groups]
