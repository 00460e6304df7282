"""Train tests/test_zero_chosen.py's MLP (two Linear layers of 1024, AdamW, float64) under
the plan the search makes on 4 fast-linked devices with ZeRO left to it (it shards some
updates and not others), or with ``--serial`` on one process.

Usage: ``distgraph run -n 4 tests/mpi_scripts/zero_chosen.py OUT [--serial]``. Rank 0
writes the global parameters to OUT/params.npz and prints ``ZERO-CHOSEN {json}``: the
losses, the world size and the updates the plan shards."""

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import distgraph as dg  # noqa: E402

import search_cases as S  # noqa: E402

WIDTH = 1024


class Rows:
    def __init__(self, n=16):
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(n, WIDTH))
        self.y = rng.normal(size=(n, WIDTH))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def main() -> None:
    serial = "--serial" in sys.argv
    dg.set_default_dtype("float64")
    dg.seed(0)
    model = dg.nn.MLP(WIDTH, WIDTH, WIDTH)
    if serial:
        engine = dg.Engine(model, dg.nn.MSELoss(), dg.optim.AdamW(1e-3))
    else:
        mesh = dg.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
        for p in model.parameters():
            dg.shard_tensor(p, mesh, [None] * len(p.shape))
        engine = dg.Engine(model, dg.nn.MSELoss(), dg.optim.AdamW(1e-3),
                           cluster=S.line_cluster(4, 100, 5),
                           strategy=dg.Strategy(auto_mode="full", recompute=False,
                                                sequence_parallel=False))
    history = engine.fit(Rows(), batch_size=8, epochs=2, verbose=0)
    params = engine.state_dict()
    if engine.rank == 0:
        plan = engine.plan()
        zero = plan.decisions.zero_params if plan.decisions is not None else None
        np.savez(os.path.join(sys.argv[1], "params.npz"), **params)
        print("ZERO-CHOSEN " + json.dumps({
            "losses": history.losses, "world": engine.world_size,
            "zero_params": None if zero is None else sorted(zero)}), flush=True)


if __name__ == "__main__":
    main()
