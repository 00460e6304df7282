"""MeshSlice on real MPI ranks (``python -m distgraph.cli run -n N``): the sliced,
overlapped matmul equals the unsliced one for every dataflow and K on 2x2, 2x3 and 3x2
meshes and counts the planned bytes; a GPT and an MLP whose FC layers run as MeshSlice
train like serial."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_spmd_mpi import check_report, run_plans

SCRIPT = Path(__file__).parent / "mpi_scripts" / "meshslice_cases.py"


def run_cases(nprocs: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "distgraph.cli", "run", "-n", str(nprocs),
                           str(SCRIPT)], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("MESHSLICE-RESULT ")]
    assert len(lines) == 1, proc.stdout[-3000:]
    return json.loads(lines[0].split(" ", 1)[1])


def check_cases(report: dict, nprocs: int) -> None:
    assert report["world"] == nprocs
    rows = report["rows"]
    assert {r["layout"].split(" ")[0] for r in rows} == {"OS", "LS", "RS"}
    for r in rows:
        assert r["error"] < 1e-12, r
        assert r["bytes"] and r["calls"], r


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [4, 6])
def test_meshslice_equals_the_unsliced_matmul_on_real_ranks(nprocs):
    check_cases(run_cases(nprocs), nprocs)


@pytest.mark.mpi
@pytest.mark.slow
def test_models_whose_fc_layers_run_as_meshslice_train_like_serial_on_four_ranks():
    keys = ["gpt:meshslice", "mlp:meshslice"]
    report = run_plans(4, keys)
    check_report(report, 4, keys)
    sliced = report["plans"]["gpt-meshslice-n4"]["meshslice"]
    for block in (0, 1):
        for layer in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"):
            assert any(f"blocks.{block}.{layer} (forward): OS" in u for u in sliced), layer
    assert any("(backward): LS" in u for u in sliced)
