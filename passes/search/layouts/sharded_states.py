"""What ZeRO changes in a search's choice, priced inside the search's problem as the
plan will run it: after the search, the planner shards the optimizer states of an update
whose parameter leaves the sharding mesh dim unused over that dim
(:func:`~distgraph.passes.transforms.zero.shard_updates`, ZeRO-1): the gradient is
resharded to the update's slice (a reduce-scatter where it was all-reduced), each process
updates its slice, and the updated slice is all-gathered back into the stored parameter,
once a step; the states take ``1 / n`` of their bytes. Where n divides no free dim of a
tensor, ZeRO pads one with zeros to a multiple of n
(:func:`~distgraph.passes.transforms.zero.zero_split`), and it is priced padded: the
states' bytes are the padded tensor's over n, the reduce-scatter and the all-gather move
the padded tensor, and the update runs on the padded slice beside the pads and the
slice that cuts the result back.

Which updates ZeRO shards is a dimension of the search (:class:`Zero`). With
``Strategy(sharding=True)`` every update that splits is sharded. With the default
``sharding=None`` each update is the search's to shard or not: the search space offers,
beside each of its strategies that ZeRO splits, the same strategy run on ZeRO's slice
(an ``OpStrategy`` with ``zero`` set, its parameter and states laid out by it alike:
:meth:`~distgraph.passes.search.layouts.space.SearchSpace._offer_zero`), so one problem
weighs ZeRO per update at its price in time (a gather added where the gradient was not
all-reduced over the dim) and in memory, and no planning without it is needed to
compare. The planner shards the chosen updates only (:meth:`~distgraph.passes.search.
layouts.intra_op.SearchResult.zero_params`, ``Choice.zero_params``).

So a parameter kept whole over the data-parallel dim with its states split there
(Meta's FSDP layout, Megatron's distributed optimizer) is a layout the search sees at
its true price: :func:`zero_terms` gives, per strategy of each update and of each
state, what ZeRO changes (the update's compute, its write-back gather, the layout its
gradient is consumed in, the states' bytes), which
:func:`~distgraph.passes.search.layouts.intra_op.search` adds to its node costs and edges
(``zero=``), so a memory budget can be met by splitting the states rather than the
weights. :func:`writeback_bytes` is the buffer the gather writes into, live at the
update beside the parameters, states and gradients' buffers (as the estimate counts it).

Example::

    terms = zero_terms(space, costs, zero_asked(strategy))
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from distgraph.ir import Role
from distgraph.passes.cost.prices import op_time
from distgraph.passes.cost.layout_prices import local_bytes
from distgraph.placement import DistAttr, ShardSpec
from distgraph.registry import TensorType
from distgraph.passes.search.layouts.placements import MESH_DIMS
from distgraph.passes.transforms.zero import zero_split
from distgraph.registry import get_op


@dataclasses.dataclass(frozen=True)
class Zero:
    """What a search is asked of ZeRO: the mesh ``dim`` it shards over, and whether
    sharding each update is the search's choice (``chosen``: ``Strategy(sharding=None)``
    outside a target, whose framework shards every update or none) or every update that
    splits is sharded (``sharding=True``)."""

    dim: str
    chosen: bool


def zero_asked(strategy) -> Zero | None:
    """The :class:`Zero` a search under ``strategy`` prices (None: ZeRO is off)."""
    dim = sharding_dim(strategy)
    if dim is None:
        return None
    return Zero(dim, strategy.sharding is None and strategy.target is None)


def sharding_dim(strategy) -> str | None:
    """The mesh dim ZeRO shards over, None where ``strategy.sharding`` is False:
    ``strategy.sharding_mesh_dim``, except that its default ("dp", a name the search's
    meshes never use) means the search's data-parallel dim (its meshes' first, ``x``)
    under ``auto_mode="full"``."""
    if strategy.sharding is False:
        return None
    default = next(f.default for f in dataclasses.fields(strategy)
                   if f.name == "sharding_mesh_dim")
    if strategy.auto_mode == "full" and strategy.sharding_mesh_dim == default:
        return MESH_DIMS[0]
    return strategy.sharding_mesh_dim


@dataclasses.dataclass(frozen=True)
class ZeroTerms:
    """What ZeRO changes in a search's problem, per strategy index: ``compute`` seconds
    of each update node on its slice (nan where it does not shard), the write-back gather's
    seconds per step (``gather``), the layout each update consumes its gradient in
    (``grad``) and, where ZeRO pads it first, the (dim, padded shape) of the pad (``pads``),
    and the bytes factor of each state's source node (``states``)."""

    compute: dict       # update node -> np.ndarray of seconds (nan: unchanged)
    gather: dict        # update node -> np.ndarray of seconds per run of the update
    grad: dict          # update node -> tuple of ShardSpec
    pads: dict          # update node -> tuple of (dim, padded shape) or None
    states: dict        # state source node -> np.ndarray of factors


