"""Megatron's tensor parallelism of Llama-tiny, with and without sequence parallelism
(Strategy(sequence_parallel=True)): the plan's collectives per decoder layer are
Megatron's (Korthikanti et al. 2022, Fig. 5 and 6) with the bytes of the cost formula,
the gradient of an activation read by several column-split matmuls is reduced once (a
sum of pending sums stays pending: add's rule is P x P -> P), and training on real MPI
ranks equals serial training (float64, 1e-10): Llama tp 2 + SP, dp 2 x tp 2 + SP, and
GPT's tp + SP plans of tests/plans.py (GPT with dropout too, on SimulatedWorld threads).
With the weights annotated and auto_mode="full", the search splits the light ops over
the tensor-parallel dim itself."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402
from distgraph import dtypes  # noqa: E402
from distgraph.errors import DistGraphError, PlanError  # noqa: E402
from distgraph.plan.kinds import collective_bytes  # noqa: E402
from distgraph.program_builder import build_program  # noqa: E402

import llama_cases as L  # noqa: E402
import plans as P  # noqa: E402
from distgraph.runtime.comm.simulated import SimulatedWorld  # noqa: E402
from test_spmd_mpi import check_report, run_plans  # noqa: E402

B, S = 4, 8
HERE = os.path.dirname(os.path.abspath(__file__))


def _plan(sequence_parallel: bool, dp: int = 1):
    model = dg.nn.Llama(dg.nn.llama.LlamaConfig(**L.TINY))
    mesh = dg.ProcessMesh(np.arange(2 * dp).reshape(dp, 2).tolist(), dim_names=["dp", "mp"])
    dg.nn.llama.megatron(model, mesh)
    built = build_program(model, [dg.InputSpec([B, S], "int64", "tokens")],
                          [dg.InputSpec([B, S], "int64", "labels")],
                          dg.nn.CrossEntropyLoss(), dg.optim.SGD(0.1))
    return dg.passes.plan(built, dg.Strategy(sequence_parallel=sequence_parallel))


def _collectives(plan) -> dict:
    """{("forward" | "backward", kind): [(bytes sent, full tensor bytes), ...]}: the
    collectives over mp of the [batch, seq, hidden] activations and their gradients (not
    the norm weights' gradients: Megatron-SP all-reduces those too)."""
    found = collections.defaultdict(list)
    ops = plan.program.ops
    for point in plan.reshards():
        op = ops[point.anchor]
        if len(point.shape) != 3:
            continue
        role = "forward" if str(op.role) == "forward" else "backward"
        full = int(np.prod(point.shape)) * dtypes.itemsize(point.dtype)
        for step in point.steps:
            if step.mesh_dim == "mp" and str(step.kind) != "slice":
                found[role, str(step.kind)].append((step.bytes, full))
    return found


def _check_bytes(found) -> None:
    for (_, kind), steps in found.items():
        for sent, full in steps:
            assert sent == collective_bytes(kind, 2, full), kind


def test_add_of_pending_sums_stays_pending():
    mesh = dg.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    rule = dg.ops.spmd_rule("add")
    p = dg.placement.ShardSpec([None, None], partial=["y"])
    res = rule.infer_forward([p, p], [(4, 6), (4, 6)], mesh)
    assert [str(s) for s in res.in_specs] == ["[None, None] P(y)"] * 2
    assert str(res.out_specs[0]) == "[None, None] P(y)"
    # one pending, one whole: the sum is settled first (as before)
    res = rule.infer_forward([p, [None, None]], [(4, 6), (4, 6)], mesh)
    assert not res.out_specs[0].partial and not res.in_specs[0].partial
    # a linear op lists P x P -> P among its strategies; a product does not
    names = [s.name for s in rule.strategies([(4, 6), (4, 6)], [(4, 6)], mesh)]
    assert "[None, None] P(y) x [None, None] P(y) -> [None, None] P(y)" in names
    assert not any("P(" in s.name.split(" -> ")[0] for s in
                   dg.ops.spmd_rule("multiply").strategies([(4, 6), (4, 6)], [(4, 6)], mesh))


def test_megatron_backward_reduces_each_input_gradient_once():
    found = _collectives(_plan(False))
    layers = L.TINY["num_hidden_layers"]
    # per layer, Megatron's 2 all-reduces forward (after o and down) and 2 backward (the
    # input gradients of q|k|v and of gate|up, each summed before it is reduced: 5 before)
    assert {key: len(steps) for key, steps in found.items()} == {
        ("forward", "all_reduce"): 2 * layers, ("backward", "all_reduce"): 2 * layers}
    _check_bytes(found)


def test_sequence_parallel_gathers_and_reduce_scatters():
    found = _collectives(_plan(True))
    layers = L.TINY["num_hidden_layers"]
    # per layer: forward, an all-gather before q|k|v and gate|up and a reduce-scatter after
    # o and down; backward, their transposes (the gradients reaching o and down gathered,
    # the input gradients of q|k|v and gate|up reduce-scattered) and the norms' outputs
    # gathered again for the weight gradients of q|k|v and gate|up (Korthikanti et al.
    # 4.2.2: the forward keeps them split, not its gathered copy); no all-reduce of an
    # activation is left. Beyond the layers: the final norm's input gathered for the LM
    # head (its weight is whole), as Megatron gathers before its output layer, and again
    # for the norm's gradient.
    assert {key: len(steps) for key, steps in found.items()} == {
        ("forward", "all_gather"): 2 * layers + 1, ("forward", "reduce_scatter"): 2 * layers,
        ("backward", "all_gather"): 4 * layers + 1, ("backward", "reduce_scatter"): 2 * layers}
    _check_bytes(found)
    # the decoder layers' norms and residual adds run split over the sequence
    plan = _plan(True, dp=2)
    light = [op for op in plan.program.ops if op.type in ("rms_norm", "add")
             and op.layer.startswith("layers.") and str(op.role) == "forward"]
    assert len(light) == 4 * layers
    assert all(op.dist_attr.output_specs[0].dims[1] == "mp" for op in light)


def test_sequence_parallel_strategy_is_checked():
    with pytest.raises(DistGraphError, match="sequence_parallel"):
        dg.Strategy(sequence_parallel="yes")
    # None (the search's) only where a search weighs it
    with pytest.raises(PlanError, match="sequence_parallel=None"):
        dg.passes.plan(None, dg.Strategy(sequence_parallel=None))


def _llama_on_mpi(n: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "distgraph.cli", "run", "-n", str(n),
                           os.path.join(HERE, "mpi_scripts", "llama_sp.py")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("LLAMA-SP ")]
    assert len(lines) == 1, proc.stdout[-3000:]
    return json.loads(lines[0].split(" ", 1)[1])


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 4], ids=["tp2_sp", "dp2_tp2_sp"])
def test_llama_sequence_parallel_trains_as_serial_on_mpi_ranks(n):
    report = _llama_on_mpi(n)
    assert report["world"] == n
    for mine in report["ranks"]:
        assert mine["losses"] == report["ranks"][0]["losses"]
        assert len(mine["losses"]) == 3
        assert mine["errors"]["same_names"]
        assert mine["errors"]["loss"] <= 1e-10 and mine["errors"]["param"] <= 1e-10
        assert {"all_gather", "reduce_scatter"} <= set(mine["kinds"])


