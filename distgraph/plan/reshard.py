"""Reshard values of the plan contract: steps, their point-to-point tiles, and points.

A :class:`ReshardStep` is one communication step that moves a tensor from one layout to
another (the planner's :func:`distgraph.passes.reshard.plan_reshard` makes lists of
them); a :class:`Transfer` is one tile of a point-to-point step; a :class:`ReshardPoint`
is a reshard placed in a process's program: which value, from which layout to which,
its steps, and the local names it reads and writes. The runtime executes them
(:mod:`distgraph.runtime.execution.reshard`); the bytes of each step are the formula of
:func:`~distgraph.plan.kinds.collective_bytes`, so what a plan says it moves is what the
communicators count.

Example::

    >>> mesh = ProcessMesh([0, 1], ["x"])
    >>> str(ReshardStep(StepKind.ALL_GATHER, mesh, ShardSpec(["x"]), ShardSpec([None]),
    ...                 (4,), "float32", 8.0, 16, "x", 2, 0))
    'all_gather(x) dim0 n=2 8 B'
"""

from __future__ import annotations

from dataclasses import dataclass

from distgraph.errors import PlanError
from distgraph.mesh import ProcessMesh
from distgraph.placement import DistAttr, ShardSpec
from distgraph.plan.kinds import StepKind
from distgraph.units import fmt_bytes


@dataclass(frozen=True)
class Transfer:
    """One p2p tile: ``src`` sends the global box ``region`` ([start, stop) per tensor
    dim) to ``dst``. ``src == dst`` is a local copy and costs nothing."""

    src: int
    dst: int
    region: tuple[tuple[int, int], ...]
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.region)

    def slices(self, origin=None) -> tuple[slice, ...]:
        """Slices of the global tensor, or of a local block starting at ``origin``."""
        origin = origin or (0,) * len(self.region)
        return tuple(slice(a - o, b - o) for (a, b), o in zip(self.region, origin))

    def __str__(self) -> str:
        box = ",".join(f"{a}:{b}" for a, b in self.region)
        return f"{self.src}->{self.dst} [{box}] {fmt_bytes(self.nbytes)}"


