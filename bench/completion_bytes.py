"""Planned communication per training step: what completion's choices cost in bytes.

For every plan of the plan matrix (``tests/plans.py``: MLP and GPT-tiny, DP, Megatron TP,
DP x TP, sequence split, ZeRO, two stages, on 2 and 4 processes), for GPT-tiny with
random conflicting annotations (as ``tests/test_completion.py`` builds it), and for the
conflict examples of issue #8 (small programs where two operands disagree), this builds
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
import itertools
import json
import os
import random
import sys

from distgraph.passes.completion import complete
from distgraph.passes.partition import partition, process_ids
from distgraph.passes.sharding import shard_updates

import distgraph as dg
from distgraph.program_builder import build_program

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
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
    ins, labels = dg.engine.DataLoader(P.Dataset(plan.kind), P.BATCH).specs(1)
    built = build_program(model, ins, labels, P.loss_fn(plan.kind), dg.optim.AdamW(0.01))
    program = complete(built.program)
    if plan.sharding and shard_updates(program, "dp"):
        complete(program)
    return program


def random_gpt_program(seed: int):
    """GPT-tiny with four random parameters and the input annotated at random on a 2x2
    mesh (the conflicts of tests/test_completion.py's randomly_annotated_gpt)."""
    mesh = dg.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    r = random.Random(seed)
    dg.seed(0)
    gpt = dg.nn.GPT(**P.GPT_DIMS)
    for _, p in r.sample(list(gpt.named_parameters()), 4):
        choices = [[None] * len(p.shape)]
        for d, m in itertools.product(range(len(p.shape)), ("dp", "mp")):
            choices.append([m if i == d else None for i in range(len(p.shape))])
        dg.shard_tensor(p, mesh, r.choice(choices))
    x_spec = r.choice([["dp", None], [None, None], [None, "mp"], ["mp", "dp"]])

    class Inp(dg.nn.Layer):
        def __init__(self):
            super().__init__()
            self.inner = gpt

        def forward(self, x):
            return self.inner(dg.shard_tensor(x, mesh, x_spec))

    built = build_program(Inp(), [dg.InputSpec([P.BATCH, 8], "int64", "x")],
                          [dg.InputSpec([P.BATCH, 8], "int64", "y")], dg.nn.CrossEntropyLoss(),
                          dg.optim.AdamW(1e-3))
    return complete(built.program)


# ---- the conflict examples of issue #8, as small programs --------------------------------
X4 = dg.ProcessMesh([0, 1, 2, 3], ["x"])
XY = dg.ProcessMesh([[0, 1, 2], [3, 4, 5]], ["x", "y"])


def _traced(fn, *specs):
    return complete(dg.trace(fn, *specs))


def conflict_add():
    """add: x [None, None, x] + y [x, None, None] (same shape)."""
    def f(a, b):
        return dg.ops.relu(dg.shard_tensor(a, X4, [None, None, "x"])
                           + dg.shard_tensor(b, X4, ["x", None, None]))
    return _traced(f, dg.InputSpec([8, 8, 8], name="a"), dg.InputSpec([8, 8, 8], name="b"))


def conflict_cross_entropy():
    """softmax cross-entropy: logits from a vocabulary-parallel head (class dim split
    over x, batch dims not yet known), labels split on the batch over x."""
    def f(h, w, labels):
        dg.shard_tensor(w, X4, [None, "x"])
        dg.shard_tensor(labels, X4, ["x", None])
        return dg.ops.cross_entropy(dg.ops.matmul(h, w), labels)
    return _traced(f, dg.InputSpec([8, 16, 32], name="h"), dg.InputSpec([32, 256], name="w"),
                   dg.InputSpec([8, 16], "int64", name="labels"))


def conflict_bias():
    """an annotated bias [x] added to an activation that wants x for its batch dim: the
    layer runs under shard_op with its input consumed [x, None], its weight [None, x]."""
    dg.seed(0)
    lin = dg.nn.Linear(16, 64)
    dg.shard_tensor(lin.weight, X4, [None, "x"])
    dg.shard_tensor(lin.bias, X4, ["x"])
    layer = dg.shard_op(lin, X4, in_shard_specs=[["x", None]])
    return _traced(lambda a: dg.ops.relu(layer(a)), dg.InputSpec([8, 16], name="a"))


def conflict_embedding():
    """embedding: ids [x, None], table [None, (x, y)] on a 2x3 mesh."""
    dg.seed(0)
    emb = dg.nn.Embedding(60, 24)
    dg.shard_tensor(emb.weight, XY, [None, ("x", "y")])

    def f(ids):
        return dg.ops.relu(emb(dg.shard_tensor(ids, XY, ["x", None])))
    return _traced(f, dg.InputSpec([8, 16], "int64", name="ids"))


def conflict_matmul():
    """matmul: x [None, x] transposed, y [None, (x, y)] on a 2x3 mesh."""
    def f(a, b):
        dg.shard_tensor(a, XY, [None, "x"])
        dg.shard_tensor(b, XY, [None, ("x", "y")])
        return dg.ops.relu(dg.ops.matmul(a, b, transpose_x=True))
    return _traced(f, dg.InputSpec([32, 16], name="a"), dg.InputSpec([32, 48], name="b"))


def conflict_reshape():
    """reshape: [12, 24, 36] with dim 1 split over x, to (288, 36)."""
    def f(a):
        h = dg.ops.relu(dg.shard_tensor(a, X4, [None, "x", None]))
        return dg.ops.relu(dg.ops.reshape(h, [288, 36]))
    return _traced(f, dg.InputSpec([12, 24, 36], name="a"))


CONFLICTS = {"add": conflict_add, "cross_entropy": conflict_cross_entropy,
             "bias": conflict_bias, "embedding": conflict_embedding,
             "matmul_t": conflict_matmul, "reshape": conflict_reshape}


def measure() -> dict:
    rows = {}
    for plan in P.PLANS.values():
        rows[str(plan)] = step_bytes(plan_program(plan))
    for seed in range(6):
        rows[f"gpt-random{seed}-n4"] = step_bytes(random_gpt_program(seed))
    for name, make in CONFLICTS.items():
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
