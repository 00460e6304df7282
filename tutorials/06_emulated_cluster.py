"""Tutorial 06: the same GPT on an emulated cluster as its machine link gets slower.

A resource file is normally a description that plans are scored against. With
``--emulate`` it becomes something to run on: each machine of the file is a Linux
network namespace with the machine's hostname, and the link between machines is shaped
to the file's bandwidth (root only; docs/machines.md's "Emulated clusters" says how). This
tutorial

1. measures the emulated cluster as a user would before planning for it
   (``distgraph cluster calibrate --emulate resources/clusters/emulated_2x2.yaml -n 4``:
   each rank's op costs, the links, and what a communication step costs on these ranks
   beyond its bytes), and writes copies of the file and of the measurement whose machine
   link is 10 x faster and 10 x slower (2 machines x 2 CPU ranks, 1 Gbit/s between them);
2. on each, trains the tiny GPT of tutorial 02 under two hand plans: ``dp`` (4-way data
   parallel: every gradient is all-reduced across the machine link) and ``dp x mp`` with
   the Megatron split inside each machine (only half of each gradient crosses the link,
   but every block all-reduces activations inside a machine);
3. trains the plan the auto-parallel search (``Strategy(auto_mode="full")``) picks for
   each link's measured file, and shows what it picked;
4. prints each plan's predicted and measured step: what each slower link costs each
   plan, which hand plan is faster on which link, and how the searched plan compares
   with the best. The plans take turns (a few steps each, three rounds; the median round
   counts), so that a load that comes and goes on a shared machine falls on all of them.

Why calibrate: the file as written prices a communication step by its bytes and the
links' latency alone. Here 4 ranks time-share the cores (2 on the reference VM), so a
step mostly waits for a descheduled neighbour, about a millisecond each time; priced at
nothing, that made the search prefer a plan of twice the steps (82 collectives against
dp x mp's 43), measured 1.2-1.35 x dp x mp's step at 10 Gbit/s. Calibrated, each step
costs what these ranks measured (per ring round: a step over 4 ranks waits 3 times).

Run it as root (about 75 s on 2 cores, nearer 3 minutes on a busy machine)::

    python tutorials/06_emulated_cluster.py
    python tutorials/06_emulated_cluster.py --steps 4 --speeds 1,0.25
    python tutorials/06_emulated_cluster.py --as-written     # price on the file, uncalibrated

The timings are wall-clock on whatever machine runs it: on a busy one they are noisy.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import distgraph as dg
from distgraph.program_builder import build_program
from distgraph.runtime.emulate.launch import launch_emulated

from counting_data import CountingSequences  # tutorials/ is on the path
from gpt_plans import megatron  # tutorial 02's annotations

HERE = os.path.dirname(os.path.abspath(__file__))
CLUSTER = os.path.join(os.path.dirname(HERE), "resources", "clusters", "emulated_2x2.yaml")
GPT = dict(vocab_size=256, d_model=256, n_layer=2, n_head=4, max_seq_len=16)
BATCH = 8
ROUNDS = 3        # the plans take turns: ROUNDS rounds of a few steps each


def hand_plans():
    """name -> (a fresh model, the mesh its batch is split over): annotated for the hand
    plans, plain for the one the search chooses ("searched", no mesh). Ranks 0, 1 are on
    node0 and 2, 3 on node1, so the rows of the 2 x 2 mesh (its ``mp`` groups) are the
    machines."""
    dp = dg.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    grid = dg.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])

    def dp_x_mp():
        model = dg.nn.GPT(**GPT)
        megatron(model, grid)
        return model, grid

    return {"dp": lambda: (dg.nn.GPT(**GPT), dp), "dp x mp": dp_x_mp,
            "searched": lambda: (dg.nn.GPT(**GPT), None)}


def searched_plan(cluster):
    """What the auto-parallel search (``Strategy(auto_mode="full")``) picks for the plain
    GPT on ``cluster``: the layouts of the first block's weights, and its prediction."""
    dg.seed(0)
    data = CountingSequences(BATCH, GPT["max_seq_len"], GPT["vocab_size"])
    built = build_program(dg.nn.GPT(**GPT), *dg.app.data.DataLoader(data, BATCH).specs(1),
                          dg.nn.CrossEntropyLoss(), dg.optim.AdamW(3e-3), "train")
    plan = dg.passes.plan(built, dg.Strategy(auto_mode="full"), cluster)
    weights = [f"{name.removeprefix('blocks.0.')} {spec}" for layer, name, spec, role
               in plan.search.layouts if role == "parameter" and name.startswith("blocks.0.")
               and name.endswith("weight") and "ln" not in name]
    return (f"on {plan.search.mesh} (x across the machines): " + ", ".join(weights),
            plan.estimate.step_time)


