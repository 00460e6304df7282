"""NCCL's collectives and messages between this job's ranks, against numpy; one JSON line.

Usage (one rank per GPU; ``hang``: rank 1 skips a collective, rank 0 must time out)::

    DISTGRAPH_COMM_TIMEOUT=10 distgraph run -n 2 tests/mpi_scripts/nccl_checks.py [hang]

Each rank runs on GPU ``rank`` through a DeviceCommunicator over the cluster
``Cluster.local(n, device="GPU")``. With one rank the calls go to the NCCL path directly
on a one-rank group (the communicator itself answers one-member groups without NCCL).
Rank 0 prints ``NCCL-RESULT {json}``: the largest error of each call and the groups made.
"""

from __future__ import annotations

import json
import sys

import numpy as np

import distgraph as dg
from distgraph.errors import RuntimeFault
from distgraph.passes.mapping.devices import assign_devices
from distgraph.plan.devices import CommGroup
from distgraph.runtime.backend import CupyBackend
from distgraph.runtime.comm.device import DeviceCommunicator
from distgraph.runtime.comm.mpi import MPICommunicator


def main(argv) -> None:
    host = MPICommunicator()
    n, rank = host.size, host.rank
    where = assign_devices(dg.Cluster.local(n, device="GPU"), n)
    xb = CupyBackend(where.device(rank).local_id)
    comm = DeviceCommunicator(host, where, xb)
    world = tuple(range(n))
    groups = [CommGroup("collective", world)] if n > 1 else []
    groups += [CommGroup("p2p", (a, b)) for a in world for b in world if a != b]
    comm.prepare(sorted(groups, key=lambda g: g.key))
    path = comm.nccl
    if n == 1:
        path.open("collective", world)
    call = path if n == 1 else comm        # one rank: NCCL on a one-rank group directly
    rng = np.random.default_rng(0)
    mine = [rng.normal(size=(2 * n, 3)) for _ in range(n)]      # every rank's input
    x = xb.from_host(mine[rank])
    errors = {}

    def check(name, got, want):
        errors[name] = float(np.max(np.abs(xb.to_host(got) - want)))

    if argv[:1] == ["hang"]:
        try:
            if rank != 1:
                comm.all_reduce(x, world)
            errors["hang"] = "no timeout"
        except RuntimeFault as e:
            errors["hang"] = str(e)
        host._comm.barrier()
        report(host, errors, path)
        return
    total = sum(mine)
    check("all_reduce", _call(call, "all_reduce", x, world), total)
    check("all_reduce_max", _call(call, "all_reduce", x, world, op="max"),
          np.max(np.stack(mine), axis=0))
    check("all_gather", _call(call, "all_gather", x, world, axis=1),
          np.concatenate(mine, axis=1))
    check("reduce_scatter", _call(call, "reduce_scatter", x, world, axis=0),
          np.split(total, n, axis=0)[rank])
    check("all_to_all", _call(call, "all_to_all", x, world, split_axis=0, concat_axis=1),
          np.concatenate([np.split(m, n, axis=0)[rank] for m in mine], axis=1))
    started = [_call(call, "iall_gather", x, world, axis=0),
               _call(call, "ireduce_scatter", x, world, axis=0)]
    gathered, scattered = comm.wait(started)
    check("iall_gather", gathered, np.concatenate(mine, axis=0))
    check("ireduce_scatter", scattered, np.split(total, n, axis=0)[rank])
    if n > 1:
        # messages posted for in the other order than they are sent: tags match them
        peer = (rank + 1) % n
        source = (rank - 1) % n
        later = comm.irecv((2 * n, 3), "float64", source, tag=7)
        sooner = comm.irecv((3,), "float64", source, tag=5)
        sends = [comm.isend(x[0], peer, tag=5), comm.isend(x * 2, peer, tag=7)]
        comm.wait([later, sooner] + sends)
        check("message_tag_5", sooner.value, mine[source][0])
        check("message_tag_7", later.value, mine[source] * 2)
        comm.send(x + 1, peer, tag=3)
        check("blocking_message", comm.recv((2 * n, 3), "float64", source, tag=3),
              mine[source] + 1)
        comm.wait_sends()
    report(host, errors, path)
    comm.close()


def _call(comm, name, x, group, **kw):
    """The public call (which validates and counts) on the communicator; the ``_`` one
    on the NCCL path itself (a one-rank group)."""
    if isinstance(comm, DeviceCommunicator):
        return getattr(comm, name)(x, group, **kw)
    if name == "all_reduce":
        return comm._all_reduce(x, group, kw.get("op", "sum"))
    return getattr(comm, "_" + name)(x, group, *kw.values())


def report(host, errors, path) -> None:
    everyone = host._comm.gather({"errors": errors,
                                  "groups": sorted(f"{k[0]}:{list(k[1])}"
                                                   for k in path.comms)}, root=0)
    if host.rank == 0:
        print("NCCL-RESULT " + json.dumps(everyone), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