@dataclass(frozen=True)
class ReshardStep:
    """One reshard step. Fields by kind:

    - every step: ``kind`` (a :class:`~distgraph.plan.kinds.StepKind`), ``mesh`` (where it
      runs; the source mesh for send_recv), ``before`` / ``after`` (the spec before and
      after it), ``shape`` (global), ``dtype``, ``bytes`` (bytes sent per participating
      process; for send_recv the busiest sender's sum of tile bytes), ``buffer_bytes``
      (the local buffer B of the bytes formula).
    - collectives, slice, make_partial: ``mesh_dim`` and ``group_size`` (its size).
    - all_gather / slice / reduce_scatter: ``tensor_dim`` gathered / sliced / scattered.
    - all_to_all: ``tensor_dim`` (was split, gets gathered = concat axis) and
      ``to_tensor_dim`` (gets split = split axis).
    - send_recv: ``dst_mesh`` and ``transfers``. Every destination process starts from
      zeros and fills the tiles addressed to it; a ``Partial`` mesh dim in ``after``
      means only its coordinate-0 processes receive (the value stays a valid sum).
    """

    kind: StepKind
    mesh: ProcessMesh
    before: ShardSpec
    after: ShardSpec
    shape: tuple[int, ...]
    dtype: str
    bytes: float
    buffer_bytes: int = 0
    mesh_dim: str | None = None
    group_size: int = 1
    tensor_dim: int | None = None
    to_tensor_dim: int | None = None
    dst_mesh: ProcessMesh | None = None
    transfers: tuple[Transfer, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "kind", StepKind.parse(self.kind))
        p2p = self.kind is StepKind.SEND_RECV
        if p2p != (self.dst_mesh is not None):
            raise PlanError(f"{self.kind} step: dst_mesh is given exactly for send_recv")
        if not p2p and self.mesh_dim not in self.mesh.dim_names:
            raise PlanError(f"{self.kind} step: mesh dim {self.mesh_dim!r} is not in "
                            f"{self.mesh}")

    @property
    def src_attr(self) -> DistAttr:
        return DistAttr(self.mesh, self.before)

    @property
    def dst_attr(self) -> DistAttr:
        return DistAttr(self.dst_mesh or self.mesh, self.after)

    def bytes_sent_by(self, process_id: int) -> float:
        """Bytes ``process_id`` sends in this step (0 if it does not take part)."""
        if self.kind is StepKind.SEND_RECV:
            return float(sum(t.nbytes for t in self.transfers
                             if t.src == process_id and t.dst != process_id))
        return self.bytes if process_id in self.mesh else 0.0

    def incoming(self, process_id: int) -> tuple:
        """send_recv: ``((source process, tile shape), ...)`` that ``process_id`` receives
        from others, in transfer order (per source, the order they are sent in)."""
        return tuple((t.src, t.shape) for t in self.transfers
                     if t.dst == process_id and t.src != process_id)

    def messages_of_busiest(self) -> int:
        """send_recv: how many tiles the busiest sender sends to others."""
        remote = [t.src for t in self.transfers if t.src != t.dst]
        return max((remote.count(p) for p in set(remote)), default=0)

    def __str__(self) -> str:
        b = fmt_bytes(self.bytes)
        if self.kind is StepKind.SEND_RECV:
            remote = sum(1 for t in self.transfers if t.src != t.dst)
            local = len(self.transfers) - remote
            extra = f" +{local} local" if local else ""
            return f"send_recv {remote} tiles{extra} max {b}"
        head = f"{self.kind}({self.mesh_dim})"
        if self.kind is StepKind.ALL_TO_ALL:
            head += f" dim{self.tensor_dim}->dim{self.to_tensor_dim}"
        elif self.tensor_dim is not None:
            head += f" dim{self.tensor_dim}"
        return f"{head} n={self.group_size} {b}"


def steps_bytes(steps) -> float:
    """Sum of the steps' per-process bytes."""
    return float(sum(s.bytes for s in steps))


def format_steps(steps) -> str:
    """One line per step: ``kind ... | before -> after``."""
    return "\n".join(f"{s} | {s.before} -> {s.after}" for s in steps) or "(no steps)"


@dataclass(frozen=True)
class ReshardPoint:
    """Reshard ``value`` from ``src`` to ``dst``. ``reads`` is the local name of the
    source held by this process (empty if it holds none); ``writes`` the local name of
    the result (empty if it is not in the destination). ``seq`` numbers the points in
    the global program order, the same on every process (it tags their messages).
    ``stores`` names the persistable the result replaces (an update written back in the
    layout its parameter is stored in). ``anchor`` is the index, in the global program,
    of the op the point belongs to: the consumer it is placed before, or for a write-back
    the update op that made the value."""

    value: str
    src: DistAttr
    dst: DistAttr
    shape: tuple
    dtype: str
    steps: tuple
    reads: tuple
    writes: tuple
    seq: int = 0
    stores: tuple = ()
    anchor: int = -1

    @property
    def bytes(self) -> float:
        return steps_bytes(self.steps)

    @property
    def transfers(self) -> bool:
        """Whether it has a point-to-point step (it crosses meshes)."""
        return any(st.kind is StepKind.SEND_RECV for st in self.steps)

    def split_at_transfer(self) -> tuple:
        """(steps before, the send_recv step, steps after) of a point with transfers."""
        steps = list(self.steps)
        k = next(i for i, st in enumerate(steps) if st.kind is StepKind.SEND_RECV)
        return tuple(steps[:k]), steps[k], tuple(steps[k + 1:])

    def __str__(self) -> str:
        steps = "; ".join(map(str, self.steps)) or "local"
        return f"reshard {self.value}: {self.src.spec} -> {self.dst.spec} [{steps}]"
