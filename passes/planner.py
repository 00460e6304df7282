"""The planner: everything decided about one built program, made whole as a Plan.

:func:`plan` is pure: it copies the built program, completes the copy's distributed
attributes (with ``Strategy(sharding=True)``, shards the updates and completes again),
places the logical processes on the cluster's devices, builds the task graph and the
schedule, and compiles the program of every process (or of the processes of the given
``ranks``) into the :class:`~distgraph.plan.plan.Plan` the runtime reads. With
``Strategy(recompute=...)`` the copy is first rewritten so that the chosen layers'
activations are recomputed in the backward (:mod:`distgraph.passes.transforms.recompute`).
With ``Strategy(balance=True)`` the plan also carries the balanced split of its batch over
its data-parallel groups (``plan.batch_split``, :mod:`distgraph.passes.balance`), the
estimate that prices it and, where it is uneven, the local programs that run it
(:mod:`distgraph.passes.balance.uneven`).
The built program is left as it was, so a search can score many plans of one program,
and planning needs no running job: a 4-process plan can be made and printed from one
process.

While it plans, the plan's ``locals`` are the lazy
:class:`~distgraph.passes.partition.Partitions` (a process is partitioned when first
needed); the plan it returns, the one of the candidates it priced that it keeps (the
others are compared by their estimates, never compiled), holds only plain values: the
local programs of one process per group and of every compiled process, and the compiled
programs (:mod:`distgraph.passes.pipeline.compile`); ``plan.decisions`` what it was made from and
for (the layouts completion started from, the chunks, ZeRO's mesh dims, the program's
print), which ``plan.save(path)`` writes (:mod:`distgraph.plan.file`) and
:mod:`distgraph.passes.plan_file` makes the same plan from. Data must only move from an
earlier stage to a later one in the forward pass: a plan whose stages form a cycle is a
PlanError naming its ops (:mod:`distgraph.passes.completion.stage_order`).

Example::

    built = build_program(model, [InputSpec([8, 16], name="x")], [InputSpec([8, 4], name="y")],
                          loss=dg.nn.MSELoss(), optimizer=dg.optim.SGD(0.1))
    p = dg.passes.plan(built, dg.Strategy(), cluster=None)
    print(p.explain())            # per stage: devices, layout, memory, time, MFU
    p.program_of(1)               # what process 1 runs, compiled
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from types import MappingProxyType

from distgraph.errors import PlanError, ShardingError, TooFewDevicesError
from distgraph.ir import Role
from distgraph.mesh import ProcessMesh, ProcessRanks
from distgraph.passes.balance import balance_batch, batch_mesh_dims
from distgraph.passes.balance.uneven import member_schedule_of, run_split, runs_own_counts
from distgraph.passes.completion.complete import complete
from distgraph.passes.completion import stage_order
from distgraph.passes.context import assign_forms
from distgraph.passes.cost.checkpoint import propose as propose_checkpoint
from distgraph.passes.cost.estimate import estimate
from distgraph.passes.fitting import fitting, with_savers
from distgraph.passes.mapping.devices import assign_devices
from distgraph.passes.mapping.rank_mapping import map_ranks
from distgraph.passes.mapping.traffic import traffic_graph as process_graph
from distgraph.passes.meshslice.slices import assign_slices, check_meshes, uses
from distgraph.passes.partition import Partitions, process_ids
from distgraph.passes.prepare import prepare
from distgraph.passes.pipeline.chunks import (chunk_meshes, chunk_of_ops, forward_chunks,
                                              place_chunks)
from distgraph.passes.pipeline.compile import compile_process
from distgraph.passes.pipeline.schedule import schedule_of
from distgraph.passes.pipeline.task_graph import build_task_graph
from distgraph.passes.session import Session
from distgraph.passes.samples import sample_axes
from distgraph.passes.transforms.sequence_parallel import gather_into_matmuls, \
    sequence_parallel
from distgraph.passes.transforms.zero import shard_updates, sharded_states
from distgraph.plan.file import Decisions
from distgraph.plan.fingerprint import program_print
from distgraph.plan.plan import Plan
from distgraph.resources.cluster import Cluster
from distgraph.strategy import Strategy

SERIAL_MESH = ProcessMesh([0], dim_names=["world"])


def plan(built, strategy: Strategy | None = None, cluster=None, rank_mapping=None,
         ranks=None, choice=None) -> Plan:
    """Plan ``built`` (a BuiltProgram) under ``strategy`` on ``cluster`` (see the module
    docstring). ``rank_mapping`` ({process: device global id}) overrides the rank
    mapper. ``ranks``: the ranks whose processes' programs to compile (None: every
    process's; a rank of a job compiles its own). ``choice``: a
    :class:`~distgraph.passes.choice.Choice` (the search's or a file's) to make
    the plan of instead of searching (``auto_mode="full"``; its strategy is the plan's;
    checked to fit, not searched again). Pure: ``built`` and ``choice`` are not modified."""
    strategy = choice.strategy if choice is not None else _zero(built, strategy or Strategy())
    with cyclic_collector_paused():
        if choice is not None:
            planned = _fitted(built, strategy, cluster, rank_mapping, choice)
        else:
            _check_supported(strategy)
            session = Session()
            try:
                # the savers left to the search chosen; what does not fit names one that does
                # recomputation left to the search: chosen per stage where it recomputes
                per_stage = strategy.recompute is None
                planned = with_savers(strategy, cluster, lambda asked: _fitted(
                    built, asked, cluster, rank_mapping, session=session,
                    per_stage=per_stage),
                    lambda asked: _fitted(built, asked, cluster, rank_mapping), applied)
            finally:
                session.close()     # its tables freed now, not at the next cyclic collection
        # the plan kept compiled, once: the candidates were priced by their estimates
        planned = _compiled(planned, ranks)
        # what it was made for, as plan.save writes it (distgraph.plan.file)
        return dataclasses.replace(planned, decisions=dataclasses.replace(
            planned.decisions, program=program_print(built)))


def _zero(built, strategy: Strategy) -> Strategy:
    """``strategy`` with ZeRO's sharding on where the program's optimizer carries a
    sharding level (``dg.parallelize``'s dp_config: the level reaches the planner on the
    optimizer, as Paddle wraps it)."""
    if getattr(built, "sharding_level", 0) and not strategy.sharding:
        return dataclasses.replace(strategy, sharding=True)
    return strategy


@contextlib.contextmanager
def cyclic_collector_paused():
    """Python's cyclic garbage collector paused while planning, as found after: planning
    makes millions of short-lived objects (specs, steps, tiles, local ops) that reference
    counting frees, and each of them counts towards the collector's next pass over the
    whole heap (a fifth of the GPT-3 plan's CPU time, measured; its peak memory is the
    same within 3% without them). What planning leaves in cycles the next pass frees."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _fitted(built, strategy, cluster, rank_mapping, given=None, session=None,
            per_stage: bool = False) -> Plan:
    """The plan of ``built`` under ``strategy`` that fits ``cluster`` (``fitting``), not
    yet compiled (its ``locals`` the lazy partitions): the candidates a planning prices
    are compared by their estimates, and only the plan kept is compiled
    (:func:`_compiled`, in :func:`plan`). ``session``: the one of every planning of one
    ``plan`` call (closed by it), whatever savers each asks: the search keys what it
    keeps by what it depends on (a count's stage options by the strategy it searched,
    sequence parallelism set aside: :func:`~distgraph.passes.search.stages.micro.
    searched_as`), so a planning that differs only in ``sequence_parallel`` (rewritten
    after the search, :func:`_completed`) prices the same search's choice without
    searching again, and the others split each micro-batch count once and share the
    prices of the ops and reshards their programs have in common. ``per_stage``: the
    search chooses the strategy's recomputation per stage (:func:`_plan`)."""
    _check_supported(strategy)
    if strategy.amp != built.amp:
        raise PlanError(f"Strategy(amp={strategy.amp!r}) plans a program built in "
                        f"{built.amp or 'full precision'}: build it with "
                        f"build_program(..., amp={strategy.amp!r}) (the Engine does)")
    if given is not None:           # made as chosen: checked, never searched again
        return fitting(strategy, cluster, lambda _: _plan(
            built, strategy, cluster, rank_mapping, None, None, given), searched=False)
    # what this planning remembers, across its budget rounds
    own = session is None
    session = session or Session()
    try:
        return fitting(strategy, cluster, lambda budget: _plan(
            built, strategy, cluster, rank_mapping, budget, session, per_stage=per_stage))
    finally:
        if own:
            session.close()     # its tables freed now, not at the next cyclic collection


