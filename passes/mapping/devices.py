"""Which device each rank runs on: the plan's :class:`~distgraph.plan.devices.DeviceAssignment`.

A plan's ranks own the first devices of its cluster (rank r the r-th; this machine's CPU
cores without a cluster). The assignment then says the array backend and each group's
communicator (:mod:`distgraph.plan.devices`).

Example::

    >>> from distgraph.resources.cluster import local_gpus
    >>> from distgraph.resources.gpus import GPUInfo
    >>> one = assign_devices(local_gpus(2, [GPUInfo(0, "H100", 80.0, (9, 0))]), 2)
    >>> one.backend, one.route((0, 1))
    ('cupy', 'MPI (host staging)')
"""

from __future__ import annotations

from distgraph.errors import TooFewDevicesError
from distgraph.plan.devices import DeviceAssignment, RankDevice


def assign_devices(cluster, world_size: int) -> DeviceAssignment:
    """The devices of a job of ``world_size`` ranks on ``cluster`` (None: this machine's
    CPU cores): rank r on the cluster's r-th compute device."""
    if cluster is None:
        return DeviceAssignment(tuple(RankDevice(r, "CPU", r, 0, "localhost", r)
                                      for r in range(world_size)))
    devices = cluster.devices
    if len(devices) < world_size:
        raise TooFewDevicesError(range(world_size), len(devices))
    hosts = {m.id: m.hostname for m in cluster.machines}
    return DeviceAssignment(tuple(
        RankDevice(r, d.type, d.local_id, d.machine_id, hosts[d.machine_id], d.global_id)
        for r, d in enumerate(devices[:world_size])))
