"""Vocabulary parallelism: a split embedding table gives a Partial lookup; a split
LM head feeds the cross-entropy its class-split logits, which the op's distributed form
reduces inside (no all-gather of the logits). Both train exactly as serial does."""

import numpy as np
import pytest

import distgraph as dg
from distgraph.passes.partition import gather_points, partition
from distgraph.program_builder import build_program
from distgraph.runtime.comm.simulated import SimulatedWorld
from distgraph.runtime.execution.executor import ProgramRunner
from distgraph.runtime.execution.runner import PlanRunner

V, D, LAYERS, HEADS, T, B = 64, 32, 2, 4, 8, 4


def build(mesh=None):
    dg.seed(3)
    model = dg.nn.GPT(V, D, LAYERS, HEADS, T)
    if mesh is not None:
        dg.shard_tensor(model.lm_head.weight, mesh, [None, "mp"])
        dg.shard_tensor(model.wte.weight, mesh, ["mp", None])
    built = build_program(model, [dg.InputSpec([B, T], "int64", "tokens")],
                          [dg.InputSpec([B, T], "int64", "labels")], dg.nn.CrossEntropyLoss(),
                          dg.optim.Adam(0.01))
    init = {n: p.numpy() for n, p in model.named_parameters()}
    init.update(dg.optim.Adam(0.01).initial_state(built.program))
    return built, init


def batches():
    rng = np.random.default_rng(0)
    return [(rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))) for _ in range(3)]


def serial():
    built, scope = build()
    runner = ProgramRunner(built.program)
    losses = [float(runner.run(scope, {"tokens": x, "labels": y}, [built.loss_name], s)
                    [built.loss_name]) for s, (x, y) in enumerate(batches())]
    return losses, scope


@pytest.mark.parametrize("n", [2, 4])
def test_split_vocabulary_trains_like_serial(float64, n):
    ref_losses, ref = serial()
    built, init = build(dg.ProcessMesh(list(range(n)), ["mp"]))
    plan = dg.passes.plan(built)
    names = [v.name for v in plan.program.persistables]

    def rank(comm):
        runner = PlanRunner(plan, comm)
        scope = runner.shard_scope(init)
        losses = [float(runner.run(scope, {"tokens": x, "labels": y}, s)[built.loss_name])
                  for s, (x, y) in enumerate(batches())]
        return losses, runner.gather(scope, names)

    for losses, params in SimulatedWorld(n).run(rank):
        assert np.allclose(losses, ref_losses, rtol=1e-12, atol=0)
        for name, value in ref.items():
            if "@STEP" not in name:
                assert np.max(np.abs(params[name] - value)) < 1e-10, name


def test_plan_keeps_logits_and_table_split(float64):
    built, _ = build(dg.ProcessMesh([0, 1], ["mp"]))
    prog = dg.passes.complete(built.program)
    ce = next(op for op in prog.ops if op.type == "softmax_cross_entropy")
    assert str(ce.dist_attr.input_specs[0]) == "[None, None, mp]"
    assert [str(s) for s in ce.dist_attr.output_specs] == ["[None, None]", "[None, None]"]
    emb = next(op for op in prog.ops if op.type == "embedding" and op.inputs[1].name == "wte.weight")
    assert emb.dist_attr.output_specs[0].partial == {"mp"}
    assert str(prog.values["wte.weight@GRAD"].dist_attr.spec) == "[mp, None]"
    logits = ce.inputs[0].name
    local = partition(prog, 0)
    assert not any(p.value == logits for p in local.points())   # consumed where produced
    ce_local = next(op for op in local.program.ops if op.type == "softmax_cross_entropy")
    assert ce_local.attrs["class_start"] == 0 and ce_local.inputs[0].shape == (B, T, V // 2)


def test_bytes_counted_equal_the_plan_with_collectives_inside_ops(float64):
    built, init = build(dg.ProcessMesh([0, 1, 2, 3], ["mp"]))
    plan = dg.passes.plan(built)
    (x, y), = batches()[:1]

    def rank(comm):
        runner = PlanRunner(plan, comm)
        scope = runner.shard_scope(init)
        comm.reset_counters()
        runner.run(scope, {"tokens": x, "labels": y}, 0)
        planned = runner.local.bytes_sent()
        for point in gather_points(plan.program, [built.loss_name], comm.rank):
            for step in point.steps:
                planned[step.kind] = planned.get(step.kind, 0.0) + step.bytes_sent_by(comm.rank)
        return planned, dict(comm.bytes_sent), runner.local.op_comm

    for planned, counted, op_comm in SimulatedWorld(4).run(rank):
        assert op_comm                      # the cross-entropy's own collectives are planned
        kinds = set(planned) | {k for k, b in counted.items() if b}
        assert {k: planned.get(k, 0.0) for k in kinds} == {k: counted.get(k, 0.0) for k in kinds}


def test_estimate_charges_a_collective_inside_an_op_the_software_cost_of_its_kind(float64):
    """A device's measured software cost per communication step (``reshard_overhead``)
    is paid by the collectives an op runs itself (the split cross-entropy's) as by
    reshard steps: the estimate's communication grows by one overhead per step and per
    op collective of each kind, per ring round (n - 1 over n processes)."""
    built, _ = build(dg.ProcessMesh([0, 1, 2, 3], ["mp"]))
    plan = dg.passes.plan(built)
    overhead = {"all_reduce": 11.0, "all_gather": 13.0, "reduce_scatter": 17.0,
                "all_to_all": 19.0, "slice": 23.0}

    def cluster(software):
        return dg.Cluster.from_dict({"machines": [{"hostname": "a", "devices": [
            {"global_id": i, "type": "CPU", "memory": 1, "gflops": {"float64": 10},
             **({"reshard_overhead": overhead} if software else {})} for i in range(4)],
            "links": [{"group": [0, 1, 2, 3], "bandwidth": 2, "latency": 5}]}]})

    plain, charged = dg.passes.estimate(plan, cluster(False)), dg.passes.estimate(plan,
                                                                                  cluster(True))
    for pid, a, b in zip(plan.process_ids, plain.processes, charged.processes):
        local = plan.local(pid)
        steps = [(s.kind, s.group_size) for p in local.points()
                 + gather_points(plan.program, [built.loss_name], pid) for s in p.steps]
        inside = [(kind, n) for collectives in local.op_comm.values()
                  for kind, n, _ in collectives]
        assert inside                                    # the op's own collectives
        # a collective over n processes pays the 2-process figure at each of n - 1 rounds
        expected = sum(overhead[str(k)] * (max(n - 1, 1) if k != "slice" else 1)
                       for k, n in steps + inside) * 1e-6
        assert b.communication - a.communication == pytest.approx(expected, rel=1e-9)
