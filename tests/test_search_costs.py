"""LayoutPrices' reshard prices: planned once per path, the same seconds as planning each.

The search prices a reshard from the steps ``plan_reshard`` plans; tensors that both
layouts divide take the same path whatever their shape and dtype, so LayoutPrices plans
it once per pair of layouts and scales each step's buffer; LayoutPrices of one session
share paths per mesh shape and prices per mesh priced alike. Oracle: a
fresh LayoutPrices per tensor (nothing shared) and the steps planned directly, priced by
``reshard_step_time``: equal to the last bit (also on random layouts, uneven and refused
shapes, and meshes placed over a heterogeneous cluster file's GPUs and XPUs).
"""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path

import numpy as np
import pytest
import search_cases as S
import yaml
from distgraph.passes.cost.prices import Rings, reshard_step_time
from distgraph.passes.reshard import plan_reshard, plan_reshard_path
from distgraph.passes.cost import layout_prices
from distgraph.passes.cost.layout_prices import LayoutPrices
from distgraph.passes.search.layouts.space import layouts
from distgraph.passes.session import Session
from distgraph.registry import spmd_rule

import distgraph as dg

MESHES = {
    "2x4": dg.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["x", "y"]),
    "2x2x2": dg.ProcessMesh([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], ["x", "cp", "y"]),
}
# shapes of one rank that divide alike or not (8 | 24 | 40, 6 and 12 not by 8 or 4)
SHAPES = [(8, 24), (16, 40), (24, 8), (6, 8), (12, 16)]


def planned_paths(monkeypatch) -> list:
    """The (mesh, source, goal, shape, dtype) of every path LayoutPrices plans from now on
    (:func:`plan_reshard_path`, called once per path)."""
    calls = []
    real = layout_prices.plan_reshard_path
    monkeypatch.setattr(layout_prices, "plan_reshard_path",
                        lambda *args: calls.append(args) or real(*args))
    return calls


def direct(cluster, mesh, src, dst, shape, dtype) -> float:
    costs = LayoutPrices(cluster, mesh, {p: p for p in mesh.process_ids})
    steps = plan_reshard(dg.DistAttr(mesh, src), dg.DistAttr(mesh, dst), shape, dtype)
    return sum(reshard_step_time(s, costs.pid, costs.rings) for s in steps)


@pytest.mark.parametrize("name", sorted(MESHES))
def test_shared_paths_price_as_planning_each(name, monkeypatch):
    mesh = MESHES[name]
    paths = planned_paths(monkeypatch)
    cluster = S.line_cluster(8, bandwidth=3.0, latency=2.0)
    shared = LayoutPrices(cluster, mesh, {p: p for p in mesh.process_ids})
    checked = 0
    for shape in SHAPES:
        specs = [s.out_specs[0] for s in layouts(shape, mesh)]
        for src, dst in itertools.product(specs, specs):
            for dtype in ("float32", "bfloat16")[:1 if name == "2x2x2" else 2]:
                got = shared.reshard(src, dst, shape, dtype)
                assert got == direct(cluster, mesh, src, dst, shape, dtype), \
                    (name, str(src), str(dst), shape, dtype)
                checked += 1
    assert checked > 500
    # one path per pair of layouts' split dims, whatever the shapes (dividing alike or
    # not) and dtypes
    pairs = {split_dims(src, dst) for shape in SHAPES for src in
             [s.out_specs[0] for s in layouts(shape, mesh)] for dst in
             [s.out_specs[0] for s in layouts(shape, mesh)] if src != dst}
    assert len(paths) == len(pairs) < 0.5 * checked


def split_dims(src, dst) -> tuple:
    """A reshard's path depends on the dims either layout splits (and the pending sums)."""
    return (tuple((src.entry(d), dst.entry(d)) for d in range(src.ndim)
                  if src.entry(d) or dst.entry(d)), src.partial, dst.partial)


