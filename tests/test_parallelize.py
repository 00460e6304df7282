"""``dg.parallelize``: a layout in one call equals the same layout written with
``shard_tensor`` (the completed programs' dist attrs, op by op), trains as the serial
model does (float64, 1e-10) for GPT, Llama and Mixtral with each config alone and
combined, cp and ep too (real MPI ranks: 4, and 8 for dp x mp x pp), and says what is
wrong with a config in one DistGraphError naming the culprit. Paddle's styles split what Paddle's
split; its sequence-parallel styles on Llama move exactly what
``Strategy(sequence_parallel=True)`` moves."""

from __future__ import annotations

import collections
import os
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402
from distgraph.runtime.comm.simulated import SimulatedWorld  # noqa: E402

import parallelize_cases as C  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def _plan(model, optimizer, strategy, kind="gpt", data=None):
    engine = dg.Engine(model, loss=dg.nn.CrossEntropyLoss(), optimizer=optimizer,
                       strategy=strategy)
    return engine.prepare(*dg.app.data.DataLoader(data or C.NextTokens(kind), C.BATCH).specs(1))


def _layouts(plan) -> list:
    """Each op's mesh and specs, then each value's dist attr, of the completed program."""
    program = plan.program
    return ([(op.type, op.layer, op.dist_attr.mesh, tuple(op.dist_attr.input_specs),
              tuple(op.dist_attr.output_specs)) for op in program.ops]
            + sorted((name, str(v.dist_attr.mesh), str(v.dist_attr.spec))
                     for name, v in program.values.items()))


def _specs(model) -> dict:
    return {name: (p.annotation.mesh, str(p.annotation.spec))
            for name, p in model.named_parameters()}


# -- the same plan as shard_tensor ----------------------------------------------------------

@pytest.mark.parametrize("kind, name", sorted(C.BY_HAND))
def test_the_layout_written_with_shard_tensor_gives_the_same_plan(kind, name):
    """Hand-written annotations (every parameter on its stage, the specs of Megatron's
    table, level 3's dp split, the input's batch split inside forward) and
    Strategy(sharding=True) for a ZeRO level, with the optimizer carrying level 3 where
    it is (the planner then stores split the parameters no free dim of which dp
    divides): the completed program parallelize's layout gives, whose optimizer carries
    the level, is the same op by op."""
    layout = C.LAYOUTS[kind, name]
    model, optimizer = C.parallelized(kind, layout)
    ours = _plan(model, optimizer, dg.Strategy(**layout.strategy), kind)
    annotate, batch, strategy = C.BY_HAND[kind, name]
    model = C.build(kind)
    annotate(model)
    if batch is not None:
        C.split_input(model, *batch)
    by_hand = dg.optim.AdamW(1e-2)
    if optimizer.sharding_level == 3:
        by_hand.sharding_level = 3
    theirs = _plan(model, by_hand, dg.Strategy(**strategy), kind)
    assert ours.strategy.sharding == theirs.strategy.sharding
    assert _layouts(ours) == _layouts(theirs)


def test_styles_and_the_built_in_plan_split_alike():
    """GPT's Megatron plan in Paddle's styles (the embedding RowWise: its vocabulary; the
    head ColWise: its classes) is the built-in "megatron"."""
    styles, _ = C.parallelized("gpt", C.LAYOUTS["gpt", "mp_styles"])
    built_in, _ = C.parallelized("gpt", C.LAYOUTS["gpt", "mp_megatron"])
    assert _specs(styles) == _specs(built_in)
    assert _specs(styles)["blocks.1.mlp.fc1.bias"][1] == "[mp]"


