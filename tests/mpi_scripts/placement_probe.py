"""Where the processes of a mapped plan run: ``distgraph run -n 4 --cluster FILE`` of a file
with two machines.

Trains a dp x mp MLP (mp groups {0, 1} and {2, 3}) for one epoch with the Engine's cluster
(the launcher's ``--cluster`` file), so the rank mapper places the logical processes on
the file's devices. Its hidden layer is narrow and its batches large, so the mp groups'
activations outweigh the dp groups' gradients: the mapper keeps each mp group in one
machine. Rank 0 prints ``PLACEMENT {json}``: every rank's host name, and the
plan's process -> rank map.
"""

from __future__ import annotations

import json
import socket

import numpy as np
from mpi4py import MPI

import distgraph as dg

MESH = dg.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])


class Data:
    def __init__(self):
        rng = np.random.default_rng(0)
        self.x, self.y = rng.normal(size=(512, 256)), rng.normal(size=(512, 256))

    def __len__(self):
        return 512

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class MLP(dg.nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = dg.nn.Linear(256, 8), dg.nn.Linear(8, 256)
        dg.shard_tensor(self.fc1.weight, MESH, [None, "mp"])
        dg.shard_tensor(self.fc2.weight, MESH, ["mp", None])

    def forward(self, x):
        dg.shard_tensor(x, MESH, ["dp", None])
        return self.fc2(dg.ops.relu(self.fc1(x)))


def main() -> None:
    dg.set_default_dtype("float64")
    dg.seed(0)
    engine = dg.Engine(MLP(), dg.nn.MSELoss(), dg.optim.SGD(0.01))
    engine.fit(Data(), batch_size=256, verbose=0)
    comm = MPI.COMM_WORLD
    hosts = comm.gather(socket.gethostname(), root=0)
    if comm.rank == 0:
        rank_of = {int(p): r for p, r in engine.plan().rank_of.items()}
        print("PLACEMENT " + json.dumps({"hosts": hosts, "rank_of": rank_of}), flush=True)


if __name__ == "__main__":
    main()
