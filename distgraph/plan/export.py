"""A plan as torchtitan's or Megatron-LM's configuration (``plan.export(target)``).

``export(plan, "torchtitan")`` returns a dict of three sections: ``"parallelism"``, the
fields of torchtitan's ``ParallelismConfig`` (``data_parallel_replicate_degree``,
``data_parallel_shard_degree``, ``tensor_parallel_degree``, ``enable_sequence_parallel``,
``pipeline_parallel_degree``, ``pipeline_parallel_schedule``,
``pipeline_parallel_layers_per_stage`` with ``pipeline_parallel_first_stage_less_layers``
and ``pipeline_parallel_last_stage_less_layers`` 0 (torchtitan then puts that many blocks
in each (virtual) stage, the embedding in the first and the head in the last, as the
plan does), ``pipeline_parallel_microbatch_size``,
``context_parallel_degree``, ``expert_parallel_degree``: ``ParallelismConfig(**d)``
builds it); ``"activation_checkpoint"``, ``{"mode": "none" | "full"}`` (its
ActivationCheckpoint mode); ``"training"``, ``local_batch_size``, ``global_batch_size``
and ``seq_len`` of its TrainingConfig.

``export(plan, "megatron")`` returns Megatron-LM's arguments as an argv list:
``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``,
``--context-parallel-size``, ``--expert-model-parallel-size``, ``--micro-batch-size``,
``--global-batch-size``, then where they apply ``--num-layers-per-virtual-pipeline-stage``,
``--sequence-parallel``, ``--recompute-granularity full --recompute-method uniform
--recompute-num-layers 1``, ``--use-distributed-optimizer``.

How a plan reads (:func:`degrees`): the stages are ``plan.stages``, all of one mesh
shape; on each, the mesh dims splitting the first feed's batch are data parallel, one
splitting its sequence context parallel, the one dim splitting weights (the Megatron
way: :mod:`distgraph.plan.styles`) tensor parallel; the transformer blocks
(``BuiltProgram.block_paths``) split evenly over the stages (the chunks, with virtual
stages), the embedding on the first and the head on the last. A plan the frameworks
cannot express raises DistGraphError saying what: stages of different mesh shapes
(different tensor degrees), an uneven split of the blocks, a layout outside their
styles, a schedule they lack. ``Strategy(target=...)`` makes the search keep to what
they express (:mod:`distgraph.passes.search`).

Example::

    plan = dg.passes.plan(built, dg.Strategy(auto_mode="full", target="megatron"), cluster)
    print(" ".join(plan.export("megatron")))     # --tensor-model-parallel-size 4 ...
"""

from __future__ import annotations

from dataclasses import dataclass

from distgraph.errors import DistGraphError
from distgraph.plan.styles import feed_problem, weight_kinds, weight_problem
from distgraph.plan.kinds import ItemKind, TaskKind
from distgraph.spmd.specs import entry_dims

TARGETS = ("torchtitan", "megatron")
# distgraph's schedule (and whether chunks interleave) -> the framework's name
TORCHTITAN_SCHEDULES = {("1F1B", False): "1F1B", ("1F1B", True): "Interleaved1F1B",
                        ("FThenB", False): "GPipe", ("ZB", True): "InterleavedZeroBubble",
                        ("ZBV", True): "ZBVZeroBubble"}
MEGATRON_SCHEDULES = {("1F1B", False), ("1F1B", True)}


@dataclass(frozen=True)
class Degrees:
    """A plan read as the frameworks' degrees (module docstring). ``dp``, ``tp``,
    ``pp``, ``cp``, ``ep``: data, tensor, pipeline, context and expert parallel
    degrees; ``virtual``: chunks per stage; ``blocks_per_chunk``: blocks a chunk holds;
    ``micro_batch``: sequences per micro-batch per data-parallel replica; ``micro_batches``
    per step; ``seq_len``; ``schedule``: distgraph's; ``recompute``: "none" or "full";
    ``zero``: optimizer states sharded over the data-parallel dims;
    ``sequence_parallel``: Megatron-SP."""

    dp: int
    tp: int
    pp: int
    cp: int
    ep: int
    virtual: int
    blocks_per_chunk: int
    micro_batch: int
    micro_batches: int
    seq_len: int
    schedule: str
    recompute: str
    zero: bool
    sequence_parallel: bool

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.micro_batches * self.dp


