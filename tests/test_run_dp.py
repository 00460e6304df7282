"""The stage DP for runs of identical blocks (passes/search/run_dp.py) against Alpa's
general stage DP (passes/search/stage_dp.py, itself checked against brute force) on the
same costs: the same optimum, whatever the parts' times and memories."""

import itertools
import math
import os
import sys

import numpy as np
import pytest

from distgraph.errors import PlanError
from distgraph.passes.search.run_dp import _bound, _setup, beats, plan_runs
from distgraph.passes.search.runs import PartCost, RunOption
from distgraph.units import GB
from distgraph.passes.search.stage_dp import StageCost, Submesh, plan_stages
from distgraph.resources.cluster import Cluster, Device, Link, Machine

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run_dp_reference as reference  # noqa: E402


def cluster_of(rows, cols, memory):
    machines, firsts = [], []
    for m in range(rows):
        devs = tuple(Device(m * cols + j, j, m, "GPU", "g", {"float32": 100.0}, memory)
                     for j in range(cols))
        links = tuple(Link(a.global_id, b.global_id, 100, 1)
                      for a, b in itertools.combinations(devs, 2))
        machines.append(Machine(m, f"h{m}", devs, links))
        firsts.append(m * cols)
    return Cluster(tuple(machines), tuple(Link(a, b, 10, 5) for a, b in
                                          itertools.pairwise(firsts)))


def random_options(rng, cluster, parts):
    mesh = cluster.device_meshes[0]
    rows, cols = (1, mesh.shape[0]) if len(mesh.shape) == 1 else mesh.shape
    shapes = [(n, cols) for n in range(1, rows + 1) if rows % n == 0]
    if rows == 1:
        shapes = [(1, m) for m in (1, 2, 4) if m < cols and cols % m == 0] + shapes
    options = []
    for shape in shapes:
        size = shape[0] * shape[1]
        speed = size ** rng.uniform(0.5, 1.0)

        def part(scale):
            return (PartCost(scale * rng.uniform(0.5, 1.5) / speed,
                             GB * scale * rng.uniform(0, 1.0) / size,
                             GB * scale * rng.uniform(0, 0.5) / size,
                             GB * scale * rng.uniform(0, 0.3)), None)
        found = {name: part(scale) for name, scale in parts.items()}
        options.append(RunOption(0, Submesh(mesh, shape, cluster.device(mesh.ids[0])),
                                 (size, 1), found))
    return options, shapes


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("ends", ["both", "first", "last", "none"])
def test_run_dp_equals_the_general_dp(seed, ends):
    rng = np.random.default_rng(seed)
    rows, cols = [(1, 4), (2, 4), (4, 2)][seed % 3]
    cluster = cluster_of(rows, cols, memory=float(rng.uniform(1.0, 3.0)))
    n = int(rng.integers(4, 7))
    first, last = ends in ("both", "first"), ends in ("both", "last")
    parts = {"block": 1.0, **({"first": 0.4} if first else {}), **({"last": 0.7} if last else {})}
    options, shapes = random_options(rng, cluster, parts)
    count = n + first + last
    blocks = range(int(first), int(first) + n)
    B = int(rng.integers(1, 9))
    by_shape = {o.sub.shape: o for o in options}

    def cost(layers, sub):
        k, i = layers.start, layers.stop - 1
        m = len(range(max(k, blocks.start), min(i + 1, blocks.stop)))
        return StageCost(*by_shape[sub.shape].cost(k < blocks.start, m, i >= blocks.stop))

    try:
        general = plan_stages(count, cluster, cost, micro_batches=B,
                              shapes={cluster.device_meshes[0].name: shapes})
    except PlanError:
        with pytest.raises(PlanError):
            plan_runs(count, blocks, options, cluster, micro_batches=B)
        return
    plan, chosen = plan_runs(count, blocks, options, cluster, micro_batches=B)
    assert plan.objective == pytest.approx(general.objective, rel=1e-9)
    # the bound that skips the DP where it cannot go below a latency is a lower bound
    runs, search = _setup(count, blocks, options, cluster, B, True)
    assert _bound(runs, search, cluster.device_meshes[0].size) <= plan.objective * (1 + 1e-12)
    assert sorted(d for s in plan.stages for d in s.device_ids) == \
        [d.global_id for d in cluster.devices]
    assert [s.layers for s in plan.stages][0].start == 0
    assert plan.stages[-1].layers.stop == count
    for stage, option in zip(plan.stages, chosen):
        assert stage.shape == option.sub.shape
        assert stage.memory <= cluster.devices[0].memory + 1e-9


