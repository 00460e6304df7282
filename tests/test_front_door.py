"""The search's front door (passes/search/__init__.py): ``choose`` gives a frozen Choice,
``dg.passes.plan(..., choice=)`` makes the plan of a Choice without searching, and a choice
is priced as the estimate prices the plan it makes: for random choices, not just the
optimum (the search charges every consumer of a Value resharded once for several: those
repeated reshards are the only difference, as tests/test_search.py states for the
optimum)."""

from __future__ import annotations

import dataclasses
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402
from distgraph.errors import DoesNotFit  # noqa: E402
from distgraph.passes.prepare import prepare  # noqa: E402
from distgraph.passes.search import choose, searched_choice  # noqa: E402
from distgraph.passes.search.stages.micro import searched_as  # noqa: E402
from distgraph.passes.search.layouts.ilp import solve  # noqa: E402
from distgraph.passes.search.layouts.ilp_problem import evaluate  # noqa: E402
from distgraph.passes.session import Session  # noqa: E402

import search_cases as S  # noqa: E402
from test_search import gpt_program, repeated_reshard_seconds  # noqa: E402


def random_choice(built, strategy, cluster, seed: int) -> tuple:
    """(a Choice of layouts drawn at random among those the search's problem allows, its
    price by the problem's own terms): the allowed choice of least cost under random
    prices, as SCIP finds it (so every tie, alias and follow the problem states holds)."""
    searched = choose(built, strategy, cluster)
    result, problem = searched.result, searched.result.problem
    rng = np.random.default_rng(seed)

    def drawn(rows):
        return [np.where(np.isfinite(np.asarray(r, float)), rng.random(len(r)), np.inf)
                for r in rows]

    edges = [(u, v, np.where(np.isfinite(np.asarray(R, float)), rng.random(np.shape(R)), np.inf))
             for u, v, R in problem.edges]
    random = dataclasses.replace(problem, compute=drawn(problem.compute),
                                 comm=[np.zeros(len(c)) for c in problem.comm], edges=edges,
                                 memory_budget=None, liveness=(), running=(), released=(),
                                 copies=())
    picked = tuple(solve(random, time_limit=30).choice)
    # as the search asked it: ZeRO left to it is read from the choice drawn
    asked = dataclasses.replace(searched.strategy, sharding=strategy.sharding)
    prepared, accumulation = prepare(built, asked, asked.micro_batches)
    drawn_result = dataclasses.replace(result, choice=picked)
    drawn_result.annotate(prepared.program)
    return (searched_choice(prepared, asked, accumulation, drawn_result,
                            searched.rank_mapping),
            evaluate(problem, picked))


CASES = {"mlp": lambda: (S.mlp_program(1024, 128), S.line_cluster(4)),
         "mlp on a grid": lambda: (S.mlp_program(1024, 256), S.grid_cluster()),
         "gpt": lambda: (gpt_program(), S.line_cluster(4))}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_random_choice_is_priced_as_the_estimate_prices_its_plan(case, seed):
    built, cluster = CASES[case]()
    # the search prices the gradients' reductions run after the backward: overlap=False;
    # ZeRO per update left to the search, so the draw shards some updates and not others
    strategy = dg.Strategy(auto_mode="full", search="ilp", overlap=False)
    choice, price = random_choice(built, strategy, cluster, seed)
    plan = dg.passes.plan(built, strategy, cluster, choice=choice, ranks=())
    assert plan.estimate.step_time > 0
    assert price == pytest.approx(plan.estimate.step_time
                                  + repeated_reshard_seconds(plan, cluster), rel=1e-9)
    # and the search's own choice is cheaper than the one drawn
    searched = dg.passes.plan(built, strategy, cluster, ranks=())
    assert searched.search.objective < price        # the drawn choice is not the optimum


def test_the_plan_of_a_choice_is_the_searched_plan():
    built, cluster = S.mlp_program(1024, 128), S.line_cluster(4)
    strategy = dg.Strategy(auto_mode="full")
    choice = choose(built, strategy, cluster)
    with pytest.raises(dataclasses.FrozenInstanceError):
        choice.strategy = strategy
    searched = dg.passes.plan(built, strategy, cluster, ranks=())
    made = dg.passes.plan(built, strategy, cluster, choice=choice, ranks=())
    again = dg.passes.plan(built, strategy, cluster, choice=choice, ranks=())  # not modified
    for plan in (made, again):
        assert plan.estimate == searched.estimate
        assert [str(op.dist_attr) for op in plan.program.ops] == \
            [str(op.dist_attr) for op in searched.program.ops]


