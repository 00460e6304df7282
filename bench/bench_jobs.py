"""What several bench programs share: timing step functions across MPI ranks, and a
parent process that calibrates this machine and collects rows from an N-rank job.

A bench script run directly imports this module from its own folder (Python puts the
script's folder first on ``sys.path``)."""

from __future__ import annotations

import json
import os
import subprocess
import time

import numpy as np

# every rank of a timing job computes on one thread
JOB_ENV = dict(os.environ, OMP_NUM_THREADS="1")


def timed(fns, steps, warmup, comm):
    """Alternate the step functions; per step, the slowest rank's seconds
    (array [function, step]); ``comm`` is an mpi4py communicator."""
    from mpi4py import MPI

    for _ in range(warmup):
        for fn in fns:
            fn()
    times = np.zeros((len(fns), steps))
    for i in range(steps):
        for j, fn in enumerate(fns):
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            times[j, i] = time.perf_counter() - t0
    comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    return times


def calibrated(n: int, given: str | None, folder: str) -> str:
    """``given``, or a resource file of this machine calibrated for ``n`` ranks, written
    into ``folder``."""
    if given is not None:
        return given
    path = os.path.join(folder, f"calibrated{n}.yaml")
    subprocess.run(["distgraph", "cluster", "calibrate", "-n", str(n), "-o", path],
                   check=True, env=JOB_ENV, stdout=subprocess.DEVNULL)
    return path


def rows_from_ranks(n: int, script: str, args: list, folder: str) -> list:
    """Run ``script`` on ``n`` ranks with ``args`` and ``--rank-output FILE``; the rows
    its rank 0 wrote there (:func:`write_rows`)."""
    out = os.path.join(folder, f"rows{n}.json")
    subprocess.run(["distgraph", "run", "-n", str(n), os.path.abspath(script), *args,
                    "--rank-output", out], check=True, env=JOB_ENV)
    with open(out) as f:
        return json.load(f)


def write_rows(path: str, rows: list) -> None:
    """Inside the job: the rows for the parent (only the rank that has them writes)."""
    if rows:
        with open(path, "w") as f:
            json.dump(rows, f)
