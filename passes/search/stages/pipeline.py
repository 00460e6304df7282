"""``Strategy(auto_mode="full", pipeline=True)``: Alpa's inter-op search (OSDI'22 §5).

1. **Layers**: the forward ops cut into layers (:mod:`distgraph.passes.search.stages.layers`;
   at most ``2 x devices + 2`` of them), every other op with its layer.
2. **Stage costs**: for each range of consecutive layers and each submesh shape of each
   device mesh (:func:`distgraph.passes.search.stages.stage_dp.submesh_shapes`), the intra-op search
   (:mod:`distgraph.passes.search.layouts.intra_op`) of those layers' ops on a ProcessMesh of that shape,
   priced on the first devices of that shape in the mesh, by the accountant
   (:mod:`distgraph.passes.search.stages.layer_ranges`): its seconds per micro-batch
   (the forward and backward, the update's share, the reshards of the Values it receives
   from a stage beside it), its memory with one micro-batch in flight and with each
   further one, its update once a step. Ranges of identical ops (the same blocks at
   other depths) are searched once. Each search has ``Strategy.solver_time_limit``
   seconds; the chosen stages are priced again where they are placed.
3. **Stages**: :func:`distgraph.passes.search.stages.stage_dp.plan_stages` chooses the stages and their
   submeshes minimising ``sum t + (micro_batches - 1) max t`` within each device's
   usable memory (``Device.usable_memory``; ``Strategy.memory_budget_gb`` lowers it).
   The chosen stages are then priced where they run
   (:mod:`~distgraph.passes.search.stages.chosen`) and, where the search recomputes,
   without recomputation where a stage has room for it
   (:mod:`~distgraph.passes.search.stages.recompute_stages`).
4. **Annotations**: stage s's ops are annotated on a ProcessMesh of its devices (process
   p is device p of the cluster, rank p) with its search's choice; completion then
   places the learning-rate read and step counter on the union of the stages, and the
   micro-batched runtime runs the stages (``Strategy.micro_batches``, ``schedule``).

``Strategy(search=...)`` picks who searches: "ilp" SCIP everywhere, "recursive" the
double-recursive search everywhere (:mod:`distgraph.passes.search.layouts.recursive`), "auto" the
recursive search for every candidate the DP compares and SCIP, warm-started from the
recursive choice, for the chosen stages only (their reports say what it gained).

Cross-stage transfers are not priced in the DP (Alpa neither: they are small by
design); the plan's estimate counts them.

Example::

    p = dg.passes.plan(built, dg.Strategy(auto_mode="full", pipeline=True,
                                          micro_batches=4), cluster)
    print(p.search)           # layers, stages and each stage's search
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from distgraph.errors import PlanError
from distgraph.mesh import ProcessMesh
from distgraph.passes.cost.stage import ZERO_BUBBLE, step_time
from distgraph.passes.search.stages.layers import block_layers, cluster_layers
from distgraph.passes.search.stages.run_dp import beats
from distgraph.passes.search.stages.block_plans import plan_blocks
from distgraph.passes.search.stages.chosen import (held_parts, priced_as_placed,
                                                   priced_with_neighbours, refined)
from distgraph.passes.search.stages.layer_ranges import LayerRangeCosts
from distgraph.passes.search.stages.part_cost import weight_gradient_seconds
from distgraph.passes.search.stages.recompute_stages import kept, per_stage
from distgraph.passes.search.stages.runs import RunCosts
from distgraph.passes.search.layouts.space import logical_dims
from distgraph.passes.search.stages.stage_dp import plan_stages
from distgraph.passes.session import Session, describe, memo_tables
from distgraph.resources.cluster import Cluster
from distgraph.units import GB, fmt_ids


@dataclass(frozen=True)
class RunReport:
    """What one stage of a block layering runs: its logical mesh ``option``, its parts and
    each part's search report (searched on a representative mesh, priced on this one),
    and ``mesh``, the stage's own ProcessMesh. It answers what a
    :class:`~distgraph.passes.search.layouts.intra_op.SearchReport` does for a
    :class:`PipelineReport` (``mesh``, ``status``, ``gap``, ``layouts``, ``chosen_by``,
    ``describe``, ``to_dict``)."""

    option: str
    parts: tuple          # ((part name, count, SearchReport), ...)
    mesh: ProcessMesh

    @property
    def status(self) -> str:
        return "optimal" if all(r.status == "optimal" for _, _, r in self.parts) \
            else "time_limit"

    @property
    def gap(self) -> float:
        return max(r.gap for _, _, r in self.parts)

    @property
    def layouts(self) -> tuple:
        return tuple(x for _, _, r in self.parts for x in r.layouts)

    @property
    def method(self) -> str:
        return self.parts[0][2].method

    @property
    def chosen_by(self) -> str:
        """Which search chose each part's layouts, in words (once where all parts agree)."""
        said = {r.chosen_by for _, _, r in self.parts}
        if len(said) == 1:
            return said.pop()
        return "; ".join(f"{name}: {r.chosen_by}" for name, _, r in self.parts)

    @property
    def what(self) -> str:
        """The parts it runs: ``"embedding + 2 blocks"``."""
        return " + ".join(f"{n} {name}" if n > 1 else name for name, n, _ in self.parts)

    def __str__(self) -> str:
        return self.describe(str(self.mesh))

    def describe(self, where: str) -> str:
        """``str``, naming the stage's devices as ``where``; each part's search report
        names the representative mesh it was searched on."""
        lines = [f"runs {self.what} on {where}: submesh {self.option}"]
        for name, _, report in self.parts:
            searched = f"a representative mesh of shape {list(report.mesh.shape)}"
            lines.append(f"  {name}: " + report.describe(searched).replace("\n", "\n  "))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"option": self.option, "status": self.status, "gap": self.gap,
                "mesh": self.mesh.to_dict(),
                "parts": [{"part": name, "count": n, **report.to_dict()}
                          for name, n, report in self.parts]}


