"""The balanced batch split (distgraph.passes.balance.batch_split): the cvxpy/SCIP
program's optimum equals a brute force over every split on small cases, memory limits
hold, a batch the devices cannot hold is a PlanError naming them, and the rows each
process reads tile the batch (an even split reads as the runtime does today)."""

import itertools
import random

import pytest

from distgraph.errors import PlanError
from distgraph.passes.balance.batch_split import (BatchSplit, Member, SplitProblem,
                                                  check_memory, solve_split)


def brute_force(problem):
    """(smallest busiest-member time, then the largest least-busy time among those)."""
    ms = problem.members
    ranges = [range(1, min(m.max_units or problem.units, problem.units) + 1) for m in ms]
    splits = [u for u in itertools.product(*ranges) if sum(u) == problem.units]
    best = min(max(m.busy(k) for m, k in zip(ms, u)) for u in splits)
    tied = [u for u in splits
            if max(m.busy(k) for m, k in zip(ms, u)) <= best * (1 + 1e-9) + 1e-12]
    return best, max(min(m.least(k) for m, k in zip(ms, u)) for u in tied)


def random_problem(rng):
    n = rng.randint(2, 4)
    units = rng.randint(n, 14)
    members = []
    for g in range(n):
        procs = rng.randint(1, 2)
        times = tuple((rng.choice([0.0, rng.uniform(0, 3e-3)]), rng.uniform(1e-4, 2e-3))
                      for _ in range(procs))
        cap = rng.choice([None, None, rng.randint(1, units)])
        members.append(Member(tuple(range(2 * g, 2 * g + procs)), (g,), times, cap))
    return SplitProblem(units, rng.choice([1, 2]), tuple(members))


@pytest.mark.parametrize("seed", range(30))
def test_the_programs_optimum_equals_a_brute_force(seed):
    problem = random_problem(random.Random(seed))
    try:
        check_memory(problem)
    except PlanError:
        with pytest.raises(PlanError):
            solve_split(problem)
        return
    units, report = solve_split(problem, time_limit=30)
    best, least = brute_force(problem)
    assert sum(units) == problem.units and all(u >= 1 for u in units)
    for m, u in zip(problem.members, units):
        assert m.max_units is None or u <= m.max_units
    assert report.busiest == pytest.approx(best, rel=1e-6)
    assert report.least_busy == pytest.approx(least, rel=1e-6)
    assert report.status == "optimal"


def test_rows_go_in_proportion_to_speed_so_members_finish_together():
    fast, slow = Member((0,), (0,), ((0.0, 1.0),)), Member((1,), (1,), ((0.0, 2.0),))
    assert solve_split(SplitProblem(12, 1, (fast, slow)))[0] == (8, 4)
    equal = tuple(Member((g,), (g,), ((0.0, 1.0),)) for g in range(3))
    # min-max alone would also take (4, 4, 2); the second phase evens the rest out
    assert sorted(solve_split(SplitProblem(10, 1, equal))[0]) == [3, 3, 4]


def test_where_no_time_depends_on_the_share_the_split_is_even():
    flat = (Member((0,), (0,), ((2.0, 0.0),)), Member((1,), (1,), ((3.0, 0.0),)))
    assert solve_split(SplitProblem(10, 1, flat))[0] == (5, 5)


def test_memory_caps_hold_and_a_batch_too_big_for_the_devices_names_them():
    fast = Member((0,), (7,), ((0.0, 1.0),), max_units=5)
    slow = Member((1,), (9,), ((0.0, 4.0),))
    units, report = solve_split(SplitProblem(12, 1, (fast, slow)))
    assert units == (5, 7) and report.busiest == 28.0
    with pytest.raises(PlanError, match=r"holds 9 rows of the batch's 12 \(devices \[7\]: 5, "
                                        r"devices \[9\]: 4\)"):
        solve_split(SplitProblem(12, 1, (fast, Member((1,), (9,), ((0.0, 1.0),), 4))))
    with pytest.raises(PlanError, match=r"devices \[9\] \(processes \[1\]\) do not have the "
                                        r"memory for one granule of 4 rows"):
        solve_split(SplitProblem(3, 4, (fast, Member((1,), (9,), ((0.0, 1.0),), 0))))


def test_rows_without_micro_batches_are_one_run_per_member():
    split = BatchSplit(12, 1, False, ("dp",), ((0, 2), (1, 3)), (8, 4))
    assert split.rows(2) == ((0, 8),) and split.rows(3) == ((8, 12),)
    assert split.row_count(1) == 4 and split.micro_batches(1) == 1 and not split.is_even
    assert "processes 1, 3: 4 rows (rows 8-12)" in str(split)
    with pytest.raises(PlanError, match="do not make the batch"):
        BatchSplit(12, 1, False, ("dp",), ((0,), (1,)), (8, 5))


def test_micro_batches_are_dealt_in_rounds_and_an_even_split_reads_as_today():
    # 3 members, 2 micro-batches each of 2 rows: micro-batch m is rows [6m, 6m + 6),
    # split over the members in order, as the pipeline runtime reads an even split
    even = BatchSplit(12, 2, True, ("dp",), ((0,), (1,), (2,)), (2, 2, 2))
    assert [even.rows(p) for p in range(3)] == [((0, 2), (6, 8)), ((2, 4), (8, 10)),
                                                ((4, 6), (10, 12))]
    uneven = BatchSplit(12, 2, True, ("dp",), ((0,), (1,)), (4, 2))
    assert uneven.rows(0) == ((0, 2), (4, 6), (8, 10), (10, 12))
    assert uneven.rows(1) == ((2, 4), (6, 8))
    assert uneven.micro_batches(0) == 4
    every = sorted(r for p in (0, 1) for r in uneven.rows(p))
    assert every == [(k, k + 2) for k in range(0, 12, 2)]
