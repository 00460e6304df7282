"""Alpa's stage DP (passes/search/stages/stage_dp.py) against brute force and closed forms.

Oracle: every split of the layers into consecutive stages and every assignment of Alpa
submesh shapes to them, kept when the shapes' sizes fill every device mesh exactly and
each stage fits its devices' memory with the activations 1F1B keeps in flight; the
objective sum t + (B - 1) max t is computed here from the callback's numbers.
"""

import itertools
import math

import numpy as np
import pytest

from distgraph.errors import PlanError
from distgraph.passes.search.stages.stage_dp import StageCost, plan_stages, submesh_shapes
from distgraph.resources.cluster import Cluster, Device, DeviceMesh, Link, Machine


def make_cluster(groups, device_meshes=None, reserved=0.0):
    """groups: (machines, devices per machine, GFLOP/s, memory GB, model) per device kind;
    devices of one machine all linked, machines chained through their first devices.
    ``reserved``: each device's ``reserved_memory`` (0: its memory is what a stage may
    fill, the figure these tests give; None: the GPU default)."""
    machines, links, gid, mid = [], [], 0, 0
    firsts = []
    for count, per, gflops, memory, model in groups:
        for _ in range(count):
            devs = tuple(Device(gid + j, j, mid, "GPU", model, {"float32": gflops}, memory,
                                reserved_memory=reserved)
                         for j in range(per))
            inner = tuple(Link(a.global_id, b.global_id, 100, 1)
                          for a, b in itertools.combinations(devs, 2))
            machines.append(Machine(mid, f"host{mid}", devs, inner))
            firsts.append(gid)
            gid += per
            mid += 1
    links = tuple(Link(a, b, 10, 5) for a, b in itertools.pairwise(firsts))
    return Cluster(tuple(machines), links, device_meshes=device_meshes)


def table_cost(seed, L, cluster, scale_memory=1.0):
    """A random but fixed (time, memory, activation memory) for every (layers, submesh)."""
    rng = np.random.default_rng(seed)
    table = {}
    for mesh in cluster.device_meshes:
        for shape in submesh_shapes(mesh.shape):
            for k in range(L):
                for i in range(k, L):
                    n = i - k + 1
                    size = shape[0] * shape[1]
                    t = n * rng.uniform(0.5, 1.5) / size ** rng.uniform(0.3, 1.0)
                    table[(mesh.name, shape, k, i + 1)] = (
                        float(np.round(t, 3)), scale_memory * n * rng.uniform(0, 2) / size,
                        scale_memory * n * rng.uniform(0, 1) / size)

    def cost(layers, sub):
        return table[(sub.mesh.name, sub.shape, layers.start, layers.stop)]
    return cost


def brute_force(L, cluster, cost, B):
    meshes = cluster.device_meshes
    options = [(m, s) for m in meshes for s in submesh_shapes(m.shape)]
    best = math.inf
    for S in range(1, L + 1):
        for cuts in itertools.combinations(range(1, L), S - 1):
            bounds = (0,) + cuts + (L,)
            ranges = [range(bounds[j], bounds[j + 1]) for j in range(S)]
            for pick in itertools.product(options, repeat=S):
                used = {m.name: 0 for m in meshes}
                for m, s in pick:
                    used[m.name] += s[0] * s[1]
                if any(used[m.name] != m.size for m in meshes):
                    continue
                times = []
                for j, (r, (m, s)) in enumerate(zip(ranges, pick)):
                    t, mem, act = _triple(cost(r, _Sub(m, s)))
                    limit = min(cluster.device(i).memory for i in m.ids)
                    if mem + (min(S - j, B) - 1) * act > limit:  # 1F1B: min(B, S - j) in flight
                        break
                    times.append(t)
                else:
                    best = min(best, sum(times) + (B - 1) * max(times))
    return best


def _triple(out):
    if isinstance(out, StageCost):
        return out.time, out.memory, out.activation_memory
    return out


class _Sub:
    def __init__(self, mesh, shape):
        self.mesh, self.shape, self.size = mesh, shape, shape[0] * shape[1]


