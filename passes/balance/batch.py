"""``Strategy(balance=True)``: the balanced split of a plan's batch, from the cost model.

:func:`balance_batch` is pure. It finds the data-parallel groups of a planned program
(the processes that read the same rows: those at the same coordinates of the mesh dims
that split dim 0 of the feeds, on every stage), prices each process with the estimate
(:func:`distgraph.passes.cost.estimate.price_process`) at two shares of the batch to get a
linear model of its busy time (seconds per row, or per micro-batch, and a fixed part:
updates, gradient reductions, launch costs), bounds each group's share by its devices'
usable memory (:func:`~distgraph.passes.cost.fit.limit_of`: ``Device.usable_memory``, at
most ``Strategy.memory_budget_gb`` where given) with the
estimate's peak-memory model, and solves the split with
:func:`distgraph.passes.balance.batch_split.solve_split`.

The reference is the plan's even split: the program is planned (completed and
partitioned) for the even layout, so its batch divides by the number of groups; the
split then says how many of the batch's rows (or micro-batches) each group reads.

Example::

    p = dg.passes.plan(built, dg.Strategy(balance=True), cluster)
    print(p.batch_split)          # rows per process, predicted busy time per group
"""

from __future__ import annotations

import math
from fractions import Fraction

from distgraph.errors import PlanError
from distgraph.passes.balance.batch_split import BatchSplit, Member, SplitProblem, solve_split
from distgraph.passes.cost.estimate import price_process
from distgraph.passes.cost.fit import limit_of
from distgraph.passes.cost.shares import Share
from distgraph.passes.samples import axes_of
from distgraph.placement import DistAttr
from distgraph.resources.cluster import Cluster

LOW, HIGH = 0.5, 1.5           # the shares (of the even one) the linear model is fitted on


def batch_mesh_dims(plan) -> tuple:
    """The mesh dims that split dim 0 of every feed of ``plan`` (major first); a
    PlanError where the feeds disagree or none is split."""
    program = plan.program
    entries = {name: program.values[name].dist_attr.spec.entry(0)
               for name in plan.built.feed_names if program.values[name].shape}
    found = set(entries.values())
    if len(found) != 1 or not next(iter(found), ()):
        said = ", ".join(f"{n} {list(program.values[n].shape)} "
                         f"{program.values[n].dist_attr.spec}" for n in entries)
        raise PlanError("Strategy(balance=True) balances a data-parallel split of the batch, "
                        "but this plan does not split dim 0 of every input over the same mesh "
                        f"dims ({said}); annotate the inputs with dg.shard_tensor(x, mesh, "
                        "['dp', ...]), or use balance=False")
    return found.pop()


def members_of(plan, dims: tuple) -> list[list[int]]:
    """The processes of each data-parallel group, in the order of the batch's blocks."""
    groups: dict = {}
    for s, mesh in enumerate(plan.stages):
        missing = [d for d in dims if d not in mesh.dim_names]
        sizes = [mesh.dim_size(d) for d in dims if d in mesh.dim_names]
        if missing or (groups and math.prod(sizes) != len(groups)):
            raise PlanError(f"Strategy(balance=True) gives every stage the same split of the "
                            f"batch over {', '.join(dims)}, but stage {s} runs on {mesh}; "
                            "split every stage's batch over mesh dims of the same names and "
                            "sizes, or use balance=False")
        for pid in mesh.process_ids:
            coord = mesh.coord(pid)
            block = 0
            for d in dims:
                i = mesh.dim_index(d)
                block = block * mesh.shape[i] + coord[i]
            groups.setdefault(block, [])
            if pid not in groups[block]:
                groups[block].append(pid)
    return [groups[b] for b in sorted(groups)]