def test_a_shard_dataloader_split_is_kept_and_a_plain_dataset_split_over_dp():
    """Fed plainly, the tokens' batch is split over dp (and ep) on the first stage and
    the labels come whole; from dg.shard_dataloader, its split (labels too) stays."""
    layout = C.LAYOUTS["gpt", "pp_dp_z2"]
    plan = _plan(*C.parallelized("gpt", layout), dg.Strategy(**layout.strategy))
    first = layout.mesh.get_mesh_with_dim("pp", 0)
    inputs = {v.name: v.dist_attr for v in plan.program.inputs}
    assert inputs["input_0"] == dg.DistAttr(first, dg.ShardSpec(["dp", None]))
    last = layout.mesh.get_mesh_with_dim("pp", 1)
    data = dg.shard_dataloader(C.NextTokens("gpt"), [first, last], "dp")
    plan = _plan(*C.parallelized("gpt", layout), dg.Strategy(**layout.strategy), data=data)
    inputs = {v.name: v.dist_attr for v in plan.program.inputs}
    assert inputs["label_0"] == dg.DistAttr(last, dg.ShardSpec(["dp", None]))
    ep = C.LAYOUTS["mixtral", "ep"]
    plan = _plan(*C.parallelized("mixtral", ep), dg.Strategy(), "mixtral")
    assert str(plan.program.inputs[0].dist_attr.spec) == "[ep, None]"


def test_llama_sequence_parallel_styles_move_what_megatron_sp_moves():
    """Paddle's Llama plan with SequenceParallelBegin/Enable/Disable/End (its styles as
    Paddle's Llama example writes them) moves the same collectives, of the same bytes, as
    Megatron's split with Strategy(sequence_parallel=True)."""
    layout = C.LAYOUTS["llama", "dp_mp_sequence_parallel"]
    ours = _plan(*C.parallelized("llama", layout), dg.Strategy(), "llama")
    model = C.build("llama")
    C.llama_by_hand([layout.mesh])(model)
    C.split_input(model, layout.mesh, "dp")
    theirs = _plan(model, dg.optim.AdamW(1e-2), dg.Strategy(sequence_parallel=True), "llama")

    def moves(plan):
        return collections.Counter((str(s.kind), s.bytes) for p in plan.local(0).points()
                                   for s in p.steps)

    assert moves(ours) == moves(theirs)
    assert any(kind == "reduce_scatter" for kind, _ in moves(ours))


def test_the_readmes_layout_in_one_config_plans_after_the_first_script():
    """The README's dp x mp x pp snippet, after its first script's model, plans its 8
    processes from one process: two stages of 2 x 2, ZeRO's sharding on."""
    readme = open(os.path.join(HERE, "..", "README.md")).read()
    section = readme[readme.index("## A first script"):readme.index("## Where to read on")]
    blocks = section.split("```python\n")[1:]
    first, snippet = blocks[0].split("```")[0], blocks[2].split("```")[0]
    scope: dict = {}
    exec(first[:first.index("engine = ")] + snippet, scope)     # noqa: S102 - the README's
    plan = scope["engine"].prepare([dg.InputSpec([16, 32], "int64", "tokens")],
                                   [dg.InputSpec([16, 32], "int64", "labels")])
    assert [m.shape for m in plan.stages] == [(2, 2), (2, 2)] and plan.strategy.sharding


# -- what each piece does -------------------------------------------------------------------

def test_styles_split_what_paddles_split():
    """ColWise: a Linear's output features and bias, an Embedding's hidden dim, a stacked
    expert weight's last dim; RowWise: input features (the bias whole), the vocabulary,
    the stacked weight's in dim; a pattern may name a parameter."""
    model = C.build("mixtral")
    plan = {"embed_tokens": dg.ColWiseParallel(), "lm_head": dg.RowWiseParallel(),
            "layers.0.self_attn.q_proj": dg.ColWiseParallel(),
            "layers.*.mlp.experts.gate_proj": dg.ColWiseParallel(),
            "layers.*.mlp.experts.down_proj": dg.RowWiseParallel()}
    dg.parallelize(model, dg.ProcessMesh([0, 1], ["mp"]), {"mp_config": {"parallelize_plan": plan}})
    specs = {n: s for n, (_, s) in _specs(model).items()}
    assert specs["embed_tokens.weight"] == "[None, mp]"
    assert specs["lm_head.weight"] == "[mp, None]"
    assert specs["layers.0.self_attn.q_proj.weight"] == "[None, mp]"
    assert specs["layers.1.self_attn.q_proj.weight"] == "[None, None]"
    assert specs["layers.1.mlp.experts.gate_proj"] == "[None, None, mp]"
    assert specs["layers.1.mlp.experts.down_proj"] == "[None, mp, None]"
    model = C.build("gpt")
    dg.parallelize(model, dg.ProcessMesh([0, 1], ["mp"]), {"mp_config": {"parallelize_plan": {
        "blocks.*.mlp.fc2": dg.RowWiseParallel(), "blocks.0.attn.qkv.bias":
        dg.ColWiseParallel()}}})
    specs = {n: s for n, (_, s) in _specs(model).items()}
    assert (specs["blocks.0.mlp.fc2.weight"], specs["blocks.0.mlp.fc2.bias"]) == \
        ("[mp, None]", "[None]")
    assert (specs["blocks.0.attn.qkv.weight"], specs["blocks.0.attn.qkv.bias"]) == \
        ("[None, None]", "[mp]")


