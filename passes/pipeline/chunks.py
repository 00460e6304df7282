"""Pipeline chunks: the stage (torch's stage index) every op of a planned program runs in.

Without virtual stages a chunk is a stage: a forward op runs in the chunk of the stage its
mesh is in (``Plan.stages``, one mesh per stage in data-flow order). With
``Strategy(virtual_stages=v)``, or ``schedule="ZBV"`` (v = 2), the forward is cut along
the data flow into ``S·v`` chunks of equal work at layer boundaries (a *layer* is a run
of forward ops under one top-level sublayer of the model, ``blocks.3`` or ``lm_head``;
ops outside any sublayer join the layer before them): chunk ``c`` runs on stage mesh
``c mod S``, or under ZBV in a V (process ``p`` holds chunks ``p`` and ``2S-1-p``).
:func:`place_chunks` rewrites a program's annotations so that completion puts every op
of chunk ``c`` on its mesh (the stage meshes must then have one shape and dim names, so
that a spec means the same on each).

Every other op belongs with the forward op it differentiates (``op.forward_op``); one
without (a sum of gradient contributions) with the earliest chunk on its mesh among the
producers of its operands, else the latest on its mesh. Update ops belong to no chunk
(None): they run once per step, after every chunk.

Example::

    cut = forward_chunks(program, count=8)          # op index -> chunk (forward ops)
    place_chunks(fresh_copy, stages, cut, meshes)   # then complete(fresh_copy)
    chunk_of_ops(completed, meshes, cut)            # every op's chunk
"""

from __future__ import annotations

from distgraph.annotation import OpAnnotation
from distgraph.errors import PlanError
from distgraph.ir import Role
from distgraph.passes.completion.stage_order import stage_of_mesh
from distgraph.placement import DistAttr
from distgraph.registry import op_flops

FORWARD = (Role.FORWARD, Role.LOSS)


def chunk_meshes(stages: tuple, virtual: int, v_shape: bool) -> tuple:
    """The mesh of each chunk: loop placement (c on stage c mod S) or the V."""
    n = len(stages)
    if v_shape:
        return tuple(stages[c if c < n else 2 * n - 1 - c] for c in range(2 * n))
    return tuple(stages[c % n] for c in range(n * virtual))


def _layer_key(path: str):
    if not path:
        return None
    parts = path.split(".")
    return tuple(parts[:2]) if len(parts) > 1 and parts[1].isdigit() else (parts[0],)


def layer_units(program) -> list:
    """The forward ops cut at layer boundaries: a list of lists of op indices."""
    units: list = []
    pending: list = []
    key = object()
    for k, op in enumerate(program.ops):
        if op.role not in FORWARD:
            continue
        this = _layer_key(op.layer)
        if this is None or this == key:
            (units[-1] if units else pending).append(k)
            continue
        units.append(pending + [k])
        pending, key = [], this
    if pending:
        if units:
            units[-1].extend(pending)
        else:
            units.append(pending)
    return units


