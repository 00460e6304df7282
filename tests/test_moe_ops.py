"""The mixture-of-experts ops against plain numpy: ``moe_ffn`` dropless equals every
token's k experts summed by weight; with a capacity it keeps GShard's order (every
first choice of a sequence before any second choice) and drops the rest; the experts
split in shards (``expert_start``) sum to the whole; its FLOPs are the expected load's;
``top_k`` and ``one_hot`` are numpy's. (Gradients: tests/test_op_grads.py; sharding
rules: tests/test_spmd_generated.py.)"""

from __future__ import annotations

import numpy as np
import pytest

import distgraph as dg
from distgraph.ops.moe import capacity_of
from distgraph.plan.kinds import collective_bytes
from distgraph.registry import KernelContext, TensorType, get_op

CTX = KernelContext(np)


def _swiglu(x, g, u, d):
    a = x @ g
    return (a / (1 + np.exp(-a)) * (x @ u)) @ d


def _case(rng, b=2, s=5, d=4, inner=3, experts=4, k=2):
    ids = np.stack([rng.permutation(experts)[:k] for _ in range(b * s)]).reshape(b, s, k)
    return (rng.standard_normal((b, s, d)), ids, rng.uniform(0.1, 1, (b, s, k)),
            rng.standard_normal((experts, d, inner)), rng.standard_normal((experts, d, inner)),
            rng.standard_normal((experts, inner, d)))


def _reference(x, ids, w, g, u, dn, kept=None):
    y = np.zeros_like(x)
    for b, s, j in np.ndindex(ids.shape):
        if kept is None or kept[b, s, j]:
            e = ids[b, s, j]
            y[b, s] += w[b, s, j] * _swiglu(x[b, s], g[e], u[e], dn[e])
    return y


def test_dropless_is_every_tokens_k_experts():
    x, ids, w, g, u, dn = _case(np.random.default_rng(0))
    y = get_op("moe_ffn").kernel(CTX, x, ids, w, g, u, dn)
    np.testing.assert_allclose(y, _reference(x, ids, w, g, u, dn), rtol=1e-12, atol=1e-12)


def test_a_capacity_keeps_first_choices_before_second_ones():
    x, ids, w, g, u, dn = _case(np.random.default_rng(1), s=6)
    ids[0] = [[0, 1], [2, 0], [0, 3], [1, 0], [0, 2], [3, 1]]   # expert 0 asked 5 times
    capacity = 2
    kept = np.ones(ids.shape, bool)
    for b in range(ids.shape[0]):
        seen = {}
        for j in range(ids.shape[2]):              # GShard: choice-major, then sequence
            for s in range(ids.shape[1]):
                e = ids[b, s, j]
                seen[e] = seen.get(e, 0) + 1
                kept[b, s, j] = seen[e] <= capacity
    # expert 0 keeps the first choices of tokens 0 and 2; token 4's first choice and the
    # second choices of tokens 1 and 3 are dropped
    assert kept[0, :, 0].tolist() == [True, True, True, True, False, True]
    assert not kept[0, 1, 1] and not kept[0, 3, 1]
    y = get_op("moe_ffn").kernel(CTX, x, ids, w, g, u, dn, capacity=capacity)
    np.testing.assert_allclose(y, _reference(x, ids, w, g, u, dn, kept), rtol=1e-12,
                               atol=1e-12)


@pytest.mark.parametrize("capacity", [None, 2])
def test_expert_shards_sum_to_the_whole(capacity):
    x, ids, w, g, u, dn = _case(np.random.default_rng(2))
    kernel = get_op("moe_ffn").kernel
    whole = kernel(CTX, x, ids, w, g, u, dn, capacity=capacity)
    parts = [kernel(CTX, x, ids, w, g[lo:lo + 2], u[lo:lo + 2], dn[lo:lo + 2],
                    capacity=capacity, expert_start=lo, num_experts=4) for lo in (0, 2)]
    np.testing.assert_allclose(parts[0] + parts[1], whole, rtol=1e-12, atol=1e-12)


def test_an_expert_id_out_of_range_is_an_error():
    x, ids, w, g, u, dn = _case(np.random.default_rng(3))
    ids[0, 0, 0] = 4
    with pytest.raises(dg.DistGraphError, match="expert id 4"):
        get_op("moe_ffn").kernel(CTX, x, ids, w, g, u, dn)


