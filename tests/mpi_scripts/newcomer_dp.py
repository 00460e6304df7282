"""The README's data-parallel script: an unmodified MLP, its data split over the ``dp``
dim by ``dg.shard_dataloader``; each rank prints its rank, the process it runs and the
losses (float64, rounded to 12 digits). ``--serial`` trains the same on one process."""

import sys

import numpy as np

import distgraph as dg


class Regression:
    def __init__(self, n=32):
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(n, 8))
        self.y = self.x @ rng.normal(size=(8, 2))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


dg.set_default_dtype("float64")
dg.seed(0)
model = dg.nn.MLP(8, 16, 2)
engine = dg.Engine(model, loss=dg.nn.MSELoss(), optimizer=dg.optim.SGD(0.05))
data = Regression()
if "--serial" not in sys.argv:
    mesh = dg.ProcessMesh([0, 1], dim_names=["dp"])
    data = dg.shard_dataloader(data, mesh, shard_dims="dp")
history = engine.fit(data, batch_size=8, epochs=2, verbose=0)
losses = " ".join(f"{x:.12f}" for x in history.losses)
print(f"rank {engine.rank} of {engine.world_size} runs process {engine.process}: "
      f"losses {losses}")
