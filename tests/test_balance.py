"""``Strategy(balance=True)`` on the planning side: the split of a plan's batch over its
data-parallel groups (rows in proportion to speed, whole micro-batches, within memory),
``Plan.batch_split`` and ``Plan.explain()``, and an estimate that prices each process's
share. Oracles: a share of an even plan costs what the even plan of that many rows
costs; the planned split is the best of every split under the estimate's linear model;
an even split reads the rows the even plan reads; a balanced plan on equal devices
trains as serial."""

import dataclasses
import os
import sys
from types import MappingProxyType

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402
from distgraph.errors import PlanError  # noqa: E402
from distgraph.passes.cost.estimate import price_process  # noqa: E402
from distgraph.passes.cost.shares import Share  # noqa: E402
from distgraph.passes.samples import sample_axes  # noqa: E402
from distgraph.program_builder import build_program  # noqa: E402
from distgraph.runtime.comm.simulated import SimulatedWorld  # noqa: E402

import plans as P  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIXED_2X1 = os.path.join(ROOT, "resources", "clusters", "emulated_mixed_2x1.yaml")
MIXED_2X2 = os.path.join(ROOT, "resources", "clusters", "emulated_mixed_2x2.yaml")
# big enough that a row's compute outweighs the cost of launching the ops
MLP = dict(seq=16, d_in=128, hidden=512, d_out=128)
GPT = dict(vocab_size=256, d_model=128, n_layer=2, n_head=4, max_seq_len=16)


def planned(kind, plan_name, nprocs, cluster, batch=16, dims=None, rank_mapping=None,
            whole=False, **strategy):
    """(engine, its plan); ``whole``: (None, the planner's plan with every process's
    program compiled, where an Engine compiles its own rank's)."""
    model = P.build_model(kind, dims=dims)
    factory = (P.PLANS.get((kind, plan_name, nprocs)) or
               P.PIPELINE_PLANS[kind, plan_name, nprocs])
    factory.annotate(model)
    data = P.Dataset(kind, n=batch, dims=dims, batch=batch)
    ins, labels = dg.app.data.DataLoader(data, batch).specs(1)
    if whole:
        built = build_program(model, ins, labels, P.loss_fn(kind), P.make_optimizer("adamw"))
        return None, dg.passes.plan(built, dg.Strategy(**strategy), cluster, rank_mapping)
    engine = dg.Engine(model, P.loss_fn(kind), P.make_optimizer("adamw"), cluster=cluster,
                       strategy=dg.Strategy(**strategy), rank_mapping=rank_mapping)
    return engine, engine.prepare(ins, labels)


def test_balance_is_off_by_default_and_changes_nothing():
    cluster = dg.Cluster.from_file(MIXED_2X1)
    _, plain = planned("mlp", "dp", 2, cluster)
    assert dg.Strategy().balance is False
    # a plan on a cluster carries the estimate it was checked to fit by, nothing split
    assert plain.batch_split is None and plain.estimate is not None
    assert "batch split" not in plain.explain() and "batch_split" not in plain.to_dict()


@pytest.mark.parametrize("kind, dims", [("mlp", MLP), ("gpt", GPT)])
def test_a_half_speed_device_gets_fewer_rows_and_the_step_gets_shorter(kind, dims):
    cluster = dg.Cluster.from_file(MIXED_2X1)
    _, even = planned(kind, "dp", 2, cluster, 32, dims)
    _, bal = planned(kind, "dp", 2, cluster, 32, dims, balance=True)
    split = bal.batch_split
    fast, slow = (split.row_count(p) for p in (0, 1))
    assert fast + slow == 32 and fast > slow >= 1
    assert split.rows(0) == ((0, fast),) and split.rows(1) == ((fast, 32),)
    before = dg.passes.estimate(even, cluster)
    assert bal.estimate.step_time < before.step_time
    # the busy times, not the device, now set the step: both within a row's work
    busy = [p.busy for p in bal.estimate.processes]
    assert max(busy) < max(p.busy for p in before.processes)
    text = bal.explain(full=True)
    assert f"processes 1: {slow} rows (rows {fast}-32" in text and "SCIP optimal" in text
    assert f"fewest rows {slow} (processes 1), most {fast} (processes 0)" in bal.explain()
    assert bal.to_dict()["batch_split"]["members"][1]["rows"] == slow


def test_the_split_is_the_best_of_every_split_under_the_linear_model():
    cluster = dg.Cluster.from_file(MIXED_2X1)
    _, bal = planned("mlp", "dp", 2, cluster, 24, MLP, balance=True)
    split = bal.batch_split
    plan = dataclasses.replace(bal, batch_split=None)
    lines = []
    for pid in (0, 1):
        lo, hi = (price_process(plan, pid, cluster, Share(rows=r / 12, mesh_dims=("dp",)))[0]
                  for r in (6, 18))
        slope = (hi.busy - lo.busy) / 12
        lines.append((lo.busy - 6 * slope, slope))
    best = min(max(a + b * u for (a, b), u in zip(lines, (u0, 24 - u0)))
               for u0 in range(1, 24))
    assert split.report.busiest == pytest.approx(best, rel=1e-6)


def test_a_share_costs_what_an_even_plan_of_that_many_rows_costs():
    # process 0 with 24 of 32 rows is priced as a process of an even plan of 48 rows
    cluster = dg.Cluster.from_file(MIXED_2X1)
    for kind, dims in (("mlp", MLP), ("gpt", GPT)):
        _, p32 = planned(kind, "dp", 2, cluster, 32, dims)
        axes = sample_axes(p32.program, p32.built.feed_names)
        p32 = dataclasses.replace(p32, sample_axes=MappingProxyType(axes))
        _, p48 = planned(kind, "dp", 2, cluster, 48, dims)
        share = price_process(p32, 0, cluster, Share(rows=24 / 16, mesh_dims=("dp",)))[0]
        whole = price_process(p48, 0, cluster)[0]
        assert share.compute == pytest.approx(whole.compute, rel=1e-9)
        assert share.communication == pytest.approx(whole.communication, rel=1e-9)
        assert share.activations == whole.activations and share.gradients == whole.gradients


