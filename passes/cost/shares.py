"""A process's share of an uneven batch split, as the estimate prices it
(:mod:`distgraph.passes.cost.estimate`, ``Strategy(balance=True)``): :class:`Share` is
the share (rows over the even split's without micro-batches, its own count of
micro-batches with them), :class:`Scale` what it changes in the process's local
program (the sizes of the Values that carry the samples along the split's mesh dims,
the reshards of such Values, the count of micro-batches).

Example::

    share = share_of(plan, pid)          # Share() under an even split
    Scale(plan, share, pid).nbytes(v)    # v's bytes at the process's share
"""

from __future__ import annotations

from dataclasses import dataclass

from distgraph.errors import PlanError
from distgraph.registry import TensorType


@dataclass(frozen=True)
class Share:
    """A process's share of an uneven batch split over ``mesh_dims``: ``rows``, its rows
    over the even split's (without micro-batches), and ``micro_batches``, how many it
    runs (with them; None: the plan's count). ``Share()`` is the even split."""

    rows: float = 1.0
    micro_batches: int | None = None
    mesh_dims: tuple = ()


def share_of(plan, pid: int) -> Share:
    """The Share of ``pid`` under the plan's batch split (even without one)."""
    split = getattr(plan, "batch_split", None)
    if split is None:
        return Share()
    if split.micro_batched:
        return Share(micro_batches=split.micro_batches(pid), mesh_dims=split.mesh_dims)
    even = split.batch / len(split.members)
    return Share(rows=split.row_count(pid) / even, mesh_dims=split.mesh_dims)


class Scale:
    """What a Share changes in process ``pid``'s local program: the size of Values that
    carry the samples along the split's mesh dims (relative to the rows its local program
    holds: the even share, or its own under an uneven split), and the count of
    micro-batches."""

    def __init__(self, plan, share: Share, pid: int):
        self.plan = plan
        self.micro_batches = share.micro_batches or plan.micro_batches
        self.rows = share.rows / _rows_held(plan, pid)
        self.dims = frozenset(share.mesh_dims)
        self.axes = {}
        if self.rows != 1.0:
            if plan.sample_axes is None:
                raise PlanError("pricing an uneven share of the batch needs the dims that "
                                "carry the samples: plan with Strategy(balance=True), or give "
                                "the plan its sample_axes (distgraph.passes.samples)")
            self.axes = plan.sample_axes

    def axis(self, name: str) -> int | None:
        """The dim of local Value ``name`` whose size scales, None if none: one that
        carries the samples and is split over the split's mesh dims (a resharded copy,
        ``name@k``, as its Value is made)."""
        if not self.axes:
            return None
        base = name if name in self.axes else name.rsplit("@", 1)[0]
        axis = self.axes.get(base)
        if axis is None or base not in self.plan.program.values:
            return None
        spec = self.plan.program.values[base].dist_attr.spec
        return axis if self.dims & set(spec.entry(axis)) else None

    def tensor(self, v) -> TensorType:
        axis = self.axis(v.name)
        if axis is None:
            return TensorType(v.shape, v.dtype)
        shape = list(v.shape)
        shape[axis] = int(round(shape[axis] * self.rows))
        return TensorType(tuple(shape), v.dtype)

    def nbytes(self, v) -> float:
        return v.nbytes * (self.rows if self.axis(v.name) is not None else 1.0)

    def of_step(self, point, step) -> float:
        """How a reshard step of ``point`` scales: with the rows of a sample-carrying
        Value, except along the split's own mesh dims (it moves the same total there)."""
        if self.axis(point.value) is None or step.mesh_dim in self.dims:
            return 1.0
        return self.rows


def _rows_held(plan, pid: int) -> float:
    """The rows process ``pid``'s local program holds over the even split's: 1, except
    for the local programs of an uneven split by rows (:mod:`distgraph.passes.balance.uneven`),
    whose values that carry samples differ from the even blocks along that dim."""
    for v in plan.local_alike(pid).program.values.values():
        value = plan.program.values.get(v.name)
        if value is None or value.dist_attr is None or pid not in value.dist_attr.mesh:
            continue
        even = value.dist_attr.local_shape(value.shape)
        for have, want in zip(v.shape, even):
            if have != want and want:
                return have / want
    return 1.0
