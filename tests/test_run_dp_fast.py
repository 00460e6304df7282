"""The run DP's fast paths (passes/search/run_dp.py) against their plain forms, on the
random cases of tests/test_run_dp.py: the relaxation over the finite entries' box leaves
every table as the relaxation over the whole table, bit for bit; the walk over all
options at once and the pairwise pruning of options as one boolean product answer as the
option-by-option loops they replaced (written out here, as run_dp had them at b73f37f)."""

import math
import os
import sys

import numpy as np
import pytest

from distgraph.errors import PlanError
from distgraph.passes.search import run_dp
from distgraph.passes.search.runs import PartCost, RunOption

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_run_dp import random_case  # noqa: E402


def searched(seed):
    """A random case's search, with a twin of every other option: as fast, twice the
    parameters, half the activations (neither dominates the other, so both stay: ties
    for the walk; alike or slower-reaching pairs for the pruning)."""
    rng = np.random.default_rng(1700 + seed)
    cluster, (options, count, blocks, B) = random_case(rng, seed)
    options += [RunOption(o.axis, o.sub, o.logical + (2,),
                          {k: (PartCost(c.time, c.persistent * 2, c.saved / 2, c.transient), r)
                           for k, (c, r) in o.parts.items()}) for o in options[::2]]
    _, search = run_dp._setup(count, blocks, options, cluster, B, True,
                              lambda o: 0.05 * o.parts["block"][0].time)
    return search


def at_cap(search, cap):
    """(reach per option, keys, reach stacked per option: (stages + 1, keys)) at ``cap``."""
    reach = [r.reach(search.max_stages, cap, search.B) for r in search.options]
    keys = list(search.options[0].table)
    return reach, keys, [np.stack([v[key] for key in keys], axis=1) for v in reach]


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


def plain_times(r, k: int, s: int, reach: dict) -> np.ndarray:
    """Seconds of option ``r``'s layers k..i for i = k .. count-1, inf where they do not
    fit with ``s`` micro-batches in flight (``reach``: ``_Run.reach`` at the cap), as
    run_dp's ``_Run.times`` had them."""
    b0, b1 = r.blocks.start, r.blocks.stop
    i = np.arange(k, r.count)
    first = k < b0
    m = np.maximum(np.minimum(i + 1, b1) - max(k, b0), 0)
    out = np.full(i.shape, np.inf)
    for last in (False, True):
        here = (i >= b1) == last
        if here.any():
            ok = here & (m <= reach[first, last][s]) & ((m >= 1) | first | last)
            out[ok] = r.table[first, last][m[ok], 0]
    return out


def plain_walk(search, tables, s, reach):
    """The walk option by option: at each start, the first (option, end) in order of
    the least total, each option's times from :func:`plain_times`."""
    stages, k, state = [], 0, list(search.caps)
    while s:
        prev, found = tables[s - 1], None
        for n, r in enumerate(search.options):
            if state[r.axis] < r.size:
                continue
            after = list(state)
            after[r.axis] -= r.size
            value = plain_times(r, k, s, reach[n]) + prev[(slice(k + 1, None),) + tuple(after)]
            i = int(np.argmin(value))
            if math.isfinite(value[i]) and (found is None or value[i] < found[0]):
                found = (float(value[i]), k + i, n)
        if found is None:
            raise PlanError("the stage DP found a plan but could not retrace it")
        _, i, n = found
        stages.append((k, i, n))
        state[search.options[n].axis] -= search.options[n].size
        k, s = i + 1, s - 1
    return stages


@pytest.mark.parametrize("seed", range(12))
def test_the_walk_over_all_options_at_once_retraces_as_the_plain_walk(seed):
    search = searched(seed)
    full = (0,) + tuple(search.caps)
    walked = 0
    for cap in caps_of(search):
        reach, keys, most = at_cap(search, cap)
        start = np.full((search.L + 1,) + search.dims, np.inf)
        start[(search.L,) + (0,) * len(search.dims)] = 0.0
        tables = [start] + tables_of(search, cap)[1]
        for s in range(1, len(tables)):
            if math.isfinite(tables[s][full]):
                assert search._walk(tables, s, np.stack(most), keys) == \
                    plain_walk(search, tables, s, reach)
                walked += 1
    assert walked


def plain_live(search, most, keys, s):
    """The pruning of slower options pair by pair."""
    blocks = keys.index((False, False))
    w = [m[s] for m in most]
    fits = [int(x[blocks]) >= 1 or any(int(x[j]) >= 0 for j in range(len(keys))
                                        if j != blocks) for x in w]
    out = []
    for n, ok in enumerate(fits):
        if ok and not any(fits[o] and (w[o] >= w[n]).all() and
                          (o < n or not (n in search._below[o] and (w[n] >= w[o]).all()))
                          for o in search._below[n]):
            out.append(n)
    return out


@pytest.mark.parametrize("seed", range(12))
def test_pruning_all_pairs_at_once_keeps_the_options_the_pairwise_loop_keeps(seed):
    search = searched(seed)
    pruned = 0
    for cap in caps_of(search):
        _, keys, most = at_cap(search, cap)
        for s in range(1, search.max_stages + 1):
            plain = plain_live(search, most, keys, s)
            assert search._live(most, keys, s) == plain
            pruned += len(plain) < len(search.options)
    assert pruned
