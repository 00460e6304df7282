"""Run by tests/test_mixtral_train.py under ``distgraph run -n 4``: the tiny Mixtral of
that test trains with its experts and its batch split over 4 MPI ranks (all-to-all
dispatch, dropless: the counts exchanged, then variable-count all_to_allv); rank 0
writes the losses and the parameters to ``argv[1]`` (an .npz) for the test to compare
with its serial run."""

import os
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import test_mixtral_train as T  # noqa: E402

import distgraph as dg  # noqa: E402

dg.set_default_dtype("float64")
losses, state = T._train(None, T.CONFIG, T._ep(4))
if MPI.COMM_WORLD.Get_rank() == 0:
    np.savez(sys.argv[1], losses=np.asarray(losses), **state)
    print("moe ep4 trained on 4 MPI ranks")