def balance_batch(plan, cluster=None, time_limit: float = 60.0) -> BatchSplit:
    """The balanced BatchSplit of ``plan`` on ``cluster`` (see the module docstring)."""
    cluster = cluster or plan.cluster or Cluster.local(plan.world_size)
    dims = batch_mesh_dims(plan)
    groups = members_of(plan, dims)
    n = len(groups)
    acc = plan.accumulation
    if acc is not None:
        batch, granule = acc.batch, acc.micro_batch_rows // n
        units, even = n * acc.micro_batches, acc.micro_batches
    else:
        batch = plan.program.values[plan.built.feed_names[0]].shape[0]
        granule = row_granule(plan, dims, batch)
        units, even = batch // granule, batch // n // granule
    budget = plan.strategy.memory_budget_gb
    members = []
    for procs in groups:
        times, caps, devices = [], [], []
        for pid in procs:
            fixed, per_unit, cap, device = _model(plan, pid, cluster, dims, even, budget)
            times.append((fixed, per_unit))
            caps.append(cap)
            devices.append(device)
        known = [c for c in caps if c is not None]
        members.append(Member(tuple(procs), tuple(devices), tuple(times),
                              min(known) if known else None))
    problem = SplitProblem(units, granule, tuple(members))
    chosen, report = solve_split(problem, time_limit)
    return BatchSplit(batch, granule, acc is not None, tuple(dims),
                      tuple(tuple(m) for m in groups), chosen,
                      tuple(m.busy(u) for m, u in zip(members, chosen)), report)


def row_granule(plan, dims: tuple, batch: int) -> int:
    """Rows per granule of a split without micro-batches: the fewest rows whose share of
    every layout that carries the samples still divides over the mesh dims splitting
    its sample dim after ``dims`` (a sample dim split over dp, then mp, needs the rows
    of a dp group in multiples of mp). The even plan's share is a multiple of it."""
    program = plan.program
    axes = axes_of(plan)
    layouts = [(v.name, v.dist_attr) for v in program.values.values()]
    layouts += [(v.name, DistAttr(op.dist_attr.mesh, spec)) for op in program.ops
                for v, spec in zip(op.inputs, op.dist_attr.input_specs)]
    granule = 1
    for name, attr in layouts:
        if name not in axes:
            continue
        entry = attr.spec.entry(axes[name])
        if entry[:len(dims)] != tuple(dims):
            continue          # cannot be split unevenly at all: the uneven plan says so
        parts = math.prod(attr.mesh.dim_size(d) for d in entry[len(dims):])
        # r rows hold r * p / q entries of the sample dim, to be split in ``parts``
        per_row = Fraction(program.values[name].shape[axes[name]], batch)
        p, q = per_row.numerator, per_row.denominator
        granule = math.lcm(granule, parts * q // math.gcd(p, parts * q))
    return granule


def _model(plan, pid, cluster, dims, even: int, budget_gb) -> tuple:
    """(fixed seconds, seconds per granule, most granules its memory holds or None,
    device) of process ``pid``: the estimate at two shares, joined by a line."""
    if plan.accumulation is not None:
        low, high = 1, 2
        shares = [Share(micro_batches=k, mesh_dims=dims) for k in (low, high)]
    else:
        low, high = LOW * even, HIGH * even
        shares = [Share(rows=k / even, mesh_dims=dims) for k in (low, high)]
    at = [price_process(plan, pid, cluster, share)[0] for share in shares]
    per_unit = max((at[1].busy - at[0].busy) / (high - low), 0.0)
    fixed = max(at[0].busy - per_unit * low, 0.0)
    limit = limit_of(cluster, at[0].device, budget_gb)
    return fixed, per_unit, _memory_cap(plan, at, low, high, limit), at[0].device


def _memory_cap(plan, at, low, high, limit) -> int | None:
    """The most granules whose estimated peak stays within ``limit`` bytes (None: any)."""
    per_unit = (at[1].peak_memory - at[0].peak_memory) / (high - low)
    if per_unit <= 0:
        return None if at[0].peak_memory <= limit else 0
    base = at[0].peak_memory - per_unit * low
    if plan.accumulation is not None and plan.strategy.schedule != "FThenB":
        # 1F1B keeps at most (stages - stage) micro-batches in flight, however many it runs
        in_flight = len(plan.stages) - at[0].stage
        if base + per_unit * in_flight <= limit:
            return None
    return max(int(math.floor((limit - base) / per_unit + 1e-9)), 0)