@dataclass(frozen=True)
class PipelineReport:
    """What the stage search did: the layers, the stage plan, each stage's intra-op
    search report, how many intra-op searches costed the DP and the seconds it all
    took; the planning's memo tables (``memos``: (name, entries, hits, misses) of each,
    :meth:`~distgraph.passes.session.Session.stats`); ``memory_binds``: whether the
    devices' memory (or the budget) may have held back a plan faster than the one chosen,
    True unless the stage DP on the fastest options, memory unlimited, finds none faster
    at any micro-batch count the search looked at (:func:`memory_binds`): where False, no
    memory saver makes the plan faster, and the planner prices no recomputation
    (:func:`~distgraph.passes.fitting.with_savers`); ``schedule``: the strategy's, and
    under a zero-bubble one ``weights``, each stage's weight-gradient seconds per
    micro-batch (:func:`~distgraph.passes.search.stages.part_cost.
    weight_gradient_seconds`), which its idle time runs (``step_time``)."""

    layering: object
    stage_plan: object
    stages: tuple
    searches: int
    seconds: float
    memos: tuple = ()
    memory_binds: bool = True
    schedule: str = "1F1B"
    weights: tuple = ()

    @property
    def status(self) -> str:
        return "optimal" if all(s.status == "optimal" for s in self.stages) else "time_limit"

    @property
    def objective(self) -> float:
        return self.stage_plan.objective

    @property
    def step_time(self) -> float:
        """Seconds per step of the chosen stages as the search priced them, by the
        accountant's :func:`~distgraph.passes.cost.stage.step_time` (their forward and
        backward per micro-batch, their updates once a step): what ``plan.estimate``
        says of the plan made from them."""
        plan = self.stage_plan
        M = plan.micro_batches
        return step_time([s.time - s.update / M for s in plan.stages], M, plan.virtual,
                         self.schedule, [s.update for s in plan.stages], self.weights or None)

    @property
    def peak_memory(self) -> float:
        """Bytes the fullest device of the chosen stages holds, as the search counted them
        (its micro-batches in flight included)."""
        return max(s.memory for s in self.stage_plan.stages) * GB

    @property
    def gap(self) -> float:
        return max(s.gap for s in self.stages)

    @property
    def layouts(self) -> tuple:
        return tuple(x for s in self.stages for x in s.layouts)

    def __str__(self) -> str:
        lines = [f"stage search: {self.layering}; {self.searches} intra-op searches, "
                 f"{self.seconds:.2f} s",
                 "  " + str(self.stage_plan).replace("\n", "\n  ")]
        for s, (report, stage) in enumerate(zip(self.stages, self.stage_plan.stages)):
            # the search numbers a stage's processes from 0; name the devices it runs on
            where = f"devices {list(stage.device_ids)} (mesh shape {list(report.mesh.shape)})"
            lines.append(f"  stage {s} " + report.describe(where).replace("\n", "\n  "))
        if self.memos:
            lines.append(f"  {describe(self.memos)}")
        return "\n".join(lines)

    def summary(self) -> str:
        """A few lines for ``Plan.explain()``: the layering, the searches, the stage plan's
        latency, each stage's layers, devices (as ranges), status, and who chose its
        layouts (once per distinct answer); ``str`` lists every stage's layouts."""
        plan = self.stage_plan
        chunks = f", {plan.virtual} chunks per stage" if plan.virtual > 1 else ""
        lines = [f"stage search: {self.searches} intra-op searches in {self.seconds:.2f} s; "
                 f"{len(plan.stages)} stages{chunks}, {plan.micro_batches} micro-batches, "
                 f"latency {_seconds(plan.objective)}, {self.status}",
                 f"  {self.layering}"]
        said: dict = {}
        for s, (report, stage) in enumerate(zip(self.stages, plan.stages)):
            layers = stage.layers
            what = f"{report.what}, " if isinstance(report, RunReport) else ""
            held = f"layer {layers.start}" if len(layers) == 1 else \
                f"layers {layers.start}-{layers.stop - 1}"
            lines.append(f"  stage {s}: {held} ({what}mesh "
                         f"{list(report.mesh.shape)}) on device{'s' if len(stage.device_ids) > 1 else ''} "
                         f"{fmt_ids(stage.device_ids)}: "
                         f"{_seconds(stage.time)}, {stage.memory:.3g} GB, gap {report.gap:.3g}")
            parts = report.parts if isinstance(report, RunReport) else (("", 1, report),)
            for name, _, part in parts:
                said.setdefault(part.chosen_by, {}).setdefault(name, []).append(s)
        for who, where in said.items():
            at = "; ".join(f"{name + ' of ' if name else ''}stage{'s' if len(ss) > 1 else ''} "
                           f"{fmt_ids(ss)}" for name, ss in where.items())
            lines.append(f"  chosen by {who}: {at}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"layers": self.layering.count,
                "layer_flops": list(self.layering.flops),
                "objective": self.objective, "step_time": self.step_time,
                "peak_memory": self.peak_memory, "status": self.status,
                "searches": self.searches, "seconds": self.seconds,
                "stages": [dict(report.to_dict(), layers=[st.layers.start, st.layers.stop],
                                devices=list(st.device_ids), time=st.time, memory=st.memory)
                           for report, st in zip(self.stages, self.stage_plan.stages)],
                "memo_tables": memo_tables(self.memos)}


