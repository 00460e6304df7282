"""ZeRO-style update sharding over any data-parallel size, as annotations and a few ops on
a completed program.

For every update op on a mesh with dim ``mesh_dim`` (default "dp", of size n) whose
parameter leaves that mesh dim unused, :func:`zero_split` picks the tensor dim to split
over it, the one needing the least padding: a dim no mesh dim splits (one n divides needs
none, and the first such is taken: the split of before this module padded), or a dim
split over other mesh dims (tensor parallel) where n times their size divides it, split
over them and ``mesh_dim`` (minor), unpadded. The optimizer states and the update's
parameter and gradient operands are annotated with that dim split over ``mesh_dim``.
Completing again then yields, with no special code path: the gradient reduce-scattered
instead of all-reduced (P -> S), each process updating its slice of the parameter and
holding only its slice of the states, and the updated slice all-gathered back into the
stored parameter (the write-back reshard of partition).

Where the dim chosen needs padding, it is padded with zeros up to a multiple of n (the
``pad`` op; its gradient is a slice), so the split is even again::

    pad(w)    -> w@PADDED         made split: each process pads its own rows
    pad(g)    -> w@GRAD@PADDED    a pending sum over dp, reduce-scattered at its padded size
    update(w@PADDED, w@GRAD@PADDED, states, ...) -> w@PADDED@OUT, states
    slice(w@PADDED@OUT) -> w@OUT  all-gathered, the padding dropped; written back to w

The states are stored padded and split (their Value's shape is the padded one, and
``Value.padded_from`` the shape before). Their padded rows stay exactly zero (a zero
gradient leaves zero moments and a zero parameter zero under SGD, Adam, AdamW and mixed
precision Adam: tests/test_zero.py checks each update kernel), so a state is its padded
array cut back: the runtime lays a padded value out from the blocks of its logical array
with zeros past its end, and gathers it cut back, so checkpoints, ``state_dict``, the
Engine's held state and exports see logical shapes only, and a checkpoint saved at one
data-parallel size resumes at another.

With ``store_split`` (ZeRO-3, ``dp_config`` ``sharding_level`` 3, whose parameters
``dg.parallelize`` splits over dp where dp divides a free dim) the parameters it could
not split are stored split too: padded (each op that read one reads a ``slice`` of it
instead), or over a dim split over tensor parallelism and dp (each op that read it is
pinned to read it as before); either way gathered where used, in the forward and again
in the backward, as FSDP does, and the update runs in place on the stored slice.

Why a padded dim per tensor rather than a flat buffer of all parameters (DeepSpeed's,
Megatron-LM's distributed optimizer): a flat buffer of global shapes cannot flatten a
tensor split over another mesh dim (tensor parallelism), and cutting tensors at any
offset is a layout one ShardSpec per tensor cannot state. An even split of a padded
dim is a layout like any other, so partition, reshard, the cost model (which prices the
padded bytes: states / n with their padding, the reduce-scatter and all-gather of the
padded size) and the runtime need nothing new. The price is at most n - 1 rows of zeros
per tensor, along the dim where they are fewest (MT-NLG's 20,480-wide dims at dp 12: 4
rows in 20,480, 0.02%). Uneven pieces instead would hold the same on the busiest process
and need every reshard and kernel to know pieces of several sizes. The padded gradient
is made by an update-role op, so its reduce-scatter is not among the gradient buckets
``Strategy(overlap=True)`` starts during the backward (priced so, exposed).

Example::

    complete(prog); shard_updates(prog, "dp"); complete(prog)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from distgraph.annotation import OpAnnotation
from distgraph.errors import PlanError
from distgraph.ir import Operation, Program, Role, Value
from distgraph.registry import get_op
from distgraph.placement import DistAttr, ShardSpec

PADDED = "@PADDED"            # a Value ZeRO padded: its name + PADDED
UNPADDED = "@UNPADDED"        # ZeRO-3: the slice of a stored padded parameter an op reads


@dataclass(frozen=True)
class ZeroSplit:
    """How ZeRO splits a tensor of ``shape`` over a mesh dim: along tensor dim ``dim``,
    padded to ``padded`` (``shape`` with that dim rounded up to a multiple of the mesh
    dims that split it then; ``shape`` itself where they divide it); ``spec`` is the
    tensor's layout with that dim split over the mesh dim too (of the padded tensor)."""

    spec: ShardSpec
    dim: int
    shape: tuple
    padded: tuple

    @property
    def pads(self) -> bool:
        return self.padded != self.shape


