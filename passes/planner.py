"""Plan: everything decided about one built program, as a value the runtime consumes.

:func:`plan` is pure: it copies the built program, completes the copy's distributed
attributes (with ``Strategy(sharding=True)``, shards the updates and completes again),
places the logical processes on the cluster's devices, and returns a :class:`Plan`.
With ``Strategy(recompute=...)`` the copy is first rewritten so that the chosen layers'
activations are recomputed in the backward (:mod:`distgraph.passes.transforms.recompute`).
With ``Strategy(balance=True)`` the plan also carries the balanced split of its batch over
its data-parallel groups (``plan.batch_split``, :mod:`distgraph.passes.balance`), the
estimate that prices it and, where it is uneven, the local programs that run it
(:mod:`distgraph.passes.uneven`).
The built program is left as it was, so a search can score many plans of one program,
and planning needs no running job: a 4-process plan can be made and printed from one
process.

A Plan holds everything the runtime reads, computed once here: the completed program
(``plan.program``; its Values and ops carry their ``dist_attr``), the logical processes
and the rank each runs on (``plan.ranks``), the stages (the meshes of the forward program
in data-flow order), each process's local program and reshard points
(``plan.local(pid)``, partitioned once), the task graph (``plan.task_graph()``: tasks per
stage and kind, message tags, the values fetched) and the schedule (``plan.schedule()``:
each process's actions in order, checked to complete before any rank starts).
Data must only move from an earlier stage to a later one in the forward pass: a plan
whose stages form a cycle is a PlanError naming its ops
(:mod:`distgraph.passes.completion.stage_order`).

Example::

    built = build_program(model, [InputSpec([8, 16], name="x")], [InputSpec([8, 4], name="y")],
                          loss=dg.nn.MSELoss(), optimizer=dg.optim.SGD(0.1))
    p = dg.passes.plan(built, dg.Strategy(), cluster=None)
    print(p.explain())            # processes, stages, layouts, reshards with bytes
    p.local(1).pretty()           # what process 1 runs
    p.schedule()                  # {0: [Action(0, 'F', 0), Action(0, 'B', 0)], 1: [...]}
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from types import MappingProxyType

from distgraph.errors import PlanError, ShardingError
from distgraph.mesh import ProcessMesh, ProcessRanks
from distgraph.passes.completion.complete import complete
from distgraph.passes.completion import stage_order
from distgraph.passes.estimate import estimate, fmt_bytes
from distgraph.passes.mapping.devices import explain as explain_devices, placement
from distgraph.passes.mapping.rank_mapping import map_ranks
from distgraph.passes.mapping.traffic import process_graph
from distgraph.passes.meshslice.slices import assign_slices, check_meshes, enable, uses
from distgraph.passes.partition import LocalProgram, Partitions, process_ids
from distgraph.passes.pipeline.accumulate import split_micro_batches
from distgraph.passes.pipeline.chunks import (chunk_meshes, chunk_of_ops, forward_chunks,
                                              place_chunks)
from distgraph.passes.pipeline.task_graph import build_task_graph
from distgraph.passes.samples import sample_axes
from distgraph.passes.transforms.recompute import recompute, segments
from distgraph.passes.transforms.zero import shard_updates
from distgraph.passes.uneven import run_split, schedule_of
from distgraph.resources.cluster import Cluster
from distgraph.strategy import Strategy

SERIAL_MESH = ProcessMesh([0], dim_names=["world"])


@dataclass(frozen=True, eq=False)
class Plan:
    """A planned program. ``built`` is a completed copy of the BuiltProgram given to
    :func:`plan` (same feed, output, loss and gradient names); ``distributed`` says
    whether it runs as an SPMD job (it carries annotations) or on one process;
    ``ranks`` (a :class:`~distgraph.mesh.ProcessRanks`) says which rank runs each
    logical process; ``stages`` are the meshes of the forward program in data-flow
    order; ``estimate`` is the cost model's estimate, where one was made; ``search``
    the report of the automatic search (``Strategy(auto_mode="full")``), else None;
    ``batch_split`` the rows of a global batch each process reads under
    ``Strategy(balance=True)`` (:class:`~distgraph.passes.batch_split.BatchSplit`), else
    None (each data-parallel process reads an even share); where it is uneven, the local
    programs are the ones that run it and ``row_gathers`` says how fetched per-sample
    values come back in the batch's order (:mod:`distgraph.passes.uneven`); ``placement``
    each rank's device, hence the array backend and each group's communicator
    (:class:`~distgraph.passes.mapping.devices.Placement`).

    With ``Strategy(micro_batches=M)``, M > 1, ``program`` is the *micro-batch* program
    (forward, backward and update on micro-batch shapes) and ``accumulation`` says how
    the step accumulates over the micro-batches (:mod:`distgraph.passes.pipeline.accumulate`).
    :meth:`task_graph` gives the tasks each process runs per micro-batch and
    :meth:`schedule` the order it runs them in (one micro-batch without ``micro_batches``)."""

    built: object
    strategy: Strategy
    distributed: bool
    process_ids: tuple
    ranks: ProcessRanks
    stages: tuple
    cluster: object = None
    estimate: object = None
    accumulation: object = None
    search: object = None
    batch_split: object = None
    row_gathers: MappingProxyType = field(default_factory=lambda: MappingProxyType({}),
                                          repr=False)
    placement: object = None
    partitions: Partitions = field(default=None, repr=False)
    graph: object = field(default=None, repr=False)
    order: object = field(default=None, repr=False)
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def program(self):
        """The completed serial program (forward, backward, update, with dist attrs)."""
        return self.built.program

    @property
    def world_size(self) -> int:
        return len(self.process_ids)

    @property
    def micro_batches(self) -> int:
        return 1 if self.accumulation is None else self.accumulation.micro_batches

    def micro_batches_of(self, process_id: int) -> int:
        """How many micro-batches ``process_id`` runs per step: the plan's count, or
        under an uneven split by micro-batches its own."""
        split = self.batch_split
        if split is not None and split.micro_batched:
            return split.micro_batches(process_id)
        return self.micro_batches

    def feed_rows(self, process_id: int) -> dict:
        """{input name: the ``(start, stop)`` rows of the batch ``process_id`` reads of it,
        one range per micro-batch it runs in the order it runs them (None: a scalar)}
        for the inputs its local program has: its block of each micro-batch, or under an
        uneven split the rows the split gives it."""
        split = self.batch_split
        mine = split is not None and any(process_id in m for m in split.members)
        out = {}
        for v in self.local(process_id).program.inputs:
            value = self.program.values[v.name]
            index = value.dist_attr.local_slices(value.shape, process_id)
            if not index:
                out[v.name] = None
            elif mine:
                out[v.name] = split.rows(process_id)
            else:
                b = (self.accumulation.micro_batch_rows if self.accumulation is not None
                     else value.shape[0])
                out[v.name] = tuple((m * b + index[0].start, m * b + index[0].stop)
                                    for m in range(self.micro_batches))
        return out

    def batch_rows(self, process_id: int) -> tuple | None:
        """The rows :meth:`feed_rows` gives every input of ``process_id``, where they are
        the same for all (None: its inputs want different rows, or it has none)."""
        found = set(self.feed_rows(process_id).values())
        return found.pop() if len(found) == 1 else None

    def micro_batch_positions(self, process_id: int) -> tuple:
        """Where each micro-batch ``process_id`` runs sits in the batch, in micro-batches
        (0, 1, 2, ... unless an uneven split deals them otherwise: see
        :meth:`~distgraph.passes.batch_split.BatchSplit.positions`)."""
        split = self.batch_split
        if split is not None and split.micro_batched:
            return split.positions(process_id)
        return tuple(range(self.micro_batches))

    @property
    def rank_of(self):
        """{process: rank}, or None where process p runs on rank p."""
        mapping = self.ranks.mapping
        return None if mapping is None else MappingProxyType(mapping)

    @property
    def fetch(self) -> tuple:
        """The values a step brings to every process (the loss when training, the loss
        and the outputs when evaluating, the outputs when predicting)."""
        return self.graph.fetch

    def task_graph(self):
        """The per-process tasks and what flows between them
        (:mod:`distgraph.passes.pipeline.task_graph`)."""
        return self.graph

    def schedule(self) -> dict:
        """{process id: [Action, ...]}: each process's compute actions in the order it
        runs them (``str(action)`` in torch.distributed.pipelining's notation, "0F3");
        without micro-batches one F and one B per stage. The update is not an action."""
        return self.order.as_dict()

    def sample_axes(self) -> dict:
        """{Value name: the dim that carries the batch's samples} of :attr:`program`
        (:func:`distgraph.passes.samples.sample_axes`), found on first use and kept."""
        if "sample_axes" not in self._cache:
            self._cache["sample_axes"] = sample_axes(self.program, self.built.feed_names)
        return self._cache["sample_axes"]

    def local(self, process_id: int) -> LocalProgram:
        """The local program of ``process_id``."""
        if process_id not in self.partitions:
            raise PlanError(f"process {process_id} has no part in this plan (processes "
                            f"{list(self.process_ids)})")
        return self.partitions[process_id]

    def gather_points(self, names, process_id: int) -> list:
        """The reshard points that bring the global values of persistables ``names`` to
        every process (made once per list of names and process, then kept)."""
        key = (tuple(names), process_id)
        if key not in self._cache:
            self._cache[key] = self.partitions.gather_points(names, process_id)
        return self._cache[key]

    def reshards(self) -> list:
        """Every reshard point of the plan once (in global order), whoever runs it (as
        the first process that runs it holds it)."""
        points: dict = {}
        for group in self.partitions.groups():      # processes of a group hold alike points
            for point in self.local(group[0]).points():
                points.setdefault(point.seq, point)
        return [points[s] for s in sorted(points)]

    def bytes_sent(self) -> dict:
        """Bytes each process sends per step: {process id: {kind: bytes}} (with
        micro-batches, a micro-batch's reshards once per micro-batch)."""
        return {pid: self.graph.step_bytes(self, pid) for pid in self.process_ids}

    # -- printing ---------------------------------------------------------------------------
    def explain(self) -> str:
        """Readable summary: processes and ranks, stages, parameter layouts per layer,
        reshards with their bytes, and the estimate when there is one."""
        lines = [f"Plan: {self.world_size} process(es), "
                 f"{'distributed' if self.distributed else 'serial'}, "
                 f"{len(self.program.ops)} ops"]
        if self.rank_of is not None:
            lines.append("  ranks: " + ", ".join(f"process {p} -> rank {r}"
                                                 for p, r in sorted(self.rank_of.items())))
        for s, mesh in enumerate(self.stages):
            lines.append(f"  stage {s}: {mesh}")
        if len(self.graph.chunks) != len(self.stages):
            lines.append(f"  {len(self.graph.chunks)} chunks: " + ", ".join(
                f"{c} on stage {self.stages.index(m)}" for c, m in enumerate(self.graph.chunks)))
        lines.append("  " + self.order.pretty().replace("\n", "\n  "))
        if self.placement is not None:
            lines.extend("  " + line for line in explain_devices(self, self.placement))
        if self.accumulation is not None:
            lines.append("  " + self.accumulation.pretty().replace("\n", "\n  "))
        lines.append("  parameters (layer: name shape spec):")
        for layer, params in _parameters_by_layer(self.program).items():
            lines.append(f"    {layer or '(model)'}:")
            for v in params:
                lines.append(f"      {v.name} {list(v.shape)} {v.dist_attr.spec}")
        sliced = uses(self.program) if self.distributed else []
        if sliced:
            lines.append(f"  MeshSlice: {len(sliced)} matmul(s) run as 2-D GeMMs with K sliced, "
                         "overlapped collectives (dataflow over mesh dims (u, v)):")
            lines.extend(f"    {use}" for use in sliced)
        points = self.reshards() if self.distributed else []
        sent = self.bytes_sent() if self.distributed else {}
        busiest = max((sum(k.values()) for k in sent.values()), default=0.0)
        lines.append(f"  reshards: {len(points)} per step; busiest process sends "
                     f"{fmt_bytes(busiest)} per step")
        for p in points:
            lines.append(f"    {p} ({fmt_bytes(p.bytes)})")
        if self.search is not None:
            lines.append("  " + str(self.search).replace("\n", "\n  "))
        if self.batch_split is not None:
            lines.append("  " + str(self.batch_split).replace("\n", "\n  "))
        if self.estimate is not None:
            lines.append("  estimate: " + str(self.estimate).replace("\n", "\n  "))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """The plan as plain data (what :meth:`to_json` writes)."""
        prog = self.program
        out = {
            "distributed": self.distributed,
            "processes": list(self.process_ids),
            "rank_of": None if self.rank_of is None else
            {str(p): r for p, r in sorted(self.rank_of.items())},
            "schedule": {str(pid): [str(a) for a in acts]
                         for pid, acts in self.schedule().items()},
            "stages": [_mesh_dict(m) for m in self.stages],
            "strategy": dataclasses.asdict(self.strategy),
            "micro_batches": self.micro_batches,
            "accumulation": None if self.accumulation is None else
            {name: self.accumulation.mode(name) for name in self.accumulation.boundary},
            "parameters": {v.name: {"shape": list(v.shape), "dtype": v.dtype,
                                    "mesh": _mesh_dict(v.dist_attr.mesh),
                                    "spec": str(v.dist_attr.spec)}
                           for v in prog.parameters},
            "ops": [{"type": op.type, "layer": op.layer, "role": op.role,
                     "mesh": list(op.dist_attr.mesh.process_ids),
                     "inputs": [str(s) for s in op.dist_attr.input_specs],
                     "outputs": [str(s) for s in op.dist_attr.output_specs]}
                    for op in prog.ops],
            "reshards": [],
            "bytes_sent": {},
            "meshslice": [{"op": use.index, "layer": use.op.layer, "role": use.op.role,
                           "dataflow": use.local.dataflow, "mesh_dims": [use.local.u,
                                                                         use.local.v],
                           "slices": use.local.slices}
                          for use in (uses(prog) if self.distributed else [])],
        }
        if self.distributed:
            out["reshards"] = [{"value": p.value, "src": str(p.src), "dst": str(p.dst),
                                "steps": [str(s) for s in p.steps], "bytes": p.bytes}
                               for p in self.reshards()]
            out["bytes_sent"] = {str(pid): kinds for pid, kinds in self.bytes_sent().items()}
        if self.placement is not None:
            out["placement"] = self.placement.to_dict()
        if self.estimate is not None:
            out["estimate"] = self.estimate.to_dict()
        if self.search is not None:
            out["search"] = self.search.to_dict()
        if self.batch_split is not None:
            out["batch_split"] = self.batch_split.to_dict()
        return out

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def plot(self, path) -> None:
        """Draw the plan into ``path`` (PNG, SVG or PDF by its suffix): a column per
        stage with its mesh, the layers on it, how each weight is split per mesh dim, the
        reshards in each layer and between stages with their bytes. Needs matplotlib
        (``pip install 'distgraph[plot]'``); see :mod:`distgraph.passes.plan_plot`."""
        from distgraph.passes.plan_plot import plot_plan    # here: a plan rarely draws

        plot_plan(self, path)


def plan(built, strategy: Strategy | None = None, cluster=None, rank_mapping=None) -> Plan:
    """Plan ``built`` (a BuiltProgram) under ``strategy`` on ``cluster`` (see the module
    docstring). ``rank_mapping`` ({process: device global id}) overrides the rank
    mapper. Pure: ``built`` is not modified."""
    strategy = strategy or Strategy()
    _check_supported(strategy)
    accumulation = None
    if strategy.micro_batches > 1:
        built, accumulation = split_micro_batches(built, strategy.micro_batches)
    try:
        if strategy.auto_mode == "full":
            # the search (SCIP, the stage DP) is imported by the plans that use it only
            from distgraph.passes.search.auto import within_budget

            return within_budget(strategy, lambda ilp_budget: _plan(
                built, strategy, cluster, rank_mapping, accumulation, ilp_budget))
        return _plan(built, strategy, cluster, rank_mapping, accumulation)
    except ShardingError as e:
        if accumulation is None:
            raise
        raise ShardingError(f"{e} (with Strategy(micro_batches={accumulation.micro_batches}) "
                            f"the program runs on micro-batches of "
                            f"{accumulation.micro_batch_rows} rows)") from None


def _plan(built, strategy, cluster, rank_mapping, accumulation, ilp_budget=None) -> Plan:
    copy, searched = _completed(built, strategy, cluster, accumulation, ilp_budget)
    rank_mapping = rank_mapping or (searched.rank_mapping if searched is not None else None)
    program = copy.program
    stages = stage_order.stages(program)      # data-flow order, or a PlanError on a cycle
    meshes, cut = stages, None
    virtual = 2 if strategy.schedule == "ZBV" else strategy.virtual_stages
    if virtual > 1:
        why = ("Strategy(schedule='ZBV')" if strategy.schedule == "ZBV" else
               f"Strategy(virtual_stages={virtual})")
        if len(stages) < 2:
            raise PlanError(f"{why} interleaves chunks of the model over the pipeline's stage "
                            f"meshes, but this plan has one stage ({stages[0]}); place the "
                            f"model's parts on several meshes")
        meshes = chunk_meshes(stages, virtual, strategy.schedule == "ZBV")
        cut = forward_chunks(program, len(meshes), why)
        copy, _ = _completed(built, strategy, cluster, accumulation, ilp_budget,
                             placement=(stages, cut, meshes))
        program = copy.program
        placed = {op.dist_attr.mesh for op in program.ops if op.role in stage_order.FORWARD}
        if placed != set(stages):
            raise PlanError(f"internal error: placing the chunks changed the stage meshes "
                            f"({sorted(map(str, placed))} vs {stages}); please report it")
    distributed = _is_annotated(program)
    ids = tuple(process_ids(program))
    partitions = Partitions(program, ids)
    rank_of = _rank_of(program, ids, cluster, rank_mapping, partitions,
                       strategy.micro_batches) if distributed else None
    if distributed:
        priced = cluster or Cluster.local(len(ids))
        if assign_slices(program, priced, lambda pid: priced.devices[
                pid if rank_of is None else rank_of[pid]].global_id):
            partitions = Partitions(program, ids)   # with their K
    planned = Plan(copy, strategy, distributed, ids, ProcessRanks(rank_of), stages, cluster,
                   accumulation=accumulation, placement=placement(cluster, len(ids)),
                   partitions=partitions)
    if searched is not None:
        searched.result.check(program)
        planned = dataclasses.replace(planned, search=searched.result.report)
    if strategy.balance:
        planned = run_split(_balanced(planned, cluster, searched is not None))
    graph = build_task_graph(planned, planned.partitions,
                             chunk_of_ops(planned.program, meshes, cut), meshes)
    planned = dataclasses.replace(planned, graph=graph, order=schedule_of(planned, graph))
    if searched is not None or planned.batch_split is not None:
        planned = dataclasses.replace(planned, estimate=estimate(planned, cluster))
    return planned


def _completed(built, strategy, cluster, accumulation, ilp_budget, placement=None):
    """A completed copy of ``built`` (recomputation, the search's annotations, ZeRO
    sharding applied); with ``placement`` (stages, cut, chunk meshes) every chunk's ops
    are moved to its mesh first. (copy, the search's result or None)."""
    program = built.program.clone()
    copy = dataclasses.replace(built, program=program)
    if strategy.meshslice:
        enable(program, strategy.meshslice)
    if strategy.recompute and program.ops_by_role("backward"):
        recompute(program, segments(copy, strategy.recompute))
    searched = None
    if strategy.auto_mode == "full":
        from distgraph.passes.search.auto import annotate

        searched = annotate(copy, strategy, cluster, accumulation, ilp_budget)
    if placement is not None:
        place_chunks(program, *placement)
    updates = bool(program.ops_by_role("optimize"))
    if _is_annotated(program):
        complete(program, cluster=cluster)      # conflicts priced on the cluster's links
        if strategy.sharding and updates:
            _shard_updates(program, strategy.sharding_mesh_dim, cluster)
    else:
        if strategy.sharding and updates:
            raise PlanError("Strategy(sharding=True) shards optimizer states over a data-"
                            "parallel mesh dim, but the model carries no annotations: "
                            "annotate its inputs with dg.shard_tensor(x, mesh, ['dp', ...])")
        complete(program, default_mesh=SERIAL_MESH)
    check_meshes(program, strategy)
    return copy, searched


def _balanced(planned: Plan, cluster, searched: bool) -> Plan:
    """``planned`` with the balanced split of its batch. A searched plan that splits no
    batch has none to balance (the search priced the balanced groups and chose none)."""
    # here, not above: the split's solver and its records are for Strategy(balance=True)
    from distgraph.passes.balance import balance_batch, batch_mesh_dims

    if searched and not planned.distributed:
        return planned
    if searched:
        try:
            batch_mesh_dims(planned)
        except PlanError:
            return planned
    split = balance_batch(planned, cluster, planned.strategy.solver_time_limit)
    return dataclasses.replace(planned, batch_split=split)


def _check_supported(strategy: Strategy) -> None:
    """Options that only mean something together are refused apart, never ignored."""
    full = strategy.auto_mode == "full"
    if strategy.pipeline and not full:
        raise PlanError("Strategy(pipeline=True) asks the search to choose the stages: use it "
                        "with auto_mode='full'; with auto_mode='semi' the stages are the "
                        "meshes you place the model on, pipelined by Strategy(micro_batches=M)")
    if strategy.memory_budget_gb is not None and not full:
        raise PlanError("Strategy(memory_budget_gb=...) constrains the automatic search: use "
                        "it with auto_mode='full' (or leave it None)")
    if strategy.memory_budget_gb is not None and not strategy.memory_budget_gb > 0:
        raise PlanError(f"Strategy(memory_budget_gb={strategy.memory_budget_gb!r}): give a "
                        "number of GB > 0 per device, or None")
    if not strategy.solver_time_limit > 0:
        raise PlanError(f"Strategy(solver_time_limit={strategy.solver_time_limit!r}): give a "
                        "number of seconds > 0")
    defaults = Strategy()
    if strategy.solver_time_limit != defaults.solver_time_limit and not (full or
                                                                         strategy.balance):
        raise PlanError(f"Strategy(solver_time_limit={strategy.solver_time_limit!r}) bounds "
                        "the automatic search and the balanced split: use it with "
                        "auto_mode='full' or balance=True")
    if strategy.sharding_mesh_dim != defaults.sharding_mesh_dim and not strategy.sharding:
        raise PlanError(f"Strategy(sharding_mesh_dim={strategy.sharding_mesh_dim!r}) names "
                        "the dim ZeRO-style sharding splits updates over: use it with "
                        "sharding=True")
    virtual = strategy.virtual_stages
    if strategy.schedule == "ZBV" and virtual not in (1, 2):
        raise PlanError(f"Strategy(schedule='ZBV') places exactly two chunks on each stage "
                        f"mesh (process p holds chunks p and 2S-1-p): leave virtual_stages at "
                        f"1 or 2, not {virtual}")
    if (virtual > 1 or strategy.schedule == "ZBV") and full:
        raise PlanError("virtual stages (Strategy(virtual_stages=...) or schedule='ZBV') with "
                        "auto_mode='full' are not supported: the stage search places whole "
                        "stages; annotate the stages by hand with auto_mode='semi'")
    if full and strategy.sharding:
        raise PlanError("Strategy(sharding=True) with auto_mode='full' is not supported: the "
                        "search lays parameters and updates out itself (a parameter it "
                        "shards over a data-parallel dim is ZeRO-3-like); leave sharding=False, "
                        "or annotate by hand with auto_mode='semi' for ZeRO update sharding")


def _shard_updates(program, mesh_dim: str, cluster) -> None:
    meshes = {op.dist_attr.mesh for op in program.ops if op.role == "optimize"}
    if not any(mesh_dim in m.dim_names for m in meshes):
        raise PlanError(f"Strategy(sharding=True) shards updates over mesh dim {mesh_dim!r}, "
                        f"but no update runs on a mesh with that dim (meshes: "
                        f"{', '.join(sorted(map(str, meshes)))}); set "
                        f"Strategy(sharding_mesh_dim=...) to a data-parallel dim")
    if shard_updates(program, mesh_dim):
        complete(program, cluster=cluster)


def _is_annotated(program) -> bool:
    return (any(v.annotation is not None for v in program.values.values())
            or any(op.annotation is not None for op in program.ops))


def _rank_of(program, ids, cluster, rank_mapping, partitions, micro_batches):
    """Logical process -> MPI rank: process p runs on the rank that owns its device, rank
    r owning the cluster's r-th device. Without a cluster or mapping: None (p on rank p)."""
    if cluster is None and rank_mapping is None:
        return None
    world_size = len(ids)
    cluster = cluster or Cluster.local(world_size)
    if len(cluster.devices) < world_size:
        raise PlanError(f"this plan has {world_size} processes but the cluster has only "
                        f"{len(cluster.devices)} devices")
    if rank_mapping is None:
        rank_mapping = map_ranks(process_graph(program, partitions,
                                               micro_batches=micro_batches), cluster,
                                 devices=[d.global_id for d in cluster.devices[:world_size]])
    to_device = dict(getattr(rank_mapping, "process_to_device", rank_mapping))
    owner = {d.global_id: r for r, d in enumerate(cluster.devices[:world_size])}
    missing = sorted(d for d in to_device.values() if d not in owner)
    if missing:
        raise PlanError(f"the rank mapping uses devices {missing}, but this job's "
                        f"{world_size} ranks own devices {sorted(owner)}")
    rank_of = {p: owner[d] for p, d in to_device.items()}
    if sorted(rank_of) != list(ids) or sorted(rank_of.values()) != list(range(world_size)):
        raise PlanError(f"the rank mapping {to_device} does not give each of the "
                        f"{world_size} ranks exactly one of the processes {list(ids)}")
    return rank_of


def _parameters_by_layer(program) -> dict:
    layers: dict = {}
    for v in program.parameters:
        layer, _, _ = v.name.rpartition(".")
        layers.setdefault(layer, []).append(v)
    return layers


def _mesh_dict(mesh: ProcessMesh) -> dict:
    return {"process_ids": list(mesh.process_ids), "shape": list(mesh.shape),
            "dim_names": list(mesh.dim_names)}
