"""Strategy(auto_mode="full", pipeline=True): layers of equal FLOPs on equal devices
make equal stages, a device twice as fast takes twice the layers, the layer cut is
Alpa's DP (against brute force), and the searched pipelines train exactly as serial
training does on the micro-batched runtime (SimulatedWorld threads, float64)."""

import itertools
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402
from distgraph.passes.search.stages.layers import _cut  # noqa: E402
from distgraph.program_builder import build_program  # noqa: E402
from distgraph.runtime.comm.simulated import SimulatedWorld  # noqa: E402

import plans as P  # noqa: E402
import search_cases as S  # noqa: E402

BATCH = 16


def mlp_dims(width=64):
    return dict(seq=4, d_in=width, hidden=width, d_out=width)


def mlp(layers, width=64):
    dg.seed(0)
    return P.PlanMLP(mlp_dims(width), layers)


def program(model, kind="mlp", dims=None):
    data = P.Dataset(kind, dims=dims, batch=BATCH)
    ins, labels = dg.app.data.DataLoader(data, BATCH).specs(1)
    return build_program(model, ins, labels, P.loss_fn(kind), dg.optim.AdamW(0.01))


def pipeline(micro_batches=8):
    return dg.Strategy(auto_mode="full", pipeline=True, micro_batches=micro_batches)


def stage_layers(plan) -> list:
    """Per stage, the model layers whose forward matmul it runs."""
    return [sorted({op.layer for op in plan.program.ops if op.type == "matmul"
                    and op.role == "forward" and op.dist_attr.mesh == mesh})
            for mesh in plan.stages]


def test_equal_layers_on_equal_devices_make_equal_stages():
    # wide layers on slow links: a weight's reduction over 4 devices is dearer than a
    # micro-batch's rows sent between two stages, a stage of one layer idles too long
    # in the pipeline's fill: two stages of two layers each (one stage, replicated or
    # split, is the faster plan below 0.1 GB/s, where the sends between stages, priced
    # since the stage DP prices them, cost more)
    cluster = S.line_cluster(4, bandwidth=0.1, device=S.FLOPS_ONLY)
    plan = dg.passes.plan(program(mlp(4, 1024), dims=mlp_dims(1024)), pipeline(), cluster)
    assert stage_layers(plan) == [["fc1", "fc2"], ["fc3", "fc4"]]
    assert [m.size for m in plan.stages] == [2, 2]
    assert plan.micro_batches == 8
    assert plan.search.status == "optimal" and len(plan.search.stages) == 2


def test_a_mesh_twice_as_fast_takes_twice_the_layers():
    cluster = S.two_speed_cluster(ratio=2.0)
    plan = dg.passes.plan(program(mlp(6), dims=mlp_dims()), pipeline(), cluster)
    fast = cluster.device_meshes[0].ids[0]
    sizes = {}
    for mesh, layers in zip(plan.stages, stage_layers(plan)):
        (pid,) = mesh.process_ids
        sizes[cluster.devices[plan.ranks(pid)].global_id] = len(layers)
    assert sizes[fast] == 4 and sum(sizes.values()) == 6
    # explain() names the devices each stage's search ran for, not the search's own
    # process numbering (which starts at 0 on every stage)
    text = str(plan.search)
    for s, stage in enumerate(plan.search.stage_plan.stages):
        assert f"stage {s} search on devices {list(stage.device_ids)} (mesh shape " in text


def brute_cut(flops, received, count, delta):
    """Every cut of len(flops) ops into ``count`` layers within the FLOP limit; the least
    (largest received, sum of squares)."""
    n, limit = len(flops), (1 + delta) * sum(flops) / count
    best = None
    for bounds in itertools.combinations(range(1, n), count - 1):
        edges = (0,) + bounds + (n,)
        layers = [(a, b - 1) for a, b in zip(edges, edges[1:])]
        sizes = [sum(flops[a:b + 1]) for a, b in layers]
        if max(sizes) > limit * (1 + 1e-12):
            continue
        key = (max(received[a, b] for a, b in layers), sum(x * x for x in sizes))
        if best is None or key < best[0]:
            best = (key, layers)
    return None if best is None else best[0]


@pytest.mark.parametrize("seed", range(6))
def test_layer_cut_is_alpas_dp(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(4, 9))
    flops = rng.integers(0, 5, size=n).astype(float)
    flops[0] += 1
    upper = np.triu(rng.integers(0, 6, size=(n, n)).astype(float))
    received = np.maximum.accumulate(upper, axis=1)        # grows with the layer's end
    for count in range(1, n + 1):
        cut = _cut(flops, received, count, 0.25)
        expected = brute_cut(flops, received, count, 0.25)
        if expected is None:
            assert cut is None
            continue
        sizes = [flops[a:b + 1].sum() for a, b in cut]
        got = (max(received[a, b] for a, b in cut), sum(x * x for x in sizes))
        assert got == pytest.approx(expected)



