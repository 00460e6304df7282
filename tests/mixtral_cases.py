"""A tiny Mixtral made by transformers (8 experts, top-2, grouped-query attention 4:2),
and its logits, loss and gradients in float64: the oracle of tests/test_mixtral.py.

Besides what llama_cases.py patches (RMSNorm, attention softmax, rotary angles in
float64), transformers' Mixtral computes two more things in float32 whatever the
model's dtype: the router's softmax (``router_logits.float()``) and the load-balancing
loss's sums. The oracle runs the router as transformers writes it without the cast for
a float64 model, and computes the load-balancing loss by transformers' formula in
float64 (:func:`balance_loss`, which ``test_balance_loss_is_transformers`` checks
against transformers' own to float32 precision). The experts run transformers' eager
loop.

:func:`legacy` rewrites a saved checkpoint in the layout earlier transformers wrote (a
tensor per expert, ``block_sparse_moe``), as Mixtral's published checkpoints are.
"""

from __future__ import annotations

import json
import os
import types

import numpy as np

import llama_cases as L

TINY_MOE = dict(L.TINY, num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.0)


def hf_mixtral(seed: int = 0, **changes):
    """A random float64 transformers MixtralForCausalLM, eval mode, the router in float64."""
    torch, transformers = L.torch, L.transformers
    torch.manual_seed(seed)
    config = transformers.MixtralConfig(**{**TINY_MOE, **changes})
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    model = transformers.MixtralForCausalLM(config).to(torch.float64).eval()
    L._float64_rotary(model)
    for layer in model.model.layers:
        router = layer.mlp.gate
        router.forward = types.MethodType(_router_forward, router)
    return model


def _router_forward(self, hidden_states):
    """transformers' MixtralTopKRouter.forward without its float32 cast."""
    torch = L.torch
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = torch.nn.functional.linear(hidden_states, self.weight)
    router_probs = torch.nn.functional.softmax(router_logits, dim=-1)
    top, indices = torch.topk(router_probs, self.top_k, dim=-1)
    top = top / top.sum(dim=-1, keepdim=True)
    return router_logits, top, indices


def balance_loss(router_logits, experts: int, top_k: int):
    """transformers' load_balancing_loss_func (no attention mask) in float64."""
    torch = L.torch
    counts = torch.zeros(experts, dtype=torch.float64)
    probs = torch.zeros(experts, dtype=torch.float64)
    rows = 0
    for logits in router_logits:
        weights = torch.nn.functional.softmax(logits, dim=-1)
        _, chosen = torch.topk(weights, top_k, dim=-1)
        counts = counts + torch.bincount(chosen.reshape(-1), minlength=experts).double()
        probs = probs + weights.sum(dim=0)
        rows += weights.shape[0]
    return torch.sum((counts / rows) * (probs / rows)) * experts


def logits_and_grads(model, ids: np.ndarray, aux: bool) -> tuple:
    """(logits, loss, {transformers name: gradient}); the loss is the mean next-token
    cross-entropy, plus ``router_aux_loss_coef`` times the load-balancing loss if
    ``aux``."""
    torch = L.torch
    model.zero_grad()
    x = torch.tensor(ids)
    out = model(input_ids=x, output_router_logits=aux)
    logits = out.logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                             x[:, 1:].reshape(-1))
    if aux:
        c = model.config
        loss = loss + c.router_aux_loss_coef * balance_loss(
            out.router_logits, c.num_local_experts, c.num_experts_per_tok)
    loss.backward()
    grads = {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()
             if p.grad is not None}
    return logits.detach().numpy(), float(loss.detach()), grads


def legacy(folder, out) -> None:
    """Write the checkpoint in ``folder`` to ``out`` in the earlier layout: a [I, hidden]
    ``w1`` (gate) and ``w3`` (up) and a [hidden, I] ``w2`` (down) per expert, the router
    as ``block_sparse_moe.gate.weight``."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(os.path.join(folder, "model.safetensors"))
    old = {}
    for key, value in tensors.items():
        prefix = key.split(".mlp.")[0] + ".block_sparse_moe."
        if key.endswith(".mlp.gate.weight"):
            old[prefix + "gate.weight"] = value
        elif key.endswith(".mlp.experts.gate_up_proj"):
            inner = value.shape[1] // 2
            for e in range(value.shape[0]):
                old[f"{prefix}experts.{e}.w1.weight"] = value[e, :inner].copy()
                old[f"{prefix}experts.{e}.w3.weight"] = value[e, inner:].copy()
        elif key.endswith(".mlp.experts.down_proj"):
            for e in range(value.shape[0]):
                old[f"{prefix}experts.{e}.w2.weight"] = value[e].copy()
        else:
            old[key] = value
    os.makedirs(out, exist_ok=True)
    save_file(old, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json")) as f:
        raw = json.load(f)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(raw, f)
