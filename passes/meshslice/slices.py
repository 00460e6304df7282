"""MeshSlice in the planner: turning it on, choosing each matmul's number of slices K,
and saying which matmuls run it.

- :func:`enable` gives every op that takes a ``meshslice`` attribute (matmul) the
  setting of ``Strategy(meshslice=...)`` where it has none (``shard_op(...,
  meshslice=...)`` sets it per layer): completion and the search may then choose
  MeshSlice's layouts for it (:mod:`distgraph.spmd.meshslice`).
- :func:`assign_slices` runs on the completed program, once processes have devices: a
  matmul that runs as MeshSlice with ``"auto"`` gets the K that the cost model
  (:func:`distgraph.passes.cost.prices.best_overlap`, on its mesh's first process) finds
  fastest among those its layout allows; the search priced its strategy with the same K.
- :func:`uses` lists the matmuls that run it (``Plan.explain(full=True)`` prints them).

Example::

    enable(program, True)                     # Strategy(meshslice=True)
    complete(program)
    assign_slices(program, cluster, device_of)
    for use in uses(program):
        print(use)      # #7 matmul blocks.0.mlp.fc1 (forward): OS over (x, y), K=4, ...
"""

from __future__ import annotations


from distgraph.errors import PlanError
from distgraph.ops.meshslice import LocalMeshSlice
from distgraph.placement import DistAttr
from distgraph.registry import LocalSite, TensorType, get_op, takes_attr
from distgraph.passes.cost.prices import Rings, best_overlap
from distgraph.plan.plan import SlicedMatmul


def enable(program, setting) -> None:
    """``Strategy(meshslice=setting)``: True ("auto") or K on every op that takes it and
    has no setting of its own."""
    value = "auto" if setting is True else int(setting)
    for op in program.ops:
        if takes_attr(op.type, "meshslice") and op.attrs.get("meshslice") is None:
            op.attrs["meshslice"] = value


def check_meshes(program, strategy) -> None:
    """PlanError when ``Strategy(meshslice=...)`` is on but no matmul runs on a mesh with
    two dims of size > 1 (MeshSlice is a 2-D GeMM)."""
    if not strategy.meshslice:
        return
    meshes = {op.dist_attr.mesh for op in program.ops if takes_attr(op.type, "meshslice")}
    if not any(sum(1 for n in m.shape if n > 1) >= 2 for m in meshes):
        shown = ", ".join(sorted(map(str, meshes))) or "none"
        raise PlanError(f"Strategy(meshslice={strategy.meshslice!r}) runs matmuls as 2-D "
                        f"GeMMs, but no matmul of this plan runs on a mesh with two dims of "
                        f"size > 1 (meshes: {shown}); annotate a 2-D mesh such as "
                        "ProcessMesh([[0, 1], [2, 3]], dim_names=['x', 'y']), or leave "
                        "meshslice off")


def local_op(op, pid: int):
    """(localized attrs, local input TensorTypes) of a completed op on process ``pid``."""
    da = op.dist_attr
    site = LocalSite(pid, tuple(v.shape for v in op.inputs),
                     tuple(DistAttr(da.mesh, s) for s in da.input_specs),
                     tuple(o.shape for o in op.outputs),
                     tuple(DistAttr(da.mesh, s) for s in da.output_specs),
                     tuple(v.dtype for v in op.inputs), tuple(sorted(op.attrs.items())))
    attrs, _ = get_op(op.type).localize(dict(op.attrs), site)
    ins = [TensorType(a.local_shape(v.shape), v.dtype)
           for a, v in zip(site.in_attrs, op.inputs)]
    return attrs, ins


def uses(program) -> list:
    """The matmuls of a completed program that run as MeshSlice."""
    found = []
    for k, op in enumerate(program.ops):
        if op.attrs.get("meshslice") is None or op.dist_attr is None:
            continue
        attrs, _ = local_op(op, op.dist_attr.mesh.process_ids[0])
        if isinstance(attrs.get("meshslice"), LocalMeshSlice):
            found.append(SlicedMatmul(k, op, attrs["meshslice"]))
    return found


def assign_slices(program, cluster, device_of) -> int:
    """Give every matmul that runs as MeshSlice with ``"auto"`` the number of slices the
    cost model finds fastest on ``cluster`` (``device_of(process) -> device global
    id``); a K fixed by the strategy stays (its layouts were chosen among those it
    divides). Returns how many it gave."""
    given = 0
    rings = Rings(cluster, device_of)
    for use in uses(program):
        op = use.op
        if op.attrs["meshslice"] != "auto":
            continue
        pid = op.dist_attr.mesh.process_ids[0]
        attrs, ins = local_op(op, pid)
        ways = get_op(op.type).overlap(attrs, ins)
        device = cluster.device(device_of(pid))
        mesh = op.dist_attr.mesh
        best, _, _ = best_overlap(ways, device, lambda dim: rings.along(mesh, pid, dim))
        op.attrs["meshslice"] = best.slices
        given += 1
    return given
