"""Train a two-stage model whose second stage reads its input whole first (a LayerNorm),
then split (a residual add), on 4 real MPI ranks, against serial training in float64.
The backward reshards the input from the split copy that stage holds
(passes/partition.py). Prints ``RECEIVED {json}`` per rank: the largest loss and
parameter errors, and the reshard points of the received value on the process.

Usage: ``distgraph run -n 4 tests/mpi_scripts/received_copy.py``
"""

from __future__ import annotations

import json

import numpy as np

import distgraph as dg
from distgraph.runtime.comm.mpi import MPICommunicator

A = dg.ProcessMesh([0, 1], ["mp"])
B = dg.ProcessMesh([2, 3], ["mp"])


class TwoStage(dg.nn.Layer):
    """fc1 -> relu on A, split over mp; then on B ``fc2(h + layer_norm(h))``, the
    LayerNorm reading ``h`` whole, the add reading both split (``staged``), or all on
    one process."""

    def __init__(self, staged: bool):
        super().__init__()
        self.fc1 = dg.nn.Linear(8, 16)
        self.ln = dg.nn.LayerNorm(16)
        self.fc2 = dg.nn.Linear(16, 4)
        self.staged = staged

    def forward(self, x):
        if not self.staged:
            h = dg.ops.relu(self.fc1(x))
            return self.fc2(h + self.ln(h))
        h = dg.shard_op(lambda v: dg.ops.relu(self.fc1(v)), A,
                        out_shard_specs=[[None, "mp"]])(x)
        y = dg.shard_op(lambda v: self.ln(v), B, in_shard_specs=[[None, None]])(h)
        z = dg.shard_op(lambda u, v: u + v, B,
                        in_shard_specs=[[None, "mp"], [None, "mp"]])(h, y)
        return dg.shard_op(lambda v: self.fc2(v), B)(z)


class Data:
    def __init__(self):
        rng = np.random.default_rng(0)
        self.x, self.y = rng.standard_normal((32, 8)), rng.standard_normal((32, 4))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def train(staged: bool, comm=None):
    dg.seed(0)
    engine = dg.Engine(TwoStage(staged), dg.nn.MSELoss(), dg.optim.AdamW(0.01),
                       strategy=dg.Strategy(micro_batches=4), communicator=comm)
    history = engine.fit(Data(), batch_size=16, epochs=2)
    return history.losses, engine.state_dict(), engine


def main() -> None:
    dg.set_default_dtype("float64")
    comm = MPICommunicator()
    serial_losses, serial_params, _ = train(False)
    losses, params, engine = train(True, comm)
    plan = engine.plan()
    local = plan.local(plan.ranks.process(comm.rank))
    received = [[str(q.dst.spec), list(q.reads), list(q.writes),
                 plan.program.ops[q.anchor].role.value]
                for q in local.points() if q.value == "relu_0" and q.writes]
    print("RECEIVED " + json.dumps({
        "rank": comm.rank,
        "loss": max(abs(a - b) for a, b in zip(losses, serial_losses)),
        "param": max(float(np.max(np.abs(np.asarray(params[k]) - np.asarray(v))))
                     for k, v in serial_params.items()),
        "points": received}), flush=True)
    comm.free()


if __name__ == "__main__":
    main()
