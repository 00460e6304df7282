"""The automatic search (``Strategy(auto_mode="full")``), behind one call:

    choice = choose(built, strategy, cluster, budget=None, session=None)

A built program, a strategy and a cluster in; one frozen :class:`Choice` out: the program
the plan runs with every op's layout written on it (and, with ``pipeline=True``, its
stage), the micro-batch count, the chunks per stage, the rank mapping the search priced
and its report. The planner (:mod:`distgraph.passes.planner`) completes the chosen
program, checks that it fits (:mod:`distgraph.passes.fitting`) and makes the Plan.

Which module decides what:

| decision | module | how |
|---|---|---|
| the micro-batch count (``micro_batches=None``) | ``stages/micro.py`` | the stage search priced at neighbouring counts, bounds first |
| the layers a stage can hold | ``stages/layers.py`` | Alpa's operator clustering; runs of identical blocks |
| stages and their submeshes | ``stages/pipeline.py``, ``stage_dp.py`` | Alpa's inter-op DP on the intra-op searches' costs |
| ... for runs of identical blocks | ``stages/runs.py``, ``run_dp.py``, ``block_plans.py``, ``interleaved.py`` | one search per logical mesh, the DP linear in the blocks, memory variants |
| what passing a stage's blocks on costs | ``stages/boundary.py``, ``part_costs.py`` | cross-mesh reshards priced as the estimate prices them |
| the mesh of a search without stages | ``layouts/mesh.py`` | the annotations' mesh, else the cluster's device mesh |
| every op's layout on a mesh | ``layouts/intra_op.py`` | Alpa's ILP (``ilp.py`` on SCIP, ``ilp_bound.py``), MindSpore's double recursion (``recursive.py``, ``tree_moves.py``) |
| what a framework runs (``Strategy(target=...)``) | ``layouts/space.py`` (weights' and feeds' layouts), ``stages/even.py`` (even splits), here (the (dp, tp) shapes of a search without stages) | :mod:`distgraph.plan.styles`'s predicate, shared with ``plan.export`` |
| what a layout costs | ``layouts/costs.py``, ``charges.py``, ``liveness.py``, ``sharded_states.py`` | the cost model's prices (:mod:`distgraph.passes.cost`) on each strategy |
| what the backward hides (one mesh, ``overlap=True``) | ``layouts/buckets.py`` | the choice's gradient buckets priced by the accountant (:func:`~distgraph.passes.cost.exposed.exposed`); searched again where it pays less |

Every memo of one planning lives in its :class:`~distgraph.passes.session.Session`
(the planner makes one per ``plan`` call; ``choose`` makes one when given none), in at
most these tables; the search's report (``Plan.search``) lists what each held and served:

| table | key | value | kept by |
|---|---|---|---|
| micro-batch programs | M; (search, M); (search, None, budget) | M's split program and accumulation; its RunCosts and (budget, stage plan) for a search; the count chosen within a budget | ``stages/micro.py`` |
| sample analyses | (program, feeds, dim) | the completion on samples the other counts' splits replay | ``passes/samples.py`` |
| stage options | (RunCosts, logical mesh); (LayerRangeCosts, layers, submesh) | its fastest parts and memory variants; a stage's cost and search | ``stages/runs.py``, ``stages/layer_ranges.py`` |
| mesh searches | (RunCosts, kind of mesh) | the searches others are priced from (a donor's) | ``stages/runs.py`` |
| boundary prices | (program, boundary key); a reshard; a Value on its devices | a stage's p2p seconds; its steps; their seconds | ``cost/boundary.py`` |
| search problems | a search's inputs | its space, shared blocks, problem and recursive search (Descents) | ``layouts/intra_op.py`` |
| recursive descents | (Descents, lam) | the descents' choices, objectives and peaks | ``layouts/recursive.py`` |
| edge prices | (descent, class, pair, far end's candidates) | the cheapest reshard per strategy | ``layouts/recursive.py`` |
| tree moves | (Flat, prices, forest[, state]) | a forest's optimistic trials; where a run of moves ends | ``layouts/tree_moves.py`` |
| layout prices | (cluster, mesh, devices, sample axes); meshes priced alike | their LayoutPrices; the first of them | ``cost/layout_prices.py`` |
| op prices | (LayoutPrices, op signature) | its strategies' compute, collective and kept bytes; a gather | ``cost/layout_prices.py`` |
| reshard prices | (meshes priced alike, tensor, layouts); (..., step, bytes) | seconds of a reshard, a matrix of them; of a step | ``cost/layout_prices.py`` |
| reshard paths | a layout; (mesh shape, pair of layouts) | its number; plan_reshard's path | ``cost/layout_prices.py`` |
| op strategies | (mesh shape, what an op or source offers) | rules bound, strategies, followers' answers, moved choices | ``layouts/space.py`` |
| program facts | (program, what) | who makes and reads each Value, ops keeping nothing, chunks | ``layouts/space.py``, ``runs.py`` |

Example::

    choice = choose(built, dg.Strategy(auto_mode="full", pipeline=True), cluster)
    print(choice.report)          # layers, stages and each stage's search
"""

