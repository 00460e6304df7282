"""Start N ranks of a Python script with the mpiexec that pip installs (mpich wheel).

Every rank runs through :mod:`distgraph.runtime.bootstrap`, which makes an uncaught
exception on any rank abort the whole job (MPICH otherwise waits forever for the dead
rank) and pins BLAS to one thread per rank unless the caller chose otherwise. Ranks also
keep the memory they free for reuse (glibc's ``MALLOC_MMAP_THRESHOLD_`` and
``MALLOC_TRIM_THRESHOLD_``), unless the caller set those.

Example::

    from distgraph.runtime.launcher import launch
    rc = launch(4, ["tutorials/02_spmd_mlp.py", "--steps", "3"])
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

from distgraph.errors import PlanError

BLAS_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
# glibc hands a freed block of 128 KiB or more back to the OS, and a training step that
# frees each gradient after its update then page-faults the same megabytes back in on
# the next step (about 0.12 ms per MiB on a 2-core VM: 2 ms per 16 MiB gradient).
# Serving blocks below 1 GiB from the heap, trimmed only past 1 GiB free, keeps them
# for reuse, as the caching allocators of GPU frameworks do (a rank holds its peak).
ALLOCATOR_VARS = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


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
    """Environment for ranks: one BLAS thread each and the allocator settings unless
    already set, and the cluster file."""
    env = dict(os.environ if base is None else base)
    for var in BLAS_THREAD_VARS:
        env.setdefault(var, "1")
    for var, value in ALLOCATOR_VARS.items():
        env.setdefault(var, value)
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
    """Run ``argv`` on ``nprocs`` ranks and return mpiexec's exit code. When the job fails,
    say which ranks failed and which ended without a word (killed, or exited abruptly)."""
    with tempfile.TemporaryDirectory(prefix="distgraph-status-") as status:
        rank_vars = rank_env(env, cluster)
        rank_vars["DISTGRAPH_STATUS_DIR"] = status
        proc = subprocess.run(launch_command(nprocs, argv), env=rank_vars, timeout=timeout,
                              check=False)
        if proc.returncode != 0:
            sys.stderr.write(failure_report(status, nprocs, proc.returncode) + "\n")
    return proc.returncode


def failure_report(status_dir: str, nprocs: int, returncode: int) -> str:
    """Which ranks failed (with their error) or died without a word, from the status
    files the ranks and their supervisors write (see runtime/bootstrap.py)."""

    def read(rank, kind):
        path = os.path.join(status_dir, f"{rank}.{kind}")
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return f.read()

    lines = [f"distgraph: the job failed (mpiexec exit code {returncode})"]
    for rank in range(nprocs):
        failed, ended = read(rank, "failed"), read(rank, "exit")
        if failed is not None:
            lines.append(f"  rank {rank} failed: {failed}")
        elif ended is not None:
            lines.append(f"  rank {rank} died without reporting an error ({ended}); "
                         "the other ranks were stopped after it")
    return "\n".join(lines)