def test_a_session_keeps_its_tables_and_counts_what_they_served():
    built, cluster = gpt_program(), S.line_cluster(4, bandwidth=1.0)
    strategy = dg.Strategy(auto_mode="full", pipeline=True, micro_batches=None,
                           search="recursive")
    session = Session()
    first = choose(built, strategy, cluster, session=session)
    programs = session.table("micro-batch programs")
    walked = programs.hits, programs.misses
    again = choose(built, strategy, cluster, session=session)       # the same budget
    assert again.strategy.micro_batches == first.strategy.micro_batches
    # walked once: the second round is served the count chosen (within its budget, None:
    # the devices' memory), its split program and its stage options
    # (keyed by the strategy choose searched: recomputation as the planner asks it first)
    search = searched_as(dataclasses.replace(strategy, recompute=False))
    assert programs[search, None, None] == first.strategy.micro_batches in programs
    assert (search, first.strategy.micro_batches) in programs
    assert (programs.hits, programs.misses) == (walked[0] + 3, walked[1])
    assert str(session).startswith(f"memo tables: micro-batch programs {len(programs)} "
                                   f"(hits {walked[0] + 3}, misses {walked[1]})")


def test_a_choice_that_does_not_fit_is_refused_not_searched_again():
    built = S.mlp_program(256, 512)
    strategy = dg.Strategy(auto_mode="full")
    roomy = S.line_cluster(4, bandwidth=0.1)
    choice = choose(built, strategy, roomy)
    peak = dg.passes.plan(built, strategy, roomy, choice=choice).estimate.peak_memory
    small = S.line_cluster(4, bandwidth=0.1, device=dict(S.DEVICE, memory=0.9 * peak / 1e9))
    with pytest.raises(DoesNotFit, match="the plan does not fit its devices' memory"):
        dg.passes.plan(built, strategy, small, choice=choice)


def test_a_table_counts_what_it_served():
    table = Session().table("prices")
    assert table.memo("a", lambda: 1) == 1 and table.memo("a", lambda: 2) == 1
    assert table.find("a") == 1 and table.find("b") is None
    assert (len(table), table.hits, table.misses) == (1, 2, 2)
    assert str(Session()) == "memo tables: none"


def test_a_planning_keeps_its_memos_in_at_most_15_tables_its_report_lists(monkeypatch):
    """A searched pipeline with micro_batches=None (the most tables: the micro-batch
    walk, the block runs, the recursive search and SCIP's refinement) keeps every memo
    in its session, in at most 15 tables, each named in the front door's docstring; the
    plan's search report lists them (to_dict, explain(full=True)), and a table counts
    what it served: each problem the searches built is an entry and a miss of "search
    problems", each search that found one built a hit."""
    from distgraph.passes import search as front
    from distgraph.passes.search.layouts import intra_op
    from distgraph.passes.session import describe
    from test_micro_search import built_gpt

    asked, built = [], []
    marks, problem = intra_op._marks, intra_op._problem      # once per search, per build
    monkeypatch.setattr(intra_op, "_marks", lambda *a: asked.append(1) or marks(*a))
    monkeypatch.setattr(intra_op, "_problem", lambda *a: built.append(1) or problem(*a))
    # the memory savers given: left to the search, each value it weighs is a planning
    strategy = dg.Strategy(auto_mode="full", pipeline=True, micro_batches=None, search="auto",
                           recompute=False, sharding=False, sequence_parallel=False)
    plan = dg.passes.plan(built_gpt(layers=4), strategy, S.line_cluster(4, bandwidth=1.0),
                          ranks=())
    memos = plan.search.memos
    tables = {name: (n, hits, misses) for name, n, hits, misses in memos}
    assert len(tables) == len(memos) <= 15
    assert all(f"\n| {name} |" in front.__doc__ for name in tables)
    assert {"micro-batch programs", "mesh searches", "search problems"} <= set(tables)
    assert tables["search problems"] == (len(built), len(asked) - len(built), len(built))
    assert tables["search problems"][1] > 0           # the refinement's problems, found
    assert plan.to_dict()["search"]["memo_tables"] == [
        {"name": name, "entries": n, "hits": hits, "misses": misses}
        for name, n, hits, misses in memos]
    assert describe(memos) in str(plan.search) and describe(memos) in plan.explain(full=True)
