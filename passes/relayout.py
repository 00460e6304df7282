"""Relayout planner: the reshard points that move held values from one plan to another.

An Engine keeps its parameters and optimizer states laid out as the plan that ran last
laid them out, and switches plans between calls (training to evaluation, a short last
batch, a new strategy or batch size). :func:`plan_relayout` plans the move of each value
like any other reshard (:func:`~distgraph.passes.reshard.plan_reshard`), and the runtime
runs the points (:func:`distgraph.runtime.execution.runner.relayout`).

The two plans number their processes alike or not (the rank mapper may place the
processes of evaluation's plan otherwise than training's), so both layouts are written
over **ranks** first: a value's mesh of process ids becomes the mesh of the ranks that run
them (``plan.ranks``), and the points' process ids are ranks. A plan that is not
distributed runs whole on every rank of the job: its values are whole everywhere, so
moving one into a distributed plan is a local slice, and out of one a gather to every
rank. Only values whose blocks over ranks changed move; the others stay as they are.

Example::

    points = plan_relayout(train_plan, eval_plan, ["fc1.weight"], rank=comm.rank)
    [str(p) for p in points]          # [] when evaluation lays fc1.weight out as training
"""

from __future__ import annotations

import numpy as np

from distgraph.errors import PlanError
from distgraph.mesh import ProcessMesh
from distgraph.placement import DistAttr, ShardSpec
from distgraph.plan.reshard import ReshardPoint
from distgraph.passes.reshard import plan_reshard


def plan_relayout(old_plan, new_plan, names, rank: int) -> tuple:
    """Points that lay out each of ``names`` (persistable Values of both plans, in an order
    every rank shares) as ``new_plan`` does, from the layout ``old_plan`` gave it, as rank
    ``rank`` takes part in them (``reads`` / ``writes`` name the value where it holds a
    block before / after). Values whose layout over ranks is the same are left out."""
    points = []
    for name in names:
        old, new = _value(old_plan, name), _value(new_plan, name)
        if tuple(old.shape) != tuple(new.shape) or old.dtype != new.dtype:
            raise PlanError(f"cannot move {name} between plans: it is "
                            f"{list(old.shape)}:{old.dtype} in one and "
                            f"{list(new.shape)}:{new.dtype} in the other; a persistable "
                            f"keeps its shape and dtype in every plan of a model")
        src, dst = on_ranks(old_plan, old.dist_attr), on_ranks(new_plan, new.dist_attr)
        if same_blocks(src, dst, tuple(new.shape)):
            continue
        if src is None:         # whole on every rank: any ranks are a source
            src = DistAttr(dst.mesh, ShardSpec.replicated(len(new.shape)))
        if dst is None:         # whole on every rank of the job
            dst = DistAttr(ProcessMesh(list(range(old_plan.world_size)), ["world"]),
                           ShardSpec.replicated(len(new.shape)))
        shape = tuple(new.shape)
        steps = tuple(plan_reshard(src, dst, shape, new.dtype))
        points.append(ReshardPoint(name, src, dst, shape, new.dtype, steps,
                                   (name,) if rank in src.mesh else (),
                                   (name,) if rank in dst.mesh else (), len(points)))
    return tuple(points)


def on_ranks(plan, attr) -> DistAttr | None:
    """``attr`` (of a Value of ``plan``) with the ranks that run its processes in place of
    their ids; None when ``plan`` is not distributed (every rank holds the value whole)."""
    if not plan.distributed:
        return None
    mesh = attr.mesh
    ranks = np.array(plan.ranks.of(mesh.process_ids)).reshape(mesh.shape)
    return DistAttr(ProcessMesh(ranks, list(mesh.dim_names)), attr.spec)


def same_blocks(src, dst, shape) -> bool:
    """Whether layouts ``src`` and ``dst`` over ranks (None: whole on every rank) give
    every rank the same block (meshes that differ only in order or dim names may)."""
    if src is None or dst is None:
        return src is dst
    ranks = src.mesh.process_ids
    return (sorted(ranks) == sorted(dst.mesh.process_ids) and not src.spec.partial
            and not dst.spec.partial
            and all(src.local_slices(shape, r) == dst.local_slices(shape, r) for r in ranks))


def _value(plan, name: str):
    values = plan.program.values
    if name not in values or not values[name].persistable:
        raise PlanError(f"{name} is no persistable Value of the plan (its persistables: "
                        f"{sorted(v.name for v in plan.program.persistables)[:8]} ...)")
    return values[name]
