"""What a calibration writes, measured on 2 real ranks: figures said to be measured, a
GEMM curve with its rates, every op type's and reshard step kind's cost; and the
comparison of two calibrations (tests/calibration_agreement.py, which
bench/calibration_agreement.py runs on two calibrations in a row) finds every figure
planted off by more than its tolerance and nothing else. (Whether two calibrations agree
is a timing of a loaded machine: the bench prints it, no test asserts it.)"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

import distgraph as dg
from calibration_agreement import disagreements
from distgraph.registry import CAST_COSTS


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    out = tmp_path_factory.mktemp("cal") / "two.yaml"
    proc = subprocess.run([sys.executable, "-m", "distgraph.cli", "cluster", "calibrate",
                           "-n", "2", "--repeats", "1", "-o", str(out)], capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return dg.Cluster.from_file(out)


@pytest.mark.mpi
def test_a_calibration_writes_measured_figures_and_a_gemm_curve(calibrated):
    assert calibrated.figures == "measured" and calibrated.calibrated
    assert calibrated.calibration["ranks"] == 2 and calibrated.calibration["cores"] >= 1
    for d in calibrated.devices:
        assert d.gemm is not None and d.gemm.units == 1 and d.gflops["float32"] > 0
        assert {"matmul", "add", "softmax", "layer_norm", *CAST_COSTS} <= set(d.op_costs)
        assert {"all_reduce", "all_gather", "slice"} <= set(d.reshard_overhead)
        # the share of an all-reduce the ranks hid behind GEMMs, tested between them
        assert 0 <= d.overlap_efficiency <= 1
    assert len({d.overlap_efficiency for d in calibrated.devices}) == 1     # the group's


@pytest.mark.mpi
def test_the_comparison_finds_the_figures_planted_off_and_nothing_else(calibrated):
    bad, total = disagreements(calibrated, calibrated, 0.10)
    assert bad == [] and total > 200
    d = calibrated.device(0)
    a, b = d.op_costs["softmax"]
    off = dataclasses.replace(d, op_costs={**d.op_costs, "softmax": (a * 1.25, b * 1.25)},
                              memory_bandwidth=d.memory_bandwidth * 1.05)
    link = calibrated.all_links[0]
    planted = dataclasses.replace(calibrated, machines=tuple(
        dataclasses.replace(m, devices=tuple(off if x.global_id == 0 else x
                                             for x in m.devices),
                            links=tuple(dataclasses.replace(ln, bandwidth=ln.bandwidth * 0.8)
                                        if ln == link else ln for ln in m.links))
        for m in calibrated.machines))
    bad, _ = disagreements(calibrated, planted, 0.10)
    assert bad and all(x.startswith("device 0 op_costs softmax at ") or
                       x.startswith(f"link {link.source}-{link.target} bandwidth")
                       for x in bad)
    assert any(x.startswith("link") for x in bad)