def updates(space):
    """(node, op) of every update of a parameter by an in-place op among ``space``'s."""
    for node in space.nodes:
        if node.is_source:
            continue
        op = space.program.ops[node.op]
        if op.role is Role.OPTIMIZE and get_op(op.type).inplace and len(op.inputs) > 1 \
                and op.inputs[0].is_parameter:
            yield node, op


def zero_terms(space, costs, zero: Zero | None) -> ZeroTerms | None:
    """The terms of ZeRO as ``zero`` asks on ``space``'s mesh (module docstring), for
    the strategies the space runs on ZeRO's slice (``zero`` set) and the parameters and
    states they lay out; None where ``zero`` is None or the mesh lacks its dim or has
    it of size 1. ``costs``: the LayoutPrices of the mesh (the gathers' prices)."""
    mesh = space.mesh
    if not _splits_on(mesh, zero):
        return None
    dim = zero.dim
    compute, gather, grad, pads, states = {}, {}, {}, {}, {}
    for node, op in updates(space):
        param = op.inputs[0]
        splits = [zero_split(s.in_specs[0], param.shape, mesh, dim) if s.zero else None
                  for s in node.strategies]
        if not any(splits):
            continue
        compute[node.index] = np.array([np.nan if z is None else _sliced_time(op, s, z, mesh, costs)
                                        for z, s in zip(splits, node.strategies)])
        gather[node.index] = np.array([0.0 if z is None else _writeback_time(s, z, param, costs)
                                       for z, s in zip(splits, node.strategies)])
        grad[node.index] = tuple(s.in_specs[1] if z is None else z.spec
                                 for z, s in zip(splits, node.strategies))
        pads[node.index] = tuple((z.dim, z.padded) if z is not None and z.pads else None
                                 for z in splits)
        for _, i in get_op(op.type).inplace:
            state = op.inputs[i]
            if i > 0 and state.name in space.source_node:
                k = space.source_node[state.name]
                states[k] = np.array([_states_factor(t.out_specs[0], state.shape, mesh, dim)
                                      if t.zero else 1.0 for t in space.nodes[k].strategies])
    return ZeroTerms(compute, gather, grad, pads, states)


def _splits_on(mesh, zero: Zero | None) -> bool:
    """Whether ZeRO as ``zero`` asks splits anything on ``mesh`` (its dim there, of size
    more than 1)."""
    return zero is not None and zero.dim in mesh.dim_names and mesh.dim_size(zero.dim) > 1


def offered(op, strategies, mesh, zero: Zero | None) -> tuple:
    """(strategies, twin of): what update ``op`` offers on ``mesh`` as ``zero`` asks,
    from its ``strategies`` without ZeRO. Where ZeRO splits a strategy's parameter, the
    strategy runs on ZeRO's slice (``zero`` set) in its place, or with ``zero.chosen``
    beside it, after all of them; ``twin of``: for each strategy offered, the index in
    ``strategies`` of the one it runs as."""
    if not _splits_on(mesh, zero):
        return tuple(strategies), tuple(range(len(strategies)))
    param = op.inputs[0]
    splits = [zero_split(s.in_specs[0], param.shape, mesh, zero.dim) is not None
              for s in strategies]
    if not zero.chosen:
        return (tuple(dataclasses.replace(s, zero=True) if z else s
                      for s, z in zip(strategies, splits)), tuple(range(len(strategies))))
    twins = [i for i, z in enumerate(splits) if z]
    return (tuple(strategies) + tuple(dataclasses.replace(strategies[i], zero=True)
                                      for i in twins), tuple(range(len(strategies))) + tuple(twins))