def _seconds(t: float) -> str:
    return f"{t:.4g} s" if t >= 1 else f"{t * 1e3:.4g} ms"


@dataclass(frozen=True)
class PipelineChoice:
    """The stage search's outcome for the planner: ``report``, the per-stage search
    results with where they were written ((result, ops map, values map), checked after
    completion) and the rank mapping (process p on device p)."""

    report: PipelineReport
    results: tuple
    rank_mapping: dict
    virtual: int = 1
    stage_meshes: tuple = ()
    # the Strategy.recompute the stages run where the search chose it per stage
    # (recompute_stages.per_stage), None where every stage runs the one asked
    recompute: object = None

    @property
    def chunks(self):
        """(stage meshes, chunks per stage) where the stages are interleaved, else None."""
        return (self.stage_meshes, self.virtual) if self.virtual > 1 else None

    @property
    def result(self):
        return self

    def check(self, program) -> None:
        if self.recompute is not None:      # the program recomputed per stage: realised
            kept(program)
            return
        for r, ops, values in self.results:
            r.check(program, ops=ops, values=values)

    def zero_params(self) -> frozenset:
        """The parameters whose updates the stages' choices run on ZeRO's slice."""
        return frozenset().union(*(r.zero_params(values) for r, _, values in self.results))


def plan_pipeline(prepared, strategy, cluster, accumulation, memory_budget=None,
                  runs=None, planned=None, session: Session | None = None,
                  looked=(), plain=None) -> PipelineChoice:
    """Choose layers, stages and each stage's layouts for ``prepared`` (a BuiltProgram the
    planner completes next) and annotate its program (module docstring).
    ``memory_budget``: bytes per device (None: the devices' memory); ``runs`` /
    ``planned``: the RunCosts :func:`pipeline_latency` made for a copy built the same
    way and the stage plan it priced (its searches are reused, and its plan where made
    within ``memory_budget``; where another count's lent it prices, searched afresh and
    that plan kept where faster: :func:`_afresh`); ``session``: the planning's (a fresh
    one by default), where what the search works out is kept; ``looked``: (RunCosts,
    micro-batch count) of the other counts the search priced or bounded, whose fastest
    options say with this plan's whether memory held a faster one back
    (``PipelineReport.memory_binds``); ``plain``: under recomputation, a function giving
    the program without it, on which the chosen stages are priced to choose it per stage
    (:func:`~distgraph.passes.search.stages.recompute_stages.per_stage`)."""
    start = time.perf_counter()
    session = session or (runs.session if runs is not None else Session())
    if cluster is None:
        raise PlanError("Strategy(pipeline=True) searches stages on a cluster: pass cluster="
                        "dg.Cluster.from_file(...) or dg.Cluster.local(N)")
    program = prepared.program
    micro = accumulation.micro_batches if accumulation is not None else 1
    devices = [d.global_id for d in cluster.devices]
    capped = cluster if memory_budget is None else _capped(cluster, memory_budget / GB)
    layering = block_layers(program, prepared.block_paths)
    if layering is not None:
        if runs is not None and runs.donor is not None:
            runs, planned = _afresh(prepared, strategy, cluster, layering, micro, capped,
                                    memory_budget, runs, planned, session)
        costs = runs or RunCosts(prepared, strategy, cluster, layering, micro, session=session)
        if planned is None or planned[0] != memory_budget:
            planned = memory_budget, plan_blocks(costs, capped, micro, _virtual(strategy))
        binds = memory_binds(strategy, planned[1][0].objective,
                             [(costs, micro)] + [c for c in looked if c[0] is not costs],
                             cluster)
        return _plan_runs(prepared, strategy, cluster, capped, costs, start, planned[1], binds,
                          plain)
    _no_blocks(strategy)
    layering = cluster_layers(program, max_layers=2 * len(devices) + 2)
    stage_cost = LayerRangeCosts(prepared, strategy, cluster, layering, micro, session)
    stage_plan = plan_stages(layering.count, capped, stage_cost, micro_batches=micro,
                             schedule=strategy.schedule)
    # every search before any annotation; under search="auto" the ILP refines these only
    results = [stage_cost.result(st.layers, cluster.device_mesh(st.mesh), st.shape,
                                 method=strategy.search_method) for st in stage_plan.stages]
    stage_plan, results = stage_cost.restated(stage_plan, results)
    for stage, result in zip(stage_plan.stages, results):
        pids = [devices.index(d) for d in stage.device_ids]
        mesh = result.space.mesh
        result.annotate(program, ProcessMesh(np.array(pids).reshape(mesh.shape).tolist(),
                                             dim_names=list(mesh.dim_names)))
    reports = [r.report for r in results]
    weights = tuple(weight_gradient_seconds(r, program, stage_cost.weights) for r in results) \
        if strategy.schedule in ZERO_BUBBLE else ()
    report = PipelineReport(layering, stage_plan, tuple(reports), stage_cost.searches,
                            time.perf_counter() - start, schedule=strategy.schedule,
                            weights=weights)
    return PipelineChoice(report, tuple((r, None, None) for r in results),
                          {p: d for p, d in enumerate(devices)})


