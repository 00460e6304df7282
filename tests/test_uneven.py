"""What runs an uneven balanced split (:mod:`distgraph.passes.balance.uneven`): each
group's local program holds its own rows; the estimate prices them as it priced the even
partitions' shares; with micro-batches the sums over the data-parallel dim wait for the update and
the groups meet nowhere else; per-sample fetches come back in the batch's order; random
ops draw the batch's rows (dropout trains as serial); and a layout that moves samples
between groups is a PlanError at plan time. The MPI runs are tests/test_balance_mpi.py."""

import dataclasses
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402
from distgraph.errors import PlanError  # noqa: E402
from distgraph.passes.balance.batch_split import BatchSplit  # noqa: E402
from distgraph.plan.kinds import ItemKind, TaskKind  # noqa: E402
from distgraph.runtime.comm.simulated import SimulatedWorld  # noqa: E402

import plans as P  # noqa: E402
from test_balance import GPT, MIXED_2X1, MIXED_2X2, MLP, planned  # noqa: E402


def test_each_group_runs_its_own_rows_and_the_estimate_is_unchanged():
    cluster = dg.Cluster.from_file(MIXED_2X1)
    _, even = planned("gpt", "dp", 2, cluster, 32, GPT, whole=True)
    _, bal = planned("gpt", "dp", 2, cluster, 32, GPT, balance=True, whole=True)
    split = bal.batch_split
    assert not split.is_even
    for pid in (0, 1):
        (start, stop), = split.rows(pid)
        program = bal.program_of(pid)
        assert program.batch_rows == ((start, stop),)
        assert {f.name: f.rows for f in program.feeds} == \
            {"input_0": ((start, stop),), "label_0": ((start, stop),)}
        tokens = bal.local(pid).program.inputs[0]
        assert tokens.shape == (stop - start, GPT["max_seq_len"])
        ops = bal.local(pid).program.ops
        assert len(ops) == len(even.local(pid).program.ops)
        # the mean keeps the batch's 1/B: the scale after the loss's sum is unchanged
        assert [op.attrs for op in ops if op.type == "scale"] == \
            [op.attrs for op in even.local(pid).program.ops if op.type == "scale"]
    # the gradients' all-reduce moves what it moved before
    assert bal.bytes_sent() == even.bytes_sent()
    # priced on its own rows, the plan costs what its shares of the even partitions cost
    again = dg.passes.estimate(
        dataclasses.replace(bal, locals=even.locals, groups=even.groups), cluster)
    assert again.step_time == pytest.approx(bal.estimate.step_time, rel=1e-12)
    assert [p.peak_memory for p in again.processes] == \
        [p.peak_memory for p in bal.estimate.processes]


def test_a_pipelines_stages_run_their_groups_rows():
    """Two stages, data parallel each; processes 1 and 3 (a group) on the slow machine."""
    cluster = dg.Cluster.from_file(MIXED_2X2)
    mapping = {0: 0, 2: 1, 1: 2, 3: 3}
    _, even = planned("gpt", "two_stage", 4, cluster, 32, GPT, rank_mapping=mapping)
    _, bal = planned("gpt", "two_stage", 4, cluster, 32, GPT, rank_mapping=mapping,
                     balance=True)
    split = bal.batch_split
    assert split.members == ((0, 2), (1, 3)) and split.units[0] > split.units[1]
    axes = dict(bal.sample_axes)
    for pid in range(4):
        rows = split.row_count(pid)
        held = [(v.shape[axes[v.name]], bal.program.values[v.name].shape[axes[v.name]])
                for v in bal.local(pid).program.values.values() if v.name in axes]
        # every activation holds the group's rows (the samples' share of its sample dim)
        assert held and all(have * 32 == size * rows for have, size in held)
    again = dg.passes.estimate(
        dataclasses.replace(bal, locals=even.locals, groups=even.groups), cluster)
    assert again.step_time == pytest.approx(bal.estimate.step_time, rel=1e-12)


def test_micro_batches_meet_only_in_the_prologue_and_the_update():
    cluster = dg.Cluster.from_file(MIXED_2X1)
    _, bal = planned("gpt", "dp", 2, cluster, 32, GPT, balance=True, micro_batches=4, whole=True)
    split = bal.batch_split
    counts = [split.micro_batches(p) for p in (0, 1)]
    assert counts[0] > counts[1] and [bal.micro_batches_of(p) for p in (0, 1)] == counts
    graph = bal.task_graph()
    assert graph.micro_batches == max(counts)
    for pid in (0, 1):
        acts = bal.schedule()[pid]
        assert sorted({a.micro_batch for a in acts}) == list(range(counts[pid]))
        tasks = graph.tasks_of(pid)
        per_mb = [graph.points[it.index] for t in tasks.values() if t.per_micro_batch
                  for it in t.items if it.kind is ItemKind.POINT]
        assert not [s for p in per_mb for s in p.steps if s.mesh_dim == "dp"]
        prologue = tasks[(None, TaskKind.PROLOGUE)]       # the label count, reduced once
        assert [graph.points[it.index].value for it in prologue.items] == ["sum_0"]
        update = [graph.points[it.index].value for it in tasks[(None, TaskKind.UPDATE)].items
                  if it.kind is ItemKind.POINT]
        # the positional embedding's gradient was summed per micro-batch before: now once
        assert "wpe.weight@GRAD" in update
    assert bal.program.values["divide_0"].dist_attr.spec.partial == {"dp"}   # the loss
    # each micro-batch draws the batch's rows: granule j of the batch at position (j-g)/n
    for pid in (0, 1):
        positions = bal.program_of(pid).positions
        rows = split.rows(pid)
        assert [p * 2 * split.granule + pid * split.granule for p in positions] == \
            [start for start, _ in rows]


