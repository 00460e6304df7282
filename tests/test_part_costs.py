"""A stage's costs from its parts (passes/cost/stage.py): the rows for every block
count at once equal the one-stage costs, bit for bit, with E and H whole, shared (virtual
stages) or absent, on random parts."""

import numpy as np
import pytest

from distgraph.passes.cost.stage import stage_cost, stage_costs
from distgraph.passes.search.stages.part_cost import PartCost
from distgraph.units import GB


def random_parts(rng, kinds=0):
    def part():
        time, persistent, saved, transient = (float(x) for x in
                                              rng.uniform(0, 1, 4) * [1e-3, GB, GB, GB])
        buffers = float(rng.uniform(0, persistent))
        forward, backward = (float(x) for x in rng.uniform(0, transient, 2))
        making = float(rng.uniform(backward, transient + buffers))
        update = float(rng.uniform(0, 1e-2))
        unlike = tuple(float(x) for x in rng.uniform(0, time, kinds))
        return (PartCost(time, persistent, saved, transient, buffers, forward, backward,
                         making, update, unlike + (time,) if kinds else ()), None)
    return {"first": part(), "block": part(), "last": part()}


@pytest.mark.parametrize("seed", range(20))
def test_every_block_count_at_once_equals_one_stage_at_a_time(seed):
    rng = np.random.default_rng(2100 + seed)
    parts = random_parts(rng, kinds=seed % 3)
    n = int(rng.integers(0, 40))
    shares = (False, True, float(rng.uniform(0.1, 0.9)))
    for first in shares:
        for last in shares:
            rows = stage_costs(parts, first, n, last)
            assert rows.shape == (n + 1, 5)
            for m in range(n + 1):
                assert tuple(rows[m]) == stage_cost(parts, first, m, last)


def test_a_stage_of_processes_that_pay_unlike_takes_the_largest_sum_over_its_parts():
    """Oracle: the sums by hand. E costs 1 ms at the priced process and 3 ms at the other
    kind, a block 2 and 1.5, H 0.5 at both (no kinds): E + 2 blocks + H take 5.5 and
    6.5 ms, so 6.5, not each part's slowest summed (7.5). Rows of every block count:
    max(1.5, 3.5), max(3.5, 5), max(5.5, 6.5), max(7.5, 8)."""
    parts = {"first": (PartCost(3.0, 0, 0, 0, kinds=(1.0, 3.0)), None),
             "block": (PartCost(2.0, 0, 0, 0, kinds=(2.0, 1.5)), None),
             "last": (PartCost(0.5, 0, 0, 0), None)}
    assert stage_cost(parts, True, 2, True).seconds == 6.5
    assert list(stage_costs(parts, True, 3, True)[:, 0]) == [3.5, 5.0, 6.5, 8.0]
    alike = {k: (PartCost(p.time, 0, 0, 0), None) for k, (p, _) in parts.items()}
    assert stage_cost(alike, True, 2, True).seconds == 7.5


def test_the_peak_is_at_the_part_whose_working_memory_tops_the_saved_before_it():
    """E saves 1 GB and works in 5 more; a block saves 1 and works in 1 more: the peak
    is E's 6 GB until the saved of E and m blocks plus a block's work pass it (m = 5:
    1 + 5 + 1 = 7 GB)."""
    E = (PartCost(1.0, 0.0, 1 * GB, 5 * GB), None)
    block = (PartCost(2.0, 0.0, 1 * GB, 1 * GB), None)
    rows = stage_costs({"first": E, "block": block}, True, 5, False)
    assert rows[:, 0].tolist() == [1.0, 3.0, 5.0, 7.0, 9.0, 11.0]
    assert rows[:, 1].tolist() == [6.0, 6.0, 6.0, 6.0, 6.0, 7.0]
    assert rows[:, 2].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]


def test_with_every_forward_first_the_buffers_are_counted_from_the_backward_that_makes_them():
    """E (1 GB persistent, 0.5 of it buffers) saves 1 GB; a block (2 GB persistent, 1 of
    it buffers) saves 1; forwards work in 1 more, backwards in 2 more without their
    buffers and in 3 more once each has made its own. With 2 blocks (fixed 5 GB, 2.5 of
    it buffers, 3 saved): the forward peaks at 3 + 1 = 4; the first backward at the last
    block at 3 + 3 = 6, at the first block at 2 + 3 + 1 (the last block's buffers) = 6,
    at E at 1 + 3 + 2 (the blocks' buffers) = 6; a later backward 2.5 (every buffer) +
    (3 + 2) - 3 (one micro-batch less held) = 4.5: so 2.5 + 6 = 8.5 GB, where buffers held
    from the start give 5 + 3 + 3 = 11 (fixed, saved and the last block's transient)."""
    E = (PartCost(1.0, 1 * GB, 1 * GB, 3 * GB, 0.5 * GB, 1 * GB, 2 * GB, 3 * GB), None)
    block = (PartCost(2.0, 2 * GB, 1 * GB, 3 * GB, 1 * GB, 1 * GB, 2 * GB, 3 * GB), None)
    seconds, one, further, before, _ = stage_cost({"first": E, "block": block}, True, 2, False)
    assert (one, further, before) == (11.0, 3.0, 8.5)
    assert stage_costs({"first": E, "block": block}, True, 2, False)[2].tolist() == \
        [seconds, one, further, before, 0.0]


def test_without_buffers_the_forwards_first_memory_is_the_one_in_flight():
    """Parts that leave their buffers in ``persistent`` (``buffers`` 0, their working
    memory ``transient`` in every phase) price a stage alike either way."""
    rng = np.random.default_rng(2200)
    parts = {k: (PartCost(*(float(x) for x in rng.uniform(0, 1, 4) * [1e-3, GB, GB, GB])),
                 None) for k in ("first", "block", "last")}
    rows = stage_costs(parts, True, 12, True)
    assert rows[:, 3].tolist() == rows[:, 1].tolist()
