"""Reshard cases and oracles shared by tests/test_reshard.py and its MPI run.

As a script (``mpiexec -n 4 python -m distgraph.runtime.launch.bootstrap reshard_cases.py``)
it plans and executes a fixed sample of cases on real MPI ranks, checks every result and
every step's byte counters on rank 0, and prints ``reshard-mpi OK <n> cases``.

A case is drawn through a ``draw`` object with ``choice(seq)`` and ``perm(seq)`` so that
hypothesis (shrinkable) and a seeded numpy generator share one generator.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from distgraph.mesh import ProcessMesh
from distgraph.passes.reshard import plan_reshard
from distgraph.placement import DistAttr, ShardSpec
from distgraph.runtime.comm.base import COUNTED_KINDS
from distgraph.runtime.execution.reshard import apply_step

MESH_NAMES = ("x", "y", "z")


def mesh_shapes(max_procs: int) -> list[tuple[int, ...]]:
    return [s for nd in (1, 2, 3) for s in itertools.product(range(1, 5), repeat=nd)
            if math.prod(s) <= max_procs]


class RngDraw:
    """``draw`` backed by a numpy Generator."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def choice(self, seq):
        seq = list(seq)
        return seq[int(self.rng.integers(len(seq)))]

    def perm(self, seq):
        seq = list(seq)
        return [seq[i] for i in self.rng.permutation(len(seq))]


def draw_mesh(draw, n_procs: int) -> ProcessMesh:
    shape = draw.choice(mesh_shapes(n_procs))
    ids = draw.perm(range(n_procs))[:math.prod(shape)]
    names = draw.perm(MESH_NAMES)[:len(shape)]
    return ProcessMesh(np.array(ids).reshape(shape), names)


def draw_spec(draw, mesh: ProcessMesh, ndim: int) -> ShardSpec:
    """Each mesh dim (in a random order, which fixes tuple order) is R, P or S(d)."""
    dims = [[] for _ in range(ndim)]
    partial = []
    for name in draw.perm(mesh.dim_names):
        how = draw.choice(["R", "P"] + list(range(ndim)))
        if how == "P":
            partial.append(name)
        elif how != "R":
            dims[how].append(name)
    return ShardSpec([tuple(d) for d in dims], partial)


def draw_case(draw, n_procs: int):
    """(src DistAttr, dst DistAttr, global shape): same mesh half of the time."""
    src_mesh = draw_mesh(draw, n_procs)
    dst_mesh = src_mesh if draw.choice([True, False]) else draw_mesh(draw, n_procs)
    ndim = draw.choice([1, 2, 3])
    src_spec = draw_spec(draw, src_mesh, ndim)
    dst_spec = draw_spec(draw, dst_mesh, ndim)
    src, dst = DistAttr(src_mesh, src_spec), DistAttr(dst_mesh, dst_spec)
    shape = tuple(math.lcm(src.parts(i), dst.parts(i)) * draw.choice([1, 2])
                  for i in range(ndim))
    return src, dst, shape


def make_locals(attr: DistAttr, full: np.ndarray, seed: int = 0) -> dict:
    """Local arrays of ``full`` laid out as ``attr``; for Partial mesh dims the pieces
    are random integers except the coordinate-0 piece, which makes the sum exact.
    Replicas (processes differing only along unused mesh dims) get equal pieces."""
    rng = np.random.default_rng(seed)
    mesh, partial = attr.mesh, attr.spec.partial
    used = set(attr.spec.mesh_dims())
    by_coord = {mesh.coord(p): p for p in mesh.process_ids}

    def representative(p):
        return by_coord[tuple(0 if n not in used else c
                              for n, c in zip(mesh.dim_names, mesh.coord(p)))]

    reps = [p for p in mesh.process_ids if representative(p) == p]
    pieces = {p: full[attr.local_slices(full.shape, p)].copy() for p in reps}
    if partial:
        kept = [i for i, n in enumerate(mesh.dim_names) if n not in partial]
        groups: dict = {}
        for p in reps:
            groups.setdefault(tuple(mesh.coord(p)[i] for i in kept), []).append(p)
        for members in groups.values():
            anchor = next(p for p in members
                          if all(mesh.coord(p)[mesh.dim_index(n)] == 0 for n in partial))
            for p in members:
                if p != anchor:
                    pieces[p] = rng.integers(-4, 5, size=pieces[p].shape).astype(full.dtype)
                    pieces[anchor] = pieces[anchor] - pieces[p]
    return {p: pieces[representative(p)].copy() for p in mesh.process_ids}