def check_plan(plan, L, cluster, cost, B):
    """Stages cover the layers in order and every device once, with contiguous submeshes
    of the stated shape; memory fits; the objective is the formula over stage times."""
    assert plan.stages[0].layers.start == 0
    assert all(a.layers.stop == b.layers.start for a, b in itertools.pairwise(plan.stages))
    assert plan.stages[-1].layers.stop == L
    ids = [i for s in plan.stages for i in s.device_ids]
    assert sorted(ids) == sorted(d.global_id for d in cluster.devices)
    S = len(plan.stages)
    for j, st in enumerate(plan.stages):
        mesh = cluster.device_mesh(st.mesh)
        rows, cols = (1, mesh.shape[0]) if len(mesh.shape) == 1 else mesh.shape
        grid = np.array(mesh.ids).reshape(rows, cols)
        n, m = st.shape
        hits = [(r, c) for r in range(rows - n + 1) for c in range(cols - m + 1)
                if tuple(grid[r:r + n, c:c + m].reshape(-1)) == st.device_ids]
        assert hits, f"stage {j} devices {st.device_ids} are not a {st.shape} block of {grid}"
        t, mem, act = _triple(cost(st.layers, _Sub(mesh, st.shape)))
        assert st.time == t and st.memory == pytest.approx(mem + (min(S - j, B) - 1) * act)
        assert st.memory <= min(cluster.device(i).memory for i in st.device_ids) + 1e-12
    times = [s.time for s in plan.stages]
    assert plan.objective == pytest.approx(sum(times) + (B - 1) * max(times))


CLUSTERS = {
    "2x2": lambda: make_cluster([(2, 2, 100, 4.0, "a")]),
    "1x4": lambda: make_cluster([(1, 4, 100, 3.0, "a")]),
    "hetero": lambda: make_cluster([(1, 2, 100, 3.0, "a"), (2, 2, 50, 2.0, "b")]),
}


# Seeds 2, 6, 7 and 9 with B = 2, 3 or 5 have their optimum strictly between the smallest
# feasible cap and the largest: they fail if the cap search skips the bisection.
@pytest.mark.parametrize("name", sorted(CLUSTERS))
@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("B", [1, 2, 3, 5])
def test_dp_matches_brute_force(name, seed, B):
    cluster = CLUSTERS[name]()
    L = 5
    cost = table_cost(seed, L, cluster)
    best = brute_force(L, cluster, cost, B)
    if math.isinf(best):
        with pytest.raises(PlanError, match="fits the devices' memory"):
            plan_stages(L, cluster, cost, micro_batches=B)
        return
    plan = plan_stages(L, cluster, cost, micro_batches=B)
    assert plan.objective == pytest.approx(best, rel=1e-12)
    check_plan(plan, L, cluster, cost, B)


def test_brute_force_cases_include_memory_bound_ones():
    # With tighter memory some optima change and some cases fit nowhere: both paths run.
    cluster, L, B = CLUSTERS["2x2"](), 5, 4
    outcomes = set()
    for seed in range(6):
        cost = table_cost(seed, L, cluster, scale_memory=3.0)
        best = brute_force(L, cluster, cost, B)
        try:
            plan = plan_stages(L, cluster, cost, micro_batches=B)
        except PlanError:
            assert math.isinf(best)
            outcomes.add("nothing fits")
            continue
        assert plan.objective == pytest.approx(best, rel=1e-12)
        check_plan(plan, L, cluster, cost, B)
        outcomes.add("fits")
    assert outcomes == {"fits", "nothing fits"}


def flops_cost(per_layer_gflop=10.0, efficiency=0.6):
    """t = FLOPs / (devices x GFLOP/s), with intra-op scaling efficiency < 1 per doubling."""
    def cost(layers, sub):
        speed = sub.device.gflops["float32"] * sub.size * efficiency ** math.log2(sub.size)
        return StageCost(len(layers) * per_layer_gflop / speed, memory=0.0)
    return cost


