"""Plan as a value: ``dg.passes.plan`` is pure, needs no running job, and is what the
runtime consumes; Strategy options that are not available raise instead of being ignored."""

import json

import numpy as np
import pytest

import distgraph as dg
from distgraph.passes.partition import partition
from distgraph.program_builder import build_program
from distgraph.runtime.comm.simulated import SimulatedWorld

MESH = dg.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])


class MLP(dg.nn.Layer):
    def __init__(self, mesh=MESH):
        super().__init__()
        self.mesh = mesh
        self.fc1, self.fc2 = dg.nn.Linear(8, 16), dg.nn.Linear(16, 4)
        if mesh is not None:
            dg.shard_tensor(self.fc1.weight, mesh, [None, "mp"])
            dg.shard_tensor(self.fc2.weight, mesh, ["mp", None])

    def forward(self, x):
        if self.mesh is not None:
            dg.shard_tensor(x, self.mesh, ["dp", None])
        return self.fc2(dg.ops.relu(self.fc1(x)))


class Data:
    def __init__(self):
        rng = np.random.default_rng(0)
        self.x, self.y = rng.normal(size=(16, 8)), rng.normal(size=(16, 4))

    def __len__(self):
        return 16

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def built(mesh=MESH):
    return build_program(MLP(mesh), [dg.InputSpec([8, 8], name="x")],
                         [dg.InputSpec([8, 4], name="y")], dg.nn.MSELoss(),
                         dg.optim.Adam(0.01))


def test_plan_leaves_the_built_program_untouched():
    b = built()
    before = b.program.pretty()
    annotations = {n: v.annotation for n, v in b.program.values.items()}
    p = dg.passes.plan(b, dg.Strategy(sharding=True))
    assert b.program.pretty() == before
    assert all(v.dist_attr is None for v in b.program.values.values())
    assert {n: v.annotation for n, v in b.program.values.items()} == annotations
    assert p.program is not b.program and p.distributed and p.world_size == 4
    assert all(v.dist_attr is not None for v in p.program.values.values())


def test_planning_pauses_the_cyclic_collector_and_leaves_it_as_found(monkeypatch):
    """The collector is off while planning (the compile step sees it off)
    and as the caller left it after, an error included; the plan is the same."""
    import gc

    from distgraph.passes import planner

    seen = []
    real = planner._compiled
    monkeypatch.setattr(planner, "_compiled",
                        lambda *a: seen.append(gc.isenabled()) or real(*a))
    b = built()
    was = gc.isenabled()
    try:
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()
            p = dg.passes.plan(b, dg.Strategy(sharding=True))
            assert gc.isenabled() is enabled
            assert p.to_json() == dg.passes.plan(b, dg.Strategy(sharding=True)).to_json()
            with pytest.raises(dg.PlanError):
                dg.passes.plan(b, dg.Strategy(micro_batches=3))
            assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
    assert seen and not any(seen)


def test_two_plans_of_one_program_differ_and_do_not_interfere():
    b = built()
    plain = dg.passes.plan(b)
    zero = dg.passes.plan(b, dg.Strategy(sharding=True))
    state = next(n for n in plain.program.values if n.startswith("fc1.weight@MOMENT1"))
    assert str(plain.program.values[state].dist_attr.spec) == "[None, mp]"
    assert str(zero.program.values[state].dist_attr.spec) == "[dp, mp]"
    kinds = {s.kind for p in zero.reshards() for s in p.steps}
    assert "reduce_scatter" in kinds
    assert "reduce_scatter" not in {s.kind for p in plain.reshards() for s in p.steps}


def test_local_programs_and_bytes_come_from_the_partition():
    p = dg.passes.plan(built())
    for pid in p.process_ids:
        local = p.local(pid)
        assert local is p.local(pid)                       # partitioned once
        fresh = partition(p.program, pid)
        assert local.pretty() == fresh.pretty()
        assert p.bytes_sent()[pid] == fresh.bytes_sent()
    seqs = [pt.seq for pt in p.reshards()]
    assert seqs == sorted(set(seqs))
    every = {pt.seq for pid in p.process_ids for pt in p.local(pid).points()}
    assert set(seqs) == every


