"""bench/published_runs.py: its table of published runs is consistent (each layout fills
its GPUs, each global batch is micro-batch x micro-batches x dp), and a small row plans
through the bench's own path to a figure in the published unit."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bench"))

import published_runs as pr  # noqa: E402
from megatron_table1 import TABLE1  # noqa: E402


@pytest.mark.parametrize("run", pr.GPT_RUNS, ids=lambda r: r.name)
def test_each_layout_fills_its_gpus_and_batch(run):
    assert run.t * run.p * run.dp == run.gpus
    assert run.gpus % 8 == 0                       # whole DGX nodes
    assert run.micro * run.micro_batches * run.dp == run.batch
    assert run.layers >= run.p and run.hidden % run.heads == 0
    assert run.heads % run.t == 0                  # whole heads per tensor-parallel rank


def test_table1_rows_keep_their_gpu_counts_and_figures():
    by_name = {r.name: r for r in pr.GPT_RUNS}
    for row in TABLE1:
        run = by_name[row.name]
        assert (run.gpus, run.batch, run.published) == (row.gpus, row.batch, row.published)


def test_flop_counts_are_the_sources():
    """Korthikanti's MFU counts no recomputation (72 ...), Narayanan's TFLOP/s count it
    (96 ...): the same step priced both ways differs by 4/3 up to the vocabulary terms."""
    run = next(r for r in pr.GPT_RUNS if r.name == "175B")
    as_tflops = dataclasses.replace(run, metric="tflops")
    ratio = as_tflops.model_flops() / run.model_flops()
    assert 1.33 < ratio < 1.34
    assert run.figure(1.0) == pytest.approx(
        100 * run.model_flops() / run.gpus / 1e12 / pr.A100_PEAK_TFLOPS)


def test_rows_and_sources_select():
    parser_args = type("A", (), {"rows": "22B,1.7B", "sources": None})
    assert pr.select(parser_args) == ["1.7B", "22B"]
    parser_args = type("A", (), {"rows": None, "sources": "korthikanti"})
    assert pr.select(parser_args) == ["22B", "175B", "530B", "1T"]


def test_a_small_row_plans_to_a_figure_in_its_unit():
    """Korthikanti's 22B row (8 GPUs, t 8, sequence parallel, selective recompute) at 4
    of its 48 layers: planned in the row's layout, priced on one DGX node."""
    run = dataclasses.replace(next(r for r in pr.GPT_RUNS if r.name == "22B"), layers=4)
    out = pr.plan_gpt(run, searched=False, time_limit=10)
    assert out["step_s"] > 0 and out["communication_s"] > 0 and out["bubble_s"] == 0
    assert 10 < out["predicted"] < 100                     # a percentage of the peak
    assert out["peak_gb"] < 80