def pipeline_latency(prepared, strategy, cluster, accumulation, memory_budget=None,
                     costs=None, donor=None, session: Session | None = None) -> tuple:
    """(seconds per step of the stage plan :func:`plan_pipeline` would choose for
    ``prepared``, priced by the method that prices the DP's candidates, before any
    refinement and without annotating; the RunCosts that priced it and (``memory_budget``,
    that plan), or None and None): what :mod:`distgraph.passes.search.stages.micro`
    compares. PlanError where nothing fits. The RunCosts and plan may be handed to
    :func:`plan_pipeline` for a program built the same way; ``costs``: one
    :func:`pipeline_beaten` made for ``prepared`` (its searches are reused); ``donor``: the
    RunCosts of the same model at another micro-batch count, whose searches price this
    one's options (:mod:`distgraph.passes.search.stages.runs`); ``session``: the
    planning's (by default the donor's, or a fresh one)."""
    micro = accumulation.micro_batches if accumulation is not None else 1
    capped = cluster if memory_budget is None else _capped(cluster, memory_budget / GB)
    layering = block_layers(prepared.program, prepared.block_paths)
    if layering is not None:
        costs = costs or RunCosts(prepared, strategy, cluster, layering, micro, donor, session)
        planned = plan_blocks(costs, capped, micro, _virtual(strategy))
        return planned[0].objective, costs, (memory_budget, planned)
    _no_blocks(strategy)
    layering = cluster_layers(prepared.program, max_layers=2 * len(cluster.devices) + 2)
    stage_cost = LayerRangeCosts(prepared, strategy, cluster, layering, micro, session)
    return plan_stages(layering.count, capped, stage_cost, micro_batches=micro,
                       schedule=strategy.schedule).objective, None, None


