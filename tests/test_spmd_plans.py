"""The plan matrix on SimulatedWorld: every plan of tests/plans.py (DP, Megatron TP,
DP x TP, sequence split, ZeRO update sharding, two stages; MLP and GPT-tiny; 2 and 4
processes) trains three steps through ``Engine.fit`` and equals serial training; each
plan really is the plan it claims to be; a step's reshard bytes equal the cost formula
and the communicators' counters."""

import math
import os
import sys
from collections import defaultdict

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402
from distgraph.passes.cost.formulas import collective_bytes  # noqa: E402
from distgraph.passes.partition import gather_points, partition  # noqa: E402
from distgraph.placement import DistAttr  # noqa: E402
from distgraph.program_builder import build_program  # noqa: E402
from distgraph.runtime.comm.base import COUNTED_KINDS  # noqa: E402
from distgraph.runtime.comm.simulated import SimulatedWorld  # noqa: E402
from distgraph.runtime.execution.runner import PlanRunner  # noqa: E402

import plans as P  # noqa: E402

ALL_PLANS = list(P.PLANS.values())


@pytest.fixture
def default_dtype(request):
    """Switch the default dtype for one test and restore it afterwards."""
    previous = dg.get_default_dtype()
    dg.set_default_dtype(request.param)
    yield request.param
    dg.set_default_dtype(previous)


_SERIAL: dict = {}


def serial(kind, optimizer="adamw"):
    key = (kind, dg.get_default_dtype(), optimizer)
    if key not in _SERIAL:
        _SERIAL[key] = P.serial_reference(kind, optimizer=optimizer)
    return _SERIAL[key]


def annotated_models(plan):
    """One freshly built, annotated model per rank (built here: the seed is global)."""
    models = [P.build_model(plan.kind) for _ in range(plan.nprocs)]
    for m in models:
        plan.annotate(m)
    return models


def run_plan(plan, optimizer="adamw"):
    models = annotated_models(plan)
    return SimulatedWorld(plan.nprocs, timeout=60).run(
        lambda comm: P.train(models[comm.rank], plan.kind, comm, plan.sharding, optimizer))


def check_against_serial(results, reference, dtype):
    ref_losses = reference[0]
    assert len(ref_losses) == P.STEPS
    for rank, result in enumerate(results):
        # History.losses is the global loss, the same on every rank.
        assert result[0] == results[0][0], f"rank {rank} reports other losses than rank 0"
        errors = P.compare(result, reference, dtype)
        assert errors["steps"] == P.STEPS
        assert errors["loss"] <= P.TOLERANCE[dtype], (rank, errors)
        assert errors["param"] <= P.TOLERANCE[dtype], (rank, errors)


# ---- numerics: every plan equals serial training ------------------------------------------

@pytest.mark.parametrize("default_dtype", ["float64"], indirect=True)
@pytest.mark.parametrize("plan", ALL_PLANS, ids=str)
def test_plan_trains_like_serial_float64(plan, default_dtype):
    check_against_serial(run_plan(plan), serial(plan.kind), default_dtype)


def _float32_optimizer(kind):
    # AdamW divides each gradient entry by its own running RMS, so an entry whose exact
    # gradient is ~0 (GPT's key bias: softmax ignores a per-query constant) moves by
    # +-lr on float32 rounding noise alone; serial float32 itself is 7e-4 away from
    # serial float64 there. A 1e-5 float32 comparison is meaningful for the MLP under
    # AdamW and for GPT under SGD with momentum (linear in the gradient); float64
    # checks AdamW on every plan.
    return "adamw" if kind == "mlp" else "sgd"


@pytest.mark.parametrize("default_dtype", ["float32"], indirect=True)
@pytest.mark.parametrize("plan", [p for p in ALL_PLANS if p.nprocs == 4 or p.kind == "mlp"],
                         ids=str)
def test_plan_trains_like_serial_float32(plan, default_dtype):
    optimizer = _float32_optimizer(plan.kind)
    check_against_serial(run_plan(plan, optimizer), serial(plan.kind, optimizer), default_dtype)


# ---- each plan is the plan it claims to be ----------------------------------------------

def planned(plan):
    """(completed program, local programs) of a plan, without running it."""
    model = annotated_models(plan)[0]
    world = SimulatedWorld(plan.nprocs)
    engine = P.prepare(P.make_engine(model, plan.kind, world.communicator(0), plan.sharding),
                       plan.kind)
    program = engine.plan().program
    return program, [partition(program, pid) for pid in range(plan.nprocs)]


def specs_of(program, name):
    return program.values[name].dist_attr


def step_kinds(local, pred):
    return {s.kind for p in local.points() if pred(p) for s in p.steps}


def weight_names(kind):
    if kind == "mlp":
        return [("fc1.weight", 1), ("fc2.weight", 0)]
    return [(f"blocks.{i}.{layer}.weight", d) for i in range(2)
            for layer, d in (("attn.qkv", 1), ("attn.proj", 0), ("mlp.fc1", 1), ("mlp.fc2", 0))]