@pytest.mark.parametrize("name", sorted(MESHES))
def test_dims_left_whole_share_paths(name, monkeypatch):
    """Tensors of 2, 3 and 4 dims whose extra dims both layouts leave whole take one
    path per pair of split dims, priced (to the last bit) as planning each."""
    mesh = MESHES[name]
    paths = planned_paths(monkeypatch)
    cluster = S.line_cluster(8, bandwidth=3.0, latency=2.0)
    shared = LayoutPrices(cluster, mesh, {p: p for p in mesh.process_ids})
    base = [s.out_specs[0] for s in layouts((8, 24), mesh)]
    checked = 0
    for src, dst in itertools.product(base, base):
        for shape, where in (((8, 24), None), ((8, 3, 24), 1), ((5, 8, 24), 0),
                             ((8, 24, 7, 2), 2)):
            def widen(spec):
                if where is None:
                    return spec
                dims = [spec.entry(d) or None for d in range(spec.ndim)]
                for _ in range(len(shape) - 2):
                    dims.insert(where, None)
                return dg.ShardSpec(dims, spec.partial)
            a, b = widen(src), widen(dst)
            assert shared.reshard(a, b, shape, "float32") == \
                direct(cluster, mesh, a, b, shape, "float32"), (str(a), str(b), shape)
            checked += 1
    pairs = {split_dims(src, dst) for src, dst in itertools.product(base, base) if src != dst}
    assert len(paths) == len(pairs) and 4 * len(pairs) < checked


def test_partial_sources_share_paths_too(monkeypatch):
    """A pending sum settled onto tensors of two sizes that divide alike: one path."""
    mesh = MESHES["2x4"]
    paths = planned_paths(monkeypatch)
    cluster = S.line_cluster(8)
    shared = LayoutPrices(cluster, mesh, {p: p for p in mesh.process_ids})
    src = dg.ShardSpec([None, "y"], {"x"})
    for dst in (dg.ShardSpec(["x", "y"]), dg.ShardSpec([None, None]), dg.ShardSpec(["y", None])):
        for shape in ((8, 16), (32, 64)):
            assert shared.reshard(src, dst, shape, "float32") == \
                direct(cluster, mesh, src, dst, shape, "float32")
    assert len(paths) == 3


def test_dtypes_share_paths(monkeypatch):
    """The dtype only scales every move's bytes: tensors of any dtype and size that divide
    alike take one planned path, priced as planning each (to the last bit)."""
    mesh = MESHES["2x4"]
    paths = planned_paths(monkeypatch)
    cluster = S.line_cluster(8, bandwidth=3.0, latency=2.0)
    shared = LayoutPrices(cluster, mesh, {p: p for p in mesh.process_ids})
    specs = [s.out_specs[0] for s in layouts((8, 24), mesh)]
    pairs = list(itertools.product(specs, specs))
    for dtype, shape in (("bool", (8, 24)), ("float32", (16, 40)), ("bfloat16", (8, 24)),
                         ("int64", (24, 8))):
        for src, dst in pairs:
            assert shared.reshard(src, dst, shape, dtype) == \
                direct(cluster, mesh, src, dst, shape, dtype), (str(src), str(dst), dtype)
    assert len(paths) <= len(pairs)


# ---- shared and shortcut pricing against plain planning, on random cases ------------------

HETERO_FILE = Path(__file__).parents[1] / "resources" / "clusters" / "hetero_2gpu_2xpu.yaml"
# software costs (µs per step, ns per byte) so that every step's software is priced too;
# the XPUs' differ from the GPUs'
GPU_SOFTWARE = {"all_gather": (30.0, 0.5), "all_to_all": (41.0, 0.7),
                "all_reduce": (25.0, 0.25), "reduce_scatter": (33.0, 0.3), "slice": (7.0, 0.1)}
XPU_SOFTWARE = {k: (2.0 * a, 1.5 * b) for k, (a, b) in GPU_SOFTWARE.items()}


def hetero_cluster() -> dg.Cluster:
    """The shipped 2 GPU + 2 XPU machines file, its devices given software costs."""
    data = yaml.safe_load(HETERO_FILE.read_text())
    for machine in data["machines"]:
        for device in machine["devices"]:
            device["reshard_overhead"] = {k: list(v) for k, v in (
                GPU_SOFTWARE if device["type"] == "GPU" else XPU_SOFTWARE).items()}
    return dg.Cluster.from_dict(data)