def _cut(work: list, count: int) -> list:
    """Split ``work`` (per unit) into ``count`` consecutive groups: the least largest
    group's work, then the most even (least sum of squares). [(first, last)]."""
    n = len(work)
    prefix = [0.0]
    for w in work:
        prefix.append(prefix[-1] + w)
    inf = (float("inf"), float("inf"))
    best = [[inf] * (count + 1) for _ in range(n + 1)]
    back = [[-1] * (count + 1) for _ in range(n + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, n + 1):
        for r in range(1, min(k, count) + 1):
            for i in range(r - 1, k):
                prev = best[i][r - 1]
                if prev == inf:
                    continue
                w = prefix[k] - prefix[i]
                value = (max(prev[0], w), prev[1] + w * w)
                if value < best[k][r]:
                    best[k][r], back[k][r] = value, i
    out, k = [], n
    for r in range(count, 0, -1):
        i = back[k][r]
        out.append((i, k - 1))
        k = i
    return out[::-1]


def forward_chunks(program, count: int, why: str) -> dict:
    """{forward op index: chunk} cutting the forward into ``count`` chunks of equal work
    at layer boundaries. ``why`` names the option that asks for it (for errors)."""
    units = layer_units(program)
    if len(units) < count:
        raise PlanError(f"{why} cuts the forward into {count} chunks at layer boundaries, "
                        f"but the model has only {len(units)} layers along its data flow; "
                        f"use fewer virtual stages or fewer stages")
    work = [sum(op_flops(program.ops[k]) for k in unit) or 1.0 for unit in units]
    out = {}
    for c, (a, b) in enumerate(_cut(work, count)):
        for unit in units[a:b + 1]:
            for k in unit:
                out[k] = c
    return out


def place_chunks(program, stages: tuple, cut: dict, meshes: tuple) -> None:
    """Annotate ``program`` (not yet completed) so that the ops of chunk ``c`` (``cut``,
    from :func:`forward_chunks`) run on ``meshes[c]``: every forward op gets its chunk's
    mesh; an annotated value moves to the mesh of the chunk that makes it (parameters and
    feeds: that first reads it), keeping its spec."""
    first = stages[0]
    for mesh in stages[1:]:
        if mesh.shape != first.shape or mesh.dim_names != first.dim_names:
            raise PlanError(f"virtual stages move layers between the stage meshes, so the "
                            f"meshes need one shape and dim names; {first} and {mesh} differ")
    made_in, read_in = {}, {}
    for k, op in enumerate(program.ops):
        c = cut.get(k)
        if c is None:
            continue
        for o in op.outputs:
            made_in[o.name] = c
        for v in op.inputs:
            read_in.setdefault(v.name, c)
        old = op.annotation
        if old is not None and old.mesh not in stages:
            raise PlanError(f"op {op.type} ({op.layer or 'model'}) is placed on {old.mesh}, "
                            f"which is no stage mesh; with virtual stages place the model's "
                            f"parts on the stage meshes {', '.join(map(str, stages))}")
        op.annotation = OpAnnotation(meshes[c], old.in_specs if old is not None else ())
    for v in program.values.values():
        c = made_in.get(v.name, read_in.get(v.name))
        if v.annotation is None or c is None:
            continue
        if v.annotation.mesh not in stages:
            raise PlanError(f"{v.name} is annotated on {v.annotation.mesh}, which is no stage "
                            f"mesh; with virtual stages annotate on the stage meshes "
                            f"{', '.join(map(str, stages))}")
        v.annotation = DistAttr(meshes[c], v.annotation.spec)


def chunk_of_ops(program, meshes: tuple, cut: dict | None = None) -> tuple:
    """Every op's chunk (module docstring); ``cut`` from :func:`forward_chunks`, or None:
    a forward op's chunk is its mesh's."""
    ops = program.ops
    chunk: list = [None] * len(ops)
    for k, op in enumerate(ops):
        if op.role in FORWARD:
            chunk[k] = cut[k] if cut is not None else stage_of_mesh(meshes, op.dist_attr.mesh)
    index = {id(op): k for k, op in enumerate(ops)}
    producer = {o.name: k for k, op in enumerate(ops) for o in op.outputs}
    on_mesh = {}
    for c, mesh in enumerate(meshes):
        on_mesh.setdefault(mesh, []).append(c)
    for k, op in enumerate(ops):
        if op.role is not Role.BACKWARD:
            continue
        if op.forward_op is not None and chunk[index[id(op.forward_op)]] is not None:
            chunk[k] = chunk[index[id(op.forward_op)]]
            continue
        mine = on_mesh.get(op.dist_attr.mesh)
        if not mine and cut is None:          # on a sub-mesh of its stage's mesh
            mine = [stage_of_mesh(meshes, op.dist_attr.mesh)]
        if not mine:
            raise PlanError(f"backward op {op.type} ({op.layer or 'model'}) runs on "
                            f"{op.dist_attr.mesh}, which no stage of the forward uses")
        made = [chunk[producer[v.name]] for v in op.inputs if v.name in producer
                and chunk[producer[v.name]] in mine]
        chunk[k] = min(made) if made else mine[-1]
    return tuple(chunk)
