"""What runs a plan whose batch split is uneven (``Strategy(balance=True)``).

Pure. :func:`run_split` takes a plan carrying a :class:`~.batch_split.BatchSplit` and
returns it with what its processes run:

- split by rows (no micro-batches): each data-parallel group's local programs on its own
  rows (:mod:`.uneven_rows`);
- split by micro-batches: the program with its sums over the split's mesh dims carried
  to the update (:mod:`.uneven_micro`), partitioned again;
- both: the fetched values that carry samples (a model's outputs when evaluating or
  predicting) are gathered with each process's part padded to the largest, and put back
  in the batch's order (:class:`~distgraph.plan.program.RowGather`).

When the groups run different numbers of micro-batches (:func:`runs_own_counts`),
:func:`member_schedule_of` gives the schedule of the plan's task graph instead of
:func:`~distgraph.passes.pipeline.schedule.schedule_of`: each group its own count, checked
to complete and that no group waits for another inside a micro-batch. Every refusal is
a PlanError at plan time, before any rank starts.

Example::

    planned = run_split(dataclasses.replace(plan, batch_split=split))
    planned.local(1)                 # process 1's program on its rows
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

from distgraph.errors import PlanError
from distgraph.passes.partition import Partitions
from distgraph.passes.balance.uneven_micro import (check_member_traffic, defer_reductions,
                                                  member_schedule)
from distgraph.passes.balance.uneven_rows import check_layouts, member_local, member_program
from distgraph.passes.samples import axes_of
from distgraph.plan.program import RowGather
from distgraph.plan.schedule import Schedule


def run_split(plan):
    """``plan`` with what runs its uneven ``batch_split`` (unchanged when it has none or
    an even one); see the module docstring."""
    split = plan.batch_split
    if split is None or split.is_even:
        return plan
    axes = axes_of(plan)
    if split.micro_batched:
        program = defer_reductions(plan.program, plan.accumulation, split.mesh_dims)
        partitions = Partitions(program, plan.process_ids)
        plan = dataclasses.replace(plan, built=dataclasses.replace(plan.built, program=program))
    else:
        partitions = Partitions.given(plan.program, _row_partitions(plan, split, axes))
    gathers = _row_gathers(plan, split, axes)
    return dataclasses.replace(plan, locals=partitions, groups=partitions.groups(),
                               row_gathers=MappingProxyType(gathers))


def runs_own_counts(plan) -> bool:
    """Whether ``plan``'s data-parallel groups run different numbers of micro-batches
    (an uneven split by micro-batches): its schedule is then :func:`member_schedule_of`."""
    split = plan.batch_split
    return split is not None and split.micro_batched and not split.is_even


def member_schedule_of(plan, graph) -> Schedule:
    """The schedule of ``graph`` (``plan``'s task graph) under an uneven split by
    micro-batches: each member runs its own count, checked to complete, and nothing may
    pass between members inside a micro-batch (a PlanError naming what does)."""
    check_member_traffic(plan, graph, plan.batch_split)
    return member_schedule(graph, plan.batch_split)


def _row_partitions(plan, split, axes) -> dict:
    program = plan.program
    check_layouts(program, axes, split.mesh_dims)
    batch, n = split.batch, len(split.members)
    scaled = {u: member_program(program, axes, batch, n, u * split.granule)
              for u in sorted(set(split.units))}
    partitions = {}
    for g, (procs, units) in enumerate(zip(split.members, split.units)):
        start = split.rows(procs[0])[0][0]
        for pid in procs:
            partitions[pid] = member_local(scaled[units], pid, program, axes, batch, start,
                                           g, units * split.granule)
    return partitions


def _row_gathers(plan, split, axes) -> dict:
    """{fetched name: RowGather} for the fetched values that carry samples."""
    program = plan.program
    rows = program.values[plan.built.feed_names[0]].shape[0]     # rows the program has
    n = len(split.members)
    out = {}
    for name in plan.built.fetch_names:
        axis = axes.get(name)
        if axis is None:
            continue
        v = program.values[name]
        if v.dist_attr.spec.entry(axis) != tuple(split.mesh_dims) or v.dist_attr.spec.partial:
            raise PlanError(f"Strategy(balance=True) split the batch unevenly over "
                            f"{', '.join(split.mesh_dims)}, and the fetched {name} "
                            f"{list(v.shape)} is laid out as {v.dist_attr.spec}: a value "
                            f"fetched whole under an uneven split must be split over "
                            f"exactly those mesh dims along its sample dim {axis}; lay it "
                            f"out so, or use Strategy(balance=False)")
        per_unit = v.shape[axis] * split.granule // rows     # entries per granule
        pad = max(split.units) * per_unit
        shape = list(v.shape)
        shape[axis] = n * pad
        take = [0] * (split.batch // split.granule * per_unit)
        for g, procs in enumerate(split.members):
            local = 0
            for start, stop in split.rows(procs[0]):
                for unit in range(start // split.granule, stop // split.granule):
                    for t in range(per_unit):
                        take[unit * per_unit + t] = g * pad + local + t
                    local += per_unit
        out[name] = RowGather(name, axis, pad, tuple(shape), tuple(take))
    return out