def test_explain_and_json_describe_the_plan():
    p = dg.passes.plan(built())
    assert "4 process(es), distributed" in p.explain()
    text = p.explain(full=True)              # the full listing: every parameter and reshard
    assert "4 process(es), distributed" in text
    assert "fc1.weight [8, 16] [None, mp]" in text
    assert "reshards:" in text
    data = json.loads(p.to_json())
    assert data["processes"] == [0, 1, 2, 3]
    assert data["parameters"]["fc2.weight"]["spec"] == "[mp, None]"
    assert data["stages"] == [{"process_ids": [0, 1, 2, 3], "shape": [2, 2],
                               "dim_names": ["dp", "mp"]}]
    assert sum(r["bytes"] for r in data["reshards"]) > 0


def test_stages_are_the_meshes_in_data_flow_order():
    first, second = dg.ProcessMesh([2, 3], ["dp"]), dg.ProcessMesh([0, 1], ["dp"])

    class TwoStage(dg.nn.Layer):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = dg.nn.Linear(8, 16), dg.nn.Linear(16, 4)

        def forward(self, x):
            y = dg.shard_op(self.fc1, first, in_shard_specs=[["dp", None]])(x)
            return dg.shard_op(self.fc2, second, in_shard_specs=[["dp", None]])(y)

    b = build_program(TwoStage(), [dg.InputSpec([8, 8], name="x")],
                      [dg.InputSpec([8, 4], name="y")], dg.nn.MSELoss(), dg.optim.SGD(0.1))
    assert dg.passes.plan(b).stages == (first, second)


def test_prepare_plans_without_a_job_and_running_checks_the_world():
    engine = dg.Engine(MLP(), dg.nn.MSELoss(), dg.optim.Adam(0.01))
    p = engine.prepare([dg.InputSpec([8, 8], name="x")], [dg.InputSpec([8, 4], name="y")])
    assert p is engine.plan() and p.world_size == 4      # no communicator was needed

    world = SimulatedWorld(2)
    engines = [dg.Engine(MLP(), dg.nn.MSELoss(), dg.optim.Adam(0.01),
                         communicator=world.communicator(r)) for r in range(2)]
    for e in engines:            # tracing is not thread-safe: plan before the threads start
        e.prepare([dg.InputSpec([8, 8], name="input_0")], [dg.InputSpec([8, 4], name="label_0")])
    with pytest.raises(dg.PlanError, match="needs 4 processes"):
        world.run(lambda comm: engines[comm.rank].fit(Data(), batch_size=8))


def test_serial_plans_run_on_one_process():
    p = dg.passes.plan(built(mesh=None))
    assert not p.distributed and p.world_size == 1 and p.rank_of is None
    assert "1 process(es), serial" in p.explain()


def test_rank_mapping_is_part_of_the_plan():
    p = dg.passes.plan(built(), cluster=dg.Cluster.local(4),
                       rank_mapping={0: 3, 1: 2, 2: 1, 3: 0})
    assert dict(p.rank_of) == {0: 3, 1: 2, 2: 1, 3: 0}
    assert [p.ranks.process(r) for r in range(4)] == [3, 2, 1, 0]
    with pytest.raises(dg.PlanError, match="exactly one"):
        dg.passes.plan(built(), cluster=dg.Cluster.local(4), rank_mapping={0: 0, 1: 0, 2: 1, 3: 2})


@pytest.mark.parametrize("options", [
    dict(auto_mode="full"), dict(pipeline=True), dict(memory_budget_gb=1.0),
    dict(solver_time_limit=5.0), dict(sharding_mesh_dim="x"),
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_options_that_would_mean_nothing_raise(options):
    """A search option without the search (or without the cluster it searches for), a
    sharding dim without sharding: refused, not ignored. (A schedule without micro-batches
    orders the one micro-batch: ZB splits its backward, tests/test_pipeline.py.)"""
    with pytest.raises(dg.PlanError, match=next(iter(options))):
        dg.passes.plan(built(), dg.Strategy(**options))


def test_sharding_needs_a_data_parallel_dim():
    with pytest.raises(dg.PlanError, match="no annotations"):
        dg.passes.plan(built(mesh=None), dg.Strategy(sharding=True))
    with pytest.raises(dg.PlanError, match="sharding_mesh_dim"):
        dg.passes.plan(built(), dg.Strategy(sharding=True, sharding_mesh_dim="pp"))
    evaluation = build_program(MLP(), [dg.InputSpec([8, 8], name="x")],
                               [dg.InputSpec([8, 4], name="y")], dg.nn.MSELoss(), mode="eval")
    assert dg.passes.plan(evaluation, dg.Strategy(sharding=True)).distributed  # no updates
