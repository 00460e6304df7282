"""MeshSlice's distributed matmul on real MPI ranks (tests/meshslice_cases.py).

Usage::

    distgraph run -n 4 tests/mpi_scripts/meshslice_cases.py      # 2x2
    distgraph run -n 6 tests/mpi_scripts/meshslice_cases.py      # 2x3 and 3x2

Every rank runs every case; rank 0 prints ``MESHSLICE-RESULT {json}`` with, per case and
layout, the largest error over the ranks, and whether every rank counted the bytes the
plan counts and made 2K collective calls.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from distgraph.runtime.comm.mpi import MPICommunicator  # noqa: E402

import meshslice_cases as C  # noqa: E402


def main() -> None:
    comm = MPICommunicator()
    rows = []
    for case in C.cases(comm.size):
        for name, err, planned, counted, calls, expected in C.run_case(comm, case):
            rows.append({"case": repr(case), "layout": name, "error": err,
                         "bytes": planned == counted and planned > 0, "calls": calls == expected})
    everyone = comm._comm.gather(rows, root=0)
    if comm.rank == 0:
        merged = []
        for mine in zip(*everyone):
            merged.append({"case": mine[0]["case"], "layout": mine[0]["layout"],
                           "error": max(r["error"] for r in mine),
                           "bytes": all(r["bytes"] for r in mine),
                           "calls": all(r["calls"] for r in mine)})
        print("MESHSLICE-RESULT " + json.dumps({"world": comm.size, "rows": merged}),
              flush=True)
    comm.free()


if __name__ == "__main__":
    main()
