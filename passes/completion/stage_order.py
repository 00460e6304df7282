"""Pipeline stages: the meshes of the forward program in data-flow order, and the check
that data only moves from an earlier stage to a later one.

A *stage* is a set of processes: the meshes of the forward ops, a mesh and the meshes
within it joined into one (a mesh and its sub-meshes, or one process set under two sets
of dim names, are one stage, run on the largest of them; so dp x mp meshes with
sub-meshes are no pipeline). Meshes that only partly overlap stay apart: a process of
both runs its actions of the two stages in one order. A *stage
edge* A -> B is a forward (or loss) op on stage A whose result an op on stage B reads. Ops
without a mesh are looked through: an edge runs from the nearest ops with a mesh before
them. Reading a parameter or a fed value is no edge (it exists before the step).

The stages are ordered along these edges (ties: the stage used first in program order
comes first). When the edges form a cycle there is no such order: a stage would wait for
a later one within a micro-batch, and a pipeline of such stages can never finish.
:func:`stages` then raises a PlanError naming the ops of each edge of the cycle.

Example::

    stages(program)      # (ProcessMesh([0]), ProcessMesh([1])), or PlanError on a cycle
"""

from __future__ import annotations

from dataclasses import dataclass

from distgraph.errors import PlanError
from distgraph.ir import Program, Role

FORWARD = (Role.FORWARD, Role.LOSS)


@dataclass(frozen=True)
class StageEdge:
    """Data moving from stage ``src`` to stage ``dst`` (indices into the list of stage
    groups): op ``producer`` (an index into the program's ops) makes a value that op
    ``consumer`` reads, possibly through ops without a mesh in between."""

    src: int
    dst: int
    producer: int
    consumer: int


def groups(meshes) -> list:
    """``meshes`` joined into stages: lists of meshes, a mesh and those within it in one
    list; stages and the meshes in each in order of first appearance in ``meshes``."""
    seen = list(dict.fromkeys(meshes))
    root = list(range(len(seen)))        # union-find; a group's root is its first mesh

    def find(i):
        while root[i] != i:
            i = root[i]
        return i

    procs = [set(m.process_ids) for m in seen]
    for i in range(len(seen)):
        for j in range(i):
            if procs[i] <= procs[j] or procs[j] <= procs[i]:
                a, b = find(i), find(j)
                root[max(a, b)] = min(a, b)
    out: dict = {}
    for i, m in enumerate(seen):
        out.setdefault(find(i), []).append(m)
    return list(out.values())


def stage_edges(ops: list, stage_of: dict) -> dict:
    """``{(src, dst): StageEdge}`` (the first such edge in program order) between the
    stages of the forward ops in ``stage_of`` (op index -> stage index); forward ops not
    in ``stage_of`` are looked through."""
    upstream: dict = {}              # value name -> {stage: nearest producer op on it}
    edges: dict = {}
    for k, op in enumerate(ops):
        if op.role not in FORWARD:
            continue
        before: dict = {}
        for v in op.inputs:
            for st, p in upstream.get(v.name, {}).items():
                before.setdefault(st, p)
        mine = stage_of.get(k)
        if mine is None:
            after = before
        else:
            for src, p in before.items():
                if src != mine:
                    edges.setdefault((src, mine), StageEdge(src, mine, p, k))
            after = {mine: k}
        for o in op.outputs:
            upstream[o.name] = after
    return edges


def order(count: int, edges) -> list:
    """Stages ``0 .. count-1`` (numbered by first use) sorted along ``edges`` ((src, dst)
    pairs): a stage comes after every stage with an edge into it; ties, and the stages of
    a cycle, keep their order of first use."""
    rest = list(range(count))
    into = {s: {a for a, b in edges if b == s} for s in rest}
    out: list = []
    while rest:
        ready = next((s for s in rest if not into[s] - set(out)), rest[0])
        out.append(ready)
        rest.remove(ready)
    return out