def test_flops_are_the_expected_loads():
    b, s, d, inner, experts, k = 2, 8, 16, 12, 4, 2
    ins = [TensorType((b, s, d), "float32"), TensorType((b, s, k), "int64"),
           TensorType((b, s, k), "float32"), TensorType((experts, d, inner), "float32"),
           TensorType((experts, d, inner), "float32"), TensorType((experts, inner, d), "float32")]
    per_pair = 6 * d * inner + 5 * inner + 2 * d
    flops = get_op("moe_ffn").flops
    assert flops(ins, [ins[0]]) == b * s * k * per_pair
    c = capacity_of(s, k, experts, 0.5)                      # ceil(0.5 * 8 * 2 / 4) = 2
    assert c == 2 and flops(ins, [ins[0]], capacity=c) == b * experts * c * per_pair
    assert get_op("moe_ffn_grad").flops(ins, [], capacity=c) == 2 * b * experts * c * per_pair


@pytest.mark.parametrize("capacity", [None, 2])
def test_the_gradient_runs_on_what_the_forward_kept(capacity):
    """With a ``saved`` dict (the runtime's, per micro-batch) the forward keeps its
    experts' rows, pre-activations and outputs and the gradient takes them (the dict is
    empty after): the same gradients as recomputing them; a gradient of other operands
    (a changed weight) recomputes."""
    x, ids, w, g, u, dn = _case(np.random.default_rng(5))
    dy = np.random.default_rng(6).standard_normal(x.shape)
    fwd, grad = get_op("moe_ffn").kernel, get_op("moe_ffn_grad").kernel
    want = grad(CTX, x, ids, w, g, u, dn, dy, capacity)
    saved = {}
    ctx = KernelContext(np, saved=saved)
    fwd(ctx, x, ids, w, g, u, dn, capacity)
    assert len(saved) == 1
    for a, b in zip(grad(ctx, x, ids, w, g, u, dn, dy, capacity), want):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    assert not saved
    # a recomputed copy of the forward (new arrays) replaces what the original kept
    fwd(ctx, x, ids, w, g, u, dn, capacity)
    again = x.copy()
    fwd(ctx, again, ids, w, g, u, dn, capacity)
    assert len(saved) == 1
    for a, b in zip(grad(ctx, again, ids, w, g, u, dn, dy, capacity), want):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    assert not saved
    fwd(ctx, x, ids, w, g, u, dn, capacity)
    other = g.copy()
    other[0] += 1.0
    for a, b in zip(grad(ctx, x, ids, w, other, u, dn, dy, capacity),
                    grad(CTX, x, ids, w, other, u, dn, dy, capacity)):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_top_k_and_one_hot_are_numpys():
    x = np.random.default_rng(4).standard_normal((3, 5, 7))
    values, ids = get_op("top_k").kernel(CTX, x, 3)
    np.testing.assert_array_equal(ids, np.argsort(-x, axis=-1)[..., :3])
    np.testing.assert_array_equal(values, -np.sort(-x, axis=-1)[..., :3])
    hot = get_op("one_hot").kernel(CTX, ids, 7, "float64")
    np.testing.assert_array_equal(hot.sum(axis=(0, 1, 2)), np.bincount(ids.ravel(), minlength=7))


SHAPES = ((4, 6, 12), (4, 6, 2), (4, 6, 2), (4, 12, 6), (4, 12, 6), (4, 6, 12))


@pytest.mark.parametrize("op", ["moe_ffn", "moe_ffn_grad"])
def test_tokens_and_experts_over_one_mesh_dim_dispatch_as_a_fixpoint(op):
    """Tokens and experts split over dp: the all-to-all layout, no output Partial over
    dp (the experts' weight gradients whole along dp too), fed back unchanged."""
    mesh = dg.ProcessMesh([0, 1], ["dp"])
    shapes = SHAPES + ((SHAPES[0],) if op == "moe_ffn_grad" else ())
    split = ["dp", None, None]
    specs = [split, split, split, split, None, None] + ([None] if op == "moe_ffn_grad" else [])
    specs = [s or [None] * 3 for s in specs]
    rule = dg.ops.spmd_rule(op)
    res = rule.infer_forward(specs, shapes, mesh)
    assert all(s.dims[0] == "dp" for s in res.in_specs)
    assert all(not s.partial for s in res.out_specs)
    assert "all-to-all over dp" in res.notes[0]
    again = rule.infer_forward(res.in_specs, shapes, mesh)
    assert again.in_specs == res.in_specs and again.out_specs == res.out_specs


