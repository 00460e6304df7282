"""The LLaMA family (Llama 2/3, Mistral, Qwen2): RMSNorm, rotary positions, grouped-query
attention, SwiGLU, optional tied embeddings — one architecture, configured as
transformers' ``LlamaConfig`` is (the same field names).

Parameter names follow transformers' without the ``model.`` prefix
(``embed_tokens.weight``, ``layers.0.self_attn.q_proj.weight``,
``layers.0.mlp.gate_proj.weight``, ``layers.0.input_layernorm.weight``, ``norm.weight``,
``lm_head.weight``), with distgraph's Linear layout ``[in, out]``
(:mod:`distgraph.app.pretrained` maps them to a checkpoint's names and layout both ways).

Tensor parallelism of grouped-query attention is ``shard_tensor`` on the weights, as
Megatron splits them (:func:`megatron` does it): ``q_proj``, ``k_proj``, ``v_proj``,
``gate_proj`` and ``up_proj`` column-split (``[None, "mp"]``), ``o_proj`` and
``down_proj`` row-split (``["mp", None]``). Key/value heads split over ``mp`` when their
count divides it; when it does not, ``k_proj``/``v_proj`` stay whole and are copied to
every rank, and the layer repeats its key/value heads to the query heads before the
attention op (each rank takes the heads its query heads read).

Example::

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=172,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = Llama(config)
    logits = dg.trace(model, dg.InputSpec([2, 16], "int64", "tokens")).outputs[0]
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from distgraph import ops
from distgraph.annotation import shard_tensor
from distgraph.errors import DistGraphError
from distgraph.nn.layer import Layer, LayerList
from distgraph.nn.layers import Embedding, Linear, _constant


@dataclass(frozen=True)
class LlamaConfig:
    """The fields of transformers' ``LlamaConfig`` that define the architecture (same
    names and defaults). ``head_dim`` None: ``hidden_size // num_attention_heads``;
    ``num_key_value_heads`` None: as many as the query heads; ``sliding_window``:
    Mistral's (None: full causal attention); ``attention_bias``: biases on q, k, v (and o,
    with ``o_proj_bias``)."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    initializer_range: float = 0.02

    def __post_init__(self):
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        derived = self.head_dim is None
        if derived:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise DistGraphError(f"LlamaConfig: num_attention_heads "
                                 f"{self.num_attention_heads} is not a multiple of "
                                 f"num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            given = "" if not derived or self.hidden_size % self.num_attention_heads == 0 \
                else (f", and it is hidden_size {self.hidden_size} // "
                                  f"num_attention_heads {self.num_attention_heads}, which do "
                                  f"not divide: give a hidden_size the heads divide")
            raise DistGraphError(f"LlamaConfig: head_dim {self.head_dim} must be even "
                                 f"(rotary embedding rotates pairs of dims){given}")

    def replace(self, **changes) -> "LlamaConfig":
        return dataclasses.replace(self, **changes)


class RMSNorm(Layer):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = _constant((int(hidden_size),), 1.0)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"

    def forward(self, x):
        return ops.rms_norm(x, self.weight, self.eps)


