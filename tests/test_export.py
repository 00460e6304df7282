"""``plan.export(target)`` (distgraph/plan/export.py) and ``Strategy(target=...)``.

Plans laid out by hand (Megatron's (t, p) on a small GPT, a Llama through
``dg.parallelize``) export as the frameworks' degrees: they multiply to the world size,
Megatron's global batch is micro-batch x micro-batches x data parallel, and where
torchtitan is installed its own ``ParallelismConfig`` takes the fields. Plans the
frameworks cannot express raise, naming what. The search under a target always gives a
plan that exports, never predicted faster than the unrestricted search's, which on some
clusters gives one that does not export (the restriction bites).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import distgraph as dg
from distgraph.plan.export import degrees
from distgraph.program_builder import build_program

BATCH, SEQ = 8, 8
ROOT = Path(__file__).resolve().parents[1]


class GPT(dg.nn.GPT):
    """A small GPT whose tokens are split over the first stage's ``dp`` dim."""

    def __init__(self, mesh=None, n_layer=4):
        super().__init__(vocab_size=64, d_model=32, n_layer=n_layer, n_head=4,
                         max_seq_len=SEQ)
        self.mesh = mesh

    def forward(self, idx):
        if self.mesh is not None:
            dg.shard_tensor(idx, self.mesh, ["dp", None])
        return super().forward(idx)


def built(model, batch=BATCH):
    return build_program(model, [dg.InputSpec([batch, SEQ], "int64", "tokens")],
                         [dg.InputSpec([batch, SEQ], "int64", "labels")],
                         dg.nn.CrossEntropyLoss(), dg.optim.AdamW(1e-3))


def hand_plan(shapes, blocks_per_stage, strategy=None, foreign=None):
    """A GPT of sum(blocks_per_stage) blocks, stage s on a (dp, mp) mesh of
    ``shapes[s]`` holding ``blocks_per_stage[s]`` blocks, laid out Megatron's way:
    qkv and fc1 split by columns over mp, proj and fc2 by rows, the vocabulary of wte
    and lm_head over mp. ``foreign(model, meshes)`` changes a layout afterwards."""
    start, meshes = 0, []
    for dp, t in shapes:
        meshes.append(dg.ProcessMesh(np.arange(start, start + dp * t).reshape(dp, t).tolist(),
                                     dim_names=["dp", "mp"]))
        start += dp * t
    model = GPT(meshes[0], n_layer=sum(blocks_per_stage))
    stage_of = [s for s, n in enumerate(blocks_per_stage) for _ in range(n)]
    for i, block in enumerate(model.blocks):
        mesh = meshes[stage_of[i]]
        for col, row in ((block.attn.qkv, block.attn.proj), (block.mlp.fc1, block.mlp.fc2)):
            dg.shard_tensor(col.weight, mesh, [None, "mp"])
            dg.shard_tensor(col.bias, mesh, ["mp"])
            dg.shard_tensor(row.weight, mesh, ["mp", None])
            dg.shard_tensor(row.bias, mesh, [None])
        for ln in (block.ln1, block.ln2):
            dg.shard_tensor(ln.weight, mesh, [None])
            dg.shard_tensor(ln.bias, mesh, [None])
    dg.shard_tensor(model.wte.weight, meshes[0], ["mp", None])
    dg.shard_tensor(model.wpe.weight, meshes[0], [None, None])
    for p in (model.ln_f.weight, model.ln_f.bias):
        dg.shard_tensor(p, meshes[-1], [None])
    dg.shard_tensor(model.lm_head.weight, meshes[-1], [None, "mp"])
    if foreign is not None:
        foreign(model, meshes)
    return dg.passes.plan(built(model), strategy or dg.Strategy())


def megatron_args(argv: list) -> dict:
    """{--flag: value or True} of an argv list."""
    out, k = {}, 0
    while k < len(argv):
        if k + 1 < len(argv) and not argv[k + 1].startswith("--"):
            out[argv[k]] = argv[k + 1]
            k += 2
        else:
            out[argv[k]] = True
            k += 1
    return out


