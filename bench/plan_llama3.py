"""Llama 3 405B planned at Meta's scale on the shipped 16,384-H100 file, on this machine.

The model is ``dg.nn.Llama`` with the 405B config of Meta's paper ("The Llama 3 Herd of
Models", 2024, Table 3: 126 layers, hidden 16,384, FFN 53,248, 128 heads, 8 key/value
heads, vocabulary 128,256), built under ``dg.LazyGuard`` in bfloat16 (AdamW's float32
master weights and moments: 16 bytes per parameter, sharded over ``dp`` as Meta's FSDP
shards them), every layer recomputed, a batch of 16M tokens. The cases are the paper's
Table 4 rows, each with Meta's own layout and its published model TFLOP/s per GPU:

  (a) 8,192 GPUs, sequence 8,192:   TP 8, CP 1,  PP 16, DP 64  -> 430 (43% MFU)
  (b) 16,384 GPUs, sequence 8,192:  TP 8, CP 1,  PP 16, DP 128 -> 400 (41% MFU)
  (c) 16,384 GPUs, sequence 131,072: TP 8, CP 16, PP 16, DP 8  -> 380 (38% MFU)

Meta's layout: PP stages of whole layers (interleaved: ``--virtual-stages`` chunks per
stage, default 8 — Meta's schedule interleaves virtual stages to shrink the bubble of
16 stages over 16-32 micro-batches); each stage a (dp, [cp,] tp) mesh of whole nodes with
attention and MLP split the Megatron way over ``mp`` (8 key/value heads over 8), the
embedding and the head over the vocabulary; one sequence per replica per micro-batch.
The planner gets the identity rank mapping (process p on the p-th GPU: tp inside a node,
then cp, dp and pp outward, as Meta orders them); the rank mapper's dense device x device
matrices do not scale to 16,384 GPUs (2 GB each).

The searched plan: ``Strategy(auto_mode="full", pipeline=True, search=...,
virtual_stages=V)`` on the same program unannotated, with the micro-batch count given
(``--search auto|recursive``; the stage search may interleave up to V chunks per stage),
and the same ``recompute`` and ``sharding`` as Meta's layout: the search lays parameters
and optimizer states out itself (a split of a weight over a data-parallel dim is
ZeRO-3-like), and the states of a weight it leaves whole over its data-parallel dim
(``x``, as the search names it) are sharded over that dim after it (ZeRO-1, as Meta's
FSDP shards them), which the stage search prices.

Prints per case: seconds to build and to plan, the plan, its predicted step and model
TFLOP/s per GPU against the published figure (target: Meta's layout within +-25%; the
search's plan no slower than Meta's), and the peak memory per GPU (target <= 80 GB).
Model FLOPs per step: 6 N T + 12 l d s T (N parameters, T tokens, l layers, d hidden,
s sequence: the attention scores and values, forward and backward, not halved for the
causal mask, as bench/plan_llama.py and Megatron count them), recomputation not counted.

Timings on a shared 2-core machine are noisy: CPU seconds are printed beside wall.

Run: ``python bench/plan_llama3.py [--case a|b|c|all] [--search auto|recursive|none]
[--virtual-stages V] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

import distgraph as dg

from plan_llama import lm_program          # bench/ is on the path

HERE = os.path.dirname(os.path.abspath(__file__))
H100_FILE = os.path.join(HERE, "..", "resources", "clusters", "h100_16384.yaml")
TOKENS, VOCAB = 16 * 1024 * 1024, 128256
LLAMA_405B = dict(num_hidden_layers=126, hidden_size=16384, intermediate_size=53248,
                  num_attention_heads=128, num_key_value_heads=8)
SEARCHED_DP = "x"     # the stage search's data-parallel dim (its logical meshes' first)
CASES = {      # name: GPUs, sequence, Meta's (tp, cp, pp, dp), published TFLOP/s per GPU
    "a": dict(gpus=8192, seq=8192, tp=8, cp=1, pp=16, dp=64, published=430.0),
    "b": dict(gpus=16384, seq=8192, tp=8, cp=1, pp=16, dp=128, published=400.0),
    "c": dict(gpus=16384, seq=131072, tp=8, cp=16, pp=16, dp=8, published=380.0),
}


def config(seq: int) -> dg.nn.LlamaConfig:
    return dg.nn.LlamaConfig(vocab_size=VOCAB, max_position_embeddings=seq,
                             rope_theta=500000.0, **LLAMA_405B)


def lazy_llama(c: dg.nn.LlamaConfig):
    dg.set_default_dtype("bfloat16")
    with dg.LazyGuard():
        return dg.nn.Llama(c)


def meta_layout(model, case: dict):
    """Annotate ``model`` with Meta's (tp, cp, pp, dp); returns the stage meshes."""
    tp, cp, pp, dp = case["tp"], case["cp"], case["pp"], case["dp"]
    dims = ["dp", "cp", "mp"] if cp > 1 else ["dp", "mp"]
    shape = (pp, dp, cp, tp) if cp > 1 else (pp, dp, tp)
    ids = np.arange(case["gpus"]).reshape(shape)
    meshes = [dg.ProcessMesh(ids[j].tolist(), dim_names=dims) for j in range(pp)]
    layers = model.config.num_hidden_layers
    per = -(-layers // pp)
    for i, layer in enumerate(model.layers):
        dg.nn.llama.megatron_layer(layer, meshes[i // per])
    dg.shard_tensor(model.embed_tokens.weight, meshes[0], ["mp", None])
    dg.shard_tensor(model.norm.weight, meshes[-1], [None])
    dg.shard_tensor(model.lm_head.weight, meshes[-1], [None, "mp"])
    return meshes, dims


def model_flops(c: dg.nn.LlamaConfig, params: int, seq: int) -> float:
    return 6.0 * params * TOKENS + 12.0 * c.num_hidden_layers * c.hidden_size * seq * TOKENS


def machine_of(cluster, gpus: int):
    """The first ``gpus`` GPUs of ``cluster`` as a cluster of their own (its node group's
    count cut: 8,192 GPUs fill two pods of 384 nodes and 256 of a third)."""
    if gpus == len(cluster.devices):
        return cluster
    data = cluster.to_dict(compact=True)
    group = data["node_groups"][0]
    per_node = len(group["devices"])
    group["count"] = gpus // per_node
    data["name"] = f"{cluster.name}_first{gpus}"
    data.pop("device_meshes", None)
    return dg.Cluster.from_dict(data)


def identity_mapping(cluster, gpus: int) -> dict:
    return {p: d.global_id for p, d in enumerate(cluster.devices[:gpus])}


def build(case: dict, annotate: bool):
    c = config(case["seq"])
    model = lazy_llama(c)
    sequences = TOKENS // case["seq"]
    meshes = dims = None
    if annotate:
        meshes, dims = meta_layout(model, case)
    spec = ("dp", "cp") if annotate and "cp" in dims else ("dp", None)
    return c, lm_program(model, sequences, case["seq"], meshes, spec)


def summarise(name, c, case, plan, cluster, build_s, plan_s, plan_cpu, how) -> dict:
    start, cpu = time.perf_counter(), time.process_time()
    est = plan.estimate or dg.passes.estimate(plan, cluster)
    plan_s += time.perf_counter() - start
    plan_cpu += time.process_time() - cpu
    params = sum(v.nbytes // 2 for v in plan.program.parameters)     # bfloat16: 2 bytes
    gpus = case["gpus"]
    tflops = model_flops(c, params, case["seq"]) / est.step_time / gpus / 1e12
    peak = max(p.peak_memory for p in est.processes) / 1e9
    return {"case": name, "how": how, "gpus": gpus, "seq": case["seq"],
            "parameters": params, "build_s": build_s, "plan_s": plan_s, "plan_cpu_s": plan_cpu,
            "step_s": est.step_time, "compute_s": est.compute,
            "communication_s": est.communication, "bubble_s": est.bubble,
            "tflops_per_gpu": tflops, "published": case["published"],
            "ratio": tflops / case["published"], "peak_gb": peak,
            "stages": len(plan.stages), "stage_shapes": sorted({m.shape for m in plan.stages}),
            "cp": sequence_split(plan)}


def sequence_split(plan) -> int:
    """How many ways the plan splits the sequence of attention (q's dim 2): its cp."""
    ways = 1
    for op in plan.program.ops:
        if op.type == "attention":
            mesh, entry = op.dist_attr.mesh, op.dist_attr.input_specs[0].entry(2)
            ways = max(ways, int(np.prod([mesh.dim_size(m) for m in entry])))
    return ways


def plan_meta(name: str, cluster, virtual: int) -> dict:
    case = CASES[name]
    start = time.perf_counter()
    c, built = build(case, annotate=True)
    build_s = time.perf_counter() - start
    sequences = TOKENS // case["seq"]
    strategy = dg.Strategy(micro_batches=sequences // case["dp"], recompute=True,
                           sharding=True, virtual_stages=virtual)
    start, cpu = time.perf_counter(), time.process_time()
    plan = dg.passes.plan(built, strategy, cluster,
                          rank_mapping=identity_mapping(cluster, case["gpus"]), ranks=())
    plan_s, plan_cpu = time.perf_counter() - start, time.process_time() - cpu
    row = summarise(name, c, case, plan, cluster, build_s, plan_s, plan_cpu, "Meta's layout")
    row["micro_batches"], row["virtual_stages"] = strategy.micro_batches, virtual
    return row


def plan_searched(name: str, cluster, search: str, micro_batches: int, virtual: int) -> dict:
    case = CASES[name]
    start = time.perf_counter()
    c, built = build(case, annotate=False)
    build_s = time.perf_counter() - start
    strategy = dg.Strategy(auto_mode="full", pipeline=True, micro_batches=micro_batches,
                           recompute=True, sharding=True, sharding_mesh_dim=SEARCHED_DP,
                           search=search, virtual_stages=virtual)
    start, cpu = time.perf_counter(), time.process_time()
    plan = dg.passes.plan(built, strategy, cluster, ranks=())
    plan_s, plan_cpu = time.perf_counter() - start, time.process_time() - cpu
    row = summarise(name, c, case, plan, cluster, build_s, plan_s, plan_cpu,
                    f"search={search!r}")
    row["micro_batches"] = micro_batches
    row["virtual_stages"] = plan.strategy.virtual_stages
    return row


def show(row: dict) -> None:
    target = abs(row["ratio"] - 1) <= 0.25
    print(f"  {row['how']}: {row['stages']} stages of {row['stage_shapes']}, cp "
          f"{row['cp']}, {row['micro_batches']} micro-batches, {row['virtual_stages']} "
          f"chunks per stage; built {row['build_s']:.1f} s, planned and "
          f"estimated {row['plan_s']:.1f} s wall, {row['plan_cpu_s']:.1f} s CPU (target "
          f"< 300 s)")
    print(f"    predicted step {row['step_s']:.2f} s (compute {row['compute_s']:.2f} + "
          f"communication {row['communication_s']:.2f} + bubble {row['bubble_s']:.2f}); "
          f"{row['tflops_per_gpu']:.0f} model TFLOP/s per GPU, published "
          f"{row['published']:.0f} (ratio {row['ratio']:.2f}: "
          f"{'within' if target else 'OUTSIDE'} +-25%); peak {row['peak_gb']:.1f} GB of 80 "
          f"({'fits' if row['peak_gb'] <= 80 else 'DOES NOT FIT'})")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=("a", "b", "c", "all"), default="all")
    parser.add_argument("--search", choices=("auto", "recursive", "none"), default="auto")
    parser.add_argument("--virtual-stages", type=int, default=8)
    parser.add_argument("--cluster", default=H100_FILE)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    cluster = dg.Cluster.from_file(args.cluster)
    print(f"{cluster.name}: {len(cluster.devices)} GPUs loaded in "
          f"{time.perf_counter() - start:.1f} s")
    rows = []
    for name in ("a", "b", "c") if args.case == "all" else (args.case,):
        case = CASES[name]
        machine = machine_of(cluster, case["gpus"])
        print(f"({name}) Llama 3 405B on {case['gpus']} GPUs, sequence {case['seq']}, "
              f"Meta's TP {case['tp']} CP {case['cp']} PP {case['pp']} DP {case['dp']}")
        meta = plan_meta(name, machine, args.virtual_stages)
        show(meta)
        rows.append(meta)
        if args.search != "none":
            found = plan_searched(name, machine, args.search, meta["micro_batches"],
                                  args.virtual_stages)
            show(found)
            print(f"    searched / Meta's predicted TFLOP/s: "
                  f"{found['tflops_per_gpu'] / meta['tflops_per_gpu']:.2f} "
                  f"(target >= 1.00)" + (f"; searched cp {found['cp']} (target > 1)"
                                         if case["cp"] > 1 else ""))
            rows.append(found)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
