"""What a pipeline stage pays to pass blocks' Values to its neighbours, priced as the
plan's estimate (:mod:`distgraph.passes.cost.estimate`) prices it.

A block of a run (:mod:`distgraph.passes.search.stages.runs`) sends the next block its output
and, in the backward, the block before it its input's gradient: the representative
block's ``periodic`` pairs (received, leaving). Between two stages these become
cross-mesh reshards (:func:`~distgraph.passes.reshard.plan_reshard`: a pending sum
reduced, point-to-point tiles, a local all-gather where the receiver is replicated),
anchored at the receiving op, so they run once per micro-batch; the estimate charges a
reshard step to every process it involves: the sender and the receiver both wait for it.

:func:`boundary_seconds` prices one such boundary for an option: each periodic Value
resharded from the option's logical mesh on its submesh to the same logical mesh on the
next submesh of the device mesh (the stages the DP places are alike there, or close), in
the layout the block receives it in, each step priced by
:func:`~distgraph.passes.cost.prices.reshard_step_time` for the busiest of the first
tensor-parallel group of either side. Where a Value is split over the data-parallel
dim (the logical mesh's first), the replicas move alike, each its own rows to its
counterpart: the reshard is planned for the first replica's share alone, which prices a
stage of 4,096 devices in milliseconds. A stage between two others sends each Value once
and receives each once: it pays the sender's and the receiver's share, the whole figure;
a stage with one neighbour (the first or the last) pays half of it.

Two neighbours need not be alike: a stage of fewer devices (the first, holding the
embedding) beside a wider one. :func:`between` prices the boundary of two stages as it
runs there: each forward Value resharded from the layout the sender's block sends it in
on its devices to the layout the receiver's block receives it in on the next stage's
devices, and each gradient back, every step charged, as the estimate charges it, to the
busiest process of either side.

What it works out is kept in the planning's session (table "boundary prices"): each
option's figure by its program and :func:`boundary_key`, each reshard's steps and each
Value's price.

Example::

    seconds = boundary_seconds(option, cluster)    # per micro-batch, a middle stage
    mine, theirs = between(first, devices, second, next_devices, cluster)
"""

from __future__ import annotations

import numpy as np

from distgraph.ir import Role
from distgraph.mesh import ProcessMesh
from distgraph.passes.cost.prices import Rings, steps_time
from distgraph.passes.reshard import plan_reshard
from distgraph.passes.cost.stage import grid
from distgraph.passes.session import Session
from distgraph.placement import DistAttr


def boundary_seconds(option, cluster, session: Session | None = None) -> float:
    """Seconds per micro-batch a stage of ``option`` (a RunOption) between two stages
    alike spends on the reshards of its blocks' periodic Values (module docstring); 0
    where its submesh is the whole device mesh (no next stage there).

    ``session`` (the planning's, on one ``cluster``; a fresh one by default) keeps in
    "boundary prices" each option's figure by its block's program and
    :func:`boundary_key`, and what any option's Values share: each reshard's steps by
    what :func:`plan_reshard` reads (the logical mesh, its dim names, the spec, the shape
    and dtype: the same steps whatever devices the meshes stand on) and each Value's
    price by that and the devices of both sides (all that :class:`Rings` reads beside
    the cluster)."""
    memo = (session or Session()).table("boundary prices")
    result = option.parts["block"][1]
    return memo.memo((result.space.program, boundary_key(option)),
                     lambda: _seconds(option, cluster, memo))


def _seconds(option, cluster, memo) -> float:
    result = option.parts["block"][1]
    return values_seconds(result, option.logical, pieces(option.sub),
                          [received for received, _ in result.boundary.periodic], cluster,
                          memo)