@pytest.mark.parametrize("plan", ALL_PLANS, ids=str)
def test_plan_structure(plan):
    program, locals_ = planned(plan)
    n = plan.nprocs
    inp = program.inputs[0]
    grads = [p for p in locals_[0].points() if p.value.endswith("@GRAD")]
    if plan.name in ("dp", "zero", "dp_tp", "zero_dp_tp"):
        assert specs_of(program, inp.name).spec.dims[0] == "dp"
        assert local_batch(locals_[0]) == P.BATCH // specs_of(program, inp.name).mesh.dim_size("dp")
        assert grads, "data-parallel gradients are never reduced"
    if plan.name in ("tp", "dp_tp", "zero_dp_tp"):
        mp = n if plan.name == "tp" else 2
        for name, dim in weight_names(plan.kind):
            attr = specs_of(program, name)
            assert attr.spec.dims[dim] == "mp", (name, attr)
            local = locals_[0].program.values[name].shape
            assert local[dim] == program.values[name].shape[dim] // mp
    if plan.name == "sp":
        split = [v for v in program.values.values() if v.role == "forward" and v.ndim == 3
                 and v.dist_attr.spec.dims[1] == "sp"]
        assert len(split) >= (3 if plan.kind == "mlp" else 2)
    if plan.name in ("zero", "zero_dp_tp"):
        check_zero(program, locals_, plan)
    if plan.name == "two_stage":
        half = n // 2
        stage0 = set(range(half))
        # (the optimizer's step counter lives on every process)
        meshes = {frozenset(op.dist_attr.mesh.process_ids) for op in program.ops
                  if op.role != "optimize"}
        assert meshes == {frozenset(stage0), frozenset(range(half, n))}
        first = [op for op in program.ops if op.role == "forward"][0]
        assert set(first.dist_attr.mesh.process_ids) == stage0
        if plan.kind == "gpt":
            for op in program.ops:
                if op.layer.startswith("blocks.0") or op.layer.startswith("wte"):
                    assert set(op.dist_attr.mesh.process_ids) == stage0, op.layer
                if op.layer.startswith("blocks.1") or op.layer.startswith("lm_head"):
                    assert set(op.dist_attr.mesh.process_ids) == set(range(half, n)), op.layer
        for local in locals_:
            assert "send_recv" in step_kinds(local, lambda p: True)
            assert len(local.program.ops) < len(program.ops)


def local_batch(local):
    return local.program.inputs[0].shape[0]


def check_zero(program, locals_, plan):
    """Gradients reduce-scattered, updated slices all-gathered back into the stored
    parameter, optimizer states held as 1/dp slices of the stored parameter."""
    dp = 2 if plan.name == "zero_dp_tp" else plan.nprocs

    def parts(v, d) -> int:
        return math.prod(v.dist_attr.mesh.dim_size(m) for m in v.dist_attr.spec.entry(d))

    # every parameter with a dim that dp divides beside the mesh dims splitting it (one
    # tensor parallelism left whole, or one it splits whose pieces dp divides again):
    # its states are split with no padding (passes/transforms/zero.py)
    params = [v.name for v in program.parameters
              if any(size % (dp * parts(v, d)) == 0 for d, size in enumerate(v.shape))]
    assert set(params) >= {name for name, _ in weight_names(plan.kind)}
    for local in locals_:
        written_back = {p.stores[0]: {s.kind for s in p.steps} for p in local.points()
                        if p.stores}
        assert sorted(written_back) == sorted(params)
        assert all(kinds == {"all_gather"} for kinds in written_back.values())
        scattered = {p.value.removesuffix("@GRAD") for p in local.points()
                     if p.value.endswith("@GRAD") and any(s.kind == "reduce_scatter"
                                                          for s in p.steps)}
        # A gradient is only reduce-scattered if it is still a pending sum when it
        # reaches the update; GPT's position table receives an already summed gradient.
        assert len(scattered) >= len(params) - (1 if plan.kind == "gpt" else 0)
        assert not any(s.kind == "all_reduce" for p in local.points()
                       if p.value.removesuffix("@GRAD") in params for s in p.steps)
        for v in program.persistables:
            owner = v.name.split("@")[0]
            if v.is_parameter or v.ndim == 0:
                continue
            state = math.prod(local.program.values[v.name].shape)
            stored = math.prod(local.program.values[owner].shape)
            assert state * (dp if owner in params else 1) == stored, (v.name, state, stored)


# ---- communication: planned bytes = cost formula = what the communicator counted --------

def local_buffer_bytes(step):
    """The buffer B of the cost model's table, from the step's layouts alone."""
    itemsize = np.dtype(step.dtype).itemsize
    if step.kind == "all_gather":
        return math.prod(DistAttr(step.mesh, step.after).local_shape(step.shape)) * itemsize
    return math.prod(DistAttr(step.mesh, step.before).local_shape(step.shape)) * itemsize