def test_the_dispatch_declares_its_all_to_alls_at_the_expected_load():
    """Each process sends (n - 1) / n of its k assignments' rows there and back, and the
    counts (dropless: both priced as MoE's variable exchange, which calibrate measures
    with the counts' size among its own); with a capacity, its fixed buffers."""
    mesh = dg.ProcessMesh([0, 1], ["dp"])
    rule = dg.ops.spmd_rule("moe_ffn")
    for capacity, want in ((None, [4 * 8 / 2, 2 * 6 * 2 * 12 * 8 / 2, 2 * 6 * 2 * 12 * 8 / 2]),
                           (3, [4 * 2 * 3 * 12 * 8 / 2] * 2)):
        found = [s for s in rule.strategies(SHAPES, [SHAPES[0]], mesh,
                                            in_dtypes=["float64", "int64", "float64"] +
                                            ["float64"] * 3, capacity=capacity)
                 if s.name.endswith("(all-to-all over dp)")]
        assert found
        sent = [collective_bytes(k, n, b) for k, n, b in found[0].comm]
        assert sent == want
        # dropless, the counts' exchange is priced as the variable exchange it opens
        kinds = [k for k, _, _ in found[0].comm]
        assert kinds == (["all_to_allv"] * 3 if capacity is None else ["all_to_all"] * 2)
    # the gradient runs on what its forward kept: the counts are known, d columns each way
    grad = dg.ops.spmd_rule("moe_ffn_grad")
    found = [s for s in grad.strategies(SHAPES + (SHAPES[0],), [SHAPES[0]] + list(SHAPES[1:]),
                                        mesh, in_dtypes=["float64", "int64"] + ["float64"] * 5)
             if s.name.endswith("(all-to-all over dp)")]
    assert [collective_bytes(k, n, b) for k, n, b in found[0].comm] == \
        [2 * 6 * 2 * 12 * 8 / 2] * 2


@pytest.mark.parametrize("capacity", [None, 2])
def test_the_dispatch_gradient_on_kept_activations_equals_recomputing_them(capacity):
    """Tokens and experts over 2 ranks (SimulatedWorld): the all-to-all gradient on what
    its forward kept in ``saved`` (``d`` columns each way) equals the one that sends
    ``[x | dy | weight]`` and recomputes, and both equal the serial kernel's."""
    from distgraph.runtime.comm.simulated import SimulatedWorld

    x, ids, w, g, u, dn = _case(np.random.default_rng(7), b=4, s=5, d=4, inner=3, experts=4)
    dy = np.random.default_rng(8).standard_normal(x.shape)
    fwd, grad = get_op("moe_ffn").kernel, get_op("moe_ffn_grad").kernel
    serial = grad(CTX, x, ids, w, g, u, dn, dy, capacity)

    def rank(comm, keep):
        r = comm.rank
        rows, ex = slice(2 * r, 2 * r + 2), slice(2 * r, 2 * r + 2)
        saved = {} if keep else None
        ctx = KernelContext(np, comm=comm, group=(0, 1), saved=saved)
        args = (x[rows], ids[rows], w[rows], g[ex], u[ex], dn[ex])
        attrs = dict(capacity=capacity, expert_start=2 * r, num_experts=4)
        fwd(ctx, *args, **attrs)
        out = grad(ctx, *args, dy[rows], **attrs)
        assert not saved
        return out

    for keep in (True, False):
        parts = SimulatedWorld(2, timeout=20).run(rank, keep)
        dx = np.concatenate([p[0] for p in parts])
        dwt = np.concatenate([p[1] for p in parts])
        np.testing.assert_allclose(dx, serial[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(dwt, serial[1], rtol=1e-12, atol=1e-12)
        for k in range(3):
            np.testing.assert_allclose(np.concatenate([p[2 + k] for p in parts]),
                                       serial[2 + k], rtol=1e-12, atol=1e-12)
