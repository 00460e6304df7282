"""Plain-numpy GPT-2 reference: the oracle for distgraph's GPT tests.

This module is deliberately independent of distgraph. It implements the
GPT-2 / nanoGPT architecture (pre-norm blocks, causal multi-head attention,
tanh-GELU MLP, final LayerNorm, untied LM head) with a forward pass and a
hand-written reverse pass, so that distgraph's forward/backward results can be
compared against it.

Conventions
-----------
* Linear weights are stored ``[in_features, out_features]`` and applied as
  ``y = x @ W + b``.
* The fused QKV projection's output is split along the last dimension into
  ``q | k | v`` (each of width ``d``); head ``h`` uses columns
  ``h*hd:(h+1)*hd`` of each of ``q``, ``k`` and ``v`` (``hd = d // n_head``).
* LayerNorm uses the biased variance with ``eps`` inside the square root.
* The loss is the mean softmax cross-entropy over all ``B*T`` tokens.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["param_shapes", "init_params", "gpt_forward", "gpt_loss_and_grads"]

_GELU_C = math.sqrt(2.0 / math.pi)


# --------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------

def param_shapes(vocab_size: int, d_model: int, n_layer: int,
                 max_seq_len: int) -> dict[str, tuple[int, ...]]:
    """Names and shapes of every parameter, in a fixed (insertion) order."""
    V, d = vocab_size, d_model
    shapes: dict[str, tuple[int, ...]] = {
        "wte.weight": (V, d),
        "wpe.weight": (max_seq_len, d),
    }
    for i in range(n_layer):
        p = f"blocks.{i}."
        shapes.update({
            p + "ln1.weight": (d,),
            p + "ln1.bias": (d,),
            p + "attn.qkv.weight": (d, 3 * d),
            p + "attn.qkv.bias": (3 * d,),
            p + "attn.proj.weight": (d, d),
            p + "attn.proj.bias": (d,),
            p + "ln2.weight": (d,),
            p + "ln2.bias": (d,),
            p + "mlp.fc1.weight": (d, 4 * d),
            p + "mlp.fc1.bias": (4 * d,),
            p + "mlp.fc2.weight": (4 * d, d),
            p + "mlp.fc2.bias": (d,),
        })
    shapes.update({
        "ln_f.weight": (d,),
        "ln_f.bias": (d,),
        "lm_head.weight": (d, V),
    })
    return shapes


def init_params(vocab_size: int, d_model: int, n_layer: int, n_head: int,
                max_seq_len: int, seed: int,
                dtype=np.float64) -> dict[str, np.ndarray]:
    """Random GPT-2 parameters.

    Weight matrices and embeddings are ``normal(0, 0.02)``. Biases and
    LayerNorm parameters are *not* left at their usual 0 / 1 initial values
    but perturbed (bias ``0.1*normal``, LayerNorm weight ``1 + 0.1*normal``),
    so that tests exercise every parameter's effect and gradient.
    """
    if d_model % n_head != 0:
        raise ValueError(f"d_model={d_model} not divisible by n_head={n_head}")
    rng = np.random.default_rng(seed)
    params: dict[str, np.ndarray] = {}
    for name, shape in param_shapes(vocab_size, d_model, n_layer,
                                    max_seq_len).items():
        is_ln = name.startswith("ln_f.") or ".ln1." in name or ".ln2." in name
        if is_ln and name.endswith(".weight"):
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            value = 0.1 * rng.standard_normal(shape)
        else:
            value = 0.02 * rng.standard_normal(shape)
        params[name] = value.astype(dtype)
    return params


# --------------------------------------------------------------------------
# Layer primitives: each forward returns (output, cache); each backward takes
# the upstream gradient and the cache.
# --------------------------------------------------------------------------

def _layernorm_fwd(x, w, b, eps):
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)  # biased variance
    rstd = 1.0 / np.sqrt(var + eps)
    xhat = (x - mu) * rstd
    return xhat * w + b, (xhat, rstd, w)


def _layernorm_bwd(dy, cache):
    xhat, rstd, w = cache
    red = tuple(range(dy.ndim - 1))
    dw = (dy * xhat).sum(axis=red)
    db = dy.sum(axis=red)
    dxhat = dy * w
    # d/dx of (x - mu) * rstd, with mu and rstd both functions of x:
    #   dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
    dx = rstd * (dxhat
                 - dxhat.mean(axis=-1, keepdims=True)
                 - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    return dx, dw, db


def _linear_fwd(x, w, b=None):
    y = x @ w
    if b is not None:
        y = y + b
    return y, x


def _linear_bwd(dy, x, w, has_bias=True):
    """Returns (dx, dw, db); db is None when the layer has no bias."""
    din, dout = w.shape
    x2 = x.reshape(-1, din)
    dy2 = dy.reshape(-1, dout)
    dw = x2.T @ dy2
    db = dy2.sum(axis=0) if has_bias else None
    dx = dy @ w.T
    return dx, dw, db


def _gelu_fwd(x):
    # tanh approximation: 0.5 * x * (1 + tanh(c * (x + 0.044715 x^3)))
    t = np.tanh(_GELU_C * (x + 0.044715 * x ** 3))
    return 0.5 * x * (1.0 + t), (x, t)


def _gelu_bwd(dy, cache):
    x, t = cache
    # d/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) * c * (1 + 3 * 0.044715 x^2)
    du_dx = _GELU_C * (1.0 + 3.0 * 0.044715 * x ** 2)
    return dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du_dx)


def _split_heads(x, n_head):
    """[B, T, d] -> [B, H, T, hd] (head h = columns h*hd:(h+1)*hd)."""
    B, T, d = x.shape
    return x.reshape(B, T, n_head, d // n_head).transpose(0, 2, 1, 3)


def _merge_heads(x):
    """[B, H, T, hd] -> [B, T, d]; inverse of _split_heads."""
    B, H, T, hd = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, H * hd)


def _attention_fwd(x, p, n_head):
    """Causal multi-head self-attention on x [B, T, d] (already normalised)."""
    d = x.shape[-1]
    hd = d // n_head
    qkv, qkv_in = _linear_fwd(x, p["attn.qkv.weight"], p["attn.qkv.bias"])
    q = _split_heads(qkv[..., 0 * d:1 * d], n_head)
    k = _split_heads(qkv[..., 1 * d:2 * d], n_head)
    v = _split_heads(qkv[..., 2 * d:3 * d], n_head)

    scale = 1.0 / math.sqrt(hd)
    T = x.shape[1]
    causal = np.tril(np.ones((T, T), dtype=bool))  # t attends to s <= t
    s = (q @ k.swapaxes(-1, -2)) * scale
    s = np.where(causal, s, -np.inf)
    s = s - s.max(axis=-1, keepdims=True)
    e = np.exp(s)  # masked entries become exactly 0
    att = e / e.sum(axis=-1, keepdims=True)
    o = _merge_heads(att @ v)

    y, proj_in = _linear_fwd(o, p["attn.proj.weight"], p["attn.proj.bias"])
    return y, (qkv_in, q, k, v, att, proj_in, scale)


def _attention_bwd(dy, cache, p):
    qkv_in, q, k, v, att, proj_in, scale = cache
    g = {}
    do, g["attn.proj.weight"], g["attn.proj.bias"] = _linear_bwd(
        dy, proj_in, p["attn.proj.weight"])
    do = _split_heads(do, q.shape[1])

    # o = att @ v
    datt = do @ v.swapaxes(-1, -2)
    dv = att.swapaxes(-1, -2) @ do
    # softmax backward (row-wise): ds = att * (datt - sum(datt * att)).
    # Masked positions have att == 0, so they receive zero gradient.
    ds = att * (datt - (datt * att).sum(axis=-1, keepdims=True))
    # s = scale * q @ k^T
    dq = (ds @ k) * scale
    dk = (ds.swapaxes(-1, -2) @ q) * scale

    dqkv = np.concatenate(
        [_merge_heads(dq), _merge_heads(dk), _merge_heads(dv)], axis=-1)
    dx, g["attn.qkv.weight"], g["attn.qkv.bias"] = _linear_bwd(
        dqkv, qkv_in, p["attn.qkv.weight"])
    return dx, g


def _mlp_fwd(x, p):
    h, fc1_in = _linear_fwd(x, p["mlp.fc1.weight"], p["mlp.fc1.bias"])
    a, gelu_cache = _gelu_fwd(h)
    y, fc2_in = _linear_fwd(a, p["mlp.fc2.weight"], p["mlp.fc2.bias"])
    return y, (fc1_in, gelu_cache, fc2_in)


def _mlp_bwd(dy, cache, p):
    fc1_in, gelu_cache, fc2_in = cache
    g = {}
    da, g["mlp.fc2.weight"], g["mlp.fc2.bias"] = _linear_bwd(
        dy, fc2_in, p["mlp.fc2.weight"])
    dh = _gelu_bwd(da, gelu_cache)
    dx, g["mlp.fc1.weight"], g["mlp.fc1.bias"] = _linear_bwd(
        dh, fc1_in, p["mlp.fc1.weight"])
    return dx, g


def _block_params(params, i):
    prefix = f"blocks.{i}."
    return {k[len(prefix):]: v for k, v in params.items()
            if k.startswith(prefix)}


def _n_layer(params):
    n = 0
    while f"blocks.{n}.ln1.weight" in params:
        n += 1
    return n


# --------------------------------------------------------------------------
# Whole model
# --------------------------------------------------------------------------

def _forward(params, idx, n_head, eps):
    idx = np.asarray(idx)
    if idx.ndim != 2:
        raise ValueError(f"idx must be [B, T], got shape {idx.shape}")
    T = idx.shape[1]
    if T > params["wpe.weight"].shape[0]:
        raise ValueError(f"sequence length {T} exceeds max_seq_len "
                         f"{params['wpe.weight'].shape[0]}")

    x = params["wte.weight"][idx] + params["wpe.weight"][:T]
    block_caches = []
    for i in range(_n_layer(params)):
        p = _block_params(params, i)
        h, ln1_c = _layernorm_fwd(x, p["ln1.weight"], p["ln1.bias"], eps)
        a, attn_c = _attention_fwd(h, p, n_head)
        x = x + a
        h, ln2_c = _layernorm_fwd(x, p["ln2.weight"], p["ln2.bias"], eps)
        m, mlp_c = _mlp_fwd(h, p)
        x = x + m
        block_caches.append((ln1_c, attn_c, ln2_c, mlp_c))
    h, lnf_c = _layernorm_fwd(x, params["ln_f.weight"], params["ln_f.bias"],
                              eps)
    logits, head_in = _linear_fwd(h, params["lm_head.weight"])
    return logits, (idx, block_caches, lnf_c, head_in)


def gpt_forward(params: dict[str, np.ndarray], idx, n_head: int,
                eps: float = 1e-5) -> np.ndarray:
    """Logits [B, T, V] for token ids ``idx`` [B, T]."""
    return _forward(params, idx, n_head, eps)[0]


def gpt_loss_and_grads(params: dict[str, np.ndarray], idx, labels,
                       n_head: int, eps: float = 1e-5
                       ) -> tuple[float, dict[str, np.ndarray]]:
    """Mean token cross-entropy and its gradient w.r.t. every parameter.

    ``idx`` and ``labels`` are integer arrays of shape [B, T]. Returns
    ``(loss, grads)`` with ``grads`` keyed by the same names as ``params``
    (and of the same shapes and dtypes).
    """
    logits, (idx, block_caches, lnf_c, head_in) = _forward(
        params, idx, n_head, eps)
    labels = np.asarray(labels, dtype=np.int64)
    if labels.shape != idx.shape:
        raise ValueError(f"labels shape {labels.shape} != idx shape "
                         f"{idx.shape}")
    B, T, V = logits.shape
    N = B * T

    # ---- loss: numerically stable log-softmax cross-entropy ----
    z = logits.reshape(N, V)
    z = z - z.max(axis=-1, keepdims=True)
    logsumexp = np.log(np.exp(z).sum(axis=-1, keepdims=True))
    logp = z - logsumexp
    flat_labels = labels.reshape(N)
    loss = float(-logp[np.arange(N), flat_labels].mean())

    # ---- backward ----
    grads: dict[str, np.ndarray] = {}
    # d(mean CE)/d logits = (softmax - onehot) / N
    dlogits = np.exp(logp)
    dlogits[np.arange(N), flat_labels] -= 1.0
    dlogits = (dlogits / N).reshape(B, T, V)

    dh, grads["lm_head.weight"], _ = _linear_bwd(
        dlogits, head_in, params["lm_head.weight"], has_bias=False)
    dx, grads["ln_f.weight"], grads["ln_f.bias"] = _layernorm_bwd(dh, lnf_c)

    for i in reversed(range(len(block_caches))):
        ln1_c, attn_c, ln2_c, mlp_c = block_caches[i]
        p = _block_params(params, i)
        prefix = f"blocks.{i}."
        # x_out = x_mid + mlp(ln2(x_mid)): residual passes dx through.
        dm, g_mlp = _mlp_bwd(dx, mlp_c, p)
        dh, dw, db = _layernorm_bwd(dm, ln2_c)
        dx = dx + dh
        grads[prefix + "ln2.weight"], grads[prefix + "ln2.bias"] = dw, db
        # x_mid = x_in + attn(ln1(x_in))
        da, g_attn = _attention_bwd(dx, attn_c, p)
        dh, dw, db = _layernorm_bwd(da, ln1_c)
        dx = dx + dh
        grads[prefix + "ln1.weight"], grads[prefix + "ln1.bias"] = dw, db
        for k, v in {**g_mlp, **g_attn}.items():
            grads[prefix + k] = v

    # x = wte[idx] + wpe[:T]: scatter-add into the embedding rows used.
    dwte = np.zeros_like(params["wte.weight"])
    np.add.at(dwte, idx, dx)
    dwpe = np.zeros_like(params["wpe.weight"])
    dwpe[:T] = dx.sum(axis=0)
    grads["wte.weight"], grads["wpe.weight"] = dwte, dwpe

    # Same order, shapes and dtypes as params.
    return loss, {name: np.asarray(grads[name], dtype=params[name].dtype)
                  for name in params}
