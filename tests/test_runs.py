"""Stage options of a model of identical blocks (passes/search/stages/runs.py): each logical
mesh offers the fastest block and blocks of smaller peak memory ("memory variants"),
each the fastest within half the previous one's peak, and no option the stage DP would
never prefer; the variants are searched only when nothing fits or a mesh's alike stages
would beat the best plan with unlimited memory, and the plan equals the eager one (the
stage DP on every option, the stages' transfers priced alike)."""

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402
from distgraph.passes.search.stages.layers import block_layers  # noqa: E402
from distgraph.errors import PlanError  # noqa: E402
from distgraph.passes.search.stages.run_dp import plan_runs  # noqa: E402
from distgraph.passes.search.stages.block_plans import plan_blocks  # noqa: E402
from distgraph.passes.pipeline.accumulate import split_micro_batches  # noqa: E402
from distgraph.passes.search.layouts.ilp import evaluate  # noqa: E402
from distgraph.passes.search.layouts.charges import reused_reshards  # noqa: E402
from distgraph.passes.search.layouts.intra_op import _carried, held_peak  # noqa: E402
from distgraph.passes.search.layouts.ilp_problem import peak_memory  # noqa: E402
from distgraph.passes.search.stages.part_cost import measure  # noqa: E402
from distgraph.passes.search.stages.runs import RunCosts, logical_mesh  # noqa: E402
from distgraph.passes.search.stages.run_variants import VARIANTS  # noqa: E402
from distgraph.program_builder import build_program  # noqa: E402

import plans as P  # noqa: E402
import search_cases as S  # noqa: E402

BATCH = 16


MICRO = 4
# slow links: the fastest block computes everything everywhere, so it peaks high
CLUSTER = S.line_cluster(4, bandwidth=0.01)


def tight_cluster(memory: float):
    """CLUSTER with ``memory`` GB per device."""
    return S.line_cluster(4, bandwidth=0.01, device=dict(S.DEVICE, memory=memory))


def run_costs(**dims) -> RunCosts:
    dims = dict(P.GPT_DIMS, n_layer=4, **dims)
    data = P.Dataset("gpt", dims=dims, batch=BATCH)
    ins, labels = dg.app.data.DataLoader(data, BATCH).specs(1)
    prepared = build_program(P.build_model("gpt", dims=dims), ins, labels, P.loss_fn("gpt"),
                         dg.optim.AdamW(0.01))
    layering = block_layers(prepared.program, prepared.block_paths)
    return RunCosts(prepared, dg.Strategy(auto_mode="full", pipeline=True), CLUSTER,
                    layering, micro=MICRO)


@pytest.fixture(scope="module")
def costs():
    costs = run_costs()
    return costs, costs.options()


def figures(option) -> list:
    costs = [option.parts[part][0] for part in sorted(option.parts)]
    return [x for c in costs for x in (c.time, c.persistent, c.saved, c.transient)]


def test_variants_halve_the_peak_at_the_least_time(costs):
    runs, _ = costs
    searched = [[s.fastest] + s.smaller for (owner, _), kind in
                runs.session.table("mesh searches").items() if owner is runs
                for s in kind.found]
    assert any(len(variants) > 1 for variants in searched)
    for variants in searched:
        assert 1 <= len(variants) <= VARIANTS
        peaks = [v["block"].report.peak_memory for v in variants]
        times = [v["block"].report.objective for v in variants]
        for previous, peak in zip(peaks, peaks[1:]):
            assert peak <= previous / 2 * (1 + 1e-9)
        # a tighter budget never makes the block faster
        assert times == sorted(times)


def test_the_embedding_and_the_head_halve_with_the_block():
    """A vocabulary of 1,024 on slow links: the fastest E and H keep their weights whole
    (16 bytes a parameter on every device); a variant's E and H peak within half the
    one's before it where a layout of theirs does, and never above it (the first and
    the last stage hold them beside their blocks)."""
    runs = run_costs(vocab_size=1024)
    runs.options()
    found = [s for (owner, _), kind in runs.session.table("mesh searches").items()
             if owner is runs for s in kind.found]
    # each leaner variant is a variant's block with E and H of their own
    blocks = [id(v["block"]) for s in found for v in s.smaller]
    assert all(id(v["block"]) in blocks for s in found for v in s.leaner)
    searched = [[s.fastest] + s.leaner for s in found]
    halved = set()
    for variants in searched:
        for part in ("first", "last"):
            peaks = [v[part].report.peak_memory for v in variants]
            assert all(b <= a * (1 + 1e-9) for a, b in zip(peaks, peaks[1:])), (part, peaks)
            if any(b <= a / 2 * (1 + 1e-9) for a, b in zip(peaks, peaks[1:])):
                halved.add(part)
    assert halved == {"first", "last"}