def values_seconds(result, logical, sides, names, cluster, memo) -> float:
    """Seconds the reshards of Values ``names`` cost, sender's and receiver's: each
    received in the layout ``result`` (a search on a ``logical`` mesh) chose for it, from
    that layout on the submesh of devices ``sides[0]`` to the same on ``sides[1]``
    (module docstring; e.g. two of :func:`pieces`); 0 without a second side."""
    if len(sides) < 2:
        return 0.0
    dims = tuple(result.space.mesh.dim_names)
    total = 0.0
    for received in names:
        spec = _received_spec(result, received)
        value = result.space.program.values[received]
        # where the Value is split over the data-parallel dim (0), its replicas move
        # alike: plan the first one's share (a mesh of one replica, the rows it holds);
        # a Value replicated there may be sent in slices the receivers all-gather
        outer = dims[0]
        n = logical[0] if outer in spec.mesh_dims() and outer not in spec.partial else 1
        shape_n = (logical[0] // n,) + tuple(logical[1:])
        shape = tuple(d // n if outer in spec.entry(i) else d
                      for i, d in enumerate(value.shape))
        size = int(np.prod(shape_n))
        # a side of fewer devices (a smaller neighbour stage) takes its part on them in turn
        devices = tuple(int(d) for d in np.concatenate([np.resize(side, size) if len(side) < size
                                                        else side[:size] for side in sides[:2]]))
        reshard = (shape_n, dims, spec, shape, value.dtype)
        sent, received_seconds = memo.memo(
            ("value",) + reshard + (devices,),
            lambda: _value_seconds(reshard, devices, cluster, memo))
        total += sent + received_seconds
    return total


def _value_seconds(reshard: tuple, devices: tuple, cluster, memo: dict) -> tuple:
    """(sender's, receiver's) seconds of one Value's reshard ``reshard`` = (logical mesh,
    dim names, spec, shape, dtype) from the first ``size`` of ``devices`` to the rest:
    the busiest of the first tensor-parallel group of either side."""
    logical, names, spec, shape, dtype = reshard
    size = len(devices) // 2

    def planned():
        ids = np.arange(2 * size)
        here = ProcessMesh(ids[:size].reshape(logical).tolist(), dim_names=list(names))
        there = ProcessMesh(ids[size:].reshape(logical).tolist(), dim_names=list(names))
        return plan_reshard(DistAttr(here, spec), DistAttr(there, spec), shape, dtype)
    steps = memo.memo(("steps",) + reshard, planned)
    rings = Rings(cluster, devices.__getitem__)
    t = logical[-1]
    return tuple(max(steps_time(steps, side, rings))
                 for side in (range(t), range(size, size + t)))


def between(before, before_devices, after, after_devices, cluster,
            session: Session | None = None) -> tuple:
    """(seconds of ``before``'s stage, seconds of ``after``'s) per micro-batch spent on
    the boundary between a stage of option ``before`` (a RunOption) on devices
    ``before_devices`` (global ids, row-major over its logical mesh) and the next stage,
    of ``after`` on ``after_devices`` (module docstring): the blocks' forward Values sent
    on, their gradients sent back, each side its busiest process. Kept in the session's
    "boundary prices" by both options' :func:`boundary_key` and devices."""
    memo = (session or Session()).table("boundary prices")
    before_devices, after_devices = tuple(before_devices), tuple(after_devices)
    key = ("between", before.parts["block"][1].space.program, boundary_key(before),
           boundary_key(after), before_devices, after_devices)
    return memo.memo(key, lambda: _between(before, before_devices, after, after_devices,
                                           cluster))


def _between(before, before_devices, after, after_devices, cluster) -> tuple:
    sides = []
    for n, (option, devices) in enumerate(((before, before_devices), (after, after_devices))):
        first = n * len(before_devices)
        ids = np.arange(first, first + len(devices)).reshape(option.logical)
        names = list(option.parts["block"][1].space.mesh.dim_names)
        sides.append(ProcessMesh(ids.tolist(), dim_names=names))
    rings = Rings(cluster, (before_devices + after_devices).__getitem__)
    spent = [0.0, 0.0]
    result = before.parts["block"][1]
    for name, _ in result.boundary.periodic:
        value = result.space.program.values[name]
        attrs = [DistAttr(mesh, _received_spec(option.parts["block"][1], name))
                 for mesh, option in zip(sides, (before, after))]
        if value.role is Role.BACKWARD:         # a gradient goes back
            attrs.reverse()
        steps = plan_reshard(attrs[0], attrs[1], value.shape, value.dtype)
        for k, mesh in enumerate(sides):
            spent[k] += max(steps_time(steps, mesh.process_ids, rings))
    return tuple(spent)


def _received_spec(result, name):
    """The layout the block searched in ``result`` receives Value ``name`` in (and,
    periodic, sends its counterpart in)."""
    space, choice = result.space, result.choice
    node = space.source_node[name]
    return space.nodes[node].strategies[choice[node]].out_specs[0]


def boundary_key(option) -> tuple:
    """What :func:`boundary_seconds` of ``option`` reads, beside its program (options of
    one program with equal keys cost the same): the submesh, the logical mesh and the
    layout the block receives each periodic Value in."""
    result = option.parts["block"][1]
    received = tuple((name, _received_spec(result, name))
                     for name, _ in result.boundary.periodic)
    return (option.axis, option.sub.shape, option.logical, result.space.mesh.dim_names,
            received)


def pieces(sub) -> list:
    """The device ids of each submesh of ``sub``'s shape on its device mesh, in the
    order the stages take them (row-major: whole rows, or row pieces in a row)."""
    rows, cols = grid(sub.mesh.shape)
    n, m = sub.shape
    ids = np.array(sub.mesh.ids).reshape(rows, cols)
    return [ids[r:r + n, c:c + m].reshape(-1) for r in range(0, rows - n + 1, n)
            for c in range(0, cols - m + 1, m)]