def _plan(built, strategy, cluster, rank_mapping, budget, session, given=None,
          per_stage: bool = False) -> Plan:
    """One plan of ``built``: under ``auto_mode="full"`` the search's choice within
    ``budget`` bytes per device (None: the devices' memory as the searches read it), or
    the ``given`` one; else the program as its annotations place it. ``per_stage``: the
    strategy's recomputation is the search's to run only on the stages that need it
    (``Strategy(recompute=None)`` asked: :func:`~distgraph.passes.search.choose`)."""
    choice = None
    if given is not None:           # completed below: on a copy of its program
        choice = dataclasses.replace(given, built=dataclasses.replace(
            given.built, program=given.built.program.clone()))
        prepared, strategy, accumulation = choice.built, choice.strategy, choice.accumulation
    elif strategy.auto_mode == "full":
        # the search (SCIP, the stage DP) is imported by the plans that use it only
        from distgraph.passes.search import choose

        choice = choose(built, strategy, cluster, budget, session, per_stage)
        prepared, strategy, accumulation = choice.built, choice.strategy, choice.accumulation
    else:
        prepared, accumulation = prepare(built, strategy, strategy.micro_batches)
    # the layouts completion starts from, before it (and ZeRO) writes more of them
    decisions = _recorded(built, choice)
    try:
        return dataclasses.replace(_made(built, prepared, strategy, cluster, rank_mapping,
                                         accumulation, choice), decisions=decisions)
    except ShardingError as e:
        if accumulation is None:
            raise
        raise ShardingError(f"{e} (with Strategy(micro_batches={accumulation.micro_batches}) "
                            f"the program runs on micro-batches of "
                            f"{accumulation.micro_batch_rows} rows)") from None