def two_kind_cluster(rng, shape_a, shape_b):
    """Machines of two GPU models, so two device meshes (one per model)."""
    machines, firsts = [], []
    for m, (model, cols, memory) in enumerate(
            [("a", shape_a[1], 2.0)] * shape_a[0] + [("b", shape_b[1], 1.5)] * shape_b[0]):
        base = sum(len(x.devices) for x in machines)
        devs = tuple(Device(base + j, j, m, "GPU", model, {"float32": 100.0},
                            memory * float(rng.uniform(0.8, 1.2)) if j == 0 else memory)
                     for j in range(cols))
        links = tuple(Link(a.global_id, b.global_id, 100, 1)
                      for a, b in itertools.combinations(devs, 2))
        machines.append(Machine(m, f"h{m}", devs, links))
        firsts.append(base)
    return Cluster(tuple(machines), tuple(Link(a, b, 10, 5) for a, b in
                                          itertools.pairwise(firsts)))


def variant_options(rng, cluster, parts):
    """Per device mesh and submesh, two or three logical shapes / memory variants:
    options that trade time for memory, as RunCosts offers them."""
    options = []
    for axis, mesh in enumerate(cluster.device_meshes):
        rows, cols = (1, mesh.shape[0]) if len(mesh.shape) == 1 else mesh.shape
        shapes = [(n, cols) for n in range(1, rows + 1) if rows % n == 0]
        if rows == 1:
            shapes = [(1, m) for m in (1, 2, 4) if m < cols and cols % m == 0] + shapes
        for shape in shapes:
            size = shape[0] * shape[1]
            for variant in range(int(rng.integers(2, 4))):
                speed = size ** rng.uniform(0.5, 1.0) / (1 + 0.3 * variant)
                split = size * 2 ** variant

                def part(scale):
                    return (PartCost(scale * rng.uniform(0.5, 1.5) / speed,
                                     GB * scale * rng.uniform(0, 1.0) * 2 / split,
                                     GB * scale * rng.uniform(0, 0.5) / size,
                                     GB * scale * rng.uniform(0, 0.3)), None)
                found = {name: part(scale) for name, scale in parts.items()}
                options.append(RunOption(axis, Submesh(mesh, shape,
                                                       cluster.device(mesh.ids[0])),
                                         (size, variant + 1), found))
    return options


def random_layers(rng, cluster, seed):
    """(options, count, blocks, micro-batches) of a random model of 5-12 blocks, E and H
    present or not by ``seed``."""
    n = int(rng.integers(5, 13))
    first, last = seed % 4 != 3, seed % 3 != 2
    parts = {"block": 1.0, **({"first": 0.4} if first else {}), **({"last": 0.7} if last else {})}
    options = variant_options(rng, cluster, parts)
    count, blocks = n + first + last, range(int(first), int(first) + n)
    return options, count, blocks, int(rng.integers(1, 17))


def random_case(rng, seed):
    """A random cluster (two device kinds on odd seeds, one on even) and its random
    layers (:func:`random_layers`): (cluster, (options, count, blocks, B))."""
    if seed % 2:
        cluster = two_kind_cluster(rng, *[((2, 4), (1, 4)), ((1, 4), (2, 2)),
                                          ((4, 2), (1, 2))][seed % 3])
    else:
        cluster = cluster_of(*[(1, 8), (4, 4), (8, 2)][seed % 3],
                             memory=float(rng.uniform(1.0, 3.0)))
    return cluster, random_layers(rng, cluster, seed)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("fit_memory", [True, False])
def test_run_dp_equals_its_previous_implementation(seed, fit_memory):
    """The vectorised DP returns the plan the previous one returned (run_dp_reference):
    the same stages, objective, caps solved and options, on one and two device meshes;
    and ``beats`` answers whether that objective lies below a latency."""
    rng = np.random.default_rng(100 + seed)
    cluster, (options, count, blocks, B) = random_case(rng, seed)
    args = (count, blocks, options, cluster, B, fit_memory)
    try:
        old, old_chosen = reference.plan_runs(*args)
    except PlanError:
        with pytest.raises(PlanError):
            plan_runs(*args)
        assert not beats(math.inf, *args)
        return
    plan, chosen = plan_runs(*args)
    assert plan == old                      # stages, objective and dp_runs, exactly
    assert [options.index(o) for o in chosen] == [options.index(o) for o in old_chosen]
    assert beats(old.objective * (1 + 1e-9), *args)
    assert not beats(old.objective, *args)


