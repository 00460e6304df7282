"""The local programs of a batch split unevenly by rows (``Strategy(balance=True)``
without micro-batches).

Pure. A plan is completed and partitioned for the even split: each of the ``n``
data-parallel groups (*members* of the :class:`~.batch_split.BatchSplit`) reads ``B / n``
of the batch's ``B`` rows. Member ``g`` of an uneven split reads ``u_g``
rows instead, and its processes run the plan's program *as if the batch had* ``n u_g``
*rows*: :func:`member_program` grows or shrinks every dim that carries the samples
(:func:`distgraph.passes.samples.sample_axes`) by ``n u_g / B`` and the ``shape`` attributes
that spell a result's shape with it, and :func:`member_local` partitions that program for
one of the member's processes, whose block is then exactly its ``u_g`` rows. Constants
that average over the batch (a mean's ``1/B``) keep the real batch's value, so the local
sums scaled by them and summed over the members are the global batch's mean, and the
gradients those of the global batch. Random ops draw the real batch's tensor and take
the member's rows, as the even plan and the serial program do.

This holds when no samples pass between members: :func:`check_layouts` requires every
layout of a Value that carries samples to split its sample dim over the split's mesh
dims first and never to be Partial over them (each member holds only its rows). Values
without samples (parameters, gradients, the loss) have the same shape on every member,
so their collectives over the split's dims (the gradients' all-reduce) meet as before.
Every op of a member program is checked with its own shape inference.

Example::

    scaled = member_program(plan.program, axes_of(plan), batch=32, members=2, rows=22)
    local = member_local(scaled, 0, plan.program, axes_of(plan), 32, 0, 0, 22)
"""

from __future__ import annotations

import dataclasses

from distgraph.annotation import OpDistAttr
from distgraph.errors import PlanError, ShardingError
from distgraph.passes.partition import LocalProgram, partition
from distgraph.passes.pipeline.accumulate import check_shapes

FIX = ("keep every value that carries the batch's samples split over the data-parallel "
       "mesh dims, or use Strategy(balance=False)")


def completed_copy(program):
    """A copy of a completed ``program`` with its dist attributes (which the copy may
    change without touching ``program``)."""
    copy = program.clone()
    for name, v in program.values.items():
        copy.values[name].dist_attr = v.dist_attr
    for new, op in zip(copy.ops, program.ops):
        da = op.dist_attr
        new.dist_attr = OpDistAttr(da.mesh, list(da.input_specs), list(da.output_specs),
                                   list(da.notes))
    return copy


def check_layouts(program, axes: dict, dims: tuple) -> None:
    """PlanError unless every layout (a Value's, an operand's, a result's) of a Value
    carrying samples splits its sample dim over ``dims`` first and is not Partial over
    them: then each member of the split holds exactly its own rows."""
    def check(name, spec, mesh, where):
        axis = axes.get(name)
        if axis is None:
            return
        entry = spec.entry(axis)
        if entry[:len(dims)] != tuple(dims) or spec.partial & set(dims):
            v = program.values[name]
            raise PlanError(f"Strategy(balance=True) split the batch unevenly over "
                            f"{', '.join(dims)}, but {where} lays out {name} "
                            f"{list(v.shape)}, whose dim {axis} carries the samples, as "
                            f"{spec} on {mesh}: with unequal shares its rows cannot move "
                            f"between the data-parallel groups; {FIX}")

    for v in program.values.values():
        check(v.name, v.dist_attr.spec, v.dist_attr.mesh, "its producer")
    for k, op in enumerate(program.ops):
        where = f"op #{k} '{op.type}' ({op.layer or 'top level'})"
        da = op.dist_attr
        for v, spec in zip(op.inputs, da.input_specs):
            check(v.name, spec, da.mesh, where)
        for v, spec in zip(op.outputs, da.output_specs):
            check(v.name, spec, da.mesh, where)


def scaled_size(name: str, size: int, batch: int, rows: int) -> int:
    """The size of a sample dim of ``size`` (for a batch of ``batch`` rows) for a batch
    of ``rows`` rows; a PlanError where it is not a whole number."""
    if size * rows % batch:
        raise PlanError(f"Strategy(balance=True): {name}'s sample dim of {size} does not "
                        f"scale to a batch of {rows} rows (from {batch}); {FIX}")
    return size * rows // batch


def member_program(program, axes: dict, batch: int, members: int, rows: int):
    """A completed copy of ``program`` for a batch of ``members * rows`` rows, ``rows``
    per member (see the module docstring)."""
    total = members * rows
    copy = completed_copy(program)
    for name, axis in axes.items():
        v = copy.values[name]
        shape = list(v.shape)
        shape[axis] = scaled_size(name, shape[axis], batch, total)
        v.shape = tuple(shape)
    what = f"run on an uneven share of the batch ({rows} of {batch // members} rows)"
    for k, (new, op) in enumerate(zip(copy.ops, program.ops)):
        # a result's shape spelled out as an attribute (reshape, broadcast_to, full, ...)
        spelled = {tuple(o.shape): tuple(n.shape) for o, n in zip(op.outputs, new.outputs)
                   if o.name in axes}
        if "shape" in new.attrs:
            new.attrs["shape"] = spelled.get(tuple(new.attrs["shape"]), new.attrs["shape"])
        check_shapes(k, new, what, FIX)
    return copy


def member_local(scaled, pid: int, program, axes: dict, batch: int, start: int,
                 member: int, rows: int) -> LocalProgram:
    """Process ``pid``'s local program of ``scaled`` (a :func:`member_program` of
    ``program``), whose member ``member`` reads the ``rows`` rows from ``start`` of the
    real batch of ``batch``: its random ops draw the real batch's tensor and take those
    rows."""
    try:
        local = partition(scaled, pid)
    except ShardingError as e:
        raise PlanError(f"Strategy(balance=True): {rows} rows per data-parallel group do "
                        f"not divide over the plan's layouts: {e}; {FIX}") from None
    contexts = dict(local.op_context)
    for i, ctx in local.op_context.items():
        out = local.program.ops[i].outputs[0].name if local.program.ops[i].outputs else None
        if "out_global_shape" not in ctx or axes.get(out) is None:
            continue
        axis, real = axes[out], tuple(program.values[out].shape)
        per_row = real[axis] // batch
        shift = (start - member * rows) * per_row
        slices = list(ctx["out_slices"])
        slices[axis] = slice(slices[axis].start + shift, slices[axis].stop + shift)
        contexts[i] = {**ctx, "out_global_shape": real, "out_slices": tuple(slices)}
    return dataclasses.replace(local, op_context=contexts)
