"""MeshSlice (Nam et al.): the blocked slicing keeps every sub-shard on the same global
indices, matmul's rule offers the three dataflows' layouts when asked to, the K-sliced
kernel equals the unsliced matmul for every dataflow, K and mesh (and counts the bytes
the plan counts), plans use it where they say so and train like serial, the cost model
prices its pipeline, the search chooses it where slow links make overlap pay, and the
autotuner ranks mesh shapes and K by that model."""

import dataclasses
import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402
from distgraph.ops import meshslice as meshslice_op  # noqa: E402
from distgraph.ops.meshslice import (LocalMeshSlice, overlap, put_slice,  # noqa: E402
                                     take_slice)
from distgraph.passes.cost.formulas import collective_time, mpi_cuts, pipeline_time  # noqa: E402
from distgraph.passes.cost.prices import (Ring, Rings, best_overlap, device_rates,  # noqa: E402
                                          op_time, overlap_time, software_time)
from distgraph.passes.meshslice.slices import local_op  # noqa: E402
from distgraph.passes.meshslice.autotune import (BACKWARD, GEMMS, gemm_shapes,  # noqa: E402
                                                 stationary_dataflow)
from distgraph.registry import Overlap, TensorType  # noqa: E402
from distgraph.runtime.comm.simulated import SimulatedWorld  # noqa: E402
from distgraph.spmd import UNKNOWN, DimsSpec  # noqa: E402
from distgraph.spmd.meshslice import (SliceLayout, MatmulAxes, block_size, layout_of,  # noqa: E402
                                      layouts, slice_choices)

import meshslice_cases as C  # noqa: E402
import plans as P  # noqa: E402
import search_cases as S  # noqa: E402
from test_search import repeated_reshard_seconds  # noqa: E402

MESH = dg.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
EMULATED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "resources", "clusters", "emulated_2x2.yaml")


# ---- slicing ------------------------------------------------------------------------------

