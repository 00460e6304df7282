"""What several bench programs share: timing step functions across MPI ranks, and a
parent process that calibrates this machine and collects rows from an N-rank job.

A bench script run directly imports this module from its own folder (Python puts the
script's folder first on ``sys.path``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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


def time_fit(engine, data, comm, steps: int, batch: int) -> float:
    """Seconds per optimizer step of ``engine.fit`` over ``steps`` batches of ``batch``
    samples of ``data``, on the slowest rank (the ranks meet before and after);
    ``comm`` is distgraph's communicator. ``fit``'s ``epochs`` is the Engine's total:
    this trains one more epoch of ``steps`` batches."""
    comm.barrier()
    start = time.perf_counter()
    engine.fit(data, batch_size=batch, epochs=engine.epoch + 1, steps_per_epoch=steps,
               verbose=0)
    comm.barrier()
    return (time.perf_counter() - start) / steps


def spearman(a, b) -> float:
    """Spearman's rank correlation of ``a`` and ``b`` (ties ranked by position).

    >>> spearman([1, 2, 3], [10, 30, 20])
    0.5
    """
    ra = np.argsort(np.argsort(a)).astype(float)
    rb = np.argsort(np.argsort(b)).astype(float)
    return float(np.corrcoef(ra, rb)[0, 1])


def median_abs_error(predicted, measured) -> float:
    """The median of |predicted / measured - 1| over the pairs.

    >>> median_abs_error([1.25, 0.5, 2.0], [1.0, 1.0, 2.0])
    0.25
    """
    return float(np.median([abs(p / m - 1) for p, m in zip(predicted, measured)]))


def calibrated(n: int, given: str | None, folder: str, repeats: int = 3,
               emulate: str | None = None) -> str:
    """``given``, or a resource file of this machine calibrated for ``n`` ranks
    (``distgraph cluster calibrate --repeats``; with ``emulate``, the ranks of that
    resource file's emulated cluster, ``--emulate``), written into ``folder``."""
    if given is not None:
        return given
    path = os.path.join(folder, f"calibrated{n}.yaml")
    extra = ["--emulate", emulate] if emulate else []
    subprocess.run([sys.executable, "-m", "distgraph.cli", "cluster", "calibrate", "-n", str(n),
                    "-o", path, "--repeats", str(repeats), *extra],
                   check=True, env=JOB_ENV, stdout=subprocess.DEVNULL)
    return path


def rows_from_ranks(n: int, script: str, args: list, folder: str) -> list:
    """Run ``script`` on ``n`` ranks with ``args`` and ``--rank-output FILE``; the rows
    its rank 0 wrote there (:func:`write_rows`)."""
    out = os.path.join(folder, f"rows{n}.json")
    subprocess.run([sys.executable, "-m", "distgraph.cli", "run", "-n", str(n),
                    os.path.abspath(script), *args, "--rank-output", out], check=True, env=JOB_ENV)
    with open(out) as f:
        return json.load(f)


def write_rows(path: str, rows: list) -> None:
    """Inside the job: the rows for the parent (only the rank that has them writes)."""
    if rows:
        with open(path, "w") as f:
            json.dump(rows, f)


def steady_cores(rank: int, ranks: int, cores: float | None = None) -> str:
    """Where the job has more ranks than this machine has cores, run this rank under a CPU
    quota of ``cores`` (default: the machine's cores shared evenly) in a cgroup of its own,
    so that every rank computes at one steady speed, as on a machine of ``ranks`` slower
    cores (time-sharing would speed a rank up while others wait, which bends a pipeline's
    bubble). Needs root and a cgroup cpu controller; the group goes when the rank ends.
    Returns a line that says what was done."""
    import atexit
    import glob

    from distgraph.runtime.emulate.cgroups import MIN_QUOTA_US, cpu_controller

    machine = os.cpu_count() or 1
    if cores is None and ranks <= machine:
        return f"{ranks} ranks on {machine} cores: no quota"
    cores = cores or machine / ranks
    controller = cpu_controller()
    if controller is None or os.geteuid() != 0:
        return (f"{ranks} ranks time-share {machine} cores (no quota of {cores:.2f} cores "
                f"per rank: that needs root and a cgroup cpu controller)")
    for stale in glob.glob(controller.group("distgraph-bench-*")):
        try:
            os.rmdir(stale)                 # left by a killed run; fails while in use
        except OSError:
            pass
    group = controller.group(f"distgraph-bench-{os.getpid()}-r{rank}")
    # a short period (the kernel's smallest quota is 1 ms): a task of a few ms then runs
    # at the quota's pace instead of at full speed and then not at all
    period = max(MIN_QUOTA_US, round(MIN_QUOTA_US / cores))
    limit = round(cores * period)
    settings = ({"cpu.cfs_period_us": period, "cpu.cfs_quota_us": limit}
                if controller.version == 1 else {"cpu.max": f"{limit} {period}"})
    try:
        os.mkdir(group)
        for name, value in {**settings, "cgroup.procs": os.getpid()}.items():
            with open(os.path.join(group, name), "w") as f:
                f.write(f"{value}\n")
    except OSError as err:
        if os.path.isdir(group):
            os.rmdir(group)
        return f"{ranks} ranks time-share {machine} cores (no quota: {err})"

    def leave():
        with open(os.path.join(controller.root, "cgroup.procs"), "w") as f:
            f.write(f"{os.getpid()}\n")
        os.rmdir(group)

    atexit.register(leave)
    return f"each of the {ranks} ranks computes on {cores:.2f} of the {machine} cores (cgroup quota)"
