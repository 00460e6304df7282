"""Tutorial 02: train the tiny GPT of tutorial 01 on 4 processes, data x tensor parallel.

The 4 ranks form a 2 x 2 ProcessMesh with dims ``dp`` (data parallel) and ``mp`` (model
parallel). Two kinds of annotation are all distgraph needs; completion infers the layout
of every other tensor, and partition places the communication:

- the input batch is split over ``dp`` by ``dg.shard_dataloader(data, mesh,
  shard_dims="dp")``: each dp row of the mesh reads half of each batch (its labels too);
  the model stays the plain ``dg.nn.GPT``;
- each block's weights are split over ``mp``: the first Linear of the attention
  (``qkv``) and of the MLP (``fc1``) by columns (weight and bias), the second (``proj``,
  ``fc2``) by rows.

The MLP then runs the Megatron way: each rank computes half of ``fc1``'s columns and the
matching rows of ``fc2``, and the partial outputs of ``fc2`` are all-reduced over ``mp``
(in the backward, the gradient of the LayerNorm output before ``fc1``). The attention
does not: ``qkv`` packs q | k | v (heads contiguous within each), so a column split gives
rank 0 q and half of k, not whole heads. Completion keeps every result correct by
all-gathering the ``qkv`` output and ``proj``'s weight before use, so each mp rank runs
the whole attention of its dp rows; its weights are only stored split (and their
gradients reduced to the split). The plan shows it: per block, all-gathers of the ``qkv``
output and of ``proj.weight`` in the forward and of ``qkv.weight`` and an attention
gradient in the backward. For attention split by heads, with q, k and v projections of
their own, see ``dg.nn.Llama`` and ``dg.nn.llama.megatron`` (tutorial 08).

Parameters the annotations leave whole (embeddings, LayerNorms, second biases,
``lm_head``) are replicated, and their gradients are all-reduced over ``dp``; the split
ones are all-reduced over ``dp`` too, each shard among the ranks holding it.

Run it with the launcher (4 MPI ranks, one BLAS thread each)::

    distgraph run -n 4 tutorials/02_spmd_gpt.py            # about 8 s on 2 cores
    distgraph run -n 4 tutorials/02_spmd_gpt.py --steps 40 # quicker

Started as one plain process (``python tutorials/02_spmd_gpt.py``) it stops with a
PlanError that says how to launch it. ``engine.rank`` is this script's rank in the job and
``engine.process`` the process of the plan it runs (the mesh's process ids; with a
cluster the rank mapper may place process p on another rank). Rank 0 prints what its
process runs and sends per step, the loss curve's start and end and the time; the job
fails unless the loss fell by at least half. ``distgraph plan -n 4
tutorials/02_spmd_gpt.py --plot plan.png`` draws the plan.
"""

import argparse
import math
import time
from collections import Counter

import numpy as np

import distgraph as dg

from counting_data import CountingSequences  # tutorials/ is on the path
from gpt_plans import megatron  # the annotations described above


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=16, help="global batch")
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=32)
    args = parser.parse_args()

    mesh = dg.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    dg.seed(0)
    model = dg.nn.GPT(vocab_size=args.vocab, d_model=64, n_layer=2, n_head=4,
                      max_seq_len=args.seq_len)
    megatron(model, mesh)
    data = CountingSequences(args.steps * args.batch_size, args.seq_len, args.vocab)
    engine = dg.Engine(model, loss=dg.nn.CrossEntropyLoss(), optimizer=dg.optim.AdamW(3e-3))

    start = time.perf_counter()
    history = engine.fit(dg.shard_dataloader(data, mesh, shard_dims="dp"),
                         batch_size=args.batch_size, epochs=1)
    seconds = time.perf_counter() - start

    # The plan: the completed program and this rank's part of it (pure values).
    local = engine.plan().local(engine.process)
    points = local.points()
    sent = sum(local.bytes_sent().values())
    # Every rank holds the same global losses, so every rank reaches the same verdict.
    first, last = history.losses[0], float(np.mean(history.losses[-10:]))
    halved = last <= first / 2
    if engine.rank == 0:
        kinds = Counter(step.kind for p in points for step in p.steps)
        print(f"plan on {mesh}: rank {engine.rank} of {engine.world_size} runs process "
              f"{engine.process}: {len(local.program.ops)} ops and {len(points)} reshard "
              f"points per step ({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))}), "
              f"sending {sent / 1024:.1f} KiB per step")
        print(f"steps {len(history.losses)}  loss {first:.3f} -> {last:.3f} (mean of the "
              f"last 10; ln vocab = {math.log(args.vocab):.3f})  {seconds:.1f} s")
        print("loss halved" if halved else "loss NOT halved")
    if not halved:
        raise RuntimeError(f"the loss fell from {first:.3f} to {last:.3f}, not by half")


if __name__ == "__main__":
    main()
