"""Recomputation chosen per stage by the stage search (passes/search/stages/
recompute_stages.py, issues #50, #63): on a cluster whose memory forces it, the search
recomputes on the first stages (1F1B keeps the most micro-batches in flight there) and
not on the last, the plan fits, the search's figures are the estimate's, and it is
faster than the plan recomputing on every stage (planned here as the oracle); with room
nothing recomputes. The plan's strategy names each layer's recomputation
(``Strategy(recompute=[(path, "selective"), path, ...])``): saved and loaded it is the
same plan, and it trains as serial training on 4 real MPI ranks (float64). A block's
recomputation changes the bytes a rank holds as the estimate says."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi_scripts"))

import distgraph as dg  # noqa: E402
from distgraph.errors import DoesNotFit  # noqa: E402
from distgraph.ir import is_recomputed  # noqa: E402
from distgraph.passes.cost.fit import overflows  # noqa: E402
from distgraph.plan.savers import SaverChoice, stage_recomputation  # noqa: E402
from distgraph.units import GB  # noqa: E402

import plan_file_training as T  # noqa: E402
import plans as P  # noqa: E402
import search_cases as S  # noqa: E402

LAYERS = 4
# bytes per device (float64): tests/plans.py's 4-block GPT in 4 micro-batches peaks at
# 780 KiB on stage 0 without recomputation; at this limit no plan fits without it, and
# the last stages have room
TIGHT = 6.0e5
SCRIPT = Path(__file__).parent / "mpi_scripts" / "plan_file_training.py"
ROOT = Path(__file__).resolve().parents[1]


def line_data(memory_bytes: float) -> dict:
    """4 alike devices of ``memory_bytes`` on slow links (tests/test_fitting.py's), on
    this host (``distgraph run --cluster`` starts the ranks where the file says)."""
    data = S.line_cluster_data(4, bandwidth=0.1, device=dict(S.DEVICE,
                                                             memory=memory_bytes / GB))
    data["machines"][0]["hostname"] = "localhost"
    return data


def specs():
    return dg.app.data.DataLoader(P.Dataset("gpt"), P.BATCH).specs(1)


def planned(memory_bytes: float, **options):
    """The 4-block GPT planned under ``Strategy(auto_mode="full", pipeline=True,
    micro_batches=4, **options)`` (tests/mpi_scripts/plan_file_training.py's) on 4
    devices of ``memory_bytes``."""
    cluster = dg.Cluster.from_dict(line_data(memory_bytes))
    model = P.build_model("gpt", seed=0, dims={**P.GPT_DIMS, "n_layer": LAYERS})
    strategy = dg.Strategy(**{**vars(T.FULL), **options})
    engine = dg.Engine(model, P.loss_fn("gpt"), P.make_optimizer("adamw"), cluster=cluster,
                       strategy=strategy)
    return engine.prepare(*specs()), cluster


@pytest.fixture(scope="module")
def tight():
    """(the searched plan at TIGHT, its cluster), float64."""
    before = dg.get_default_dtype()
    dg.set_default_dtype("float64")
    try:
        return planned(TIGHT)
    finally:
        dg.set_default_dtype(before)


def test_where_memory_forces_it_the_first_stages_recompute_and_the_last_do_not(tight,
                                                                                 float64):
    plan, cluster = tight
    assert not overflows(plan.estimate, cluster, None)
    with pytest.raises(DoesNotFit):         # no plan without recomputation fits
        planned(TIGHT, recompute=False)
    kinds = stage_recomputation(plan)
    assert len(kinds) >= 2 and kinds[0] is not False and kinds[-1] is False
    # the blocks of the stages that recompute are the ones the strategy names
    copied = {op.layer.split(".")[1] for op in plan.program.ops if is_recomputed(op)}
    named = {(e if isinstance(e, str) else e[0]).split(".")[1] for e in plan.strategy.recompute}
    assert copied == named and "0" in named and str(LAYERS - 1) not in named
    # the search priced the plan it chose, stages without recomputation included
    assert plan.search.step_time == pytest.approx(plan.estimate.step_time, rel=0.01)
    assert plan.search.peak_memory == pytest.approx(plan.estimate.peak_memory, rel=0.01)
    # the oracle: the plan recomputing on every stage, searched as asked, is slower
    every, _ = planned(TIGHT, recompute=kinds[0])
    # a value the user gives runs on every stage: the search chooses per stage only
    # where recomputation is left to it
    assert every.strategy.recompute == kinds[0]
    assert set(stage_recomputation(every)) == {kinds[0]}
    assert not overflows(every.estimate, cluster, None)
    assert plan.estimate.step_time < every.estimate.step_time
    note = next(c for c in plan.savers if c.option == "recompute")
    assert note.value == plan.strategy.recompute and note.stages == kinds
    assert note.seconds == plan.estimate.step_time
    # what else was priced on every stage did not fit: none, and less than it recomputes
    assert note.others[0][0] is False and all(p[2] is None for p in note.others)
    text = plan.explain()
    assert "per stage, as the stage search chose: stage" in text
    assert "without recomputation" in text.split("per stage")[1].splitlines()[0]


def test_each_stage_is_priced_as_the_estimate_prices_its_process(tight, float64):
    """The search prices a stage without recomputation on the program without it (the
    same layouts, the backward reading the Values the forward kept): each stage's
    seconds per micro-batch within 0.3% of the estimate's process there, and its memory
    with its micro-batches in flight within 1% of that process's peak. Oracle: the
    estimate of the plan the search made (cost/estimate.price_process). The last stage
    (the head and the loss) is left out of the seconds: the search prices it 0.9% above
    the estimate with every stage recomputing too, which this does not change."""
    from distgraph.passes.cost.estimate import price_process

    plan, cluster = tight
    M, kinds = plan.micro_batches, stage_recomputation(plan)
    peaks = {p.process: p.peak_memory for p in plan.estimate.processes}
    assert False in kinds[:-1] and len(set(kinds)) == 2
    for s, (stage, mesh) in enumerate(zip(plan.search.stage_plan.stages, plan.stages)):
        figures = [price_process(plan, pid, cluster) for pid in mesh.process_ids]
        est = max((p.compute + p.communication - update) / M for p, update in figures)
        if s < len(plan.stages) - 1:
            assert stage.time - stage.update / M == pytest.approx(est, rel=0.003)
        assert stage.memory * GB == pytest.approx(max(peaks[p] for p in mesh.process_ids),
                                                  rel=0.01)


def test_with_room_no_stage_recomputes(float64):
    plan, cluster = planned(1e12)
    assert plan.strategy.recompute is False
    assert not any(is_recomputed(op) for op in plan.program.ops)
    note = next(c for c in plan.savers if c.option == "recompute")
    assert note.value is False and note.stages == ()      # nothing to choose per stage
    # the stage DP with memory unlimited found no faster plan: recomputation not priced
    assert plan.search.memory_binds is False
    assert note.others == () and "memory held no faster plan back" in note.why
    # the oracle: the scores recomputed, searched as asked, are slower
    selective, _ = planned(1e12, recompute="selective")
    assert plan.estimate.step_time < selective.estimate.step_time


def test_where_memory_binds_at_the_first_count_none_is_not_walked_on(float64):
    """With the micro-batch count searched too, the search without recomputation stops at
    the first count it prices where memory holds that plan back (passes/fitting.py,
    MemoryBinds); the attention scores are planned next and win, so the counts after the
    first are not walked without recomputation. Oracle: the plan without recomputation
    planned in full (every count the walk looks at, its budget rounds) is slower."""
    plan, cluster = planned(7.5e5, micro_batches=None)
    assert not overflows(plan.estimate, cluster, None)
    assert any(kind is not False for kind in stage_recomputation(plan))
    note = next(c for c in plan.savers if c.option == "recompute")
    (stopped,) = [o for o in note.others if o[0] is False]
    assert stopped[1] is None and stopped[2] > plan.estimate.step_time
    assert "at the first micro-batch count priced" in plan.explain()
    walked, _ = planned(7.5e5, micro_batches=None, recompute=False)
    assert not overflows(walked.estimate, cluster, None)
    assert plan.estimate.step_time < walked.estimate.step_time


def test_the_per_stage_plan_saved_and_loaded_is_the_same_plan(tight, float64, tmp_path):
    plan, cluster = tight
    path = tmp_path / "plan.json"
    plan.save(path)
    held = json.loads(path.read_text())["strategy"]["recompute"]
    assert isinstance(held, list) and tuple(e if isinstance(e, str) else tuple(e)
                                            for e in held) == plan.strategy.recompute
    model = P.build_model("gpt", seed=0, dims={**P.GPT_DIMS, "n_layer": LAYERS})
    engine = dg.Engine(model, P.loss_fn("gpt"), P.make_optimizer("adamw"), cluster=cluster,
                       strategy=T.FULL, plan=path)
    loaded = engine.prepare(*specs())
    assert loaded.strategy == plan.strategy and loaded.search is None
    assert loaded.estimate.step_time == plan.estimate.step_time
    assert [p.peak_memory for p in loaded.estimate.processes] == \
        [p.peak_memory for p in plan.estimate.processes]
    assert loaded.stages == plan.stages and loaded.program.pretty() == plan.program.pretty()


@pytest.mark.slow
@pytest.mark.mpi
def test_the_per_stage_plan_trains_on_four_ranks_as_serially(tight, float64, tmp_path):
    """Saved here, loaded by 4 MPI ranks under ``distgraph run --cluster --plan``: the
    same plan, and losses and parameters equal serial training (float64, 1e-10)."""
    plan, _ = tight
    path, resources = tmp_path / "plan.json", tmp_path / "line4.json"
    plan.save(path)
    resources.write_text(json.dumps(line_data(TIGHT)))
    proc = subprocess.run(
        [sys.executable, "-m", "distgraph.cli", "run", "-n", "4", "--cluster", str(resources),
         "--plan", str(path), str(SCRIPT), "full", str(tmp_path), str(LAYERS)],
        env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
        timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PLANFILE-RESULT ")]
    assert len(lines) == 1, proc.stdout[-3000:]
    got = json.loads(lines[0].split(" ", 1)[1])
    assert not got["searched"] and got["step_time"] == plan.estimate.step_time
    assert got["program"] == hashlib.sha256(plan.program.pretty().encode()).hexdigest()
    reference = P.train(P.build_model("gpt", 0, dims={**P.GPT_DIMS, "n_layer": LAYERS}), "gpt")
    err = P.compare((got["losses"], dict(np.load(tmp_path / "params.npz"))), reference,
                    "float64")
    assert err["steps"] == P.STEPS
    assert err["loss"] < P.TOLERANCE["float64"] and err["param"] < P.TOLERANCE["float64"], err


def test_a_blocks_recomputation_holds_what_the_estimate_says(float64):
    """Per layer: block 0's attention scores and block 1 whole recomputed. The bytes a
    rank's allocator hands out at its peak are the plan's estimate (tracemalloc; the
    kernels' workspace included) with and without, and each recomputation keeps fewer
    activations for the backward than the one before it."""
    data = P.Dataset("gpt", n=32, dims=dict(P.GPT_DIMS, max_seq_len=32), batch=16)
    held, saved = {}, {}
    options = (False, (("blocks.0", "selective"),), (("blocks.0", "selective"), "blocks.1"))
    for option in options:
        dg.seed(0)
        model = dg.nn.GPT(vocab_size=64, d_model=32, n_layer=2, n_head=4, max_seq_len=32)
        engine = dg.Engine(model, dg.nn.CrossEntropyLoss(), dg.optim.AdamW(1e-3),
                           cluster=dg.Cluster.local(1), strategy=dg.Strategy(recompute=option))
        history = P.traced_fit(engine, data, batch_size=16, epochs=1, verbose=0)
        held[option] = history.allocated[-1]
        saved[option] = engine.plan().estimate.processes[0].saved_activations
        assert held[option] == pytest.approx(engine.plan().estimate.peak_memory, rel=0.05)
        assert engine.plan().strategy.recompute == option
    # block 1 recomputed whole keeps less for the backward; the peak (block 0's backward,
    # with a GELU gradient's workspace) stays where it was
    assert saved[options[2]] < saved[options[1]] < saved[options[0]]
    assert held[options[2]] <= 1.01 * held[options[1]] and held[options[1]] < held[options[0]]


def test_recompute_per_layer_is_one_hashable_value_and_a_bad_entry_is_refused():
    a = dg.Strategy(recompute=["blocks.0", ["blocks.1", "selective"], ("blocks.2", True)])
    assert a.recompute == ("blocks.0", ("blocks.1", "selective"), "blocks.2")
    assert a == dg.Strategy(recompute=("blocks.0", ("blocks.1", "selective"), "blocks.2"))
    assert len({a, dg.Strategy(recompute=a.recompute)}) == 1
    for bad in ([("blocks.0", "scores")], [("blocks.0",)], [""], [3], []):
        with pytest.raises(dg.DistGraphError, match="paired with its kind"):
            dg.Strategy(recompute=bad)


def test_a_layer_without_attention_scores_is_refused_by_name():
    model = P.build_model("gpt", seed=0)
    engine = dg.Engine(model, P.loss_fn("gpt"), P.make_optimizer("adamw"),
                       cluster=dg.Cluster.local(1),
                       strategy=dg.Strategy(recompute=[("blocks.0", "selective"),
                                                       ("lm_head", "selective")]))
    with pytest.raises(dg.PlanError, match="layer 'lm_head' computes no attention scores"):
        engine.prepare(*specs())


def test_the_note_says_per_stage_what_each_stage_got():
    note = SaverChoice("recompute", (("blocks.0", "selective"), ("blocks.1", "selective")),
                       9e5, 1e6, 0.02, ((False, None, None), ("selective", 9.5e5, 0.025)),
                       ("selective", "selective", False, False))
    lines = note.lines()
    assert lines[0].startswith("recompute=per layer (the attention scores of 2 layers) chosen "
                               "by the search: peak")
    assert lines[1] == ("  per stage, as the stage search chose: "
                        "stages 0-1 recomputing the attention scores; stages 2-3 without "
                        "recomputation")
    assert lines[3].startswith("  recomputing the attention scores on every stage: peak")
    assert note.to_dict()["stages"] == ["selective", "selective", False, False]
