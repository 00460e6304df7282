"""Plans measured on an emulated 2 x 2 cluster against the cost model's prediction.

Run as root (the emulation makes network namespaces)::

    python bench/emulated_cluster.py [--cluster resources/clusters/emulated_2x2.yaml]

The MLP and GPT-tiny of tests/plans.py (at bench sizes) train under data parallel (dp),
Megatron tensor parallel (mp), a 2 x 2 dp x mp mesh placed both ways (mp groups inside
the machines and dp across them, or mp across the machines), and the plan the search
chooses for the file (``Strategy(auto_mode="full")``, "auto"), whose measured step is
compared with the best hand plan's (target <= 1.10 x). The program runs every plan
twice on 4 ranks: on the emulated cluster (``launch_emulated``), and as a reference on
this machine's shared memory (``launch`` with the same file, so the same plans and
placements). It prints per plan the step time the cost model (``dg.passes.estimate``)
predicts from the file (and its communication part), both measured step times (best of ``--repeats``
timings of ``--steps`` optimizer steps) and their difference, the cost of the emulated
links; whether the predicted and measured orders of the plans agree, for whole steps and
for communication; and which dp x mp placement the rank mapper (passes/rank_mapping.py)
picks against the measured faster one. Timings on a shared 2-core machine are noisy, and
4 ranks share its 2 cores, which the file's per-device compute rate does not know.

With ``--hostfile`` it compares launch paths instead: the same plans on the same shaped
machines, once through ``--emulate`` and once through the ordinary multi-host path,
``distgraph run --hostfile`` against the machines made hosts running sshd
(:class:`~distgraph.runtime.emulate.ssh_hosts.SshHosts`), in the order emulated,
hostfile, hostfile, emulated (best of each path kept), and prints per plan the ratio of
the step times (hostfile / emulated; target 0.9-1.1: the multi-host path adds nothing
per step).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

import distgraph as dg
from distgraph.passes.mapping.traffic import traffic_graph
from distgraph.passes.mapping.rank_mapping import map_ranks
from distgraph.runtime.emulate.namespaces import check_prerequisites
from distgraph.runtime.emulate.launch import launch_emulated
from distgraph.runtime.emulate.ssh_hosts import SshHosts
from distgraph.runtime.launch.launcher import launch
from distgraph.runtime.launch.status import LOG_DIR
from distgraph.runtime.comm.mpi import MPICommunicator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import plans as P  # noqa: E402
from bench_jobs import time_fit  # noqa: E402

MLP = dict(seq=16, d_in=256, hidden=1024, d_out=256)
GPT = dict(vocab_size=512, d_model=256, n_layer=2, n_head=4, max_seq_len=32)
BATCH = 32
TIE = 0.05           # measured times closer than this are not ordered
PLACEMENTS = {"dp across machines": {0: 0, 1: 1, 2: 2, 3: 3},
              "mp across machines": {0: 0, 1: 2, 2: 1, 3: 3}}


class Data:
    def __init__(self, kind: str, n: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        if kind == "mlp":
            self.fields = [rng.normal(size=(n, MLP["seq"], MLP["d_in"])).astype(np.float32),
                           rng.normal(size=(n, MLP["seq"], MLP["d_out"])).astype(np.float32)]
        else:
            tokens = rng.integers(0, GPT["vocab_size"], size=(n, GPT["max_seq_len"] + 1))
            self.fields = [tokens[:, :-1], tokens[:, 1:]]

    def __len__(self):
        return len(self.fields[0])

    def __getitem__(self, i):
        return tuple(f[i] for f in self.fields)


def configs():
    """(model kind, plan name, annotate, placement name, process -> device); the "auto"
    plan is the search's (Strategy(auto_mode="full") for the file), placed as it chose."""
    for kind in ("mlp", "gpt"):
        yield kind, "dp", P.dp_plan(kind, 4), "-", PLACEMENTS["dp across machines"]
        yield kind, "mp", P.tp_plan(kind, 4), "-", PLACEMENTS["dp across machines"]
        for where, mapping in PLACEMENTS.items():
            yield kind, "dp x mp", P.dp_tp_plan(kind, 4), where, mapping
        yield kind, "auto", lambda model: None, "searched", None


def predict(engine, cluster) -> dict:
    """The cost model's step time of the engine's plan on ``cluster``, split {"compute",
    "comm", "total"} (seconds): ``dg.passes.estimate``, for the bottleneck process."""
    est = dg.passes.estimate(engine.plan(), cluster)
    return {"total": est.step_time, "compute": est.compute, "comm": est.communication}


