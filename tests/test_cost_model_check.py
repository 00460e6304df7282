"""bench/cost_model_check.py's machinery, without timing anything: ``--matrix`` runs the
plan kinds of bench/memory_check.py, its figures (Spearman, median |error|, the parts'
fitted factors) are right on inputs whose answers are known, and its report prints them
against the issue's targets."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from scipy.stats import spearmanr

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bench"))

import cost_model_check as cmc  # noqa: E402
import memory_check  # noqa: E402
from bench_jobs import median_abs_error, spearman  # noqa: E402


def test_matrix_runs_memory_checks_plan_kinds():
    assert list(cmc.MATRIX_PLANS) == list(memory_check.LAYOUTS) + list(memory_check.SEARCHED)
    assert len(cmc.MATRIX_PLANS) == len(set(cmc.MATRIX_PLANS)) == 22   # with pp_amp


@pytest.mark.parametrize("seed", range(5))
def test_spearman_equals_scipys_without_ties(seed):
    rng = np.random.default_rng(seed)
    a, b = rng.permutation(21), rng.normal(size=21)
    assert spearman(a, b) == pytest.approx(spearmanr(a, b).statistic)


def test_spearman_of_orders():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # one swapped neighbour pair of 4: 1 - 6 * (1 + 1) / (4 * 15)
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)


def test_median_abs_error_is_relative_to_the_measurement():
    assert median_abs_error([0.9, 1.5, 2.0], [1.0, 1.0, 2.0]) == pytest.approx(0.1)
    assert median_abs_error([2.0, 4.0], [1.0, 4.0]) == pytest.approx(0.5)   # mean of 1, 0


def rows_of(parts, factors):
    """Rows whose measured step is the parts scaled by ``factors``."""
    return [dict(zip(cmc.PARTS, p), measured=float(np.dot(p, factors)),
                 predicted=float(sum(p)), plan=f"p{k}", shape="1st 1mb")
            for k, p in enumerate(parts)]


def test_part_scales_recover_the_factors():
    parts = [(1.0, 0.5, 0.1, 0.0), (2.0, 0.1, 0.4, 0.3), (0.5, 1.0, 0.0, 0.2),
             (1.5, 0.2, 0.9, 0.0), (0.3, 0.3, 0.3, 0.6)]
    scales = cmc.part_scales(rows_of(parts, (1.25, 0.5, 0.25, 2.0)))
    assert scales == pytest.approx({"compute": 1.25, "wire": 0.5, "software": 0.25,
                                    "bubble": 2.0})


def test_part_scales_leave_out_parts_no_plan_has():
    scales = cmc.part_scales(rows_of([(1.0, 0.5, 0.0, 0.0), (2.0, 0.1, 0.0, 0.0)],
                                     (1.1, 0.9, 0.0, 0.0)))
    assert scales == pytest.approx({"compute": 1.1, "wire": 0.9})


def test_without_software_keeps_everything_but_the_steps_software_costs():
    import distgraph as dg

    devices = [dict(global_id=i, local_id=i, type="CPU", memory=4, gflops={"float32": 10},
                    reshard_overhead={"all_reduce": [30.0, 0.5]}) for i in range(2)]
    cluster = dg.Cluster.from_dict({"machines": [{"id": 0, "hostname": "a", "devices": devices,
                                                 "links": [{"source": 0, "target": 1,
                                                            "bandwidth": 5, "latency": 2}]}]})
    bare = cmc.without_software(cluster)
    assert [d.reshard_overhead for d in bare.devices] == [None, None]
    assert [d.gflops for d in bare.devices] == [d.gflops for d in cluster.devices]
    assert (bare.bandwidth(0, 1), bare.latency(0, 1)) == (5, 2)


def test_report_prints_the_figures_against_the_targets(capsys):
    rows = rows_of([(1.0, 0.5, 0.0, 0.0), (2.0, 0.1, 0.0, 0.3), (0.5, 1.0, 0.0, 1.2)],
                   (1.0, 1.0, 1.0, 1.0))
    rows[0]["measured"] *= 1.25
    cluster = os.path.join(HERE, "..", "resources", "clusters", "emulated_2x2.yaml")
    cmc.report_matrix(rows, cluster)
    out = capsys.readouterr().out
    assert "Spearman rank correlation 1.000 (target >= 0.9)" in out
    assert "median |error| 0.0% (target <= 10%); over 3 plans" in out
    assert "-20.0%" in out                 # 1.5 predicted against 1.875 measured