def _made(built, prepared, strategy, cluster, rank_mapping, accumulation, choice) -> Plan:
    """The Plan of ``prepared`` (the program the plan runs, annotated by the user or by the
    search's ``choice``): completed, partitioned, mapped, scheduled and estimated."""
    _completed(prepared, strategy, cluster, choice)
    rank_mapping = rank_mapping or (choice.rank_mapping if choice is not None else None)
    interleaved = choice.chunks if choice is not None else None
    program = prepared.program
    if interleaved is not None:             # the search placed the chunks (_completed)
        stages = tuple(interleaved[0])
    else:
        stages = stage_order.stages(program)  # data-flow order, or a PlanError on a cycle
    meshes, cut = stages, None
    virtual = 2 if strategy.schedule == "ZBV" else strategy.virtual_stages
    if interleaved is not None:
        meshes = chunk_meshes(stages, virtual, False)
        cut = forward_chunks(program, len(meshes), f"Strategy(virtual_stages={virtual})")
    elif virtual > 1:
        why = ("Strategy(schedule='ZBV')" if strategy.schedule == "ZBV" else
               f"Strategy(virtual_stages={virtual})")
        if len(stages) < 2:
            raise PlanError(f"{why} interleaves chunks of the model over the pipeline's stage "
                            f"meshes, but this plan has one stage ({stages[0]}); place the "
                            f"model's parts on several meshes")
        meshes = chunk_meshes(stages, virtual, strategy.schedule == "ZBV")
        cut = forward_chunks(program, len(meshes), why)
        # the annotated program again, each chunk's ops moved to its mesh first
        prepared, _ = prepare(built, strategy, strategy.micro_batches)
        _completed(prepared, strategy, cluster, None, chunks=(stages, cut, meshes))
        program = prepared.program
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

        def device_of(pid):
            return priced.devices[pid if rank_of is None else rank_of[pid]].global_id

        if assign_slices(program, priced, device_of) + assign_forms(program, priced,
                                                                    device_of):
            partitions = Partitions(program, ids)   # with their K, attention's forms
    planned = Plan(prepared, strategy, distributed, ids, ProcessRanks(rank_of), stages, cluster,
                   accumulation=accumulation, devices=assign_devices(cluster, len(ids)),
                   groups=partitions.groups(), locals=partitions,
                   sliced=tuple(uses(program)) if distributed else ())
    if choice is not None:
        planned = dataclasses.replace(planned, search=choice.report)
    if strategy.balance:
        planned = run_split(_balanced(planned, cluster, choice is not None))
    graph = build_task_graph(planned, planned.locals,
                             chunk_of_ops(planned.program, meshes, cut), meshes)
    order = (member_schedule_of(planned, graph) if runs_own_counts(planned)
             else schedule_of(graph))
    planned = dataclasses.replace(planned, graph=graph, order=order)
    if cluster is not None or planned.batch_split is not None or strategy.mtbf_hours:
        # on a cluster the plan must fit its devices (fitting): the estimate says
        planned = dataclasses.replace(planned, estimate=estimate(planned, cluster))
    if strategy.mtbf_hours is not None:
        planned = dataclasses.replace(planned, checkpoint=propose_checkpoint(
            planned.estimate, strategy.mtbf_hours, strategy.checkpoint_write_gbps))
    return planned