def plain(cluster, mesh, device_of, src, dst, shape, dtype):
    """What nothing shared or skipped prices: plan_reshard's steps on the ring model (a
    layout kept costs nothing, as LayoutPrices.reshard says, unchecked)."""
    if src == dst:
        return 0.0
    rings = Rings(cluster, device_of.__getitem__)
    try:
        steps = plan_reshard(dg.DistAttr(mesh, src), dg.DistAttr(mesh, dst), shape, dtype)
    except dg.errors.ShardingError as e:
        return type(e), str(e)
    return sum(reshard_step_time(s, mesh.process_ids[0], rings) for s in steps)


def shortcut(costs, src, dst, shape, dtype):
    try:
        return costs.reshard(src, dst, shape, dtype)
    except dg.errors.ShardingError as e:
        return type(e), str(e)


def random_spec(rng, names, ndim) -> dg.ShardSpec:
    dims = [[] for _ in range(ndim)]
    partial = set()
    for m in names:
        r = rng.random()
        if r < 0.5:
            dims[rng.randrange(ndim)].append(m)
        elif r < 0.65:
            partial.add(m)
    for entry in dims:
        rng.shuffle(entry)
    return dg.ShardSpec([tuple(e) if e else None for e in dims], partial)


def placements():
    """(mesh, device_of) on the 16 devices of the file (0-7 GPUs, 8-15 XPUs): meshes of
    one shape over the GPUs, over the XPUs, over both (a block of each, or interleaved:
    rings of the GPUs' speeds, or not), on other process ids, reordered."""
    gpus, xpus = list(range(8)), list(range(8, 16))
    out = []
    for shape, names in (((2, 4), ["x", "y"]), ((4, 2), ["x", "y"]), ((2, 2, 2), ["x", "cp", "y"]),
                         ((8,), ["x"]), ((1, 8), ["x", "y"])):
        for pids, devices in ((range(8), gpus), (range(8), xpus), (range(100, 108), gpus),
                              (range(8), gpus[4:] + gpus[:4]), (range(8), gpus[:4] + xpus[:4]),
                              (range(8), [d for pair in zip(gpus, xpus) for d in pair])):
            mesh = dg.ProcessMesh(np.array(list(pids)).reshape(shape).tolist(), names)
            out.append((mesh, dict(zip(pids, devices))))
    for shape, names in (((4, 4), ["x", "y"]), ((2, 2, 4), ["x", "cp", "y"])):
        mesh = dg.ProcessMesh(np.arange(16).reshape(shape).tolist(), names)
        out.append((mesh, {p: p for p in range(16)}))
        out.append((mesh, {p: (p + 8) % 16 for p in range(16)}))
    return out


@pytest.mark.parametrize("seed", range(2))
def test_shared_and_shortcut_prices_equal_plain_pricing(seed, monkeypatch):
    """LayoutPrices of many meshes in one session (as a planning shares them): every
    reshard and matrix entry, on random layouts and shapes (dividing, uneven and
    refused), equals plan_reshard's steps priced afresh, to the last bit; meshes of one
    shape whose priced process has the same rings and device share their prices (other
    process ids alike), others do not, and every mesh of a shape shares paths (none is
    planned twice)."""
    rng = random.Random(seed)
    cluster = hetero_cluster()
    session = Session()
    paths = planned_paths(monkeypatch)
    all_costs = []
    checked = refused = 0
    cases: dict = {}      # per mesh shape: the same cases on each of its placements
    for mesh, device_of in placements():
        costs = LayoutPrices(cluster, mesh, device_of, session=session)
        all_costs.append(costs)
        names = list(mesh.dim_names)
        if mesh.shape not in cases:
            cases[mesh.shape] = []
            for _ in range(25):
                ndim = rng.randint(1, 3)
                shape = tuple(rng.choice([2, 3, 4, 6, 8, 12, 16, 40, 64]) for _ in range(ndim))
                dtype = rng.choice(["float32", "bfloat16", "int64"])
                specs = [random_spec(rng, names, ndim) for _ in range(4)]
                picks = [rng.randrange(4) for _ in range(8)]
                cases[mesh.shape].append((shape, dtype, specs, picks))
        for shape, dtype, specs, picks in cases[mesh.shape]:
            for src, dst in itertools.product(specs, specs):
                want = plain(cluster, mesh, device_of, src, dst, shape, dtype)
                assert shortcut(costs, src, dst, shape, dtype) == want, \
                    (str(mesh), str(src), str(dst), shape, dtype)
                checked += 1
                refused += isinstance(want, tuple)
            fine = [s for s in specs if not isinstance(plain(
                cluster, mesh, device_of, s, dg.ShardSpec.replicated(len(shape)), shape,
                dtype), tuple)]
            if fine:
                made = tuple(fine[k % len(fine)] for k in picks[:5])
                wanted = tuple(fine[k % len(fine)] for k in picks[5:])
                got = costs.matrix(made, wanted, shape, dtype)
                want = [[plain(cluster, mesh, device_of, a, b, shape, dtype)
                         for b in wanted] for a in made]
                assert got.tolist() == want, (str(mesh), shape, dtype)
    assert checked > 8_000 and 0 < refused < checked / 2
    by_key = {}
    for costs in all_costs:
        key = (costs.mesh.shape, costs.mesh.dim_names,
               tuple(costs.ring_of(d) for d in costs.mesh.dim_names), costs.device.model)
        by_key.setdefault(key, []).append(costs)
    for group in by_key.values():
        assert all(c.alike is group[0].alike for c in group)
    alikes = {id(c.alike) for c in all_costs}
    assert len(alikes) == len(by_key) < len(all_costs)
    # on other process ids, the GPU placement shares the first mesh's prices
    assert all_costs[0].alike is all_costs[2].alike is not all_costs[1].alike
    planned = {(m.shape, m.dim_names, split_dims(src, dst)) for m, src, dst, *_ in paths}
    assert paths and len(planned) == len(paths)


