"""The picture of a plan: what it shows is the plan's (every weight's split per mesh dim,
every reshard's bytes once, in its layer or between its stages), and it is drawn to a
file by ``plan.plot`` and ``distgraph plan --plot``."""

import subprocess
import sys
from pathlib import Path

import pytest

import distgraph as dg
from distgraph.app.data import DataLoader
from distgraph.plan.plot import layer_of, picture

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tutorials"))
from counting_data import CountingSequences  # noqa: E402
from gpt_plans import megatron_block  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def staged_gpt_plan(n_stages=2):
    """GPT on ``n_stages`` 2 x 2 meshes: Megatron over mp, the batch over dp."""
    stages = [dg.ProcessMesh([[4 * s, 4 * s + 1], [4 * s + 2, 4 * s + 3]], ["dp", "mp"])
              for s in range(n_stages)]
    dg.seed(0)
    model = dg.nn.GPT(vocab_size=32, d_model=16, n_layer=n_stages, n_head=2, max_seq_len=8)
    model.embed = dg.shard_op(model.embed, stages[0])
    for i, block in enumerate(model.blocks):
        megatron_block(block, stages[i])
        model.blocks[i] = dg.shard_op(block, stages[i], in_shard_specs=[["dp", None, None]])
    model.head = dg.shard_op(model.head, stages[-1])
    engine = dg.Engine(model, dg.nn.CrossEntropyLoss(), dg.optim.SGD(0.1),
                       strategy=dg.Strategy(micro_batches=2))
    data = dg.shard_dataloader(CountingSequences(16, 8, 32), [stages[0], stages[-1]], "dp")
    return engine.prepare(*DataLoader(data, 8).specs(1)), stages


def test_layers_group_parameters_up_to_their_index():
    assert layer_of("blocks.3.attn.qkv.weight") == "blocks.3"
    assert layer_of("wte.weight") == "wte" and layer_of("") == ""
    assert layer_of("layers.0.weight") == "layers.0"


def test_the_picture_shows_every_weight_split_and_every_reshard_once():
    plan, stages = staged_gpt_plan()
    pic = picture(plan)
    assert [s.mesh for s in pic.stages] == stages
    assert [[x.name for x in s.layers] for s in pic.stages] == \
        [["wpe", "wte", "blocks.0"], ["blocks.1", "ln_f", "lm_head"]]
    qkv = next(w for w in pic.stages[1].layers[0].weights if w.name == "attn.qkv.weight")
    assert qkv.splits() == [("dp", "copies"), ("mp", "columns")]
    proj = next(w for w in pic.stages[0].layers[2].weights if w.name == "attn.proj.weight")
    # tutorial 02's attention: proj's weight is gathered before the forward uses it
    assert proj.splits() == [("dp", "copies"), ("mp", "rows stored, gathered to use")]
    fc1 = next(w for w in pic.stages[0].layers[2].weights if w.name == "mlp.fc1.weight")
    assert fc1.splits() == [("dp", "copies"), ("mp", "columns")]
    # every stage computes on the batch split over dp, and so does every block's matmul
    assert [s.batch for s in pic.stages] == [("dp",), ("dp",)]
    assert {w.batch for s in pic.stages for x in s.layers if x.name.startswith("blocks")
            for w in x.weights} == {("dp",)}
    assert pic.stages[0].layers[2].vectors == (8, 2)          # qkv.bias and fc1.bias split
    # the bytes drawn are the plan's, each reshard once
    drawn = sum(size for s in pic.stages for x in s.layers for _, _, size, _ in x.reshards)
    drawn += sum(c.bytes for c in pic.crossings)
    assert drawn == pytest.approx(sum(p.bytes for p in plan.reshards()))
    assert {(c.src, c.dst, c.role) for c in pic.crossings} == {(0, 1, "fwd"), (1, 0, "bwd")}
    assert "2 micro-batches" in pic.title


def test_an_automatic_plan_that_splits_the_batch_shows_it():
    """Issue 38: an auto plan on 4 processes that splits the batch and gathers weights
    is drawn with the batch split and with the weights it only stores split."""
    dg.seed(0)
    model = dg.nn.GPT(vocab_size=32, d_model=32, n_layer=2, n_head=2, max_seq_len=8)
    engine = dg.Engine(model, dg.nn.CrossEntropyLoss(), dg.optim.AdamW(1e-3),
                       # ZeRO's states split, the search no longer gathers weights here
                       strategy=dg.Strategy(auto_mode="full", sharding=False),
                       cluster=dg.Cluster.local(4))
    plan = engine.prepare(*DataLoader(CountingSequences(64, 8, 32), 32).specs(1))
    (tokens, *_) = plan.program.inputs
    split = tuple(tokens.dist_attr.spec.entry(0))
    assert split, "the search no longer splits the batch: pick another case"
    pic = picture(plan)
    assert pic.stages[0].batch == split
    weights = {f"{x.name}.{w.name}": w for x in pic.stages[0].layers for w in x.weights}
    gathered = {p.value for p in plan.reshards()
                if any(s.kind == "all_gather" for s in p.steps) and
                plan.program.ops[p.anchor].role == "forward"}
    assert any(name in gathered for name in weights)       # the case the issue names
    for name, w in weights.items():
        assert any("gathered to use" in what for _, what in w.splits()) == (name in gathered)


def test_plot_writes_a_picture(tmp_path):
    plan, _ = staged_gpt_plan()
    plan.plot(tmp_path / "plan.png")
    assert (tmp_path / "plan.png").read_bytes()[:8] == PNG
    plan.plot(tmp_path / "plan.svg")
    assert b"<svg" in (tmp_path / "plan.svg").read_bytes()[:400]


def test_distgraph_plan_draws_the_plan_of_a_script(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "distgraph.cli", "plan", "-n", "4",
                           str(ROOT / "tutorials" / "02_spmd_gpt.py"), "--plot",
                           str(tmp_path / "p.png"), "--", "--steps", "2"],
                          capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == f"wrote {tmp_path / 'p.png'}"
    assert (tmp_path / "p.png").read_bytes()[:8] == PNG