def _recorded(built, choice) -> Decisions:
    """The decisions of a plan of ``built``: the search's ``choice`` written on the
    program it runs (before completion), or, without one, the model's own annotations
    (``program`` is left None: :func:`~distgraph.passes.planner.plan` sets its print)."""
    if choice is None:
        return Decisions(None, "built", *_annotations(built.program))
    params = None if choice.zero_params is None else tuple(sorted(choice.zero_params))
    return Decisions(None, "prepared", *_annotations(choice.built.program), choice.chunks,
                     choice.sharding_dim, params)


def _annotations(program) -> tuple:
    values = tuple((v.name, v.annotation) for v in program.values.values()
                   if v.annotation is not None)
    ops = tuple((k, op.annotation) for k, op in enumerate(program.ops)
                if op.annotation is not None)
    return values, ops


def _completed(prepared, strategy, cluster, choice, chunks=None) -> None:
    """Complete ``prepared``'s program in place: with ``chunks`` (stages, cut, chunk meshes)
    every chunk's ops moved to its mesh first (or where the search interleaved its
    stages, as it placed them), the search's choice checked as completion kept it,
    sequence parallelism and ZeRO sharding applied as asked."""
    program = prepared.program
    if choice is not None and chunks is None and choice.chunks is not None:
        # the stage search interleaved its alike stages: chunk c on stage c mod S
        stages, virtual = choice.chunks
        meshes = chunk_meshes(stages, virtual, False)
        chunks = (stages, forward_chunks(program, len(meshes),
                                         f"Strategy(virtual_stages={virtual})"), meshes)
    if chunks is not None:
        place_chunks(program, *chunks)
    updates = bool(program.ops_by_role("optimize"))
    if _is_annotated(program):
        complete(program, cluster=cluster)      # conflicts priced on the cluster's links
        if choice is not None:                  # as chosen, before ZeRO shards the states
            choice.check(program)
        if strategy.sequence_parallel and sequence_parallel(program, choice is not None):
            complete(program, cluster=cluster)
        elif choice is None and strategy.auto_mode == "semi" and \
                gather_into_matmuls(program):       # the user's (a style's) sequence split
            complete(program, cluster=cluster)
        if strategy.sharding and updates:
            dim, only = strategy.sharding_mesh_dim, None
            if choice is not None:              # the search named the mesh dims
                dim, only = choice.sharding_dim, choice.zero_params
            _shard_updates(program, dim, cluster, getattr(prepared, "sharding_level", 0) == 3,
                           only)
    else:
        if strategy.sharding and updates:
            raise PlanError("Strategy(sharding=True) shards optimizer states over a data-"
                            "parallel mesh dim, but the model carries no annotations: "
                            "annotate its inputs with dg.shard_tensor(x, mesh, ['dp', ...])")
        complete(program, default_mesh=SERIAL_MESH)
    check_meshes(program, strategy)


