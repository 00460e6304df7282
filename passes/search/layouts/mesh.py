"""The mesh the intra-op search plans a whole program on (``Strategy(auto_mode="full")``
without stages).

With annotations, the search plans on the one ProcessMesh they use (and keeps them: they
are hard constraints); without, on a ProcessMesh of the shape of the cluster's device
mesh (dims ``x``, ``y``, ... in the device mesh's order, so ``x`` of a machines x devices
mesh runs across the machines), one process per device. Process p runs on the mesh's
p-th device in row-major order: the search priced each collective on those devices'
links, so the planner's rank mapping is that one.

Example::

    mesh, device_of = search_mesh(program, cluster)
"""

from __future__ import annotations

import math

from distgraph.errors import PlanError
from distgraph.mesh import ProcessMesh
from distgraph.passes.search.layouts.space import MESH_DIMS


def search_mesh(program, cluster) -> tuple[ProcessMesh, dict]:
    """(the mesh the search plans on, process -> device global id)."""
    meshes = {op.annotation.mesh for op in program.ops if op.annotation is not None}
    meshes |= {v.annotation.mesh for v in program.values.values() if v.annotation is not None}
    if len(meshes) > 1:
        raise PlanError(f"Strategy(auto_mode='full') searches one mesh, but the annotations "
                        f"use {len(meshes)}: {', '.join(sorted(map(str, meshes)))}; annotate "
                        "on one mesh, or use auto_mode='semi' to place stages by hand")
    devices = _device_mesh(cluster)
    if meshes:
        mesh = meshes.pop()
        if mesh.size > len(devices.ids):
            raise PlanError(f"the annotations use {mesh} ({mesh.size} processes), but device "
                            f"mesh {devices.name} of the cluster has {len(devices.ids)} devices: "
                            f"launch {mesh.size} ranks (`distgraph run -n {mesh.size} ...`), "
                            f"give a cluster with {mesh.size} devices, or annotate on a mesh of "
                            f"{len(devices.ids)}")
        return mesh, {p: devices.ids[i] for i, p in enumerate(mesh.process_ids)}
    n = len(devices.ids)
    mesh = ProcessMesh([[*range(n)]][0], dim_names=["x"]) if len(devices.shape) == 1 else \
        ProcessMesh(_nested_ids(devices.shape), dim_names=list(MESH_DIMS[:len(devices.shape)]))
    return mesh, {p: devices.ids[p] for p in range(n)}


def _nested_ids(shape):
    ids = list(range(math.prod(shape)))
    for size in reversed(shape[1:]):
        ids = [ids[i:i + size] for i in range(0, len(ids), size)]
    return ids


def _device_mesh(cluster):
    if cluster is None:
        raise PlanError("Strategy(auto_mode='full') searches a plan for a cluster: pass "
                        "cluster=dg.Cluster.from_file(...) or dg.Cluster.local(N)")
    meshes = cluster.device_meshes
    if len(meshes) > 1:
        raise PlanError(f"cluster {cluster.name or '(unnamed)'} has {len(meshes)} device meshes "
                        f"({', '.join(m.name for m in meshes)}); the intra-op search plans on "
                        "one: use Strategy(auto_mode='full', pipeline=True) to place stages "
                        "on several")
    if len(meshes[0].shape) > len(MESH_DIMS):
        raise PlanError(f"device mesh {meshes[0].name} has {len(meshes[0].shape)} dims; the "
                        f"search names at most {len(MESH_DIMS)}")
    return meshes[0]