@pytest.mark.parametrize("split", [
    "blocks", {"blocks.0": dg.SplitPoint.END}, {"blocks.1": dg.SplitPoint.BEGINNING},
    {"blocks.1": 1}, {"wte": 0, "blocks.1": 1}])
def test_split_specs_place_the_embedding_first_and_the_head_last(split):
    """Each form of split_spec gives GPT's two stages: embeddings and block 0 on the pp
    dim's slice 0, block 1, the final norm and the head on slice 1; every stage a dp x mp
    sub-mesh."""
    layout = C.mesh((2, 2, 2), ("pp", "dp", "mp"))
    model = dg.parallelize(C.build("gpt"), layout, {
        "mp_config": {"parallelize_plan": "megatron"}, "pp_config": {"split_spec": split}})
    stages = [layout.get_mesh_with_dim("pp", s) for s in (0, 1)]
    assert stages[1] == dg.ProcessMesh([[4, 5], [6, 7]], ["dp", "mp"])
    for name, (mesh, _) in _specs(model).items():
        want = next(s for s, parts in enumerate(C.GPT_STAGES)
                    if any(name.startswith(part + ".") for part in parts))
        assert mesh == stages[want], name


def test_a_mesh_of_pp_alone_gives_one_process_per_stage():
    model = dg.parallelize(C.build("llama"), C.mesh((2,), ("pp",)),
                           {"pp_config": {"split_spec": "layers"}})
    meshes = {name: mesh for name, (mesh, _) in _specs(model).items()}
    assert meshes["embed_tokens.weight"] == dg.ProcessMesh([0], ["pp"])
    assert meshes["layers.1.mlp.up_proj.weight"] == dg.ProcessMesh([1], ["pp"])


def test_the_level_rides_on_the_optimizer_to_the_planner():
    """parallelize returns the optimizer it was given with the level; a program built
    with it is planned with ZeRO's sharding (gradients reduce-scattered onto the slices
    the updates run on); level 0 plans plain data parallelism."""
    mesh = C.mesh((4,), ("dp",))
    model, optimizer = dg.parallelize(C.build("gpt"), mesh, {"dp_config": {"sharding_level": 2}},
                                      optimizer=dg.optim.AdamW(1e-2))
    assert optimizer.sharding_level == 2
    assert optimizer.hyperparameters()["sharding_level"] == 2
    plan = _plan(model, optimizer, dg.Strategy())
    assert plan.strategy.sharding

    def kinds(plan):         # of the reshards of the weight matrices' gradients
        return {str(s.kind) for p in plan.local(0).points()
                if p.value.endswith(".weight@GRAD") and p.value != "wpe.weight@GRAD"
                for s in p.steps}

    assert kinds(plan) == {"reduce_scatter"}
    model, optimizer = dg.parallelize(C.build("gpt"), mesh, {}, optimizer=dg.optim.AdamW(1e-2))
    plan = _plan(model, optimizer, dg.Strategy())
    assert not plan.strategy.sharding and kinds(plan) == {"all_reduce"}
    assert "sharding_level" not in optimizer.hyperparameters()