def check_exports(plan, targets=("torchtitan", "megatron")):
    """The exports of ``plan`` to ``targets``, checked against the plan's world and
    batch: (torchtitan's dict or None, Megatron's arguments as a dict or None)."""
    world, rows = plan.world_size, plan.program.inputs[0].shape[0] * plan.micro_batches
    titan = args = None
    if "torchtitan" in targets:
        titan = plan.export("torchtitan")
        par = titan["parallelism"]
        dp = par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"]
        assert dp * par["tensor_parallel_degree"] * par["pipeline_parallel_degree"] * \
            par["context_parallel_degree"] == world
        assert titan["training"]["global_batch_size"] == rows
        assert titan["training"]["local_batch_size"] * dp == rows // (
            1 if par["pipeline_parallel_degree"] > 1 else plan.micro_batches)
        titan_config = _titan()
        if titan_config is not None:         # torchtitan's own config takes the fields
            made = titan_config.ParallelismConfig(**par)
            assert made.tensor_parallel_degree == par["tensor_parallel_degree"]
    if "megatron" in targets:
        args = megatron_args(plan.export("megatron"))
        tp = int(args["--tensor-model-parallel-size"])
        pp = int(args["--pipeline-model-parallel-size"])
        cp = int(args["--context-parallel-size"])
        dp = world // (tp * pp * cp)
        assert dp * tp * pp * cp == world and dp % int(args["--expert-model-parallel-size"]) == 0
        assert int(args["--global-batch-size"]) == \
            int(args["--micro-batch-size"]) * plan.micro_batches * dp == rows
        if titan is not None:
            assert dp == titan["parallelism"]["data_parallel_replicate_degree"] * \
                titan["parallelism"]["data_parallel_shard_degree"]
    return titan, args


def _titan():
    try:
        import torchtitan.config as config
    except ImportError:
        return None
    return config


@pytest.mark.skipif(_titan() is None, reason="torchtitan is not installed (test extra)")
def test_torchtitan_builds_its_config_from_the_export():
    titan = hand_plan([(2, 2)], [4]).export("torchtitan")
    config = _titan().ParallelismConfig(**titan["parallelism"])
    assert (config.data_parallel_replicate_degree, config.tensor_parallel_degree) == (2, 2)


