"""Train cases of tests/device_cases.py as GPU plans on real MPI ranks; one JSON line.

Usage (the job size must equal every case's process count)::

    distgraph run -n 4 tests/mpi_scripts/device_plans.py GPUS BACKEND CASE...

``GPUS``: how many GPUs the plan's cluster describes on this machine (``detect``: this
machine's, ``Cluster.local(n, device="GPU")``); ``BACKEND``: ``numpy`` (numpy standing in
for CuPy: the routes are the GPU plan's) or ``plan`` (the plan's own, CuPy). A CASE is
``kind:name[:1F1B]`` (tests/device_cases.py). Every rank trains each case with the
runner and compares it with serial numpy training; rank 0 prints ``DEVICE-RESULT
{json}`` with, per case, every rank's largest errors and its groups' routes (and the NCCL
communicators it made).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import distgraph as dg  # noqa: E402
from distgraph.runtime.backend import NUMPY  # noqa: E402
from distgraph.runtime.comm.mpi import MPICommunicator  # noqa: E402

import device_cases as D  # noqa: E402


def main(argv) -> None:
    gpus, backend, keys = argv[0], argv[1], argv[2:]
    dg.set_default_dtype("float64")
    comm = MPICommunicator()
    n = comm.size
    cluster = (dg.Cluster.local(n, device="GPU") if gpus == "detect"
               else D.gpu_cluster(n, int(gpus)))
    report = {"world": n, "cases": {}}
    refs = {}
    for key in keys:
        kind, name, *pipe = key.split(":")
        opts = {"micro_batches": 2, "schedule": "1F1B"} if pipe else {}
        if kind not in refs:
            refs[kind] = D.serial(kind)
        plan, built, init = D.planned(kind, name, n, cluster, **opts)
        losses, params, runner = D.train(kind, plan, built, init, comm,
                                         NUMPY if backend == "numpy" else None)
        loss, param = D.largest_errors((losses, params), refs[kind])
        device = runner.comm
        mine = {"loss": loss, "param": param, "losses": losses,
                "backend": runner.backend.name,
                "routes": sorted({plan.devices.route(g.ranks)
                                  for g in plan.program_of(runner.pid).comm_groups}),
                "nccl": sorted(f"{k[0]}:{list(k[1])}" for k in
                               (device._nccl.comms if getattr(device, "_nccl", None) else ()))}
        everyone = comm._comm.gather(mine, root=0)
        if comm.rank == 0:
            report["cases"][key] = everyone
    if comm.rank == 0:
        print("DEVICE-RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
