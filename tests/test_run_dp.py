"""The stage DP for runs of identical blocks (passes/search/stages/run_dp.py) against Alpa's
general stage DP (passes/search/stages/stage_dp.py, itself checked against brute force) on the
same costs: the same optimum, whatever the parts' times and memories; and against brute
force on small cases: the least objective of every split and every option per stage,
and ties broken by the options' order. Its plans on a fixed corpus are pinned in
tests/test_search_pinned.py."""

import itertools
import math

import numpy as np
import pytest

from distgraph.errors import PlanError
from distgraph.passes.search.stages.run_dp import _bound, _setup, beats, plan_runs
from distgraph.passes.search.stages.part_cost import PartCost
from distgraph.passes.search.stages.runs import RunOption
from distgraph.units import GB
from distgraph.passes.search.stages.stage_dp import StageCost, Submesh, plan_stages
from distgraph.resources.cluster import Cluster, Device, Link, Machine


def cluster_of(rows, cols, memory):
    """GPUs whose ``memory`` (GB) a stage may fill: no reserve (``reserved_memory`` 0)."""
    machines, firsts = [], []
    for m in range(rows):
        devs = tuple(Device(m * cols + j, j, m, "GPU", "g", {"float32": 100.0}, memory,
                            reserved_memory=0.0)
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
        return StageCost(*by_shape[sub.shape].cost(k < blocks.start, m, i >= blocks.stop)[:3])

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
                            memory * float(rng.uniform(0.8, 1.2)) if j == 0 else memory,
                            reserved_memory=0.0)
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


def brute_force_runs(count, blocks, options, cluster, B, fit_memory=True, p2p=None) -> tuple:
    """Every plan the run DP may make, by enumeration, priced as run_dp's docstrings
    price it: ``count`` layers split into consecutive stages of one layer or more, each
    on one of ``options``, so that every device of every mesh holds one stage; a stage
    of ``[E] + m blocks + [H]`` on option o takes ``o.cost(E?, m, H?)`` seconds plus
    ``p2p(o) (2 - E? - H?) / 2`` (the transfers' share), and with ``s`` stages from it
    to the last keeps ``min(s, B)`` micro-batches in flight: it fits where ``memory +
    (min(s, B) - 1) activations`` is within the mesh's smallest device memory (always
    without ``fit_memory``). Returns ([(objective, ((k, i, option index), ...))] of the
    plans that fit, objective ``sum t + (B - 1) max t``; {(k, i, n): (seconds, memory,
    activations)}; the memory limit per mesh)."""
    meshes = cluster.device_meshes
    limit = [min(cluster.device(d).memory for d in m.ids) if fit_memory else math.inf
             for m in meshes]
    b0, b1 = blocks.start, blocks.stop
    cost = {}
    for k in range(count):
        for i in range(k, count):
            first, last = k < b0, i >= b1
            m = len(range(max(k, b0), min(i + 1, b1)))
            for n, o in enumerate(options):
                seconds, memory, further, *_ = o.cost(first, m, last)
                if p2p is not None:
                    seconds += p2p(o) * (2 - first - last) / 2
                cost[k, i, n] = (seconds, memory, further)
    splits = []

    def extend(k, left, stages):
        if k == count or not any(left):
            if k == count and not any(left):
                splits.append(tuple(stages))
            return
        for i in range(k, count):
            for n, o in enumerate(options):
                if o.sub.size <= left[o.axis]:
                    left[o.axis] -= o.sub.size
                    extend(i + 1, left, stages + [(k, i, n)])
                    left[o.axis] += o.sub.size

    extend(0, [m.size for m in meshes], [])
    plans = []
    for stages in splits:
        S = len(stages)
        if all(cost[st][1] + (min(S - j, B) - 1) * cost[st][2] <= limit[options[st[2]].axis]
               for j, st in enumerate(stages)):
            times = [cost[st][0] for st in stages]
            plans.append((sum(times) + (B - 1) * max(times), stages))
    return plans, cost, limit