from __future__ import annotations

import dataclasses

import numpy as np

from distgraph.errors import PlanError
from distgraph.ir import Role
from distgraph.mesh import ProcessMesh
from distgraph.passes.choice import Choice
from distgraph.passes.cost.stage import stage_cost
from distgraph.passes.prepare import transformed
from distgraph.passes.search.layouts.buckets import bucketed
from distgraph.passes.search.layouts.intra_op import search
from distgraph.passes.search.layouts.mesh import search_mesh
from distgraph.passes.search.layouts.sharded_states import sharding_dim, zero_asked
from distgraph.passes.search.layouts.space import MESH_DIMS
from distgraph.passes.session import Session
from distgraph.units import GB
from distgraph.passes.search.stages.micro import searched_as, searched_count, split_in
from distgraph.passes.search.stages.part_cost import measure
from distgraph.passes.search.stages.pipeline import plan_pipeline
from distgraph.passes.search.stages.recompute_stages import realised

__all__ = ["Choice", "Session", "choose", "searched_choice"]

# the pipeline schedules each target runs, by distgraph's names (without interleaving)
TARGET_SCHEDULES = {"megatron": ("1F1B",), "torchtitan": ("1F1B", "FThenB")}


def searched_choice(prepared, strategy, accumulation, result, rank_mapping) -> Choice:
    """The :class:`~distgraph.passes.choice.Choice` of a search's ``result`` (written on
    ``prepared``'s program): its report, the chunks it chose, the mesh dims ZeRO shards
    over as it names them and, where it chose per update, the parameters whose updates
    it shards (the strategy's ``sharding`` then says whether there are any), and its
    check of what completion kept."""
    zero = zero_asked(strategy)
    params = result.zero_params() if zero is not None and zero.chosen else None
    if strategy.sharding is None:
        strategy = dataclasses.replace(strategy, sharding=params is None or bool(params))
    return Choice(prepared, strategy, accumulation, rank_mapping,
                  getattr(result, "chunks", None), sharding_dim(strategy), result.report,
                  result.check, result, params)


def choose(built, strategy, cluster, budget: float | None = None,
           session: Session | None = None, per_stage: bool = False) -> Choice:
    """The search's choice for ``built`` (a BuiltProgram) under ``strategy`` on
    ``cluster``, within ``budget`` bytes per device and the devices' usable memory
    (None: that alone; no limit without a cluster); ``per_stage``: the
    strategy's recomputation was left to the search (``Strategy(recompute=None)``), which
    runs it only on the stages that need it (:mod:`~distgraph.passes.search.stages.
    recompute_stages`); with it, ``Strategy(recompute=None)``: none, planned as the
    planner weighs it first, stopped (:class:`~distgraph.passes.cost.fit.MemoryBinds`) where memory held
    back the plan of the first micro-batch count the search priced (so that recomputation
    is planned before the rest of the counts are walked). Pure: ``built`` is not
    modified."""
    _check_target(strategy)
    session = session or Session()
    # recomputation as the planner weighs it (passes/fitting.py) first: none; ZeRO's
    # sharding left None is chosen per update by the search (layouts/sharded_states.py)
    stop = per_stage and strategy.recompute is None
    if strategy.recompute is None:
        strategy = dataclasses.replace(strategy, recompute=False)
    # M -> (program, accumulation); (search, M) -> (RunCosts, (budget, stage plan));
    # (search, None, budget) -> the count chosen within budget (stages/micro.py): where
    # the planner lowers the budget (passes/fitting.py) the counts are weighed again
    # under it, since what fits reorders them
    programs = session.table("micro-batch programs")
    search = searched_as(strategy)
    micro = strategy.micro_batches
    if micro is None:
        micro = programs.memo((search, None, budget), lambda: searched_count(
            built, strategy, cluster, session, budget, stop))
    asked = dataclasses.replace(strategy, micro_batches=micro)
    program, accumulation = split_in(built, micro, session)
    costs, planned = programs.find((search, micro)) or (None, None)
    prepared = transformed(program, asked)
    if asked.pipeline:
        # the other counts looked at say with this one whether memory held a plan back
        looked = [(entry[0], key[1]) for key, entry in programs.items()
                  if isinstance(key, tuple) and key[0] == search and key[1] is not None
                  and entry[0] is not None]
        result = plan_pipeline(prepared, asked, cluster, accumulation, budget, costs, planned,
                               session, looked, plain=(lambda: transformed(
                                   program, dataclasses.replace(asked, recompute=False)))
                               if per_stage else None)
        rank_mapping = result.rank_mapping
        if result.recompute is not None:
            # recomputation chosen per stage: the chosen layouts on the program so prepared
            asked = dataclasses.replace(asked, recompute=result.recompute)
            searched, prepared = prepared, transformed(program, asked)
            realised(searched, prepared)
        if asked.virtual_stages > 1:
            # the stage search chose how many chunks per stage (up to the strategy's)
            chunks = result.chunks
            asked = dataclasses.replace(asked, virtual_stages=chunks[1] if chunks else 1)
    else:
        result, rank_mapping = _layouts(prepared, asked, cluster, accumulation, budget, session)
    # the report says what the planning's tables held and served, this search included
    result = dataclasses.replace(result, report=dataclasses.replace(
        result.report, memos=tuple(session.stats())))
    return searched_choice(prepared, asked, accumulation, result, rank_mapping)