@pytest.mark.mpi
def test_gpt_sequence_parallel_trains_as_serial_on_mpi_ranks():
    keys = ["gpt:tp_sp", "gpt:dp_tp_sp"]
    report = run_plans(4, keys)
    check_report(report, 4, keys)
    for result in report["plans"].values():
        assert "reduce_scatter" in result["reshards"]["grad"]


def _gpt_tp(dropout=0.0):
    with P.BUILD_LOCK:
        model = P.build_model("gpt", dropout=dropout)
        P._tensor_parallel(model, dg.ProcessMesh([0, 1], ["mp"]))
        ins, labels = dg.app.data.DataLoader(P.Dataset("gpt"), P.BATCH).specs(1)
        return build_program(model, ins, labels, P.loss_fn("gpt"), dg.optim.SGD(0.1))


def _train_gpt(comm, sequence_parallel):
    with P.BUILD_LOCK:
        model = P.build_model("gpt", dropout=0.1)
        if comm is not None:
            P._tensor_parallel(model, dg.ProcessMesh([0, 1], ["mp"]))
    engine = P.prepare(P.make_engine(model, "gpt", comm, sequence_parallel=sequence_parallel),
                       "gpt")
    history = engine.fit(P.Dataset("gpt"), batch_size=P.BATCH, epochs=1, verbose=0)
    return history.losses, engine.state_dict()


def test_gpt_with_dropout_runs_its_dropout_split_and_trains_as_serial(float64):
    plan = dg.passes.plan(_gpt_tp(dropout=0.1), dg.Strategy(sequence_parallel=True))
    residual = [op for op in plan.program.ops if op.type == "dropout"
                and op.layer.endswith(("resid_drop", "mlp.drop"))]
    assert len(residual) == 2 * P.GPT_DIMS["n_layer"]
    assert all(str(op.dist_attr.output_specs[0]) == "[None, mp, None]" for op in residual)
    serial = _train_gpt(None, False)
    for result in SimulatedWorld(2, timeout=120).run(_train_gpt, True):
        errors = P.compare(result, serial, "float64")
        assert errors["loss"] <= 1e-10 and errors["param"] <= 1e-10, errors