def small_case(seed):
    """(options, count, blocks, cluster, micro-batches, p2p or None, exact): four
    devices on one device mesh ([1, 4] or [2, 2]) or two ([1, 2] each), two or three
    memory variants of every submesh (:func:`variant_options`) and a twin of every other
    option (as fast, twice the parameters, half the activations: a tie the DP breaks by
    the options' order), 1-5 blocks, E and H or not, the stages' transfers priced on
    every third seed. ``exact`` (even seeds): every time a multiple of 1/8, so that
    every sum is exact, plans tie often and objectives compare exactly."""
    rng = np.random.default_rng(2000 + seed)
    if seed % 3 == 2:
        cluster = two_kind_cluster(rng, (1, 2), (1, 2))
    else:
        cluster = cluster_of(*[(1, 4), (2, 2)][seed % 3], memory=float(rng.uniform(0.5, 2.0)))
    n = int(rng.integers(1, 6))
    first, last = seed % 4 != 3, seed % 5 != 4
    parts = {"block": 1.0, **({"first": 0.4} if first else {}), **({"last": 0.7} if last else {})}
    options = variant_options(rng, cluster, parts)
    options += [RunOption(o.axis, o.sub, o.logical + (2,),
                          {k: (PartCost(c.time, c.persistent * 2, c.saved / 2, c.transient), r)
                           for k, (c, r) in o.parts.items()}) for o in options[::2]]
    exact = seed % 2 == 0
    if exact:
        options = [RunOption(o.axis, o.sub, o.logical, {
            k: (PartCost(max(1, round(8 * c.time)) / 8, c.persistent, c.saved, c.transient), r)
            for k, (c, r) in o.parts.items()}) for o in options]
    p2p = None
    if seed % 3 == 0:
        def p2p(option):
            seconds = 0.2 * option.parts["block"][0].time
            return round(8 * seconds) / 8 if exact else seconds
    B = int(rng.integers(1, 9))
    return options, n + first + last, range(int(first), int(first) + n), cluster, B, p2p, exact


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("fit_memory", [True, False])
def test_run_dp_finds_the_brute_force_optimum_and_breaks_ties_by_the_options_order(seed,
                                                                                   fit_memory):
    """On small cases (:func:`small_case`) plan_runs returns a plan of the least
    objective any plan has (:func:`brute_force_runs`; exactly where every sum is exact),
    and refuses where none fits; its stages are priced as the enumeration prices them;
    each stage's option is the first, in the options' order, of those of its mesh and
    size that fit there as fast or faster (the walk takes the first option of the least
    total); ``beats`` and ``below`` answer whether a plan lies below a latency."""
    options, count, blocks, cluster, B, p2p, exact = small_case(seed)
    args = (count, blocks, options, cluster, B, fit_memory)
    plans, cost, limit = brute_force_runs(*args[:5], fit_memory, p2p)
    if not plans:
        with pytest.raises(PlanError):
            plan_runs(*args, p2p=p2p)
        assert not beats(math.inf, *args, p2p=p2p)
        return
    best = min(objective for objective, _ in plans)

    def least(objective) -> bool:
        return objective == best if exact else objective == pytest.approx(best, rel=1e-12)

    plan, chosen = plan_runs(*args, p2p=p2p)
    assert least(plan.objective)
    picked = [next(n for n, o in enumerate(options) if o is c) for c in chosen]
    stages = tuple((s.layers.start, s.layers.stop - 1, n) for s, n in zip(plan.stages, picked))
    S = len(stages)
    assert stages[0][0] == 0 and stages[-1][1] == count - 1
    assert all(a[1] + 1 == b[0] for a, b in zip(stages, stages[1:]))
    assert sorted(d for s in plan.stages for d in s.device_ids) == \
        [d.global_id for d in cluster.devices]
    times = [cost[st][0] for st in stages]
    assert [s.time for s in plan.stages] == times
    assert plan.objective == sum(times) + (B - 1) * max(times)
    for j, (stage, (k, i, n)) in enumerate(zip(plan.stages, stages)):
        option = options[n]
        assert stage.shape == option.sub.shape and stage.mesh == option.sub.mesh.name
        seconds, memory, further = cost[k, i, n]
        assert stage.memory == memory + (min(S - j, B) - 1) * further <= limit[option.axis]
        for o in range(n):
            other = options[o]
            if other.axis == option.axis and other.sub.size == option.sub.size:
                t, m, a = cost[k, i, o]
                assert not (t <= seconds and m + (min(S - j, B) - 1) * a <= limit[other.axis])
    assert beats(plan.objective * (1 + 1e-9), *args, p2p=p2p)
    assert not beats(best, *args, p2p=p2p)
    assert plan_runs(*args, p2p=p2p, below=best) is None
    assert least(plan_runs(*args, p2p=p2p, below=plan.objective * (1 + 1e-9))[0].objective)