def zero_params(space, choice, values: dict | None = None) -> frozenset:
    """The parameters (named as in ``values``, {name: name}, where given) whose updates
    ``choice`` (strategy indices of ``space``'s nodes) runs on ZeRO's slice."""
    out = set()
    for node, op in updates(space):
        if node.strategies[choice[node.index]].zero:
            name = op.inputs[0].name
            out.add(name if values is None else values.get(name, name))
    return frozenset(out)


def _whole_along(spec: ShardSpec, dim: int) -> ShardSpec:
    """``spec`` whole along tensor dim ``dim`` (what a pad reads and a slice makes)."""
    dims = list(spec.dims)
    dims[dim] = None
    return ShardSpec(dims, spec.partial)


def _writeback_time(s, z, param, costs) -> float:
    """Seconds a step moves the parameter of an update under strategy ``s`` that ZeRO
    splits as ``z``: the updated slice all-gathered into the stored layout; where ``z``
    pads, into the layout whole along the padded dim (the slice cutting it back reads
    that), with the parameter gathered so for its pad first and the cut result written
    back into the stored layout (none of these two where no mesh dim splits that dim)."""
    stored = s.in_specs[0]
    if not z.pads:
        return costs.reshard(z.spec, stored, z.padded, param.dtype)
    whole = _whole_along(stored, z.dim)
    return (costs.reshard(z.spec, whole, z.padded, param.dtype)
            + costs.reshard(stored, whole, param.shape, param.dtype)
            + costs.reshard(whole, stored, param.shape, param.dtype))


def _states_factor(spec, shape, mesh, dim) -> float:
    """The bytes of a state laid out as ``spec`` once ZeRO splits it over ``dim``, over
    its bytes as ``spec`` (1 where ZeRO leaves it): the padded tensor's share."""
    z = zero_split(spec, shape, mesh, dim)
    if z is None:
        return 1.0
    return math.prod(DistAttr(mesh, z.spec).local_shape(z.padded)) / \
        max(math.prod(DistAttr(mesh, spec).local_shape(shape)), 1)


def _sliced_time(op, s, z, mesh, costs) -> float:
    """Seconds of update ``op`` under strategy ``s`` run on the slice of its parameter
    that ``z`` (a ZeroSplit) makes (its operands and results laid out as the parameter,
    sliced alike), and where ``z`` pads, of the pads of the parameter and its gradient
    and of the slice that cuts the result back."""
    param = op.inputs[0]
    sliced = DistAttr(mesh, z.spec).local_shape(z.padded)

    def local(values, specs, shapes):
        return [TensorType(sliced if spec == s.in_specs[0] and v.shape == param.shape
                           else shape, v.dtype) for v, spec, shape in zip(values, specs, shapes)]

    seconds = op_time(op.type, local(op.inputs, s.in_specs, s.in_local_shapes),
                      local(op.outputs, s.out_specs, s.out_local_shapes), op.attrs, costs.device)
    if not z.pads:
        return seconds
    # the pads read their operands whole along the padded dim, the slice makes that
    grad = op.inputs[1]
    whole = DistAttr(mesh, _whole_along(s.in_specs[0], z.dim))
    param_whole = TensorType(whole.local_shape(param.shape), param.dtype)
    padded = TensorType(whole.local_shape(z.padded), param.dtype)
    grad_whole = DistAttr(mesh, _whole_along(s.in_specs[1], z.dim))
    attrs = {"axis": z.dim, "size": z.padded[z.dim]}
    cut = {"axes": (z.dim,), "starts": (0,), "ends": (param.shape[z.dim],)}
    return seconds + sum(op_time(kind, [a], [b], attrs_, costs.device) for kind, a, b, attrs_ in (
        ("pad", param_whole, TensorType(sliced, param.dtype), attrs),
        ("pad", TensorType(grad_whole.local_shape(grad.shape), grad.dtype),
         TensorType(grad_whole.local_shape(z.padded), grad.dtype), attrs),
        ("slice", padded, param_whole, cut)))