@pytest.mark.parametrize("length,parts", [(24, (2, 3)), (48, (4, 2)), (36, (3, 3)), (16, (1, 4))])
def test_sub_shard_k_of_every_member_holds_the_same_global_indices_under_both_splits(length,
                                                                                       parts):
    """Seed §3: slice k takes every K-th block; gathered over either split, the members'
    sub-shards k are the same global indices, in the same order."""
    index = np.arange(length)
    for k_slices in slice_choices(length, *parts):
        block = block_size(length, *parts, k_slices)
        assert all((length // (p * k_slices)) % block == 0 for p in parts)
        for k in range(k_slices):
            gathered = [np.concatenate([take_slice(np, shard, 0, k_slices, k, block)
                                        for shard in np.split(index, p)]) for p in parts]
            assert np.array_equal(gathered[0], gathered[1])
            assert np.array_equal(gathered[0], np.sort(gathered[0]))
        everything = np.concatenate([take_slice(np, index, 0, k_slices, k, block)
                                     for k in range(k_slices)])
        assert np.array_equal(np.sort(everything), index)


def test_slice_choices_are_the_common_divisors_of_both_shards():
    assert slice_choices(24, 2, 3) == (1, 2, 4)          # shards of 12 and 8
    assert slice_choices(64, 2, 2) == (1, 2, 4, 8, 16, 32)


def test_put_slice_writes_back_what_take_slice_takes():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(3, 24, 5))
    out = np.zeros_like(a)
    for k in range(4):
        put_slice(np, out, 1, 4, k, 2, take_slice(np, a, 1, 4, k, 2))
    assert np.array_equal(out, a)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("order_a,order_b", [("C", "C"), ("F", "C"), ("C", "F"), ("F", "F")])
def test_a_partial_gemm_adds_into_the_result_in_place_for_either_operand_layout(
        order_a, order_b, dtype):
    rng = np.random.default_rng(1)
    a = np.asarray(rng.normal(size=(40, 16)), dtype=dtype, order=order_a)
    b = np.asarray(rng.normal(size=(16, 24)), dtype=dtype, order=order_b)
    out = rng.normal(size=(40, 24)).astype(dtype)
    expected = out + a.astype(np.float64) @ b.astype(np.float64)
    assert meshslice_op._fortran_operands(np, a, b, out) is not None   # the BLAS path
    polls = []
    meshslice_op.BLOCK_FLOPS, saved = 1.0, meshslice_op.BLOCK_FLOPS  # many blocks
    try:
        got = meshslice_op.partial_gemm(np, a, b, out, lambda: polls.append(1), accumulate=True)
    finally:
        meshslice_op.BLOCK_FLOPS = saved
    assert got is out and len(polls) == meshslice_op.MAX_TESTS - 1
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(out, expected, rtol=tol, atol=tol)


# ---- layouts and the rule -------------------------------------------------------------------

def test_the_three_dataflows_lay_out_their_operands_as_the_seed_table_says():
    found = {(lay.dataflow, lay.u, lay.v): lay for lay in layouts([(8, 6), (6, 4)], {}, MESH)}
    axes = MatmulAxes.of([(8, 6), (6, 4)], {})
    specs = {key: [str(s) for s in lay.specs(axes, [(8, 6), (6, 4)])]
             for key, lay in found.items()}
    assert specs["OS", "x", "y"] == ["[x, y]", "[x, y]", "[x, y]"]
    assert specs["LS", "x", "y"] == ["[x, y]", "[y, x]", "[x, y]"]
    assert specs["RS", "x", "y"] == ["[y, x]", "[x, y]", "[x, y]"]
    assert len(found) == 6                                  # 3 dataflows x 2 orders


def test_layouts_need_a_2d_mesh_a_2d_right_operand_and_k_dividing_the_shard():
    assert layouts([(8, 6), (6, 4)], {}, dg.ProcessMesh([0, 1, 2, 3], ["x"])) == []
    assert layouts([(2, 8, 6), (2, 6, 4)], {}, MESH) == []             # batched y
    assert {lay.dataflow for lay in layouts([(12, 12), (12, 12)], {"meshslice": 3}, MESH)} \
        == {"OS", "LS", "RS"}
    assert layouts([(12, 12), (12, 12)], {"meshslice": 4}, MESH) == []     # shards of 6
    # K slices the contracted k in OS, n in LS and m in RS
    assert {lay.dataflow for lay in layouts([(8, 12), (12, 8)], {"meshslice": 3}, MESH)} \
        == {"OS"}


def test_matmul_offers_meshslice_strategies_only_when_asked():
    rule = dg.ops.spmd_rule("matmul")
    plain = rule.strategies([(8, 6), (6, 4)], [(8, 4)], MESH)
    sliced = rule.strategies([(8, 6), (6, 4)], [(8, 4)], MESH, meshslice="auto")
    assert not any("MeshSlice" in s.name for s in plain)
    extra = [s for s in sliced if "MeshSlice" in s.name]
    assert len(sliced) == len(plain) + len(extra) and len(extra) == 6
    os_ = next(s for s in extra if s.name.endswith("(MeshSlice OS)") and
               str(s.in_specs[0]) == "[x, y]")
    assert os_.flops_fraction == 0.25 and os_.in_local_shapes == ((4, 3), (3, 2))
    assert [(kind, n) for kind, n, _ in os_.comm] == [("all_gather", 2), ("all_gather", 2)]


def test_every_layout_is_a_fixpoint_of_the_rule():
    rule = dg.ops.spmd_rule("matmul")
    for shapes, attrs in [([(8, 6), (6, 4)], {}), ([(2, 8, 6), (6, 4)], {}),
                          ([(8, 6), (8, 4)], {"transpose_x": True})]:
        axes = MatmulAxes.of(shapes, attrs)
        for lay in layouts(shapes, attrs, MESH):
            x, y, out = lay.specs(axes, shapes)
            res = rule.infer([x, y], [out], shapes, None, MESH, fixed_in=(0, 1),
                             meshslice="auto", **attrs)
            assert (res.in_specs, res.out_specs) == ((x, y), (out,)), str(lay)
            assert layout_of(x, y, out, shapes, attrs, MESH) == lay


def test_the_rule_takes_meshslice_where_the_operands_show_a_2d_layout():
    rule = dg.ops.spmd_rule("matmul")
    # a 2-D weight and an activation split on its batch only: OS, the activation's
    # hidden dim sliced locally (no communication)
    res = rule.infer_forward([["x", None, None], ["x", "y"]], [(4, 8, 6), (6, 4)], MESH,
                             fixed=(1,), meshslice="auto")
    assert [str(s) for s in res.in_specs + res.out_specs] == \
        ["[x, None, y]", "[x, y]", "[x, None, y]"]
    assert any("MeshSlice OS over (x, y)" in n for n in res.notes)
    # Megatron's column split is no 2-D layout: the einsum rule's answer stays
    res = rule.infer_forward([["x", None, None], [None, "y"]], [(4, 8, 6), (6, 4)], MESH,
                             fixed=(1,), meshslice="auto")
    assert [str(s) for s in res.out_specs] == ["[x, None, y]"]
    assert not any("MeshSlice" in n for n in res.notes)
    # nothing known: no 2-D layout is made up
    res = rule.infer_forward([DimsSpec.unknown(2), DimsSpec.unknown(2)], [(8, 6), (6, 4)],
                             MESH, meshslice="auto")
    assert all(e is UNKNOWN for e in res.out_specs[0].dims)


def test_a_fixed_k_that_does_not_divide_the_pinned_layout_is_an_error():
    rule = dg.ops.spmd_rule("matmul")
    with pytest.raises(dg.DistGraphError, match=r"takes K in \(1, 2, 3, 6\)"):
        rule.infer_forward([["x", "y"], ["x", "y"]], [(12, 12), (12, 12)], MESH,
                           fixed=(0, 1), meshslice=4)


def test_a_bad_meshslice_setting_is_refused():
    with pytest.raises(dg.DistGraphError, match="meshslice"):
        dg.Strategy(meshslice=0)
    with pytest.raises(dg.DistGraphError, match="meshslice"):
        dg.Strategy(meshslice="yes")
    with pytest.raises(dg.ShardingError, match="meshslice"):
        dg.shard_op(lambda v: v, MESH, meshslice=-2)
    with pytest.raises(dg.ShardingError, match="no matmul"):
        dg.trace(lambda x: dg.shard_op(dg.ops.relu, MESH, meshslice=True)(x),
                 dg.InputSpec([4, 4], name="x"))


# ---- the kernel -------------------------------------------------------------------------------

@pytest.mark.parametrize("world", [4, 6])
def test_every_dataflow_and_k_equals_the_unsliced_matmul_and_counts_the_planned_bytes(world):
    for case in C.cases(world):
        records = SimulatedWorld(world).run(lambda comm: C.run_case(comm, case))
        assert records[0], case
        for rank in records:
            for name, err, planned, counted, calls, expected in rank:
                assert err < 1e-12, (case, name, err)
                assert planned == counted > 0, (case, name)
                assert calls == expected, (case, name)


# ---- plans ------------------------------------------------------------------------------------

def planned(kind="mlp", slices=True, strategy=None):
    model = P.build_model(kind)
    P.meshslice_plan(kind, 4, slices)(model)
    world = SimulatedWorld(4)
    engine = dg.Engine(model, P.loss_fn(kind), dg.optim.AdamW(0.01),
                       communicator=world.communicator(0), strategy=strategy)
    return P.prepare(engine, kind).plan()


def test_plan_explain_names_the_matmuls_their_dataflow_and_k():
    plan = planned("mlp", slices=2)
    assert "MeshSlice: 4 matmul(s)" in plan.explain()
    text = plan.explain(full=True)
    assert "MeshSlice: 4 matmul(s)" in text
    assert "matmul fc1 (forward): OS over (x, y) keeps C in place, K=2" in text
    assert "matmul fc2 (backward): LS over (x, y) keeps A in place, K=2" in text
    assert "matmul fc2 (backward): RS over (x, y) keeps B in place, K=2" in text
    rows = plan.to_dict()["meshslice"]
    assert {(r["layer"], r["role"], r["dataflow"], r["slices"]) for r in rows} == {
        ("fc1", "forward", "OS", 2), ("fc2", "forward", "OS", 2),
        ("fc2", "backward", "LS", 2), ("fc2", "backward", "RS", 2)}


def test_the_planner_gives_each_meshslice_matmul_the_k_the_cost_model_prefers():
    cluster = dg.Cluster.from_file(EMULATED)
    plan = dg.passes.plan(S.mlp_program(64, 256, _two_d), dg.Strategy(meshslice=True), cluster)
    uses = dg.passes.meshslice.uses(plan.program)
    assert len(uses) >= 3
    for use in uses:
        attrs, ins = local_op(use.op, 0)
        every_k = {**attrs, "meshslice": dataclasses.replace(attrs["meshslice"], slices=None)}
        ways = dg.ops.meshslice.overlap(every_k, ins)
        assert len(ways) > 1
        rings = Rings(cluster, lambda p: p)
        best = best_overlap(ways, cluster.device(0),
                            lambda d: rings.along(use.op.dist_attr.mesh, 0, d))[0]
        assert use.local.slices == best.slices


def _two_d(model):
    dg.shard_tensor(model.fc1.weight, MESH, ["x", "y"])
    dg.shard_tensor(model.fc2.weight, MESH, ["x", "y"])


def test_strategy_meshslice_needs_a_2d_mesh():
    mesh = dg.ProcessMesh([0, 1, 2, 3], ["x"])
    built = S.mlp_program(16, 16, lambda m: dg.shard_tensor(m.fc1.weight, mesh, [None, "x"]))
    with pytest.raises(dg.PlanError, match="two dims of size > 1"):
        dg.passes.plan(built, dg.Strategy(meshslice=True))
    with pytest.raises(dg.PlanError, match="two dims of size > 1"):
        dg.passes.plan(S.mlp_program(16, 16), dg.Strategy(meshslice=2))


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_a_meshslice_step_counts_the_bytes_the_plan_counts(kind, float64):
    plan = planned(kind, slices=2)
    models = [P.build_model(kind) for _ in range(4)]
    for m in models:
        P.meshslice_plan(kind, 4, 2)(m)

    def rank(comm):
        engine = P.prepare(P.make_engine(models[comm.rank], kind, comm), kind)
        engine.fit(P.Dataset(kind, n=P.BATCH), batch_size=P.BATCH, verbose=0)
        comm.reset_counters()
        engine.fit(P.Dataset(kind, n=P.BATCH), batch_size=P.BATCH, epochs=2, verbose=0)
        return dict(comm.bytes_sent)

    assert plan.bytes_sent()
    counted = SimulatedWorld(4).run(rank)
    planned_bytes = plan.bytes_sent()
    for pid, got in enumerate(counted):
        want = planned_bytes[pid]
        gathered = {k: got.get(k, 0.0) - want.get(k, 0.0) for k in got}
        # beyond the step, fit gathers the loss (all-reduces of a scalar) and nothing else
        assert all(v == 0 for k, v in gathered.items() if k != "all_reduce"), gathered
        assert 0 <= gathered["all_reduce"] < 64


# ---- the cost model -------------------------------------------------------------------------

def test_one_slice_hides_nothing_and_k_slices_follow_the_pipeline_formula():
    cluster = dg.Cluster.from_file(EMULATED)
    device = cluster.device(0)
    rings = {"x": Ring(0.125, 100.0, False), "y": Ring(10.0, 1.0, True)}
    ins = (TensorType((64, 256), "float32"), TensorType((256, 128), "float32"))
    outs = (TensorType((64, 128), "float32"),)
    before = (("all_gather", "y", 2, 64 * 256 * 4), ("all_gather", "x", 2, 256 * 128 * 4))
    for k in (1, 4):
        ov = Overlap(k, "matmul", ins, outs, before, ())
        gemm = op_time("matmul", ins, outs, {}, device)
        shm = collective_time("all_gather", 2, before[0][3], 10.0, 1.0)
        net = collective_time("all_gather", 2, before[1][3], 0.125, 100.0)
        cpu = gemm + shm + 2 * software_time(device, "all_gather")
        compute, exposed = overlap_time(ov, device, rings.get)
        assert compute == pytest.approx(k * gemm)
        assert compute + exposed == pytest.approx(pipeline_time(k, [net, cpu, 0.0]))
        if k == 1:
            assert exposed == pytest.approx(net + cpu - gemm)
    assert pipeline_time(3, [1.0, 2.0, 0.5]) == 3.5 + 2 * 2.0
    # what each slice reads again costs its compute: at the file's memory bandwidth...
    ov = Overlap(4, "matmul", ins, outs, before, (), reread=3e6)
    bandwidth = device_rates(device)[0]
    assert overlap_time(ov, device, rings.get)[0] == pytest.approx(
        4 * (op_time("matmul", ins, outs, {}, device) + 3e6 / bandwidth))
    # ... or at the measured figure per byte
    measured = dataclasses.replace(device, reshard_overhead={"sliced": (0.0, 2.0)})
    assert overlap_time(ov, measured, rings.get)[0] == pytest.approx(
        4 * (op_time("matmul", ins, outs, {}, device) + 3e6 * 2e-9))


def test_each_dataflow_counts_what_its_slices_read_again():
    """OS slices after the first read and write the result again; LS slices read A
    whole, RS slices B whole: K - 1 extra passes over it, shared by the K slices."""
    for dataflow, again in (("OS", 2 * 32 * 16), ("LS", 32 * 24), ("RS", 24 * 16)):
        local = LocalMeshSlice(dataflow, "x", "y", 1, 1, 0, None, 24, (1, 1))
        found = overlap({"meshslice": local}, [TensorType((32, 24), "float64"),
                                               TensorType((24, 16), "float64")])
        for ov in found:
            assert ov.reread == pytest.approx(again * 8 * (ov.slices - 1) / ov.slices)
        assert [ov.slices for ov in found] == list(slice_choices(24, 1, 1))


def test_the_calibrated_sliced_cost_makes_the_model_reproduce_each_more_slice():
    """``sliced`` (what one collective of a sliced pipeline costs beyond the model's
    charge) is derived from the measured tiny GeMM at K = 1 and K = 8: priced with it,
    the model's difference between the two equals the measured one; without it a
    collective inside the pipeline costs what a reshard step of its kind costs."""
    from distgraph.ops.meshslice import overlap
    from distgraph.passes.cost.prices import sliced_software_time
    from distgraph.tools.calibrate import build_cluster
    from distgraph.tools.software_fit import SLICED_SLICES, sliced_problem

    ranks = [{"rank": r, "host": f"node{r // 2}", "model": "cpu", "memory": 8.0,
              "gflops": {"float32": 10.0}, "memory_bandwidth": 5.0, "op_overhead": 30.0}
             for r in range(4)]
    pairs = {(a, b): (0.1 if a // 2 != b // 2 else 3.0, 40.0) for a in range(4)
             for b in range(a + 1, 4)}
    steps = {"all_gather": [(2**12, 2e-4), (2**16, 1e-3), (2**20, 2e-2)]}
    measured = {1: 6e-4, SLICED_SLICES: 4.1e-3}
    partial = [(28 * 2**20, 0.011), (56 * 2**20, 0.025)]      # (bytes read again, s)
    cluster = build_cluster(ranks, pairs, None, "calibrated4", steps, measured, partial)
    device = cluster.device(0)
    per_step, again = device.reshard_overhead["sliced"]
    # the least-squares slope through the origin: (28 x 11 + 56 x 25) / (28^2 + 56^2) ms/MiB
    assert again * 1e-9 == pytest.approx((28 * 0.011 + 56 * 0.025) / (28**2 + 56**2) / 2**20,
                                         rel=1e-5)
    _, per_byte = device.reshard_overhead["all_gather"]
    assert per_step > 0 and per_byte > 0
    assert sliced_software_time(device, "all_gather", 1e6) == pytest.approx(
        per_step * 1e-6 + per_byte * 1e-9 * 1e6)

    def priced(k):
        local, ins, mesh = sliced_problem(4, k)
        ov = overlap({"meshslice": local}, [TensorType(s, "float32") for s in ins])[0]
        rings = Rings(cluster, lambda p: p)
        return sum(overlap_time(ov, device, lambda d: rings.along(mesh, 0, d)))

    assert priced(SLICED_SLICES) - priced(1) == pytest.approx(
        measured[SLICED_SLICES] - measured[1], rel=1e-4)
    plain = build_cluster(ranks, pairs, None, "calibrated4", steps).device(0)
    assert sliced_software_time(plain, "all_gather", 1e6) == \
        software_time(plain, "all_gather", 1e6)


def test_groups_of_a_mesh_dim_that_cross_the_same_machines_share_their_link():
    """On 2 machines x 2 devices, the two groups along x (across the machines) cross the
    machine link at once: each gets half; the one 4-device ring of a 1x4 mesh crosses
    it once each way: all of it. Inside a machine, CPU ranks copy (processor time)."""
    cluster = S.grid_cluster(fast=20.0, slow=1.0)
    rings = Rings(cluster, {p: p for p in range(4)}.__getitem__)
    assert rings.along(MESH, 0, "x") == (0.5, 1.0, False, None, False)
    assert rings.along(MESH, 0, "y") == (20.0, 1.0, True, None, False)
    line = dg.ProcessMesh([[0, 1, 2, 3]], ["x", "y"])
    # MPI's all-reduce sends that ring two thirds of the ring's bytes between the machines
    assert rings.along(line, 0, "y") == (1.0, 1.0, False, mpi_cuts((0, 0, 1, 1)), False)
    assert rings.along(line, 0, "y").cuts.all_reduce == pytest.approx(2 / 3)


def test_the_search_chooses_meshslice_where_slow_links_make_overlap_pay_and_prices_it_as_the_estimate():
    cluster = S.grid_cluster(fast=10.0, slow=0.5)
    built = S.mlp_program(512, 512)
    plan = dg.passes.plan(built, dg.Strategy(auto_mode="full", meshslice=True), cluster)
    assert dg.passes.meshslice.uses(plan.program)
    plain = dg.passes.plan(built, dg.Strategy(auto_mode="full"), cluster)
    assert plan.search.objective < plain.search.objective
    expected = plan.estimate.step_time + repeated_reshard_seconds(plan, cluster)
    assert plan.search.objective == pytest.approx(expected, rel=1e-9)


# ---- the autotuner ----------------------------------------------------------------------------

def test_the_backward_dataflows_are_the_layouts_of_the_forwards_specs():
    """The autotuner's table (the paper's Table 1) is what completion finds: each backward GeMM,
    on the forward's layouts of x, W and y, is the listed dataflow."""
    tokens, n_in, n_out = 8, 12, 16
    for forward in ("OS", "LS", "RS"):
        x, w, _ = gemm_shapes("forward", tokens, n_in, n_out)
        axes = MatmulAxes.of([x, w], {})
        sx, sw, sy = SliceLayout(forward, "x", "y").specs(axes, [x, w])
        operands = {"forward": (sx, sw, sy), "backward_data": (sy, sw, sx),
                    "backward_weight": (sx, sy, sw)}
        for gemm, (dataflow, orient) in zip(GEMMS, BACKWARD[forward]):
            a, b, attrs = gemm_shapes(gemm, tokens, n_in, n_out)
            lay = layout_of(*operands[gemm], [a, b], attrs, MESH)
            dims = ("x", "y") if orient == "uv" else ("y", "x")
            assert (lay.dataflow, lay.u, lay.v) == (dataflow, *dims), (forward, gemm)


def test_stage_one_keeps_the_largest_matrix_stationary():
    assert stationary_dataflow(tokens=1024, n_in=256, n_out=1024) == "OS"   # y largest
    assert stationary_dataflow(tokens=1024, n_in=1024, n_out=256) == "LS"   # x largest
    assert stationary_dataflow(tokens=64, n_in=1024, n_out=1024) == "RS"    # W largest
    assert stationary_dataflow(tokens=512, n_in=512, n_out=512) == "OS"     # ties: y
    # on one device the three dataflows run the same three GeMMs: the prices tie, and
    # the paper's rule decides
    report = dg.passes.meshslice.autotune(layers=1, hidden=64, heads=4, seq=16, batch=2,
                                          cluster=EMULATED, devices=1, verbose=False)
    assert [(name, dataflow) for name, dataflow, _ in report.best.layers] == \
        [(name, stationary_dataflow(32, n_in, n_out)) for name, n_in, n_out in
         (("qkv", 64, 192), ("proj", 64, 64), ("fc1", 64, 256), ("fc2", 256, 64))]


def test_autotune_ranks_every_factorisation_and_picks_each_gemms_fastest_k(capsys):
    report = dg.passes.meshslice.autotune(layers=2, hidden=256, heads=4, seq=64, batch=8,
                                          cluster=EMULATED, slices=(1, 2, 4, 8))
    printed = capsys.readouterr().out
    assert printed.strip() == str(report).strip() and "rank  mesh" in printed
    assert {c.mesh for c in report.choices} == {(1, 4), (2, 2), (4, 1)}
    totals = [c.total for c in report.choices]
    assert totals == sorted(totals)
    for choice in report.choices:
        layer_sum = sum(g.total for _, _, gemms in choice.layers for g in gemms) * 2
        assert choice.total == pytest.approx(layer_sum)
        for name, dataflow, gemms in choice.layers:
            for g in gemms:
                rivals = [c for c in report.candidates if (c.layer, c.gemm, c.dataflow,
                                                           c.mesh, c.dims) ==
                          (g.layer, g.gemm, g.dataflow, g.mesh, g.dims)]
                assert g.total == min(c.total for c in rivals)
                assert all(c.slices in (1, 2, 4, 8) for c in rivals)
                assert g.exposed <= g.communication + 1e-12
            # the layer's forward dataflow is the one whose three GeMMs price least
            for forward in ("OS", "LS", "RS"):
                family = 0.0
                for gemm, (dataflow, orient) in zip(GEMMS, BACKWARD[forward]):
                    dims = ("x", "y") if orient == "uv" else ("y", "x")
                    family += min(c.total for c in report.candidates if
                                  (c.layer, c.gemm, c.dataflow, c.mesh, c.dims) ==
                                  (name, gemm, dataflow, choice.mesh, dims))
                assert sum(g.total for g in gemms) <= family + 1e-15
    # the slow link runs between the machines: mesh dim x over the rows crosses it
    assert report.best.mesh == (2, 2)


def test_autotune_skips_a_mesh_that_splits_heads_and_refuses_bad_models():
    report = dg.passes.meshslice.autotune(layers=1, hidden=96, heads=3, seq=8, batch=4,
                                          cluster=EMULATED, verbose=False)
    assert {c.mesh for c in report.choices} == {(4, 1)}
    assert [m for m, _ in report.skipped] == [(1, 4), (2, 2)]
    with pytest.raises(dg.PlanError, match="multiple of heads"):
        dg.passes.meshslice.autotune(1, 100, 3, 8, 4, EMULATED, verbose=False)
    with pytest.raises(dg.PlanError, match="layers"):
        dg.passes.meshslice.autotune(0, 96, 3, 8, 4, EMULATED, verbose=False)
    assert math.isfinite(report.best.total)


def test_a_local_meshslice_says_what_it_runs():
    lay = LocalMeshSlice("OS", "x", "y", 2, 2, 0, 4, 64, (2, 2))
    assert str(lay) == "MeshSlice OS over (x, y), K=4" and lay.block(4) == 8
    assert lay.choices() == (1, 2, 4, 8, 16, 32)