@pytest.mark.parametrize("seed", range(28, 48))     # 32 and 44 failed before the fix
def test_run_dp_prices_the_stage_transfers_once_per_stage(seed):
    """With the stages' transfers priced (``p2p``: seconds per micro-batch of a middle
    stage, half that for the first and the last), the run DP equals the general DP
    given each stage's time plus its share: a stage of m blocks pays them once, not m
    times."""
    rng = np.random.default_rng(300 + seed)
    rows, cols = [(1, 4), (2, 4), (4, 2)][seed % 3]
    cluster = cluster_of(rows, cols, memory=float(rng.uniform(2.0, 4.0)))
    n = int(rng.integers(8, 13))
    first, last = seed % 4 != 3, seed % 3 != 2
    parts = {"block": 1.0, **({"first": 0.4} if first else {}), **({"last": 0.7} if last else {})}
    options, shapes = random_options(rng, cluster, parts)
    sends = {o.sub.shape: float(rng.uniform(0.2, 2.0)) * o.parts["block"][0].time
             for o in options}
    count, blocks = n + first + last, range(int(first), int(first) + n)
    B = int(rng.integers(1, 9))
    by_shape = {o.sub.shape: o for o in options}

    def cost(layers, sub):
        k, i = layers.start, layers.stop - 1
        m = len(range(max(k, blocks.start), min(i + 1, blocks.stop)))
        head, tail = k < blocks.start, i >= blocks.stop
        seconds, memory, further = by_shape[sub.shape].cost(head, m, tail)
        return StageCost(seconds + sends[sub.shape] * (2 - head - tail) / 2, memory, further)

    def p2p(option):
        return sends[option.sub.shape]

    try:
        general = plan_stages(count, cluster, cost, micro_batches=B,
                              shapes={cluster.device_meshes[0].name: shapes})
    except PlanError:
        with pytest.raises(PlanError):
            plan_runs(count, blocks, options, cluster, micro_batches=B, p2p=p2p)
        return
    plan, _ = plan_runs(count, blocks, options, cluster, micro_batches=B, p2p=p2p)
    assert plan.objective == pytest.approx(general.objective, rel=1e-9)


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("fit_memory", [True, False])
def test_run_dp_skipping_slower_options_keeps_the_plan(seed, fit_memory, monkeypatch):
    """The DP skips, per stage count, an option that another of the same mesh and size
    matches in every time and reach (``_RunSearch._live``); with every option that fits
    relaxed instead, it returns the same plan, stage for stage."""
    from distgraph.passes.search import run_dp

    rng = np.random.default_rng(500 + seed)
    cluster = cluster_of(*[(1, 8), (4, 4), (8, 2)][seed % 3],
                         memory=float(rng.uniform(1.0, 3.0)))
    options, count, blocks, B = random_layers(rng, cluster, seed)
    # some options as fast as another of their submesh, to be skipped where they reach less
    options += [RunOption(o.axis, o.sub, o.logical + (2,),
                          {k: (PartCost(c.time, c.persistent * 2, c.saved, c.transient), r)
                           for k, (c, r) in o.parts.items()}) for o in options[::2]]

    def p2p(option):
        return 0.1 * option.parts["block"][0].time

    def answer():
        try:
            plan, chosen = plan_runs(count, blocks, options, cluster, B, fit_memory, p2p=p2p)
        except PlanError:
            return None
        return plan, [options.index(o) for o in chosen]

    pruned = answer()
    everything = run_dp._RunSearch._live

    def unpruned(self, most, keys, s):
        blocks_at = keys.index((False, False))
        return [n for n, m in enumerate(most) if int(m[s][blocks_at]) >= 1 or
                any(int(x) >= 0 for j, x in enumerate(m[s]) if j != blocks_at)]

    monkeypatch.setattr(run_dp._RunSearch, "_live", unpruned)
    assert answer() == pruned
    monkeypatch.setattr(run_dp._RunSearch, "_live", everything)


