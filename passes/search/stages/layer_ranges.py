"""The stage DP's prices of a model without identical blocks (Alpa's layer ranges,
:func:`~distgraph.passes.search.stages.layers.cluster_layers`): one intra-op search per
(distinct layer range, submesh), priced by the accountant as a stage of one part, with
the reshards of the Values it receives from the stages beside it; and the chosen
stages restated where they are placed (:meth:`LayerRangeCosts.restated`).

Example::

    costs = LayerRangeCosts(prepared, strategy, cluster, layering, micro)
    plan = plan_stages(layering.count, cluster, costs, micro_batches=micro)
"""

from __future__ import annotations

import dataclasses

import numpy as np

from distgraph.ir import Role
from distgraph.mesh import ProcessMesh
from distgraph.passes.cost.boundary import pieces, values_seconds
from distgraph.passes.cost.layout_prices import process_kinds
from distgraph.passes.cost.stage import held, in_flight, stage_cost, step_time
from distgraph.passes.search.layouts.buckets import bucketed
from distgraph.passes.search.layouts.intra_op import price, search
from distgraph.passes.search.layouts.sharded_states import zero_asked
from distgraph.passes.search.layouts.space import MESH_DIMS
from distgraph.passes.search.stages.part_cost import measure
from distgraph.passes.search.stages.runs import pricing_method
from distgraph.passes.search.stages.stage_dp import StageCost
from distgraph.passes.session import Session