def test_per_sample_fetches_come_back_in_the_batchs_order():
    from distgraph.passes.balance.uneven import _row_gathers
    split = BatchSplit(4, 1, True, ("dp",), ((0,), (1,)), (3, 1))
    assert split.rows(0) == ((0, 1), (2, 3), (3, 4)) and split.rows(1) == ((1, 2),)

    class Plan:            # the two facts _row_gathers reads of a plan
        program = dg.ir.Program()
        built = None

    value = dg.ir.Value("out", (2, 5), "float64")
    mesh = dg.ProcessMesh([0, 1], ["dp"])
    value.dist_attr = dg.DistAttr(mesh, dg.ShardSpec(["dp", None]))
    feed = dg.ir.Value("x", (2, 3), "float64")
    Plan.program.values.update({"out": value, "x": feed})
    Plan.built = type("Built", (), {"feed_names": ["x"], "fetch_names": ["out"]})
    gather = _row_gathers(Plan, split, {"out": 0})["out"]
    # process 0 holds granules 0, 2, 3, process 1 granule 1, each padded to 3
    assert gather.pad == 3 and gather.shape == (6, 5)
    assert gather.take == (0, 3, 1, 2)


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_dropout_under_an_uneven_split_trains_as_serial(float64, micro_batches):
    reference = P.train(P.build_model("gpt", dropout=0.1), "gpt")
    models = [P.build_model("gpt", dropout=0.1) for _ in range(2)]
    for m in models:
        P.PLANS["gpt", "dp", 2].annotate(m)

    def rank(comm):
        engine = dg.Engine(models[comm.rank], P.loss_fn("gpt"), P.make_optimizer("adamw"),
                           cluster=dg.Cluster.from_file(MIXED_2X1), communicator=comm,
                           strategy=dg.Strategy(balance=True, micro_batches=micro_batches))
        P.prepare(engine, "gpt")
        assert not engine.plan().batch_split.is_even
        history = engine.fit(P.Dataset("gpt"), batch_size=P.BATCH, verbose=0)
        return history.losses, engine.state_dict()

    for result in SimulatedWorld(2, timeout=60).run(rank):
        errors = P.compare(result, reference, "float64")
        assert errors["loss"] <= 1e-10 and errors["param"] <= 1e-10, errors


def _replicated_hidden(micro_batches):
    """The MLP with its hidden activation gathered whole on every process."""
    model = P.build_model("mlp", dims=MLP)
    mesh = dg.ProcessMesh([0, 1], ["dp"])
    for where, spec in (("input", ["dp", None, None]), ("hidden", [None, None, None]),
                        ("output", ["dp", None, None])):
        P._set_act(model, where, mesh, spec)
    data = P.Dataset("mlp", n=32, dims=MLP, batch=32)
    ins, labels = dg.app.data.DataLoader(data, 32).specs(1)
    engine = dg.Engine(model, P.loss_fn("mlp"), P.make_optimizer("adamw"),
                       cluster=dg.Cluster.from_file(MIXED_2X1),
                       strategy=dg.Strategy(balance=True, micro_batches=micro_batches))
    return engine.prepare(ins, labels)


def test_samples_moving_between_groups_are_refused_at_plan_time():
    with pytest.raises(PlanError, match=r"relu_0 \[32, 16, 512\], whose dim 0 carries the "
                                        r"samples, as \[None, None, None\]"):
        _replicated_hidden(1)
    with pytest.raises(PlanError, match=r"different numbers of micro-batches .*add_0 is "
                                        r"resharded \[dp, None, None\] -> \[None, None, None\] "
                                        r"\(all_gather over dp\) in every micro-batch's "
                                        r"forward task"):
        _replicated_hidden(2)


def test_a_sample_dim_split_over_dp_then_mp_is_split_in_multiples_of_mp_rows(float64):
    """The hidden activation's rows are split over dp and, inside each group, over mp:
    a group's rows must divide by mp, so the granule is two rows."""
    def annotate(model):
        mesh = dg.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
        for where, spec in (("input", ["dp", None, None]), ("hidden", [("dp", "mp"), None, None]),
                            ("output", ["dp", None, None])):
            P._set_act(model, where, mesh, spec)

    reference = P.train(P.build_model("mlp"), "mlp")
    models = [P.build_model("mlp") for _ in range(4)]
    for m in models:
        annotate(m)

    def rank(comm):
        engine = dg.Engine(models[comm.rank], P.loss_fn("mlp"), P.make_optimizer("adamw"),
                           cluster=dg.Cluster.from_file(MIXED_2X2), communicator=comm,
                           rank_mapping={p: p for p in range(4)},
                           strategy=dg.Strategy(balance=True))
        P.prepare(engine, "mlp")
        split = engine.plan().batch_split
        assert split.granule == 2 and not split.is_even
        history = engine.fit(P.Dataset("mlp"), batch_size=P.BATCH, verbose=0)
        return history.losses, engine.state_dict()

    for result in SimulatedWorld(4, timeout=60).run(rank):
        errors = P.compare(result, reference, "float64")
        assert errors["loss"] <= 1e-10 and errors["param"] <= 1e-10, errors