def zero_split(spec: ShardSpec, shape, mesh, mesh_dim) -> ZeroSplit | None:
    """How ZeRO splits a tensor of ``shape`` laid out as ``spec`` over ``mesh_dim`` (of
    size n): along the dim needing the least padding among the dims no mesh dim splits
    (padded to a multiple of n) and those split over other mesh dims whose size their
    product with n divides (split over them and ``mesh_dim``, minor; unpadded); on ties
    the dims no mesh dim splits first, in order (the first such dim n divides: the split
    of before). Where there is none of either (a 1-d tensor split over tensor
    parallelism), the split dim padded to a multiple of that product. None where
    ``spec`` already uses ``mesh_dim``, the mesh lacks it (or has it of size 1: nothing
    to shard) or the tensor has no dim.

    Example: on a dp of 3, [5, 12] splits dim 1, unpadded; [5, 7] pads dim 1 to 9 (2
    columns of 5) rather than dim 0 to 6 (a row of 7); [12] split over an mp of 2 is
    split over (mp, dp); [10] split over it is padded to 12 and split so."""
    if mesh_dim not in mesh.dim_names or mesh_dim in spec.mesh_dims():
        return None
    n = mesh.dim_size(mesh_dim)
    if n == 1:
        return None
    shape = tuple(shape)
    options, split_padded = [], []      # (padded elements, split already, dim, padded size)
    for d, size in enumerate(shape):
        ways = n * math.prod(mesh.dim_size(m) for m in spec.entry(d))
        rounded = -(-size // ways) * ways
        option = ((rounded - size) * math.prod(shape[:d] + shape[d + 1:]),
                  int(bool(spec.entry(d))), d, rounded)
        # padding a split dim gathers the tensor along it first: a last resort
        (split_padded if option[1] and rounded != size else options).append(option)
    if not (options or split_padded):
        return None
    _, _, d, rounded = min(options or split_padded)
    dims = list(spec.dims)
    dims[d] = mesh_dim if not spec.entry(d) else (*spec.entry(d), mesh_dim)
    return ZeroSplit(ShardSpec(dims), d, shape, shape[:d] + (rounded,) + shape[d + 1:])


def updated_parameter(program: Program, op) -> Value | None:
    """The parameter that ``op``, an optimizer's in-place update, updates (its first
    operand, or the parameter that operand pads where this module padded it); None
    where ``op`` is no update of a parameter."""
    if op.role is not Role.OPTIMIZE or not get_op(op.type).inplace or len(op.inputs) < 2:
        return None
    v = op.inputs[0]
    if v.name.endswith(PADDED):
        v = program.values.get(v.name[:-len(PADDED)], v)
    return v if v.is_parameter else None


def shard_updates(program: Program, mesh_dim: str = "dp", store_split: bool = False,
                  only=None) -> int:
    """Annotate the update ops of a completed program, padding where it must (see the
    module docstring); returns how many parameters' updates were sharded. With
    ``store_split`` (ZeRO-3) the parameters are stored split too. ``only``: the names of
    the parameters whose updates to shard (None: every one; a name that no update
    updates is a PlanError). Complete the program again afterwards."""
    count = 0
    if only is not None:
        updated = {v.name for v in (updated_parameter(program, op) for op in program.ops)
                   if v is not None}
        stray = sorted(set(only) - updated)
        if stray:
            raise PlanError(f"ZeRO is asked to shard the updates of {stray[:3]}, but no "
                            f"optimizer update of the program updates "
                            f"{'them' if len(stray) > 1 else 'it'}")
    for op in list(program.ops):
        param = updated_parameter(program, op)
        if param is None or param is not op.inputs[0] or (only is not None and
                                                           param.name not in only):
            continue
        split = zero_split(param.dist_attr.spec, param.shape, op.dist_attr.mesh, mesh_dim)
        if split is None:
            continue
        if store_split:
            _store_split(program, op, split)
        else:
            _split_update(program, op, split)
        count += 1
    return count


def _split_update(program: Program, op, split: ZeroSplit) -> None:
    """ZeRO-1/2 on update ``op``: its states and its work split as ``split`` says, the
    parameter stored as it was (padded around the update where ``split`` pads)."""
    param, grad = op.inputs[0], op.inputs[1]
    mesh, spec = op.dist_attr.mesh, split.spec
    # Pin where the parameter is stored, so the next completion keeps it there instead
    # of taking the sharded update's layout.
    param.annotation = param.annotation or param.dist_attr
    updated = op.outputs[0]
    if split.pads:
        at = program.ops.index(op)
        padded = _pad(program, param, split, at, op)
        # the update reads its rows of the padded parameter, made where it reads them
        padded.annotation = DistAttr(mesh, spec)
        op.inputs[0] = padded
        op.inputs[1] = _pad(program, grad, split, at + 1, op)
        _pad_states(op, split)
        # the update writes the padded slice; its rows cut back, gathered, are the
        # parameter's new value, written back as the update's result was
        program.rename_value(updated, param.name + PADDED + "@OUT")
        updated.shape, updated.alias_of = split.padded, None
        # made whole along the padded dim (the slice cuts it there); written back into
        # the parameter's layout from that (a local slice where the parameter is split)
        new = program.add_value(Value(param.name + "@OUT", tuple(param.shape), param.dtype,
                                      role=Role.OPTIMIZE, alias_of=param.name,
                                      annotation=DistAttr(param.dist_attr.mesh,
                                                          _whole_along(param, split))))
        program.ops.insert(at + 3, _unpad(updated, new, split, Role.OPTIMIZE, op.layer,
                                          OpAnnotation(mesh, ())))
        updated.annotation = DistAttr(mesh, spec)
    _annotate_update(op, split)


def _store_split(program: Program, op, split: ZeroSplit) -> None:
    """ZeRO-3 on update ``op``: the parameter stored split as ``split`` says, every other
    op reading it as it did before (gathered where it is used; where ``split`` pads,
    through a slice that cuts the padding off), the update in place on the stored
    slice."""
    param, grad = op.inputs[0], op.inputs[1]
    mesh = op.dist_attr.mesh
    readers = [(c, i) for c in program.ops if c is not op
               for i, v in enumerate(c.inputs) if v is param]
    param.annotation = DistAttr(mesh, split.spec)
    if not split.pads:
        for c, i in readers:
            _read_as(c, param.name, c.dist_attr.input_specs[i])
        _annotate_update(op, split)
        return
    param.padded_from, param.shape = split.shape, split.padded
    for c, i in readers:
        read = list(c.dist_attr.input_specs[i].dims)
        read[split.dim] = None          # read whole along the padded dim (gathered there)
        whole = program.add_value(Value(program.unique_name(param.name + UNPADDED),
                                        split.shape, param.dtype, role=c.role))
        program.ops.insert(program.ops.index(c), _unpad(
            param, whole, split, c.role, c.layer,
            OpAnnotation(c.dist_attr.mesh, ((param.name, ShardSpec(read)),)),
            c.forward_op))
        c.inputs[i] = whole
        if c.annotation is not None and any(n == param.name for n, _ in c.annotation.in_specs):
            c.annotation = OpAnnotation(c.annotation.mesh, tuple(
                (whole.name if n == param.name else n, s) for n, s in c.annotation.in_specs))
    op.inputs[1] = _pad(program, grad, split, program.ops.index(op), op)
    _pad_states(op, split)
    op.outputs[0].shape = split.padded
    _annotate_update(op, split)


def _read_as(op, name: str, spec: ShardSpec) -> None:
    """Pin op ``op`` to read its operand ``name`` laid out as ``spec``."""
    pinned = op.annotation.in_specs if op.annotation is not None else ()
    mesh = op.annotation.mesh if op.annotation is not None else op.dist_attr.mesh
    op.annotation = OpAnnotation(mesh, tuple((n, s) for n, s in pinned if n != name) +
                                 ((name, spec),))


def _annotate_update(op, split: ZeroSplit) -> None:
    """The update ``op`` and its states laid out as ``split``: its parameter and gradient
    operands, the states and the values it writes back."""
    mesh, spec = op.dist_attr.mesh, split.spec
    for state in _states(op):
        state.annotation = DistAttr(mesh, spec)
    op.annotation = OpAnnotation(mesh, ((op.inputs[0].name, spec), (op.inputs[1].name, spec)))
    # The write-backs are made in the update's layout: a search annotates them as it
    # laid the update out (the parameter's), which would win over the op's annotation
    # and leave the update whole, gathering the states to it and slicing them back.
    for out in op.outputs:
        if out.alias_of is not None:
            out.annotation = DistAttr(mesh, spec)


def _states(op) -> list:
    return [op.inputs[i] for _, i in get_op(op.type).inplace if i > 0]


def _pad_states(op, split: ZeroSplit) -> None:
    """The states of ``op`` and the values it writes back to them stored padded."""
    for state in _states(op):
        state.padded_from, state.shape = tuple(state.shape), split.padded
    for out in op.outputs[1:]:
        out.shape = split.padded


def _pad(program: Program, value: Value, split: ZeroSplit, at: int, update) -> Value:
    """``value`` padded as ``split`` says by a ``pad`` op inserted at ``at`` (the update's
    role, layer and mesh), which reads it as it is made but whole along the padded dim: a
    gradient pending over the data-parallel dim stays pending through the pad and is
    reduce-scattered at the padded size, not all-reduced before it."""
    padded = program.add_value(Value(value.name + PADDED, split.padded, value.dtype,
                                     role=Role.OPTIMIZE))
    mesh = update.dist_attr.mesh
    made = ((value.name, _whole_along(value, split)),) if value.dist_attr.mesh == mesh else ()
    program.ops.insert(at, Operation("pad", [value], [padded],
                                     {"axis": split.dim, "size": split.padded[split.dim]},
                                     Role.OPTIMIZE, update.layer,
                                     annotation=OpAnnotation(mesh, made)))
    return padded


def _whole_along(value: Value, split: ZeroSplit) -> ShardSpec:
    """``value``'s layout whole along the dim ``split`` pads (pending sums kept)."""
    dims = list(value.dist_attr.spec.dims)
    dims[split.dim] = None
    return ShardSpec(dims, value.dist_attr.spec.partial)


def _unpad(padded: Value, whole: Value, split: ZeroSplit, role, layer, annotation,
           forward_op=None) -> Operation:
    """The ``slice`` op that cuts ``padded`` back to ``whole`` (its logical shape)."""
    return Operation("slice", [padded], [whole],
                     {"axes": (split.dim,), "starts": (0,), "ends": (split.shape[split.dim],)},
                     role, layer, forward_op, annotation)


def sharded_states(program: Program, mesh_dims) -> bool:
    """Whether a completed program shards an update's optimizer states over one of
    ``mesh_dims`` (a name or a tuple of names) where the parameter it updates is not
    split over it: what :func:`shard_updates` leaves behind where it sharded something,
    and nothing else lays out (an update keeps its states as its parameter)."""
    dims = {mesh_dims} if isinstance(mesh_dims, str) else set(mesh_dims)
    for op in program.ops:
        param = updated_parameter(program, op)
        if param is None:
            continue
        kept = set(param.dist_attr.spec.mesh_dims())
        for _, i in get_op(op.type).inplace:
            if i > 0 and (set(op.inputs[i].dist_attr.spec.mesh_dims()) & dims) - kept:
                return True
    return False