def export(plan, target: str):
    """``plan`` as ``target``'s configuration (module docstring): a dict for
    "torchtitan", an argv list for "megatron"."""
    if target not in TARGETS:
        raise DistGraphError(f"plan.export: no target {target!r}; targets: "
                             f"{', '.join(TARGETS)}")
    d = degrees(plan, target)
    interleaved = d.virtual > 1
    if target == "torchtitan":
        if d.pp > 1 and (d.schedule, interleaved) not in TORCHTITAN_SCHEDULES:
            raise _cannot(target, f"schedule {d.schedule!r}"
                          f"{' interleaved' if interleaved else ''}: torchtitan's "
                          f"schedules are {', '.join(TORCHTITAN_SCHEDULES.values())}")
        schedule = TORCHTITAN_SCHEDULES.get((d.schedule, interleaved), "1F1B")
        local = d.micro_batch * (d.micro_batches if d.pp > 1 else 1)
        return {
            "parallelism": {
                "data_parallel_replicate_degree": 1 if d.zero else d.dp,
                "data_parallel_shard_degree": d.dp if d.zero else 1,
                "tensor_parallel_degree": d.tp,
                "enable_sequence_parallel": d.sequence_parallel,
                "pipeline_parallel_degree": d.pp,
                "pipeline_parallel_schedule": schedule,
                "pipeline_parallel_layers_per_stage": d.blocks_per_chunk if d.pp > 1 else None,
                # the embedding and the head count as no layer: the blocks split evenly
                "pipeline_parallel_first_stage_less_layers": 0 if d.pp > 1 else 1,
                "pipeline_parallel_last_stage_less_layers": 0 if d.pp > 1 else 1,
                "pipeline_parallel_microbatch_size": d.micro_batch,
                "context_parallel_degree": d.cp,
                "expert_parallel_degree": d.ep,
            },
            "activation_checkpoint": {"mode": d.recompute},
            "training": {"local_batch_size": local, "global_batch_size": d.global_batch,
                         "seq_len": d.seq_len},
        }
    if d.pp > 1 and (d.schedule, interleaved) not in MEGATRON_SCHEDULES:
        raise _cannot(target, f"schedule {d.schedule!r}: Megatron-LM pipelines with 1F1B "
                      f"(interleaved with --num-layers-per-virtual-pipeline-stage)")
    argv = ["--tensor-model-parallel-size", str(d.tp),
            "--pipeline-model-parallel-size", str(d.pp),
            "--context-parallel-size", str(d.cp),
            "--expert-model-parallel-size", str(d.ep),
            "--micro-batch-size", str(d.micro_batch),
            "--global-batch-size", str(d.global_batch)]
    if interleaved:
        argv += ["--num-layers-per-virtual-pipeline-stage", str(d.blocks_per_chunk)]
    if d.sequence_parallel:
        argv.append("--sequence-parallel")
    if d.recompute == "full":
        argv += ["--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", "1"]
    if d.zero:
        argv.append("--use-distributed-optimizer")
    return argv


def _cannot(target: str, what: str) -> DistGraphError:
    return DistGraphError(f"plan.export({target!r}): {target} cannot run this plan: {what}. "
                          f"Strategy(auto_mode='full', target={target!r}) searches only "
                          f"plans it runs")


