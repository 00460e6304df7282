"""How long the automatic search takes on a big model, and what sharing identical blocks
costs in plan quality.

1. A 24-layer GPT (d_model 1024, 16 heads, vocab 4096, 128 tokens, batch 8; AdamW) on
   a 2 x 4 mesh of A100s (2 machines of 4, NVLink inside, 100 Gb/s between): the whole
   of ``dg.passes.plan(built, Strategy(auto_mode="full"), cluster)`` is timed, search
   included (problem building, SCIP, completion of the annotations, partition and
   estimate of the 8 processes), against the issue's 60 s.
2. On a smaller GPT (``--small-layers`` blocks, d_model 256), the search with the
   interior blocks sharing one strategy against the search without: both objectives
   (their ratio) and times.

Run::

    python bench/auto_plan_scale.py [--layers 24] [--d-model 1024] [--small-layers 6]

Timings on a shared 2-core machine are noisy; the objectives are not.
"""

from __future__ import annotations

import argparse
import time

import distgraph as dg
from distgraph.passes.search.layouts.intra_op import search
from distgraph.program_builder import build_program
from distgraph.trace import InputSpec

A100 = {"type": "GPU", "model": "A100-SXM4-40GB", "memory": 40,
        "gflops": {"float32": 19500, "float64": 9700}}


def gpu_cluster(machines: int = 2, per: int = 4) -> dg.Cluster:
    """``machines`` x ``per`` A100s: NVLink (300 GB/s, 2 us) inside a machine, 12.5 GB/s
    and 7 us between machines (gpu_2x8.yaml's figures)."""
    ms = [{"id": m, "hostname": f"node{m}",
           "devices": [dict(A100, global_id=m * per + i, local_id=i) for i in range(per)],
           "links": [{"group": [m * per + i for i in range(per)], "bandwidth": 300,
                      "latency": 2}]} for m in range(machines)]
    links = [{"source": a, "target": b, "bandwidth": 12.5, "latency": 7}
             for a in range(per) for m in range(1, machines)
             for b in range(m * per, (m + 1) * per)]
    return dg.Cluster.from_dict({"name": f"a100_{machines}x{per}", "machines": ms,
                                 "links": links})


def gpt_program(layers: int, d_model: int, heads: int = 16, vocab: int = 4096,
                seq: int = 128, batch: int = 8):
    dg.seed(0)
    model = dg.nn.GPT(vocab_size=vocab, d_model=d_model, n_layer=layers, n_head=heads,
                      max_seq_len=seq)
    return build_program(model, [InputSpec([batch, seq], "int64", "tokens")],
                         [InputSpec([batch, seq], "int64", "labels")],
                         dg.nn.CrossEntropyLoss(), dg.optim.AdamW(1e-3))


def big(args, cluster) -> None:
    start = time.perf_counter()
    built = gpt_program(args.layers, args.d_model)
    built_s = time.perf_counter() - start
    start = time.perf_counter()
    plan = dg.passes.plan(built, dg.Strategy(auto_mode="full"), cluster, ranks=())
    seconds = time.perf_counter() - start
    s = plan.search
    print(f"GPT {args.layers} layers, d_model {args.d_model}: {len(built.program.ops)} ops in "
          f"the training program (built in {built_s:.1f} s)")
    print(f"  planned in {seconds:.1f} s (target < 60 s): problem {s.build_time:.1f} s, "
          f"SCIP {s.solve_time:.1f} s ({s.status}, gap {s.gap:.3g}), completion + partition "
          f"+ estimate {seconds - s.build_time - s.solve_time:.1f} s")
    print(f"  {s.nodes} nodes, {s.free_nodes} choosing freely, {s.shared_blocks} blocks "
          f"sharing; {s.variables} variables, {s.constraints} constraints")
    print(f"  objective {s.objective * 1e3:.3f} ms; estimate {plan.estimate.step_time * 1e3:.3f} "
          f"ms per step; peak {plan.estimate.peak_memory / 1e9:.2f} GB per device")
    layer = next(x for x in s.layouts if x[0] == "blocks.5.mlp.fc1")
    print(f"  e.g. {layer[1]}: {layer[2]}")


def shared_vs_alone(args, cluster) -> None:
    built = gpt_program(args.small_layers, 256, heads=8, vocab=1024, seq=64)
    mesh = dg.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["x", "y"])
    devices = {p: p for p in range(8)}
    results = {}
    for name, blocks in (("shared", built.block_paths), ("unshared", ())):
        start = time.perf_counter()
        r = search(built.program, mesh, cluster, devices, loss=built.loss_name,
                   blocks=blocks, time_limit=args.time_limit)
        results[name] = (r.report, time.perf_counter() - start)
    shared, alone = results["shared"][0], results["unshared"][0]
    print(f"GPT {args.small_layers} layers, d_model 256, on the same mesh:")
    for name, (rep, t) in results.items():
        print(f"  {name:<8}: objective {rep.objective * 1e3:.4f} ms, {rep.status} "
              f"(gap {rep.gap:.3g}), {rep.variables} variables, {t:.1f} s")
    print(f"  shared / unshared objective = {shared.objective / alone.objective:.5f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--small-layers", type=int, default=6)
    parser.add_argument("--time-limit", type=float, default=300.0,
                        help="SCIP seconds for each search of the comparison")
    args = parser.parse_args()
    cluster = gpu_cluster()
    big(args, cluster)
    shared_vs_alone(args, cluster)


if __name__ == "__main__":
    main()
