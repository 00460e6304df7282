"""Balanced against even data-parallel splits on emulated machines of different speeds.

Run as root (the emulation makes network namespaces and CPU-quota cgroups)::

    python bench/heterogeneous.py [--steps 4] [--repeats 3] [--only 2x1|2x2] [--no-calibrate]
                                  [--batch 32]

Cases (the MLP and GPT-tiny of tests/plans.py at bench sizes, batch 32 unless ``--batch``
says otherwise: a larger batch makes the rows' compute outweigh what every process does
once per step, the update and the gradients' all-reduce, which no split shortens):

- ``2x1``: 2 machines x 1 rank, node1 half as fast (``emulated_mixed_2x1.yaml``: a CPU
  quota of half a core), links unshaped (the file's machine link raised to 10 GB/s,
  above what a veth carries): data parallel, ``Strategy(balance=True)`` against the even
  split. Targets: measured step-time ratio balanced / even <= 0.80 (ideal 0.67), and the
  estimate's predicted ratio within 15% of the measured one.
- ``2x2``: 2 machines x 2 ranks (``emulated_mixed_2x2.yaml``, links unshaped), dp x mp
  with the mp groups inside the machines: the ratio, reported.
- Predicted against measured step time of the balanced plans: median error <= 20%.

The plans are made for the emulated cluster as measured: each case first runs
``distgraph cluster calibrate --emulate`` on its file (GEMM rates sustained under the
quotas, op and reshard costs, links), and every plan, its split and its estimate use
that measured file (``--no-calibrate``: the file's own figures). The program plans every
case here first (pure: the splits and the estimate's step times), then measures each
plan on the emulated cluster (best of ``--repeats`` timings
of ``--steps`` optimizer steps, the plans taken in turn so that the machine's load hits
them alike): every process runs its share of the rows, under its machine's CPU quota.
A plan that cannot run (a PlanError on every rank before any step) is reported, its
figures left out, and the bench exits 1. It makes up no figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import distgraph as dg
from distgraph.resources.cluster import Link
from distgraph.runtime.comm.mpi import MPICommunicator
from distgraph.runtime.emulate.cgroups import require_controller
from distgraph.runtime.emulate.launch import launch_emulated
from distgraph.runtime.emulate.namespaces import check_prerequisites

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import plans as P  # noqa: E402
from bench_jobs import time_fit  # noqa: E402

CLUSTERS = os.path.join(ROOT, "resources", "clusters")
CASES = {"2x1": ("emulated_mixed_2x1.yaml", 2, "dp"),
         "2x2": ("emulated_mixed_2x2.yaml", 4, "dp_tp")}
MLP = dict(seq=16, d_in=256, hidden=1024, d_out=256)
GPT = dict(vocab_size=512, d_model=256, n_layer=2, n_head=4, max_seq_len=32)
BATCH = 32               # rows per step unless --batch
UNSHAPED_GBPS, UNSHAPED_US = 10.0, 20.0     # above a veth's rate; about its latency
RATIO_TARGET, RATIO_TOLERANCE, MEDIAN_TARGET = 0.80, 0.15, 0.20


def unshaped(path: str, folder: str) -> str:
    """The file at ``path`` with every link between machines at UNSHAPED_GBPS."""
    cluster = dg.Cluster.from_file(path)
    links = tuple(Link(ln.source, ln.target, UNSHAPED_GBPS, UNSHAPED_US, ln.type)
                  for ln in cluster.links)
    out = os.path.join(folder, f"{cluster.name}_unshaped.yaml")
    dg.Cluster(cluster.machines, links, name=f"{cluster.name}_unshaped").save(out)
    return out


def engine_for(kind: str, plan_name: str, nprocs: int, cluster, balance: bool, comm=None):
    model = P.build_model(kind, 0, MLP if kind == "mlp" else GPT)
    P.PLANS[kind, plan_name, nprocs].annotate(model)
    # process p on device p: the data-parallel groups are the machines (dp x mp: the mp
    # groups inside them), whose speeds differ
    return dg.Engine(model, P.loss_fn(kind), dg.optim.AdamW(1e-3), cluster=cluster,
                     communicator=comm, strategy=dg.Strategy(balance=balance),
                     rank_mapping={p: cluster.devices[p].global_id for p in range(nprocs)})


def data(kind: str, n: int, batch: int):
    return P.Dataset(kind, n=n, dims=MLP if kind == "mlp" else GPT, batch=batch)


def predictions(case: str, cluster_file: str, batch: int) -> list:
    """Per model: the balanced split and the predicted step times of both plans."""
    _, nprocs, plan_name = CASES[case]
    cluster = dg.Cluster.from_file(cluster_file)
    rows = []
    for kind in ("mlp", "gpt"):
        row = {"case": case, "model": kind, "plan": plan_name}
        for balance in (False, True):
            engine = engine_for(kind, plan_name, nprocs, cluster, balance)
            ins, labels = dg.app.data.DataLoader(data(kind, batch, batch), batch).specs(1)
            plan = engine.prepare(ins, labels)
            name = "balanced" if balance else "even"
            row[f"{name}_predicted"] = dg.passes.estimate(plan, cluster).step_time
            if balance:
                split = plan.batch_split
                hosts = [cluster.machine_of(cluster.devices[plan.ranks(m[0])].global_id).hostname
                         for m in split.members]
                row["rows"] = [f"{split.row_count(m[0])}@{h}" for m, h in zip(split.members,
                                                                              hosts)]
        rows.append(row)
    return rows


def calibrated(path: str, nprocs: int, folder: str) -> str:
    """The emulated cluster of ``path`` as measured on ``nprocs`` ranks."""
    out = os.path.join(folder, f"{os.path.basename(path)[:-5]}_measured.yaml")
    subprocess.run([sys.executable, "-m", "distgraph.cli", "cluster", "calibrate", "--emulate",
                    path, "-n", str(nprocs), "-o", out], check=True,
                   env=dict(os.environ, OMP_NUM_THREADS="1"))
    return out


def rank_part(args) -> None:
    """On each rank of one case: time both splits of each model; rank 0 writes rows."""
    case = args.only
    _, nprocs, plan_name = CASES[case]
    cluster = dg.Cluster.from_file(args.plan_cluster)
    comm = MPICommunicator()
    runs, rows = [], []
    for kind in ("mlp", "gpt"):
        for balance in (False, True):
            engine = engine_for(kind, plan_name, nprocs, cluster, balance, comm)
            samples = data(kind, args.batch * (args.steps + 2), args.batch)
            row = {"case": case, "model": kind, "balance": balance, "measured": float("inf")}
            try:
                time_fit(engine, samples, comm, 2, args.batch)           # warm up
                runs.append((row, engine, samples))
            except dg.PlanError as err:        # every rank refuses alike, before any step
                row["error"] = str(err)
            rows.append(row)
    for _ in range(args.repeats):
        for row, engine, samples in runs:
            row["measured"] = min(row["measured"], time_fit(engine, samples, comm,
                                                            args.steps, args.batch))
    comm.free()
    if comm.rank == 0:
        with open(args.rank_part, "w") as f:
            json.dump(rows, f)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per timing")
    parser.add_argument("--repeats", type=int, default=3, help="timings per plan (best kept)")
    parser.add_argument("--only", choices=sorted(CASES), help="run one case")
    parser.add_argument("--batch", type=int, default=BATCH, help="rows per step")
    parser.add_argument("--no-calibrate", action="store_true",
                        help="plan on the files' figures instead of measured ones")
    parser.add_argument("--rank-part", help=argparse.SUPPRESS)
    parser.add_argument("--plan-cluster", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_part:
        rank_part(args)
        return 0
    try:
        check_prerequisites()
        require_controller()
    except dg.DistGraphError as err:
        print(f"bench/heterogeneous.py: cannot emulate machines of different speeds here: "
              f"{err}", file=sys.stderr)
        return 2
    predicted, measured = [], []
    with tempfile.TemporaryDirectory(prefix="distgraph-bench-") as tmp:
        for case in ([args.only] if args.only else sorted(CASES)):
            name, nprocs, _ = CASES[case]
            path = unshaped(os.path.join(CLUSTERS, name), tmp)
            planning = path if args.no_calibrate else calibrated(path, nprocs, tmp)
            predicted += predictions(case, planning, args.batch)
            out = os.path.join(tmp, f"{case}.json")
            rc = launch_emulated(path, nprocs, [os.path.abspath(__file__), "--rank-part", out,
                                                "--plan-cluster", planning, "--only", case,
                                                "--steps", str(args.steps),
                                                "--batch", str(args.batch),
                                                "--repeats", str(args.repeats)])
            if rc != 0:
                print(f"the {case} run failed (exit code {rc})", file=sys.stderr)
                return rc
            with open(out) as f:
                measured += json.load(f)
    return report(predicted, measured)


def report(predicted: list, measured: list) -> int:
    """Print the table and the targets; 1 where a balanced plan could not run."""
    got = {(r["case"], r["model"], r["balance"]): r for r in measured}
    header = ("case", "model", "rows", "even pred", "bal pred", "pred ratio", "even meas",
              "bal meas", "meas ratio", "pred/meas ratio")
    table, errors, ratios, misses = [header], [], [], []
    for row in predicted:
        even = got[row["case"], row["model"], False]
        bal = got[row["case"], row["model"], True]
        pred_ratio = row["balanced_predicted"] / row["even_predicted"]
        cells = [row["case"], row["model"], "/".join(map(str, row["rows"])),
                 f"{row['even_predicted'] * 1e3:.1f}", f"{row['balanced_predicted'] * 1e3:.1f}",
                 f"{pred_ratio:.2f}", f"{even['measured'] * 1e3:.1f}"]
        if "error" in bal:
            misses.append(f"{row['case']} {row['model']}: {bal['error']}")
            cells += ["-", "-", "-"]
        else:
            meas_ratio = bal["measured"] / even["measured"]
            ratios.append((row["case"], row["model"], meas_ratio, pred_ratio / meas_ratio))
            errors.append(abs(row["balanced_predicted"] / bal["measured"] - 1))
            cells += [f"{bal['measured'] * 1e3:.1f}", f"{meas_ratio:.2f}",
                      f"{pred_ratio / meas_ratio:.2f}"]
        table.append(tuple(cells))
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    print("step times in ms; rows: the balanced split's rows per data-parallel group "
          "(@ the machine of its first process)")
    for r in table:
        print("  ".join(c.rjust(w) if i > 1 else c.ljust(w)
                        for i, (c, w) in enumerate(zip(r, widths))).rstrip())
    for case, model, ratio, agreement in ratios:
        if case == "2x1":
            print(f"{case} {model}: balanced / even measured {ratio:.2f} (target <= "
                  f"{RATIO_TARGET}, ideal 0.67); predicted / measured ratio {agreement:.2f} "
                  f"(target within {RATIO_TOLERANCE:.0%})")
        else:
            print(f"{case} {model}: balanced / even measured {ratio:.2f}")
    if errors:
        print(f"balanced plans, predicted against measured step: median error "
              f"{statistics.median(errors):.0%} (target <= {MEDIAN_TARGET:.0%})")
    if misses:
        print("these balanced plans could not run, so their figures are missing:",
              file=sys.stderr)
        for line in misses:
            print(f"  {line}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
