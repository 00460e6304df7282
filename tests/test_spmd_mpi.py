"""A sample of the plan matrix on real MPI ranks (``python -m distgraph.cli run -n N``, the
``distgraph run`` command): every rank's ``History.losses`` and parameters equal serial
training, the losses are the same on every rank, and ZeRO's partitioned program
reduce-scatters gradients and all-gathers parameters. A plan the search chooses in
``fit`` is searched on rank 0 only, every other rank making the same plan from its
decisions; where rank 0's search fails, every rank raises its error."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "mpi_scripts" / "train_plans.py"
TOLERANCE = 1e-10

FOUR = ["mlp:dp", "gpt:dp", "gpt:tp", "gpt:dp_tp", "gpt:two_stage", "gpt:zero", "gpt:sp",
        "mlp:zero_dp_tp", "gpt:auto"]
TWO = ["mlp:tp", "mlp:sp", "mlp:zero", "mlp:two_stage", "gpt:dp", "mlp:auto", "gpt:auto"]


def run_plans(nprocs, keys, dtype="float64"):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "distgraph.cli", "run", "-n", str(nprocs), str(SCRIPT),
                           dtype, *keys], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PLANS-RESULT ")]
    assert len(lines) == 1, proc.stdout[-3000:]
    return json.loads(lines[0].split(" ", 1)[1])


def check_report(report, nprocs, keys):
    assert report["world"] == nprocs
    assert sorted(report["plans"]) == sorted(
        f"{k.split(':')[0]}-{k.split(':')[1]}-n{nprocs}" for k in keys)
    for name, result in report["plans"].items():
        ranks = result["ranks"]
        assert len(ranks) == nprocs
        for rank, mine in enumerate(ranks):
            assert mine["losses"] == ranks[0]["losses"], f"{name}: rank {rank} differs"
            assert len(mine["losses"]) == len(result["serial"]) == 3
            assert max(abs(a - b) for a, b in zip(mine["losses"], result["serial"])) <= TOLERANCE
            assert mine["errors"]["loss"] <= TOLERANCE, (name, rank, mine["errors"])
            assert mine["errors"]["param"] <= TOLERANCE, (name, rank, mine["errors"])
        if "-auto" in name:     # rank 0 searched; the others made its plan from its decisions
            assert [mine["searched"] for mine in ranks] == [True] + [False] * (nprocs - 1)
            assert {mine["decisions"] for mine in ranks} == {ranks[0]["decisions"]}, name
            assert [mine["eval searched"] for mine in ranks] == [True] + [False] * (nprocs - 1)
            assert len({mine["eval loss"] for mine in ranks}) == 1, name
        if "-zero" in name:
            assert "reduce_scatter" in result["reshards"]["grad"], name
            assert result["reshards"]["param"] == ["all_gather"], name
        elif "-two_stage" in name:
            assert "send_recv" in result["reshards"]["grad"], name


@pytest.mark.mpi
def test_plans_on_four_mpi_ranks():
    check_report(run_plans(4, FOUR), 4, FOUR)


@pytest.mark.mpi
def test_plans_on_two_mpi_ranks():
    report = run_plans(2, ["refused"] + TWO)
    check_report(report, 2, TWO)
    # rank 0's search found no plan: every rank raised its error, none waited for it
    (kind, message), other = report["refused"]
    assert kind == "DoesNotFit" and "may hold 1e-06 GB" in message and other == [kind, message], \
        report["refused"]
