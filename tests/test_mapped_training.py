"""A training step gives identical results under different valid rank mappings."""

import json
import subprocess
from pathlib import Path

import pytest

from distgraph.runtime.launch.launcher import launch_command, rank_env

SCRIPT = Path(__file__).parent / "mpi_scripts" / "mapped_training.py"


@pytest.mark.mpi
def test_identical_results_under_three_mappings():
    proc = subprocess.run(launch_command(4, [str(SCRIPT)]), env=rank_env(), capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["identical"]
    # the explicit mappings really moved processes to other ranks
    moved = [m for m in result["rank_of"] if m and any(int(p) != r for p, r in m.items())]
    assert len(moved) >= 2


def test_evaluation_under_another_rank_mapping_reads_the_trained_parameters():
    """The rank mapper places training's and evaluation's processes apart (their traffic
    differs): evaluating after training moves every parameter to its new rank."""
    import sys

    import distgraph as dg
    from distgraph.runtime.comm.simulated import SimulatedWorld
    sys.path.insert(0, str(Path(__file__).parent))
    import plans as P

    cluster = dg.Cluster.from_file(Path(__file__).parents[1] / "resources" / "clusters" /
                                   "emulated_mixed_2x2.yaml")
    previous = dg.get_default_dtype()
    dg.set_default_dtype("float64")
    try:
        def run(engine):
            engine.fit(P.Dataset("gpt"), batch_size=P.BATCH, verbose=0)
            return engine.evaluate(P.Dataset("gpt", seed=3), batch_size=P.BATCH, verbose=0)

        reference = run(dg.Engine(P.build_model("gpt"), P.loss_fn("gpt"),
                                  P.make_optimizer("adamw")))
        models = [P.build_model("gpt") for _ in range(4)]
        for m in models:
            P.PLANS["gpt", "dp_tp", 4].annotate(m)

        def rank(comm):
            engine = dg.Engine(models[comm.rank], P.loss_fn("gpt"), P.make_optimizer("adamw"),
                               cluster=cluster, communicator=comm)
            P.prepare(engine, "gpt")
            result = run(engine)
            return result, engine.plan("train").rank_of, engine.plan("eval").rank_of

        for result, train_map, eval_map in SimulatedWorld(4, timeout=60).run(rank):
            assert train_map != eval_map
            assert abs(result["loss"] - reference["loss"]) <= 1e-10
    finally:
        dg.set_default_dtype(previous)