def test_a_budget_with_micro_batches_in_flight_counts_their_saved_activations():
    """A stage keeping k micro-batches in flight holds its blocks' saved activations k
    times: a search with ``in_flight=k`` keeps weights, states and k times the saved
    within its budget (where a budget on one micro-batch's peak picks a block whose k
    in flight do not fit), and reports its choice as one micro-batch, as the problem
    without the weighting prices it."""
    runs = run_costs(max_seq_len=32)        # activations outweigh the weights
    (option,) = [o for o in runs.options(variants=False) if o.logical == (2, 2)]
    mesh, device_of = logical_mesh(option.sub.mesh, option.sub.shape, option.logical)
    fastest = {part: result for part, (_, result) in option.parts.items()}
    k = 4
    budget = 0.75 * held_peak(fastest["block"], runs.weights, k)
    held = runs._within(mesh, device_of, fastest, budget, k)["block"]
    plain = runs._within(mesh, device_of, fastest, budget, 1)["block"]
    assert held_peak(held, runs.weights, k) <= budget < held_peak(plain, runs.weights, k)
    cost = measure(held, runs.program, runs.weights, runs.strategy)
    assert cost.persistent + k * cost.saved <= budget
    assert held.report.in_flight == k and plain.report.in_flight == 1
    assert held.report.peak_memory == peak_memory(plain.problem, held.choice)
    assert held.report.objective >= plain.report.objective     # the memory costs time


def test_variants_for_the_micro_batches_in_flight_let_a_faster_plan_fit():
    """8 devices of 1.5 MB and activations outweighing the weights: a stage of 4 devices
    keeps 2 micro-batches in flight, so the variants that halve one micro-batch's peak
    are not the ones its stages need; the in-flight variants (searched on the kind's
    8-device mesh, priced on 4) give a faster plan than the options without them (ZeRO
    off: with the states split the plain options fit)."""
    dims = dict(P.GPT_DIMS, n_layer=4, max_seq_len=32)
    data = P.Dataset("gpt", dims=dims, batch=BATCH)
    ins, labels = dg.app.data.DataLoader(data, BATCH).specs(1)
    built = build_program(P.build_model("gpt", dims=dims), ins, labels, P.loss_fn("gpt"),
                          dg.optim.AdamW(0.01))
    cluster = S.line_cluster(8, bandwidth=0.01, device=dict(S.DEVICE, memory=1.5e-3))
    runs = RunCosts(built, dg.Strategy(auto_mode="full", pipeline=True, sharding=False),
                    cluster, block_layers(built.program, built.block_paths), micro=MICRO)
    options = runs.options()

    def searched(option):
        return (option.origin[2] if option.origin else {"block": option.parts["block"][1]})

    held = [o for o in options if searched(o)["block"].report.in_flight > 1]
    assert any(o.sub.size == 4 and searched(o)["block"].space.mesh.size == 8 for o in held)

    def latency(options):
        try:
            return plan_runs(runs.layering.count, runs.blocks, options, cluster, MICRO,
                             p2p=runs.p2p_seconds)[0].objective
        except PlanError:
            return math.inf
    assert latency(options) < latency([o for o in options if o not in held])


def test_no_option_is_matched_or_beaten_by_another_on_its_mesh(costs):
    _, options = costs
    groups = {}
    for option in options:
        groups.setdefault((option.axis, option.sub.shape, option.logical), []).append(option)
    assert len(groups) == 6       # 1 device; 2 as [2, 1], [1, 2]; 4 as [4, 1], [2, 2], [1, 4]
    assert any(len(group) > 1 for group in groups.values())
    for group in groups.values():
        for a in group:
            for b in group:
                if a is not b:
                    assert not all(x <= y for x, y in zip(figures(a), figures(b))), (a, b)


def eager_plan(costs, cluster) -> tuple:
    runs, options = costs
    return plan_runs(runs.layering.count, runs.blocks, options, cluster, MICRO,
                     p2p=runs.p2p_seconds)