def degrees(plan, target: str = "megatron") -> Degrees:
    """The frameworks' degrees of ``plan`` (module docstring); DistGraphError naming
    what ``target`` cannot express."""
    strategy, program = plan.strategy, plan.program
    stages = list(plan.stages)
    first = stages[0]
    for s, mesh in enumerate(stages[1:], 1):
        if (tuple(mesh.shape), tuple(mesh.dim_names)) != (tuple(first.shape),
                                                          tuple(first.dim_names)):
            raise _cannot(target, f"stage 0 runs on a mesh {list(first.shape)} "
                          f"{list(first.dim_names)}, stage {s} on {list(mesh.shape)} "
                          f"{list(mesh.dim_names)}: every stage has the same tensor and data "
                          f"degrees there")
    sizes = dict(zip(first.dim_names, first.shape))
    feed = program.inputs[0]
    spec = feed.dist_attr.spec
    data = [m for m in entry_dims(spec.dims[0]) if sizes.get(m, 1) > 1] if spec.dims else []
    sequence = [m for m in (entry_dims(spec.dims[1]) if len(spec.dims) > 1 else ())
                if sizes.get(m, 1) > 1]
    if len(sequence) > 1:
        raise _cannot(target, f"the sequence of {feed.name} is split over {sequence}: "
                      f"context parallelism runs over one mesh dim")
    kinds = weight_kinds(program)
    split = {m for v in program.parameters for e in v.dist_attr.spec.dims
             for m in entry_dims(e) if sizes.get(m, 1) > 1 and m not in data}
    experts = {m for v in program.parameters if kinds[v.name] == "expert"
               for m in entry_dims(v.dist_attr.spec.dims[0]) if m in data}
    split -= set(sequence)
    if len(split) > 1:
        raise _cannot(target, f"weights are split over mesh dims {sorted(split)}: tensor "
                      f"parallelism runs over one")
    tensor = next(iter(split), None)
    idle = [m for m, n in sizes.items() if n > 1 and m not in data + sequence + [tensor]]
    if idle:
        raise _cannot(target, f"mesh dim {idle[0]!r} ({sizes[idle[0]]} processes) splits "
                      f"neither the batch, the sequence nor a weight: its processes repeat "
                      f"the same work")
    problem = feed_problem(feed.name, feed.shape, spec, sizes, tensor,
                           sequence[0] if sequence else None)
    fsdp = target == "torchtitan" and strategy.sharding
    for v in program.parameters:
        problem = problem or weight_problem(v.name, kinds[v.name], v.logical_shape,
                                            v.dist_attr.spec, sizes, tensor, data_ok=fsdp)
    if problem:
        raise _cannot(target, problem)
    if plan.batch_split is not None:
        raise _cannot(target, "the batch is split unevenly over the data-parallel groups "
                      "(Strategy(balance=True))")
    zero = _zero_dim(strategy)
    chosen = plan.decisions.zero_params if plan.decisions is not None else None
    if zero is not None and chosen is not None and sizes.get(zero, 1) > 1:
        whole = [v.name for v in program.parameters
                 if zero not in v.dist_attr.spec.mesh_dims() and v.name not in chosen]
        if whole:
            raise _cannot(target, f"ZeRO shards the updates of {len(chosen)} parameters and "
                          f"not of {len(whole)} others ({whole[0]}, ...), as the search chose "
                          f"per update; {target} shards every update or none")
    if zero is not None and zero not in data and sizes.get(zero, 1) > 1:
        raise _cannot(target, f"ZeRO shards over mesh dim {zero!r}, not a data-parallel dim "
                      f"({data})")
    dp = 1
    for m in data:
        dp *= sizes[m]
    ep = 1
    for m in experts:
        ep *= sizes[m]
    if ep > 1 and target == "torchtitan":
        dense = (dp if zero is not None else 1) * (sizes[tensor] if tensor else 1) * \
            (sizes[sequence[0]] if sequence else 1)
        if dense % ep:
            raise _cannot(target, f"the experts are split over {ep} ranks, but torchtitan's "
                          f"expert parallelism borrows its ranks from FSDP, context and tensor "
                          f"parallelism ({dense} here: data_parallel_shard_degree x cp x tp); "
                          f"shard over the data-parallel dims (Strategy(sharding=True))")
    virtual, per_chunk = _chunks(plan, stages, target)
    rows = int(feed.shape[0])
    return Degrees(dp=dp, tp=sizes.get(tensor, 1) if tensor else 1, pp=len(stages),
                   cp=sizes[sequence[0]] if sequence else 1, ep=ep, virtual=virtual,
                   blocks_per_chunk=per_chunk, micro_batch=rows // dp,
                   micro_batches=plan.micro_batches,
                   seq_len=int(feed.shape[1]) if len(feed.shape) > 1 else 1,
                   schedule=strategy.schedule, recompute=_recompute(plan, target),
                   zero=zero is not None, sequence_parallel=strategy.sequence_parallel)


