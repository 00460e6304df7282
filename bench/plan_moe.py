"""Mixture-of-experts models planned at scale, lazily, on this machine: Mixtral 8x7B on 64
A100s (the first 8 nodes of the shipped 1,024-A100 file), and a DeepSeek-V3-like 671B
MoE on 2,048 H100s.

Mixtral 8x7B is ``dg.nn.Mixtral`` with Mistral AI's published config (32 layers, hidden
4096, 8 experts of intermediate 14,336, top-2, 32 heads, 8 key/value heads, vocabulary
32,000, RoPE theta 1e6), sequence 4096, a batch of 1,024 sequences (4M tokens), built
under ``dg.LazyGuard`` in bfloat16 (AdamW keeps float32 master weights and moments),
every layer recomputed, dropless routing (the experts priced at the expected, balanced
load). The layout is given as (ep, pp, dp, tp) (``--layouts``; tp = ``t``, pp = ``p``):
``p`` stages of whole layers, each a (dp, t) mesh of consecutive GPUs (``t`` inside a
node), attention Megatron-split over ``mp`` (key/value heads too where they divide), each
expert's intermediate dim split over ``mp``, the experts split over ``dp`` (ep = dp, as
DeepSpeed-MoE and DeepSeek do: the tokens the dp dim splits are dispatched by all-to-all
over it), the router whole, the embedding and the head split over the vocabulary; one
sequence per data-parallel replica per micro-batch; the updates and optimizer states of
the weights that are whole over ``dp`` sharded over it (ZeRO-1; the experts are split
over it already). Every layout given is planned; the best predicted is reported.

Prints per model and layout: the seconds to build and to plan, (ep, pp, dp, tp), the
predicted step time (the bottleneck process's compute, communication and bubble) and
model TFLOP/s per GPU (6 N_active T + 12 l d s T: N_active the
parameters a token goes through, the router's k of E experts; T tokens), the estimated
peak memory per GPU against its 80 GB, and the planned all-to-alls of one MoE layer.

Run: ``python bench/plan_moe.py [--model mixtral|deepseek|both] [--layouts 8,4,8,2 ...]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import numpy as np

import distgraph as dg
from distgraph.annotation import shard_tensor
from distgraph.nn.llama import LlamaDecoderLayer, LlamaMLP, megatron_attention, megatron_layer
from distgraph.nn.mixtral import Mixtral, MixtralConfig, MixtralSparseMoeBlock

from gpt_scale import dgx_cluster          # bench/ is on the path
from plan_llama import lm_program

HERE = os.path.dirname(os.path.abspath(__file__))
H100_FILE = os.path.join(HERE, "..", "resources", "clusters", "h100_16384.yaml")
MODELS = {
    "mixtral": dict(config=dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                num_hidden_layers=32, num_attention_heads=32,
                                num_key_value_heads=8, num_local_experts=8,
                                num_experts_per_tok=2, rope_theta=1e6,
                                max_position_embeddings=4096),
                    seq=4096, batch=1024, nodes=8, machine="A100",
                    layouts=["8,4,8,2", "8,8,8,1", "4,4,4,4", "8,2,8,4"]),
    # DeepSeek-V3 (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, section 4.2): 61
    # layers, hidden 7168, the first 3 dense (SwiGLU 18,432), the rest 256 routed experts
    # of 2048 + 1 shared expert of 2048, top-8, vocabulary 129,280, batch 15,360 x 4096.
    # MLA (q rank 1536, kv rank 512, 128 heads of 128 + 64 rotary) has 187.1M parameters
    # a layer; standard attention of 80 heads of 128 with 20 key/value heads has 183.5M
    # (-1.9%) and stands in for it. Its router is a softmax top-k (DeepSeek's is sigmoid
    # scores with a balancing bias): the same FLOPs and layout.
    "deepseek": dict(config=dict(vocab_size=129280, hidden_size=7168, intermediate_size=2048,
                                 num_hidden_layers=61, num_attention_heads=80,
                                 num_key_value_heads=20, head_dim=128, num_local_experts=256,
                                 num_experts_per_tok=8, max_position_embeddings=4096),
                     dense_layers=3, dense_intermediate=18432, shared_intermediate=2048,
                     seq=4096, batch=15360, nodes=256, machine="H100",
                     layouts=["128,16,128,1", "64,16,64,2", "128,8,128,2", "32,16,32,4"]),
}


def h100_cluster(nodes: int) -> dg.Cluster:
    """The first ``nodes`` nodes of the shipped 16,384-H100 file (its node group's count
    cut to ``nodes``; the switches of the pods they do not reach left out)."""
    import yaml

    with open(H100_FILE) as f:
        data = yaml.safe_load(f)
    group = data["node_groups"][0]
    every = group["uplinks"][0]["every"]
    group["count"] = nodes
    pods = {f"pod{k}-" for k in range(-(-nodes // every))}
    dropped = {s["global_id"] for s in data["switches"]
               if s["name"].startswith("pod") and s["name"].split("-")[0] + "-" not in pods}
    data["switches"] = [s for s in data["switches"] if s["global_id"] not in dropped]
    data["links"] = [ln for ln in data["links"]
                     if ln["source"] not in dropped and ln["target"] not in dropped]
    data["name"] = f"h100_{nodes * len(group['devices'])}"
    return dg.Cluster.from_dict(data, source=H100_FILE)


def stage_meshes(gpus: int, t: int, p: int) -> list:
    dp = gpus // (t * p)
    ids = np.arange(gpus).reshape(p, dp, t)
    return [dg.ProcessMesh(ids[j].tolist(), dim_names=["dp", "mp"]) for j in range(p)]


def annotate_moe_layer(layer, mesh) -> None:
    """Megatron's attention over ``mp``; the experts over ``dp`` (ep) and their
    intermediate dim over ``mp``; the router whole."""
    megatron_attention(layer, mesh, "mp")
    e = layer.mlp.experts
    shard_tensor(e.gate_proj, mesh, ["dp", None, "mp"])
    shard_tensor(e.up_proj, mesh, ["dp", None, "mp"])
    shard_tensor(e.down_proj, mesh, ["dp", "mp", None])
    shard_tensor(layer.mlp.gate.weight, mesh, [None, None])


class SharedExpertMoe(MixtralSparseMoeBlock):
    """The routed experts and one shared expert every token goes through (DeepSeek's)."""

    def __init__(self, config: MixtralConfig, shared: int):
        super().__init__(config)
        self.shared = LlamaMLP(config.replace(intermediate_size=shared))

    def forward(self, x):
        y, stats = super().forward(x)
        return y + self.shared(x), stats


class DeepSeekLike(Mixtral):
    """Mixtral's layers with a shared expert beside the routed ones, the first ``dense``
    layers Llama's dense SwiGLU of ``dense_intermediate``."""

    def __init__(self, config: MixtralConfig, dense: int, dense_intermediate: int,
                 shared: int):
        super().__init__(config)
        for i, layer in enumerate(self.layers):
            if i < dense:
                self.layers[i] = LlamaDecoderLayer(
                    config.replace(intermediate_size=dense_intermediate))
            else:
                layer.mlp = SharedExpertMoe(config, shared)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            out = layer(x)
            x = out[0] if isinstance(out, tuple) else out
        return self.head(x)


def build_model(spec: dict, gpus: int, t: int, p: int):
    c = MixtralConfig(**spec["config"])
    meshes = stage_meshes(gpus, t, p)
    dg.set_default_dtype("bfloat16")
    with dg.LazyGuard():
        model = Mixtral(c) if "dense_layers" not in spec else DeepSeekLike(
            c, spec["dense_layers"], spec["dense_intermediate"], spec["shared_intermediate"])
    per = -(-c.num_hidden_layers // p)
    for i, layer in enumerate(model.layers):
        if isinstance(layer.mlp, MixtralSparseMoeBlock):
            annotate_moe_layer(layer, meshes[i // per])
            if isinstance(layer.mlp, SharedExpertMoe):
                shared = layer.mlp.shared
                shard_tensor(shared.gate_proj.weight, meshes[i // per], [None, "mp"])
                shard_tensor(shared.up_proj.weight, meshes[i // per], [None, "mp"])
                shard_tensor(shared.down_proj.weight, meshes[i // per], ["mp", None])
        else:
            megatron_layer(layer, meshes[i // per])
    shard_tensor(model.embed_tokens.weight, meshes[0], ["mp", None])
    shard_tensor(model.norm.weight, meshes[-1], [None])
    shard_tensor(model.lm_head.weight, meshes[-1], [None, "mp"])
    return c, model, meshes


def active_parameters(plan, c) -> tuple[int, int]:
    """(all parameters, those one token goes through): the experts' at k / E."""
    total = active = 0
    for v in plan.program.parameters:
        n = v.nbytes // 2                                  # bfloat16
        total += n
        active += n * c.num_experts_per_tok // c.num_local_experts \
            if ".experts." in v.name else n
    return total, active


def _group(ids: str) -> str:
    ids = [int(x) for x in ids.split(",") if x.strip()]
    return f"over {len(ids)} processes ({ids[0]}, {ids[1]}, ..., {ids[-1]})" \
        if len(ids) > 4 else f"over {tuple(ids)}"


def plan_one(name: str, cluster, ep: int, p: int, dp: int, t: int) -> dict:
    spec = MODELS[name]
    gpus = len(cluster.devices)
    if ep != dp or t * p * dp != gpus:
        raise SystemExit(f"layout ep {ep}, pp {p}, dp {dp}, tp {t}: this bench splits the "
                         f"experts over the dp dim (ep = dp) and needs tp x pp x dp = {gpus}")
    seq, batch = spec["seq"], spec["batch"]
    start = time.perf_counter()
    c, model, meshes = build_model(spec, gpus, t, p)
    built = lm_program(model, batch, seq, meshes)
    built_s = time.perf_counter() - start
    strategy = dg.Strategy(micro_batches=batch // dp, recompute=True, sharding=True)
    start = time.perf_counter()
    plan = dg.passes.plan(built, strategy, cluster, ranks=())     # planned, not run
    plan_s = time.perf_counter() - start
    est = plan.estimate or dg.passes.estimate(plan, cluster)
    total, active = active_parameters(plan, c)
    flops = 6.0 * active * batch * seq + \
        12.0 * c.num_hidden_layers * c.hidden_size * seq * batch * seq
    peak = max(pr.peak_memory for pr in est.processes) / 1e9
    moe = next(k for k, layer in enumerate(model.layers)
               if isinstance(layer.mlp, MixtralSparseMoeBlock))
    first = [re.sub(r"over \(([^)]*)\)", lambda m: _group(m.group(1)), line)
             for line in plan.op_collectives() if f"(layers.{moe}.mlp)" in line]
    return {"model": name, "gpus": gpus, "ep": ep, "pp": p, "dp": dp, "tp": t,
            "micro_batches": strategy.micro_batches, "parameters": total, "active": active,
            "build_s": built_s, "plan_s": plan_s, "step_s": est.step_time,
            "compute_s": est.compute, "communication_s": est.communication,
            "bubble_s": est.bubble,
            "tokens_per_s": batch * seq / est.step_time,
            "tflops_per_gpu": flops / est.step_time / gpus / 1e12, "peak_gb": peak,
            "device_gb": min(d.memory for d in cluster.devices), "all_to_alls": first,
            "moe_layer": moe}


def report(row: dict) -> None:
    print(f"  ep {row['ep']}, pp {row['pp']}, dp {row['dp']}, tp {row['tp']}: "
          f"{row['micro_batches']} micro-batches; built in {row['build_s']:.1f} s, planned in "
          f"{row['plan_s']:.1f} s; step {row['step_s']:.2f} s (compute "
          f"{row['compute_s']:.2f} + communication {row['communication_s']:.2f} + bubble "
          f"{row['bubble_s']:.2f}), "
          f"{row['tokens_per_s'] / 1e3:.0f}k tokens/s, {row['tflops_per_gpu']:.0f} model "
          f"TFLOP/s per GPU; peak {row['peak_gb']:.1f} GB of {row['device_gb']:.0f} "
          f"({'fits' if row['peak_gb'] <= row['device_gb'] else 'DOES NOT FIT'})")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=tuple(MODELS) + ("both",), default="mixtral")
    parser.add_argument("--layouts", nargs="+", help="ep,pp,dp,tp each (default per model)")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    rows = []
    for name in (tuple(MODELS) if args.model == "both" else (args.model,)):
        spec = MODELS[name]
        cluster = dgx_cluster(spec["nodes"]) if spec["machine"] == "A100" else \
            h100_cluster(spec["nodes"])
        print(f"{name}: {len(cluster.devices)} GPUs ({spec['nodes']} {spec['machine']} nodes), "
              f"batch {spec['batch']} x {spec['seq']} tokens, bfloat16, AdamW, recompute")
        mine = []
        for layout in args.layouts or spec["layouts"]:
            ep, p, dp, t = (int(x) for x in layout.split(","))
            row = plan_one(name, cluster, ep, p, dp, t)
            report(row)
            mine.append(row)
        fits = [r for r in mine if r["peak_gb"] <= r["device_gb"]]
        if fits:
            best = max(fits, key=lambda r: r["tflops_per_gpu"])
            print(f"  best that fits: ep {best['ep']}, pp {best['pp']}, dp {best['dp']}, tp "
                  f"{best['tp']} ({best['parameters'] / 1e9:.1f}B parameters, "
                  f"{best['active'] / 1e9:.1f}B active); layer {best['moe_layer']}'s all-to-alls:")
            for line in best["all_to_alls"]:
                print(f"    {line}")
        rows += mine
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
