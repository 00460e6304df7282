"""The recursive search made cheaper (passes/search/recursive.py, tree_moves.py: tree
moves depth by depth over flat gathers, runs ending where an earlier run passed,
optimistic trials found once per forest, re-picks skipped where no neighbour moved,
edge prices kept for every walk) chooses exactly as before: the same choice, objective,
status and note as the old descents and tree moves (tests/recursive_reference.py) on
random problems (budgets, aliases, ties, forbidden strategies) and on every problem
planning a GPT on two DGX A100s searches (meshes of one to three dims)."""

import dataclasses
import os
import sys


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402
from distgraph.passes.search import intra_op  # noqa: E402
from distgraph.passes.search.recursive import Walks, _fit, solve_recursive  # noqa: E402

from recursive_reference import reference_walks  # noqa: E402
from test_ilp import random_problem  # noqa: E402


def answer(problem, space, dims, old=False):
    """(choice, objective, status, peak, note) of the search (``old``: the old one), or
    why it refused."""
    try:
        walks = reference_walks(problem, space, dims) if old else Walks()
        sol, note = solve_recursive(problem, space, dims, walks=walks)
    except dg.PlanError as e:
        return ("refused", str(e))
    return sol.choice, sol.objective, sol.status, sol.peak_memory, note


def test_random_problems_are_answered_as_the_old_search_answered():
    differ = [seed for seed in range(150)
              if answer(p := random_problem(seed), None, []) != answer(p, None, [], old=True)]
    assert not differ


def test_every_search_of_a_gpt_plan_is_answered_as_the_old_search_answered(monkeypatch):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
    from gpt_scale import dgx_cluster, gpt, program
    calls = []
    original = intra_op.solve_recursive

    def kept(problem, space, dims, *args, **kwargs):
        calls.append((problem, space, list(dims)))
        return original(problem, space, dims, *args, **kwargs)
    monkeypatch.setattr(intra_op, "solve_recursive", kept)
    dg.passes.plan(program(gpt(4, 256, 4), 8), dg.Strategy(
        auto_mode="full", pipeline=True, micro_batches=4, search="recursive"),
        dgx_cluster(2), ranks=())
    monkeypatch.undo()
    assert len(calls) >= 6 and any(len(dims) >= 2 for _, _, dims in calls)
    budgets = 0
    for problem, space, dims in calls:
        unbudgeted = dataclasses.replace(problem, memory_budget=None)
        first = answer(unbudgeted, space, dims)
        assert first == answer(unbudgeted, space, dims, old=True)
        if first[0] == "refused" or not problem.liveness:
            continue
        # the memory ladder and the re-picks within a budget (without SCIP, which
        # decides where no choice fits)
        new, old = Walks(), reference_walks(unbudgeted, space, dims)
        new.setup(unbudgeted, space, dims)
        for share in (0.8, 0.5, 0.3):
            budget = share * first[3]
            assert _fit(unbudgeted, new, first[1], first[3], budget) == \
                _fit(unbudgeted, old, first[1], first[3], budget)
            budgets += 1
    assert budgets > 0
