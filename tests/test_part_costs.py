"""A stage's costs from its parts (passes/cost/terms.py): the rows for every block
count at once equal the one-stage costs, bit for bit, with E and H whole, shared (virtual
stages) or absent, on random parts."""

import numpy as np
import pytest

from distgraph.passes.cost.terms import stage_cost, stage_costs
from distgraph.passes.search.stages.runs import PartCost
from distgraph.units import GB


def random_parts(rng):
    def part():
        return (PartCost(*(float(x) for x in rng.uniform(0, 1, 4) * [1e-3, GB, GB, GB])),
                None)
    return {"first": part(), "block": part(), "last": part()}


@pytest.mark.parametrize("seed", range(20))
def test_every_block_count_at_once_equals_one_stage_at_a_time(seed):
    rng = np.random.default_rng(2100 + seed)
    parts = random_parts(rng)
    n = int(rng.integers(0, 40))
    shares = (False, True, float(rng.uniform(0.1, 0.9)))
    for first in shares:
        for last in shares:
            rows = stage_costs(parts, first, n, last)
            assert rows.shape == (n + 1, 3)
            for m in range(n + 1):
                assert tuple(rows[m]) == stage_cost(parts, first, m, last)


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
