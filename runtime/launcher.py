"""Start N ranks of a Python script with the mpiexec that pip installs (mpich wheel).

Every rank runs through :mod:`distgraph.runtime.bootstrap`, which makes an uncaught
exception on any rank abort the whole job (MPICH otherwise waits forever for the dead
rank) and pins BLAS to one thread per rank unless the caller chose otherwise.

Example::

    from distgraph.runtime.launcher import launch
    rc = launch(4, ["tutorials/02_spmd_mlp.py", "--steps", "3"])
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from distgraph.errors import PlanError

BLAS_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def mpiexec_path() -> str:
    """The mpiexec beside this interpreter (the mpich wheel's), else the one on PATH."""
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.exists(local):
        return local
    found = shutil.which("mpiexec")
    if found is None:
        raise PlanError(
            "no mpiexec found: install the 'mpich' wheel into this environment "
            "(pip install mpich) or put an MPI's mpiexec on PATH"
        )
    return found


def rank_env(base: dict | None = None, cluster: str | None = None) -> dict:
    """Environment for ranks: one BLAS thread each unless already set, and the cluster file."""
    env = dict(os.environ if base is None else base)
    for var in BLAS_THREAD_VARS:
        env.setdefault(var, "1")
    if cluster is not None:
        env["DISTGRAPH_CLUSTER"] = os.path.abspath(cluster)
    return env


def launch_command(nprocs: int, argv: list[str]) -> list[str]:
    """The mpiexec command line that runs ``argv`` (a script and its args) on N ranks."""
    if nprocs < 1:
        raise PlanError(f"cannot launch {nprocs} processes: -n must be at least 1")
    return [mpiexec_path(), "-n", str(nprocs), sys.executable, "-m",
            "distgraph.runtime.bootstrap", *argv]


def launch(nprocs: int, argv: list[str], cluster: str | None = None,
           env: dict | None = None, timeout: float | None = None) -> int:
    """Run ``argv`` on ``nprocs`` ranks and return mpiexec's exit code."""
    proc = subprocess.run(launch_command(nprocs, argv), env=rank_env(env, cluster),
                          timeout=timeout, check=False)
    return proc.returncode
