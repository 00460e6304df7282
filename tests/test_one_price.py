"""One price (issue #63): what the search priced for the plan it chose is what the plan's
estimate says of it. The search report's ``step_time`` and ``peak_memory`` (bytes, the
fullest process) equal ``plan.estimate``'s within 1% over a sample of automatic plans:
searches on one mesh and stage searches, with and without micro-batches, ZeRO, and the
savers left to the search. The oracle is the estimate, which walks every process's local
program after completion, partition and reshard insertion; the search prices strategies
per op on a representative mesh before any of that."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import search_cases as S

import distgraph as dg
from distgraph.passes.cost.stage import step_time
from distgraph.passes.pipeline.schedule import chain, make_schedule, v_place
from distgraph.plan.replay import replay
from distgraph.program_builder import build_program
from distgraph.units import GB

CLUSTERS_DIR = Path(__file__).resolve().parents[1] / "resources" / "clusters"
TOLERANCE = 0.01
SAVERS_GIVEN = dict(recompute=False, sharding=False, sequence_parallel=False)
EMULATED = "emulated_2x2.yaml"
CASES = {
    # name: (blocks, batch, cluster file or None for Cluster.local(4), strategy fields)
    "one mesh": (4, 16, None, dict(SAVERS_GIVEN)),
    "one mesh, ZeRO": (4, 16, None, dict(SAVERS_GIVEN, sharding=True)),
    "one mesh, 4 micro-batches": (4, 16, None, dict(SAVERS_GIVEN, micro_batches=4)),
    "stages, 4 micro-batches": (4, 16, EMULATED, dict(SAVERS_GIVEN, pipeline=True,
                                                       micro_batches=4)),
    "stages, 8 micro-batches": (8, 32, EMULATED, dict(SAVERS_GIVEN, pipeline=True,
                                                       micro_batches=8)),
    "stages, ZeRO": (8, 32, EMULATED, dict(SAVERS_GIVEN, pipeline=True, micro_batches=8,
                                           sharding=True)),
    "stages, the default strategy": (8, 32, EMULATED, dict(pipeline=True)),
    "stages, selective recomputation": (8, 32, EMULATED, dict(
        SAVERS_GIVEN, pipeline=True, micro_batches=8, recompute="selective")),
    "stages, whole blocks recomputed": (8, 32, EMULATED, dict(
        SAVERS_GIVEN, pipeline=True, micro_batches=8, recompute=True)),
    "stages, reductions after the backward": (8, 32, EMULATED, dict(
        SAVERS_GIVEN, pipeline=True, micro_batches=8, overlap=False)),
    # GPipe keeps every micro-batch in flight on every stage (the search counted 1F1B's:
    # 4.47 MB against 7.56)
    "stages, GPipe's schedule": (8, 32, EMULATED, dict(SAVERS_GIVEN, pipeline=True,
                                                       micro_batches=8, schedule="FThenB")),
    # 16 A100s: the backward hides part of the data-parallel reductions (the search
    # priced every one whole: +1.5% on the step before)
    "one mesh, reductions hidden behind the backward": (1, 32, "gpu_2x8.yaml",
                                                        dict(SAVERS_GIVEN), 512, 128),
}


def gpt_program(blocks, batch, d_model=64, seq=16, dropout=0.0, vocab=128):
    dg.seed(0)
    model = dg.nn.GPT(vocab_size=vocab, d_model=d_model, n_layer=blocks, n_head=4,
                      max_seq_len=seq, dropout=dropout)
    return build_program(model, [dg.InputSpec([batch, seq], "int64", "tokens")],
                         [dg.InputSpec([batch, seq], "int64", "labels")],
                         loss=dg.nn.CrossEntropyLoss(), optimizer=dg.optim.AdamW(1e-3))


def planned(blocks, batch, cluster_file, fields, d_model=64, seq=16, dropout=0.0, vocab=128):
    built = gpt_program(blocks, batch, d_model, seq, dropout, vocab)
    cluster = dg.Cluster.from_file(CLUSTERS_DIR / cluster_file) if cluster_file else \
        dg.Cluster.local(4)
    return dg.passes.plan(built, dg.Strategy(auto_mode="full", **fields), cluster, ranks=())


@pytest.mark.parametrize("name", list(CASES))
def test_the_search_prices_its_plan_as_the_estimate_does(name):
    plan = planned(*CASES[name])
    report, est = plan.search, plan.estimate
    assert report.step_time == pytest.approx(est.step_time, rel=TOLERANCE), name
    assert report.peak_memory == pytest.approx(est.peak_memory, rel=TOLERANCE), name


def test_a_zero_bubble_pipeline_is_priced_with_its_weight_gradients_in_the_bubble():
    """Under ZB the search prices the step with each stage's weight-gradient seconds
    (its parts' W ops, as the schedule runs them in the fill and drain), as the estimate
    does from the tasks. Its memory is not asserted: the search counts 1F1B's
    micro-batches in flight, not what a micro-batch keeps from its I to its W (2.3%
    under the estimate here, which replays the schedule's actions)."""
    fields = dict(SAVERS_GIVEN, pipeline=True, micro_batches=8)
    zb = planned(8, 32, EMULATED, dict(fields, schedule="ZB"))
    report, est = zb.search, zb.estimate
    assert report.step_time == pytest.approx(est.step_time, rel=TOLERANCE)
    # the weight gradients fill part of the bubble: the step is below 1F1B's
    assert report.step_time < planned(8, 32, EMULATED, fields).search.step_time


def test_the_search_chooses_knowing_what_the_backward_hides():
    """Issue #64: with overlap on (the default), the search prices the gradient buckets
    as the runtime runs them and chooses by it. Oracle: the estimate of its plan against
    that of the plan it chooses with overlap off, run with overlap on (the same layouts,
    their reductions bucketed as well): GPT of 4 blocks on 16 A100s, 5.40 against 5.55
    ms (the search said 6.83 ms of that plan before)."""
    from distgraph.passes.search import choose

    built = gpt_program(4, 32, d_model=512, seq=128)
    cluster = dg.Cluster.from_file(CLUSTERS_DIR / "gpu_2x8.yaml")
    aware = dg.passes.plan(built, dg.Strategy(auto_mode="full", **SAVERS_GIVEN), cluster,
                           ranks=())
    blind = choose(built, dg.Strategy(auto_mode="full", overlap=False, **SAVERS_GIVEN), cluster)
    blind = dg.passes.plan(built, cluster=cluster, ranks=(), choice=dataclasses.replace(
        blind, strategy=dataclasses.replace(blind.strategy, overlap=True)))
    assert aware.search.hidden > 0
    assert aware.search.step_time == pytest.approx(aware.estimate.step_time, rel=TOLERANCE)
    # explain() says the step the search priced, not only its objective
    assert f"{aware.search.step_time * 1e3:.4f} ms a step" in aware.explain()
    assert aware.estimate.step_time < 0.99 * blind.estimate.step_time


@pytest.mark.parametrize("name", ["one mesh", "stages, 8 micro-batches"])
def test_the_search_prices_a_mesh_of_unlike_devices_as_its_slowest_process(name, tmp_path):
    """One rank of the emulated 2 x 2 computes at 80% of the others' rate, as the ranks of a
    calibrated machine differ: the step waits for it. Priced on the mesh's first device
    (as the searches did), the figures part by 2-5%."""
    blocks, batch, _, fields = CASES[name][:4]
    text = (CLUSTERS_DIR / EMULATED).read_text()
    fast = "{global_id: 3, local_id: 1, type: CPU, model: cpu, memory: 4, gflops: " \
        "{float32: 50, float64: 25}}"
    assert fast in text
    path = tmp_path / "unlike.yaml"
    path.write_text(text.replace(fast, fast.replace("50", "40").replace("25", "20")))
    plan = planned(blocks, batch, path, fields)
    assert plan.search.step_time == pytest.approx(plan.estimate.step_time, rel=TOLERANCE)
    assert plan.search.peak_memory == pytest.approx(plan.estimate.peak_memory, rel=TOLERANCE)


def test_the_readmes_strategy_on_local_ranks_whose_steps_cost_software(tmp_path):
    """The README's strategy on 4 local ranks whose reshard steps cost what a calibrated
    machine's do (hundreds of microseconds each, as ``distgraph cluster calibrate``
    measures them on CPU ranks): one stage, on a logical mesh of two dims. Every
    process holds its loss whole already, so nothing moves it (the partitioner's
    rule); the search priced its fetch as a send between the two meshes (+0.9% on the
    step, on this machine's calibration)."""
    line = "gflops: {float32: 50, float64: 25}}"
    text = (CLUSTERS_DIR / "local4.yaml").read_text()
    assert text.count(line) == 4
    path = tmp_path / "local4_software.yaml"
    path.write_text(text.replace(line, line[:-1] + ", reshard_overhead: {send_recv: 420, "
                                 "all_reduce: 670, all_gather: 420, reduce_scatter: 660}}"))
    plan = planned(4, 16, path, dict(pipeline=True))
    assert len(plan.stages) == 1 and len(plan.stages[0].mesh.shape) == 2
    assert plan.search.step_time == pytest.approx(plan.estimate.step_time, rel=TOLERANCE)
    assert plan.search.peak_memory == pytest.approx(plan.estimate.peak_memory, rel=TOLERANCE)


def test_the_stage_search_prices_what_the_backward_hides_as_the_one_mesh_search_does(tmp_path):
    """Issue #64: ``Strategy(auto_mode="full", pipeline=True)``, the newcomer's strategy,
    on 4 local ranks whose collectives cost software as a calibrated machine's do: a
    bucket's reductions meet once, so most of the 52 gradient reductions' cost is hidden
    in buckets. The stage search priced every reduction whole and planned 1.79 x the
    one-mesh search's step (51.9 against 29.0 ms); its parts' searches and its stages
    now price the buckets, and the step is within 10% of the one-mesh plan's (30.6 ms),
    the search's figure the estimate's."""
    line = "gflops: {float32: 50, float64: 25}}"
    path = tmp_path / "local4_software.yaml"
    path.write_text((CLUSTERS_DIR / "local4.yaml").read_text().replace(
        line, line[:-1] + ", reshard_overhead: {send_recv: 420, all_reduce: 670, "
        "all_gather: 420, reduce_scatter: 660}}"))
    staged = planned(4, 16, path, dict(pipeline=True), d_model=128, seq=32)
    whole = planned(4, 16, path, {}, d_model=128, seq=32)
    assert staged.search.step_time == pytest.approx(staged.estimate.step_time, rel=TOLERANCE)
    assert whole.search.hidden > 0.5 * whole.estimate.step_time
    assert staged.estimate.step_time < 1.1 * whole.estimate.step_time


@pytest.mark.parametrize("schedule", ["1F1B", "ZB", "FThenB"])
def test_the_stages_of_a_model_without_identical_blocks_are_priced_as_the_estimate_does(
        schedule):
    """The generic stage DP (a model without identical blocks): each stage priced by the
    accountant with its sends to the stage beside it, restated where it is placed. On
    the 2 x 2 whose second machine is half as fast, the MLP splits over the machines,
    and the search's step and peak are the estimate's (before: -25% on the step), under
    each schedule (ZB's step with its stages' weight gradients: +1.2% without them)."""
    built = S.mlp_program(batch=256, hidden=512)
    plan = dg.passes.plan(built, dg.Strategy(auto_mode="full", pipeline=True, micro_batches=8,
                                             schedule=schedule, **SAVERS_GIVEN),
                          dg.Cluster.from_file(CLUSTERS_DIR / "emulated_mixed_2x2.yaml"),
                          ranks=())
    assert len(plan.stages) > 1
    assert plan.search.step_time == pytest.approx(plan.estimate.step_time, rel=TOLERANCE)
    assert plan.search.peak_memory == pytest.approx(plan.estimate.peak_memory, rel=TOLERANCE)


def test_a_one_mesh_plan_with_micro_batches_counts_their_gradients_beside_the_buffers():
    """Gradient accumulation on one mesh: a later micro-batch's gradient is live beside
    the buffer the first one's became until it is added (the runtime's count; the
    search's liveness held it once: -11% on the peak before)."""
    built = S.mlp_program(batch=256, hidden=512)
    plan = dg.passes.plan(built, dg.Strategy(auto_mode="full", micro_batches=8, **SAVERS_GIVEN),
                          dg.Cluster.from_file(CLUSTERS_DIR / EMULATED), ranks=())
    assert not plan.stages or len(plan.stages) == 1
    assert plan.search.step_time == pytest.approx(plan.estimate.step_time, rel=TOLERANCE)
    assert plan.search.peak_memory == pytest.approx(plan.estimate.peak_memory, rel=TOLERANCE)


def test_the_report_says_its_figures():
    plan = planned(*CASES["stages, 8 micro-batches"])
    figures = plan.search.to_dict()
    assert figures["step_time"] == plan.search.step_time > 0
    assert figures["peak_memory"] == plan.search.peak_memory > 0


def test_the_step_takes_the_updates_once_and_the_slowest_stage_per_micro_batch():
    """Oracle: the formula by hand. Three stages of 2, 3 and 2 ms per micro-batch, updates
    of 5, 1 and 1 ms once a step, 4 micro-batches: 7 + 3 x 3 + 5 ms. Interleaved (2 chunks
    per stage): the fill is half, the last micro-batch drains a chunk: 3.5 + 3.5 x 3 + 5.
    Stages that run 4, 2 and 4 micro-batches (an uneven split): 7 + max(3 x 2, 1 x 3,
    3 x 2) + 5."""
    times, updates = [2.0, 3.0, 2.0], [5.0, 1.0, 1.0]
    assert step_time(times, 4, updates=updates) == 7 + 3 * 3 + 5
    assert step_time(times, 4, virtual=2, updates=updates) == 3.5 + 3.5 * 3 + 5
    assert step_time(times, [4, 2, 4], updates=updates) == 7 + 6 + 5
    assert step_time(times, 4, schedule="FThenB", virtual=2) == 3.5 + 3 * 3


@pytest.mark.parametrize("schedule, virtual", [("ZB", 1), ("ZBV", 2), ("1F1B", 1),
                                               ("1F1B", 2)])
@pytest.mark.parametrize("stages, micro_batches", [(2, 4), (4, 8), (8, 16)])
def test_a_zero_bubble_step_is_the_replay_of_its_schedule(schedule, virtual, stages,
                                                           micro_batches):
    """Oracle: the replay of the schedule the runtime runs
    (:func:`~distgraph.plan.replay.replay` of :func:`make_schedule`'s orders, with each
    action's seconds). A zero-bubble schedule runs the weight gradients (W) in the
    fill and drain: on stages alike the accountant's step with each stage's W seconds is
    the replay's to the last bit, and 1F1B's is too; on stages 0.7-1.3 x apart, with W
    0.5-1.2 x the forward, both are within 15% of it (1F1B's form on such stages: up to
    19% over). Without W, ZB's step is priced as 1F1B's: above its replay."""
    rng = np.random.default_rng(stages * 100 + micro_batches)
    for trial in range(12):
        f = rng.uniform(0.7, 1.3, stages) if trial else np.ones(stages)
        i = f * (rng.uniform(0.8, 1.2, stages) if trial else 1.0)
        w = f * (rng.uniform(0.5, 1.2, stages) if trial else 1.0)
        problem = chain(stages, virtual, micro_batches, schedule)
        seconds = {}
        for c in range(problem.chunks):
            s = v_place(c, stages) if schedule == "ZBV" else c % stages
            seconds.update({(c, "F"): f[s] / virtual, (c, "B"): (i[s] + w[s]) / virtual,
                            (c, "I"): i[s] / virtual, (c, "W"): w[s] / virtual})
        replayed = replay(make_schedule(problem).orders, problem, seconds).makespan
        times = list(f + i + w)
        priced = step_time(times, micro_batches, virtual, schedule, weights=list(w))
        if trial == 0:
            assert priced == pytest.approx(replayed, rel=1e-12)
        else:
            assert priced == pytest.approx(replayed, rel=0.15)
        if schedule == "ZB":
            assert step_time(times, micro_batches, virtual, schedule) > replayed


@pytest.mark.parametrize("pipeline", [True, False])
def test_a_dropouts_output_is_freed_at_the_residual_add_and_its_mask_kept(pipeline):
    """A dropout's node makes two results: its output, read by the residual add only,
    and its mask, kept for the backward. The runtime frees the output at the add; the
    search's liveness held both to the backward (the peak +4.5% with stages, +2.6% on
    one mesh, before): a result is released where it is freed."""
    fields = dict(SAVERS_GIVEN, micro_batches=8, pipeline=pipeline)
    plan = planned(8, 32, EMULATED, fields, d_model=128, seq=64, dropout=0.1)
    assert any(op.type == "dropout" for op in plan.program.ops)
    assert plan.search.peak_memory == pytest.approx(plan.estimate.peak_memory, rel=0.002)
    assert plan.search.step_time == pytest.approx(plan.estimate.step_time, rel=TOLERANCE)


def test_a_zero_write_back_is_held_at_the_update_not_beside_the_activations():
    """A 4-block GPT of vocabulary 8,192 in two stages on the 2 x 8 A100 file, ZeRO on:
    the head stage's update gathers its large output weight back (ZeRO's write-back),
    when no micro-batch keeps activations. The search added that buffer to the
    activations' peak: the head stage's memory was 4.7% over the estimate's before.
    Oracle: the estimate's fullest process of each stage."""
    fields = dict(SAVERS_GIVEN, pipeline=True, micro_batches=8, sharding=True)
    plan = planned(4, 32, "gpu_2x8.yaml", fields, vocab=8192)
    assert plan.strategy.sharding and len(plan.stages) == 2
    for s, stage in enumerate(plan.search.stage_plan.stages):
        est = max(p.peak_memory for p in plan.estimate.processes if p.stage == s)
        assert stage.memory * GB == pytest.approx(est, rel=0.002), s
    assert plan.search.peak_memory == pytest.approx(plan.estimate.peak_memory, rel=0.002)


def test_a_boundary_between_unlike_stages_is_priced_as_it_runs():
    """A 4-block GPT on two DGX A100 nodes in 4 micro-batches: its first stage on a mesh
    of three dims (x, cp, y), the second on one of two. The stage DP prices a stage's
    boundary as if its neighbour were like it (half of its own Values' reshard); between
    unlike stages the plan reshards from the sender's layout on its devices to the
    receiver's on theirs (cost/boundary.between), and the chosen stages are priced so.
    Before, the search's seconds per micro-batch were 0.77% and -0.52% off the
    estimate's, its step -0.80%. Oracle: the estimate's slowest process of each stage,
    per micro-batch."""
    from distgraph.passes.cost.estimate import price_process
    from pin_search_outputs import recursive_gpt_plan

    plan, cluster = recursive_gpt_plan("pipeline on 2 nodes")
    assert len({len(mesh.shape) for mesh in plan.stages}) == 2
    M = plan.micro_batches
    for stage, mesh in zip(plan.search.stage_plan.stages, plan.stages):
        figures = [price_process(plan, pid, cluster) for pid in mesh.process_ids]
        est = max((p.compute + p.communication - update) / M for p, update in figures)
        assert stage.time - stage.update / M == pytest.approx(est, rel=0.003)
    assert plan.search.step_time == pytest.approx(plan.estimate.step_time, rel=0.003)
