"""ProcessMesh propagation, the first step of completion: which mesh every op and Value
lives on.

A forward op is *held* to its ``shard_op`` mesh, else to the mesh of an annotated operand
(a parameter's ``shard_tensor`` places the ops that read it). The held meshes are the
pipeline stages, ordered along the data flow (:mod:`.stage_order`). Every other forward op
follows its inputs so that data only moves from an earlier stage to a later one: it takes
the mesh of its inputs' producers, and where two meet, the one that contains the other
(dp x mp meshes and their sub-meshes), else the *latest* stage. A residual add that reads
stage 0's activation and stage 1's therefore runs on stage 1. Ops without a placed input
(constants, ops on unannotated parameters or feeds) take the earliest stage of the ops that
read them, else the mesh of the op before them. Backward ops take their forward op's mesh,
update ops their parameter's (or the mesh they are annotated with, as ZeRO annotates an
update and the pads and slice around it); the step counter shared by all updates lives on
the union of their meshes.

Example::

    mesh, vmesh = assign_meshes(program, producer, consumers, default_mesh=None)
"""

from __future__ import annotations

from distgraph.errors import PlanError
from distgraph.ir import Program, Role
from distgraph.mesh import ProcessMesh
from distgraph.passes.completion.stage_order import FORWARD, ranks


def _pick(meshes: list, rank: dict, latest: bool) -> ProcessMesh:
    """The mesh that contains all the others; else the latest (or earliest) stage."""
    for m in meshes:
        if all(m.contains_mesh(o) for o in meshes):
            return m
    pos = [rank.get(m, len(rank)) for m in meshes]
    best = max(pos) if latest else min(pos)
    return meshes[pos.index(best)]


def _annotated(op) -> ProcessMesh | None:
    """The mesh an op is held to: its shard_op mesh, else an annotated operand's."""
    if op.annotation is not None:
        return op.annotation.mesh
    cands = [v.annotation.mesh for v in op.inputs + op.outputs if v.annotation]
    return _pick(cands, {}, latest=False) if cands else None


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

    forward = [k for k, op in enumerate(ops) if op.role in FORWARD]
    held = {k: m for k in forward if (m := _annotated(ops[k])) is not None}
    rank = ranks(ops, held)
    for k in forward:                      # along the data flow: the latest input stage
        op = ops[k]
        if k in held:
            set_op(k, held[k])
        else:
            cands = [vmesh[v.name] for v in op.inputs if v.name in vmesh]
            if cands:
                set_op(k, _pick(cands, rank, latest=True))
    for k in reversed(forward):            # the rest: the earliest stage that reads them
        if mesh[k] is None:
            cands = [mesh[c] for o in ops[k].outputs for c, _ in consumers.get(o.name, [])
                     if mesh[c] is not None]
            if cands:
                set_op(k, _pick(cands, rank, latest=False))
    first = min(rank, key=rank.get) if rank else default_mesh
    if first is None:
        raise PlanError("no ProcessMesh found: annotate at least one tensor with "
                        "dg.shard_tensor (or an op with dg.shard_op), or pass default_mesh")
    last = first
    for k in forward:                      # read by nothing placed: the op before's mesh
        if mesh[k] is None and ops[k].inputs:
            set_op(k, last)
        last = mesh[k] if mesh[k] is not None else last

    def sources_from_consumers():
        for k, op in enumerate(ops):
            for v in op.inputs:
                if v.name not in vmesh and mesh[k] is not None:
                    vmesh[v.name] = mesh[k]

    sources_from_consumers()                      # parameters and inputs
    index = {id(op): k for k, op in enumerate(ops)}
    for k, op in enumerate(ops):
        if op.role == Role.BACKWARD and op.forward_op is not None:
            set_op(k, mesh[index[id(op.forward_op)]] or first)
    for k, op in enumerate(ops):
        if op.role == Role.OPTIMIZE and op.annotation is not None:
            set_op(k, op.annotation.mesh)
        elif op.role == Role.OPTIMIZE and op.inputs and op.inputs[0].is_parameter:
            set_op(k, vmesh.get(op.inputs[0].name, first))
    update_meshes = [mesh[k] for k, op in enumerate(ops)
                     if op.role == Role.OPTIMIZE and mesh[k] is not None]
    for k, op in enumerate(ops):
        if op.role == Role.OPTIMIZE and mesh[k] is None:
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
