"""ZeRO chosen per update by the search (passes/search/layouts/sharded_states.py): with
``Strategy(sharding=None)`` each update is offered with and without ZeRO's slice in one
problem, and the planner shards the chosen updates only (``plan.decisions.zero_params``).

Oracles: the plan of every other subset of the updates sharded, made from the plan's own
file with that subset written in, is estimated no faster (brute force over all 2^4
subsets of a two-layer MLP); the plan shards exactly the updates it names (their states
split over the dim, the others' not); the plan sharding some updates trains on 4 real
MPI ranks as on one process (float64, 1e-10).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import distgraph as dg
from distgraph.errors import PlanError
from distgraph.passes.plan_file import load
from distgraph.passes.transforms.zero import shard_updates, updated_parameter
from distgraph.plan.file import read
from distgraph.program_builder import build_program
from distgraph.registry import get_op
from distgraph.trace import InputSpec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import search_cases as S  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).parent / "mpi_scripts" / "zero_chosen.py"
MESH = dg.ProcessMesh([0, 1, 2, 3], dim_names=["x"])


def mlp():
    """An MLP of two Linear layers with AdamW, its parameters kept whole on the search's mesh (so the
    search chooses only how the batch splits and which updates ZeRO shards)."""
    dg.seed(0)
    model = dg.nn.MLP(1024, 1024, 1024)
    for p in model.parameters():
        dg.shard_tensor(p, MESH, [None] * len(p.shape))
    return build_program(model, [InputSpec([8, 1024], name="x")],
                         [InputSpec([8, 1024], name="y")], dg.nn.MSELoss(),
                         dg.optim.AdamW(1e-3))


def states_split(plan, dim: str) -> dict:
    """{parameter: whether its update's optimizer states are split over ``dim`` where the
    parameter is not} of a completed plan."""
    out = {}
    for op in plan.program.ops:
        param = updated_parameter(plan.program, op)
        if param is None:
            continue
        kept = set(param.dist_attr.spec.mesh_dims())
        out[param.name] = any(dim in set(op.inputs[i].dist_attr.spec.mesh_dims()) - kept
                              for _, i in get_op(op.type).inplace if i > 0)
    return out


def with_zero(data: dict, names) -> dict:
    """A plan file's data with ZeRO over x on the updates of ``names`` only (none: off),
    its result's figures left for the plan made from it to say."""
    data = json.loads(json.dumps(data))
    data["strategy"]["sharding"] = bool(names)
    data["decisions"]["zero_dim"] = "x" if names else None
    data["decisions"]["zero_params"] = sorted(names) if names else None
    data["result"]["step_time"] = data["result"]["peak_memory"] = None
    return data


def test_the_updates_sharded_are_the_fastest_subset(tmp_path):
    """Searched with ZeRO left to it on 4 fast-linked devices: the big weights' updates
    are sharded (a slice's update saves more than a second collective's latency costs)
    and the biases' not; the plan of each of the 16 subsets, made from the plan's file,
    is estimated no faster, and each shards exactly the updates it names."""
    built = mlp()
    cluster = S.line_cluster(4, 100, 5)
    plan = dg.passes.plan(built, dg.Strategy(auto_mode="full", recompute=False,
                                             sequence_parallel=False), cluster, ranks=())
    chosen = set(plan.decisions.zero_params)
    assert chosen == {"fc1.weight", "fc2.weight"}, chosen       # the premise: a real choice
    assert plan.strategy.sharding is True
    assert plan.search.step_time == pytest.approx(plan.estimate.step_time, rel=0.01)
    path = tmp_path / "plan.json"
    plan.save(path)
    data = json.loads(path.read_text())
    names = sorted(states_split(plan, "x"))
    assert len(names) == 4
    times = {}
    for k in range(len(names) + 1):
        for subset in itertools.combinations(names, k):
            edited = tmp_path / f"subset{len(times)}.json"
            edited.write_text(json.dumps(with_zero(data, subset)))
            other = load(read(edited), built, cluster, ranks=())
            assert states_split(other, "x") == {n: n in subset for n in names}
            times[subset] = other.estimate.step_time
    assert times[tuple(sorted(chosen))] == pytest.approx(plan.estimate.step_time, rel=1e-12)
    fastest = min(times.values())
    assert plan.estimate.step_time <= fastest * (1 + 1e-12), times
    assert times[()] > plan.estimate.step_time and times[tuple(names)] > plan.estimate.step_time


def test_a_name_no_update_updates_is_refused():
    completed = dg.passes.plan(mlp(), dg.Strategy(), None).program    # as annotated
    with pytest.raises(PlanError, match=r"ZeRO is asked to shard the updates of \['fc9'\]"):
        shard_updates(completed, "x", only={"fc9", "fc1.weight"})


def _run(*args) -> dict:
    proc = subprocess.run([sys.executable, "-m", "distgraph.cli", "run", *map(str, args)],
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("ZERO-CHOSEN ")), None)
    assert proc.returncode == 0 and line is not None, (proc.stdout[-2000:], proc.stderr[-3000:])
    return json.loads(line[len("ZERO-CHOSEN "):])


@pytest.mark.slow
@pytest.mark.mpi
def test_a_plan_sharding_some_updates_trains_on_four_ranks_as_serially(tmp_path, job_trace):
    """The MLP above in float64, its plan made by each of 4 real MPI ranks (some updates
    sharded, a bias's not), trains to the losses and parameters of one process
    (1e-10)."""
    (tmp_path / "serial").mkdir()
    serial = _run("-n", 1, SCRIPT, tmp_path / "serial", "--serial")
    got = _run("-n", 4, SCRIPT, tmp_path)
    sharded = got["zero_params"]
    assert got["world"] == 4 and "fc1.weight" in sharded and len(sharded) < 4, sharded
    assert np.allclose(got["losses"], serial["losses"], rtol=1e-10, atol=0)
    want, have = np.load(tmp_path / "serial" / "params.npz"), np.load(tmp_path / "params.npz")
    assert sorted(want) == sorted(have)
    for name in want:
        assert np.abs(have[name] - want[name]).max() <= 1e-10 * max(1.0, np.abs(want[name]).max())
    job_trace.assert_nothing_left(ran_mpi=True)
