"""Tutorial 04: a tiny GPT in two pipeline stages of two data-parallel ranks each, 1F1B.

A *stage* is nothing but a mesh: ``shard_op`` puts the embedding and the first half of
the blocks on mesh ``[0, 1]`` and the rest and the head on mesh ``[2, 3]``; the input
batch is split over each mesh's ``dp`` dim. Completion and partition then give each
rank its part, with the activations sent from stage 0 to stage 1 and their gradients
back (reshard points between the two meshes).

``Strategy(micro_batches=8, schedule="1F1B")`` cuts each batch into 8 micro-batches:
the forward and backward run once per micro-batch and the gradients accumulate, the
update runs once, and the result equals training on whole batches. Each rank runs its
tasks as actors: a task runs when its inputs have arrived and the buffers it writes to
have room. Stage ``s`` of ``S`` keeps at most ``S - s`` micro-batches in flight, so
stage 0 runs two forwards ahead and then alternates backward and forward: 1F1B.

With ``profile=True`` every rank records its tasks and messages; ``engine.timeline()``
(on every rank) merges them. Rank 0 writes the Chrome trace (open it at
https://ui.perfetto.dev) and a Gantt chart of the last step.

Run it with the launcher (4 MPI ranks)::

    distgraph run -n 4 tutorials/04_pipeline.py                 # writes pipeline.json/.png
    distgraph run -n 4 tutorials/04_pipeline.py --steps 20 --out /tmp/tl

The job fails unless the loss fell by at least half. The chart needs matplotlib
(``pip install 'distgraph[plot]'``); without it only the trace is written.
"""

import argparse
import math
import time

import numpy as np

import distgraph as dg
from distgraph.runtime.comm.mpi import MPICommunicator

from counting_data import CountingSequences  # tutorials/ is on the path


class TwoStageGPT(dg.nn.GPT):
    """GPT whose first half runs on ``stages[0]``, second half and head on ``stages[1]``,
    each stage data parallel over its ``dp`` dim."""

    def __init__(self, stages, **kwargs):
        super().__init__(**kwargs)
        self.stages = stages

    def forward(self, idx):
        first, second = self.stages
        dg.shard_tensor(idx, first, ["dp", None])
        x = dg.shard_op(self.embed, first)(idx)
        half = len(self.blocks._items) // 2
        for i, block in enumerate(self.blocks):
            x = dg.shard_op(block, first if i < half else second)(x)
        return dg.shard_op(self.head, second)(x)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=32, help="global batch")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--schedule", default="1F1B", choices=["1F1B", "FThenB", "ZB"])
    parser.add_argument("--out", default="pipeline", help="writes OUT.json and OUT.png")
    args = parser.parse_args()

    stages = (dg.ProcessMesh([0, 1], ["dp"]), dg.ProcessMesh([2, 3], ["dp"]))
    vocab, seq_len = 64, 32
    dg.seed(0)
    model = TwoStageGPT(stages, vocab_size=vocab, d_model=64, n_layer=4, n_head=4,
                        max_seq_len=seq_len)
    data = CountingSequences(args.steps * args.batch_size, seq_len, vocab)
    strategy = dg.Strategy(micro_batches=args.micro_batches, schedule=args.schedule,
                           profile=True)
    comm = MPICommunicator()
    engine = dg.Engine(model, loss=dg.nn.CrossEntropyLoss(), optimizer=dg.optim.AdamW(3e-3),
                       strategy=strategy, communicator=comm)

    start = time.perf_counter()
    history = engine.fit(data, batch_size=args.batch_size, epochs=1)
    seconds = time.perf_counter() - start
    timeline = engine.timeline()           # a collective: every rank calls it

    first, last = history.losses[0], float(np.mean(history.losses[-10:]))
    halved = last <= first / 2
    if comm.rank == 0:
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
        timeline.save(f"{args.out}.json")
        try:
            timeline.plot(f"{args.out}.png", step=step)
            wrote = f"{args.out}.json and {args.out}.png"
        except dg.DistGraphError as e:
            wrote = f"{args.out}.json ({e})"
        print(f"steps {len(history.losses)}  loss {first:.3f} -> {last:.3f} (mean of the "
              f"last 10; ln vocab = {math.log(vocab):.3f})  {seconds:.1f} s; wrote {wrote}")
        print("loss halved" if halved else "loss NOT halved")
    if not halved:
        raise RuntimeError(f"the loss fell from {first:.3f} to {last:.3f}, not by half")


if __name__ == "__main__":
    main()