def test_search_splits_the_light_ops_over_the_tensor_parallel_dim():
    """With Megatron's weights annotated, the search (auto_mode="full") lays the norms
    and residual adds out split over mp, as sequence parallelism does (here over the
    batch, the other token dim; it is as cheap): a row-split matmul's pending sum is
    reduce-scattered, and no activation is all-reduced."""
    plan = dg.passes.plan(_gpt_tp(), dg.Strategy(auto_mode="full"), dg.Cluster.local(2))
    norms = [op for op in plan.program.ops if op.type == "layer_norm"
             and str(op.role) == "forward"]
    assert norms and all("mp" in op.dist_attr.output_specs[0].dims[:2] for op in norms)
    found = _collectives(plan)
    assert ("forward", "reduce_scatter") in found
    assert not any(kind == "all_reduce" for _, kind in found)


def _train_stages(comm, strategy):
    with P.BUILD_LOCK:
        model = P.build_model("gpt")
        if comm is not None:
            P.PIPELINE_PLANS["gpt", "two_stage_tp", 4].annotate(model)
    engine = dg.Engine(model, P.loss_fn("gpt"), P.make_optimizer("adamw"), strategy=strategy,
                       communicator=comm)
    P.prepare(engine, "gpt")
    history = engine.fit(P.Dataset("gpt"), batch_size=P.BATCH, epochs=1, verbose=0)
    kinds = {str(s.kind) for p in engine.plan().reshards() for s in p.steps}
    return (history.losses, engine.state_dict()), kinds


def test_sequence_parallel_inside_two_tensor_parallel_pipeline_stages(float64):
    serial, _ = _train_stages(None, dg.Strategy())
    strategy = dg.Strategy(sequence_parallel=True, micro_batches=2)
    for result, kinds in SimulatedWorld(4, timeout=120).run(_train_stages, strategy):
        assert {"reduce_scatter", "send_recv"} <= kinds
        errors = P.compare(result, serial, "float64")
        assert errors["loss"] <= 1e-10 and errors["param"] <= 1e-10, errors


def test_sequence_parallel_keeps_stage_boundaries_whole():
    """Megatron's (t, p) as bench/gpt_scale.py annotates it (each block's norms on its
    stage): the activation a stage hands the next stays out of the sequence-parallel
    regions, so the next stage's first norm and residual add stay on their stage (it
    pinned them to the earlier one, a cycle between the stages)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    from gpt_scale import dgx_cluster, megatron_plan

    plan = megatron_plan(4, 256, 8, 4, 2, 8, 4, 2, dgx_cluster(1), sequence_parallel=True)
    order = {m: i for i, m in enumerate(plan.stages)}
    for op in plan.program.ops:
        if op.role.value == "forward" and op.layer.startswith("blocks."):
            block = int(op.layer.split(".")[1])
            assert order[op.dist_attr.mesh] == block // 2, (op.type, op.layer)
    kinds = {str(s.kind) for p in plan.reshards() for s in p.steps}
    assert "reduce_scatter" in kinds


def test_sequence_parallel_on_searched_stages_keeps_every_op_on_its_stage():
    """A searched pipeline's annotations (every forward op and activation, as the search
    writes them) with a stage boundary inside a block, as on GPT-3 at 40 GB: block 1's
    first norm on stage A, the rest of block 1 on stage B. The pins sequence parallelism
    releases are the layouts, not the stages: the residual add that reads A's activation
    and B's dropout stays on B (released whole it took A's mesh, a cycle between the
    stages the planner refused)."""
    from distgraph.annotation import OpAnnotation
    from distgraph.passes.completion.complete import complete
    from distgraph.passes.transforms.sequence_parallel import sequence_parallel

    stage_a, stage_b = dg.ProcessMesh([0, 1], ["mp"]), dg.ProcessMesh([2, 3], ["mp"])
    dg.seed(0)
    model = dg.nn.GPT(vocab_size=64, d_model=32, n_layer=2, n_head=4, max_seq_len=16,
                      dropout=0.1)
    for block, mesh in zip(model.blocks, (stage_a, stage_b)):
        for layer, spec in ((block.attn.qkv, [None, "mp"]), (block.attn.proj, ["mp", None]),
                            (block.mlp.fc1, [None, "mp"]), (block.mlp.fc2, ["mp", None])):
            dg.shard_tensor(layer.weight, mesh, spec)
    tokens = [dg.InputSpec([4, 16], "int64", "tokens")]
    program = build_program(model, tokens, [dg.InputSpec([4, 16], "int64", "labels")],
                            dg.nn.CrossEntropyLoss(), dg.optim.SGD(0.1)).program
    complete(program)
    forward = [op for op in program.ops if op.role.value == "forward"]
    stage_of = {id(op): op.dist_attr.mesh for op in forward}
    ln1 = next(op for op in forward if op.layer == "blocks.1.ln1")
    assert stage_of[id(ln1)] == stage_a        # the boundary inside block 1
    for op in forward:                          # the search's annotations
        op.annotation = OpAnnotation(op.dist_attr.mesh)
    for v in program.values.values():
        if v.dist_attr is not None and "@" not in v.name:
            v.annotation = v.dist_attr
    assert sequence_parallel(program, searched=True) > 0
    complete(program)
    moved = [(op.type, op.layer) for op in forward if op.dist_attr.mesh != stage_of[id(op)]]
    assert not moved
