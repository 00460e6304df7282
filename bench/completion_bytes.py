"""Planned communication per training step: what completion's choices cost in bytes.

For every plan of the plan matrix (``tests/plans.py``: MLP and GPT-tiny, DP, Megatron TP,
DP x TP, sequence split, ZeRO, two stages, on 2 and 4 processes), for GPT-tiny with
random conflicting annotations, and for the conflict examples of issue #8 (small programs
where two operands disagree; both in ``tests/conflicts.py``), this builds
the program, completes it (and shards the updates where the plan says so), partitions it
for every process and prints the bytes the plan sends in one step: reshard steps plus the
collectives inside ops' distributed forms, summed over all processes
(``LocalProgram.bytes_sent``), with the number of reshard points.

``--save FILE`` writes the figures as JSON; ``--baseline FILE`` prints them beside a
saved run (another version of the code) with the ratio now / baseline.

Run: ``python bench/completion_bytes.py [--save now.json] [--baseline before.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from distgraph.passes.completion.complete import complete
from distgraph.passes.partition import partition, process_ids
from distgraph.passes.transforms.zero import shard_updates

import distgraph as dg
from distgraph.program_builder import build_program

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import conflicts as C
import plans as P


def step_bytes(program) -> tuple[float, int]:
    """(bytes all processes send in one step, reshard points) of a completed program."""
    total, points = 0.0, 0
    for pid in process_ids(program):
        local = partition(program, pid)
        total += sum(local.bytes_sent().values())
        points += len(local.points())
    return total, points


def plan_program(plan):
    model = P.build_model(plan.kind)
    plan.annotate(model)
    ins, labels = dg.app.data.DataLoader(P.Dataset(plan.kind), P.BATCH).specs(1)
    built = build_program(model, ins, labels, P.loss_fn(plan.kind), dg.optim.AdamW(0.01))
    program = complete(built.program)
    if plan.sharding and shard_updates(program, "dp"):
        complete(program)
    return program


def measure() -> dict:
    rows = {}
    for plan in P.PLANS.values():
        rows[str(plan)] = step_bytes(plan_program(plan))
    for seed in range(6):
        rows[f"gpt-random{seed}-n4"] = step_bytes(C.random_gpt_program(seed))
    for name, make in C.CONFLICTS.items():
        rows[f"conflict-{name}"] = step_bytes(make())
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--save", help="write the figures to this JSON file")
    ap.add_argument("--baseline", help="a JSON file from --save to compare with")
    args = ap.parse_args()
    rows = measure()
    base = {}
    if args.baseline:
        with open(args.baseline) as f:
            base = json.load(f)
    head = f"{'program':<24} {'points':>6} {'bytes/step':>12}"
    if base:
        head += f" {'baseline':>12} {'ratio':>7}"
    print(head)
    worse = []
    for name, (nbytes, points) in rows.items():
        line = f"{name:<24} {points:>6} {nbytes:>12.0f}"
        if name in base:
            before = base[name][0]
            ratio = nbytes / before if before else (1.0 if nbytes == 0 else float("inf"))
            line += f" {before:>12.0f} {ratio:>7.3f}"
            if nbytes > before:
                worse.append(name)
        print(line)
    if base:
        print(f"more bytes than the baseline: {', '.join(worse) or 'none'}")
    if args.save:
        with open(args.save, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