def test_run_dp_keeps_the_micro_batches_1f1b_keeps_in_flight():
    """Stages of one or two of eight devices (four to seven of them, 1-3 micro-batches):
    with the devices' memory set between what the unlimited optimum (brute force) needs
    with ``min(s, B)`` micro-batches in flight at a stage ``s`` from the last, as 1F1B
    keeps, and what it would need with ``s``, plan_runs still finds that optimum."""
    checked = 0
    for seed in range(16):
        rng = np.random.default_rng(3000 + seed)
        n = int(rng.integers(4, 6))
        first, last = seed % 2 == 0, seed % 3 != 2
        parts = {"block": 1.0, **({"first": 0.4} if first else {}),
                 **({"last": 0.7} if last else {})}
        sized = [o for o in variant_options(rng, cluster_of(1, 8, 1.0), parts)
                 if o.sub.size <= 2]
        count, blocks, B = n + first + last, range(int(first), int(first) + n), \
            int(rng.integers(1, 4))
        plans, cost, _ = brute_force_runs(count, blocks, sized, cluster_of(1, 8, 1.0), B,
                                          fit_memory=False)
        best, stages = min(plans)
        S = len(stages)
        need = max(cost[st][1] + (min(S - j, B) - 1) * cost[st][2]
                   for j, st in enumerate(stages))
        more = max(cost[st][1] + (S - j - 1) * cost[st][2] for j, st in enumerate(stages))
        if not more > need:
            continue            # its stages' activations never outgrow B micro-batches
        cluster = cluster_of(1, 8, (need + more) / 2)
        mesh = cluster.device_meshes[0]
        options = [RunOption(0, Submesh(mesh, o.sub.shape, cluster.device(0)), o.logical,
                             o.parts) for o in sized]
        assert min(brute_force_runs(count, blocks, options, cluster, B)[0])[0] == best
        assert plan_runs(count, blocks, options, cluster, B)[0].objective == \
            pytest.approx(best, rel=1e-12)
        checked += 1
    assert checked >= 8


def test_the_brute_force_cases_have_ties_memory_bounds_and_refusals():
    """The cases of the test above are not all alike: some have several optimal plans,
    some an optimum the memory raises, some no plan that fits."""
    tied = bound = refused = 0
    for seed in range(40):
        options, count, blocks, cluster, B, p2p, _ = small_case(seed)
        fit = brute_force_runs(count, blocks, options, cluster, B, True, p2p)[0]
        free = brute_force_runs(count, blocks, options, cluster, B, False, p2p)[0]
        refused += not fit
        if fit:
            best = min(objective for objective, _ in fit)
            tied += sum(objective == best for objective, _ in fit) > 1
            bound += min(objective for objective, _ in free) < best
    assert tied >= 10 and bound >= 5 and refused >= 1


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
        seconds, memory, further, *_ = by_shape[sub.shape].cost(head, m, tail)
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
    from distgraph.passes.search.stages import run_dp

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
    from distgraph.passes.search.stages.block_plans import _fitting_alike

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