def reconstruct(attr: DistAttr, shape, locals_: dict) -> np.ndarray:
    """The global tensor from the locals of ``attr``; checks that replicas agree."""
    mesh = attr.mesh
    used = set(attr.spec.mesh_dims())
    replicated = [i for i, n in enumerate(mesh.dim_names) if n not in used]
    out = np.zeros(shape, dtype=np.float64)
    by_coord = {mesh.coord(p): p for p in mesh.process_ids}
    for p in mesh.process_ids:
        c = list(mesh.coord(p))
        for i in replicated:
            c[i] = 0
        rep = by_coord[tuple(c)]
        if rep == p:
            out[attr.local_slices(shape, p)] += locals_[p]
        elif not np.array_equal(locals_[p], locals_[rep]):
            raise AssertionError(f"replicas {p} and {rep} of {attr} differ")
    return out


def run_steps(steps, local, comm, pid, ranks=None):
    """Apply ``steps`` one by one; returns (final local, per-step counter deltas)."""
    deltas = []
    for step in steps:
        before = dict(comm.bytes_sent)
        local = apply_step(step, local, comm, pid, ranks)
        deltas.append({k: comm.bytes_sent[k] - before[k] for k in COUNTED_KINDS})
    return local, deltas


def check_counters(steps, deltas_by_pid: dict) -> None:
    """Each process's counters moved by exactly the planned bytes, under the step's kind."""
    for i, step in enumerate(steps):
        for pid, deltas in deltas_by_pid.items():
            got = deltas[i]
            want = {k: 0.0 for k in COUNTED_KINDS}
            if step.kind in COUNTED_KINDS:
                want[step.kind] = step.bytes_sent_by(pid)
            for k in COUNTED_KINDS:
                if not math.isclose(got[k], want[k], rel_tol=1e-12, abs_tol=1e-9):
                    raise AssertionError(f"step {i} {step}: process {pid} counted "
                                         f"{got[k]} {k} bytes, planned {want[k]}")


def check_case(src, dst, shape, results: dict, steps) -> None:
    """``results``: pid -> (final local, deltas) for every process of the world."""
    full = global_tensor(shape)
    for pid, (local, _) in results.items():
        if (pid in dst.mesh) != (local is not None):
            raise AssertionError(f"process {pid}: in dst mesh = {pid in dst.mesh}, "
                                 f"but returned {type(local).__name__}")
    got = reconstruct(dst, shape, {p: r[0] for p, r in results.items() if r[0] is not None})
    if not np.array_equal(got, full):
        raise AssertionError(f"reshard {src} -> {dst} of {shape} gave a wrong tensor")
    check_counters(steps, {p: r[1] for p, r in results.items()})


def global_tensor(shape) -> np.ndarray:
    rng = np.random.default_rng(sum(shape) * 7919 + len(shape))
    return rng.integers(-9, 10, size=shape).astype(np.float64)


def fixed_cases(n_procs: int = 4, n_random: int = 40):
    """Hand-picked cases on 4 processes plus seeded random ones."""
    m22 = ProcessMesh([[0, 1], [2, 3]], ["x", "y"])
    m4 = ProcessMesh([0, 1, 2, 3], ["x"])
    m2a = ProcessMesh([0, 1], ["x"])
    m2b = ProcessMesh([[3], [2]], ["a", "b"])
    S = ShardSpec
    cases = [
        (DistAttr(m22, S(["x", None])), DistAttr(m22, S([None, "x"])), (4, 6)),
        (DistAttr(m22, S([("x", "y"), None])), DistAttr(m22, S([("y", "x"), None])), (8, 2)),
        (DistAttr(m22, S([None, None], "x")), DistAttr(m22, S(["x", "y"])), (4, 4)),
        (DistAttr(m22, S(["y", None], "x")), DistAttr(m22, S([None, None], "y")), (4, 4)),
        (DistAttr(m4, S([None, "x"])), DistAttr(m2b, S(["a", None])), (4, 8)),
        (DistAttr(m2a, S([None], "x")), DistAttr(m22, S(["y"])), (6,)),
        (DistAttr(m22, S(["x", "y"])), DistAttr(m2a, S([None, None])), (4, 4)),
    ]
    draw = RngDraw(2024)
    cases += [draw_case(draw, n_procs) for _ in range(n_random)]
    return cases


def main() -> None:
    from mpi4py import MPI

    from distgraph.runtime.comm.mpi import MPICommunicator

    comm = MPICommunicator()
    cases = fixed_cases(comm.size)
    kinds: set = set()
    for src, dst, shape in cases:
        steps = plan_reshard(src, dst, shape, "float64")
        kinds.update(s.kind for s in steps)
        full = global_tensor(shape)
        local = make_locals(src, full).get(comm.rank)
        result = run_steps(steps, local, comm, comm.rank)
        everything = MPI.COMM_WORLD.allgather(result)
        if comm.rank == 0:
            check_case(src, dst, shape, dict(enumerate(everything)), steps)
    comm.barrier()
    if comm.rank == 0:
        print(f"reshard-mpi OK {len(cases)} cases, step kinds {sorted(kinds)}", flush=True)


if __name__ == "__main__":
    main()
