"""Checks that the plain-numpy GPT-2 reference (tests/reference_gpt.py) is
itself correct: its hand-written gradients against central finite
differences, and (when PyTorch is installed) its loss and gradients against an
autograd implementation written independently here."""

import os
import sys

import numpy as np
import pytest

# Import the sibling module without relying on pytest's rootdir/sys.path setup.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference_gpt import gpt_loss_and_grads, init_params  # noqa: E402

# Tiny config for finite differences; max_seq_len > T so that the unused
# position-embedding rows (which must get zero gradient) are present.
TINY = dict(vocab_size=11, d_model=8, n_layer=2, n_head=2, max_seq_len=7)
TINY_B, TINY_T = 2, 5


def _batch(cfg, B, T, seed):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, cfg["vocab_size"], size=(B, T), dtype=np.int64)
    labels = rng.integers(0, cfg["vocab_size"], size=(B, T), dtype=np.int64)
    return idx, labels


def _expected_shapes(V, d, L, S):
    shapes = {"wte.weight": (V, d), "wpe.weight": (S, d)}
    for i in range(L):
        p = f"blocks.{i}."
        shapes.update({
            p + "ln1.weight": (d,), p + "ln1.bias": (d,),
            p + "attn.qkv.weight": (d, 3 * d), p + "attn.qkv.bias": (3 * d,),
            p + "attn.proj.weight": (d, d), p + "attn.proj.bias": (d,),
            p + "ln2.weight": (d,), p + "ln2.bias": (d,),
            p + "mlp.fc1.weight": (d, 4 * d), p + "mlp.fc1.bias": (4 * d,),
            p + "mlp.fc2.weight": (4 * d, d), p + "mlp.fc2.bias": (d,),
        })
    shapes.update({"ln_f.weight": (d,), "ln_f.bias": (d,),
                   "lm_head.weight": (d, V)})
    return shapes


def test_param_names_shapes_and_dtype():
    params = init_params(**TINY, seed=0)
    expected = _expected_shapes(11, 8, 2, 7)
    assert {k: v.shape for k, v in params.items()} == expected
    assert all(v.dtype == np.float64 for v in params.values())
    # Deterministic in the seed.
    again = init_params(**TINY, seed=0)
    assert all(np.array_equal(params[k], again[k]) for k in params)

    p32 = init_params(**TINY, seed=0, dtype=np.float32)
    assert all(v.dtype == np.float32 for v in p32.values())
    idx, labels = _batch(TINY, TINY_B, TINY_T, seed=1)
    loss32, g32 = gpt_loss_and_grads(p32, idx, labels, n_head=TINY["n_head"])
    assert np.isfinite(loss32)
    assert all(g32[k].dtype == np.float32 and g32[k].shape == p32[k].shape
               for k in p32)


def test_grads_match_finite_differences():
    n_head = TINY["n_head"]
    params = init_params(**TINY, seed=0)
    idx, labels = _batch(TINY, TINY_B, TINY_T, seed=1)
    loss, grads = gpt_loss_and_grads(params, idx, labels, n_head=n_head)
    assert set(grads) == set(params)
    assert np.isfinite(loss) and loss > 0

    rng = np.random.default_rng(2)
    h = 1e-5
    n_checked = 0
    for name, w in params.items():
        # A random subset of entries of every parameter (all of tiny ones).
        n_pick = min(w.size, 6)
        for flat in rng.choice(w.size, size=n_pick, replace=False):
            pos = np.unravel_index(flat, w.shape)
            orig = w[pos]
            w[pos] = orig + h
            lp, _ = gpt_loss_and_grads(params, idx, labels, n_head=n_head)
            w[pos] = orig - h
            lm, _ = gpt_loss_and_grads(params, idx, labels, n_head=n_head)
            w[pos] = orig
            fd = (lp - lm) / (2 * h)
            np.testing.assert_allclose(
                grads[name][pos], fd, rtol=1e-6, atol=1e-9,
                err_msg=f"{name}{tuple(int(i) for i in pos)}")
            n_checked += 1
    assert n_checked > 100

    # Exact zeros where the loss cannot depend on the parameter.
    np.testing.assert_array_equal(grads["wpe.weight"][TINY_T:], 0.0)
    unused = np.setdiff1d(np.arange(TINY["vocab_size"]), idx)
    np.testing.assert_array_equal(grads["wte.weight"][unused], 0.0)


def _torch_loss_and_grads(torch, params, idx, labels, n_head, eps=1e-5):
    """Independent float64 autograd GPT-2 built from torch library ops."""
    F = torch.nn.functional
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True)
         for k, v in params.items()}
    idx_t = torch.tensor(idx, dtype=torch.long)
    B, T = idx_t.shape
    d = t["wte.weight"].shape[1]
    hd = d // n_head

    def ln(x, name):
        return F.layer_norm(x, (d,), t[name + ".weight"], t[name + ".bias"],
                            eps)

    def heads(z):  # [B, T, d] -> [B, H, T, hd]
        return z.view(B, T, n_head, hd).transpose(1, 2)

    x = t["wte.weight"][idx_t] + t["wpe.weight"][:T]
    i = 0
    while f"blocks.{i}.ln1.weight" in t:
        p = f"blocks.{i}."
        h = ln(x, p + "ln1")
        q, k, v = (h @ t[p + "attn.qkv.weight"]
                   + t[p + "attn.qkv.bias"]).split(d, dim=-1)
        o = F.scaled_dot_product_attention(heads(q), heads(k), heads(v),
                                           is_causal=True)
        o = o.transpose(1, 2).reshape(B, T, d)
        x = x + o @ t[p + "attn.proj.weight"] + t[p + "attn.proj.bias"]
        h = ln(x, p + "ln2")
        h = F.gelu(h @ t[p + "mlp.fc1.weight"] + t[p + "mlp.fc1.bias"],
                   approximate="tanh")
        x = x + h @ t[p + "mlp.fc2.weight"] + t[p + "mlp.fc2.bias"]
        i += 1
    logits = ln(x, "ln_f") @ t["lm_head.weight"]
    loss = F.cross_entropy(logits.reshape(B * T, -1),
                           torch.tensor(labels, dtype=torch.long).reshape(-1))
    loss.backward()
    return loss.item(), {k: v.grad.numpy() for k, v in t.items()}


@pytest.mark.parametrize("cfg,B,T", [
    (TINY, TINY_B, TINY_T),
    (dict(vocab_size=50, d_model=32, n_layer=3, n_head=4, max_seq_len=20),
     3, 16),
])
def test_matches_torch_autograd(cfg, B, T):
    torch = pytest.importorskip("torch")
    params = init_params(**cfg, seed=3)
    idx, labels = _batch(cfg, B, T, seed=4)
    loss, grads = gpt_loss_and_grads(params, idx, labels, n_head=cfg["n_head"])
    t_loss, t_grads = _torch_loss_and_grads(torch, params, idx, labels,
                                            n_head=cfg["n_head"])
    np.testing.assert_allclose(loss, t_loss, rtol=1e-10, atol=0)
    assert set(grads) == set(t_grads)
    for name in params:
        g, tg = grads[name], t_grads[name]
        # Relative to the tensor's scale, so entries that are (near) zero,
        # e.g. unused embedding rows, do not demand bitwise agreement.
        scale = np.abs(tg).max()
        np.testing.assert_allclose(g, tg, rtol=1e-10, atol=1e-10 * scale,
                                   err_msg=name)