# (stage mesh shapes, blocks per stage, strategy) -> torchtitan's (replicate, shard, tp, pp)
CASES = {
    "dp": ([(4, 1)], [4], dg.Strategy(), (4, 1, 1, 1)),
    "dp x tp": ([(2, 2)], [4], dg.Strategy(), (2, 1, 2, 1)),
    "zero": ([(2, 2)], [4], dg.Strategy(sharding=True), (1, 2, 2, 1)),
    "dp accumulating": ([(4, 1)], [4], dg.Strategy(micro_batches=2), (4, 1, 1, 1)),
    "pp 1F1B": ([(1, 2), (1, 2)], [2, 2], dg.Strategy(micro_batches=4), (1, 1, 2, 2)),
    "pp x dp recomputed": ([(2, 1), (2, 1)], [2, 2],
                           dg.Strategy(micro_batches=2, recompute=True), (2, 1, 1, 2)),
    "pp interleaved": ([(1, 2), (1, 2)], [2, 2], dg.Strategy(micro_batches=4,
                                                             virtual_stages=2), (1, 1, 2, 2)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hand_plans_export_their_degrees(case):
    shapes, blocks, strategy, want = CASES[case]
    plan = hand_plan(shapes, blocks, strategy)
    titan, args = check_exports(plan)
    par = titan["parallelism"]
    assert (par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"],
            par["tensor_parallel_degree"], par["pipeline_parallel_degree"]) == want
    assert args["--tensor-model-parallel-size"] == str(want[2])
    assert args["--pipeline-model-parallel-size"] == str(want[3])
    assert ("--use-distributed-optimizer" in args) == strategy.sharding
    assert titan["activation_checkpoint"]["mode"] == ("full" if strategy.recompute else "none")
    assert ("--recompute-granularity" in args) == bool(strategy.recompute)
    if strategy.virtual_stages > 1:
        assert par["pipeline_parallel_schedule"] == "Interleaved1F1B"
        assert args["--num-layers-per-virtual-pipeline-stage"] == "1"
    elif want[3] > 1:
        assert par["pipeline_parallel_schedule"] == "1F1B"
        assert par["pipeline_parallel_layers_per_stage"] == 2
    if want[3] > 1:     # torchtitan then splits the blocks as the plan does
        assert par["pipeline_parallel_first_stage_less_layers"] == 0
        assert par["pipeline_parallel_last_stage_less_layers"] == 0


def test_a_llama_laid_out_by_parallelize_exports():
    mesh = dg.ProcessMesh(np.arange(8).reshape(2, 2, 2).tolist(), ["pp", "dp", "mp"])
    model = dg.nn.Llama(vocab_size=64, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=SEQ)
    model = dg.parallelize(model, mesh, {"mp_config": {"parallelize_plan": "megatron"},
                                         "pp_config": {"split_spec": "layers"}})
    plan = dg.passes.plan(built(model), dg.Strategy(micro_batches=4))
    titan, args = check_exports(plan)
    assert (titan["parallelism"]["tensor_parallel_degree"],
            titan["parallelism"]["pipeline_parallel_degree"],
            titan["parallelism"]["data_parallel_replicate_degree"]) == (2, 2, 2)
    assert degrees(plan).blocks_per_chunk == 2


def _mixtral(layers=2):
    return dg.nn.Mixtral(vocab_size=64, hidden_size=32, intermediate_size=32,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=SEQ, num_local_experts=4,
                         num_experts_per_tok=2)


@pytest.mark.parametrize("dims,megatron", [(("ep", "mp"), True), (("dp", "ep"), False)])
def test_experts_over_data_ranks_export_as_expert_parallelism(dims, megatron):
    """Mixtral's experts split over the ``ep`` dim that splits the batch too: Megatron's
    --expert-model-parallel-size; torchtitan's expert parallelism borrows FSDP's, context
    and tensor parallelism's ranks, so without those it cannot run it."""
    mesh = dg.ProcessMesh(np.arange(4).reshape(2, 2).tolist(), list(dims))
    config = {"mp_config": {"parallelize_plan": "megatron"}} if "mp" in dims else {}
    plan = dg.passes.plan(built(dg.parallelize(_mixtral(), mesh, config)), dg.Strategy())
    args = megatron_args(plan.export("megatron"))
    assert args["--expert-model-parallel-size"] == "2"
    assert args["--tensor-model-parallel-size"] == ("2" if "mp" in dims else "1")
    if megatron:
        assert plan.export("torchtitan")["parallelism"]["expert_parallel_degree"] == 2
    else:
        with pytest.raises(dg.DistGraphError, match="borrows its ranks from FSDP"):
            plan.export("torchtitan")
    zero = dg.passes.plan(built(dg.parallelize(_mixtral(), mesh, config)),
                          dg.Strategy(sharding=True, sharding_mesh_dim=dims[0]))
    assert zero.export("torchtitan")["parallelism"]["expert_parallel_degree"] == 2


def _split_embedding_by_hidden(model, meshes):
    dg.shard_tensor(model.wte.weight, meshes[0], [None, "mp"])


def _fc1_over_dp(model, meshes):
    dg.shard_tensor(model.blocks[0].mlp.fc1.weight, meshes[0], ["dp", "mp"])


def _ln_over_mp(model, meshes):
    dg.shard_tensor(model.blocks[0].ln1.weight, meshes[0], ["mp"])


INEXPRESSIBLE = {
    "uneven stages": (([(1, 2), (1, 2)], [1, 3], dg.Strategy(micro_batches=2)),
                      "split unevenly over the stages: \\[1, 3\\] blocks each"),
    "tensor degrees per stage": (([(2, 2), (4, 1)], [2, 2], dg.Strategy(micro_batches=2)),
                                 "stage 0 runs on a mesh \\[2, 2\\].*stage 1 on \\[4, 1\\]"),
    "embedding split by hidden": (([(2, 2)], [4], dg.Strategy(), _split_embedding_by_hidden),
                                  "embedding table wte.weight \\[64, 32\\] is split over "
                                  "the tensor dim 'mp' along its dim 1"),
    "a Linear split over data": (([(2, 2)], [4], dg.Strategy(), _fc1_over_dp),
                                 "blocks.0.mlp.fc1.weight \\[32, 128\\] is split over mesh "
                                 "dim 'dp'"),
    "a norm split": (([(2, 2)], [4], dg.Strategy(), _ln_over_mp),
                     "norm weight blocks.0.ln1.weight \\[32\\] is split over the tensor dim"),
}


@pytest.mark.parametrize("case", list(INEXPRESSIBLE))
def test_inexpressible_plans_raise_naming_what(case):
    args, message = INEXPRESSIBLE[case]
    plan = hand_plan(*args)
    for target in ("megatron", "torchtitan"):
        with pytest.raises(dg.DistGraphError, match=message):
            plan.export(target)


def test_schedules_the_frameworks_lack_raise():
    plan = hand_plan([(1, 2), (1, 2)], [2, 2], dg.Strategy(micro_batches=4, schedule="FThenB"))
    assert plan.export("torchtitan")["parallelism"]["pipeline_parallel_schedule"] == "GPipe"
    with pytest.raises(dg.DistGraphError, match="schedule 'FThenB': Megatron-LM pipelines "
                                                "with 1F1B"):
        plan.export("megatron")
    plan = hand_plan([(1, 2), (1, 2)], [2, 2], dg.Strategy(micro_batches=4, schedule="ZB"))
    for target in ("megatron", "torchtitan"):
        with pytest.raises(dg.DistGraphError, match="schedule 'ZB'"):
            plan.export(target)


def test_unknown_targets_and_semi_targets_are_refused():
    with pytest.raises(dg.DistGraphError, match="no target 'deepspeed'"):
        hand_plan([(4, 1)], [4]).export("deepspeed")
    with pytest.raises(dg.DistGraphError, match="Strategy.target must be None or one of"):
        dg.Strategy(auto_mode="full", target="deepspeed")
    with pytest.raises(dg.DistGraphError, match="use it with auto_mode='full'"):
        dg.Strategy(target="megatron")
    with pytest.raises(dg.PlanError, match="splits the batch evenly"):
        dg.passes.plan(built(GPT()), dg.Strategy(auto_mode="full", target="torchtitan",
                                                 balance=True), dg.Cluster.local(2))
    with pytest.raises(dg.PlanError, match="megatron has no pipeline schedule 'FThenB'"):
        dg.passes.plan(built(GPT()), dg.Strategy(auto_mode="full", target="megatron",
                                                 pipeline=True, micro_batches=2,
                                                 schedule="FThenB"), dg.Cluster.local(2))


def _shipped(name):
    return lambda: dg.Cluster.from_file(ROOT / "resources" / "clusters" / name)


def _llama():
    return dg.nn.Llama(vocab_size=64, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=SEQ)


# model, cluster, batch, more of the strategy
SEARCHED = {
    "gpt on 4 cpus": (lambda: GPT(n_layer=4), lambda: dg.Cluster.local(4), 8, {}),
    "gpt on 2 x 8 gpus": (lambda: GPT(n_layer=4), _shipped("gpu_2x8.yaml"), 16, {}),
    "gpt on 2 x 8 gpus, zero": (lambda: GPT(n_layer=4), _shipped("gpu_2x8.yaml"), 16,
                                {"sharding": True}),
    "llama on 4 cpus": (_llama, lambda: dg.Cluster.local(4), 8, {}),
    "mixtral on 4 cpus": (lambda: _mixtral(4), lambda: dg.Cluster.local(4), 8, {}),
}


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", [False, True], ids=["layouts", "stages"])
@pytest.mark.parametrize("case", list(SEARCHED))
def test_a_restricted_search_always_exports_and_is_a_restriction(case, pipeline):
    model, cluster, batch, more = SEARCHED[case]
    cluster = cluster()
    micro = 4 if pipeline else 1
    free = dg.passes.plan(built(model(), batch), dg.Strategy(
        auto_mode="full", pipeline=pipeline, micro_batches=micro, **more), cluster)
    for target in ("megatron", "torchtitan"):
        plan = dg.passes.plan(built(model(), batch), dg.Strategy(
            auto_mode="full", pipeline=pipeline, micro_batches=micro, target=target, **more),
            cluster)
        titan, args = check_exports(plan, (target,))
        if args is not None:
            assert ("--use-distributed-optimizer" in args) == plan.strategy.sharding
        assert plan.estimate.step_time >= free.estimate.step_time * (1 - 1e-9)


def test_the_restriction_bites_where_the_free_search_picks_a_foreign_layout():
    cluster = dg.Cluster.local(4)
    free = dg.passes.plan(built(GPT()), dg.Strategy(auto_mode="full"), cluster)
    with pytest.raises(dg.DistGraphError, match="cannot run this plan"):
        free.export("megatron")
    kept = dg.passes.plan(built(GPT()), dg.Strategy(auto_mode="full", target="megatron"),
                          cluster)
    check_exports(kept)


def test_the_plan_command_prints_an_export():
    """``distgraph plan SCRIPT --export``: the tutorial's pipeline (2 stages of 2
    data-parallel processes, 8 micro-batches) as Megatron's arguments and torchtitan's
    fields."""
    def plan_cli(*args):
        return subprocess.run([sys.executable, "-m", "distgraph.cli", "plan",
                               str(ROOT / "tutorials" / "04_pipeline.py"), *args],
                              capture_output=True, text=True, timeout=300, cwd=ROOT)
    proc = plan_cli("--export", "megatron")
    assert proc.returncode == 0, proc.stderr
    args = megatron_args(shlex.split(proc.stdout))
    assert (args["--tensor-model-parallel-size"], args["--pipeline-model-parallel-size"]) == \
        ("1", "2")
    assert int(args["--global-batch-size"]) == int(args["--micro-batch-size"]) * 8 * 2
    proc = plan_cli("--export", "torchtitan")
    assert proc.returncode == 0, proc.stderr
    par = json.loads(proc.stdout)["parallelism"]
    assert (par["data_parallel_replicate_degree"], par["pipeline_parallel_degree"]) == (2, 2)


def test_a_target_pipeline_needs_identical_blocks():
    with pytest.raises(dg.PlanError, match="no run of identical blocks"):
        dg.passes.plan(built(_mixtral(2)), dg.Strategy(auto_mode="full", target="megatron",
                                                        pipeline=True, micro_batches=2),
                       dg.Cluster.local(2))
