"""``Strategy(balance=True)`` on real MPI ranks (``python -m distgraph.cli run``): on the
mixed-speed cluster files the balanced split is uneven, and training, evaluation and
prediction equal serial whole-batch runs (float64, 1e-10) for the MLP and GPT-tiny, split
by rows and by micro-batches, data parallel, dp x mp and over two pipeline stages; a
checkpoint saved under an uneven split resumes exactly; ``balance=False`` plans as
before (no split, every process the plan's micro-batches)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
SCRIPT = Path(__file__).parent / "mpi_scripts" / "balanced_training.py"
MIXED_2X1 = ROOT / "resources" / "clusters" / "emulated_mixed_2x1.yaml"
MIXED_2X2 = ROOT / "resources" / "clusters" / "emulated_mixed_2x2.yaml"
TOLERANCE = 1e-10


def run_items(nprocs, cluster, items):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "distgraph.cli", "run", "-n", str(nprocs),
                           str(SCRIPT), str(cluster), *items], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("BALANCE-RESULT ")]
    assert len(lines) == 1, proc.stdout[-3000:]
    report = json.loads(lines[0].split(" ", 1)[1])
    assert report["world"] == nprocs and sorted(report["runs"]) == sorted(items)
    return report["runs"]


def check_equal_to_serial(item, ranks):
    for rank, mine in enumerate(ranks):
        assert mine["losses"] == ranks[0]["losses"], f"{item}: rank {rank} reports other losses"
        errors = mine["errors"]
        assert errors["steps"] == 3, (item, errors)
        assert errors["accuracy"] == 0.0, (item, rank, errors)     # every row, in order
        for what in ("loss", "param", "eval", "predict"):
            assert errors[what] <= TOLERANCE, (item, rank, what, errors)


def check_uneven(item, run, micro_batched):
    for key in ("split", "eval_split"):
        split = run[key]
        assert split is not None and not split["even"], (item, key, split)
        assert split["micro_batched"] == micro_batched, (item, split)
        assert split["units"][0] > split["units"][-1], (item, split)   # the fast group more
    if micro_batched:
        split = run["split"]
        counts = {p: u for m, u in zip(split["members"], split["units"]) for p in m}
        assert run["micro_batches"] == [counts[p] for p in sorted(counts)]


TWO = ["mlp:dp:1:on", "mlp:dp:4:on", "gpt:dp:1:on", "gpt:dp:4:on"]


@pytest.mark.mpi
def test_balanced_training_on_two_mpi_ranks_of_mixed_speed_equals_serial(tmp_path):
    items = TWO + ["gpt:dp:4:off", f"resume:{tmp_path}"]
    runs = run_items(2, MIXED_2X1, items)
    for item in TWO:
        check_equal_to_serial(item, runs[item])
        check_uneven(item, runs[item][0], micro_batched=item.split(":")[2] != "1")
    off = runs["gpt:dp:4:off"]
    check_equal_to_serial("gpt:dp:4:off", off)
    assert off[0]["split"] is None and off[0]["micro_batches"] == [4, 4]
    for rank, resume in enumerate(runs[f"resume:{tmp_path}"]):
        assert not resume["split"]["even"]
        assert resume["first"] == resume["full"][:5] and resume["steps"] == [5, 6, 7]
        assert resume["resumed"] == resume["full"][5:], rank
        assert resume["same_names"] and resume["state_error"] == 0.0, rank


FOUR = ["gpt:dp_tp:1:on:0,1,2,3", "gpt:dp_tp:4:on:0,1,2,3", "gpt:two_stage:4:on:0,2,1,3",
        "mlp:two_stage:1:on:0,2,1,3"]


@pytest.mark.mpi
@pytest.mark.slow
def test_balanced_dp_mp_and_pipelines_on_four_mpi_ranks_equal_serial():
    """dp x mp (the tensor-parallel pair of the slow machine reads fewer rows) and two
    stages (each stage data parallel; processes 1 and 3, a data-parallel group of both
    stages, on the slow machine by the given mapping)."""
    runs = run_items(4, MIXED_2X2, FOUR)
    for item in FOUR:
        check_equal_to_serial(item, runs[item])
        check_uneven(item, runs[item][0], micro_batched=item.split(":")[2] != "1")