class LlamaAttention(Layer):
    """Causal grouped-query self-attention with rotary positions on q and k: the fused
    ``attention`` op (a sequence split over a mesh dim runs it context parallel)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        c = config
        std = c.initializer_range
        self.config = c
        self.q_proj = Linear(c.hidden_size, c.num_attention_heads * c.head_dim,
                             bias=c.attention_bias, init_std=std)
        self.k_proj = Linear(c.hidden_size, c.num_key_value_heads * c.head_dim,
                             bias=c.attention_bias, init_std=std)
        self.v_proj = Linear(c.hidden_size, c.num_key_value_heads * c.head_dim,
                             bias=c.attention_bias, init_std=std)
        self.o_proj = Linear(c.num_attention_heads * c.head_dim, c.hidden_size,
                             bias=c.o_proj_bias, init_std=std)
        # the op takes fewer key/value heads (grouped-query attention); a tensor
        # parallelism their count does not divide repeats them to the query heads first
        # (megatron_attention sets it), so the query heads' split carries them
        self.repeat_kv = False

    def forward(self, x):
        c = self.config
        b, s, _ = x.shape
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim

        def heads(z, n, rotate):
            z = ops.reshape(z, [b, s, n, hd])
            if rotate:
                z = ops.rotary(z, 1, c.rope_theta, c.rope_scaling)
            return ops.transpose(z, [0, 2, 1, 3])            # [b, n, s, hd]

        q = heads(self.q_proj(x), nh, True)
        k, v = heads(self.k_proj(x), nkv, True), heads(self.v_proj(x), nkv, False)
        if self.repeat_kv:
            k, v = _repeat_kv(k, nh // nkv), _repeat_kv(v, nh // nkv)
        y = ops.attention(q, k, v, 1.0 / math.sqrt(hd), True, c.sliding_window)
        y = ops.reshape(ops.transpose(y, [0, 2, 1, 3]), [b, s, nh * hd])
        return self.o_proj(y)


def _repeat_kv(z, rep: int):
    """Each of the key/value heads of ``z`` [b, nkv, s, hd] ``rep`` times in a row."""
    if rep == 1:
        return z
    b, n, s, hd = z.shape
    z = ops.broadcast_to(ops.reshape(z, [b, n, 1, s, hd]), [b, n, rep, s, hd])
    return ops.reshape(z, [b, n * rep, s, hd])


class LlamaMLP(Layer):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        c, std = config, config.initializer_range
        self.gate_proj = Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias,
                                init_std=std)
        self.up_proj = Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias,
                              init_std=std)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias,
                                init_std=std)

    def forward(self, x):
        return self.down_proj(ops.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(Layer):
    """Pre-norm block: ``h = x + attn(norm(x))``, then ``h + mlp(norm(h))``."""

    recompute_unit = True        # Strategy(recompute=True) recomputes inside each one

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x):
        h = x + self.self_attn(self.input_layernorm(x))
        return h + self.mlp(self.post_attention_layernorm(h))

    def megatron(self, mesh, dim: str = "mp") -> None:
        """This layer's Megatron split over ``dim`` (:func:`megatron_layer`); a layer
        with another MLP (Mixtral's experts) splits its own."""
        megatron_layer(self, mesh, dim)


class Llama(Layer):
    """A LLaMA-family causal language model: token ids [batch, seq] -> logits
    [batch, seq, vocab]. Give a :class:`LlamaConfig` or its fields. A subclass (Mixtral)
    names its own ``config_class`` and ``decoder_layer``."""

    config_class = LlamaConfig
    decoder_layer = LlamaDecoderLayer

    def __init__(self, config: LlamaConfig | None = None, **fields):
        super().__init__()
        name = type(self).__name__
        if config is not None and fields:
            raise DistGraphError(f"{name}(config, **fields): give a {self.config_class.__name__}"
                                 f" or its fields, not both (config.replace(...) changes a "
                                 f"field)")
        config = config or self.config_class(**fields)
        self.config = config
        std = config.initializer_range
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, init_std=std)
        self.layers = LayerList(self.decoder_layer(config)
                                for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else \
            Linear(config.hidden_size, config.vocab_size, bias=False, init_std=std)

    def extra_repr(self) -> str:
        c = self.config
        return (f"layers={c.num_hidden_layers}, hidden={c.hidden_size}, heads="
                f"{c.num_attention_heads}, kv_heads={c.num_key_value_heads}, "
                f"vocab={c.vocab_size}" + (", tied" if c.tie_word_embeddings else ""))

    def head(self, x):
        """Final norm and LM head: the logits of hidden states ``x``."""
        x = self.norm(x)
        if self.lm_head is None:
            return ops.matmul(x, self.embed_tokens.weight, transpose_y=True)
        return self.lm_head(x)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    def megatron(self, mesh, dim: str = "mp") -> None:
        """Megatron-LM's tensor parallelism over mesh dim ``dim`` (``dg.parallelize``'s
        ``"megatron"`` plan): every decoder layer as :func:`megatron` splits it, and the
        vocabulary of ``embed_tokens`` (``[dim, None]``) and ``lm_head`` (``[None,
        dim]``; a tied head is the embedding) split over ``dim`` (Megatron's
        vocab-parallel embedding and output layer) where its size divides the vocabulary
        (else they stay whole)."""
        megatron(self, mesh, dim)
        if self.config.vocab_size % mesh.dim_size(dim) == 0:
            shard_tensor(self.embed_tokens.weight, mesh, [dim, None])
            if self.lm_head is not None:
                shard_tensor(self.lm_head.weight, mesh, [None, dim])


def megatron(model: Llama, mesh, dim: str = "mp") -> None:
    """Megatron's tensor parallelism of every decoder layer of ``model`` over mesh dim
    ``dim`` (:func:`megatron_layer`; for a Mixtral, each expert's intermediate dim:
    :func:`distgraph.nn.mixtral.megatron`)."""
    model.assign_paths()          # errors name a parameter by its path in the model
    for layer in model.layers:
        layer.megatron(mesh, dim)


def megatron_layer(layer: LlamaDecoderLayer, mesh, dim: str = "mp") -> None:
    """q, k, v, gate and up column-split over ``dim`` (their biases too), o and down
    row-split; k and v whole (copied) where the key/value heads do not divide over
    ``dim``; the norms on ``mesh``, whole."""
    megatron_attention(layer, mesh, dim)
    mlp = layer.mlp
    for linear in (mlp.gate_proj, mlp.up_proj):
        shard_tensor(linear.weight, mesh, [None, dim])
        if linear.bias is not None:
            shard_tensor(linear.bias, mesh, [dim])
    shard_tensor(mlp.down_proj.weight, mesh, [dim, None])


def megatron_attention(layer: LlamaDecoderLayer, mesh, dim: str = "mp") -> None:
    """The attention part of :func:`megatron_layer` (the norms too): what a layer with
    another MLP (Mixtral's experts) shares with Llama's."""
    attn = layer.self_attn
    kv_split = attn.config.num_key_value_heads % mesh.dim_size(dim) == 0
    attn.repeat_kv = not kv_split
    for linear in [attn.q_proj] + ([attn.k_proj, attn.v_proj] if kv_split else []):
        shard_tensor(linear.weight, mesh, [None, dim])
        if linear.bias is not None:
            shard_tensor(linear.bias, mesh, [dim])
    shard_tensor(attn.o_proj.weight, mesh, [dim, None])
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        shard_tensor(norm.weight, mesh, [None])
