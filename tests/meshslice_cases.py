"""MeshSlice's distributed matmul against the unsliced one, on any communicator.

A case is a mesh shape, the matmul's shapes and transposes, and K; each of its MeshSlice
layouts (every dataflow, on both orders of the mesh dims, m on each dim of the m-group)
runs through the matmul op's own ``localize`` and kernel, as the executor calls them.
Every process draws the same global operands, runs on its shards, and compares its part
of the result with numpy's matmul of the whole operands; it also compares the bytes its
communicator counted with the op's ``comm`` hook (what the plan counts) and the number
of collective calls with 2K.

Used by tests/test_meshslice.py (SimulatedWorld threads) and
tests/mpi_scripts/meshslice_cases.py (real MPI ranks).
"""

from __future__ import annotations

import numpy as np

import distgraph as dg
from distgraph.passes.cost.formulas import collective_bytes
from distgraph.placement import DistAttr, ShardSpec
from distgraph.registry import KernelContext, LocalSite, get_op
from distgraph.spmd.meshslice import MatmulAxes, layouts

# (x shape, y shape, transpose_x, transpose_y): 2-D, batched x, x^T (dW), y^T (dX)
SHAPES = [((12, 24), (24, 36), False, False), ((2, 12, 24), (24, 36), False, False),
          ((24, 12), (24, 36), True, False), ((12, 24), (36, 24), False, True)]


def cases(world: int) -> list:
    """(mesh shape, x shape, y shape, tx, ty, K) for a world of 4 (2x2) or 6 (2x3, 3x2)."""
    meshes = {4: [(2, 2)], 6: [(2, 3), (3, 2)]}[world]
    return [(mesh, xs, ys, tx, ty, k) for mesh in meshes for xs, ys, tx, ty in SHAPES
            for k in (1, 2, 4)]


def run_case(comm, case) -> list:
    """One record per layout of the case on this rank: (layout, largest error, bytes the
    plan counts, bytes the communicator counted, collective calls, 2K)."""
    mesh_shape, xs, ys, tx, ty, k = case
    n = int(np.prod(mesh_shape))
    mesh = dg.ProcessMesh(np.arange(n).reshape(mesh_shape).tolist(), ["x", "y"])
    rng = np.random.default_rng(7)
    x, y = rng.normal(size=xs), rng.normal(size=ys)
    want = (np.swapaxes(x, -1, -2) if tx else x) @ (y.T if ty else y)
    attrs = {"transpose_x": tx, "transpose_y": ty, "meshslice": k}
    op = get_op("matmul")
    axes = MatmulAxes.of([xs, ys], attrs)
    out = []
    for lay in layouts([xs, ys], attrs, mesh):
        sx, sy, so = (DistAttr(mesh, ShardSpec(s.dims)) for s in lay.specs(axes, [xs, ys]))
        pid = comm.rank
        site = LocalSite(pid, (xs, ys), (sx, sy), (want.shape,), (so,),
                         ("float64", "float64"), tuple(sorted(attrs.items())))
        local, ctx = op.localize(dict(attrs), site)
        comm.reset_counters()
        got = op.kernel(KernelContext(np, comm=comm, **ctx),
                        x[sx.local_slices(xs, pid)], y[sy.local_slices(ys, pid)], **local)
        err = float(np.max(np.abs(got - want[so.local_slices(want.shape, pid)])))
        planned = sum(collective_bytes(kind, g, b) for kind, g, b in op.comm(site))
        calls = sum(comm.calls.values())
        out.append((str(lay), err, planned, comm.total_bytes_sent, calls, 2 * k))
    return out