def test_an_even_split_reads_the_rows_the_runtime_reads():
    cluster = dg.Cluster.local(4)
    for name in ("dp", "dp_tp"):
        _, plan = planned("gpt", name, 4, cluster, 16, balance=True)
        split = plan.batch_split
        assert split.is_even
        tokens = plan.program.values[plan.built.feed_names[0]]
        for pid in plan.process_ids:
            rows = tokens.dist_attr.local_slices(tokens.shape, pid)[0]
            assert split.rows(pid) == ((rows.start, rows.stop),)
        if name == "dp_tp":
            assert split.members == ((0, 1), (2, 3)) and split.mesh_dims == ("dp",)


def test_micro_batches_are_the_granule():
    cluster = dg.Cluster.from_file(MIXED_2X1)
    _, bal = planned("mlp", "dp", 2, cluster, 32, MLP, balance=True, micro_batches=4)
    split = bal.batch_split
    assert split.micro_batched and split.granule == 4          # 32 rows / 4 / 2 groups
    counts = [split.micro_batches(p) for p in (0, 1)]
    assert sum(counts) == 8 and counts[0] > counts[1] >= 1
    assert sorted(r for p in (0, 1) for r in split.rows(p)) == \
        [(k, k + 4) for k in range(0, 32, 4)]
    assert bal.estimate.step_time < dg.passes.estimate(
        dataclasses.replace(bal, batch_split=None), cluster).step_time


def test_a_pipeline_splits_every_stage_alike():
    cluster = dg.Cluster.from_file(MIXED_2X2)
    _, bal = planned("mlp", "two_stage", 4, cluster, 32, MLP, balance=True, micro_batches=2)
    split = bal.batch_split
    stage0, stage1 = bal.stages
    assert len(split.members) == 2
    for member in split.members:
        assert len([p for p in member if p in stage0]) == 1
        assert len([p for p in member if p in stage1]) == 1


def test_memory_bounds_the_split_and_too_little_names_the_devices():
    base = dg.Cluster.from_file(MIXED_2X1)
    _, bal = planned("mlp", "dp", 2, base, 32, MLP, balance=True)
    free = bal.batch_split.row_count(0)
    peaks = [p.peak_memory for p in bal.estimate.processes]
    per_row = (peaks[0] - peaks[1]) / (2 * free - 32)
    fixed = peaks[0] - per_row * free
    # the fast device holds 4 rows fewer than it would take
    small = _with_memory(base, 0, (fixed + (free - 3.5) * per_row) / 1e9)
    _, capped = planned("mlp", "dp", 2, small, 32, MLP, balance=True)
    assert capped.batch_split.row_count(0) == free - 4
    # the rank mapper checks the even split; placed by hand, the split's own check speaks
    ten = (fixed + 10.5 * per_row) / 1e9
    tiny = _with_memory(_with_memory(base, 0, ten), 1, ten)
    with pytest.raises(PlanError, match=r"devices' memory holds 20 rows of the batch's 32 "
                                        r"\(devices \[0\]: 10, devices \[1\]: 10\)"):
        planned("mlp", "dp", 2, tiny, 32, MLP, rank_mapping={0: 0, 1: 1}, balance=True)


def _with_memory(cluster, device, gb):
    machines = []
    for m in cluster.machines:
        devices = tuple(dataclasses.replace(d, memory=gb) if d.global_id == device else d
                        for d in m.devices)
        machines.append(dataclasses.replace(m, devices=devices))
    return dg.Cluster(tuple(machines), tuple(cluster.links), name=cluster.name)


def test_a_plan_that_splits_no_batch_cannot_be_balanced():
    with pytest.raises(PlanError, match="does not split dim 0 of every input"):
        planned("mlp", "tp", 2, dg.Cluster.local(2), balance=True)
    with pytest.raises(PlanError, match="does not split dim 0"):
        built = dg.program_builder.build_program(
            P.build_model("mlp"), [dg.InputSpec([8, 4, 8], name="x")],
            [dg.InputSpec([8, 4, 4], name="y")], P.loss_fn("mlp"), P.make_optimizer("sgd"))
        dg.passes.plan(built, dg.Strategy(balance=True))


def test_a_balanced_plan_on_equal_devices_trains_as_serial():
    previous = dg.get_default_dtype()
    dg.set_default_dtype("float64")
    try:
        reference = P.serial_reference("gpt")
        models = [P.build_model("gpt") for _ in range(2)]
        for m in models:
            P.PLANS["gpt", "dp", 2].annotate(m)

        def rank(comm):
            engine = dg.Engine(models[comm.rank], P.loss_fn("gpt"), P.make_optimizer("adamw"),
                               cluster=dg.Cluster.local(2), communicator=comm,
                               strategy=dg.Strategy(balance=True))
            P.prepare(engine, "gpt")
            assert engine.plan().batch_split.is_even
            history = engine.fit(P.Dataset("gpt"), batch_size=P.BATCH)
            return history.losses, engine.state_dict()

        for result in SimulatedWorld(2, timeout=60).run(rank):
            errors = P.compare(result, reference, "float64")
            assert errors["loss"] <= 1e-10 and errors["param"] <= 1e-10, errors
    finally:
        dg.set_default_dtype(previous)
