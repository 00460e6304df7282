"""The stage DP for runs of identical blocks (passes/search/run_dp.py) against Alpa's
general stage DP (passes/search/stage_dp.py, itself checked against brute force) on the
same costs: the same optimum, whatever the parts' times and memories."""

import itertools

import numpy as np
import pytest

from distgraph.errors import PlanError
from distgraph.passes.search.run_dp import plan_runs
from distgraph.passes.search.runs import PartCost, RunOption
from distgraph.passes.search.space import GB
from distgraph.passes.search.stage_dp import StageCost, Submesh, plan_stages
from distgraph.resources.cluster import Cluster, Device, Link, Machine


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
    assert sorted(d for s in plan.stages for d in s.device_ids) == \
        [d.global_id for d in cluster.devices]
    assert [s.layers for s in plan.stages][0].start == 0
    assert plan.stages[-1].layers.stop == count
    for stage, option in zip(plan.stages, chosen):
        assert stage.shape == option.sub.shape
        assert stage.memory <= cluster.devices[0].memory + 1e-9
