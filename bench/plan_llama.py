"""Llama 3 70B and 405B planned for the shipped 1,024-A100 file, lazily, on this machine.

The models are ``dg.nn.Llama`` with the configs of Meta's paper ("The Llama 3 Herd of
Models", 2024, Table 3): 70B — 80 layers, hidden 8192, FFN 28,672, 64 heads, 8 key/value
heads; 405B — 126 layers, hidden 16,384, FFN 53,248, 128 heads, 8 key/value heads; both
vocabulary 128,256, RoPE theta 500,000, sequence 8192. Built under ``dg.LazyGuard`` in
bfloat16 (the optimizer keeps float32 master weights and moments: 16 bytes per
parameter), the batch 16M tokens (2,048 sequences) as in the paper, every layer
recomputed. The layout is Megatron's (t, p) (``--t``, ``--p``; default t 8 and p 4 for
70B, p 16 for 405B; dp = 1024 / (t p)): p stages of whole layers, each a (dp, t) mesh of
whole machines, attention and MLP split the Megatron way over ``mp`` (key/value heads
too: 8 divide t = 8), the embedding and the head split over the vocabulary; one
sequence per data-parallel replica per micro-batch; the updates and optimizer states
sharded over ``dp`` (ZeRO, as Llama 3's training shards them; ``--no-zero`` keeps them
whole).

Prints per model: the seconds to build and to plan, the plan (t, p, dp, micro-batches),
its predicted step time and model TFLOP/s per GPU, and the estimated peak memory per GPU
against its 80 GB. Model FLOPs per step: 6 N T + 12 l d s T (N parameters, T tokens, l
layers, d hidden, s sequence: the attention scores and values, forward and backward,
not halved for the causal mask), recomputation not counted.

Run: ``python bench/plan_llama.py [--model 70B|405B|both] [--t T] [--p P] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import distgraph as dg
from distgraph.program_builder import build_program

HERE = os.path.dirname(os.path.abspath(__file__))
A100_FILE = os.path.join(HERE, "..", "resources", "clusters", "dgx_a100_1024.yaml")
SEQ, VOCAB, BATCH = 8192, 128256, 2048
MODELS = {
    "70B": dict(num_hidden_layers=80, hidden_size=8192, intermediate_size=28672,
                num_attention_heads=64, num_key_value_heads=8, p=4),
    "405B": dict(num_hidden_layers=126, hidden_size=16384, intermediate_size=53248,
                 num_attention_heads=128, num_key_value_heads=8, p=16),
}


def lm_program(model, batch: int, seq: int, meshes=None, spec=("dp", None)):
    """The training program of a language model on [batch, seq] tokens (cross-entropy,
    AdamW); with ``meshes``, the tokens annotated ``spec`` on the first mesh and the labels
    on the last."""
    tokens = dg.InputSpec([batch, seq], "int64", "tokens")
    labels = dg.InputSpec([batch, seq], "int64", "labels")
    built = build_program(model, [tokens], [labels], dg.nn.CrossEntropyLoss(),
                          dg.optim.AdamW(1e-4))
    for name, mesh in (("tokens", meshes[0]), ("labels", meshes[-1])) if meshes else ():
        built.program.values[name].annotation = dg.DistAttr(mesh, dg.ShardSpec(list(spec)))
    return built


def config(name: str) -> dg.nn.LlamaConfig:
    fields = {k: v for k, v in MODELS[name].items() if k != "p"}
    return dg.nn.LlamaConfig(vocab_size=VOCAB, max_position_embeddings=SEQ,
                             rope_theta=500000.0, **fields)


def megatron_llama(c: dg.nn.LlamaConfig, t: int, p: int, gpus: int):
    """A lazy bfloat16 Llama annotated with Megatron's (t, p) (module docstring)."""
    import numpy as np

    dp = gpus // (t * p)
    ids = np.arange(gpus).reshape(p, dp, t)
    meshes = [dg.ProcessMesh(ids[j].tolist(), dim_names=["dp", "mp"]) for j in range(p)]
    dg.set_default_dtype("bfloat16")
    with dg.LazyGuard():
        model = dg.nn.Llama(c)
    per = -(-c.num_hidden_layers // p)
    for i, layer in enumerate(model.layers):
        dg.nn.llama.megatron_layer(layer, meshes[i // per])
    dg.shard_tensor(model.embed_tokens.weight, meshes[0], ["mp", None])
    dg.shard_tensor(model.norm.weight, meshes[-1], [None])
    dg.shard_tensor(model.lm_head.weight, meshes[-1], [None, "mp"])
    return model, meshes, dp


def model_flops(c: dg.nn.LlamaConfig, params: int, tokens: int) -> float:
    return 6.0 * params * tokens + 12.0 * c.num_hidden_layers * c.hidden_size * SEQ * tokens


def plan_one(name: str, cluster, t: int, p: int, zero: bool = True) -> dict:
    c = config(name)
    gpus = len(cluster.devices)
    start = time.perf_counter()
    model, meshes, dp = megatron_llama(c, t, p, gpus)
    built = lm_program(model, BATCH, SEQ, meshes)
    built_s = time.perf_counter() - start
    strategy = dg.Strategy(micro_batches=BATCH // dp, recompute=True, sharding=zero)
    start = time.perf_counter()
    plan = dg.passes.plan(built, strategy, cluster, ranks=())     # planned, not run
    plan_s = time.perf_counter() - start
    est = plan.estimate or dg.passes.estimate(plan, cluster)
    params = sum(v.nbytes // 2 for v in plan.program.parameters)    # bfloat16: 2 bytes
    flops = model_flops(c, params, BATCH * SEQ)
    peak = max(pr.peak_memory for pr in est.processes) / 1e9
    return {"model": name, "gpus": gpus, "t": t, "p": p, "dp": dp, "zero": zero,
            "micro_batches": strategy.micro_batches, "parameters": params,
            "build_s": built_s, "plan_s": plan_s, "step_s": est.step_time,
            "tflops_per_gpu": flops / est.step_time / gpus / 1e12, "peak_gb": peak,
            "device_gb": min(d.memory for d in cluster.devices)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("70B", "405B", "both"), default="both")
    parser.add_argument("--t", type=int, default=8)
    parser.add_argument("--p", type=int, help="default: 4 for 70B, 16 for 405B")
    parser.add_argument("--cluster", default=A100_FILE)
    parser.add_argument("--no-zero", action="store_true",
                        help="keep every optimizer state whole on its data-parallel replicas")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    cluster = dg.Cluster.from_file(args.cluster)
    rows = []
    for name in (("70B", "405B") if args.model == "both" else (args.model,)):
        row = plan_one(name, cluster, args.t, args.p or MODELS[name]["p"], not args.no_zero)
        rows.append(row)
        print(f"Llama 3 {name} ({row['parameters'] / 1e9:.1f}B parameters) on {row['gpus']} "
              f"A100s: t {row['t']}, p {row['p']}, dp {row['dp']}"
              f"{' (optimizer states sharded over dp)' if row['zero'] else ''}, "
              f"{row['micro_batches']} "
              f"micro-batches of one sequence per replica; built in {row['build_s']:.1f} s, "
              f"planned in {row['plan_s']:.1f} s")
        print(f"  predicted step {row['step_s']:.1f} s, {row['tflops_per_gpu']:.0f} model "
              f"TFLOP/s per GPU; peak memory {row['peak_gb']:.1f} GB of {row['device_gb']:.0f} "
              f"GB per GPU ({'fits' if row['peak_gb'] <= row['device_gb'] else 'DOES NOT FIT'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
