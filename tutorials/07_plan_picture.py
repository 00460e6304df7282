"""Tutorial 07: a picture of a plan, a 4-stage GPT with data x tensor parallelism.

Sixteen processes, four pipeline stages of a 2 x 2 mesh each (``dp`` x ``mp``): two
blocks per stage with the Megatron split of tutorial 02 over ``mp``, the batch split over
``dp`` by ``dg.shard_dataloader`` (tokens on the first stage, labels on the last), and
each stage's first block consuming its input split over ``dp`` too, so that the middle
stages stay data parallel. Planning needs no running job: this script plans the
16-process job from one process and draws it with ``plan.plot(path)``: a column per
stage with its mesh, the layers on it, each weight matrix cut by the mesh dims that split
it, the reshards in each layer and the activations and gradients crossing stages, with
their bytes. docs/programs.md shows the picture it draws.

    python tutorials/07_plan_picture.py                      # into a temporary folder
    python tutorials/07_plan_picture.py --out plan.png

``distgraph plan SCRIPT --plot plan.png`` draws the plan of any training script the same
way. The picture needs matplotlib (``pip install 'distgraph[plot]'``).
"""

import argparse
import os
import tempfile

import distgraph as dg
from distgraph.app.data import DataLoader

from counting_data import CountingSequences  # tutorials/ is on the path
from gpt_plans import megatron_block  # tutorial 02's annotations, per block

STAGES, BLOCKS_PER_STAGE = 4, 2


def four_stage_gpt(stages):
    """The plain GPT, its own parts put on the stages (no subclass)."""
    model = dg.nn.GPT(vocab_size=64, d_model=64, n_layer=STAGES * BLOCKS_PER_STAGE, n_head=4,
                      max_seq_len=32)
    model.embed = dg.shard_op(model.embed, stages[0])
    for i, block in enumerate(model.blocks):
        mesh = stages[i // BLOCKS_PER_STAGE]
        megatron_block(block, mesh)
        first = i % BLOCKS_PER_STAGE == 0        # a stage's input comes in split over dp
        model.blocks[i] = dg.shard_op(block, mesh,
                                      in_shard_specs=[["dp", None, None]] if first else None)
    model.head = dg.shard_op(model.head, stages[-1])
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="the picture's path (.png, .svg or .pdf; default: a "
                        "new temporary folder's plan.png)")
    args = parser.parse_args()
    stages = [dg.ProcessMesh([[4 * s, 4 * s + 1], [4 * s + 2, 4 * s + 3]], ["dp", "mp"])
              for s in range(STAGES)]
    dg.seed(0)
    engine = dg.Engine(four_stage_gpt(stages), loss=dg.nn.CrossEntropyLoss(),
                       optimizer=dg.optim.AdamW(3e-3), strategy=dg.Strategy(micro_batches=4))
    data = dg.shard_dataloader(CountingSequences(64, 32, 64), [stages[0], stages[-1]], "dp")
    plan = engine.prepare(*DataLoader(data, batch_size=16).specs(n_labels=1))
    out = args.out or os.path.join(tempfile.mkdtemp(prefix="distgraph-tutorial07-"),
                                   "plan.png")
    plan.plot(out)
    sent = plan.bytes_sent()
    busiest = max(sent, key=lambda p: sum(sent[p].values()))
    print(f"{plan.world_size} processes, {len(plan.stages)} stages, "
          f"{len(plan.reshards())} reshard points; process {busiest} sends the most: "
          f"{sum(sent[busiest].values()) / 1024:.1f} KiB per step")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