def pipeline_beaten(prepared, strategy, cluster, accumulation, latency: float,
                    donor=None, memory_budget=None, session: Session | None = None,
                    costs=None) -> tuple:
    """(True where the stage search finds no plan of ``prepared`` below ``latency`` seconds
    per step; the RunCosts it priced, for :func:`pipeline_latency`, or None). First the
    bound :mod:`distgraph.passes.search.stages.micro` prunes with: the stage DP on each logical
    mesh's fastest parts, the devices' memory unlimited; where that does not rule it
    out, the stage search itself looking below ``latency`` only (its caps pruned by it,
    memory variants searched only for meshes whose alike stages beat it:
    :func:`~distgraph.passes.search.stages.block_plans.plan_blocks`). Programs not of identical
    blocks are not bounded: False. ``donor`` / ``session`` / ``costs``: as
    :func:`pipeline_latency`'s; ``memory_budget``: bytes per device (None: the devices'
    memory)."""
    layering = block_layers(prepared.program, prepared.block_paths)
    if layering is None:
        return False, None
    micro = accumulation.micro_batches if accumulation is not None else 1
    costs = costs or RunCosts(prepared, strategy, cluster, layering, micro, donor, session)
    fastest = costs.options(variants=False)
    if not beats(latency, layering.count, layering.blocks, fastest, cluster, micro,
                 fit_memory=False):
        return True, costs
    capped = cluster if memory_budget is None else _capped(cluster, memory_budget / GB)
    found = plan_blocks(costs, capped, micro_batches=micro, virtual=_virtual(strategy),
                        below=latency)
    return found is None, costs


def _afresh(prepared, strategy, cluster, layering, micro, capped, memory_budget, runs,
            planned, session) -> tuple:
    """(RunCosts, (``memory_budget``, stage plan)) for a count priced with another count's
    searches (``runs``, its donor's: :mod:`~distgraph.passes.search.stages.micro`): searched
    afresh, and the priced plan kept where the fresh search finds none as fast. The
    searches of one count look for the layouts of the micro-batch they split (a mesh's
    ``x`` dividing its rows, first), so another count's may price faster here (Llama 3
    405B at one sequence per micro-batch: the sequence split over 64 devices that a
    micro-batch of two sequences found); the count was chosen on that price, and its
    plan is at least as fast."""
    fresh = RunCosts(prepared, strategy, cluster, layering, micro, session=session)
    priced = planned[1] if planned is not None and planned[0] == memory_budget else None
    try:
        mine = plan_blocks(fresh, capped, micro, _virtual(strategy))
    except PlanError:
        if priced is None:
            raise
        return runs, planned
    if priced is not None and priced[0].objective < mine[0].objective:
        return runs, planned
    return fresh, (memory_budget, mine)


def memory_binds(strategy, latency: float, looked, cluster) -> bool:
    """Whether memory may have held back a plan faster than ``latency`` (the stage DP's
    objective of the plan chosen): the stage DP on the fastest options of any of
    ``looked`` ((RunCosts, micro-batch count) of the counts the search looked at), the
    devices' memory unlimited, finds one faster. A memory saver (recomputation) only adds
    work to every option, so where none is found it cannot make the plan faster at those
    counts. Plain stages only: interleaved plans (``strategy``'s) are not bounded, True."""
    return _virtual(strategy) > 1 or any(
        beats(latency, costs.layering.count, costs.blocks, costs.options(variants=False),
              cluster, micro, fit_memory=False, p2p=costs.p2p_seconds,
              schedule=costs.strategy.schedule)
        for costs, micro in looked)


