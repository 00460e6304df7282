"""Stage options of a model of identical blocks (passes/search/runs.py): each logical
mesh offers the fastest block and blocks of smaller peak memory ("memory variants"),
each the fastest within half the previous one's peak, and no option the stage DP would
never prefer."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402
from distgraph.passes.search.layers import block_layers  # noqa: E402
from distgraph.passes.search.runs import VARIANTS, RunCosts  # noqa: E402
from distgraph.program_builder import build_program  # noqa: E402

import plans as P  # noqa: E402
import search_cases as S  # noqa: E402

BATCH = 16


@pytest.fixture(scope="module")
def costs():
    dims = dict(P.GPT_DIMS, n_layer=4)
    data = P.Dataset("gpt", dims=dims, batch=BATCH)
    ins, labels = dg.app.data.DataLoader(data, BATCH).specs(1)
    copy = build_program(P.build_model("gpt", dims=dims), ins, labels, P.loss_fn("gpt"),
                         dg.optim.AdamW(0.01))
    # slow links: the fastest block computes everything everywhere, so it peaks high
    cluster = S.line_cluster(4, bandwidth=0.01)
    layering = block_layers(copy.program, copy.block_paths)
    costs = RunCosts(copy, dg.Strategy(auto_mode="full", pipeline=True), cluster,
                     layering, micro=4)
    return costs, costs.options()


def figures(option) -> list:
    costs = [option.parts[part][0] for part in sorted(option.parts)]
    return [x for c in costs for x in (c.time, c.persistent, c.saved, c.transient)]


def test_variants_halve_the_peak_at_the_least_time(costs):
    runs, _ = costs
    searched = [variants for found in runs._found.values() for variants in found]
    assert any(len(variants) > 1 for variants in searched)
    for variants in searched:
        assert 1 <= len(variants) <= VARIANTS
        peaks = [v["block"].report.peak_memory for v in variants]
        times = [v["block"].report.objective for v in variants]
        for previous, peak in zip(peaks, peaks[1:]):
            assert peak <= previous / 2 * (1 + 1e-9)
        # a tighter budget never makes the block faster
        assert times == sorted(times)


def test_no_option_is_matched_or_beaten_by_another_on_its_mesh(costs):
    _, options = costs
    groups = {}
    for option in options:
        groups.setdefault((option.axis, option.sub.shape, option.logical), []).append(option)
    assert len(groups) == 6       # 1 device; 2 as [2, 1], [1, 2]; 4 as [4, 1], [2, 2], [1, 4]
    assert any(len(group) > 1 for group in groups.values())
    for group in groups.values():
        for a in group:
            for b in group:
                if a is not b:
                    assert not all(x <= y for x, y in zip(figures(a), figures(b))), (a, b)
