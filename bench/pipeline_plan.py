"""Planning time of a pipelined GPT: ``engine.prepare`` of a 4-stage, 8-micro-batch plan
(tracing, autodiff, micro-batch split, completion, partition of every process, task
graph, schedule and its check), on one process (planning needs no job).

Run::

    python bench/pipeline_plan.py [--layers 8] [--repeats 5] [--against PYTHON]

The GPT (vocab 512, d_model 64, 4 heads, sequence 32, ``--layers`` blocks) is placed on
four one-process stages with ``shard_op``: the embedding and the first quarter of the
blocks on stage 0, a quarter of the blocks on each next stage, the head on stage 3.
It prints the median and the least wall time and CPU time (``time.process_time``, steadier
on a shared machine) of ``--repeats`` plans for each schedule (a fresh Engine each time,
so nothing is cached). ``--against PYTHON`` is the reference: the interpreter of another
checkout (one whose ``distgraph`` is installed in it) runs the same measurements in a
child process, taking turns with this one over ``--rounds`` rounds, and the ratios of
the least times are printed against the target (<= 1.2 x), judged on CPU time: planning
runs on one thread, so its CPU time is its work, while its wall time on a shared machine
also counts other jobs' turns (on a quiet one the two agree). To make one for an old
commit::

    git worktree add /tmp/old 7b2aabd
    python -m venv --without-pip /tmp/old-venv
    echo "$(python -c 'import numpy, os; print(os.path.dirname(os.path.dirname(numpy.__file__)))')" \
        > "$(/tmp/old-venv/bin/python -c 'import site; print(site.getsitepackages()[0])')/deps.pth"
    /tmp/old-venv/bin/python -m pip install -q --no-deps --no-build-isolation -e /tmp/old
    python bench/pipeline_plan.py --against /tmp/old-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

import numpy as np

import distgraph as dg


def build(layers: int):
    dg.seed(0)
    model = dg.nn.GPT(vocab_size=512, d_model=64, n_layer=layers, n_head=4, max_seq_len=32)
    meshes = [dg.ProcessMesh([p], ["dp"]) for p in range(4)]
    per = layers // 4

    def forward(idx):
        x = dg.shard_op(model.embed, meshes[0])(idx)
        for i, block in enumerate(model.blocks):
            x = dg.shard_op(block, meshes[min(i // per, 3)])(x)
        return dg.shard_op(model.head, meshes[3])(x)

    model.forward = forward
    return model


def plan_once(layers: int, strategy) -> tuple:
    """(wall seconds, CPU seconds) of one engine.prepare."""
    model = build(layers)
    engine = dg.Engine(model, dg.nn.CrossEntropyLoss(), dg.optim.AdamW(1e-3),
                       strategy=strategy)
    start, cpu = time.perf_counter(), time.process_time()
    engine.prepare([dg.InputSpec([32, 32], "int64", "tokens")],
                   [dg.InputSpec([32, 32], "int64", "labels")])
    return time.perf_counter() - start, time.process_time() - cpu


SCHEDULES = ("1F1B", "ZB")
TARGET = 1.2


def measure(layers: int, repeats: int) -> dict:
    """{schedule: [(wall, CPU) seconds of each of ``repeats`` plans]}."""
    out = {}
    for schedule in SCHEDULES:
        strategy = dg.Strategy(micro_batches=8, schedule=schedule)
        plan_once(layers, strategy)                  # warm imports and registries
        out[schedule] = [plan_once(layers, strategy) for _ in range(repeats)]
    return out


def line(name: str, times) -> str:
    wall, cpu = zip(*times)
    return (f"  {name:<16} wall median {np.median(wall) * 1e3:7.1f} ms min "
            f"{min(wall) * 1e3:7.1f} ms; CPU median {np.median(cpu) * 1e3:7.1f} ms min "
            f"{min(cpu) * 1e3:7.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--against", metavar="PYTHON",
                        help="the reference checkout's interpreter")
    parser.add_argument("--rounds", type=int, default=3,
                        help="turns each side takes with --against")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.json:
        print(json.dumps(measure(args.layers, args.repeats)))
        return
    ours: dict = {s: [] for s in SCHEDULES}
    theirs: dict = {s: [] for s in SCHEDULES}
    for _ in range(args.rounds if args.against else 1):
        for s, times in measure(args.layers, args.repeats).items():
            ours[s] += times
        if args.against:
            out = subprocess.run([args.against, __file__, "--json", "--layers",
                                  str(args.layers), "--repeats", str(args.repeats)],
                                 check=True, capture_output=True, text=True).stdout
            for s, times in json.loads(out.splitlines()[-1]).items():
                theirs[s] += [tuple(t) for t in times]
    n = len(ours[SCHEDULES[0]])
    print(f"GPT with {args.layers} blocks on 4 stages, 8 micro-batches; engine.prepare, "
          f"{n} plans each" + (f" (taking turns with {args.against})" if args.against else ""))
    for s in SCHEDULES:
        print(line(f"{s} this", ours[s]))
        if args.against:
            print(line(f"{s} reference", theirs[s]))
            wall = min(t[0] for t in ours[s]) / min(t[0] for t in theirs[s])
            cpu = min(t[1] for t in ours[s]) / min(t[1] for t in theirs[s])
            print(f"  {s} this / reference (least times): CPU {cpu:.2f} (wall {wall:.2f}); "
                  f"target <= {TARGET} {'OK' if cpu <= TARGET else 'MISSED'}")


if __name__ == "__main__":
    main()
