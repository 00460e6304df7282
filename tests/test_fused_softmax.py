"""The fused scale-mask-softmax (Megatron's FusedScaleMaskSoftmax) equals the ops it fuses
(scale, causal where, softmax), forward and backward (its finite-difference case is in
tests/test_op_grads.py), and is priced as one pass over the scores where they take
several."""

from __future__ import annotations

import numpy as np

import distgraph as dg
from distgraph.passes.cost.prices import op_time
from distgraph.registry import KernelContext, TensorType, get_op


def test_equals_the_composed_ops_forward_and_backward():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 5, 5))
    ctx = KernelContext(np)
    y = get_op("scaled_masked_softmax").kernel(ctx, x, scale=0.25, causal=True)
    keep = np.tril(np.ones((5, 5), dtype=bool))
    z = np.where(keep, 0.25 * x, -np.inf)
    ref = np.exp(z - z.max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
    assert np.allclose(y, ref, atol=1e-12)
    dy = rng.standard_normal(y.shape)
    dx = get_op("scaled_masked_softmax_grad").kernel(ctx, y, dy, scale=0.25)
    ref_dx = 0.25 * ref * (dy - (dy * ref).sum(-1, keepdims=True))
    assert np.allclose(dx, ref_dx, atol=1e-12)
    assert np.allclose(dx[..., ~keep], 0.0)          # masked scores get no gradient


def test_priced_as_one_pass_where_the_composed_ops_take_several():
    device = dg.Cluster.local(1).devices[0]
    t = TensorType((8, 16, 512, 512), "bfloat16")
    fused = op_time("scaled_masked_softmax", [t], [t], {"scale": 0.1, "causal": True}, device)
    scale = op_time("scale", [t], [t], {"scale": 0.1}, device)
    softmax = op_time("softmax", [t], [t], {"axis": 3}, device)
    assert fused <= 1.01 * softmax and fused < 0.6 * (scale + softmax)