def _plan_runs(prepared, strategy, cluster, capped, costs, start, planned,
               binds: bool, plain=None) -> PipelineChoice:
    """The stage search of a model of identical blocks (:mod:`distgraph.passes.search.
    runs`): options costed once per logical mesh, the DP linear in the blocks
    (``planned``: its plan, before the refinement; ``binds``: whether memory held a
    faster one back, :func:`memory_binds`; ``plain``: as :func:`plan_pipeline`'s)."""
    layering = costs.layering
    stage_plan, chosen = planned
    if strategy.search_method == "auto":       # the ILP refines the chosen stages only
        stage_plan, chosen = refined(stage_plan, chosen, costs, capped)
    if stage_plan.virtual == 1:
        stage_plan = priced_as_placed(stage_plan, chosen, costs)
        stage_plan = priced_with_neighbours(stage_plan, chosen, costs)
    held = _chunk_ranges(costs, len(stage_plan.stages), stage_plan.virtual)
    recompute = None
    if plain is not None:
        stage_plan, recompute = per_stage(stage_plan, chosen, costs, capped, plain, held)
    index = {d.global_id: p for p, d in enumerate(cluster.devices)}
    reports, checks, meshes = [], [], []
    for s, (stage, option) in enumerate(zip(stage_plan.stages, chosen)):
        pids = [index[d] for d in stage.device_ids]
        mesh = ProcessMesh(np.array(pids).reshape(option.logical).tolist(),
                           dim_names=logical_dims(option.logical))
        parts = []
        for layers in held[s] if held is not None else [stage.layers]:
            reports_of, written = costs.annotate(prepared.program, layers, option, mesh)
            parts += reports_of
            checks += written
        reports.append(RunReport(str(option), tuple(parts), mesh))
        meshes.append(mesh)
    weights = ()
    if strategy.schedule in ZERO_BUBBLE:
        weights = tuple(_weight_gradients(costs, stage, costs.placed(option, stage.device_ids))
                        for stage, option in zip(stage_plan.stages, chosen))
    report = PipelineReport(layering, stage_plan, tuple(reports), costs.searches,
                            time.perf_counter() - start, memory_binds=binds,
                            schedule=strategy.schedule, weights=weights)
    return PipelineChoice(report, tuple(checks),
                          {p: d.global_id for p, d in enumerate(cluster.devices)},
                          stage_plan.virtual, tuple(meshes), recompute)


def _weight_gradients(costs, stage, option) -> float:
    """Seconds per micro-batch of ``stage``'s weight gradients under ``option``: its
    parts' (E, its blocks, H) as each part's search chose them."""
    held = zip(("first", "block", "last"), held_parts(stage, costs))
    return sum(float(n) * weight_gradient_seconds(option.parts[part][1], costs.program,
                                                  costs.weights)
               for part, n in held if n)


def _chunk_ranges(costs, S: int, virtual: int):
    """Under virtual stages (``virtual`` > 1), the layer ranges of each of ``S`` stages:
    chunk c's layers (a layer cut between chunks goes with the one holding most of its
    FLOPs) on stage c mod S, as the planner will move them; else None."""
    if virtual < 2:
        return None
    chunks = costs.chunk_layers(S * virtual)
    home = {}
    for c, chunk in enumerate(chunks):
        for layer, share in chunk.items():
            if share > home.get(layer, (-1.0, 0))[0]:
                home[layer] = (share, c)
    out: list = [[] for _ in range(S)]
    for c in range(len(chunks)):
        mine = sorted(layer for layer, (_, at) in home.items() if at == c)
        if mine:
            out[c % S].append(range(mine[0], mine[-1] + 1))
    return out


def _no_blocks(strategy) -> None:
    """PlanError under a target: its stages are even splits of identical blocks."""
    if strategy.target is not None:
        raise PlanError(f"Strategy(target={strategy.target!r}) splits a model's identical "
                        f"blocks evenly over stages; this model has no run of identical "
                        f"blocks (model.blocks / model.layers) to split")


def _virtual(strategy) -> int:
    """The most chunks per stage the search may interleave: ``Strategy.virtual_stages``
    under the 1F1B schedule (the search chooses 1, 2, 4 .. up to it), else 1."""
    return strategy.virtual_stages if strategy.schedule == "1F1B" else 1


def _capped(cluster, gb: float):
    """``cluster`` with every device's usable memory at most ``gb`` (its reserve raised
    where that is less: the stage search reads the devices' usable memory)."""
    data = cluster.to_dict()
    for machine in data["machines"]:
        for device in machine["devices"]:
            d = cluster.device(device["global_id"])
            device["reserved_memory"] = d.memory - d.usable_memory(gb)
    return Cluster.from_dict(data)