def rank_part(args):
    """On each rank: train every plan, taking turns (``ROUNDS`` rounds of a few steps
    each after a warm-up); rank 0 writes {plan: [predicted, measured seconds per step]},
    measured the median round. Every step ends with the global loss on every rank, so
    the ranks' clocks start and stop together."""
    cluster = dg.Cluster.from_file(args.priced_on)
    per_round = max(1, args.steps // ROUNDS)
    samples = CountingSequences(BATCH * (per_round + 2), GPT["max_seq_len"], GPT["vocab_size"])
    runs = {}
    for name, build in hand_plans().items():
        dg.seed(0)
        model, mesh = build()
        data = samples if mesh is None else dg.shard_dataloader(samples, mesh, "dp")
        strategy = dg.Strategy(auto_mode="full" if name == "searched" else "semi")
        engine = dg.Engine(model, loss=dg.nn.CrossEntropyLoss(),
                           optimizer=dg.optim.AdamW(3e-3), cluster=cluster, strategy=strategy)
        engine.fit(data, batch_size=BATCH, epochs=1, steps_per_epoch=2, verbose=0)  # warm up
        runs[name] = (engine, data, [])
    for r in range(ROUNDS):
        for name, (engine, data, times) in runs.items():
            start = time.perf_counter()
            engine.fit(data, batch_size=BATCH, epochs=2 + r, steps_per_epoch=per_round,
                       verbose=0)
            times.append((time.perf_counter() - start) / per_round)
    engine = runs["dp"][0]
    if engine.rank == 0:
        with open(args.rank_part, "w") as f:
            json.dump({name: [dg.passes.estimate(e.plan(), cluster).step_time,
                              sorted(times)[len(times) // 2]]
                       for name, (e, _, times) in runs.items()}, f)


def calibrate(folder):
    """``distgraph cluster calibrate --emulate`` of :data:`CLUSTER` on its 4 ranks, as a
    user runs it; returns the measured file's path."""
    out = os.path.join(folder, "calibrated.yaml")
    print(f"== measuring the emulated cluster: distgraph cluster calibrate --emulate "
          f"{os.path.relpath(CLUSTER)} -n 4", flush=True)
    done = subprocess.run([sys.executable, "-m", "distgraph.cli", "cluster", "calibrate",
                           "--emulate", CLUSTER, "-n", "4", "-o", out],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        sys.exit(f"calibrating the emulated cluster failed (exit code {done.returncode}):\n"
                 f"{done.stdout}")
    steps = [ln for ln in done.stdout.splitlines() if "reshard steps through" in ln]
    print("   " + (steps[0].removeprefix("calibrate: ") if steps else "measured"), flush=True)
    return out


def scaled_copy(path, factor, folder, prefix=""):
    """``path`` with the bandwidth of every link between machines times ``factor``,
    saved in ``folder``; returns the new file's path (``path`` itself for factor 1)."""
    if factor == 1:
        return path
    data = dg.Cluster.from_file(path).to_dict()
    for link in data.get("links", []):
        link["bandwidth"] = link["bandwidth"] * factor
    data["name"] = f"{data['name']}_x{factor:g}"
    out = os.path.join(folder, f"{prefix}x{factor:g}.yaml")
    dg.Cluster.from_dict(data).save(out)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per plan")
    parser.add_argument("--speeds", default="10,1,0.1",
                        help="machine-link bandwidths to run, as factors of the file's")
    parser.add_argument("--as-written", action="store_true",
                        help="plan and price on the file as written, not calibrated")
    parser.add_argument("--rank-part", help=argparse.SUPPRESS)
    parser.add_argument("--priced-on", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_part:
        return rank_part(args)

    results, picks = {}, {}
    with tempfile.TemporaryDirectory(prefix="tutorial06-") as tmp:
        priced = CLUSTER if args.as_written else calibrate(tmp)
        for factor in sorted({float(f) for f in args.speeds.split(",")}, reverse=True):
            path = scaled_copy(CLUSTER, factor, tmp)
            priced_on = scaled_copy(priced, factor, tmp, "priced-")
            label = f"{dg.Cluster.from_file(path).bandwidth(0, 2) * 8:g} Gbit/s"
            print(f"== {label} between the machines", flush=True)
            out = os.path.join(tmp, "timings.json")
            rc = launch_emulated(path, 4, [os.path.abspath(__file__), "--rank-part", out,
                                           "--priced-on", priced_on,
                                           "--steps", str(args.steps)])
            if rc != 0:
                sys.exit(f"the emulated run at {label} failed (exit code {rc})")
            with open(out) as f:
                results[label] = json.load(f)
            picks[label] = searched_plan(dg.Cluster.from_file(priced_on))[0]
            print(f"   auto-parallel search picks {picks[label]}", flush=True)

    labels = list(results)
    what = "the file as written" if args.as_written else "the calibrated file"
    print(f"\nstep time (ms): predicted on {what} / measured")
    print(" " * 24 + "".join(f"{label:>20}" for label in labels))
    for name in results[labels[0]]:
        print(f"  {name:22}" + "".join(
            f"{results[label][name][0] * 1e3:>9.1f} /{results[label][name][1] * 1e3:>8.1f}"
            for label in labels))
    for label in labels:
        hand = {k: v[1] for k, v in results[label].items() if k != "searched"}
        best = min(hand, key=hand.get)
        other = max(hand, key=hand.get)
        print(f"at {label}: {best} is the faster hand plan "
              f"({hand[best] / hand[other]:.2f} x {other}'s step); the searched plan takes "
              f"{results[label]['searched'][1] / hand[best]:.2f} x its step")
    print(f"\nThe predictions price {what} ({os.cpu_count()} core(s) here for 4 ranks); "
          "what they are for is the plans' order.")


if __name__ == "__main__":
    main()
