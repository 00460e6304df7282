"""Cost model against measurement: predicted and measured step times of six plans of an
MLP and of GPT-tiny on 2 real MPI ranks (serial, dp, mp, sequence split, ZeRO, two
stages), on this machine as a calibrated resource file describes it.

Prints one row per (model, plan) and two figures: the Spearman rank correlation of
predicted against measured (target >= 0.8, for each model on its own too) and the median
relative error (target <= 20%).

Run (calibrates this machine first into a temporary file, then starts 2 ranks)::

    python bench/cost_model_check.py [--cluster FILE] [--steps 20]

The plans are the plan matrix of the tests (tests/plans.py), at bench sizes. A serial
plan runs on rank 0 while rank 1 waits. Each measurement is the slowest rank's time per
step, best of three batches of ``--steps`` steps after a warm-up.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

from bench_jobs import calibrated, rows_from_ranks, write_rows

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

MODELS = {
    "mlp": (dict(seq=16, d_in=256, hidden=1024, d_out=256), 32),
    "gpt": (dict(vocab_size=128, d_model=64, n_layer=2, n_head=4, max_seq_len=32), 8),
}
PLAN_NAMES = ("serial", "dp", "tp", "sp", "zero", "two_stage")


def spearman(a, b) -> float:
    ra = np.argsort(np.argsort(a)).astype(float)
    rb = np.argsort(np.argsort(b)).astype(float)
    return float(np.corrcoef(ra, rb)[0, 1])


def measure_rank(cluster_file: str, steps: int) -> list:
    """Under MPI: every (model, plan) measured on this rank; rank 0 returns the rows."""
    from mpi4py import MPI

    import distgraph as dg
    import plans as P
    from distgraph.program_builder import build_program
    from distgraph.runtime.comm.mpi import MPICommunicator
    from distgraph.runtime.execution.runner import PlanRunner

    world = MPI.COMM_WORLD
    comm = MPICommunicator()
    cluster = dg.Cluster.from_file(cluster_file)
    rows = []
    for kind, (dims, batch) in MODELS.items():
        data = P.Dataset(kind, n=batch, dims=dims)
        feed_arrays = [np.stack([data[i][k] for i in range(batch)]) for k in range(2)]
        for name in PLAN_NAMES:
            model = P.build_model(kind, 0, dims)
            sharding = name == "zero"
            if name != "serial":
                P.PLANS[kind, "dp" if sharding else name, 2].annotate(model)
            optimizer = dg.optim.Adam(1e-3)
            ins, labels = dg.app.data.DataLoader(data, batch).specs(1)
            built = build_program(model, ins, labels, P.loss_fn(kind), optimizer)
            plan = dg.passes.plan(built, dg.Strategy(sharding=sharding), cluster=cluster)
            predicted = dg.passes.estimate(plan, cluster).step_time
            init = {n: p.numpy() for n, p in model.named_parameters()}
            init.update(optimizer.initial_state(plan.program))
            feed = dict(zip(built.feed_names, feed_arrays))
            runs = plan.distributed or world.rank == 0
            if runs:
                runner = PlanRunner(plan, comm if plan.distributed else None)
                scope = runner.shard_scope(init)

                def step(s, runner=runner, scope=scope, feed=feed):
                    runner.run(scope, feed, s)
            best = np.inf
            for batch_no in range(4):          # batch 0 warms up
                world.Barrier()
                start = time.perf_counter()
                if runs:
                    for s in range(steps):
                        step(batch_no * steps + s)
                elapsed = world.allreduce((time.perf_counter() - start) / steps, op=MPI.MAX)
                if batch_no:
                    best = min(best, elapsed)
            rows.append({"model": kind, "plan": name, "predicted": predicted, "measured": best})
    comm.free()
    return rows if world.rank == 0 else []


def report(rows) -> None:
    print(f"{'model':<5} {'plan':<10} {'predicted ms':>13} {'measured ms':>12} {'error':>7}")
    for r in rows:
        err = (r["predicted"] - r["measured"]) / r["measured"]
        print(f"{r['model']:<5} {r['plan']:<10} {r['predicted'] * 1e3:>13.3f} "
              f"{r['measured'] * 1e3:>12.3f} {err:>+7.1%}")
    pred = [r["predicted"] for r in rows]
    meas = [r["measured"] for r in rows]
    errors = [abs(p - m) / m for p, m in zip(pred, meas)]
    print(f"Spearman rank correlation {spearman(pred, meas):.3f} (target >= 0.8); "
          f"median relative error {np.median(errors):.1%} (target <= 20%)")
    for kind in MODELS:
        sub = [r for r in rows if r["model"] == kind]
        print(f"  {kind}: Spearman {spearman([r['predicted'] for r in sub], [r['measured'] for r in sub]):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", help="calibrated 2-rank resource file (default: "
                                          "calibrate now)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--calibrate-repeats", type=int, default=3,
                        help="distgraph cluster calibrate --repeats (steadier figures)")
    parser.add_argument("--rank-output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_output:                       # inside the 2-rank job
        write_rows(args.rank_output, measure_rank(args.cluster, args.steps))
        return
    with tempfile.TemporaryDirectory() as tmp:
        cluster = calibrated(2, args.cluster, tmp, args.calibrate_repeats)
        report(rows_from_ranks(2, __file__, ["--cluster", os.path.abspath(cluster),
                                             "--steps", str(args.steps)], tmp))


if __name__ == "__main__":
    main()
