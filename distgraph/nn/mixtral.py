"""Mixtral: the LLaMA architecture (:mod:`distgraph.nn.llama`: attention, norms, rotary
positions) with a sparse mixture-of-experts block in place of the MLP, configured as
transformers' ``MixtralConfig`` is (the same field names).

The block (:class:`MixtralSparseMoeBlock`): a router (a Linear to one logit per expert,
softmax, the top ``num_experts_per_tok``, their probabilities renormalised to sum to 1)
and experts that are SwiGLU MLPs whose weights are stacked with the expert as dim 0:
``mlp.experts.gate_proj`` and ``up_proj`` [E, hidden, intermediate], ``down_proj``
[E, intermediate, hidden] (``[in, out]`` per expert, as distgraph's Linear). The experts
run in one op, :func:`distgraph.ops.moe_ffn`, on the tokens routed to each.

Routing is dropless (Mixtral's results exactly) unless ``capacity_factor`` is set: then
each sequence gives each expert at most ``ceil(capacity_factor * seq * k / E)`` tokens,
GShard's fixed-capacity dispatch with its dropped assignments (the op's docstring says
which are dropped and what a dropped one gives).

``output_router_logits=True`` adds the router's load-balancing loss times
``router_aux_loss_coef`` to the training loss (``Mixtral.auxiliary_loss``, which
``build_program`` adds), as transformers' ``MixtralForCausalLM`` does: over all layers'
tokens, ``E * sum_e f_e P_e`` with ``f_e`` the share of top-k assignments expert e gets
and ``P_e`` its mean router probability.

**With micro-batches** (``Strategy(micro_batches=M)``: a pipeline or gradient
accumulation) the loss is computed per micro-batch, over that micro-batch's tokens, and
averaged over the M micro-batches, as Megatron-LM and DeepSpeed-MoE compute it (their
router runs on one micro-batch at a time and adds its loss to that micro-batch's). It is
not the whole batch's loss: ``f_e P_e`` is a product of two sums over the tokens, so the
whole batch's value would need every micro-batch's statistics before any backward could
start, which is the very thing a pipeline avoids; and it is the loss the frameworks
people port their Mixtral training from optimise. The micro-batches are the batch's
consecutive rows, as the accumulation splits it (micro-batch m: rows [m B/M, (m+1) B/M)),
so a serial run with ``auxiliary_loss(micro_batches=M)`` computes the same loss, and M =
1 is transformers' loss. The layers' statistics are kept per row ([batch, E]) until the
loss groups them.

Expert parallelism is ``shard_tensor`` of the stacked weights on their expert dim
(:func:`expert_parallel`); tensor parallelism splits each expert's intermediate dim and
the attention as Megatron does (:func:`megatron`).

Example::

    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                           num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=8)
    model = Mixtral(config)
    expert_parallel(model, dg.ProcessMesh([0, 1], ["ep"]))
"""

from __future__ import annotations

from dataclasses import dataclass

from distgraph import dtypes, ops
from distgraph.annotation import shard_tensor
from distgraph.errors import DistGraphError, ShardingError
from distgraph.nn.layer import Layer
from distgraph.nn.layers import Linear, _normal
from distgraph.nn.llama import (Llama, LlamaAttention, LlamaConfig, LlamaDecoderLayer, RMSNorm,
                                megatron_attention)
from distgraph.ops.moe import capacity_of


@dataclass(frozen=True)
class MixtralConfig(LlamaConfig):
    """LlamaConfig's fields and Mixtral's (transformers' names and defaults);
    ``capacity_factor`` is distgraph's (None: dropless routing, as Mixtral)."""

    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False
    capacity_factor: float | None = None

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.num_experts_per_tok <= self.num_local_experts:
            raise DistGraphError(f"MixtralConfig: num_experts_per_tok "
                                 f"{self.num_experts_per_tok} must be in [1, "
                                 f"num_local_experts {self.num_local_experts}]")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise DistGraphError(f"MixtralConfig: capacity_factor {self.capacity_factor} must "
                                 f"be > 0 (None: dropless)")


class MixtralExperts(Layer):
    """The experts' SwiGLU weights, stacked with the expert as dim 0."""

    experts_stacked = True       # dim 0 is the expert: dg.parallelize splits it over "ep"

    def __init__(self, config: MixtralConfig):
        super().__init__()
        c, std = config, config.initializer_range
        e, d, inner = c.num_local_experts, c.hidden_size, c.intermediate_size
        self.gate_proj = _normal((e, d, inner), std)
        self.up_proj = _normal((e, d, inner), std)
        self.down_proj = _normal((e, inner, d), std)

    def extra_repr(self) -> str:
        return ", ".join(map(str, self.gate_proj.shape))


class MixtralSparseMoeBlock(Layer):
    """Router and experts: x [b, s, hidden] -> (y, router statistics or None). The
    statistics (when the config asks for the load-balancing loss) are, per row of the
    batch ([b, E]), each expert's top-k assignments and the sum of its router
    probabilities over the row's tokens."""

    def __init__(self, config: MixtralConfig):
        super().__init__()
        self.config = config
        self.gate = Linear(config.hidden_size, config.num_local_experts, bias=False,
                           init_std=config.initializer_range)
        self.experts = MixtralExperts(config)

    def forward(self, x):
        c = self.config
        n, k = c.num_local_experts, c.num_experts_per_tok
        probs = ops.softmax(self.gate(x), axis=-1)
        top, ids = ops.top_k(probs, k)
        weights = ops.divide(top, ops.sum(top, axis=-1, keepdim=True))
        capacity = None if c.capacity_factor is None else \
            capacity_of(x.shape[1], k, n, c.capacity_factor)
        e = self.experts
        y = ops.moe_ffn(x, ids, weights, e.gate_proj, e.up_proj, e.down_proj, capacity)
        if not c.output_router_logits:
            return y, None
        # the statistics in float32 at least (under amp: bfloat16 counts stop at 256)
        wide = "float32" if dtypes.itemsize(x.dtype) < 4 else x.dtype
        counts = ops.sum(ops.one_hot(ids, n, wide), axis=(1, 2))
        probs = probs if probs.dtype == wide else ops.cast(probs, wide)
        return y, (counts, ops.sum(probs, axis=1))


class MixtralDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block with the sparse MoE block as its ``mlp``; returns the
    hidden states and the block's router statistics."""

    def __init__(self, config: MixtralConfig):
        Layer.__init__(self)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MixtralSparseMoeBlock(config)

    def forward(self, x):
        h = x + self.self_attn(self.input_layernorm(x))
        y, stats = self.mlp(self.post_attention_layernorm(h))
        return h + y, stats

    def megatron(self, mesh, dim: str = "mp") -> None:
        """Megatron's attention split over ``dim`` and each expert's intermediate dim
        split over it (gate and up column-split, down row-split); the router whole."""
        megatron_attention(self, mesh, dim)
        e = self.mlp.experts
        shard_tensor(e.gate_proj, mesh, [None, None, dim])
        shard_tensor(e.up_proj, mesh, [None, None, dim])
        shard_tensor(e.down_proj, mesh, [None, dim, None])
        shard_tensor(self.mlp.gate.weight, mesh, [None, None])


class Mixtral(Llama):
    """A Mixtral causal language model: token ids [batch, seq] -> logits [batch, seq,
    vocab]; ``auxiliary_loss(micro_batches)`` is the router's weighted load-balancing
    loss of the last traced forward (None unless ``output_router_logits``)."""

    config_class = MixtralConfig
    decoder_layer = MixtralDecoderLayer

    def extra_repr(self) -> str:
        c = self.config
        return (super().extra_repr() + f", experts={c.num_local_experts}, "
                f"top_k={c.num_experts_per_tok}"
                + (f", capacity_factor={c.capacity_factor}" if c.capacity_factor else ""))

    def forward(self, ids):
        x = self.embed_tokens(ids)
        stats = []
        for layer in self.layers:
            x, s = layer(x)
            stats.append(s)
        object.__setattr__(self, "_stats", (stats, tuple(ids.shape)))
        return self.head(x)

    def auxiliary_loss(self, micro_batches: int | None = 1):
        """The load-balancing loss times ``router_aux_loss_coef`` of the last traced
        forward, each of ``micro_batches`` consecutive parts of the batch its own and
        their mean (module docstring); None unless ``output_router_logits``."""
        stats, shape = getattr(self, "_stats", ((), None))
        if not self.config.output_router_logits or not stats:
            return None
        batch, seq = shape[:2]
        m = micro_batches
        if m is None:
            raise DistGraphError("Mixtral's load-balancing loss is computed per micro-batch: "
                                 "give Strategy(micro_batches=M) (the search cannot choose "
                                 "M for it), or output_router_logits=False")
        if m < 1 or batch % m:
            raise DistGraphError(f"Mixtral's load-balancing loss per micro-batch: the batch "
                                 f"of {batch} rows does not split into {m} micro-batches")
        counts, probs = stats[0]
        for c, p in stats[1:]:
            counts, probs = ops.add(counts, c), ops.add(probs, p)
        n = self.config.num_local_experts
        grouped = [ops.sum(ops.reshape(v, [m, batch // m, n]), axis=1) for v in (counts, probs)]
        rows = len(stats) * batch // m * seq          # a micro-batch's tokens, all layers
        loss = ops.sum(ops.multiply(*grouped))
        return ops.scale(loss, self.config.router_aux_loss_coef * n / rows / rows / m)


def expert_parallel(model: Mixtral, mesh, dim: str = "ep", inner: str | None = None) -> None:
    """Every layer's experts split over mesh dim ``dim`` on their expert dim (each
    process holds ``E / size`` experts); ``inner``: each expert's intermediate dim split
    over that mesh dim too (tensor parallelism inside each expert, as :func:`megatron`
    splits it; call this after :func:`megatron`, whose annotation of the experts it
    replaces). With the batch split over ``dim`` as well, ``moe_ffn`` dispatches the
    tokens to their experts' processes with all-to-alls over ``dim``."""
    if not isinstance(model, Mixtral):
        raise ShardingError(f"expert_parallel splits a Mixtral's experts, but "
                            f"{type(model).__name__} has none; for a dense model use "
                            f"dg.nn.llama.megatron(model, mesh, dim) or a data-parallel split")
    model.assign_paths()          # errors name a parameter by its path in the model
    for layer in model.layers:
        e = layer.mlp.experts
        shard_tensor(e.gate_proj, mesh, [dim, None, inner])
        shard_tensor(e.up_proj, mesh, [dim, None, inner])
        shard_tensor(e.down_proj, mesh, [dim, inner, None])


def megatron(model: Mixtral, mesh, dim: str = "mp") -> None:
    """Megatron's attention split over ``dim`` (:func:`distgraph.nn.llama.megatron_layer`)
    and each expert's intermediate dim split over it (gate and up column-split, down
    row-split); the router whole (:meth:`MixtralDecoderLayer.megatron`;
    ``dg.nn.llama.megatron`` of a Mixtral is the same)."""
    model.assign_paths()          # errors name a parameter by its path in the model
    for layer in model.layers:
        layer.megatron(mesh, dim)
