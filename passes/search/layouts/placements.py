"""Layouts of a tensor on a search mesh: every layout a source may take, the ways a
pending sum may be settled for the ops that follow, and the local shapes they leave.

A layout uses only mesh dims of size > 1 (a split over one process is no split), so the
``(w // 2, 2)`` meshes of the search at w = 2 offer what a 1-D mesh of 2 offers.
"""
from __future__ import annotations

import itertools

from distgraph.mesh import ProcessMesh
from distgraph.placement import ShardSpec
from distgraph.spmd import LETTERS, EinsumPlan, OpStrategy, entry_dims, entry_of

MESH_DIMS = "xyzw"           # names of the dims of a mesh the search makes


def without_unit_dims(spec: ShardSpec, mesh: ProcessMesh) -> ShardSpec:
    """``spec`` with the mesh dims of size 1 dropped: a split over one process is no split,
    and the layouts here use only mesh dims of size > 1 (a ``(w // 2, 2)`` mesh at w = 2)."""
    def kept(entry):
        names = tuple(n for n in entry_dims(entry) if mesh.dim_size(n) > 1)
        return entry_of(names)
    return ShardSpec(tuple(kept(e) for e in spec.dims),
                     frozenset(n for n in spec.partial if mesh.dim_size(n) > 1))


def layouts(shape, mesh: ProcessMesh) -> list:
    """Every layout of a tensor of ``shape`` on ``mesh`` (replicated first), as one-output
    OpStrategy records: each mesh dim of size > 1 splits a dim it divides, or none."""
    ndim = len(shape)
    word = LETTERS[:ndim]
    plan = EinsumPlan(f"{word}->{word}", [tuple(shape)], [tuple(shape)], mesh)
    return [OpStrategy(str(s.out_specs[0]), (), s.out_specs, (), s.out_local_shapes,
                       s.flops_fraction) for s in plan.strategies()]


def settlements(s, out_shapes, mesh, summed=None) -> list:
    """The hints a strategy offers its followers, one tuple of output layouts each: the
    outputs as made, except that a Partial output may be settled by an all-reduce (the
    partial mesh dims left unsplit) or a reduce-scatter onto one of its unsplit dims, or,
    where a linear op reads it (``summed[j]``), be left pending for that op to add."""
    options = []
    for j, (spec, shape) in enumerate(zip(s.out_specs, out_shapes)):
        if not spec.partial:
            options.append([spec])
            continue
        ways = [ShardSpec(spec.dims)] + ([spec] if summed and summed[j] else [])
        for m in sorted(spec.partial):
            size = mesh.dim_size(m)
            for d, (entry, n) in enumerate(zip(spec.dims, shape)):
                if entry is None and n % size == 0 and len(spec.partial) == 1:
                    dims = list(spec.dims)
                    dims[d] = m
                    ways.append(ShardSpec(dims))
        options.append(ways)
    return [tuple(c) for c in itertools.product(*options)]


def local_shape(spec: ShardSpec, shape, mesh: ProcessMesh) -> tuple:
    sizes = dict(zip(mesh.dim_names, mesh.shape))
    out = []
    for entry, n in zip(spec.dims, shape):
        for m in (() if entry is None else (entry,) if isinstance(entry, str) else entry):
            n //= sizes[m]
        out.append(n)
    return tuple(out)
