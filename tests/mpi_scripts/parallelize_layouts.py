"""Run by tests/test_parallelize.py under ``distgraph run -n N``: each layout named in
``argv[2:]`` ("kind:name" of parallelize_cases.LAYOUTS, each of N ranks; "kind:name@B":
with ``Strategy(bucket_mb=B)``) trains on the job's MPI ranks; every rank writes its
losses and parameters to ``{argv[1]}/{kind}_{name}[@B]_rank{r}.npz`` for the test to
compare with its serial run."""

import dataclasses
import os
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import parallelize_cases as C  # noqa: E402

import distgraph as dg  # noqa: E402

dg.set_default_dtype("float64")
rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
for key in sys.argv[2:]:
    kind, name = key.split(":")
    name, _, bucket = name.partition("@")
    layout = C.LAYOUTS[kind, name]
    if bucket:
        layout = dataclasses.replace(layout, strategy={**layout.strategy,
                                                       "bucket_mb": float(bucket)})
        name = f"{name}@{bucket}"
    assert layout.ranks == size, (key, layout.ranks, size)
    losses, state = C.train(None, kind, layout)
    np.savez(os.path.join(sys.argv[1], f"{kind}_{name}_rank{rank}.npz"),
             losses=np.asarray(losses), **state)
    if rank == 0:
        print(f"{key} trained on {size} MPI ranks", flush=True)