def test_equal_layers_on_equal_devices_give_equal_stages():
    cluster = make_cluster([(2, 4, 100, 8.0, "a")])
    plan = plan_stages(16, cluster, flops_cost(), micro_batches=32)
    assert len(plan.stages) == 8
    assert {len(s.layers) for s in plan.stages} == {2}
    assert {s.shape for s in plan.stages} == {(1, 1)}


def test_twice_the_gflops_takes_twice_the_layers():
    cluster = make_cluster([(1, 1, 200, 8.0, "fast"), (1, 1, 100, 8.0, "slow")])
    plan = plan_stages(12, cluster, flops_cost(), micro_batches=64)
    layers = {s.mesh: len(s.layers) for s in plan.stages}
    fast, slow = (m.name for m in cluster.device_meshes)
    assert layers == {fast: 8, slow: 4}
    # Larger meshes of each kind: the fast kind still takes twice the layers in total.
    cluster = make_cluster([(2, 2, 200, 8.0, "fast"), (2, 2, 100, 8.0, "slow")])
    plan = plan_stages(24, cluster, flops_cost(), micro_batches=64)
    per_kind = {}
    for s in plan.stages:
        per_kind[s.mesh] = per_kind.get(s.mesh, 0) + len(s.layers)
    assert per_kind == {"gpu": 16, "gpu_1": 8}


def test_memory_limit_shapes_the_split():
    cluster = make_cluster([(1, 4, 100, 4.0, "a")])

    def cost(layers, sub):   # per layer: 0.5 GB replicated + 1 GB split over the submesh
        n = len(layers)
        return StageCost(n / sub.size, n * (0.5 + 1.0 / sub.size), activation_memory=0.1)
    plan = plan_stages(4, cluster, cost, micro_batches=1)
    assert [s.shape for s in plan.stages] == [(1, 4)] and plan.stages[0].memory == 3.0
    plan = plan_stages(8, cluster, cost, micro_batches=1)     # one stage would need 6 GB
    assert len(plan.stages) > 1 and all(s.memory <= 4.0 for s in plan.stages)
    assert plan.objective == pytest.approx(brute_force(8, cluster, cost, 1))
    check_plan(plan, 8, cluster, cost, 1)
    with pytest.raises(PlanError, match=r"one layer needs at least 1.5 GB per device"):
        plan_stages(8, make_cluster([(1, 4, 100, 1.0, "a")]),
                    lambda r, s: StageCost(len(r), 1.5 * len(r)), 4)


def test_stages_fit_the_usable_memory():
    """A device's reserve is left free: the plan on devices of 6 GB with 2 reserved is the
    plan on devices of 4 GB, one stage of 8 layers (6 GB) no longer fits, and a layer of
    5 GB fits nowhere; the default reserve of a 6 GB GPU is 2.3 GB."""
    def cost(layers, sub):   # per layer: 0.5 GB replicated + 1 GB split over the submesh
        n = len(layers)
        return StageCost(n / sub.size, n * (0.5 + 1.0 / sub.size), activation_memory=0.1)
    six = make_cluster([(1, 4, 100, 6.0, "a")], reserved=2.0)
    four = make_cluster([(1, 4, 100, 4.0, "a")])
    whole = plan_stages(8, make_cluster([(1, 4, 100, 6.0, "a")]), cost, micro_batches=1)
    assert [s.shape for s in whole.stages] == [(1, 4)] and whole.stages[0].memory == 6.0
    plan = plan_stages(8, six, cost, micro_batches=1)
    assert plan == plan_stages(8, four, cost, micro_batches=1)
    assert len(plan.stages) > 1 and all(s.memory <= 4.0 for s in plan.stages)
    with pytest.raises(PlanError, match=r"devices with 4 GB usable\): one layer needs at "
                                        r"least 5 GB per device"):
        plan_stages(8, six, lambda r, s: StageCost(len(r), 5.0 * len(r)), 4)
    default = make_cluster([(1, 4, 100, 6.0, "a")], reserved=None)
    assert default.devices[0].usable_memory() == pytest.approx(3.7)
    assert plan_stages(8, default, cost, micro_batches=1) == plan_stages(
        8, make_cluster([(1, 4, 100, 3.7, "a")]), cost, micro_batches=1)