def _zero_dim(strategy) -> str | None:
    """The mesh dim ZeRO shards the optimizer states over (None: no ZeRO): the search's
    data-parallel dim ``x`` under auto_mode="full" with the default name."""
    if not strategy.sharding:
        return None
    if strategy.auto_mode == "full" and strategy.sharding_mesh_dim == "dp":
        return "x"
    return strategy.sharding_mesh_dim


def _recompute(plan, target: str) -> str:
    """"full" where every block is recomputed, "none" where none is."""
    asked = plan.strategy.recompute
    blocks = tuple(plan.built.block_paths)
    if asked is False:
        return "none"
    whole = isinstance(asked, tuple) and all(isinstance(e, str) for e in asked)
    if asked is True or (whole and sorted(asked) == sorted(blocks)):
        return "full"
    # the attention scores ("selective"), or some layers only (per stage: passes/stage_recompute.py)
    what = "the attention scores" if asked == "selective" else f"{list(asked)}"
    raise _cannot(target, f"recomputation of {what} only: the frameworks recompute "
                  f"every block (full) or none")


def _chunks(plan, stages, target: str) -> tuple:
    """(chunks per stage, blocks per chunk): the blocks split evenly, whole, over the
    chunks in order, the layers before them (embedding) with the first chunk and those
    after them (head) with the last."""
    blocks = list(plan.built.block_paths)
    held = _chunk_layers(plan)
    n = len(held)
    if not blocks:
        if n > 1:
            raise _cannot(target, "the model has no run of identical blocks "
                          "(model.blocks / model.layers) for its stages to split")
        return 1, 0
    where: dict = {}
    for c, layers in enumerate(held):
        for b in blocks:
            if any(x == b or x.startswith(b + ".") for x in layers):
                where.setdefault(b, []).append(c)
    cut = [b for b in blocks if len(where.get(b, ())) != 1]
    if cut:
        raise _cannot(target, f"block {cut[0]} runs in chunks {where.get(cut[0], [])}: each "
                      f"block runs whole in one stage")
    counts = [sum(1 for b in blocks if where[b] == [c]) for c in range(n)]
    if len(set(counts)) > 1 or any(where[b][0] > where[a][0]
                                   for a, b in zip(blocks[1:], blocks)):
        what = "stages" if n == len(stages) else "virtual stages (chunks)"
        raise _cannot(target, f"the {len(blocks)} blocks are split unevenly over the "
                      f"{what}: {counts} blocks each; both frameworks give each "
                      f"{len(blocks) // n if len(blocks) % n == 0 else 'the same number'}")
    for c, layers in enumerate(held):
        outside = {x.split(".")[0] for x in layers} - {b.split(".")[0] for b in blocks}
        if outside and 0 < c < n - 1:
            raise _cannot(target, f"chunk {c} holds {sorted(outside)} between the blocks: "
                          f"the embedding runs in the first stage, the head in the last")
    return n // len(stages), counts[0]


def _chunk_layers(plan) -> list:
    """The layer paths of the forward ops (and the parameters they read) each chunk of
    ``plan`` runs, in chunk order."""
    graph = plan.graph
    out = []
    for c, mesh in enumerate(graph.chunks):
        pid = mesh.process_ids[0]
        ops = plan.local_alike(pid).program.ops
        task = graph.tasks_of(pid).get((c, TaskKind.FORWARD))
        layers = set()
        for it in task.items if task is not None else ():
            if it.kind is ItemKind.OP:
                op = ops[it.index]
                layers |= {v.name.rpartition(".")[0] for v in op.inputs if v.is_parameter}
                if op.layer:
                    layers.add(op.layer)
        out.append(layers)
    return out
