"""Run by tests/test_mixtral_train.py under ``distgraph run -n 4``: the tiny Mixtral of
that test trains with its experts and its batch split over 4 MPI ranks in layout
``argv[2]`` of its LAYOUTS (default ``ep4``: all-to-all dispatch, dropless, the counts
exchanged, then variable-count all_to_allv; ``ep_pipeline``: 2 stages of ep 2 with 2
micro-batches, the load-balancing loss per micro-batch); rank 0 writes the losses and
the parameters to ``argv[1]`` (an .npz) for the test to compare with its serial run."""

import os
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import test_mixtral_train as T  # noqa: E402

import distgraph as dg  # noqa: E402

dg.set_default_dtype("float64")
layout = sys.argv[2] if len(sys.argv) > 2 else "ep4"
annotate, ranks, strategy, _ = T.LAYOUTS[layout]
assert ranks == MPI.COMM_WORLD.Get_size(), (layout, ranks)
losses, state = T._train(None, T.CONFIG, annotate, strategy=strategy)
if MPI.COMM_WORLD.Get_rank() == 0:
    np.savez(sys.argv[1], losses=np.asarray(losses), **state)
    print(f"moe {layout} trained on {ranks} MPI ranks")
