"""Train a DP x TP MLP on 4 ranks under three rank mappings; rank 0 prints JSON saying
whether losses and parameters are bitwise identical and which mappings were used."""
import json

import numpy as np
from mpi4py import MPI

import distgraph as dg

dg.set_default_dtype("float64")
MESH = dg.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
MAPPINGS = [None, {0: 3, 1: 2, 2: 1, 3: 0}, {0: 1, 1: 0, 2: 3, 3: 2}]


class Data:
    def __init__(self):
        rng = np.random.default_rng(0)
        self.x, self.y = rng.normal(size=(64, 8)), rng.normal(size=(64, 4))

    def __len__(self):
        return 64

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class MLP(dg.nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = dg.nn.Linear(8, 16), dg.nn.Linear(16, 4)
        dg.shard_tensor(self.fc1.weight, MESH, [None, "mp"])
        dg.shard_tensor(self.fc2.weight, MESH, ["mp", None])

    def forward(self, x):
        dg.shard_tensor(x, MESH, ["dp", None])
        return self.fc2(dg.ops.relu(self.fc1(x)))


results = []
for mapping in MAPPINGS:
    dg.seed(0)
    engine = dg.Engine(MLP(), dg.nn.MSELoss(), dg.optim.Adam(0.01),
                       cluster=dg.Cluster.local(4), rank_mapping=mapping)
    history = engine.fit(Data(), batch_size=16)
    results.append((history.losses, engine.state_dict(), dict(engine.plan().rank_of)))
if MPI.COMM_WORLD.rank == 0:
    first_losses, first_params = results[0][0], results[0][1]
    same = all(losses == first_losses
               and all(np.array_equal(params[k], first_params[k]) for k in params)
               for losses, params, _ in results)
    print(json.dumps({"identical": same, "rank_of": [r[2] for r in results]}))
