"""Measure what each rank computes, for the emulated machine-speed tests.

Usage::

    distgraph run -n N --emulate FILE tests/mpi_scripts/speed_probe.py [SECONDS] [--fail R]

Each rank runs float64 GEMMs for SECONDS (default 2) and reports its cgroup (the path in
the cpu hierarchy, or the v2 path) and the GEMM rate twice: per second of wall time (what
the rank gets) and per second of its own CPU time (what its core gives while it runs).
Their ratio is the share of the wall time the rank ran. Rank 0 prints
``SPEED-PROBE {json}``. With ``--fail R``, rank R raises instead of reporting.
"""

from __future__ import annotations

import json
import socket
import sys
import time

import numpy as np
from mpi4py import MPI

SIZE = 192


def my_cgroup() -> str:
    """This process's cgroup in the cpu controller's hierarchy (v1), else its v2 path."""
    with open("/proc/self/cgroup") as f:
        lines = [line.strip().split(":", 2) for line in f if line.strip()]
    for _, controllers, path in lines:
        if "cpu" in controllers.split(","):
            return path
    return next(path for hid, controllers, path in lines if hid == "0")


def gemm_rates(seconds: float) -> tuple[float, float]:
    """(GFLOP/s per wall second, GFLOP/s per CPU second) of SIZE^3 float64 GEMMs."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((SIZE, SIZE)), rng.standard_normal((SIZE, SIZE))
    a @ b
    count = 0
    wall, cpu = time.perf_counter(), time.process_time()
    while time.perf_counter() - wall < seconds:
        a @ b
        count += 1
    flops = 2.0 * SIZE**3 * count
    return (flops / (time.perf_counter() - wall) / 1e9,
            flops / (time.process_time() - cpu) / 1e9)


def main() -> None:
    args = sys.argv[1:]
    fail = int(args[args.index("--fail") + 1]) if "--fail" in args else None
    seconds = float(args[0]) if args and args[0] != "--fail" else 2.0
    comm = MPI.COMM_WORLD
    comm.Barrier()
    wall_rate, cpu_rate = gemm_rates(seconds)
    if comm.Get_rank() == fail:
        raise RuntimeError(f"rank {fail} fails, as asked")
    record = {"rank": comm.Get_rank(), "host": socket.gethostname(), "cgroup": my_cgroup(),
              "wall_gflops": wall_rate, "cpu_gflops": cpu_rate}
    records = comm.gather(record, root=0)
    if comm.Get_rank() == 0:
        print("SPEED-PROBE " + json.dumps(records), flush=True)


if __name__ == "__main__":
    main()
