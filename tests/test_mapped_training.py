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
