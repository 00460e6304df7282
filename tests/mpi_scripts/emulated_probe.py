"""Probe the machine a rank runs on, for the emulated-cluster tests.

Usage::

    distgraph run -n 4 --emulate FILE tests/mpi_scripts/emulated_probe.py [A-B ...] [--allreduce S]

With ``--allreduce S`` the ranks first all-reduce vectors of ones (distgraph's
MPICommunicator, so a lost peer times out) until rank 0 has run S seconds, checking every
sum, and report the count and the slowest call. Then each rank reports its hostname and
``DISTGRAPH_CLUSTER``, and for every pair ``A-B`` of ranks, the one-way bandwidth of an
8 MiB ping-pong (best of 3). Rank 0 prints ``EMULATED-PROBE {json}``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import numpy as np
from mpi4py import MPI

from distgraph.runtime.comm.mpi import MPICommunicator

PING_BYTES = 8 * 2**20


def ping_pong(comm, a: int, b: int) -> float:
    buf = np.zeros(PING_BYTES, dtype=np.uint8)
    best = np.inf
    rank = comm.Get_rank()
    for _ in range(4):               # the first exchange sets up the connection
        comm.Barrier()
        start = time.perf_counter()
        if rank == a:
            comm.Send(buf, dest=b)
            comm.Recv(buf, source=b)
        elif rank == b:
            comm.Recv(buf, source=a)
            comm.Send(buf, dest=a)
        best = min(best, (time.perf_counter() - start) / 2)
    return PING_BYTES / best / 1e9


def all_reduce_loop(seconds: float) -> dict:
    comm = MPICommunicator()
    group = tuple(range(comm.size))
    x = np.ones(1 << 14)
    count, slowest, start = 0, 0.0, time.monotonic()
    while True:
        t = time.monotonic()
        x[0] = float(comm.rank == 0 and t - start > seconds)   # rank 0 says when to stop
        y = comm.all_reduce(x, group)
        slowest = max(slowest, time.monotonic() - t)
        count += 1
        if not np.all(y[1:] == comm.size):
            raise AssertionError(f"rank {comm.rank}: wrong all-reduce sum {y[1:4]}")
        if y[0] > 0:
            return {"count": count, "slowest": slowest}


def main(argv) -> None:
    comm = MPI.COMM_WORLD
    report = {}
    # First, so that a fault injected early meets calls that time out, not MPI's own.
    if "--allreduce" in argv:
        loop = all_reduce_loop(float(argv[argv.index("--allreduce") + 1]))
        report["allreduce"] = comm.gather(loop)
    report["hostnames"] = comm.gather(socket.gethostname())
    report["cluster"] = comm.gather(os.environ.get("DISTGRAPH_CLUSTER"))
    report["bandwidth"] = {}
    pairs = [tuple(int(r) for r in p.split("-")) for p in argv if "-" in p and p[0].isdigit()]
    for a, b in pairs:
        bw = ping_pong(comm, a, b)
        report["bandwidth"][f"{a}-{b}"] = comm.bcast(bw, root=a)
    if comm.Get_rank() == 0:
        print("EMULATED-PROBE " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
