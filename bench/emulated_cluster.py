"""Plans measured on an emulated 2 x 2 cluster against the cost model's prediction.

Run as root (the emulation makes network namespaces)::

    python bench/emulated_cluster.py [--cluster resources/clusters/emulated_2x2.yaml]

The MLP and GPT-tiny of tests/plans.py (at bench sizes) train under data parallel (dp),
Megatron tensor parallel (mp) and a 2 x 2 dp x mp mesh placed both ways: mp groups inside
the machines and dp across them, or mp across the machines. The program runs every plan
twice on 4 ranks: on the emulated cluster (``launch_emulated``), and as a reference on
this machine's shared memory (``launch`` with the same file, so the same plans and
placements). It prints per plan the step time the alpha-beta cost model predicts from
the file (and its communication part), both measured step times (best of ``--repeats``
timings of ``--steps`` optimizer steps) and their difference, the cost of the emulated
links; whether the predicted and measured orders of the plans agree, for whole steps and
for communication; and which dp x mp placement the rank mapper (passes/rank_mapping.py)
picks against the measured faster one. Timings on a shared 2-core machine are noisy, and
4 ranks share its 2 cores, which the file's per-device compute rate does not know.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

import distgraph as dg
from distgraph.passes.cost_model import COLLECTIVES, collective_time
from distgraph.passes.partition import partition
from distgraph.passes.plan_traffic import process_graph
from distgraph.passes.rank_mapping import map_ranks
from distgraph.runtime.emulate import check_prerequisites
from distgraph.runtime.emulate_launch import launch_emulated
from distgraph.runtime.launcher import launch
from distgraph.runtime.mpi_comm import MPICommunicator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import plans as P  # noqa: E402

MLP = dict(seq=16, d_in=256, hidden=1024, d_out=256)
GPT = dict(vocab_size=512, d_model=256, n_layer=2, n_head=4, max_seq_len=32)
BATCH = 32
PLACEMENTS = {"dp across machines": {0: 0, 1: 1, 2: 2, 3: 3},
              "mp across machines": {0: 0, 1: 2, 2: 1, 3: 3}}


class BenchMLP(P.PlanMLP):
    """tests/plans.py's MLP (same hooks and forward) at bench size."""

    def __init__(self):
        dg.nn.Layer.__init__(self)
        self.fc1 = dg.nn.Linear(MLP["d_in"], MLP["hidden"])
        self.fc2 = dg.nn.Linear(MLP["hidden"], MLP["d_out"])
        self.hooks = P.Hooks()


class BenchGPT(P.PlanGPT):
    """tests/plans.py's GPT (same hooks and forward) at bench size."""

    def __init__(self):
        dg.nn.GPT.__init__(self, **GPT)
        self.hooks = P.Hooks()


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
    """(model kind, plan name, annotate, placement name, process -> device)."""
    for kind in ("mlp", "gpt"):
        yield kind, "dp", P.dp_plan(kind, 4), "-", PLACEMENTS["dp across machines"]
        yield kind, "mp", P.tp_plan(kind, 4), "-", PLACEMENTS["dp across machines"]
        for where, mapping in PLACEMENTS.items():
            yield kind, "dp x mp", P.dp_tp_plan(kind, 4), where, mapping


def _ring(cluster, devices) -> tuple[float, float]:
    """Bandwidth (GB/s) and latency (µs) of a ring over ``devices``: its slowest hop."""
    hops = [(devices[i], devices[(i + 1) % len(devices)]) for i in range(len(devices))]
    hops = [(a, b) for a, b in hops if a != b] or [(devices[0], devices[0])]
    if hops[0][0] == hops[0][1]:
        return float("inf"), 0.0
    return (min(cluster.bandwidth(a, b) for a, b in hops),
            max(cluster.latency(a, b) for a, b in hops))


def predict(program, cluster, to_device: dict) -> dict:
    """The step time the alpha-beta model gives, split {"compute", "comm", "total"} (s):
    per process, its FLOPs at its device's rate plus every collective it joins at the
    slowest hop of that collective's ring; the step is the slowest process's. A stand-in
    for ``dg.passes.estimate(plan, cluster)`` (being built): swap it in here when it
    lands."""
    graph = process_graph(program)
    dtype = dg.get_default_dtype()
    worst = _ring(cluster, sorted(set(to_device.values())))
    times = []
    for pid in sorted(to_device):
        device = cluster.device(to_device[pid])
        compute = graph.compute[pid] / device.gflops.get(dtype, min(device.gflops.values()))
        seconds = 0.0
        local = partition(program, pid)
        for point in local.points():
            for step in point.steps:
                if step.kind in COLLECTIVES:
                    group = step.mesh.group_of(pid, step.mesh_dim)
                    bw, lat = _ring(cluster, [to_device[q] for q in group])
                    seconds += collective_time(step.kind, len(group), step.buffer_bytes,
                                               bw, lat)
                elif step.kind == "send_recv":
                    for t in step.transfers:
                        if t.src == pid and t.dst != pid:
                            a, b = to_device[t.src], to_device[t.dst]
                            seconds += collective_time("send_recv", 2, t.nbytes,
                                                       cluster.bandwidth(a, b),
                                                       cluster.latency(a, b))
        # An op's internal collectives do not name their group: take the slowest ring.
        for collectives in local.op_comm.values():
            for kind, n, nbytes in collectives:
                seconds += collective_time(kind, n, nbytes, *worst)
        times.append((compute + seconds, compute, seconds))
    total, compute, comm = max(times)
    return {"total": total, "compute": compute, "comm": comm}


