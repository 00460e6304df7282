"""The run DP's relaxation over the finite entries' box (passes/search/stages/run_dp.py) leaves
every table as the relaxation over the whole table, bit for bit, on the random cases of
tests/test_run_dp.py with a twin of every other option. (The walk over all options at once
and the pruning of options are held to brute force in tests/test_run_dp.py and to pinned
plans in tests/test_search_pinned.py.)"""

import os
import sys

import numpy as np
import pytest

from distgraph.passes.search.stages import run_dp
from distgraph.passes.search.stages.part_cost import PartCost
from distgraph.passes.search.stages.runs import RunOption

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_run_dp import random_case  # noqa: E402


def searched(seed):
    """A random case's search, with a twin of every other option: as fast, twice the
    parameters, half the activations (neither dominates the other, so both stay)."""
    rng = np.random.default_rng(1700 + seed)
    cluster, (options, count, blocks, B) = random_case(rng, seed)
    options += [RunOption(o.axis, o.sub, o.logical + (2,),
                          {k: (PartCost(c.time, c.persistent * 2, c.saved / 2, c.transient), r)
                           for k, (c, r) in o.parts.items()}) for o in options[::2]]
    _, search = run_dp._setup(count, blocks, options, cluster, B, True,
                              lambda o: 0.05 * o.parts["block"][0].time)
    return search


def tables_of(search, cap):
    """(the cap's answer, the table of every stage count solve_cap made)."""
    tables = []
    bound = search.longer_bound
    search.longer_bound = lambda G, density: (tables.append(G.copy()), bound(G, density))[1]
    try:
        return search.solve_cap(cap), tables
    finally:
        del search.longer_bound


def caps_of(search):
    caps = search.caps_sorted
    return [float(c) for c in caps[::max(1, len(caps) // 12)]]


@pytest.mark.parametrize("seed", range(12))
def test_relaxing_the_finite_box_alone_leaves_every_table_as_it_was(seed, monkeypatch):
    search = searched(seed)
    boxes = []
    finite_box = run_dp._finite_box

    def recorded(F):
        box = finite_box(F)
        boxes.append(box is not None and
                     [b - a + 1 for a, b in box] != list(F.shape))
        return box

    fast = []
    monkeypatch.setattr(run_dp, "_finite_box", recorded)
    for cap in caps_of(search):
        fast.append(tables_of(search, cap))
    relax = run_dp._RunSearch._relax
    monkeypatch.setattr(run_dp._RunSearch, "_relax",
                        lambda self, G, F, r, most, s, box=None: relax(self, G, F, r, most, s))
    for cap, (answer, tables) in zip(caps_of(search), fast):
        plain, plain_tables = tables_of(search, cap)
        assert answer == plain
        assert len(tables) == len(plain_tables)
        assert all(np.array_equal(a, b) for a, b in zip(tables, plain_tables))
    assert any(boxes)                   # the box was smaller than the table somewhere
