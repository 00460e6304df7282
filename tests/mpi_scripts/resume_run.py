"""Exact resume across processes: a GPT with dropout, shuffled data and a warm-up +
cosine learning rate, trained for 3 epochs of 6 steps.

Usage (serially, or under ``distgraph run -n 4`` with PLAN dp_tp)::

    python tests/mpi_scripts/resume_run.py PLAN first DIR
    python tests/mpi_scripts/resume_run.py PLAN resume DIR

``first`` trains all 18 steps uninterrupted (global state to ``DIR/full.npz``), then a
fresh engine trains until step 9 (inside the second epoch), saves ``DIR/ckpt`` and
stops. ``resume`` builds the model from another seed (other weights and dropout
seeds), loads ``DIR/ckpt`` and calls the same ``fit``; its global state goes to
``DIR/resumed-PLAN.npz``. Rank 0 prints ``RESUME-RESULT {json}`` with the losses of each run.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

import distgraph as dg

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from plans import StopAndSave, Tokens  # noqa: E402

STOP_AFTER = 9
FIT = dict(batch_size=4, epochs=3, shuffle=True, verbose=0)




class GPT(dg.nn.GPT):
    def __init__(self, mesh):
        super().__init__(vocab_size=32, d_model=16, n_layer=2, n_head=2, max_seq_len=8,
                         dropout=0.1)
        self.mesh = mesh
        if mesh is not None:
            for block in self.blocks:
                for first, second in ((block.attn.qkv, block.attn.proj),
                                      (block.mlp.fc1, block.mlp.fc2)):
                    dg.shard_tensor(first.weight, mesh, [None, "mp"])
                    dg.shard_tensor(second.weight, mesh, ["mp", None])

    def forward(self, idx):
        if self.mesh is not None:
            dg.shard_tensor(idx, self.mesh, ["dp", None])
        return super().forward(idx)


def engine(plan, seed, comm):
    dg.seed(seed)
    mesh = dg.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"]) if plan == "dp_tp" else None
    lr = dg.optim.lr.LinearWarmup(dg.optim.lr.CosineDecay(1e-2, decay_steps=15), 3)
    return dg.Engine(GPT(mesh), dg.nn.CrossEntropyLoss(), dg.optim.AdamW(lr),
                     communicator=comm)


def state(e) -> dict:
    return {**e.state_dict(), **e.optimizer_state_dict()}


def main(plan, phase, directory) -> None:
    dg.set_default_dtype("float64")
    comm = None
    if plan != "serial":
        from distgraph.runtime.comm.mpi import MPICommunicator
        comm = MPICommunicator()
    rank = comm.rank if comm is not None else 0
    ckpt = os.path.join(directory, "ckpt")
    result = {"plan": plan, "phase": phase}
    if phase == "first":
        full = engine(plan, 0, comm)
        result["full"] = full.fit(Tokens(24), **FIT).losses
        values = state(full)
        if rank == 0:
            np.savez(os.path.join(directory, "full.npz"), **values)
        first = engine(plan, 0, comm)
        stop = StopAndSave(ckpt, STOP_AFTER)
        result["first"] = first.fit(Tokens(24), callbacks=[stop], **FIT).losses
    else:
        resumed = engine(plan, 1, comm)
        resumed.load(ckpt)
        history = resumed.fit(Tokens(24), **FIT)
        result["resumed"], result["steps"] = history.losses, history.steps
        values = state(resumed)
        if rank == 0:
            np.savez(os.path.join(directory, f"resumed-{plan}.npz"), **values)
    if rank == 0:
        print("RESUME-RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
