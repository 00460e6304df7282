"""A stage's costs from its parts (passes/cost/stage.py): the rows for every block
count at once equal the one-stage costs, bit for bit, with E and H whole, shared (virtual
stages) or absent, on random parts."""

import numpy as np
import pytest

from distgraph.passes.cost.exposed import Timeline, bucket_terms, exposed, exposed_rows
from distgraph.passes.cost.stage import stage_cost, stage_costs
from distgraph.plan.buckets import MB, cut
from distgraph.passes.search.stages.part_cost import PartCost
from distgraph.units import GB


def random_timeline(rng, reduced=0.0, bucket_mb=1.0, hides=1.0) -> Timeline:
    """A part's backward in segments, its reductions (each ready after its segment, of
    0.1 to 3 MB, its copies, wire and waits on one of two groups) and the update's ops
    after it, each reading one reduction or none."""
    k = int(rng.integers(0, 6))
    reductions = []
    for r in range(k):
        wire, waits = (float(x) for x in rng.uniform(0, 1e-3, 2) * [1, rng.integers(0, 2)])
        reductions.append((r + 1, int(rng.uniform(0.1, 3) * MB),
                           (wire + waits + float(rng.uniform(0, 1e-4)), wire + waits, waits,
                            "xy"[int(rng.integers(0, 2))])))
    after = [(float(rng.uniform(0, 3e-4)), frozenset([r])) for r in rng.permutation(k)]
    if rng.uniform() < 0.3:
        after.insert(0, (1e-4, frozenset()))
    return Timeline(tuple(float(x) for x in rng.uniform(0, 1e-3, k + 1)), tuple(reductions),
                    tuple(after), reduced, 0.25, bucket_mb, hides)


def random_parts(rng, kinds=0, overlap=False):
    def part():
        time, persistent, saved, transient = (float(x) for x in
                                              rng.uniform(0, 1, 4) * [1e-3, GB, GB, GB])
        buffers = float(rng.uniform(0, persistent))
        forward, backward = (float(x) for x in rng.uniform(0, transient, 2))
        making = float(rng.uniform(backward, transient + buffers))
        update = float(rng.uniform(0, 1e-2))
        unlike = tuple(float(x) for x in rng.uniform(0, time, kinds))
        line = random_timeline(rng, update / 2) if overlap else None
        # ZeRO's write-back buffer at the update: at times more than the activations
        writeback = float(rng.uniform(0, 3 * GB)) if rng.uniform() < 0.5 else 0.0
        return (PartCost(time, persistent, saved, transient, buffers, forward, backward,
                         making, update, unlike + (time,) if kinds else (), line,
                         writeback), None)
    return {"first": part(), "block": part(), "last": part()}


@pytest.mark.parametrize("seed", range(20))
def test_every_block_count_at_once_equals_one_stage_at_a_time(seed):
    rng = np.random.default_rng(2100 + seed)
    parts = random_parts(rng, kinds=seed % 3, overlap=seed % 2 == 1)
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


def exposed_by_the_estimates_rule(lines, bucket_mb, hides):
    """What :func:`exposed` (the estimate's rule, op by op) pays for the reductions of
    ``lines`` run one after another, cut into buckets by the runtime's cut."""
    backward, reductions, after = [], [], []
    for line in lines:
        base, first = len(backward), len(reductions)
        backward += line.backward
        reductions += [(base + ready, nbytes, terms) for ready, nbytes, terms in line.reductions]
        after += [(seconds, {first + r for r in reads}) for seconds, reads in line.after]
    if not reductions:
        return 0.0
    buckets = cut([(r, nbytes) for r, (_, nbytes, _) in enumerate(reductions)], bucket_mb)
    bucket_of = {r: b for b, (items, _) in enumerate(buckets) for r in items}
    priced = [(reductions[items[-1]][0], *bucket_terms(reductions[r][2] for r in items))
              for items, _ in buckets]
    return exposed(backward, priced, [(s, {bucket_of[r] for r in reads}) for s, reads in after],
                   hides)[0]


@pytest.mark.parametrize("seed", range(30))
def test_a_stages_buckets_over_its_parts_pay_what_the_estimates_rule_says(seed):
    """Issue #64: a stage of E, m blocks and H reduces its gradients in buckets cut over
    all its parts, H's first (the backward's order). The accountant's rows for every m
    at once (the cut of a prefix reused) equal the estimate's rule over the parts laid
    end to end, op by op, on random parts: buckets of 1 to 25 MB over reductions of 0.1
    to 3 MB, groups that meet once per bucket, devices that hide all or part of the wire."""
    rng = np.random.default_rng(4600 + seed)
    head = [random_timeline(rng)] if seed % 3 else []
    block = random_timeline(rng)
    tail = [random_timeline(rng)] if seed % 4 else []
    n = int(rng.integers(0, 8))
    bucket_mb, hides = [1.0, 4.0, 25.0][seed % 3], [1.0, 0.4][seed % 2]
    rows = exposed_rows(head, block, tail, n, bucket_mb, hides)
    for m in range(n + 1):
        assert rows[m] == pytest.approx(
            exposed_by_the_estimates_rule(head + [block] * m + tail, bucket_mb, hides),
            rel=1e-12, abs=1e-15)


def test_a_stage_pays_its_reductions_less_what_its_buckets_hide():
    """One block whose backward (2 ms) makes a 30 MB gradient after 1 ms, reduced in 1.5 ms
    of wire: priced whole by its part (1.5 ms in its update), the stage's bucket starts
    after 1 ms and ends at 2.5 ms, so the update waits 0.5 ms: 1 ms of it hidden, and the
    seconds per micro-batch hold the update's share of it (0.25)."""
    line = Timeline((1e-3, 1e-3), ((1, 30 * MB, (1.5e-3, 1.5e-3, 0.0, "x")),),
                    ((2e-4, frozenset([0])),), 1.5e-3, 0.25, 25.0, 1.0)
    block = PartCost(4e-3, 0, 0, 0, update=1.7e-3, timeline=line)
    price = stage_cost({"block": (block, None)}, False, 1, False)
    assert price.update == pytest.approx(1.7e-3 - 1e-3)
    assert price.seconds == pytest.approx(4e-3 - 0.25 * 1e-3)
