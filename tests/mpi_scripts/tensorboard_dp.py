"""``dg.callbacks.TensorBoard`` on the ranks of a data-parallel job: an MLP whose batches
``dg.shard_dataloader`` splits over ``dp``, on ``dg.Cluster.local(n)`` (so the plan has
an estimate), 2 epochs of 4 steps, every rank logging to the same folder.

Usage::

    distgraph run -n 2 tests/mpi_scripts/tensorboard_dp.py DIR

Each rank prints ``TB-RANK {json}``: its rank, its History's losses and steps, the
epochs' mean losses, its measured memory peaks, and the plan's predicted step time and
peak.
"""

from __future__ import annotations

import json
import sys

import numpy as np

import distgraph as dg


class Rows:
    def __init__(self, n=32):
        rng = np.random.default_rng(0)
        self.x, self.y = rng.normal(size=(n, 8)), rng.normal(size=(n, 2))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def main(directory):
    dg.set_default_dtype("float64")
    dg.seed(0)
    world = dg.get_world_size()
    engine = dg.Engine(dg.nn.MLP(8, 16, 2), loss=dg.nn.MSELoss(), optimizer=dg.optim.SGD(0.05),
                       cluster=dg.Cluster.local(world))
    mesh = dg.ProcessMesh(list(range(world)), dim_names=["dp"])
    history = engine.fit(dg.shard_dataloader(Rows(), mesh, shard_dims="dp"), batch_size=8,
                         epochs=2, verbose=0, callbacks=[dg.callbacks.TensorBoard(directory)])
    print("TB-RANK " + json.dumps({
        "rank": engine.rank, "losses": history.losses, "steps": history.steps,
        "epoch_losses": [e["loss"] for e in history.epochs], "memory": history.memory,
        "predicted_peak": engine.plan().estimate.peak_memory,
        "predicted": engine.plan().estimate.step_time}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
