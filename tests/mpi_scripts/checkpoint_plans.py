"""Save checkpoints under some plans of tests/plans.py and load them under others, on
real MPI ranks; print one JSON result line.

Usage (the job size must equal every listed plan's process count)::

    distgraph run -n 4 tests/mpi_scripts/checkpoint_plans.py DIR save:gpt:dp_tp load:gpt:zero

``save:KIND:PLAN`` trains KIND (3 AdamW steps) under PLAN, saves ``DIR/KIND-PLAN`` and has
rank 0 write the global parameters and optimizer states to ``DIR/KIND-PLAN.npz``.
``load:KIND:PLAN:SOURCE`` builds KIND afresh from another seed under PLAN, plans it,
loads ``DIR/KIND-SOURCE`` (which lays the values out for the plan, each rank reading its
blocks) and compares every parameter and optimizer state, gathered, with the npz.
Rank 0 prints ``CKPT-RESULT {json}``: per action, every rank's largest difference, the
names compared, and the bytes each rank read from the shard files.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import distgraph as dg  # noqa: E402
from distgraph.runtime.comm.mpi import MPICommunicator  # noqa: E402

import plans as P  # noqa: E402


def engine_for(kind, name, comm, seed):
    plan = P.PLANS[kind, name, comm.size]
    model = P.build_model(kind, seed)
    plan.annotate(model)
    return P.prepare(P.make_engine(model, kind, comm, plan.sharding), kind)


def save(directory, kind, name, comm) -> dict:
    engine = engine_for(kind, name, comm, seed=0)
    engine.fit(P.Dataset(kind), batch_size=P.BATCH, epochs=1, verbose=0)
    path = os.path.join(directory, f"{kind}-{name}")
    engine.save(path)
    values = {**engine.state_dict(), **engine.optimizer_state_dict()}
    if comm.rank == 0:
        np.savez(path + ".npz", **values)
    return {"names": len(values)}


def load(directory, kind, name, source, comm) -> dict:
    engine = engine_for(kind, name, comm, seed=1)
    path = os.path.join(directory, f"{kind}-{source}")
    engine.load(path)
    read = engine._held.pending.bytes_read        # what laying out the plan read
    total = sum(os.path.getsize(os.path.join(engine._held.pending.data_dir, f))
                for f in os.listdir(engine._held.pending.data_dir))
    got = {**engine.state_dict(), **engine.optimizer_state_dict()}
    want = dict(np.load(path + ".npz"))
    diff = max(float(np.max(np.abs(got[k] - want[k]))) for k in want)
    return {"diff": diff, "same_names": sorted(got) == sorted(want), "bytes_read": read,
            "checkpoint_bytes": total}


def main(argv) -> None:
    dg.set_default_dtype("float64")
    directory, actions = argv[0], argv[1:]
    comm = MPICommunicator()
    report = {}
    for action in actions:
        op, kind, name, *rest = action.split(":")
        result = save(directory, kind, name, comm) if op == "save" else \
            load(directory, kind, name, rest[0], comm)
        everyone = comm._comm.gather(result, root=0)
        if comm.rank == 0:
            report[action] = everyone
    comm.free()
    if comm.rank == 0:
        print("CKPT-RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