def test_plan_reshard_path_is_plan_reshards_figures():
    """The figures :func:`plan_reshard_path` gives are those of plan_reshard's steps, and
    it refuses what plan_reshard refuses, on random meshes, layouts and shapes."""
    rng = random.Random(7)
    planned = 0
    for _ in range(1500):
        sizes = [rng.choice([1, 2, 3, 4, 8]) for _ in range(rng.randint(1, 3))]
        names = ["x", "y", "z"][:len(sizes)]
        rng.shuffle(names)
        mesh = dg.ProcessMesh(np.arange(math.prod(sizes)).reshape(sizes).tolist(), names)
        ndim = rng.randint(1, 4)
        shape = tuple(rng.choice([1, 2, 3, 6, 8, 12, 16, 24, 48]) for _ in range(ndim))
        src, dst = random_spec(rng, names, ndim), random_spec(rng, names, ndim)
        dtype = rng.choice(["float32", "bfloat16"])
        try:
            steps = plan_reshard(dg.DistAttr(mesh, src), dg.DistAttr(mesh, dst), shape, dtype)
        except dg.errors.ShardingError:
            with pytest.raises(dg.errors.ShardingError):
                plan_reshard_path(mesh, src, dst, shape, dtype)
            continue
        assert plan_reshard_path(mesh, src, dst, shape, dtype) == tuple(
            (s.kind, s.mesh_dim, s.group_size, s.buffer_bytes) for s in steps)
        planned += 1
    assert planned > 500


def test_a_mesh_is_priced_at_one_process_of_each_kind():
    """Processes on devices of the same figures with the same rings along every mesh dim
    price alike: a 2 x 2 grid of alike machines (fast links inside, slow across) is one
    kind; a device of twice the GFLOP/s is another, priced at its own process, where a
    matmul takes less time under every strategy."""
    grid = dg.ProcessMesh([[0, 1], [2, 3]], ["x", "y"])
    assert LayoutPrices(S.grid_cluster(), grid, {p: p for p in range(4)}).others == ()
    line = dg.ProcessMesh([0, 1], ["x"])
    costs = LayoutPrices(S.mixed_speed_cluster(2.0), line, {0: 0, 1: 1})
    (other,) = costs.others
    assert (costs.pid, other.pid) == (0, 1)
    mm = S.mlp_program(256, 512).program.ops[0]
    assert mm.type == "matmul"
    strategies = spmd_rule("matmul").strategies([v.shape for v in mm.inputs],
                                               [v.shape for v in mm.outputs], line)
    fast, slow = costs.op(mm, strategies)[0], other.op(mm, strategies)[0]
    assert (fast > 0).all() and (fast < slow).all()
