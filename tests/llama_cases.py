"""Tiny LLaMA-family checkpoints made by transformers, and transformers' own logits and
gradients for them in float64: the oracle of tests/test_llama.py.

transformers computes three things in float32 whatever the model's dtype: the rotary
angles (its ``rotary_emb`` casts positions and ``inv_freq`` to float), RMSNorm (it casts
the hidden states to float32) and the attention softmax (``dtype=torch.float32``). That
moves float64 logits by ~1e-7. The oracle therefore runs those three in float64 when the
model is float64: the softmax and RMSNorm are transformers' own with the casts left out,
and the rotary embedding is the same formula (``cat(freqs, freqs)``, cos and sin) on the
inverse frequencies distgraph computes — which ``test_rope_frequencies_equal_transformers``
checks against transformers' own, to float32 precision. Everything else (attention with
its causal and sliding-window masks and grouped-query heads, the MLP, embeddings, the
loss) is transformers' code in float64; float32 models are not touched.
"""

from __future__ import annotations

import types

import numpy as np

torch = None
transformers = None

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=500000.0)),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM",
                   dict(rope_theta=500000.0, tie_word_embeddings=True)),
    "llama3-scaled": ("LlamaConfig", "LlamaForCausalLM",
                      dict(rope_theta=500000.0, rope_scaling=LLAMA3_SCALING)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=5, head_dim=8)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1000000.0)),
}


MODELING = ("llama", "mistral", "qwen2", "mixtral")


def load_libraries():
    """Import torch and transformers (the tests skip without them) and let their float64
    models stay in float64 (module docstring)."""
    global torch, transformers
    import importlib

    import torch as _torch
    import transformers as _transformers

    torch, transformers = _torch, _transformers
    for name in MODELING:
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        module.nn = _NN()
        norm = getattr(module, f"{name.capitalize()}RMSNorm", None)
        if norm is not None and not getattr(norm, "_float64", False):
            norm.forward, norm._float64 = _rms_forward(norm.forward), True


class _Functional:
    """torch.nn.functional whose softmax keeps a float64 input in float64."""

    def __getattr__(self, name):
        return getattr(torch.nn.functional, name)

    @staticmethod
    def softmax(x, dim=None, dtype=None, **kw):
        return torch.nn.functional.softmax(x, dim=dim, dtype=None if x.dtype == torch.float64
                                           else dtype, **kw)


class _NN:
    """torch.nn with :class:`_Functional`, for the modeling modules' ``nn`` global."""

    functional = _Functional()

    def __getattr__(self, name):
        return getattr(torch.nn, name)


def _rms_forward(original):
    def forward(self, hidden_states):
        if hidden_states.dtype != torch.float64:
            return original(self, hidden_states)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))
    return forward


def hf_model(name: str, seed: int = 0):
    """A random float64 transformers model of CONFIGS[name], eval mode."""
    config_cls, model_cls, extra = CONFIGS[name]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**TINY, **extra)
    config._attn_implementation = "eager"
    model = getattr(transformers, model_cls)(config).to(torch.float64).eval()
    _float64_rotary(model)
    return model


def _float64_rotary(model) -> None:
    """Evaluate the model's rotary embedding in float64 (module docstring)."""
    from distgraph.ops.transformer import rope_frequencies

    c = model.config
    params = dict(c.rope_parameters)
    theta = params.pop("rope_theta")
    scaling = params if params.get("rope_type", "default") != "default" else None
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    inv = torch.tensor(rope_frequencies(head_dim, theta, tuple(sorted((scaling or {}).items()))),
                       dtype=torch.float64)
    rotary = model.model.rotary_emb

    def forward(self, x, position_ids):
        freqs = position_ids[..., None].to(torch.float64) * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    rotary.forward = types.MethodType(forward, rotary)


def np_bfloat16():
    import ml_dtypes

    return ml_dtypes.bfloat16


def tokens(batch: int = 2, seq: int = 12, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, TINY["vocab_size"], (batch, seq))


def logits_and_grads(model, ids: np.ndarray) -> tuple:
    """(logits, mean next-token cross-entropy, {transformers name: gradient})."""
    model.zero_grad()
    x = torch.tensor(ids)
    logits = model(input_ids=x).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                             x[:, 1:].reshape(-1))
    loss.backward()
    grads = {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()
             if p.grad is not None}
    return logits.detach().numpy(), float(loss.detach()), grads


# -- distgraph plans and data for the Llama training tests ---------------------------------------
class NextTokens:
    """``n`` random token sequences of ``seq + 1`` tokens: sample i is (tokens, the next
    tokens)."""

    def __init__(self, n: int, seq: int, seed: int = 0):
        self.ids = np.random.default_rng(seed).integers(0, TINY["vocab_size"], (n, seq + 1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return self.ids[i, :-1], self.ids[i, 1:]


def two_stages(model, first, second) -> None:
    """The embedding and the first half of the layers on mesh ``first``, the rest, the
    final norm and the head on ``second`` (parameters replicated on their stage)."""
    import distgraph as dg

    half = len(model.layers._items) // 2
    parts = [(model.embed_tokens, first), (model.norm, second)]
    parts += [(layer, first if i < half else second) for i, layer in enumerate(model.layers)]
    if model.lm_head is not None:
        parts.append((model.lm_head, second))
    for layer, mesh in parts:
        for _, p in layer.named_parameters():
            dg.shard_tensor(p, mesh, [None] * len(p.shape))


def trains_equal(results, serial) -> None:
    """Each ``(losses, {parameter: value})`` of ``results`` equals ``serial``'s (1e-10)."""
    for losses, params in results:
        np.testing.assert_allclose(losses, serial[0], rtol=0, atol=1e-10)
        for name, value in serial[1].items():
            np.testing.assert_allclose(params[name], value, rtol=0, atol=1e-10, err_msg=name)
