"""What ``Strategy(sharding=True)`` changes in a stage search's choice, priced as the plan
will run it: after the search, the planner shards the optimizer states of every update
whose parameter leaves the sharding mesh dim unused over that dim
(:func:`~distgraph.passes.transforms.zero.shard_updates`, ZeRO-1): the gradient is
resharded to the update's slice (a reduce-scatter where it was all-reduced), each
process updates its slice, and the updated slice is all-gathered back into the stored
parameter, once a step; the states take ``1 / n`` of their bytes.

Example::

    seconds, saved = zero_effect(result, program, strategy, weights, costs)
"""

from __future__ import annotations

import dataclasses

from distgraph.ir import Role
from distgraph.passes.search.space import MESH_DIMS
from distgraph.passes.transforms.zero import sharded_spec
from distgraph.registry import get_op


def sharding_dim(strategy) -> str:
    """The mesh dim ZeRO shards over: ``strategy.sharding_mesh_dim``, except that its
    default ("dp", a name the search's meshes never use) means the search's
    data-parallel dim (its meshes' first, ``x``) under ``auto_mode="full"``."""
    default = next(f.default for f in dataclasses.fields(strategy)
                   if f.name == "sharding_mesh_dim")
    if strategy.auto_mode == "full" and strategy.sharding_mesh_dim == default:
        return MESH_DIMS[0]
    return strategy.sharding_mesh_dim


def zero_effect(result, program, strategy, weights: dict, costs) -> tuple[float, float]:
    """(seconds added per micro-batch, bytes per device saved) by ZeRO's sharding of the
    states on ``result``'s choice (a SearchResult; ``costs``: the SearchCosts of its mesh
    and devices; ``weights``: op role -> runs per micro-batch); (0, 0) without
    ``strategy.sharding`` or where the mesh lacks its :func:`sharding_dim`."""
    space, problem, choice = result.space, result.problem, result.choice
    mesh, dim = space.mesh, sharding_dim(strategy)
    if not strategy.sharding or dim not in mesh.dim_names:
        return 0.0, 0.0
    n = mesh.dim_size(dim)
    w = weights.get(Role.OPTIMIZE, 1)
    seconds = saved = 0.0
    for node in space.nodes:
        if node.is_source:
            continue
        op = program.ops[node.op]
        inplace = get_op(op.type).inplace
        if op.role is not Role.OPTIMIZE or not inplace or not op.inputs[0].is_parameter:
            continue
        param, grad = op.inputs[0], op.inputs[1]
        s = node.strategies[choice[node.index]]
        spec = sharded_spec(s.in_specs[0], param.shape, mesh, dim)
        if spec is None:
            continue
        seconds += float(problem.compute[node.index][choice[node.index]]) * (1 / n - 1)
        if grad.name in space.producer:
            u, j = space.producer[grad.name]
            made = space.nodes[u].strategies[choice[u]].out_specs[j]
            seconds += w * (costs.reshard(made, spec, grad.shape, grad.dtype)
                            - costs.reshard(made, s.in_specs[1], grad.shape, grad.dtype))
        seconds += w * costs.reshard(spec, s.in_specs[0], param.shape, param.dtype)
        for _, i in inplace:
            state = op.inputs[i].name
            if i > 0 and state in space.source_node:
                k = space.source_node[state]
                saved += float(problem.memory[k][choice[k]]) * (1 - 1 / n)
    return seconds, saved
