"""SearchCosts' reshard prices: planned once per path, the same seconds as planning each.

The search prices a reshard from the steps ``plan_reshard`` plans; tensors that both
layouts divide take the same path whatever their shape and dtype, so SearchCosts plans
it once per pair of layouts and scales each step's buffer. Oracle: a fresh SearchCosts per tensor (nothing shared) and the steps planned
directly, priced by ``reshard_step_time``: equal to the last bit.
"""

from __future__ import annotations

import itertools

import pytest
import search_cases as S
from distgraph.passes.cost.prices import reshard_step_time
from distgraph.passes.reshard import plan_reshard
from distgraph.passes.search.costs import SearchCosts
from distgraph.passes.search.space import layouts

import distgraph as dg

MESHES = {
    "2x4": dg.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["x", "y"]),
    "2x2x2": dg.ProcessMesh([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], ["x", "cp", "y"]),
}
# shapes of one rank that divide alike or not (8 | 24 | 40, 6 and 12 not by 8 or 4)
SHAPES = [(8, 24), (16, 40), (24, 8), (6, 8), (12, 16)]


def direct(cluster, mesh, src, dst, shape, dtype) -> float:
    costs = SearchCosts(cluster, mesh, {p: p for p in mesh.process_ids})
    steps = plan_reshard(dg.DistAttr(mesh, src), dg.DistAttr(mesh, dst), shape, dtype)
    return sum(reshard_step_time(s, costs.pid, costs.rings) for s in steps)


@pytest.mark.parametrize("name", sorted(MESHES))
def test_shared_paths_price_as_planning_each(name):
    mesh = MESHES[name]
    cluster = S.line_cluster(8, bandwidth=3.0, latency=2.0)
    shared = SearchCosts(cluster, mesh, {p: p for p in mesh.process_ids})
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
    assert len(shared._paths) == len(pairs) < 0.5 * checked


def split_dims(src, dst) -> tuple:
    """A reshard's path depends on the dims either layout splits (and the pending sums)."""
    return (tuple((src.entry(d), dst.entry(d)) for d in range(src.ndim)
                  if src.entry(d) or dst.entry(d)), src.partial, dst.partial)


@pytest.mark.parametrize("name", sorted(MESHES))
def test_dims_left_whole_share_paths(name):
    """Tensors of 2, 3 and 4 dims whose extra dims both layouts leave whole take one
    path per pair of split dims, priced (to the last bit) as planning each."""
    mesh = MESHES[name]
    cluster = S.line_cluster(8, bandwidth=3.0, latency=2.0)
    shared = SearchCosts(cluster, mesh, {p: p for p in mesh.process_ids})
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
    assert len(shared._paths) == len(pairs) and 4 * len(pairs) < checked


def test_partial_sources_share_paths_too():
    """A pending sum settled onto tensors of two sizes that divide alike: one path."""
    mesh = MESHES["2x4"]
    cluster = S.line_cluster(8)
    shared = SearchCosts(cluster, mesh, {p: p for p in mesh.process_ids})
    src = dg.ShardSpec([None, "y"], {"x"})
    for dst in (dg.ShardSpec(["x", "y"]), dg.ShardSpec([None, None]), dg.ShardSpec(["y", None])):
        for shape in ((8, 16), (32, 64)):
            assert shared.reshard(src, dst, shape, "float32") == \
                direct(cluster, mesh, src, dst, shape, "float32")
    assert len(shared._paths) == 3


def test_dtypes_share_paths():
    """The dtype only scales every move's bytes: tensors of any dtype and size that divide
    alike take one planned path, priced as planning each (to the last bit)."""
    mesh = MESHES["2x4"]
    cluster = S.line_cluster(8, bandwidth=3.0, latency=2.0)
    shared = SearchCosts(cluster, mesh, {p: p for p in mesh.process_ids})
    specs = [s.out_specs[0] for s in layouts((8, 24), mesh)]
    pairs = list(itertools.product(specs, specs))
    for dtype, shape in (("bool", (8, 24)), ("float32", (16, 40)), ("bfloat16", (8, 24)),
                         ("int64", (24, 8))):
        for src, dst in pairs:
            assert shared.reshard(src, dst, shape, dtype) == \
                direct(cluster, mesh, src, dst, shape, dtype), (str(src), str(dst), dtype)
    assert len(shared._paths) <= len(pairs)
