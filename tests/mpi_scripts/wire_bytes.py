"""Count the bytes each machine of an emulated cluster sends to the others while the
runtime runs one collective, for ``tests/test_mpi_cuts.py``.

Usage::

    distgraph run -n 4 --emulate FILE tests/mpi_scripts/wire_bytes.py KIND:BYTES ...

For each case (``all_reduce``, ``reduce_scatter`` or ``all_gather``; BYTES: the cost
formula's B, the local buffer, or for all_gather the gathered one), the ranks run the
collective through distgraph's MPICommunicator over all of them (once to connect, then
three times); around each run, after a barrier, the first rank of every machine reads
its namespace's ``dg0`` transmit counter (``/proc/net/dev``: the machine's own network).
The fewest bytes of the three runs are kept (the barriers and the launcher's control
messages add a little). Rank 0 prints ``WIRE-BYTES {json}``: per case, the machines in
rank order and each machine's bytes sent.
"""

from __future__ import annotations

import json
import socket
import sys

import numpy as np
from mpi4py import MPI

from distgraph.runtime.comm.mpi import MPICommunicator

IFACE = "dg0"


def sent_bytes() -> int:
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, counters = line.partition(":")
            if name.strip() == IFACE:
                return int(counters.split()[8])
    raise RuntimeError(f"no {IFACE} in this rank's network namespace")


def main(cases) -> None:
    world = MPI.COMM_WORLD
    comm = MPICommunicator()
    rank, size = world.Get_rank(), world.Get_size()
    hosts = world.allgather(socket.gethostname())
    first = hosts.index(hosts[rank]) == rank
    group = tuple(range(size))
    report = {"hosts": hosts, "cases": []}
    for case in cases:
        kind, nbytes = case.split(":")
        nbytes = int(nbytes)
        piece = nbytes // 4 // (size if kind == "all_gather" else 1)
        arr = np.ones(piece, np.float32)

        def run():
            if kind == "all_reduce":
                comm.all_reduce(arr, group)
            elif kind == "reduce_scatter":
                comm.reduce_scatter(arr, group)
            else:
                comm.all_gather(arr, group)

        run()
        fewest = None
        for _ in range(3):
            world.Barrier()
            before = sent_bytes() if first else 0
            world.Barrier()
            run()
            world.Barrier()
            got = sent_bytes() - before if first else 0
            fewest = got if fewest is None else min(fewest, got)
        by_host = world.gather((hosts[rank], fewest) if first else None)
        if rank == 0:
            report["cases"].append({"kind": kind, "bytes": nbytes,
                                    "sent": dict(h for h in by_host if h is not None)})
    comm.free()
    if rank == 0:
        print("WIRE-BYTES " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
