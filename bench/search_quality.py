"""The double-recursive search (``Strategy(search="recursive")``) against the SCIP ILP on
random graphs: the ratio of their objectives (the same cost model: the recursive plan's
estimate over the ILP optimum's) and of their times: with problem building (the same
for both) and of the searches alone (the reports' solve seconds, CPU-bound).

``--graphs`` random programs (default 20): MLPs (2-4 layers), GPTs (``dg.nn.GPT``) and
Llamas (``dg.nn.Llama``, 1-2 blocks), small enough for the ILP, each on a cluster of
4-64 A100s, as one machine (a 1-D mesh) or as machines x 8 (a 2-D mesh: NVLink inside,
100 Gb/s across). Both searches run on the same problem (``intra_op.search``, blocks
shared as the planner shares them); SCIP gets ``--time-limit`` seconds.

Run::

    nice python bench/search_quality.py [--graphs 20] [--seed 0] [--time-limit 60]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import distgraph as dg
from distgraph.passes.search.layouts.mesh import search_mesh
from distgraph.passes.search.layouts.intra_op import search
from distgraph.program_builder import build_program
from distgraph.trace import InputSpec

A100 = {"type": "GPU", "model": "A100-SXM4-40GB", "memory": 40,
        "gflops": {"float32": 19500, "float64": 9700}}


def cluster(devices: int, per: int) -> dg.Cluster:
    """``devices`` A100s, ``per`` to a machine: NVLink inside, 12.5 GB/s between."""
    machines = devices // per
    ms = [{"id": m, "hostname": f"node{m}",
           "devices": [dict(A100, global_id=m * per + i, local_id=i) for i in range(per)],
           "links": [{"group": [m * per + i for i in range(per)], "bandwidth": 300,
                      "latency": 2}]} for m in range(machines)]
    links = [{"source": a, "target": b, "bandwidth": 12.5, "latency": 7}
             for m in range(machines) for a in range(m * per, (m + 1) * per)
             for b in range((m + 1) * per, devices)]
    return dg.Cluster.from_dict({"name": f"a100_{machines}x{per}", "machines": ms,
                                 "links": links})


class MLP(dg.nn.Layer):
    def __init__(self, width: int, depth: int):
        super().__init__()
        self.layers = dg.nn.LayerList([dg.nn.Linear(width, width) for _ in range(depth)])

    def forward(self, x):
        for k, layer in enumerate(self.layers):
            x = layer(x if k == 0 else dg.ops.relu(x))
        return x


def random_graph(rng):
    """(name, BuiltProgram) of a random MLP, GPT or Llama."""
    kind = rng.choice(["mlp", "gpt", "llama"])
    dg.seed(0)
    batch = int(rng.choice([8, 16, 64]))
    if kind == "mlp":
        width, depth = int(rng.choice([256, 1024, 4096])), int(rng.integers(2, 5))
        rows = batch * 16
        built = build_program(MLP(width, depth), [InputSpec([rows, width], name="x")],
                              [InputSpec([rows, width], name="y")], dg.nn.MSELoss(),
                              dg.optim.AdamW(1e-3))
        return f"mlp w{width} x{depth} b{rows}", built
    seq, layers = 64, int(rng.integers(1, 3))
    d = int(rng.choice([256, 512, 1024]))
    if kind == "gpt":
        model = dg.nn.GPT(vocab_size=4096, d_model=d, n_layer=layers, n_head=8,
                          max_seq_len=seq)
    else:
        model = dg.nn.Llama(vocab_size=4096, hidden_size=d, intermediate_size=int(2.75 * d),
                            num_hidden_layers=layers, num_attention_heads=8,
                            max_position_embeddings=seq)
    built = build_program(model, [InputSpec([batch, seq], "int64", "tokens")],
                          [InputSpec([batch, seq], "int64", "labels")],
                          dg.nn.CrossEntropyLoss(), dg.optim.AdamW(1e-3))
    return f"{kind} d{d} x{layers} b{batch}", built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graphs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-limit", type=float, default=60.0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    quality, speed, alone = [], [], []
    print(f"{'graph':<24} {'devices':>9} {'ILP ms':>10} {'rec ms':>10} {'ratio':>7} "
          f"{'ILP s':>7} {'rec s':>7} {'ILP sv':>7} {'rec sv':>7}  ILP status")
    for _ in range(args.graphs):
        name, built = random_graph(rng)
        devices = int(rng.choice([4, 8, 16, 32, 64]))
        per = devices if devices <= 8 or rng.random() < 0.3 else 8
        target = cluster(devices, per)
        mesh, device_of = search_mesh(built.program, target)
        found, seconds = {}, {}
        for method in ("ilp", "recursive"):
            start = time.perf_counter()
            found[method] = search(built.program, mesh, target, device_of, method=method,
                                   loss=built.loss_name, blocks=built.block_paths,
                                   time_limit=args.time_limit).report
            seconds[method] = time.perf_counter() - start
        ratio = found["recursive"].objective / found["ilp"].objective
        quality.append(ratio)
        speed.append(seconds["recursive"] / seconds["ilp"])
        alone.append(found["recursive"].solve_time / found["ilp"].solve_time)
        shape = "x".join(map(str, mesh.shape))
        print(f"{name:<24} {shape:>9} {found['ilp'].objective * 1e3:10.4f} "
              f"{found['recursive'].objective * 1e3:10.4f} {ratio:7.4f} "
              f"{seconds['ilp']:7.2f} {seconds['recursive']:7.2f} "
              f"{found['ilp'].solve_time:7.3f} {found['recursive'].solve_time:7.3f}  "
              f"{found['ilp'].status}",
              flush=True)
    quality, speed, alone = np.array(quality), np.array(speed), np.array(alone)
    print(f"\nrecursive / ILP objective over {len(quality)} graphs: median "
          f"{np.median(quality):.4f}, worst {quality.max():.4f}, within 10%: "
          f"{(quality <= 1.10).mean():.0%}")
    print(f"recursive / ILP time (problem building included): median "
          f"{np.median(speed):.3f}, worst {speed.max():.3f}")
    print(f"recursive / ILP time of the searches alone: median {np.median(alone):.3f}, "
          f"worst {alone.max():.3f}")


if __name__ == "__main__":
    main()
