"""Plans the search chose train exactly as serial training does (SimulatedWorld threads,
float64; a real-MPI sample runs in tests/test_spmd_mpi.py), and the Engine finds the
cluster the search plans for."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402
from distgraph.runtime.comm.simulated import SimulatedWorld  # noqa: E402

import plans as P  # noqa: E402



@pytest.mark.parametrize("plan", list(P.AUTO_PLANS.values()), ids=str)
def test_auto_plan_trains_like_serial(plan, float64):
    reference = P.serial_reference(plan.kind)
    models = [P.build_model(plan.kind) for _ in range(plan.nprocs)]
    results = SimulatedWorld(plan.nprocs, timeout=60).run(
        lambda comm: P.train(models[comm.rank], plan.kind, comm, auto=True))
    for rank, result in enumerate(results):
        assert result[0] == results[0][0], f"rank {rank} reports other losses"
        errors = P.compare(result, reference, "float64")
        assert errors["steps"] == P.STEPS
        assert errors["loss"] <= P.TOLERANCE["float64"], (rank, errors)
        assert errors["param"] <= P.TOLERANCE["float64"], (rank, errors)


def test_engine_plans_for_the_cluster_file_of_the_job(tmp_path, monkeypatch):
    cluster = dg.Cluster.local(2)
    path = tmp_path / "two.yaml"
    cluster.save(path)
    monkeypatch.setenv("DISTGRAPH_CLUSTER", str(path))
    engine = P.prepare(P.make_engine(P.build_model("mlp"), "mlp", auto=True), "mlp")
    plan = engine.plan()
    assert plan.world_size == 2 and plan.search is not None
    assert plan.cluster.name == cluster.name
    monkeypatch.delenv("DISTGRAPH_CLUSTER")
    world = SimulatedWorld(4)
    engine = P.prepare(P.make_engine(P.build_model("mlp"), "mlp", world.communicator(0),
                                     auto=True), "mlp")
    assert engine.plan().world_size == 4