@pytest.mark.parametrize("ends, faster", [(0.05, "blocks"), (3.0, "layers")])
def test_alike_stages_take_the_faster_of_the_layers_and_the_blocks_split_evenly(ends, faster):
    """Two layers of E, eight blocks and two of H over four alike stages: split by layers
    (three each), the middle stages hold three blocks; split by blocks, each holds two,
    E on the first and H on the last (Megatron-LM's split). alike_stages prices both and
    takes the faster: the blocks' where E and H are light, the layers' where they weigh
    as much as three blocks."""
    from distgraph.passes.cost.stage import step_time
    from distgraph.passes.search.stages.interleaved import alike_stages, even_splits

    S, M, count, blocks = 4, 8, 12, range(2, 10)
    assert even_splits(S, blocks, count) == [
        [(True, 1, False), (False, 3, False), (False, 3, False), (False, 1, True)],
        [(True, 2, False), (False, 2, False), (False, 2, False), (False, 2, True)]]
    cluster = cluster_of(1, S, memory=1e3)
    parts = {name: (PartCost(seconds, 0.0, 0.0, 0.0), None)
             for name, seconds in (("first", ends), ("block", 1.0), ("last", ends))}
    option = RunOption(0, Submesh(cluster.device_meshes[0], (1, 1), cluster.device(0)),
                       (1, 1), parts)
    by_layers = step_time([ends + 1, 3.0, 3.0, 1 + ends], M)
    by_blocks = step_time([ends + 2, 2.0, 2.0, 2 + ends], M)
    objective, times, *_ = alike_stages(option, count, blocks, cluster, M, 1,
                                        lambda n: None)
    assert objective == pytest.approx(min(by_layers, by_blocks), rel=1e-12)
    assert (by_blocks < by_layers) == (faster == "blocks")
    assert times == pytest.approx([ends + 2, 2.0, 2.0, 2 + ends] if faster == "blocks"
                                  else [ends + 1, 3.0, 3.0, 1 + ends])


@pytest.mark.parametrize("S, v, M", [(4, 2, 8), (8, 8, 32), (16, 8, 16), (8, 4, 8)])
def test_interleaved_objective_is_the_replayed_schedules_makespan(S, v, M):
    """S alike stages of v one-block chunks, a block's F + B taking the unit-cost clock's
    3, no transfers: alike_stages' objective is the makespan schedule.replay finds for
    interleaved 1F1B (M u + (S - 1) u / v; it was M u + (S - v) u / v, no bubble at
    S = v)."""
    from distgraph.passes.pipeline.schedule import chain, make_schedule
    from distgraph.plan.replay import COST, replay
    from distgraph.passes.search.stages.interleaved import alike_stages

    problem = chain(S, v, M, "1F1B")
    makespan = replay(make_schedule(problem).orders, problem).makespan
    cluster = cluster_of(1, S, memory=1e3)
    block = (PartCost(COST["F"] + COST["B"], 0.0, 0.0, 0.0), None)
    option = RunOption(0, Submesh(cluster.device_meshes[0], (1, 1), cluster.device(0)),
                       (1, 1), {"block": block})
    count = S * v

    def chunk_layers(n):
        return [{k: 1.0} for k in range(n)]

    objective, times, *_ = alike_stages(option, count, range(count), cluster, M, v,
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
    from distgraph.passes.search.stages import run_dp

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
            low = search.longer_bound(
                G, search.extension(density[min(s + 1, search.max_stages)]))
            later = [float(t[full]) for t in tables[s:]]
            assert all(x >= low or math.isclose(x, low, rel_tol=1e-12) for x in later)
    assert stopped or len(caps) < 3