def one_step_traffic(plan):
    """Per rank: (every reshard point of a training step, planned bytes per kind, bytes
    the communicator counted per kind, its total)."""
    model = annotated_models(plan)[0]
    optimizer = dg.optim.AdamW(P.LEARNING_RATE)
    ins, labels = dg.app.data.DataLoader(P.Dataset(plan.kind), P.BATCH).specs(1)
    built = build_program(model, ins, labels, P.loss_fn(plan.kind), optimizer)
    planned_ = dg.passes.plan(built, dg.Strategy(sharding=plan.sharding))
    program = planned_.program
    init = {n: p.numpy() for n, p in model.named_parameters()}
    init.update(optimizer.initial_state(program))
    data = P.Dataset(plan.kind)
    feed = {name: np.stack([data[i][k] for i in range(P.BATCH)])
            for k, name in enumerate(built.feed_names)}

    def body(comm):
        runner = PlanRunner(planned_, comm)
        scope = runner.shard_scope(init)
        comm.reset_counters()
        runner.run(scope, feed, step=0)
        points = runner.local.points() + gather_points(program, [built.loss_name], comm.rank)
        planned = defaultdict(float)
        for point in points:
            for step in point.steps:
                planned[step.kind] += step.bytes_sent_by(comm.rank)
        return points, dict(planned), dict(comm.bytes_sent), comm.total_bytes_sent

    return program, SimulatedWorld(plan.nprocs).run(body)


BYTES_PLANS = ([P.PLANS[k, name, n] for k in ("mlp", "gpt") for name in ("dp", "tp")
                for n in (2, 4)]
               + [P.PLANS["mlp", name, 4] for name in ("zero", "dp_tp", "two_stage")])


@pytest.mark.parametrize("default_dtype", ["float64"], indirect=True)
@pytest.mark.parametrize("plan", BYTES_PLANS, ids=str)
def test_step_bytes_equal_formula_and_counters(plan, default_dtype):
    program, per_rank = one_step_traffic(plan)
    for rank, (points, planned, counted, total) in enumerate(per_rank):
        assert sum(planned.values()) > 0
        for point in points:
            for step in point.steps:
                if step.kind in ("slice", "make_partial"):
                    assert step.bytes == 0
                elif step.kind == "send_recv":
                    itemsize = np.dtype(step.dtype).itemsize
                    for t in step.transfers:
                        assert t.nbytes == math.prod(t.shape) * itemsize
                    assert step.bytes_sent_by(rank) == sum(
                        t.nbytes for t in step.transfers if t.src == rank != t.dst)
                else:
                    assert step.buffer_bytes == local_buffer_bytes(step), str(step)
                    assert step.bytes == collective_bytes(step.kind, step.group_size,
                                                          step.buffer_bytes), str(step)
                    assert step.group_size == step.mesh.dim_size(step.mesh_dim)
        assert total == pytest.approx(sum(planned.values()), rel=1e-12)
        for kind in COUNTED_KINDS:
            assert counted[kind] == pytest.approx(planned.get(kind, 0.0), rel=1e-12, abs=0), \
                (rank, kind, planned, counted)
        assert set(planned) <= set(COUNTED_KINDS) | {"slice", "make_partial"}


@pytest.mark.parametrize("default_dtype", ["float64"], indirect=True)
@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_data_parallel_moves_one_all_reduce_of_the_gradients(kind, default_dtype):
    """DP on n processes: all-reduce of every gradient, 2 (n-1)/n x its bytes, plus the
    scalar loss, plus (GPT's mean cross-entropy) the scalar count of labels that are not
    ignore_index; nothing else (the closed form of the ring all-reduce)."""
    n = 4
    program, per_rank = one_step_traffic(P.PLANS[kind, "dp", n])
    param_bytes = sum(math.prod(v.shape) * 8 for v in program.parameters)
    scalars = 2 if kind == "gpt" else 1
    expected = 2 * (n - 1) / n * (param_bytes + 8 * scalars)
    for _, _, counted, total in per_rank:
        # (GPT's position table: the all-reduce is of the gradient of its slice, which
        # here is the whole table, so the bytes are the same)
        assert counted["all_reduce"] == pytest.approx(expected, rel=1e-12)
        assert total == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("default_dtype", ["float64"], indirect=True)
def test_zero_moves_the_bytes_of_data_parallel(default_dtype):
    """reduce_scatter + all_gather of a gradient and parameter = one all_reduce (ring)."""
    _, dp = one_step_traffic(P.PLANS["mlp", "dp", 4])
    _, zero = one_step_traffic(P.PLANS["mlp", "zero", 4])
    for (_, _, _, total_dp), (_, _, c_zero, total_zero) in zip(dp, zero):
        assert c_zero["reduce_scatter"] > 0 and c_zero["all_gather"] > 0
        assert c_zero["all_reduce"] == pytest.approx(2 * 3 / 4 * 8)   # the loss only
        assert total_zero == pytest.approx(total_dp, rel=1e-12)