def _layouts(prepared, strategy, cluster, accumulation, budget, session) -> tuple:
    """(the intra-op search's result on the program's mesh, written onto it; the rank
    mapping it priced). Under ``Strategy(target=...)`` the search's own mesh is searched
    as (data, tensor) meshes of its devices (:func:`_target_meshes`), the fastest kept."""
    program = prepared.program
    micro = accumulation.micro_batches if accumulation is not None else 1
    weights = {Role.FORWARD: micro, Role.LOSS: micro, Role.BACKWARD: micro, Role.OPTIMIZE: 1}
    found, failed = None, None
    rows = program.inputs[0].shape[0] if program.inputs and program.inputs[0].shape else 1
    mesh, device_of = search_mesh(program, cluster)
    # what its devices may hold is a limit, budget or not
    held = None if cluster is None else \
        min(cluster.device(d).usable_memory() for d in device_of.values()) * GB
    for mesh, device_of in _target_meshes(mesh, device_of, strategy.target, rows):
        try:
            result = search(program, mesh, cluster, device_of, weights=weights,
                            loss=prepared.loss_name, memory_budget=budget, memory=True,
                            time_limit=strategy.solver_time_limit, blocks=prepared.block_paths,
                            balance=strategy.balance, method=strategy.search_method,
                            zero=zero_asked(strategy), session=session,
                            style=strategy.target, bucket_mb=bucketed(prepared, strategy),
                            copies=True, limit=held)
        except PlanError as e:          # no layout the target runs fits this shape
            failed = failed or e
            continue
        if found is None or result.report.step_time < found[0].report.step_time:
            found = result, device_of
    if found is None:
        raise failed
    result, device_of = found
    result.annotate(program)
    if micro > 1:
        # its peak as the accountant counts a stage: a later micro-batch's gradients
        # beside the buffers the first one's became (part_cost.measure), which the
        # search's liveness holds once
        part = measure(result, program, weights, strategy)
        peak = stage_cost({"first": (part, result)}, True, 0, False).one * GB
        result = dataclasses.replace(result, report=dataclasses.replace(
            result.report, peak_memory=peak))
    return result, device_of


def _target_meshes(mesh, device_of, target, rows: int) -> list:
    """[(mesh, device_of)] the search plans on: ``mesh`` alone, or under a target where
    ``mesh`` is the search's own (dims x, y .. over processes 0 .. n-1, not annotated),
    its processes as (data, tensor) meshes whose tensor dim is its last dims (none, the
    last, ..., all), so that each of its dims is data or tensor parallel: every layout
    there is one of ``mesh``'s, and the search under a target a restriction of it. The
    data dim divides the batch's ``rows``: each data-parallel rank reads its own."""
    n = mesh.size
    if target is None or tuple(mesh.dim_names) != tuple(MESH_DIMS[:mesh.ndim]) or \
            list(mesh.process_ids) != list(range(n)):
        return [(mesh, device_of)]
    tensors = sorted({int(np.prod(mesh.shape[k:])) for k in range(mesh.ndim + 1)})
    return [(ProcessMesh(np.arange(n).reshape(n // t, t).tolist(), dim_names=["x", "y"]),
             device_of) for t in tensors if rows % (n // t) == 0]


def _check_target(strategy) -> None:
    """PlanError where ``strategy`` asks a target for what its framework does not run."""
    target = strategy.target
    if target is None:
        return
    if strategy.virtual_stages > 1 or strategy.schedule == "ZBV":
        raise PlanError(f"Strategy(target={target!r}) does not interleave stages: distgraph "
                        f"cuts virtual stages by equal work, {target} by whole layers; "
                        f"use virtual_stages=1 and schedule '1F1B'")
    if strategy.balance:
        raise PlanError(f"Strategy(target={target!r}, balance=True): {target} splits the batch "
                        f"evenly over its data-parallel ranks; leave balance False")
    if strategy.pipeline and strategy.schedule not in TARGET_SCHEDULES[target]:
        raise PlanError(f"{target} has no pipeline schedule {strategy.schedule!r}; with "
                        f"Strategy(target={target!r}) use one of "
                        f"{', '.join(TARGET_SCHEDULES[target])}")