def applied(planned: Plan) -> dict:
    """{saver: whether it changed ``planned``} for the savers its strategy turns on that
    may find nothing to change: ``sharding`` (an update's optimizer states split over
    ZeRO's mesh dim while its parameter is not: :func:`sharded_states`) and
    ``sequence_parallel`` (a forward activation the plan splits over the sequence where
    the layouts it was completed from, the search's or the user's, did not). What
    :func:`~distgraph.passes.fitting.with_savers` reads to say False where a saver it
    tried has nothing to act on (no data-parallel or tensor-parallel dim)."""
    out = {}
    if planned.strategy.sharding:
        dims = planned.decisions.zero_dim if planned.decisions is not None else None
        dims = dims or planned.strategy.sharding_mesh_dim
        out["sharding"] = sharded_states(planned.program, dims)
    if planned.strategy.sequence_parallel:
        out["sequence_parallel"] = _sequence_split(planned)
    return out


def _sequence_split(planned: Plan) -> bool:
    """Whether a forward activation of ``planned`` is split over the sequence (dim 1) on
    a mesh dim its recorded annotation did not split it over (what sequence parallelism
    adds: :func:`~distgraph.passes.transforms.sequence_parallel.sequence_parallel`)."""
    program = planned.program
    made = {o.name: op for op in program.ops for o in op.outputs}
    given = dict(planned.decisions.values) if planned.decisions is not None else {}
    for name, op in made.items():
        v = program.values[name]
        if op.role is not Role.FORWARD or len(v.shape) != 3 or v.dist_attr is None:
            continue
        before = given.get(name)
        was = set(before.spec.entry(1)) if before is not None else set()
        if set(v.dist_attr.spec.entry(1)) - was:
            return True
    return False


def _balanced(planned: Plan, cluster, searched: bool) -> Plan:
    """``planned`` with the balanced split of its batch. A searched plan that splits no
    batch has none to balance (the search priced the balanced groups and chose none)."""
    if searched and not planned.distributed:
        return planned
    if searched:
        try:
            batch_mesh_dims(planned)
        except PlanError:
            return planned
    axes = MappingProxyType(sample_axes(planned.program, planned.built.feed_names))
    planned = dataclasses.replace(planned, sample_axes=axes)
    split = balance_batch(planned, cluster, planned.strategy.solver_time_limit)
    counts = {pid: split.micro_batches(pid) for m in split.members for pid in m} \
        if split.micro_batched else {}
    return dataclasses.replace(planned, batch_split=split,
                               micro_batch_counts=MappingProxyType(counts))


