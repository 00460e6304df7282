"""The task graph a plan's processes run: tasks by role per stage, the B/W split of the
zero-bubble schedule, sends and receives where values cross stages, buffers that bound
the micro-batches in flight, and the errors for pipelines it cannot make."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402
from distgraph.program_builder import build_program  # noqa: E402

import plans as P  # noqa: E402

ALL = {**P.PLANS, **P.PIPELINE_PLANS}


def plan_of(key, **strategy):
    kind = key[0]
    model = P.build_model(kind)
    ALL[key].annotate(model)
    ins, labels = dg.app.data.DataLoader(P.Dataset(kind, batch=16), 16).specs(1)
    built = build_program(model, ins, labels, P.loss_fn(kind), P.make_optimizer("adamw"))
    return dg.passes.plan(built, dg.Strategy(**strategy))


@pytest.mark.parametrize("schedule", ["FThenB", "1F1B", "ZB"])
def test_buffers_bound_the_micro_batches_in_flight(schedule):
    p = plan_of(("mlp4", "four_stage", 4), micro_batches=8, schedule=schedule)
    g = p.task_graph()
    assert len(g.stages) == 4 and [g.stage_of[q] for q in range(4)] == [0, 1, 2, 3]
    assert g.caps == ((8,) * 4 if schedule == "FThenB" else (4, 3, 2, 1))
    for e in g.edges:
        if e.remote:
            assert e.buffer == (8 if schedule == "FThenB" else 2)
            assert e.src[0] != e.dst[0] and e.points
        else:
            assert e.buffer == g.caps[g.stage_of[e.src[0]]]
            assert e.flush == (schedule == "FThenB" and e.src[1] == "forward")
    first = {"FThenB": "forward", "1F1B": "backward", "ZB": "backward_input"}[schedule]
    assert g.priority[0] == first
    # forwards flow down the stages, gradients up
    forward = [(e.src[0], e.dst[0]) for e in g.edges if e.remote and e.src[1] == "forward"]
    assert sorted(forward) == [(0, 1), (1, 2), (2, 3)]
    backward = [(e.src[0], e.dst[0]) for e in g.edges if e.remote and e.src[1] != "forward"]
    assert sorted(backward) == [(1, 0), (2, 1), (3, 2)]


def test_tasks_cut_each_local_program_by_role():
    p = plan_of(("gpt", "two_stage", 4), micro_batches=4)
    g = p.task_graph()
    for pid in range(4):
        tasks = g.tasks_of(pid)
        assert sorted(tasks) == ["backward", "forward", "update"]
        local = p.local(pid)
        ops = [it.index for t in tasks.values() for it in t.items if it.kind == "op"]
        # each op once; the mean's count of labels is the prologue's, in no task
        prologue = [i for i, op in enumerate(local.program.ops)
                    if {o.name for o in op.outputs} <= p.accumulation.skipped]
        assert [local.program.ops[i].type for i in prologue] == \
            (["label_mask", "sum"] if pid >= 2 else [])
        assert sorted(ops + prologue) == list(range(len(local.program.ops)))
        roles = {kind: {local.program.ops[it.index].role for it in t.items if it.kind == "op"}
                 for kind, t in tasks.items()}
        assert roles["forward"] <= {"forward", "loss"}
        assert roles["backward"] == {"backward"} and roles["update"] == {"optimize"}
        items = [it.kind for it in tasks["update"].items]
        assert items[-1] == "gather"                     # the loss, for every process
        grads = set(tasks["backward"].accumulates)
        assert grads and all(n.endswith("@GRAD") for n in grads)
    # the activation leaves stage 0 by a send after its forward, enters stage 1 by a recv
    assert [it.kind for it in g.tasks_of(0)["forward"].items].count("send") == 1
    assert [it.kind for it in g.tasks_of(2)["forward"].items][0] == "recv"
    assert "send" in [it.kind for it in g.tasks_of(2)["backward"].items]
    # stage 0 all-reduces the position embedding's gradient before slice_grad, stage 1 the
    # loss: their processes meet in collectives inside tasks, so each stage has a leader
    assert g.coordinated == (True, True)
    assert "0:forward -> 2:forward remote buffer 2" in g.pretty()
    mlp = plan_of(("mlp", "two_stage", 4), micro_batches=4).task_graph()
    assert mlp.coordinated == (False, True)   # stage 0's gradients only meet in the update
    text = mlp.pretty()
    assert "stage 0 [0, 1]: at most 2 micro-batch(es) in flight; independent" in text
    assert "stage 1 [2, 3]: at most 1 micro-batch(es) in flight; coordinated by process 2" \
        in text


def test_zero_bubble_splits_backward_into_input_and_weight_gradients():
    p = plan_of(("gpt", "two_stage", 2), micro_batches=4, schedule="ZB")
    g = p.task_graph()
    for pid in (0, 1):
        tasks = g.tasks_of(pid)
        assert {"backward_input", "backward_weight"} <= set(tasks)
        ops = p.local(pid).program.ops
        made_by_w = {o.name for it in tasks["backward_weight"].items if it.kind == "op"
                     for o in ops[it.index].outputs}
        read_by_b = {v.name for it in tasks["backward_input"].items if it.kind == "op"
                     for v in ops[it.index].inputs}
        assert made_by_w and not made_by_w & read_by_b    # B never waits for W
        assert set(tasks["backward_weight"].accumulates) <= made_by_w | set(
            tasks["backward_input"].accumulates) | made_by_w
    sends = [it for it in g.tasks_of(1)["backward_input"].items if it.kind == "send"]
    assert sends and not [it for it in g.tasks_of(1)["backward_weight"].items
                          if it.kind == "send"]
    weight_ops = [p.local(1).program.ops[it.index].type
                  for it in g.tasks_of(1)["backward_weight"].items if it.kind == "op"]
    assert "matmul" in weight_ops           # x^T dY of the linear layers


def test_tensor_parallel_stages_are_coordinated():
    g = plan_of(("gpt", "two_stage_tp", 4), micro_batches=2).task_graph()
    assert g.coordinated == (True, True)
    assert g.leader(0) == 0 and g.leader(1) == 2


def test_overlapping_stages_are_refused():
    a, b = dg.ProcessMesh([0, 1], ["dp"]), dg.ProcessMesh([1, 2], ["dp"])
    model = P.build_model("mlp")
    model.hooks.wraps["stage0"] = lambda fn: dg.shard_op(fn, a)
    model.hooks.wraps["stage1"] = lambda fn: dg.shard_op(fn, b)
    ins, labels = dg.app.data.DataLoader(P.Dataset("mlp"), 8).specs(1)
    built = build_program(model, ins, labels, P.loss_fn("mlp"), P.make_optimizer("sgd"))
    with pytest.raises(dg.PlanError, match="process 1 belongs to stages"):
        dg.passes.plan(built, dg.Strategy(micro_batches=2))