def same_plan(a, b) -> bool:
    (plan_a, chosen_a), (plan_b, chosen_b) = a, b
    return plan_a.stages == plan_b.stages and plan_a.objective == plan_b.objective and \
        [(str(o), figures(o)) for o in chosen_a] == [(str(o), figures(o)) for o in chosen_b]


def test_variants_are_not_searched_where_the_fastest_options_lose_nothing_to_memory(costs):
    lazy = run_costs()
    fastest = lazy.options(variants=False)
    searched = lazy.searches
    plan = plan_blocks(lazy, CLUSTER, MICRO)
    assert lazy.searches == searched < costs[0].searches
    free, _ = plan_runs(lazy.layering.count, lazy.blocks, fastest, CLUSTER, MICRO,
                        fit_memory=False, p2p=lazy.p2p_seconds)
    assert plan[0].objective == free.objective
    assert same_plan(plan, eager_plan(costs, CLUSTER))


def least_memory(runs, options) -> float:
    """The least device memory (GB) at which plan_runs finds a plan on ``options``: a
    stage fits where its peak, ``memory + (s - 1) saved`` with s micro-batches in flight
    (at most one per device; ``memory`` the stage's with one in flight, or where it holds
    every micro-batch the one with the forwards first: terms.held), is within the
    device's, so the least is one of those peaks; the smallest that fits (fitting is
    monotone in the memory)."""
    count, blocks, devices = runs.layering.count, runs.blocks, CLUSTER.device_meshes[0].size
    firsts = (False, True) if blocks.start else (False,)
    lasts = (False, True) if blocks.stop < count else (False,)
    peaks = sorted({memory + (s - 1) * saved for o in options for f in firsts for last in lasts
                    for m in range(len(blocks) + 1)
                    for _, one, saved, before, _ in [o.cost(f, m, last)]
                    for memory in (one, before) for s in range(1, devices + 1)})

    def fits(memory):
        try:
            plan_runs(count, blocks, options, tight_cluster(memory), MICRO)
            return True
        except PlanError:
            return False
    lo, hi = 0, len(peaks) - 1
    assert fits(peaks[hi])
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(peaks[mid]) else (mid + 1, hi)
    return peaks[lo]


def test_variants_are_searched_where_the_fastest_options_do_not_fit(costs):
    lazy = run_costs()
    fastest = lazy.options(variants=False)
    searched = lazy.searches
    # devices between the least memory the variants plan in and the least the fastest
    # options do (derived from their peaks, not a number that drifts with the models)
    low, high = least_memory(costs[0], costs[1]), least_memory(costs[0], fastest)
    assert low < high, (low, high)      # the variants plan in less memory than the fastest
    tight = tight_cluster((low + high) / 2)
    with pytest.raises(PlanError):      # the premise: only the variants fit `tight`
        plan_runs(lazy.layering.count, lazy.blocks, fastest, tight, MICRO)
    plan = plan_blocks(lazy, tight, MICRO)
    assert searched < lazy.searches == costs[0].searches
    assert same_plan(plan, eager_plan(costs, tight))
    assert all(figures(o) not in [figures(f) for f in fastest] for o in plan[1])


def split_costs(micro: int, donor=None) -> RunCosts:
    """RunCosts of the test's GPT split into ``micro`` micro-batches, as the micro-batch
    search prices it (``donor``: the RunCosts of another count)."""
    whole = run_costs().prepared
    split, _ = split_micro_batches(whole, micro)
    return RunCosts(split, dg.Strategy(auto_mode="full", pipeline=True), CLUSTER,
                    block_layers(split.program, split.block_paths), micro, donor)


