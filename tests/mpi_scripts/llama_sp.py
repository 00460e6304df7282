"""Train Llama-tiny (tests/llama_cases.py's TINY config, float64) with Megatron's tensor
parallelism over ``mp`` and Strategy(sequence_parallel=True) on real MPI ranks, and the
same model serially on each rank; rank 0 prints one ``LLAMA-SP {json}`` line.

Usage (2 ranks: tp 2; 4 ranks: dp 2 x tp 2, the batch split over dp)::

    distgraph run -n 4 tests/mpi_scripts/llama_sp.py

The JSON holds every rank's losses, the largest loss and parameter errors against serial,
and the kinds of rank 0's reshard steps (all-gathers and reduce-scatters where the
sequence-parallel regions meet the tensor-parallel ones).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import distgraph as dg  # noqa: E402
from distgraph.runtime.comm.mpi import MPICommunicator  # noqa: E402

import llama_cases as L  # noqa: E402

BATCH, SEQ, STEPS = 8, 8, 3


def train(comm, mesh, sequence_parallel):
    dg.seed(0)
    model = dg.nn.Llama(dg.nn.llama.LlamaConfig(**L.TINY))
    data = L.NextTokens(BATCH * STEPS, SEQ)
    if mesh is not None:
        dg.nn.llama.megatron(model, mesh)
        data = dg.shard_dataloader(data, mesh, shard_dims="dp")
    strategy = dg.Strategy(sequence_parallel=sequence_parallel)
    engine = dg.Engine(model, loss=dg.nn.CrossEntropyLoss(), optimizer=dg.optim.AdamW(1e-2),
                       strategy=strategy, communicator=comm)
    ins, labels = dg.app.data.DataLoader(data, BATCH).specs(1)
    engine.prepare(ins, labels)
    history = engine.fit(data, batch_size=BATCH, epochs=1, verbose=0)
    return history.losses, engine.state_dict(), engine


def main() -> None:
    dg.set_default_dtype("float64")
    comm = MPICommunicator()
    ids = np.arange(comm.size).reshape(comm.size // 2, 2).tolist()
    mesh = dg.ProcessMesh(ids, dim_names=["dp", "mp"])
    losses, params, engine = train(comm, mesh, True)
    serial_losses, serial_params, _ = train(None, None, False)
    errors = {"loss": max(abs(a - b) for a, b in zip(losses, serial_losses)),
              "param": max(float(np.max(np.abs(params[k] - serial_params[k])))
                           for k in serial_params),
              "same_names": sorted(params) == sorted(serial_params)}
    kinds = sorted({str(s.kind) for p in engine.plan().local(comm.rank).points()
                    for s in p.steps})
    mine = {"losses": losses, "serial": serial_losses, "errors": errors, "kinds": kinds}
    everyone = comm._comm.gather(mine, root=0)
    if comm.rank == 0:
        print("LLAMA-SP " + json.dumps({"world": comm.size, "ranks": everyone}), flush=True)


if __name__ == "__main__":
    main()
