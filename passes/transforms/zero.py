"""ZeRO-style update sharding, expressed only as annotations on a completed program.

For every update op on a mesh with dim ``mesh_dim`` (default "dp") whose parameter
leaves that mesh dim unused and has a free, divisible dim, the optimizer states and the
update's parameter and gradient operands are annotated with that dim split over
``mesh_dim``. Completing again then yields, with no special code path: the gradient
reduce-scattered instead of all-reduced (P -> S), each process updating its slice of
the parameter and holding only its slice of the states, and the updated slice
all-gathered back into the stored parameter (the write-back reshard of partition).

Example::

    complete(prog); shard_updates(prog, "dp"); complete(prog)
"""

from __future__ import annotations

from distgraph.annotation import OpAnnotation
from distgraph.ir import Program, Role
from distgraph.registry import get_op
from distgraph.placement import DistAttr, ShardSpec


def sharded_spec(spec: ShardSpec, shape, mesh, mesh_dim) -> ShardSpec | None:
    """``spec`` with its first free dim of ``shape`` that ``mesh_dim`` divides split over
    it; None where ``spec`` already uses ``mesh_dim``, the mesh lacks it (or has it of size
    1: nothing to shard) or no dim fits."""
    if mesh_dim not in mesh.dim_names or mesh_dim in spec.mesh_dims():
        return None
    n = mesh.dim_size(mesh_dim)
    if n == 1:
        return None
    for d, size in enumerate(shape):
        if spec.dims[d] is None and size % n == 0:
            dims = list(spec.dims)
            dims[d] = mesh_dim
            return ShardSpec(dims)
    return None


def shard_updates(program: Program, mesh_dim: str = "dp") -> int:
    """Annotate the update ops of a completed program (see the module docstring); returns
    how many parameters' updates were sharded. Complete the program again afterwards."""
    count = 0
    for op in program.ops:
        if op.role is not Role.OPTIMIZE or not get_op(op.type).inplace or not op.inputs[0].is_parameter:
            continue
        param = op.inputs[0]
        mesh = op.dist_attr.mesh
        spec = sharded_spec(param.dist_attr.spec, param.shape, mesh, mesh_dim)
        if spec is None:
            continue
        # Pin where the parameter is stored, so the next completion keeps it there
        # instead of taking the sharded update's layout.
        param.annotation = param.annotation or param.dist_attr
        states = [op.inputs[i] for _, i in get_op(op.type).inplace if i > 0]
        for state in states:
            state.annotation = DistAttr(mesh, spec)
        grad = op.inputs[1]
        op.annotation = OpAnnotation(mesh, ((param.name, spec), (grad.name, spec)))
        # The write-backs are made in the update's layout: a search annotates them as it
        # laid the update out (the parameter's), which would win over the op's annotation
        # and leave the update whole, gathering the states to it and slicing them back.
        for out in op.outputs:
            if out.alias_of is not None:
                out.annotation = DistAttr(mesh, spec)
        count += 1
    return count


def sharded_states(program: Program, mesh_dims) -> bool:
    """Whether a completed program shards an update's optimizer states over one of
    ``mesh_dims`` (a name or a tuple of names) where the parameter it updates is not
    split over it: what :func:`shard_updates` leaves behind where it sharded something,
    and nothing else lays out (an update keeps its states as its parameter)."""
    dims = {mesh_dims} if isinstance(mesh_dims, str) else set(mesh_dims)
    for op in program.ops:
        if op.role is not Role.OPTIMIZE or not get_op(op.type).inplace or \
                not op.inputs[0].is_parameter:
            continue
        kept = set(op.inputs[0].dist_attr.spec.mesh_dims())
        for _, i in get_op(op.type).inplace:
            if i > 0 and (set(op.inputs[i].dist_attr.spec.mesh_dims()) & dims) - kept:
                return True
    return False