def test_level_3_gathers_each_weight_to_use_it_and_keeps_the_batch_split():
    """ZeRO-3 as FSDP runs it: each weight stored split over dp is all-gathered where its
    layer uses it (forward, and again for the input gradients), the tokens stay split
    over dp (not gathered to compute the whole batch everywhere, which moves fewer bytes
    but does dp times the work), and its gradient is reduce-scattered onto its slice."""
    layout = C.LAYOUTS["gpt", "dp_z3"]
    plan = _plan(*C.parallelized("gpt", layout), dg.Strategy(**layout.strategy))
    steps = collections.defaultdict(list)
    for point in plan.local(0).points():
        steps[point.value] += [str(s.kind) for s in point.steps]
    assert "input_0" not in steps
    for name in ("blocks.0.attn.qkv.weight", "blocks.1.mlp.fc2.weight", "lm_head.weight"):
        assert steps[name] == ["all_gather", "all_gather"], name
        assert steps[name + "@GRAD"] == ["reduce_scatter"], name


def test_parallelize_again_lays_the_model_out_anew():
    """A second call replaces every annotation and wrapper of the first (no layout
    stacked on another)."""
    model = C.build("llama")
    layout = C.LAYOUTS["llama", "dp_mp_sequence_parallel"]
    dg.parallelize(model, layout.mesh, layout.config())
    assert "forward" in model.layers[0].self_attn.__dict__
    mesh = C.mesh((4,), ("dp",))
    again = dg.parallelize(model, mesh)
    assert again is model
    assert "forward" not in model.layers[0].self_attn.__dict__
    assert {m for m, _ in _specs(model).values()} == {mesh}
    assert {s for _, s in _specs(model).values()} <= {"[None]", "[None, None]"}
    plan = _plan(model, dg.optim.AdamW(1e-2), dg.Strategy(), "llama")
    assert str(plan.program.inputs[0].dist_attr.spec) == "[dp, None]"


# -- mistakes ---------------------------------------------------------------------------------

def _gpt():
    return C.build("gpt")


DP_MP = C.mesh((2, 2), ("dp", "mp"))
MP = C.mesh((2,), ("mp",))
PP = C.mesh((2,), ("pp",))
MEGATRON = {"mp_config": {"parallelize_plan": "megatron"}}


def _plan_of(plan):
    return {"mp_config": {"parallelize_plan": plan}}


def _split(spec):
    return {"pp_config": {"split_spec": spec}}


