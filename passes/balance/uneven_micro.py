"""Running a batch split unevenly by micro-batches (``Strategy(balance=True)`` with
``micro_batches``).

Pure. Each data-parallel group (*member* of the :class:`~.batch_split.BatchSplit`) runs its
own number of the plan's micro-batches, on the micro-batch program the even plan runs:
local shapes do not change. What must change is everything that makes the members meet
*inside* a micro-batch: with unequal counts there is no partner micro-batch to meet, and
a member that waited for one would set the others' pace again. So:

- :func:`defer_reductions` keeps sums over the split's mesh dims (a loss summed over the
  samples, the gradient of a sliced parameter) local through the ops that are linear in
  them, up to the update: the accumulated values are reduced there once, with the
  gradients (completion reduced them per micro-batch, before their first consumer). A
  sum that an op needs whole in every micro-batch (a non-linear op) cannot wait: a
  PlanError naming the op.
- the whole-batch sums of the accumulation's prologue (the count of labels a mean
  cross-entropy divides by) are reduced once, in the prologue (the task graph's
  ``prologue`` task);
- :func:`member_schedule` makes each member's schedule for its own count;
- :func:`check_member_traffic` is the check: no collective over the split's dims and no
  transfer between members is left in a per-micro-batch task (a PlanError naming it).

Example::

    program = defer_reductions(plan.program, plan.accumulation, ("dp",))
    order = member_schedule(graph, split)       # {pid: actions}, each member its count
"""

from __future__ import annotations

from types import MappingProxyType

from distgraph.errors import PlanError, ShardingError
from distgraph.ir import Role
from distgraph.passes.pipeline.accumulate import linear_in_sums
from distgraph.passes.pipeline.schedule import checked_schedule
from distgraph.plan.replay import Problem, problem_of
from distgraph.plan.schedule import Schedule
from distgraph.plan.kinds import PER_MICRO_BATCH, ItemKind, StepKind
from distgraph.plan.tasks import COMMUNICATING
from distgraph.passes.balance.uneven_rows import completed_copy
from distgraph.placement import DistAttr, ShardSpec

FIX = "use micro_batches=1 (a balanced split of rows) or Strategy(balance=False)"


def defer_reductions(program, accumulation, dims: tuple):
    """A completed copy of the micro-batch ``program`` whose sums over ``dims`` stay
    local until the update (see the module docstring)."""
    copy = completed_copy(program)
    split = set(dims)
    skipped = accumulation.skipped

    def partial(name) -> frozenset:
        return copy.values[name].dist_attr.spec.partial & split

    def sample_free(name) -> bool:
        return name not in accumulation.split_axis and not partial(name)

    for k, op in enumerate(copy.ops):
        if op.role is Role.OPTIMIZE or (op.outputs and all(o.name in skipped for o in op.outputs)):
            continue
        da = op.dist_attr
        waiting = {}
        for i, v in enumerate(op.inputs):
            held = partial(v.name)
            if (held and v.name not in accumulation.prologue and v.dist_attr.mesh == da.mesh
                    and not held <= da.input_specs[i].partial):
                waiting[i] = held
        if not waiting:
            continue
        names = ", ".join(op.inputs[i].name for i in waiting)
        where = f"op #{k} '{op.type}' ({op.layer or 'top level'})"
        if not linear_in_sums(op, sorted(waiting), sample_free):
            raise PlanError(f"Strategy(balance=True) gives the data-parallel groups different "
                            f"numbers of micro-batches, so sums over {', '.join(dims)} wait "
                            f"for the update, but {where} needs {names} summed over every "
                            f"group in each micro-batch; {FIX}")
        held = frozenset().union(*waiting.values())
        try:
            for i in waiting:
                want = da.input_specs[i]
                da.input_specs[i] = ShardSpec(want.dims, want.partial | held)
            for j, o in enumerate(op.outputs):
                made = da.output_specs[j]
                da.output_specs[j] = ShardSpec(made.dims, made.partial | held)
                o.dist_attr = DistAttr(da.mesh, da.output_specs[j])
        except ShardingError as e:
            raise PlanError(f"Strategy(balance=True): {where} cannot carry {names} as a sum "
                            f"over {', '.join(dims)} to the update ({e}); {FIX}") from None
    return copy


def member_schedule(graph, split) -> Schedule:
    """The schedule of ``graph`` with member g of ``split`` running its
    ``split.units[g]`` micro-batches (each member's processes by the plan's rules, as
    if they were the whole plan), checked to complete."""
    problem = problem_of(graph)
    orders: dict = {}
    for procs, count in zip(split.members, split.units):
        holders = tuple(tuple(p for p in held if p in procs) for held in problem.holders)
        own = Problem(count, holders, problem.kinds, problem.deps, problem.schedule,
                      problem.stages, problem.virtual)
        orders.update(checked_schedule(own).orders)
    return Schedule(problem.schedule, max(split.units),
                    MappingProxyType(dict(sorted(orders.items()))))


def check_member_traffic(plan, graph, split) -> None:
    """PlanError where a per-micro-batch task of ``graph`` still communicates between
    members of ``split``: a collective over its mesh dims, a transfer between members,
    or an op's own collective across them."""
    member = {p: g for g, procs in enumerate(split.members) for p in procs}
    dims = set(split.mesh_dims)

    def fail(what, task):
        counts = ", ".join(f"processes {list(m)}: {u}" for m, u in zip(split.members,
                                                                         split.units))
        raise PlanError(f"Strategy(balance=True) gives the data-parallel groups different "
                        f"numbers of micro-batches ({counts}), so nothing may pass between "
                        f"groups inside a micro-batch, but {what} in every micro-batch's "
                        f"{task.kind} task of stage {task.chunk}; {FIX}")

    for pid in graph.processes():
        local = plan.local(pid)
        for task in graph.tasks_of(pid).values():
            if task.kind not in PER_MICRO_BATCH:
                continue
            for it in task.items:
                if it.kind is ItemKind.OP:
                    op = local.program.ops[it.index]
                    ctx = local.op_context.get(it.index, {})
                    groups = ctx.get("groups") or ((ctx["group"],) if ctx.get("group") else ())
                    if local.op_comm.get(it.index) and (not groups or any(
                            len({member[q] for q in grp}) > 1 for grp in groups)):
                        fail(f"op '{op.type}' ({op.layer or 'top level'}) communicates "
                             f"across them", task)
                    continue
                if it.kind not in COMMUNICATING:
                    continue
                point = graph.points[it.index]
                for step in point.steps:
                    crosses = (any(member[t.src] != member[t.dst] for t in step.transfers)
                               if step.kind is StepKind.SEND_RECV else
                               step.kind.is_collective and step.mesh_dim in dims
                               and step.group_size > 1)
                    if crosses:
                        fail(f"{point.value} is resharded {point.src.spec} -> "
                             f"{point.dst.spec} ({step.kind} over "
                             f"{step.mesh_dim or 'a transfer'})", task)