def test_in_flight_activations_count_per_stage():
    cluster = make_cluster([(1, 2, 100, 2.0, "a")])
    # Two one-device stages: the first keeps one more micro-batch of activations.
    def cost(r, s):
        return StageCost(len(r) / s.size ** 0.5, 1.0 * len(r) / s.size, activation_memory=0.5)
    plan = plan_stages(2, cluster, cost, micro_batches=8, shapes={"gpu": [(1, 1)]})
    assert [s.memory for s in plan.stages] == [1.5, 1.0]
    with pytest.raises(PlanError, match="fits the devices' memory"):
        plan_stages(2, cluster, lambda r, s: StageCost(1.0, 1.0, 1.5), 8,
                    shapes={"gpu": [(1, 1)]})


def test_submesh_shapes():
    assert submesh_shapes((4, 8)) == [(1, 1), (1, 2), (1, 4), (1, 8), (2, 8), (3, 8), (4, 8)]
    assert submesh_shapes((8,)) == [(1, 1), (1, 2), (1, 4), (1, 8)]
    assert submesh_shapes((3, 6)) == [(1, 1), (1, 2), (1, 6), (2, 6), (3, 6)]
    assert submesh_shapes((2, 1)) == [(1, 1), (2, 1)]
    with pytest.raises(PlanError, match=r"1-D or 2-D device meshes, got shape \[2, 2, 2\]"):
        submesh_shapes((2, 2, 2))


def test_row_pieces_pack_into_rows():
    # 3 x 6 mesh: pieces of 1, 2 and 6 devices; every mix the DP picks is placeable.
    cluster = make_cluster([(3, 6, 100, 8.0, "a")])
    for seed in range(3):
        cost = table_cost(seed, 6, cluster)
        plan = plan_stages(6, cluster, cost, micro_batches=4)
        check_plan(plan, 6, cluster, cost, 4)


@pytest.mark.parametrize("call, message", [
    (lambda c: plan_stages(0, c, flops_cost()), "num_layers = 0"),
    (lambda c: plan_stages(4, c, flops_cost(), micro_batches=0), "micro_batches = 0"),
    (lambda c: plan_stages(4, c, flops_cost(), shapes={"gpu": [(1, 3)]}),
     r"submesh shape \[1, 3\] on mesh gpu \[2, 4\] is not one the DP can place"),
    (lambda c: plan_stages(4, c, flops_cost(), shapes={"tpu": [(1, 1)]}),
     r"shapes names meshes \['tpu'\]"),
    (lambda c: plan_stages(2, c, flops_cost(), shapes={"gpu": [(1, 2)]}),
     "covers every device with the submesh shapes allowed"),
    (lambda c: plan_stages(4, c, lambda r, s: (1.0,)), r"returned \(1.0,\)"),
    (lambda c: plan_stages(4, c, lambda r, s: (1.0, -2.0)), "returned \\(1.0, -2.0, 0.0\\)"),
    (lambda c: plan_stages(4, c, lambda r, s: "fast"), "returned 'fast'"),
])
def test_errors_say_what_and_how(call, message):
    with pytest.raises(PlanError, match=message):
        call(make_cluster([(2, 4, 100, 8.0, "a")]))


def test_fewer_layers_than_meshes():
    cluster = make_cluster([(1, 2, 100, 8.0, "a"), (1, 2, 100, 8.0, "b")])
    with pytest.raises(PlanError, match="1 layers cannot cover the 2 device meshes"):
        plan_stages(1, cluster, flops_cost())


def test_three_dim_mesh_is_refused():
    devices = [(1, 8, 100, 8.0, "a")]
    cluster = make_cluster(devices, device_meshes=(DeviceMesh("cube", (2, 2, 2), tuple(range(8))),))
    with pytest.raises(PlanError, match="1-D or 2-D device meshes"):
        plan_stages(4, cluster, flops_cost())