MISTAKES = [
    ("mesh dim", _gpt, C.mesh((4,), ("tp",)), None, {},
     r"mesh dim 'tp' .* is not one it knows; name the dims among dp, pp, mp, cp, ep"),
    ("mesh type", _gpt, [[0, 1]], None, {}, r"mesh must be a ProcessMesh"),
    ("unused mp", _gpt, DP_MP, None, {}, r"mesh dim 'mp' .* splits nothing: give "
                                         r"config\['mp_config'\]"),
    ("unused pp", _gpt, PP, None, {}, r"mesh dim 'pp' .* splits nothing"),
    ("no mp dim", _gpt, C.mesh((2,), ("dp",)), MEGATRON, {},
     r"config\['mp_config'\] splits over mesh dim 'mp', which .* lacks"),
    ("config key", _gpt, MP, {"tp_config": {}}, {}, r"config key 'tp_config' is not one"),
    ("inner key", _gpt, C.mesh((2,), ("dp",)), {"dp_config": {"stage": 2}}, {},
     r"config\['dp_config'\] key 'stage' is not one it knows; give 'sharding_level'"),
    ("level", _gpt, C.mesh((2,), ("dp",)), {"dp_config": {"sharding_level": 4}},
     {"optimizer": dg.optim.SGD(0.1)}, r"sharding_level 4; give 0 \(none\)"),
    ("level without optimizer", _gpt, C.mesh((2,), ("dp",)),
     {"dp_config": {"sharding_level": 2}}, {}, r"sharding_level 2 shards the optimizer's "
                                               r"states: pass optimizer="),
    ("level without dp", _gpt, MP, {**MEGATRON, "dp_config": {"sharding_level": 1}},
     {"optimizer": dg.optim.SGD(0.1)}, r"sharding_level 1 shards over mesh dim 'dp', but"),
    ("no plan", _gpt, MP, _plan_of(None), {},
     r"config\['mp_config'\] needs 'parallelize_plan'"),
    ("built-in name", _gpt, MP, _plan_of("tensor"), {},
     r"parallelize_plan 'tensor' is not a built-in plan; give 'megatron'"),
    ("no built-in", lambda: dg.nn.MLP(4, 8), MP, MEGATRON, {},
     r"'megatron' is the built-in plan of dg.nn's GPT, Llama and Mixtral; MLP has none"),
    ("pattern", _gpt, MP, _plan_of({"blocks.*.mlp.fc3": dg.ColWiseParallel()}), {},
     r"pattern 'blocks.\*.mlp.fc3' matches no layer or parameter of GPT \(did you mean"),
    ("style class", _gpt, MP, _plan_of({"lm_head": dg.ColWiseParallel}), {},
     r"gives the class ColWiseParallel; give an instance: dg.ColWiseParallel\(\)"),
    ("not a style", _gpt, MP, _plan_of({"lm_head": "colwise"}), {},
     r"pattern 'lm_head' gives 'colwise'; give a style"),
    ("no weight", _gpt, MP, _plan_of({"blocks.0.attn": dg.ColWiseParallel()}), {},
     r"'blocks.0.attn' \(MultiHeadAttention\) has none; name a Linear or Embedding"),
    ("two splits", _gpt, MP, _plan_of({"lm_head": [dg.ColWiseParallel(), dg.RowWiseParallel()]}),
     {}, r"pattern 'lm_head' gives ColWiseParallel\(\) and RowWiseParallel\(\)"),
    ("conflict", _gpt, MP, _plan_of({"lm_head": dg.ColWiseParallel(),
                                     "lm_head.weight": dg.RowWiseParallel()}), {},
     r"parameter 'lm_head.weight' is split by ColWiseParallel\(\) \(pattern 'lm_head'\) and "
     r"by RowWiseParallel\(\) \(pattern 'lm_head.weight'\)"),
    ("sequence style on a parameter", _gpt, MP,
     _plan_of({"lm_head.weight": dg.SequenceParallelEnd()}), {},
     r"SequenceParallelEnd\(\) lays out a layer's input and output; pattern 'lm_head.weight' "
     r"names the parameter"),
    ("two inputs", _gpt, MP, _plan_of({"ln_f": dg.SequenceParallelEnable(),
                                       "ln*": dg.SequenceParallelEnd()}), {},
     r"layer 'ln_f' gets two layouts of its input"),
    ("not a list", _gpt, PP, _split("wte"), {},
     r"split_spec 'wte' is not a layer list of the model; its layer lists: \['blocks'\]"),
    ("too few layers", _gpt, C.mesh((4,), ("pp",)), _split("blocks"), {},
     r"split_spec 'blocks' has 2 layers for 4 stages"),
    ("split count", _gpt, PP, _split({"blocks.0": dg.SplitPoint.END,
                                      "blocks.1": dg.SplitPoint.END}), {},
     r"gives 2 split point\(s\) for the 2 stages of the pp dim; give 1"),
    ("split path", _gpt, PP, _split({"block.0": dg.SplitPoint.END}), {},
     r"split_spec names 'block.0', which is not a layer of GPT \(did you mean 'blocks.0'"),
    ("split value", _gpt, PP, _split({"blocks.0": "end"}), {},
     r"split_spec\['blocks.0'\] = 'end'; give dg.SplitPoint.END"),
    ("empty stage", _gpt, PP, _split({"lm_head": dg.SplitPoint.END}), {},
     r"leaves stage 1 without a parameter"),
    ("no experts", _gpt, C.mesh((2,), ("ep",)), None, {},
     r"mesh dim 'ep' splits a mixture of experts' experts, but GPT has none"),
    ("optimizer", _gpt, C.mesh((2,), ("dp",)), None, {"optimizer": "adamw"},
     r"optimizer must be a dg.optim optimizer"),
]


