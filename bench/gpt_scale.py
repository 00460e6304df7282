"""What the real-scale planning benches share: GPT models built lazily in 16 bit, the
model FLOPs Megatron-LM counts, DGX A100 clusters of any size, Megatron's own (t, p)
plan, and how a plan reads as tensor / pipeline / data parallel degrees.

A bench script run directly imports this module from its own folder (Python puts the
script's folder first on ``sys.path``).
"""

from __future__ import annotations

import copy
import math
import os

import numpy as np

import distgraph as dg
from distgraph import ops
from distgraph.program_builder import build_program
from distgraph.trace import InputSpec

HERE = os.path.dirname(os.path.abspath(__file__))
DGX_FILE = os.path.join(HERE, "..", "resources", "clusters", "dgx_a100_1024.yaml")
SEQ, VOCAB = 2048, 51200


def model_flops(batch: int, layers: int, hidden: int, seq: int = SEQ,
                vocab: int = VOCAB) -> float:
    """Narayanan et al.'s FLOPs of one step with full recomputation:
    F = 96 B s l h^2 (1 + s / (6 h) + V / (16 l h))."""
    return 96.0 * batch * seq * layers * hidden ** 2 * (
        1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


class MegatronAttention(dg.nn.MultiHeadAttention):
    """Causal self-attention with Megatron-LM's fused qkv layout: the projection's 3d
    columns hold each head's q, k and v side by side (``[b, s, h, 3 hd]``, as
    ParallelAttention splits them), so columns split over t give every process whole
    heads. The same function as ``dg.nn``'s q | k | v layout up to a permutation of
    qkv's columns."""

    def forward(self, x):
        b, t, d = x.shape
        h, hd = self.n_head, d // self.n_head
        qkv = ops.reshape(self.qkv(x), [b, t, h, 3 * hd])
        q, k, v = (ops.transpose(z, [0, 2, 1, 3]) for z in ops.split(qkv, 3, axis=-1))
        att = ops.scale(ops.matmul(q, k, transpose_y=True), 1.0 / math.sqrt(hd))
        att = ops.where(ops.causal_mask(t), att, float("-inf"))
        att = self.attn_drop(ops.softmax(att, axis=-1))
        y = ops.reshape(ops.transpose(ops.matmul(att, v), [0, 2, 1, 3]), [b, t, d])
        return self.resid_drop(self.proj(y))


class CoreAttention(dg.nn.Layer):
    """Megatron-LM's CoreAttention as a layer of its own: q k^T, scale, causal mask,
    softmax, dropout and the product with v on ``[b, h, s, hd]`` heads. Being a layer,
    its path (``blocks.{i}.attn.core``) is what selective recomputation names
    (Korthikanti et al. 2022: only these activations, which grow with s^2, are
    recomputed). ``fused``: scale, mask and softmax as Megatron's one kernel
    (``ops.scaled_masked_softmax``, FusedScaleMaskSoftmax) instead of three ops."""

    def __init__(self, dropout: float, fused: bool = False):
        super().__init__()
        self.drop = dg.nn.Dropout(dropout)
        self.fused = fused

    def forward(self, q, k, v):
        t, hd = q.shape[2], q.shape[3]
        scores = ops.matmul(q, k, transpose_y=True)
        if self.fused:
            probs = ops.scaled_masked_softmax(scores, 1.0 / math.sqrt(hd))
        else:
            att = ops.where(ops.causal_mask(t), ops.scale(scores, 1.0 / math.sqrt(hd)),
                            float("-inf"))
            probs = ops.softmax(att, axis=-1)
        return ops.matmul(self.drop(probs), v)


class CoreMegatronAttention(MegatronAttention):
    """:class:`MegatronAttention` whose attention core is the :class:`CoreAttention`
    layer ``core`` (the same function)."""

    def forward(self, x):
        b, t, d = x.shape
        h, hd = self.n_head, d // self.n_head
        qkv = ops.reshape(self.qkv(x), [b, t, h, 3 * hd])
        q, k, v = (ops.transpose(z, [0, 2, 1, 3]) for z in ops.split(qkv, 3, axis=-1))
        y = ops.reshape(ops.transpose(self.core(q, k, v), [0, 2, 1, 3]), [b, t, d])
        return self.resid_drop(self.proj(y))


def with_core(model, dropout: float = 0.1, fused: bool = False) -> list:
    """Give every block of a :class:`Megatron` model its attention core as a layer
    (:class:`CoreAttention`, its softmax ``fused`` or not); returns the cores' paths,
    what ``Strategy(recompute=paths)`` recomputes selectively."""
    for block in model.blocks:
        block.attn.core = CoreAttention(dropout, fused)
        block.attn.__class__ = CoreMegatronAttention
    return [f"blocks.{i}.attn.core" for i in range(len(model.blocks))]


class Megatron(dg.nn.GPT):
    """GPT-3 as Megatron-LM builds it (:class:`MegatronAttention`), whose tokens are split
    over the first stage's ``dp`` dim (``mesh`` None: no annotation, for the search)."""

    def __init__(self, mesh=None, **kwargs):
        super().__init__(**kwargs)
        self.mesh = mesh
        for block in self.blocks:
            block.attn.__class__ = MegatronAttention     # same parameters, Megatron's layout

    def forward(self, idx):
        if self.mesh is not None:
            dg.shard_tensor(idx, self.mesh, ["dp", None])
        return super().forward(idx)


def gpt(layers: int, hidden: int, heads: int, mesh=None, vocab: int = VOCAB):
    """A lazy bfloat16 GPT of Megatron's shape (vocabulary 51,200 unless given,
    sequence 2048, dropout 0.1)."""
    dg.set_default_dtype("bfloat16")
    with dg.LazyGuard():
        return Megatron(mesh, vocab_size=vocab, d_model=hidden, n_layer=layers,
                        n_head=heads, max_seq_len=SEQ, dropout=0.1)


def program(model, batch: int, sharding_level: int = 0):
    """The training program of ``model`` on ``batch`` sequences (AdamW; its
    ``sharding_level`` as ``dp_config`` gives it: 3 is ZeRO-3, FSDP's full sharding)."""
    optimizer = dg.optim.AdamW(1e-4)
    optimizer.sharding_level = sharding_level
    return build_program(model, [InputSpec([batch, SEQ], "int64", "tokens")],
                         [InputSpec([batch, SEQ], "int64", "labels")],
                         dg.nn.CrossEntropyLoss(), optimizer)


def dgx_cluster(nodes: int) -> dg.Cluster:
    """``nodes`` DGX A100 nodes as the shipped 1,024-GPU file describes them: its first
    node copied, each node's HCAs on the eight rail switches, the rails on one spine."""
    base = dg.Cluster.from_file(DGX_FILE).to_dict()
    node = base["machines"][0]
    gpus = len(node["devices"])
    rails = [s for s in base["switches"] if s["name"].startswith("rail")]
    spine = [s for s in base["switches"] if s["name"] == "spine"]
    nic_links = [ln for ln in base["links"] if ln["source"] in
                 {n["global_id"] for n in node["nics"]}]
    spine_links = [ln for ln in base["links"] if ln["source"] in
                   {s["global_id"] for s in rails}]
    offset_nic = nodes * gpus                       # NIC ids after the GPUs
    offset_switch = 2 * nodes * gpus                # switches after the NICs
    switch_id = {s["global_id"]: offset_switch + k for k, s in enumerate(rails + spine)}
    machines, links = [], []
    for m in range(nodes):
        dev_id = {d["global_id"]: m * gpus + i for i, d in enumerate(node["devices"])}
        nic_id = {n["global_id"]: offset_nic + m * gpus + i
                  for i, n in enumerate(node["nics"])}
        ids = {**dev_id, **nic_id}
        machine = copy.deepcopy(node)
        machine.update(id=m, hostname=f"dgx{m:04d}")
        for d in machine["devices"]:
            d["global_id"] = dev_id[d["global_id"]]
        for n in machine["nics"]:
            n["global_id"] = nic_id[n["global_id"]]
        for ln in machine["links"]:
            if "group" in ln:           # one link joining every device of the group
                ln["group"] = [ids[d] for d in ln["group"]]
            else:
                ln["source"], ln["target"] = ids[ln["source"]], ids[ln["target"]]
        machines.append(machine)
        for ln in nic_links:
            links.append(dict(ln, source=nic_id[ln["source"]],
                              target=switch_id[ln["target"]]))
    for ln in spine_links:
        links.append(dict(ln, source=switch_id[ln["source"]], target=switch_id[ln["target"]]))
    switches = [dict(s, global_id=switch_id[s["global_id"]]) for s in rails + spine]
    return dg.Cluster.from_dict({"name": f"dgx_a100_{nodes * gpus}", "figures": "published",
                                 "machines": machines,
                                 "switches": switches, "links": links})


def megatron_plan(layers, hidden, heads, t, p, gpus, batch, micro_batches, cluster,
                  recompute=True, sequence_parallel=False, sharding=False, vocab=VOCAB,
                  fused_softmax=False, overlap=True, sharding_level=0):
    """Megatron's (t, p) as annotations: p stages of layers / p blocks each (every
    parameter of a block on its stage), the embeddings on the first and the final norm
    and head on the last, each stage a (dp, t) mesh of whole machines with the blocks'
    Linear layers split the Megatron way over ``mp``, the vocabulary of the embedding and
    the LM head split over ``mp`` too; every block recomputed unless ``recompute`` is
    False, only each attention core (:func:`with_core`) where it is "selective";
    ``sequence_parallel``: Megatron-SP between the tensor-parallel regions;
    ``sharding``: optimizer states and updates split over ``dp`` (ZeRO), with
    ``sharding_level`` 3 the parameters stored split too and gathered where used (FSDP);
    ``fused_softmax``: Megatron's fused scale-mask-softmax kernel in every attention;
    ``overlap``: the gradients' reduction over dp started during the backward
    (``Strategy(overlap=...)``)."""
    dp = gpus // (t * p)
    ids = np.arange(gpus).reshape(p, dp, t)
    meshes = [dg.ProcessMesh(ids[j].tolist(), dim_names=["dp", "mp"]) for j in range(p)]
    model = gpt(layers, hidden, heads, meshes[0], vocab)
    if recompute == "selective" or fused_softmax:
        cores = with_core(model, fused=fused_softmax)
        recompute = cores if recompute == "selective" else recompute
    per = layers // p
    for i, block in enumerate(model.blocks):
        mesh = meshes[min(i // per, p - 1)]
        for first, second in ((block.attn.qkv, block.attn.proj),
                              (block.mlp.fc1, block.mlp.fc2)):
            dg.shard_tensor(first.weight, mesh, [None, "mp"])
            dg.shard_tensor(first.bias, mesh, ["mp"])
            dg.shard_tensor(second.weight, mesh, ["mp", None])
        for ln in (block.ln1, block.ln2):        # with its block, as Megatron places it
            dg.shard_tensor(ln.weight, mesh, [None])
            dg.shard_tensor(ln.bias, mesh, [None])
        dg.shard_tensor(block.attn.proj.bias, mesh, [None])
        dg.shard_tensor(block.mlp.fc2.bias, mesh, [None])
    dg.shard_tensor(model.wte.weight, meshes[0], ["mp", None])
    dg.shard_tensor(model.wpe.weight, meshes[0], [None, None])
    dg.shard_tensor(model.ln_f.weight, meshes[-1], [None])
    dg.shard_tensor(model.ln_f.bias, meshes[-1], [None])
    dg.shard_tensor(model.lm_head.weight, meshes[-1], [None, "mp"])
    built = program(model, batch, sharding_level)
    strategy = dg.Strategy(micro_batches=micro_batches, recompute=recompute,
                           sequence_parallel=sequence_parallel, sharding=sharding,
                           overlap=overlap)
    return dg.passes.plan(built, strategy, cluster, ranks=())   # planned, not run


def degrees(plan) -> dict:
    """Tensor, pipeline and data parallel degrees of a plan whose stages are 2-d meshes
    (data x tensor), with each stage's own."""
    stages = [tuple(m.shape) if len(m.shape) == 2 else (m.shape[0], 1) for m in plan.stages]
    return {"p": len(stages), "t": sorted({s[1] for s in stages}),
            "dp": sorted({s[0] for s in stages}), "stages": stages}


def throughput(plan, flops: float, gpus: int) -> float:
    """Predicted model TFLOP/s per GPU: the step's FLOPs over its estimated time."""
    return flops / plan.estimate.step_time / gpus / 1e12
