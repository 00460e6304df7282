"""The number of micro-batches chosen by the search (passes/search/stages/micro.py,
``Strategy(micro_batches=None)``): the walk over micro-batch sizes ends where neither
neighbour is faster (a closed-form latency and the stage search's own), the plan runs
with the M chosen, and the option is refused where no stage search runs."""

import dataclasses
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402
from distgraph.errors import PlanError  # noqa: E402
from distgraph.passes.prepare import prepare  # noqa: E402
from distgraph.passes.session import Session  # noqa: E402
from distgraph.passes.search.stages.layers import block_layers  # noqa: E402
from distgraph.passes.search.stages.pipeline import pipeline_latency  # noqa: E402
from distgraph.passes.search.stages.micro import (batch_rows, choose_micro_batches,  # noqa: E402
                                                  count_beaten, count_latency, ladder, searched_as)
from distgraph.program_builder import build_program  # noqa: E402

import plans as P  # noqa: E402
import search_cases as S  # noqa: E402

BATCH = 16


def built_gpt(batch=BATCH, layers=2):
    dims = dict(P.GPT_DIMS, n_layer=layers)
    data = P.Dataset("gpt", dims=dims, batch=batch)
    ins, labels = dg.app.data.DataLoader(data, batch).specs(1)
    return build_program(P.build_model("gpt", dims=dims), ins, labels, P.loss_fn("gpt"),
                         dg.optim.AdamW(0.01))


def test_the_ladder_is_the_divisors_of_the_batch():
    assert ladder(16) == [1, 2, 4, 8, 16]
    assert ladder(6) == [1, 2, 3, 6]
    assert ladder(1) == [1] and ladder(7) == [1, 7]
    for rows in (1536, 2520, 97, 360):
        assert ladder(rows) == [r for r in range(1, rows + 1) if rows % r == 0]