def mapper_choice(program, cluster) -> str:
    """The placement the rank mapper picks for a dp x mp program, by where it puts the
    mp group of processes 0 and 1."""
    mapping = map_ranks(traffic_graph(program), cluster,
                        devices=[d.global_id for d in cluster.devices[:4]])
    to_device = mapping.process_to_device
    same = cluster.machine_of(to_device[0]).id == cluster.machine_of(to_device[1]).id
    return "dp across machines" if same else "mp across machines"


def rank_part(args) -> None:
    """On each of 4 ranks: time every config; rank 0 writes the rows as JSON into its
    log folder (which the launcher brings back from another host)."""
    cluster = dg.Cluster.from_file(os.environ["DISTGRAPH_CLUSTER"])
    comm = MPICommunicator()
    if comm.size != 4:
        raise dg.PlanError(f"this benchmark runs on 4 ranks, not {comm.size}")
    rows, runs = [], []
    for kind, plan, annotate, where, mapping in configs():
        model = P.build_model(kind, 0, MLP if kind == "mlp" else GPT)
        annotate(model)
        auto = dg.Strategy(auto_mode="full") if plan == "auto" else dg.Strategy()
        engine = dg.Engine(model, P.loss_fn(kind), dg.optim.AdamW(1e-3), cluster=cluster,
                           communicator=comm, rank_mapping=mapping, strategy=auto)
        data = Data(kind, BATCH * (args.steps + 2))
        time_fit(engine, data, comm, 2, BATCH)                             # warm up
        row = {"model": kind, "plan": plan, "placement": where, "measured": float("inf")}
        if comm.rank == 0:
            program = engine.plan().program
            row.update(predict(engine, cluster))
            if plan == "dp x mp":
                row["mapper"] = mapper_choice(program, cluster)
        rows.append(row)
        runs.append((engine, data))
    # Round-robin over the plans, so that a change in the machine's load hits them alike.
    for _ in range(args.repeats):
        for row, (engine, data) in zip(rows, runs):
            row["measured"] = min(row["measured"],
                                  time_fit(engine, data, comm, args.steps, BATCH))
    comm.free()
    if comm.rank == 0:
        with open(os.path.join(os.environ[LOG_DIR], args.rank_part), "w") as f:
            json.dump(rows, f)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default=os.path.join(ROOT, "resources", "clusters",
                                                          "emulated_2x2.yaml"),
                        help="a resource file with 2 machines of 2 devices")
    parser.add_argument("--steps", type=int, default=4, help="steps per timing")
    parser.add_argument("--repeats", type=int, default=3, help="timings per plan (best kept)")
    parser.add_argument("--hostfile", action="store_true",
                        help="compare --emulate with distgraph run --hostfile on hosts with sshd")
    parser.add_argument("--rank-part", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_part:
        rank_part(args)
        return 0
    check_prerequisites()
    if args.hostfile:
        return compare_paths(args)
    timings = {}
    with tempfile.TemporaryDirectory(prefix="distgraph-bench-") as tmp:
        for name in ("shared memory", "emulated"):
            logs = os.path.join(tmp, name[0])
            if name == "emulated":
                rc = launch_emulated(args.cluster, 4, rank_argv(args), log_dir=logs)
            else:
                rc = launch(4, rank_argv(args), cluster=args.cluster, log_dir=logs)
            if rc != 0:
                print(f"the {name} run failed (exit code {rc})", file=sys.stderr)
                return rc
            timings[name] = rows_in(logs)
    report(dg.Cluster.from_file(args.cluster), timings["emulated"], timings["shared memory"])
    return 0


def rank_argv(args) -> list[str]:
    return [os.path.abspath(__file__), "--rank-part", "rows.json", "--steps", str(args.steps),
            "--repeats", str(args.repeats)]


def rows_in(logs: str) -> list:
    with open(os.path.join(logs, "rows.json")) as f:
        return json.load(f)


def compare_paths(args) -> int:
    """The plans through --emulate and through --hostfile on hosts with sshd (see the
    module docstring)."""
    cluster = dg.Cluster.from_file(args.cluster)
    best: dict = {}
    with tempfile.TemporaryDirectory(prefix="distgraph-bench-") as tmp, \
            SshHosts(cluster, 4) as hosts:
        hostfile = hosts.hostfile()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for k, path in enumerate(("emulated", "hostfile", "hostfile", "emulated")):
            logs = os.path.join(tmp, f"{k}-{path}")
            run = [sys.executable, "-m", "distgraph.cli", "run", "-n", "4", "--log-dir", logs]
            # (a process of its own: the emulation names its namespaces after its launcher,
            # and this one holds the hosts')
            if path == "emulated":
                rc = subprocess.run([*run, "--emulate", args.cluster, *rank_argv(args)],
                                    env=env).returncode
            else:
                rc = subprocess.run(hosts.login_argv(
                    [*run, "--hostfile", hostfile, "--cluster", args.cluster,
                     *rank_argv(args)]), env={**env, **hosts.env()}).returncode
            if rc != 0:
                print(f"the {path} run failed (exit code {rc})", file=sys.stderr)
                return rc
            for row in rows_in(logs):
                key = (row["model"], row["plan"], row["placement"], path)
                best[key] = min(best.get(key, float("inf")), row["measured"])
    print(f"cluster {cluster.name!r}: step times in ms through --emulate and through "
          "--hostfile on hosts with sshd (best of two runs each)")
    print(f"{'model':5}  {'plan':7}  {'placement':18}  {'emulated':>8}  {'hostfile':>8}  ratio")
    ratios = []
    for model, plan, where, path in best:
        if path != "emulated":
            continue
        a, b = best[model, plan, where, "emulated"], best[model, plan, where, "hostfile"]
        ratios.append(b / a)
        print(f"{model:5}  {plan:7}  {where:18}  {a * 1e3:8.1f}  {b * 1e3:8.1f}  {b / a:5.2f}")
    inside = sum(0.9 <= r <= 1.1 for r in ratios)
    print(f"hostfile / emulated: {inside} of {len(ratios)} plans within 0.9-1.1 (geometric "
          f"mean {np.exp(np.mean(np.log(ratios))):.3f}); target: all")
    return 0


def report(cluster, rows, local) -> None:
    a, b = cluster.devices[0].global_id, cluster.devices[-1].global_id
    print(f"cluster {cluster.name!r}: {len(cluster.machines)} machines, between them "
          f"{cluster.bandwidth(a, b):g} GB/s and {cluster.latency(a, b):g} us (file figures); "
          "step times in ms")
    header = ("model", "plan", "placement", "predicted", "(comm)", "emulated", "shm",
              "emulated-shm")
    table = [header]
    for row, base in zip(rows, local):
        table.append((row["model"], row["plan"], row["placement"],
                      f"{row['total'] * 1e3:.1f}", f"{row['comm'] * 1e3:.1f}",
                      f"{row['measured'] * 1e3:.1f}", f"{base['measured'] * 1e3:.1f}",
                      f"{(row['measured'] - base['measured']) * 1e3:.1f}"))
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for r in table:
        print("  ".join(c.rjust(w) if i > 2 else c.ljust(w)
                        for i, (c, w) in enumerate(zip(r, widths))).rstrip())
    for kind in ("mlp", "gpt"):
        mine = [(r, base) for r, base in zip(rows, local) if r["model"] == kind]
        key = [(r["plan"], r["placement"]) for r, _ in mine]
        for what, pred, meas in (
                ("step", [r["total"] for r, _ in mine], [r["measured"] for r, _ in mine]),
                ("link", [r["comm"] for r, _ in mine],
                 [r["measured"] - b["measured"] for r, b in mine])):
            print(f"{kind} {what} times: predicted {_names(_order(key, pred))}; measured "
                  f"{_names(_order(key, meas))}; {_pairs(pred, meas)}")
        hand = {(r["plan"], r["placement"]): r["measured"] for r, _ in mine
                if r["plan"] != "auto"}
        best = min(hand, key=hand.get)
        auto = next(r["measured"] for r, _ in mine if r["plan"] == "auto")
        print(f"{kind} searched plan: {auto * 1e3:.1f} ms = {auto / hand[best]:.2f} x the "
              f"best hand plan ({_names([best])}, {hand[best] * 1e3:.1f} ms); target <= 1.10")
        two = {r["placement"]: r["measured"] for r, _ in mine if r["plan"] == "dp x mp"}
        fastest = min(two, key=two.get)
        ratio = two[fastest] / max(two.values())
        chosen = next(r["mapper"] for r, _ in mine if r["plan"] == "dp x mp")
        verdict = ("within the tie margin" if ratio > 1 - TIE else
                   "agree" if fastest == chosen else "disagree")
        print(f"{kind} dp x mp: the rank mapper places {chosen}; measured faster: {fastest} "
              f"({ratio:.2f} x the other's step): {verdict}")


def _pairs(pred, meas) -> str:
    """How many pairs of plans the prediction orders as measured; pairs measured within
    the tie margin of each other are counted apart."""
    same = ties = total = 0
    for i in range(len(pred)):
        for j in range(i + 1, len(pred)):
            if abs(meas[i] / meas[j] - 1) <= TIE:
                ties += 1
                continue
            total += 1
            same += (pred[i] < pred[j]) == (meas[i] < meas[j])
    return (f"same order for {same} of {total} pairs of plans ({ties} more measured within "
            f"{TIE:.0%} of each other)")


def _order(keys, values) -> list:
    return [k for _, k in sorted(zip(values, keys))]


def _names(keys) -> str:
    return " < ".join(plan if where == "-" else f"{plan} ({where})" for plan, where in keys)


if __name__ == "__main__":
    sys.exit(main())