def time_steps(engine, data, comm, steps: int) -> float:
    comm.barrier()
    start = time.perf_counter()
    engine.fit(data, batch_size=BATCH, epochs=1, steps_per_epoch=steps)
    comm.barrier()
    return (time.perf_counter() - start) / steps


def mapper_choice(program, cluster) -> str:
    """The placement the rank mapper picks for a dp x mp program, by where it puts the
    mp group of processes 0 and 1."""
    mapping = map_ranks(process_graph(program), cluster,
                        devices=[d.global_id for d in cluster.devices[:4]])
    to_device = mapping.process_to_device
    same = cluster.machine_of(to_device[0]).id == cluster.machine_of(to_device[1]).id
    return "dp across machines" if same else "mp across machines"


def rank_part(args) -> None:
    """On each of 4 ranks: time every config; rank 0 writes the rows as JSON."""
    cluster = dg.Cluster.from_file(os.environ["DISTGRAPH_CLUSTER"])
    comm = MPICommunicator()
    if comm.size != 4:
        raise dg.PlanError(f"this benchmark runs on 4 ranks, not {comm.size}")
    rows, runs = [], []
    for kind, plan, annotate, where, mapping in configs():
        dg.seed(0)
        model = BenchMLP() if kind == "mlp" else BenchGPT()
        annotate(model)
        engine = dg.Engine(model, P.loss_fn(kind), dg.optim.AdamW(1e-3), cluster=cluster,
                           communicator=comm, rank_mapping=mapping)
        data = Data(kind, BATCH * (args.steps + 2))
        time_steps(engine, data, comm, 2)                                 # warm up
        row = {"model": kind, "plan": plan, "placement": where, "measured": float("inf")}
        if comm.rank == 0:
            program = engine.plan().program
            row.update(predict(program, cluster, mapping))
            if plan == "dp x mp":
                row["mapper"] = mapper_choice(program, cluster)
        rows.append(row)
        runs.append((engine, data))
    # Round-robin over the plans, so that a change in the machine's load hits them alike.
    for _ in range(args.repeats):
        for row, (engine, data) in zip(rows, runs):
            row["measured"] = min(row["measured"], time_steps(engine, data, comm, args.steps))
    comm.free()
    if comm.rank == 0:
        with open(args.rank_part, "w") as f:
            json.dump(rows, f)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default=os.path.join(ROOT, "resources", "clusters",
                                                          "emulated_2x2.yaml"),
                        help="a resource file with 2 machines of 2 devices")
    parser.add_argument("--steps", type=int, default=4, help="steps per timing")
    parser.add_argument("--repeats", type=int, default=3, help="timings per plan (best kept)")
    parser.add_argument("--rank-part", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_part:
        rank_part(args)
        return 0
    check_prerequisites()
    timings = {}
    with tempfile.TemporaryDirectory(prefix="distgraph-bench-") as tmp:
        for name in ("shared memory", "emulated"):
            out = os.path.join(tmp, f"{name[0]}.json")
            argv = [os.path.abspath(__file__), "--rank-part", out, "--steps", str(args.steps),
                    "--repeats", str(args.repeats)]
            if name == "emulated":
                rc = launch_emulated(args.cluster, 4, argv)
            else:
                rc = launch(4, argv, cluster=args.cluster)
            if rc != 0:
                print(f"the {name} run failed (exit code {rc})", file=sys.stderr)
                return rc
            with open(out) as f:
                timings[name] = json.load(f)
    report(dg.Cluster.from_file(args.cluster), timings["emulated"], timings["shared memory"])
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
            p, m = _order(key, pred), _order(key, meas)
            print(f"{kind} {what} times: predicted {_names(p)}; measured {_names(m)}: "
                  f"{'same order' if p == m else 'different order'}")
        two = {r["placement"]: r["measured"] for r, _ in mine if r["plan"] == "dp x mp"}
        fastest = min(two, key=two.get)
        chosen = next(r["mapper"] for r, _ in mine if r["plan"] == "dp x mp")
        print(f"{kind} dp x mp: the rank mapper places {chosen}; measured faster: {fastest} "
              f"({two[fastest] / max(two.values()):.2f} x the other's step): "
              f"{'agree' if fastest == chosen else 'disagree'}")


def _order(keys, values) -> list:
    return [k for _, k in sorted(zip(values, keys))]


def _names(keys) -> str:
    return " < ".join(plan if where == "-" else f"{plan} ({where})" for plan, where in keys)


if __name__ == "__main__":
    sys.exit(main())