def writeback_bytes(result, zero: Zero | None) -> float:
    """The largest buffer ZeRO's write-back holds at an update of ``result``'s choice (a
    SearchResult): the updated slice and the parameter it is gathered into, padded where
    ZeRO pads (bytes per device; 0 where nothing is sharded)."""
    mesh, choice = result.space.mesh, result.choice
    if not _splits_on(mesh, zero):
        return 0.0
    dim = zero.dim
    most = 0.0
    for node, op in updates(result.space):
        param = op.inputs[0]
        s = node.strategies[choice[node.index]]
        z = zero_split(s.in_specs[0], param.shape, mesh, dim) if s.zero else None
        if z is not None:
            gathered = _whole_along(s.in_specs[0], z.dim) if z.pads else s.in_specs[0]
            whole = local_bytes([DistAttr(mesh, gathered).local_shape(z.padded)], [param.dtype])
            most = max(most, whole * (1 + 1 / mesh.dim_size(dim)))
    return most


def _padded_matrix(costs, made: tuple, wanted: tuple, dim: int, padded: tuple,
                   grad) -> np.ndarray:
    """Seconds from each layout ``made`` of ``grad`` to each ``wanted`` of it padded
    along ``dim`` to ``padded``, as the plan runs it: the pad reads the dim whole (a
    layout splitting it is gathered there first, at the gradient's own shape), keeps
    the rest of the layout (a pending sum stays pending), and the padded gradient is
    resharded to the update's layout (a reduce-scatter of the padded bytes)."""
    whole = [_whole_along(spec, dim) for spec in made]
    first = np.array([costs.reshard(m, g, grad.shape, grad.dtype) for m, g in zip(made, whole)])
    return first[:, None] + costs.matrix(tuple(whole), wanted, padded, grad.dtype)


def _padded_price(costs, made, wanted, dim: int, padded: tuple, grad) -> float:
    """One entry of :func:`_padded_matrix`: from ``made`` to ``wanted``."""
    whole = _whole_along(made, dim)
    return costs.reshard(made, whole, grad.shape, grad.dtype) + \
        costs.reshard(whole, wanted, padded, grad.dtype)


def apply_zero(terms: ZeroTerms | None, space, costs, weights: dict, compute: list,
               comm: list, memory: list, edges: list, tied=None) -> None:
    """Add ``terms`` to a problem's node costs and edges as :func:`~distgraph.passes.
    search.intra_op._problem` built them (lists by node index; ``edges``: (producer,
    consumer, seconds matrix, or its diagonal between tied nodes)): the update's compute
    scaled, its write-back gather added, its gradient's edge priced into the layout
    ZeRO consumes it in (its diagonal alone where ``tied(producer, update)``: they take
    one index), the states' bytes scaled. Nothing where ``terms`` is None."""
    if terms is None:
        return
    w = weights.get(Role.OPTIMIZE, 1)
    at = {(u, v): e for e, (u, v, _) in enumerate(edges)}
    for v, factor in terms.compute.items():
        node = space.nodes[v]
        sliced = np.isfinite(compute[v]) & ~np.isnan(factor)
        compute[v] = np.where(sliced, np.nan_to_num(factor) * w, compute[v])
        comm[v] = comm[v] + terms.gather[v] * w
        grad = space.program.ops[node.op].inputs[1]
        u, j = space.producer[grad.name]
        made = tuple(s.out_specs[j] for s in space.nodes[u].strategies)
        if tied is not None and tied(u, v):
            mat = np.array([costs.reshard(a, b, grad.shape, grad.dtype) if pad is None else
                            _padded_price(costs, a, b, *pad, grad)
                            for a, b, pad in zip(made, terms.grad[v], terms.pads[v])])
        else:
            mat = np.zeros((len(made), len(terms.grad[v])))
            for pad in dict.fromkeys(terms.pads[v]):
                cols = [c for c, p in enumerate(terms.pads[v]) if p == pad]
                wanted = tuple(terms.grad[v][c] for c in cols)
                mat[:, cols] = costs.matrix(made, wanted, grad.shape, grad.dtype) \
                    if pad is None else _padded_matrix(costs, made, wanted, *pad, grad)
        mat = mat * w
        if (u, v) in at:
            edges[at[(u, v)]] = (u, v, mat)
        elif mat.any():
            edges.append((u, v, mat))
    for k, factor in terms.states.items():
        memory[k] = memory[k] * factor