@pytest.mark.parametrize("seed", range(12))
def test_alike_stages_that_fit_bound_the_dp_from_above(seed):
    """The first DP of plan_blocks is pruned from the start by the best plan of alike
    stages that fits as the DP counts memory (block_plans._fitting_alike): a plan the DP
    can make, so its objective is no less than the DP's optimum, and the DP below it
    finds that optimum."""
    from distgraph.passes.search.block_plans import _fitting_alike

    rng = np.random.default_rng(700 + seed)
    cluster = cluster_of(*[(1, 8), (4, 4), (8, 2)][seed % 3],
                         memory=float(rng.uniform(1.0, 3.0)))
    options, count, blocks, B = random_layers(rng, cluster, seed)

    def p2p(option):
        return 0.2 * option.parts["block"][0].time

    fits = _fitting_alike(options, count, blocks, cluster, B, p2p)
    try:
        plan, _ = plan_runs(count, blocks, options, cluster, B, p2p=p2p)
    except PlanError:
        assert math.isinf(fits)
        return
    assert plan.objective <= fits * (1 + 1e-12)
    if math.isfinite(fits):
        bounded, _ = plan_runs(count, blocks, options, cluster, B, p2p=p2p,
                               below=fits * (1 + 1e-9))
        assert bounded.objective == pytest.approx(plan.objective, rel=1e-12)


@pytest.mark.parametrize("S, v, M", [(4, 2, 8), (8, 8, 32), (16, 8, 16), (8, 4, 8)])
def test_interleaved_objective_is_the_replayed_schedules_makespan(S, v, M):
    """S alike stages of v one-block chunks, a block's F + B taking the unit-cost clock's
    3, no transfers: alike_stages' objective is the makespan schedule.replay finds for
    interleaved 1F1B (M u + (S - 1) u / v; it was M u + (S - v) u / v, no bubble at
    S = v)."""
    from distgraph.passes.pipeline.schedule import COST, chain, make_schedule, replay
    from distgraph.passes.search.interleaved import alike_stages

    problem = chain(S, v, M, "1F1B")
    makespan = replay(make_schedule(problem).orders, problem).makespan
    cluster = cluster_of(1, S, memory=1e3)
    block = (PartCost(COST["F"] + COST["B"], 0.0, 0.0, 0.0), None)
    option = RunOption(0, Submesh(cluster.device_meshes[0], (1, 1), cluster.device(0)),
                       (1, 1), {"block": block})
    count = S * v

    def chunk_layers(n):
        return [{k: 1.0} for k in range(n)]

    objective, times, _ = alike_stages(option, count, range(count), cluster, M, v,
                                       chunk_layers)
    assert times == [v * 3.0] * S
    assert objective == pytest.approx(makespan, rel=1e-12)


@pytest.mark.parametrize("seed", range(10))
def test_the_prefix_bound_bounds_every_longer_plan_and_keeps_each_caps_answer(seed):
    """``_RunSearch.solve_cap`` stops adding stages once ``longer_bound`` (the least
    ``F(s, k, d) + P[k, d]`` over the entries whose layers 0..k-1 the units left can
    hold, ``P`` the least any stages covering them can cost) is no less than the best
    plan found, or inf: on every cap, every plan of more stages than s (the full DP's
    tables, the bound switched off) sums to at least that bound (and none exists where
    it is inf), and the cap's answer (summed time and stages) is the full DP's."""
    from distgraph.passes.search import run_dp

    rng = np.random.default_rng(900 + seed)
    cluster, (options, count, blocks, B) = random_case(rng, seed)

    def p2p(option):
        return 0.05 * option.parts["block"][0].time

    _, search = run_dp._setup(count, blocks, options, cluster, B, True, p2p)
    full = (0,) + tuple(search.caps)
    keys = list(search.options[0].table)
    stopped = 0
    caps = search.caps_sorted
    for cap in caps[::max(1, len(caps) // 24)]:          # 24 caps or so, low to high
        answer = search.solve_cap(float(cap))
        levels = search.levels
        tables = []         # the table of each stage count, 1, 2 .. (never stopping early)
        search.longer_bound = lambda G, density: (tables.append(G), -math.inf)[1]
        plain = search.solve_cap(float(cap))
        del search.longer_bound
        assert answer == plain
        stopped += levels < search.levels
        most = [np.stack([r.reach(search.max_stages, float(cap), B)[key] for key in keys],
                         axis=1) for r in search.options]
        density = search._densities(most, keys)
        for s, G in enumerate(tables, start=1):
            low = search.longer_bound(G, density[min(s + 1, search.max_stages)])
            later = [float(t[full]) for t in tables[s:]]
            assert all(x >= low or math.isclose(x, low, rel_tol=1e-12) for x in later)
    assert stopped or len(caps) < 3