def _check_supported(strategy: Strategy) -> None:
    """Options that only mean something together are refused apart, never ignored."""
    full = strategy.auto_mode == "full"
    if strategy.pipeline and not full:
        raise PlanError("Strategy(pipeline=True) asks the search to choose the stages: use it "
                        "with auto_mode='full'; with auto_mode='semi' the stages are the "
                        "meshes you place the model on, pipelined by Strategy(micro_batches=M)")
    if strategy.micro_batches is None and not (full and strategy.pipeline):
        raise PlanError("Strategy(micro_batches=None) lets the stage search choose the number "
                        "of micro-batches: use it with auto_mode='full' and pipeline=True, or "
                        "give micro_batches=M")
    if strategy.recompute is None and not full:
        raise PlanError("Strategy(recompute=None) lets the search choose recomputation: use it "
                        "with auto_mode='full', or give recompute=False, True, 'selective' or "
                        "layer paths")
    for saver in ("sharding", "sequence_parallel"):
        if getattr(strategy, saver) is None and not full:
            raise PlanError(f"Strategy({saver}=None) lets the search choose it: use it with "
                            f"auto_mode='full', or give {saver}=True or False")
    if strategy.search is not None and not full:
        raise PlanError(f"Strategy(search={strategy.search!r}) picks the automatic search: "
                        "use it with auto_mode='full' (or leave it None)")
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
    if strategy.sharding_mesh_dim != defaults.sharding_mesh_dim and strategy.sharding is False:
        raise PlanError(f"Strategy(sharding_mesh_dim={strategy.sharding_mesh_dim!r}) names "
                        "the dim ZeRO-style sharding splits updates over: use it with "
                        "sharding=True")
    virtual = strategy.virtual_stages
    if strategy.schedule == "ZBV" and virtual not in (1, 2):
        raise PlanError(f"Strategy(schedule='ZBV') places exactly two chunks on each stage "
                        f"mesh (process p holds chunks p and 2S-1-p): leave virtual_stages at "
                        f"1 or 2, not {virtual}")
    if ((virtual > 1 and not strategy.pipeline) or strategy.schedule == "ZBV") and full:
        raise PlanError("virtual stages (Strategy(virtual_stages=...) or schedule='ZBV') with "
                        "auto_mode='full' are supported with the stage search only "
                        "(pipeline=True, schedule='1F1B': it interleaves up to "
                        "virtual_stages chunks per stage); or annotate the stages by hand "
                        "with auto_mode='semi'")


def _compiled(planned: Plan, ranks) -> Plan:
    """``planned`` with the programs of the processes of ``ranks`` (None: all) compiled,
    and plain local programs in place of the lazy partitions."""
    parts = planned.locals
    if ranks is None or not planned.distributed:    # a serial plan runs alike everywhere
        wanted = planned.process_ids
    else:
        # a rank whose process the plan lacks (meshes numbered [0, 1, 2, 4] on 4 ranks)
        # compiles nothing: the runtime's check of the world says how to launch it
        wanted = tuple(sorted({planned.ranks.process(r) for r in ranks
                               if r < planned.world_size} & set(planned.process_ids)))
    state = {pid: parts.gather_points(sorted(v.name for v in planned.program.persistables),
                                      pid) for pid in wanted}
    programs = {pid: compile_process(planned, pid, state[pid]) for pid in wanted}
    kept = {g[0] for g in planned.groups} | set(wanted)
    return dataclasses.replace(planned, programs=MappingProxyType(programs),
                               locals=MappingProxyType({pid: parts[pid] for pid in sorted(kept)}))


def _shard_updates(program, mesh_dim: str, cluster, store_split: bool, only=None) -> None:
    """ZeRO over ``mesh_dim`` (:func:`shard_updates`) of the updates of the parameters
    ``only`` names (None: all), the parameters stored split too where ``store_split``
    (ZeRO-3: those ``dg.parallelize`` could not split, padded or over a tensor-parallel
    dim and ``mesh_dim``)."""
    meshes = {op.dist_attr.mesh for op in program.ops if op.role is Role.OPTIMIZE}
    if not any(mesh_dim in m.dim_names for m in meshes):
        raise PlanError(f"Strategy(sharding=True) shards updates over mesh dim {mesh_dim!r}, "
                        f"but no update runs on a mesh with that dim (meshes: "
                        f"{', '.join(sorted(map(str, meshes)))}); set "
                        f"Strategy(sharding_mesh_dim=...) to a data-parallel dim")
    if shard_updates(program, mesh_dim, store_split, only):
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
        raise TooFewDevicesError(sorted(ids), len(cluster.devices))
    if rank_mapping is None:
        if list(ids) != list(range(world_size)):
            raise PlanError(f"the plan's meshes number their processes {list(ids)}, but the "
                            f"rank mapper places processes 0..{world_size - 1} on the "
                            f"cluster's devices: number the ProcessMesh processes 0.."
                            f"{world_size - 1}, or map each process onto a device with "
                            f"Engine(..., rank_mapping={{process: device id}})")
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