def find_cycle(edges: dict) -> list | None:
    """The StageEdges of one cycle among ``edges`` (as from :func:`stage_edges`), in the
    order data flows around it, or None if there is none."""
    succ: dict = {}
    for e in edges.values():
        succ.setdefault(e.src, []).append(e)
    state: dict = {}                   # stage -> "open" while on the path, "done" after

    def visit(s, path):               # path: the edges from the root to s
        state[s] = "open"
        for e in succ.get(s, []):
            if state.get(e.dst) == "open":       # e.dst is on the path: a cycle
                start = next(i for i, p in enumerate(path) if p.src == e.dst)
                return path[start:] + [e]
            if e.dst not in state:
                found = visit(e.dst, path + [e])
                if found:
                    return found
        state[s] = "done"
        return None

    for s in sorted(succ):
        if s not in state:
            found = visit(s, [])
            if found:
                return found
    return None


def ranks(ops: list, mesh_of: dict) -> dict:
    """``{mesh: position of its stage along the data flow}`` for the meshes of ``mesh_of``
    (op index -> mesh; other forward ops are looked through), cycles or not."""
    stage_groups = groups(mesh_of[k] for k in sorted(mesh_of))
    index = {m: i for i, g in enumerate(stage_groups) for m in g}
    edges = stage_edges(ops, {k: index[m] for k, m in mesh_of.items()})
    position = {s: i for i, s in enumerate(order(len(stage_groups), edges))}
    return {m: position[index[m]] for m in index}


def stages(program: Program) -> tuple:
    """The stages of the completed ``program``'s forward ops in data-flow order, one mesh
    each: the largest mesh of its group (see the module docstring); a PlanError names the
    ops and stages of a cycle."""
    ops = program.ops
    mesh_of = {k: op.dist_attr.mesh for k, op in enumerate(ops) if op.role in FORWARD}
    stage_groups = groups(mesh_of.values())
    index = {m: i for i, g in enumerate(stage_groups) for m in g}
    edges = stage_edges(ops, {k: index[m] for k, m in mesh_of.items()})
    cycle = find_cycle(edges)
    if cycle:
        raise PlanError(_cycle_message(ops, cycle, stage_groups))
    return tuple(_largest(stage_groups[s]) for s in order(len(stage_groups), edges))


def stage_of_mesh(stages: tuple, mesh) -> int:
    """The index in ``stages`` (as from :func:`stages`) of the stage ``mesh`` runs in."""
    if mesh in stages:
        return stages.index(mesh)
    mine = set(mesh.process_ids)
    for s, stage in enumerate(stages):
        if mine <= set(stage.process_ids):
            return s
    raise PlanError(f"internal error: {mesh} is in no stage of {stages}; please report it")


def _largest(group: list):
    """The mesh of a stage: the group's mesh that holds every process of the others."""
    top = max(group, key=lambda m: len(m.process_ids))
    if not set().union(*(m.process_ids for m in group)) <= set(top.process_ids):
        raise PlanError(f"the meshes {', '.join(map(str, group))} share processes but none "
                        f"holds all the others' processes, so they are neither one pipeline "
                        f"stage nor separate ones; place them on one mesh and its sub-meshes")
    return top


def _describe(op) -> str:
    return f"{op.type} ({op.layer or 'model'})"


def _cycle_message(ops: list, cycle: list, stage_groups: list) -> str:
    hops = "; ".join(f"stage {e.src} -> {e.dst}: {_describe(ops[e.producer])} "
                     f"feeds {_describe(ops[e.consumer])}" for e in cycle)
    back = next(e for e in cycle if e.src > e.dst)
    listed = ", ".join(f"{i}: {' + '.join(map(str, g))}" for i, g in enumerate(stage_groups))
    return (f"the pipeline stages form a cycle, so the plan could never finish (a stage "
            f"would wait for a later one): {hops}. Stages by first use: {listed}. In the "
            f"forward pass data must only move to a later stage: place "
            f"{_describe(ops[back.consumer])} on stage {back.src} or later (its shard_op, or "
            f"its parameters' shard_tensor), or leave it unannotated so that it follows its "
            f"inputs")