class LayerRangeCosts:
    """The DP's cost callback: one intra-op search per (distinct layer range, submesh),
    kept in ``session``'s "stage options" (by the range's ops' signature and place for
    the cost, by the range for the search), priced by the accountant as a stage of one
    part (:func:`~distgraph.passes.cost.stage.stage_cost` of its
    :func:`~distgraph.passes.search.stages.part_cost.measure`) with the reshards of the
    Values it receives from other stages each micro-batch (:meth:`_received`), from its
    layout on the devices of a stage beside it (:meth:`_sides`) to its own: the sender's
    seconds and its own (:func:`~distgraph.passes.cost.boundary.values_seconds`), as
    each direction of a boundary costs both sides alike."""

    def __init__(self, prepared, strategy, cluster, layering, micro, session=None):
        self.prepared, self.strategy, self.cluster = prepared, strategy, cluster
        self.layering, self.micro = layering, micro
        self.session = session or Session()
        self.options = self.session.table("stage options")
        self.weights = {Role.FORWARD: 1, Role.LOSS: 1, Role.BACKWARD: 1,
                        Role.OPTIMIZE: 1 / micro}
        self.searches = 0

    def __call__(self, layers: range, sub) -> StageCost:
        ops = self.layering.ops(layers)
        place = (layers.start == 0, layers.stop == self.layering.count)
        return self.options.memo(
            (self, "cost", self._signature(ops), place, sub.mesh.name, sub.shape),
            lambda: self.price(self.result(layers, sub.mesh, sub.shape, ops), self._sides(sub)))

    def price(self, result, sides) -> StageCost:
        """What a stage of ``result``'s choice costs, on its devices ``sides[0]`` beside a
        stage on ``sides[1]`` (class docstring)."""
        part = measure(result, self.prepared.program, self.weights, self.strategy,
                       bucketed(self.prepared, self.strategy))
        one = stage_cost({"first": (part, result)}, True, 0, False)
        sends = values_seconds(result, tuple(result.space.mesh.shape), sides,
                               self._received(result), self.cluster,
                               self.session.table("boundary prices"))
        return StageCost(one.seconds + sends, one.one, one.further, one.before, one.update)

    def restated(self, stage_plan, results) -> tuple:
        """(``stage_plan`` with each stage's seconds, memory and update those of its
        search in ``results``, priced on the devices it is placed on and beside its
        neighbour's, the step with them; the results so priced): the DP priced a
        submesh shape on the first devices of its mesh, by the method that prices its
        candidates, and the plan's estimate prices each stage where it runs, as
        chosen."""
        stages, M = stage_plan.stages, stage_plan.micro_batches
        restated, priced = [], []
        for s, (stage, result) in enumerate(zip(stages, results)):
            mesh, first = _submesh(self.cluster.device_mesh(stage.mesh), stage.shape)
            here = dict(enumerate(stage.device_ids))
            if process_kinds(self.cluster, mesh, first) != \
                    process_kinds(self.cluster, mesh, here):
                result = price(result.space.rebind(mesh, result.choice, self.prepared.program),
                               self.cluster, here, weights=self.weights,
                               loss=self._loss(result.space.ops), status=result.report.status,
                               zero=zero_asked(self.strategy), session=self.session)
            beside = stages[s + 1 if s + 1 < len(stages) else s - 1]
            cost = self.price(result, [np.array(stage.device_ids), np.array(beside.device_ids)]
                              if len(stages) > 1 else [])
            restated.append(dataclasses.replace(
                stage, time=cost.time, update=cost.update,
                memory=held(cost.memory, cost.activation_memory,
                            in_flight(self.strategy.schedule, M, len(stages), s), M,
                            cost.before)))
            priced.append(result)
        return (dataclasses.replace(stage_plan, stages=tuple(restated),
                                    objective=step_time([st.time for st in restated], M)),
                priced)

    def _sides(self, sub) -> list:
        """The devices of ``sub`` and of a stage beside it: the next submesh of its shape
        on its device mesh, else the first devices of another device mesh."""
        found = pieces(sub)
        if len(found) > 1:
            return found
        others = [m for m in self.cluster.device_meshes
                  if m.name != sub.mesh.name and m.size >= sub.size]
        return found + [np.array(others[0].ids[:sub.size])] if others else found

    def _received(self, result) -> list:
        """The Values a stage of ``result`` receives from another stage each micro-batch:
        what its forward or backward reads and no op of its makes, neither fed nor kept
        from step to step (the values an update reads once a step, the step counter and
        the learning rate, each stage makes itself)."""
        program = self.prepared.program
        fed = {v.name for v in program.inputs}
        per_micro = {v.name for k in result.space.ops for v in program.ops[k].inputs
                     if program.ops[k].role != Role.OPTIMIZE}
        return [n.value for n in result.space.nodes if n.is_source and n.value in per_micro
                and not program.values[n.value].persistable and n.value not in fed]

    def result(self, layers: range, device_mesh, shape, ops=None, method=None):
        """The search of exactly ``layers`` on a ``shape`` submesh of ``device_mesh`` by
        ``method`` (default: the one that prices the DP's candidates)."""
        method = method or pricing_method(self.strategy)
        key = (self, "search", layers.start, layers.stop, device_mesh.name, tuple(shape),
               method)
        ops = self.layering.ops(layers) if ops is None else ops

        def searched():
            mesh, device_of = _submesh(device_mesh, shape)
            program = self.prepared.program
            loss = self._loss(ops)
            self.searches += 1
            return search(program, mesh, self.cluster, device_of, ops=ops,
                          weights=self.weights,
                          loss=loss, time_limit=self.strategy.solver_time_limit,
                          blocks=self.prepared.block_paths, memory=True,
                          balance=self.strategy.balance, method=method,
                          zero=zero_asked(self.strategy), session=self.session,
                          bucket_mb=bucketed(self.prepared, self.strategy))
        return self.options.memo(key, searched)

    def _loss(self, ops):
        loss = self.prepared.loss_name
        program = self.prepared.program
        made = {o.name for k in ops for o in program.ops[k].outputs}
        return loss if loss in made else None

    def _signature(self, ops) -> tuple:
        program = self.prepared.program
        return tuple((op.type, op.role, tuple(v.shape for v in op.inputs),
                      tuple(o.shape for o in op.outputs), repr(sorted(op.attrs.items())))
                     for op in (program.ops[k] for k in ops))


def _submesh(device_mesh, shape) -> tuple[ProcessMesh, dict]:
    """A ProcessMesh of submesh ``shape`` (rows, columns) and its processes' devices: the
    first rows and columns of the device mesh (1-D device meshes give 1-D meshes)."""
    rows, cols = shape
    if len(device_mesh.shape) == 1:
        ids = list(device_mesh.ids[:cols])
        return ProcessMesh(list(range(cols)), dim_names=[MESH_DIMS[0]]), dict(enumerate(ids))
    grid = np.array(device_mesh.ids).reshape(device_mesh.shape)[:rows, :cols]
    mesh = ProcessMesh(np.arange(rows * cols).reshape(rows, cols).tolist(),
                       dim_names=list(MESH_DIMS[:2]))
    return mesh, dict(enumerate(int(d) for d in grid.reshape(-1)))