def test_a_donor_prices_its_layouts_on_another_micro_batch_count_by_the_same_model():
    # another count's searches priced here cost what this program's own search space
    # says those layouts cost: the transplant changes the shapes, not the model
    donor = split_costs(2)
    donor.options()
    other = split_costs(4, donor)
    options = other.options()
    assert other.searches < donor.searches        # most layouts came from the donor
    lent = {id(r.space) for (owner, _), kind in donor.session.table("mesh searches").items()
            if owner is donor for s in kind.found
            for parts in [s.fastest] + (s.smaller or []) for r in parts.values()}
    checked, moved = 0, 0
    for option in options:
        cost, result = option.parts["block"]
        assert result.space.program is other.program
        mesh, device_of = logical_mesh(option.sub.mesh, option.sub.shape, option.logical)
        own = other._search(mesh, device_of)["block"]     # this program's whole space
        choice = _carried(result, own.space, own.problem)
        if choice is None:      # a split over a dim of size 1, which the space lists not
            assert 1 in option.logical
            continue
        shared = reused_reshards(own.space, own.problem, choice)
        assert evaluate(own.problem, choice) - shared == pytest.approx(cost.time, rel=1e-12)
        checked += 1
        mine = donor.options()
        twin = [o for o in mine if (o.axis, o.sub.shape, o.logical) ==
                (option.axis, option.sub.shape, option.logical) and
                o.parts["block"][1].report.layouts == result.report.layouts]
        moved += bool(twin) and twin[0].parts["block"][0].time != cost.time
    assert checked >= 6 and moved >= 1 and lent


def test_boundary_prices_shared_by_key_equal_each_options_own(costs):
    # p2p_seconds is cached per boundary_key (what boundary_seconds reads): every option's
    # figure equals its own boundary priced afresh
    from distgraph.passes.cost.boundary import boundary_key, boundary_seconds

    runs, options = costs
    options = options + runs.options(variants=True)
    priced = [runs.p2p_seconds(o) for o in options]
    assert priced == [boundary_seconds(o, CLUSTER) for o in options]
    assert any(p > 0 for p in priced)
    kept = {key[1] for key in runs.session.table("boundary prices") if len(key) == 2}
    assert {boundary_key(o) for o in options} <= kept


def kept_entries(session) -> int:
    """How many records a session's SearchSpaces keep (per mesh shape: rules and
    strategies, followed and free choices)."""
    return len(session.table("op strategies"))


def test_spaces_sharing_rules_equal_spaces_made_afresh(costs):
    # a session keeps per mesh shape each source's layouts and each unannotated op's
    # choices (free or followed, by what they depend on): spaces made from them, for
    # each part, on a (x, y) and a (dp, cp, tp) mesh and on the whole program, equal
    # spaces made with nothing shared, node for node
    from distgraph.passes.search.layouts.space import SearchSpace
    from distgraph.passes.session import Session

    runs, _ = costs
    program = runs.program
    shared = Session()
    meshes = [dg.ProcessMesh([[0, 1], [2, 3]], ["x", "y"]),
              dg.ProcessMesh([[[0, 1]], [[2, 3]]], ["x", "cp", "y"]),
              dg.ProcessMesh([[[0], [1]], [[2], [3]]], ["x", "cp", "y"])]
    parts = [runs.layering.ops(layers) for layers in (
        range(0, 1), range(runs.rep, runs.rep + 1), range(runs.rep + 1, runs.rep + 2),
        range(runs.layering.count - 1, runs.layering.count))] + [None]
    hits = 0
    for mesh in meshes:
        for ops in parts:
            before = kept_entries(shared)
            kept = SearchSpace(program, mesh, ops, session=shared)
            fresh = SearchSpace(program, mesh, ops)
            assert kept.nodes == fresh.nodes
            after = kept_entries(shared)
            hits += after == before
    assert hits            # some spaces were made from what others kept alone


def test_spaces_of_parts_read_the_shared_program_index_as_a_scan_of_the_program(costs):
    # a part's Values received from outside and sent outside, found from the program's
    # index (made once per program in the session's program facts), equal a scan of
    # every op
    from distgraph.passes.search.layouts.space import SearchSpace
    from distgraph.passes.session import Session

    runs, _ = costs
    program = runs.program
    shared = Session()
    mesh = dg.ProcessMesh([[0, 1], [2, 3]], ["x", "y"])
    for layers in (range(0, 1), range(runs.rep, runs.rep + 1), range(1, 3),
                   range(runs.layering.count - 1, runs.layering.count)):
        ops = runs.layering.ops(layers)
        inside = set(ops)
        made = {o.name for k in ops for o in program.ops[k].outputs}
        made_all = {o.name for op in program.ops for o in op.outputs}
        leaving = {v.name for k, op in enumerate(program.ops) if k not in inside
                   for v in op.inputs if v.name in made}
        received = {v.name for k in ops for v in program.ops[k].inputs
                    if v.name in made_all - made}
        for session in (shared, shared, None):
            space = SearchSpace(program, mesh, ops, session=session)
            assert space.leaving == leaving and space.boundary == received
            assert leaving and received
