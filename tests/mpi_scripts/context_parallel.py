"""Run by tests/test_context_parallel.py under ``distgraph run -n 4``: Llama-tiny trains
with its sequence split over ``cp`` in each layout named in ``argv[2:]`` ("base/form",
:func:`test_context_parallel.layout_of`; real ranks, attention's collectives inside the
op); rank 0 writes each layout's losses and parameters to ``{argv[1]}_{base}_{form}.npz``
for the test to compare with its serial run."""

import os
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import test_context_parallel as T  # noqa: E402

import distgraph as dg  # noqa: E402

dg.set_default_dtype("float64")
for layout in sys.argv[2:]:
    losses, state = T.train(None, layout)
    if MPI.COMM_WORLD.Get_rank() == 0:
        np.savez(f"{sys.argv[1]}_{layout.replace('/', '_')}.npz", losses=np.asarray(losses),
                 **state)
        print(f"{layout} trained on {MPI.COMM_WORLD.Get_size()} MPI ranks")
