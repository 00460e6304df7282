"""The proven lower bound that lets Strategy(search="auto") skip SCIP
(passes/search/layouts/ilp_bound.py): on random small problems it never exceeds the brute-force
optimum, whatever its multipliers; whenever it says a start cannot be improved, SCIP run
anyway from that start gains nothing above GAIN_RTOL; solve(bounded=True) then returns
the start without a model, and otherwise what SCIP returns."""

import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from distgraph.passes.search.layouts.ilp import evaluate, peak_memory, reduce_problem, solve  # noqa: E402
from distgraph.passes.search.layouts.ilp_bound import GAIN_RTOL, bound, lp_bound, proven_gap  # noqa: E402
from distgraph.passes.search.layouts.recursive import solve_recursive  # noqa: E402
from distgraph.passes.search.layouts.tree_moves import objective  # noqa: E402

from test_ilp import oracle, random_problem  # noqa: E402


def per_class(red, choice) -> list:
    return [int(choice[v]) for v in np.unique(red.cls, return_index=True)[1]]


def test_the_bound_is_at_most_the_optimum_whatever_the_multipliers():
    """The LP duals' bound, and the bound of random multipliers, never exceed the best
    allowed choice's objective (memory ignored), on the reduced problem and the real
    one; the LP's is tight (equals the optimum) on most of these small problems."""
    checked = tight = 0
    for seed in range(200):
        p = random_problem(seed)
        best, _, _ = oracle(p)
        if math.isinf(best):
            continue
        red = reduce_problem(p)
        lower = lp_bound(red)
        assert lower <= best + 1e-9 * max(abs(best), 1.0)
        rng = np.random.default_rng(seed)
        for _ in range(3):
            beta = [rng.normal(0, 5, pair.cost.shape[0]) for pair in red.pairs]
            gamma = [rng.normal(0, 5, pair.cost.shape[1]) for pair in red.pairs]
            assert bound(red, beta, gamma) <= best + 1e-9 * max(abs(best), 1.0)
        checked += 1
        tight += lower >= best - 1e-9 * max(abs(best), 1.0)
    assert checked > 150 and tight > 0.8 * checked


def test_whenever_the_bound_says_skip_scip_gains_nothing():
    """From the recursive choice and from random allowed choices: where proven_gap says
    no choice is more than GAIN_RTOL cheaper, SCIP (run anyway, from that start and
    with the budget) finds none; solve(bounded=True) then answers the start itself with
    no model, else SCIP's answer. Both kinds of answer occur."""
    skipped = solved = 0
    for seed in range(200):
        p = random_problem(seed)
        best, best_in_budget, _ = oracle(p)
        if math.isinf(best_in_budget):
            continue
        red = reduce_problem(p)
        rng = np.random.default_rng(seed)
        starts = [solve_recursive(p, None, [])[0].choice]
        for _ in range(20):
            c = tuple(int(rng.integers(k)) for k in p.strategy_counts)
            c = tuple(c[int(np.flatnonzero(red.cls == red.cls[v])[0])] for v in range(p.n))
            if math.isfinite(evaluate(p, c)) and (p.memory_budget is None or
                                                  peak_memory(p, c) <= p.memory_budget):
                starts.append(c)
                break
        for start in starts:
            value = objective(red, red.cost, per_class(red, start))
            gap = proven_gap(red, per_class(red, start))
            scip = solve(p, time_limit=10, starts=[start])
            answer = solve(p, time_limit=10, starts=[start], bounded=True)
            if gap is not None:
                assert scip.objective >= value - GAIN_RTOL * abs(value) - 1e-12
                assert scip.objective >= best - 1e-9       # (SCIP's answer is real)
                assert answer.choice == tuple(start) and answer.variables == 0
                assert answer.status == "optimal" and 0.0 <= answer.gap <= GAIN_RTOL
                skipped += 1
            else:
                assert answer.choice == scip.choice and answer.variables > 0
                solved += 1
    assert skipped > 50 and solved > 20


def test_a_start_that_breaks_the_budget_or_a_tie_is_not_taken():
    """bounded=True answers a start only where it is a real choice of the problem: within
    the budget (the bound ignores memory) and with tied nodes alike."""
    for seed in range(200):
        p = random_problem(seed, budget_kind="random")
        best, best_in_budget, _ = oracle(p)
        if p.memory_budget is None or math.isinf(best_in_budget) or best_in_budget == best:
            continue
        # the unbudgeted optimum is over the budget: SCIP must decide
        free = solve(p.with_budget(None), time_limit=10)
        if peak_memory(p, free.choice) <= p.memory_budget:
            continue
        answer = solve(p, time_limit=10, starts=[free.choice], bounded=True)
        assert answer.variables > 0 and answer.objective == pytest.approx(best_in_budget)
        return
    pytest.fail("no random problem whose budget binds")
