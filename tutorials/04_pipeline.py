"""Tutorial 04: a tiny GPT in two pipeline stages of two data-parallel ranks each, 1F1B.

A *stage* is nothing but a mesh: ``shard_op`` puts the model's own parts on meshes (the
embedding and the first half of the blocks on mesh ``[0, 1]``, the rest and the head on
mesh ``[2, 3]``) without a subclass: ``dg.shard_op(layer, mesh)`` is the same layer, run
on ``mesh``. ``dg.shard_dataloader(data, [first, second], shard_dims="dp")`` feeds the
tokens to the first stage and the labels to the second, each split over its mesh's
``dp`` dim, so both stages are data parallel. Completion and partition then give each
rank its part, with the activations sent from stage 0 to stage 1 and their gradients
back (reshard points between the two meshes).

``Strategy(micro_batches=8, schedule="1F1B")`` cuts each batch into 8 micro-batches:
the forward and backward run once per micro-batch and the gradients accumulate, the
update runs once, and the result equals training on whole batches. The order of each
rank's tasks is planned (and checked to complete) with the plan: each rank runs its
tasks in that order, each waiting only for the activations or gradients it receives, and
sends never wait. Stage ``s`` of ``S`` keeps at most ``S - s`` micro-batches in flight,
so stage 0 runs two forwards ahead and then alternates backward and forward: 1F1B
(``engine.plan().schedule()`` prints each process's order).

With ``profile=True`` every rank records its tasks and messages; ``engine.timeline()``
(on every rank) merges them. Rank 0 writes the Chrome trace (open it at
https://ui.perfetto.dev), a Gantt chart of the last step and a picture of the plan
into ``--out`` (a new temporary folder unless given).

Run it with the launcher (4 MPI ranks)::

    distgraph run -n 4 tutorials/04_pipeline.py
    distgraph run -n 4 tutorials/04_pipeline.py --steps 30 --out pipeline-out

The job fails unless the loss fell by at least half. The charts need matplotlib
(``pip install 'distgraph[plot]'``); without them only the trace is written.
"""

import argparse
import math
import os
import tempfile
import time

import numpy as np

import distgraph as dg

from counting_data import CountingSequences  # tutorials/ is on the path


def on_stages(model, first, second):
    """Put ``model``'s embedding and first half of the blocks on ``first``, the other
    blocks and the head on ``second`` (no subclass: its own parts, wrapped)."""
    half = len(model.blocks) // 2
    model.embed = dg.shard_op(model.embed, first)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = dg.shard_op(block, first if i < half else second)
    model.head = dg.shard_op(model.head, second)
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=32, help="global batch")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--schedule", default="1F1B", choices=["1F1B", "FThenB", "ZB"])
    parser.add_argument("--out", help="folder for timeline.json, timeline.png and plan.png "
                        "(default: a new temporary folder)")
    args = parser.parse_args()

    first, second = dg.ProcessMesh([0, 1], ["dp"]), dg.ProcessMesh([2, 3], ["dp"])
    vocab, seq_len = 64, 32
    dg.seed(0)
    model = on_stages(dg.nn.GPT(vocab_size=vocab, d_model=64, n_layer=4, n_head=4,
                                max_seq_len=seq_len), first, second)
    data = CountingSequences(args.steps * args.batch_size, seq_len, vocab)
    strategy = dg.Strategy(micro_batches=args.micro_batches, schedule=args.schedule,
                           profile=True)
    engine = dg.Engine(model, loss=dg.nn.CrossEntropyLoss(), optimizer=dg.optim.AdamW(3e-3),
                       strategy=strategy)

    start = time.perf_counter()
    history = engine.fit(dg.shard_dataloader(data, [first, second], shard_dims="dp"),
                         batch_size=args.batch_size, epochs=1)
    seconds = time.perf_counter() - start
    timeline = engine.timeline()           # a collective: every rank calls it

    first, last = history.losses[0], float(np.mean(history.losses[-10:]))
    halved = last <= first / 2
    if engine.rank == 0:
        plan = engine.plan()
        print(plan.task_graph().pretty().split("\n  process")[0])
        step = timeline.steps[-1]
        order = [f"{e.kind[0].upper()}{e.micro_batch}" for e in timeline.events
                 if e.rank == 0 and e.step == step and e.kind in ("forward", "backward")]
        print(f"rank 0, step {step}: {' '.join(order)}")
        idle = timeline.idle_fraction(step)
        s, m = len(plan.stages), args.micro_batches
        print(f"idle share of the pipeline per rank: "
              f"{', '.join(f'{r}: {f:.2f}' for r, f in idle.items())} "
              f"(ideal bubble (S-1)/(M+S-1) = {(s - 1) / (m + s - 1):.2f})")
        out = args.out or tempfile.mkdtemp(prefix="distgraph-tutorial04-")
        os.makedirs(out, exist_ok=True)
        timeline.save(os.path.join(out, "timeline.json"))
        try:
            timeline.plot(os.path.join(out, "timeline.png"), step=step)
            plan.plot(os.path.join(out, "plan.png"))
            wrote = f"timeline.json, timeline.png and plan.png into {out}"
        except dg.DistGraphError as e:
            wrote = f"timeline.json into {out} ({e})"
        print(f"steps {len(history.losses)}  loss {first:.3f} -> {last:.3f} (mean of the "
              f"last 10; ln vocab = {math.log(vocab):.3f})  {seconds:.1f} s; wrote {wrote}")
        print("loss halved" if halved else "loss NOT halved")
    if not halved:
        raise RuntimeError(f"the loss fell from {first:.3f} to {last:.3f}, not by half")


if __name__ == "__main__":
    main()
