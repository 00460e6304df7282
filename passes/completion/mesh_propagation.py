"""ProcessMesh propagation, the first step of completion: which mesh every op and Value
lives on.

An op takes, in order of preference: its ``shard_op`` mesh; the mesh of an annotated
operand; the meshes of its inputs' producers (where two meet, the one that contains the
other); the nearest resolved op before it (after it, for the ops ahead of every
annotation). Ops without inputs (constants) take their first consumer's mesh, backward
ops their forward op's, update ops their parameter's; the step counter shared by all
updates lives on the union of their meshes.

Example::

    mesh, vmesh = assign_meshes(program, producer, consumers, default_mesh=None)
"""

from __future__ import annotations

from distgraph.errors import PlanError
from distgraph.ir import Program
from distgraph.mesh import ProcessMesh


def _pick(meshes: list) -> ProcessMesh:
    for m in meshes:
        if all(m.contains_mesh(o) for o in meshes):
            return m
    return meshes[0]


def assign_meshes(program: Program, producer: dict, consumers: dict,
                  default_mesh: ProcessMesh | None) -> tuple[list, dict]:
    """Each op's mesh and each Value's mesh (see the module docstring)."""
    ops = program.ops
    n = len(ops)
    mesh: list = [None] * n
    vmesh: dict = {v.name: v.annotation.mesh for v in program.values.values()
                   if v.annotation is not None and v.name not in producer}

    def set_op(k, m):
        mesh[k] = m
        for o in ops[k].outputs:
            vmesh[o.name] = m

    forward = [k for k, op in enumerate(ops) if op.role in ("forward", "loss")]
    last = None
    for k in forward:
        op = ops[k]
        if not op.inputs and op.annotation is None:
            continue                      # constants: from their consumer, below
        if op.annotation is not None:
            m = op.annotation.mesh
        else:
            cands = [v.annotation.mesh for v in op.inputs + op.outputs if v.annotation]
            if not cands:
                cands = [vmesh[v.name] for v in op.inputs if v.name in vmesh]
            m = _pick(cands) if cands else last
        if m is not None:
            set_op(k, m)
            last = m
    first = next((mesh[k] for k in forward if mesh[k] is not None), default_mesh)
    if first is None:
        raise PlanError("no ProcessMesh found: annotate at least one tensor with "
                        "dg.shard_tensor (or an op with dg.shard_op), or pass default_mesh")
    for k in forward:
        if mesh[k] is None and ops[k].inputs:
            set_op(k, first)
    def sources_from_consumers():
        for k, op in enumerate(ops):
            for v in op.inputs:
                if v.name not in vmesh and mesh[k] is not None:
                    vmesh[v.name] = mesh[k]

    sources_from_consumers()                      # parameters and inputs
    index = {id(op): k for k, op in enumerate(ops)}
    for k, op in enumerate(ops):
        if op.role == "backward" and op.forward_op is not None:
            set_op(k, mesh[index[id(op.forward_op)]] or first)
    for k, op in enumerate(ops):
        if op.role == "optimize" and op.inputs and op.inputs[0].is_parameter:
            set_op(k, vmesh.get(op.inputs[0].name, first))
    update_meshes = [mesh[k] for k, op in enumerate(ops)
                     if op.role == "optimize" and mesh[k] is not None]
    for k, op in enumerate(ops):
        if op.role == "optimize" and mesh[k] is None:
            set_op(k, _union(update_meshes) if update_meshes else first)
    for k in reversed(range(n)):                # constants and the rest: first consumer
        if mesh[k] is None:
            cons = [c for o in ops[k].outputs for c, _ in consumers.get(o.name, [])]
            set_op(k, mesh[min(cons)] if cons and mesh[min(cons)] is not None else first)
    sources_from_consumers()                      # optimizer states
    for v in program.values.values():
        vmesh.setdefault(v.name, first)
    return mesh, vmesh


def _union(meshes) -> ProcessMesh:
    first = meshes[0]
    if all(m == first for m in meshes):
        return first
    ids = sorted({p for m in meshes for p in m.process_ids})
    return ProcessMesh(ids, dim_names=["all"])