def train(model, kind, comm, cluster, dims=None, strategy=None):
    engine = dg.Engine(model, P.loss_fn(kind), P.make_optimizer("adamw"), cluster=cluster,
                       strategy=strategy or pipeline(4), communicator=comm)
    data = P.Dataset(kind, dims=dims, batch=BATCH)
    with P.BUILD_LOCK:
        engine.prepare(*dg.app.data.DataLoader(data, BATCH).specs(1))
    history = engine.fit(data, batch_size=BATCH, epochs=1, verbose=0)
    return history.losses, engine.state_dict(), engine.plan()


@pytest.mark.parametrize("case", ["mlp4", "gpt", "gpt_blocks"])
def test_searched_pipelines_train_like_serial(case, float64):
    """gpt_blocks: four identical blocks, so the stage search costs runs of blocks
    (passes/search/stages/runs.py) and writes the representative block's layouts onto all."""
    strategy = None
    if case == "mlp4":
        # two device meshes, a stage on each (on one mesh of alike devices one stage of
        # the four layers is faster, since the stage DP prices the sends between stages)
        kind, n, dims = "mlp", 2, mlp_dims()
        cluster = S.two_speed_cluster(ratio=1.5)
        build = lambda: mlp(4)                                       # noqa: E731
    elif case == "gpt_blocks":
        kind, n, dims = "gpt", 2, dict(P.GPT_DIMS, n_layer=4)
        # at 0.01 GB/s the blocks' sends between two stages (priced since the stage DP
        # prices them) cost more than one stage; at 0.1 two stages win
        cluster = S.line_cluster(2, bandwidth=0.1)
        build = lambda: P.build_model("gpt", dims=dims, dropout=0.1)  # noqa: E731
    else:
        kind, n, dims = "gpt", 2, None
        # two device meshes, a stage on each (on one mesh of two alike devices one stage
        # is faster)
        cluster = S.two_speed_cluster(ratio=1.5)
        build = lambda: P.build_model("gpt")                         # noqa: E731
    serial = dg.Engine(build(), P.loss_fn(kind), P.make_optimizer("adamw"))
    data = P.Dataset(kind, dims=dims, batch=BATCH)
    reference = (serial.fit(data, batch_size=BATCH, epochs=1, verbose=0).losses,
                 serial.state_dict())
    models = [build() for _ in range(n)]
    results = SimulatedWorld(n, timeout=120).run(
        lambda comm: train(models[comm.rank], kind, comm, cluster, dims, strategy))
    plan = results[0][2]
    assert len(plan.stages) > 1 and plan.micro_batches > 1
    assert (plan.search.layering.blocks is not None) == (case == "gpt_blocks")
    for rank, (losses, params, _) in enumerate(results):
        errors = P.compare((losses, params), reference, "float64")
        assert errors["steps"] == len(reference[0])
        assert errors["loss"] <= 1e-10 and errors["param"] <= 1e-10, (rank, errors)


def test_a_searched_pipeline_with_zero_shards_the_states_and_trains_like_serial(float64):
    # Strategy(sharding=True) as a user writes it (no sharding_mesh_dim: the search names
    # the dims): the states of the updates are split over each stage's data-parallel dim
    dims = dict(P.GPT_DIMS, n_layer=4)
    build = lambda: P.build_model("gpt", dims=dims)                  # noqa: E731
    serial = dg.Engine(build(), P.loss_fn("gpt"), P.make_optimizer("adamw"))
    data = P.Dataset("gpt", dims=dims, batch=BATCH)
    reference = (serial.fit(data, batch_size=BATCH, epochs=1, verbose=0).losses,
                 serial.state_dict())
    strategy = dg.Strategy(auto_mode="full", pipeline=True, micro_batches=2, sharding=True)
    models = [build() for _ in range(4)]
    results = SimulatedWorld(4, timeout=120).run(
        lambda comm: train(models[comm.rank], "gpt", comm, S.grid_cluster(), dims, strategy))
    plan = results[0][2]
    assert len(plan.stages) > 1
    split = [op for op in plan.program.ops if op.role == "optimize" and len(op.inputs) > 2
             and op.inputs[2].dist_attr.mesh.dim_size("x") > 1
             and "x" in str(op.inputs[2].dist_attr.spec)]
    assert split                        # ZeRO over the search's data-parallel dim
    for rank, (losses, params, _) in enumerate(results):
        errors = P.compare((losses, params), reference, "float64")
        assert errors["steps"] == len(reference[0])
        assert errors["loss"] <= 1e-10 and errors["param"] <= 1e-10, (rank, errors)
