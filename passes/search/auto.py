"""``Strategy(auto_mode="full")`` in the planner: where the search plans, and how its
choice becomes the annotations that completion then follows.

- **The mesh.** With annotations, the search plans on the one ProcessMesh they use (and
  keeps them: they are hard constraints); without, on a ProcessMesh of the shape of the
  cluster's device mesh (dims ``x``, ``y``, ... in the device mesh's order, so ``x`` of a
  machines x devices mesh runs across the machines), one process per device. Process p
  runs on the mesh's p-th device in row-major order: the search priced each collective
  on those devices' links, so the planner's rank mapping is that one.
- **The search** (:mod:`distgraph.passes.search.intra_op`) runs on the program the plan executes
  (after recomputation, on the micro-batch program with micro-batches, whose forward and
  backward then count once per micro-batch), within ``Strategy.solver_time_limit``
  seconds, under ``Strategy.memory_budget_gb`` per device.
- **The budget holds for the estimate.** The ILP's memory model counts the results live
  at each op; the estimate also counts reshard buffers (a resharded copy lives until its
  last consumer) and, under a pipeline schedule, micro-batches in flight. When the
  estimated peak of the chosen plan exceeds the budget, the search runs again with the
  ILP's budget lowered by the excess (``BUDGET_ROUNDS`` searches at most); a budget
  nothing fits raises PlanError naming the smallest peak.

Example::

    p = dg.passes.plan(built, dg.Strategy(auto_mode="full"), cluster)
    print(p.search)            # status, objective, gap, chosen layouts per layer
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from distgraph.errors import PlanError
from distgraph.ir import Role
from distgraph.mesh import ProcessMesh
from distgraph.passes.search.intra_op import search
from distgraph.passes.search.sharded_states import sharding_dim
from distgraph.passes.search.space import GB, MESH_DIMS
from distgraph.passes.search.stages import plan_pipeline

BUDGET_ROUNDS = 4


@dataclass(frozen=True)
class AutoChoice:
    """What the planner needs back: the search's result and the rank mapping
    ({process: device global id}) the search priced."""

    result: object
    rank_mapping: dict


def search_mesh(program, cluster) -> tuple[ProcessMesh, dict]:
    """(the mesh the search plans on, process -> device global id)."""
    meshes = {op.annotation.mesh for op in program.ops if op.annotation is not None}
    meshes |= {v.annotation.mesh for v in program.values.values() if v.annotation is not None}
    if len(meshes) > 1:
        raise PlanError(f"Strategy(auto_mode='full') searches one mesh, but the annotations "
                        f"use {len(meshes)}: {', '.join(sorted(map(str, meshes)))}; annotate "
                        "on one mesh, or use auto_mode='semi' to place stages by hand")
    devices = _device_mesh(cluster)
    if meshes:
        mesh = meshes.pop()
        if mesh.size > len(devices.ids):
            raise PlanError(f"the annotations use {mesh} ({mesh.size} processes), but device "
                            f"mesh {devices.name} of the cluster has {len(devices.ids)} devices: "
                            f"launch {mesh.size} ranks (`distgraph run -n {mesh.size} ...`), "
                            f"give a cluster with {mesh.size} devices, or annotate on a mesh of "
                            f"{len(devices.ids)}")
        return mesh, {p: devices.ids[i] for i, p in enumerate(mesh.process_ids)}
    n = len(devices.ids)
    mesh = ProcessMesh([[*range(n)]][0], dim_names=["x"]) if len(devices.shape) == 1 else \
        ProcessMesh(_grid(devices.shape), dim_names=list(MESH_DIMS[:len(devices.shape)]))
    return mesh, {p: devices.ids[p] for p in range(n)}


def _grid(shape):
    ids = list(range(math.prod(shape)))
    for size in reversed(shape[1:]):
        ids = [ids[i:i + size] for i in range(0, len(ids), size)]
    return ids


def _device_mesh(cluster):
    if cluster is None:
        raise PlanError("Strategy(auto_mode='full') searches a plan for a cluster: pass "
                        "cluster=dg.Cluster.from_file(...) or dg.Cluster.local(N)")
    meshes = cluster.device_meshes
    if len(meshes) > 1:
        raise PlanError(f"cluster {cluster.name or '(unnamed)'} has {len(meshes)} device meshes "
                        f"({', '.join(m.name for m in meshes)}); the intra-op search plans on "
                        "one: use Strategy(auto_mode='full', pipeline=True) to place stages "
                        "on several")
    if len(meshes[0].shape) > len(MESH_DIMS):
        raise PlanError(f"device mesh {meshes[0].name} has {len(meshes[0].shape)} dims; the "
                        f"search names at most {len(MESH_DIMS)}")
    return meshes[0]


def annotate(copy, strategy, cluster, accumulation, ilp_budget, runs=None) -> AutoChoice:
    """Search the plan of ``copy`` (a BuiltProgram the planner completes next) under
    ``ilp_budget`` bytes per process (None: no limit) and write the choice onto its
    program as annotations (``runs``: see :func:`~distgraph.passes.search.stages.
    plan_pipeline`)."""
    if strategy.pipeline:
        choice = plan_pipeline(copy, strategy, cluster, accumulation, ilp_budget, runs)
        return AutoChoice(choice, choice.rank_mapping)
    program = copy.program
    mesh, device_of = search_mesh(program, cluster)
    micro = accumulation.micro_batches if accumulation is not None else 1
    weights = {Role.FORWARD: micro, Role.LOSS: micro, Role.BACKWARD: micro, Role.OPTIMIZE: 1}
    result = search(program, mesh, cluster, device_of, weights=weights, loss=copy.loss_name,
                    memory_budget=ilp_budget, time_limit=strategy.solver_time_limit,
                    blocks=copy.block_paths, balance=strategy.balance,
                    method=strategy.search_method, zero=sharding_dim(strategy))
    result.annotate(program)
    return AutoChoice(result, device_of)


def within_budget(strategy, plan_once):
    """``plan_once(ilp_budget)`` (a Plan with its estimate) whose estimated peak memory
    fits ``Strategy.memory_budget_gb``: the ILP's budget is lowered by the excess until
    it does (module docstring)."""
    if strategy.memory_budget_gb is None:
        return plan_once(None)
    budget = ilp_budget = strategy.memory_budget_gb * GB
    asked = f"Strategy(memory_budget_gb={strategy.memory_budget_gb:g})"
    peak = None
    for _ in range(BUDGET_ROUNDS):
        try:
            planned = plan_once(ilp_budget)
        except PlanError as e:
            smallest = getattr(e, "smallest_peak", None)
            if smallest is None:
                raise
            raise PlanError(f"no plan fits {asked}: the smallest peak memory any plan reaches "
                            f"is {smallest / GB:.4g} GB per device (the results live at once"
                            + ("" if peak is None else f"; with reshard buffers the plans that "
                               f"come closest need {peak / GB:.4g} GB") +
                            "); raise the budget") from None
        peak = planned.estimate.peak_memory
        if peak <= budget:
            return planned
        ilp_budget -= peak - budget
    raise PlanError(f"no plan found that fits {asked}: the last one searched needs "
                    f"{peak / GB:.4g} GB per device (its reshard buffers come on top of what "
                    "the search counts); raise the budget")
