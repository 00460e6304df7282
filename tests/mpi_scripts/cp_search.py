"""Run by tests/test_cp_search.py under ``distgraph run -n 4``: every rank searches the
plan of Llama-tiny's long sequences under the budget (tests/cp_search_cases.py: the
sequence split) and trains it on real MPI ranks; rank 0 writes the losses and
parameters to ``argv[1]``."""

import os
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cp_search_cases as C  # noqa: E402

import distgraph as dg  # noqa: E402
from distgraph.runtime.comm.mpi import MPICommunicator  # noqa: E402

dg.set_default_dtype("float64")
plan, built, values = C.search_plan(*C.LONG, budget_gb=C.BUDGET_GB)
losses, params = C.train(plan, built, values, MPICommunicator())
if MPI.COMM_WORLD.Get_rank() == 0:
    np.savez(sys.argv[1], losses=np.asarray(losses), **params)
    print(f"trained the searched plan on {MPI.COMM_WORLD.Get_size()} MPI ranks")