@pytest.mark.parametrize("stages, fixed", [(4, 0.0), (4, 3.0), (1, 1.0), (8, 0.5)])
def test_the_walk_finds_the_least_of_a_unimodal_latency(stages, fixed):
    # a pipeline of S equal stages, each micro-batch costing its rows plus a fixed part:
    # (S + M - 1) (B / M + fixed), unimodal in M; the brute-force least is the oracle
    def closed_form(m):
        return (stages + m - 1) * (BATCH / m + fixed)

    def latency(_built, strategy, m):
        assert strategy.micro_batches == m
        return closed_form(m)

    strategy = dg.Strategy(auto_mode="full", pipeline=True, micro_batches=None)
    chosen = choose_micro_batches(built_gpt(), strategy, S.line_cluster(4), latency)
    assert chosen == min((BATCH // r for r in ladder(BATCH)), key=closed_form)


def test_nothing_fits_names_the_counts_tried():
    strategy = dg.Strategy(auto_mode="full", pipeline=True, micro_batches=None)

    def latency(*_):
        raise PlanError("too big")

    with pytest.raises(PlanError, match="no plan fits the devices' memory with any of the "
                                        "micro-batch counts tried"):
        choose_micro_batches(built_gpt(), strategy, S.line_cluster(4), latency)


def test_the_plan_runs_the_count_whose_stage_search_is_fastest_around_it():
    # the savers given (weighed in test_searched_savers.py): one planning, the count's
    built, cluster = built_gpt(), S.line_cluster(4, bandwidth=1.0)
    strategy = dg.Strategy(auto_mode="full", pipeline=True, micro_batches=None,
                           search="recursive", recompute=False, sharding=True,
                           sequence_parallel=False)
    plan = dg.passes.plan(built, strategy, cluster, ranks=())
    m = plan.strategy.micro_batches
    assert m in [BATCH // r for r in ladder(BATCH)] and plan.micro_batches == m

    def latency(k: int) -> float:
        asked = dataclasses.replace(plan.strategy, micro_batches=k)
        prepared, accumulation = prepare(built, asked, k)
        return pipeline_latency(prepared, asked, cluster, accumulation)[0]

    sizes = ladder(BATCH)           # the counts of the micro-batch sizes either side
    at = sizes.index(BATCH // m)
    latency = {BATCH // r: latency(BATCH // r) for r in sizes[max(at - 1, 0):at + 2]}
    assert latency[m] <= min(latency.values())


def test_left_to_the_search_only_where_a_stage_search_runs():
    assert batch_rows(built_gpt()) == BATCH
    with pytest.raises(dg.DistGraphError, match="integer >= 1, or None"):
        dg.Strategy(micro_batches=0)
    for strategy in (dg.Strategy(micro_batches=None),
                     dg.Strategy(auto_mode="full", micro_batches=None)):
        with pytest.raises(PlanError, match="pipeline=True"):
            dg.passes.plan(built_gpt(), strategy, S.line_cluster(4))


def test_a_count_is_pruned_only_where_its_bound_reaches_the_best_latency():
    # the bound (fastest parts, memory unlimited) never exceeds the count's own latency,
    # and the search below a latency finds a plan exactly where the count's own is
    # below it, so pruning with them keeps the walk's choice: the same M with and without
    built, cluster = built_gpt(layers=4), S.line_cluster(4, bandwidth=1.0)
    assert block_layers(built.program, built.block_paths) is not None     # bounded
    strategy = dg.Strategy(auto_mode="full", pipeline=True, micro_batches=None,
                           search="recursive")
    for m in (2, 4, 8):
        asked = dataclasses.replace(strategy, micro_batches=m)
        latency = count_latency(built, asked, cluster, m, Session())
        assert not count_beaten(built, asked, cluster, m, latency * (1 + 1e-9), Session())
        assert count_beaten(built, asked, cluster, m, latency, Session())
        assert count_beaten(built, asked, cluster, m, latency * 1e-6, Session())
    session = Session()
    pruned = choose_micro_batches(built, strategy, cluster,
                                  lambda b, s, m: count_latency(b, s, cluster, m, session),
                                  lambda b, s, m, t: count_beaten(b, s, cluster, m, t, session))
    full = choose_micro_batches(built, strategy, cluster,
                                lambda b, s, m: count_latency(b, s, cluster, m, Session()))
    assert pruned == full


def test_a_count_held_back_by_memory_is_beaten_exactly_where_its_latency_is_not_below():
    # under a memory budget the count's plan needs the memory variants (slower than its
    # fastest parts' bound); the search below a latency still answers exactly: beaten
    # at its own latency, not just above it
    built, cluster = built_gpt(layers=4), S.line_cluster(4, bandwidth=1.0)
    strategy = dg.Strategy(auto_mode="full", pipeline=True, micro_batches=4,
                           search="recursive")
    session = Session()
    free = count_latency(built, strategy, cluster, 4, session)
    programs = session.table("micro-batch programs")
    peak = max(s.memory for s in programs[searched_as(strategy), 4][1][1][0].stages)
    tight = dataclasses.replace(strategy, memory_budget_gb=0.9 * peak)
    latency = count_latency(built, tight, cluster, 4, Session())
    assert latency > free * 1.05                # memory holds the fastest parts back
    assert count_beaten(built, tight, cluster, 4, latency, Session())
    assert not count_beaten(built, tight, cluster, 4, latency * (1 + 1e-9), Session())


def test_counts_share_their_search_costs_and_price_as_fresh_ones():
    # a count with another as donor prices in the donor's session, on its LayoutPrices
    # (reshard and op prices depend on shapes, not on the program); oracle: the same
    # count with a donor (the donor's searches read from another session), on fresh ones
    from distgraph.passes.search.stages.runs import RunCosts

    built, cluster = built_gpt(layers=4), S.line_cluster(4, bandwidth=1.0)
    strategy = dg.Strategy(auto_mode="full", pipeline=True, micro_batches=2,
                           search="recursive")
    session = Session()
    runs = session.table("micro-batch programs")
    count_latency(built, strategy, cluster, 2, session)
    donor = runs[searched_as(strategy), 2][0]
    four = dataclasses.replace(strategy, micro_batches=4)
    shared = count_latency(built, four, cluster, 4, session)
    mine = runs[searched_as(four), 4][0]
    assert mine.donor is donor and mine.session is donor.session is session
    prepared, accumulation = prepare(built, four, 4)
    elsewhere = Session()       # the searches of the session, none of its prices
    elsewhere.table("mesh searches").update(session.table("mesh searches"))
    layering = block_layers(prepared.program, prepared.block_paths)
    fresh = RunCosts(prepared, four, cluster, layering, 4, donor, session=elsewhere)
    alone, _, _ = pipeline_latency(prepared, four, cluster, accumulation, costs=fresh)
    assert {id(c) for c in elsewhere.table("layout prices").values()}.isdisjoint(
        id(c) for c in session.table("layout prices").values())     # priced afresh
    assert shared == alone
    assert [o.cost(True, 1, True) for o in mine.options()] == \
        [o.cost(True, 1, True) for o in fresh.options()]
    # the count chosen is searched afresh on the prices planned: the plan of a fresh search
    chosen = dg.passes.plan(built, dataclasses.replace(strategy, micro_batches=None), cluster,
                            ranks=())
    again = dg.passes.plan(built, dataclasses.replace(strategy,
                                                      micro_batches=chosen.micro_batches),
                           cluster, ranks=())
    assert chosen.estimate.step_time == again.estimate.step_time
    assert chosen.search.layouts == again.search.layouts


def test_a_count_priced_on_another_counts_searches_plans_no_slower_than_priced():
    # a count's own searches look first on the meshes whose x divides its micro-batch's
    # rows, so another count's searches may price it faster than they do (Llama 3 405B
    # at one sequence per micro-batch: 434 against 132 TFLOP/s); the count was chosen on
    # that price, so its plan keeps the priced stages where its fresh search is slower.
    # Oracle: the latencies of the count searched alone and priced from a donor. (With
    # the reductions bucketed during the backward the two searches here agree to 0.01%:
    # overlap off keeps the donor the faster.)
    from distgraph.passes.search import choose

    built, cluster = built_gpt(batch=4, layers=4), S.line_cluster(8, bandwidth=1.0)
    strategy = dg.Strategy(auto_mode="full", pipeline=True, micro_batches=2,
                           search="recursive", recompute=False, sharding=True, overlap=False)
    alone_session = Session()
    alone = count_latency(built, strategy, cluster, 2, alone_session)
    session = Session()
    count_latency(built, dataclasses.replace(strategy, micro_batches=4), cluster, 4, session)
    priced = count_latency(built, strategy, cluster, 2, session)
    assert session.table("micro-batch programs")[searched_as(strategy), 2][0].donor is not None
    assert priced < alone               # the case this test is about

    def planned(session):           # the stages the count's DP chose, as it priced them
        return session.table("micro-batch programs")[searched_as(strategy), 2][1][1][0]
    kept = planned(session)
    choice = choose(built, strategy, cluster, session=session)
    # the plan is the priced one (the report prices its boundaries between unlike stages
    # as they run, so its objective is the DP's only where the stages are alike)
    assert stages_of(choice.result.report.stage_plan) == stages_of(kept)
    plan = dg.passes.plan(built, choice=choice, cluster=cluster, ranks=())
    assert plan.micro_batches == 2 and stages_of(plan.search.stage_plan) == stages_of(kept)
    # and where the fresh search is the faster, the plan is the fresh one
    fresh = choose(built, strategy, cluster, session=Session())
    assert stages_of(fresh.result.report.stage_plan) == stages_of(planned(alone_session))
    assert stages_of(planned(alone_session)) != stages_of(kept)


def stages_of(stage_plan) -> list:
    return [(s.layers, tuple(s.device_ids), s.memory) for s in stage_plan.stages]


def test_a_second_walk_from_one_row_per_micro_batch_finds_what_memory_hides():
    # where memory binds, latency is not unimodal in M: a few large micro-batches fit on
    # wide stages, the counts next to them not at all, one row per micro-batch on narrow
    # ones (Korthikanti's 1T). The walk from the start stops at its local least; the
    # walk from the other end finds the least of all. Oracle: brute force
    table = {1: 10.0, 2: math.inf, 4: 13.0, 8: 7.0, 16: 6.0}

    def latency(_built, strategy, m):
        if math.isinf(table[m]):
            raise PlanError("does not fit")
        return table[m]

    strategy = dg.Strategy(auto_mode="full", pipeline=True, micro_batches=None)
    chosen = choose_micro_batches(built_gpt(), strategy, S.line_cluster(4), latency)
    assert chosen == min(table, key=table.get) == 16


def many_machines(n: int) -> dg.Cluster:
    """``n`` machines of one device each, every pair linked."""
    machines = [{"id": m, "hostname": f"node{m}", "devices": [S._device(m, 0)]}
                for m in range(n)]
    links = [{"source": a, "target": b, "bandwidth": 10.0, "latency": 1.0}
             for a in range(n) for b in range(a + 1, n)]
    return dg.Cluster.from_dict({"name": f"many{n}", "machines": machines, "links": links})


@pytest.mark.parametrize("machines, batch, first", [(64, 64, 2), (8, 64, 8), (64, 128, 4), (64, 16, 16)])
def test_the_first_count_searched_has_the_rows_its_stages_could_split_over_their_machines(
        machines, batch, first):
    # the first count is searched in full and the others priced on its layouts, so it
    # must be one whose rows the stages can split: with 2 blocks on 64 machines a stage
    # spans 32 machines or more, which one row per micro-batch leaves idle (Llama 3
    # 405B on 2,048 machines: 2,048 micro-batches of one sequence, 0.25 x Meta's
    # layout; 64 of 32 sequences, 1.26 x). With fewer rows than machines, the rows are
    # split inside stages and the start is one row per micro-batch
    counts = []

    def latency(_built, strategy, m):
        counts.append(m)
        return 1.0

    strategy = dg.Strategy(auto_mode="full", pipeline=True, micro_batches=None)
    choose_micro_batches(built_gpt(batch), strategy, many_machines(machines), latency)
    assert counts[0] == first


def test_the_counts_are_weighed_within_the_budget_the_planner_holds_the_search_to():
    # the planner lowers the budget where a plan's estimate overflows (passes/fitting.py);
    # the counts are weighed again under it, in the same planning's session. Oracle:
    # each count's latency within that budget, priced alone
    from distgraph.passes.search import choose

    built, cluster = built_gpt(layers=4), S.line_cluster(4, bandwidth=1.0)
    strategy = dg.Strategy(auto_mode="full", pipeline=True, micro_batches=None,
                           search="recursive", recompute=False, sharding=True)
    session = Session()
    free = choose(built, strategy, cluster, session=session)
    peak = max(s.memory for s in free.result.report.stage_plan.stages) * 1e9
    budget = 0.8 * peak

    def alone(m):
        try:
            return count_latency(built, dataclasses.replace(strategy, micro_batches=m),
                                 cluster, m, Session(), budget)
        except PlanError:
            return math.inf

    counts = [BATCH // r for r in ladder(BATCH)]
    held = choose(built, strategy, cluster, budget, session=session)
    assert held.strategy.micro_batches == min(counts, key=alone) != free.strategy.micro_batches
    assert max(s.memory for s in held.result.report.stage_plan.stages) * 1e9 <= budget
