"""Train a GPT built under dg.LazyGuard and the same GPT built eagerly on 4 MPI ranks
(dp x mp = 2 x 2, Megatron blocks, the position table split by columns and frozen),
and print one JSON result line from rank 0.

Usage::

    distgraph run -n 4 tests/mpi_scripts/lazy_training.py

Each rank measures its peak of traced memory (tracemalloc: numpy arrays and Python
objects) from before the lazy model is built to the end of its training. The frozen
position table is the largest tensor by far (its whole is more than all else a rank
holds): a rank that made it whole, even for a moment, would peak above its size.
Rank 0 prints ``LAZY-RESULT {json}``: every rank's losses and peak, the whole table's
bytes, and the largest difference between the lazy and eager runs' losses and final
parameters.
"""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
from mpi4py import MPI

import distgraph as dg
from distgraph.runtime.comm.mpi import MPICommunicator

DIMS = dict(vocab_size=64, d_model=32, n_layer=2, n_head=4, max_seq_len=131072)
SEQ, BATCH, STEPS = 8, 8, 3


class Tokens:
    """Next-token samples from a fixed random sequence."""

    def __init__(self, n=BATCH * STEPS):
        rng = np.random.default_rng(1)
        self.data = rng.integers(0, DIMS["vocab_size"], size=(n, SEQ + 1))

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i, :-1].astype(np.int64), self.data[i, 1:].astype(np.int64)


class DataParallelGPT(dg.nn.GPT):
    def __init__(self, mesh, **kwargs):
        super().__init__(**kwargs)
        self.mesh = mesh

    def forward(self, idx):
        dg.shard_tensor(idx, self.mesh, ["dp", None])
        return super().forward(idx)


def build(mesh, lazy: bool):
    dg.seed(0)
    if lazy:
        with dg.LazyGuard():
            model = DataParallelGPT(mesh, **DIMS)
    else:
        model = DataParallelGPT(mesh, **DIMS)
    model.wpe.weight.trainable = False
    dg.shard_tensor(model.wpe.weight, mesh, [None, "mp"])
    for block in model.blocks:
        for first, second in ((block.attn.qkv, block.attn.proj),
                              (block.mlp.fc1, block.mlp.fc2)):
            dg.shard_tensor(first.weight, mesh, [None, "mp"])
            dg.shard_tensor(first.bias, mesh, ["mp"])
            dg.shard_tensor(second.weight, mesh, ["mp", None])
    return model


def train(mesh, comm, lazy: bool):
    tracemalloc.start()
    model = build(mesh, lazy)
    engine = dg.Engine(model, dg.nn.CrossEntropyLoss(), dg.optim.AdamW(1e-2),
                       communicator=comm)
    losses = engine.fit(Tokens(), batch_size=BATCH, epochs=1, verbose=0).losses
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return losses, peak, engine.state_dict()


def main() -> None:
    dg.set_default_dtype("float64")
    comm = MPICommunicator()
    mesh = dg.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    lazy_losses, lazy_peak, lazy_params = train(mesh, comm, lazy=True)
    eager_losses, eager_peak, eager_params = train(mesh, comm, lazy=False)
    mine = {"losses": lazy_losses, "lazy_peak": lazy_peak, "eager_peak": eager_peak,
            "loss_error": max(abs(a - b) for a, b in zip(lazy_losses, eager_losses)),
            "param_error": max(float(np.max(np.abs(lazy_params[n] - eager_params[n])))
                               for n in eager_params)}
    ranks = MPI.COMM_WORLD.gather(mine, root=0)
    if comm.rank == 0:
        whole = DIMS["max_seq_len"] * DIMS["d_model"] * 8
        print("LAZY-RESULT " + json.dumps({"ranks": ranks, "whole_table_bytes": whole,
                                           "eager_losses": eager_losses}), flush=True)
    comm.free()


if __name__ == "__main__":
    main()