@pytest.mark.parametrize("what, make, mesh, config, kwargs, message", MISTAKES,
                         ids=[m[0] for m in MISTAKES])
def test_each_mistake_is_one_error_naming_its_culprit(what, make, mesh, config, kwargs, message):
    model = make()
    before = {n: p.annotation for n, p in model.named_parameters()}
    with pytest.raises(dg.DistGraphError, match=message):
        dg.parallelize(model, mesh, config, **kwargs)
    assert {n: p.annotation for n, p in model.named_parameters()} == before


def test_a_sequence_split_of_a_flat_activation_says_its_shape():
    """SequenceParallelBegin on an MLP's Linear whose output has no sequence dim: the
    error names the layer, the value and its shape when the model is traced."""
    model = dg.nn.MLP(8, 16)
    dg.parallelize(model, MP, _plan_of({"fc1": [dg.ColWiseParallel(),
                                                dg.SequenceParallelBegin()]}))
    with pytest.raises(dg.DistGraphError, match=r"SequenceParallelBegin\(\) on 'fc1' splits "
                                                r"its output's sequence .* has shape \[4, 16\]"):
        dg.trace(model, dg.InputSpec([4, 8], name="x"))


# -- training equals serial -----------------------------------------------------------------

@pytest.fixture(scope="module")
def serial():
    before = dg.get_default_dtype()
    dg.set_default_dtype("float64")
    try:
        return {kind: C.train(None, kind) for kind in C.CONFIGS}
    finally:
        dg.set_default_dtype(before)


@pytest.mark.parametrize("kind, name", [("gpt", "dp_mp_megatron_z2"), ("mixtral", "pp_ep")])
def test_training_equals_serial_on_threads(float64, serial, kind, name):
    """Two layouts on SimulatedWorld threads (the quick suite's check of the numbers)."""
    layout = C.LAYOUTS[kind, name]
    for result in SimulatedWorld(layout.ranks, timeout=120).run(C.train, kind, layout):
        C.trains_equal(result, serial[kind])


def test_context_parallel_from_the_loader_keeps_its_balanced_order(float64, serial):
    """dp x cp: the loader's split of the sequence over cp, in the load-balanced order
    of 2 cp chunks, is kept (parallelize's own is the natural order: the mpi job), and
    trains as serial does."""
    layout = C.LAYOUTS["llama", "dp_cp"]
    loader = dict(shard_dims="dp", sequence_dim="cp")
    data = dg.shard_dataloader(C.NextTokens("llama"), layout.mesh, **loader)
    plan = _plan(*C.parallelized("llama", layout), dg.Strategy(), "llama", data)
    assert str(plan.program.inputs[0].dist_attr.spec) == "[dp, cp]"
    assert data.sequence_chunks == 4
    for result in SimulatedWorld(4, timeout=120).run(C.train, "llama", layout, loader):
        C.trains_equal(result, serial["llama"])


JOBS = {4: sorted(k for k, layout in C.LAYOUTS.items() if layout.ranks == 4),
        8: sorted(k for k, layout in C.LAYOUTS.items() if layout.ranks == 8)}


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", sorted(JOBS))
def test_every_layout_trains_equal_to_serial_on_mpi_ranks(float64, serial, tmp_path, ranks):
    """Every layout of parallelize_cases on real ranks (one job per world size): every
    rank's losses and parameters equal the serial run's."""
    names = [f"{kind}:{name}" for kind, name in JOBS[ranks]]
    proc = subprocess.run([sys.executable, "-m", "distgraph.cli", "run", "-n", str(ranks),
                           os.path.join(HERE, "mpi_scripts", "parallelize_layouts.py"),
                           str(tmp_path), *names],
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for kind, name in JOBS[ranks]:
        for rank in range(ranks):
            got = np.load(tmp_path / f"{kind}_{name}_rank{rank}.npz")
            state = {k: got[k] for k in got.files if k != "losses"}
            C.trains_equal((got["losses"], state), serial[kind])
