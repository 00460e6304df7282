"""Reshard planner: the communication steps that turn one DistAttr into another.

:func:`plan_reshard` is pure: it returns a list of frozen
:class:`~distgraph.plan.reshard.ReshardStep` values and never touches data;
:mod:`distgraph.runtime.execution.reshard` executes them. Every step's ``bytes`` is the
per-process formula of :func:`~distgraph.plan.kinds.collective_bytes` applied to the
step's local buffer, so ``steps_bytes(steps)`` is what the communicators count.

Same mesh: a shortest-path search over layouts, each edge one step of the transition
table below (cost = bytes per process, ties broken by fewer steps). It finds the direct
step where one exists (S(i)->S(j) is one all_to_all, P->S one reduce_scatter) and
otherwise the cheapest valid sequence, e.g. gathering a dim then slicing it.

Different meshes (other process set or shape): reduce any Partial inside the source mesh
(reduce_scatter onto the largest divisible dim, else all_reduce), then one ``send_recv``
step of point-to-point tiles with senders balanced across replicas (least loaded, then
round-robin); where the destination is replicated along a mesh dim, each replica may
receive only a slice that the destination mesh then all-gathers (Alpa's local
all-gather; chosen where it lowers the busiest sender's p2p bytes). A Partial
destination is received by coordinate 0 of its partial mesh dims only; the other
processes hold zeros (make_partial folded into the p2p step).

Example::

    >>> mesh = ProcessMesh([0, 1], ["x"])
    >>> steps = plan_reshard(DistAttr(mesh, ShardSpec(["x", None])),
    ...                      DistAttr(mesh, ShardSpec([None, "x"])), (4, 4))
    >>> [str(s) for s in steps]
    ['all_to_all(x) dim0->dim1 n=2 16 B']
"""

from __future__ import annotations

import heapq
import itertools
import math
from math import prod
from typing import NamedTuple

import numpy as np

from distgraph import dtypes
from distgraph.errors import PlanError
from distgraph.mesh import ProcessMesh
from distgraph.placement import DistAttr, ShardSpec
from distgraph.plan.kinds import StepKind, collective_bytes
from distgraph.plan.reshard import ReshardStep, Transfer, steps_bytes

ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, ALL_TO_ALL = (
    StepKind.ALL_GATHER, StepKind.REDUCE_SCATTER, StepKind.ALL_REDUCE, StepKind.ALL_TO_ALL)
SLICE, MAKE_PARTIAL = StepKind.SLICE, StepKind.MAKE_PARTIAL


def plan_reshard(src: DistAttr, dst: DistAttr, shape, dtype="float32") -> list[ReshardStep]:
    """Steps that turn a tensor of global ``shape`` laid out as ``src`` into ``dst``.

    Both attrs are validated first (ShardingError naming the side, shape, spec, mesh).
    Meshes with the same ids and shape but other dim names are planned as one mesh: the
    steps then name ``src.mesh`` and its dims. ``dtype`` sets the bytes of every step.
    """
    shape = tuple(int(s) for s in shape)
    dtype = dtypes.canonical(dtype)
    src.spec.validate(src.mesh, shape, "reshard source")
    dst.spec.validate(dst.mesh, shape, "reshard destination")
    if src.mesh == dst.mesh:
        return _plan_same_mesh(src.mesh, src.spec, dst.spec, shape, dtype)
    if src.mesh.process_ids == dst.mesh.process_ids and src.mesh.shape == dst.mesh.shape:
        rename = dict(zip(dst.mesh.dim_names, src.mesh.dim_names))
        return _plan_same_mesh(src.mesh, src.spec, _renamed(dst.spec, rename), shape, dtype)
    return _plan_cross_mesh(src, dst, shape, dtype)


def plan_reshard_path(mesh: ProcessMesh, src: ShardSpec, dst: ShardSpec, shape,
                      dtype="float32") -> tuple:
    """``(kind, mesh dim, group size, buffer bytes)`` of each step :func:`plan_reshard`
    plans from ``src`` to ``dst``, both on ``mesh``: its figures without the steps (what
    a price reads; the search prices many more paths than it runs). Validated alike.

    >>> mesh = ProcessMesh([0, 1], ["x"])
    >>> plan_reshard_path(mesh, ShardSpec(["x", None]), ShardSpec([None, "x"]), (4, 4))
    ((<StepKind.ALL_TO_ALL: 'all_to_all'>, 'x', 2, 32),)
    """
    shape = tuple(int(s) for s in shape)
    src.validate(mesh, shape, "reshard source")
    dst.validate(mesh, shape, "reshard destination")
    sizes = dict(zip(mesh.dim_names, mesh.shape))
    return tuple((mv.kind, mv.mesh_dim, sizes[mv.mesh_dim], mv.buffer_bytes)
                 for _, mv in _search(mesh, _state(src), _state(dst), shape,
                                      dtypes.itemsize(dtype)))


def _renamed(spec: ShardSpec, rename: dict) -> ShardSpec:
    return ShardSpec([tuple(rename[n] for n in spec.entry(i)) for i in range(spec.ndim)],
                     {rename[n] for n in spec.partial})


# ---- same mesh: shortest path over layouts ------------------------------------------
#
# Transition table, per mesh dim m of size n; B = the local buffer before the step.
#
#   from \ to | R                      | S(e)                            | P
#   ----------+------------------------+---------------------------------+-------------
#   R         | -                      | slice e           0             | make_partial 0
#   S(d)      | all_gather (n-1)B      | all_to_all d->e   (n-1)/n B     | (via R)
#   P         | all_reduce 2(n-1)/n B  | reduce_scatter e  (n-1)/n B     | -
#
# A tuple entry (x, y) means block index cx*ny + cy, so a step may only touch the
# *minor-most* (last) mesh dim of an entry: all_gather and all_to_all need m last in
# dims[d]; slice, reduce_scatter and all_to_all append m last to dims[e]. Every state
# on a path keeps each tensor dim divisible by its parts. Moves are goal-directed:
# a mesh dim is only appended to dims[e] where that extends a prefix of the goal's
# dims[e], and only made partial where the goal is partial over it; gathers and
# all-reduces are always allowed. That keeps the search small and plans plain, and
# it stays complete: gathering everything, then slicing in goal order, is always a path.
# Any other change (reordering a tuple entry, moving a major mesh dim) is a sequence
# found by the search, typically gathering the dim and slicing it again.

_State = tuple  # (dims: tuple[tuple[str, ...], ...], partial: frozenset[str])


class _Move(NamedTuple):
    kind: StepKind
    mesh_dim: str
    after: _State
    buffer_bytes: int
    cost: int  # bytes scaled by the lcm of the mesh dim sizes, so sums stay exact
    tensor_dim: int | None = None
    to_tensor_dim: int | None = None


def _state(spec: ShardSpec) -> _State:
    return tuple(spec.entry(i) for i in range(spec.ndim)), spec.partial


def _spec(state: _State) -> ShardSpec:
    dims, partial = state
    return ShardSpec([e if e else None for e in dims], partial)


def _moves(sizes: dict, state: _State, goal: _State, shape, itemsize: int,
           scale: int) -> list:
    """The moves from ``state`` in the search's order: per mesh dim (``sizes``: name ->
    size, in mesh order) its all-reduce then reduce-scatter, or its slice then
    make-partial, or its all-gather then all-to-all."""
    dims, partial = state
    goal_dims, goal_partial = goal
    parts = []
    split = {}          # mesh dim -> the tensor dim it splits
    nexts = {}          # mesh dim -> the tensor dim whose goal entry it extends next
    for e, entry in enumerate(dims):
        p = 1
        for x in entry:
            p *= sizes[x]
            split[x] = e
        parts.append(p)
        g, k = goal_dims[e], len(entry)
        if len(g) > k and g[:k] == entry:
            nexts[g[k]] = e
    local_bytes = itemsize
    for s, p in zip(shape, parts):
        local_bytes *= s // p

    def append(ds, e, m):
        return ds[:e] + (ds[e] + (m,),) + ds[e + 1:]

    out = []
    for m, n in sizes.items():
        unit = (n - 1) * (scale // n)   # a move's cost: factor x (n-1) x buffer x scale/n
        # the one tensor dim (a mesh dim splits one at most) where appending m extends a
        # prefix of the goal's entry, if the tensor divides there
        e = nexts.get(m)
        if e is not None and shape[e] % (parts[e] * n):
            e = None
        if m in partial:
            rest = partial - {m}
            out.append(_Move(ALL_REDUCE, m, (dims, rest), local_bytes,
                             2 * unit * local_bytes))
            if e is not None:
                out.append(_Move(REDUCE_SCATTER, m, (append(dims, e, m), rest), local_bytes,
                                 unit * local_bytes, e))
            continue
        d = split.get(m)
        if d is None:
            if e is not None:
                out.append(_Move(SLICE, m, (append(dims, e, m), partial), local_bytes, 0, e))
            if m in goal_partial:
                out.append(_Move(MAKE_PARTIAL, m, (dims, partial | {m}), local_bytes, 0))
        elif dims[d][-1] == m:
            gathered = dims[:d] + (dims[d][:-1],) + dims[d + 1:]
            out.append(_Move(ALL_GATHER, m, (gathered, partial), local_bytes * n,
                             unit * (local_bytes * n), d))
            if e is not None and e != d:    # the other dims' entries and parts are kept
                out.append(_Move(ALL_TO_ALL, m, (append(gathered, e, m), partial),
                                 local_bytes, unit * local_bytes, d, e))
    return out


def _search(mesh, start: _State, goal: _State, shape, itemsize: int) -> list:
    """The cheapest path's moves from ``start`` to ``goal`` on ``mesh`` as (state before,
    move) pairs: Dijkstra over states by (bytes, steps), the first found among equals."""
    sizes = dict(zip(mesh.dim_names, mesh.shape))
    scale = math.lcm(*mesh.shape)
    best = {start: (0, 0)}
    back: dict = {}
    heap = [(0, 0, 0, start)]
    tick = 1
    while heap:
        cost, nsteps, _, state = heapq.heappop(heap)
        if state == goal:
            break
        if (cost, nsteps) > best[state]:
            continue
        for mv in _moves(sizes, state, goal, shape, itemsize, scale):
            key = (cost + mv.cost, nsteps + 1)
            after = mv.after
            if after not in best or key < best[after]:
                best[after] = key
                back[after] = (state, mv)
                heapq.heappush(heap, (*key, tick, after))
                tick += 1
    if goal not in best:
        raise PlanError(f"no reshard path from {_spec(start)} to {_spec(goal)} on {mesh} "
                        f"for shape {list(shape)}; this is a planner bug, please report it")
    path = []
    state = goal
    while state != start:
        prev, mv = back[state]
        path.append((prev, mv))
        state = prev
    return path[::-1]


def _plan_same_mesh(mesh, src_spec, dst_spec, shape, dtype) -> list[ReshardStep]:
    start = _state(src_spec)
    steps = []
    for prev, mv in _search(mesh, start, _state(dst_spec), shape, dtypes.itemsize(dtype)):
        n = mesh.dim_size(mv.mesh_dim)
        steps.append(ReshardStep(mv.kind, mesh, _spec(prev), _spec(mv.after), shape, dtype,
                                 collective_bytes(mv.kind, n, mv.buffer_bytes),
                                 mv.buffer_bytes, mv.mesh_dim, n, mv.tensor_dim,
                                 mv.to_tensor_dim))
    return steps


# ---- different meshes: reduce, p2p tiles, local all-gather -----------------------------

def _largest_fitting_dim(mesh, dims, shape, n) -> int | None:
    """Tensor dim with the largest local extent that can be split n more ways."""
    best, best_extent = None, 0
    for e, entry in enumerate(dims):
        parts = prod(mesh.dim_size(m) for m in entry)
        if shape[e] % (parts * n) == 0 and shape[e] // parts > best_extent:
            best, best_extent = e, shape[e] // parts
    return best


def _reduced_spec(mesh, spec: ShardSpec, shape) -> ShardSpec:
    """``spec`` without Partial: each partial mesh dim becomes a split where one fits."""
    dims = [list(spec.entry(i)) for i in range(spec.ndim)]
    for m in sorted(spec.partial, key=mesh.dim_index):
        n = mesh.dim_size(m)
        e = _largest_fitting_dim(mesh, dims, shape, n) if n > 1 else None
        if e is not None:
            dims[e].append(m)
    return ShardSpec([tuple(e) for e in dims])


def _receive_spec(mesh, spec: ShardSpec, shape, split) -> ShardSpec | None:
    """``spec`` with each mesh dim in ``split`` (replicated in ``spec``) also splitting
    the largest tensor dim it fits, so that each replica receives a distinct slice and
    the destination all-gathers it; None if one does not fit anywhere."""
    dims = [list(spec.entry(i)) for i in range(spec.ndim)]
    for m in split:
        e = _largest_fitting_dim(mesh, dims, shape, mesh.dim_size(m))
        if e is None:
            return None
        dims[e].append(m)
    return ShardSpec([tuple(e) for e in dims], spec.partial)


def _boxes(attr: DistAttr, shape, pids) -> np.ndarray:
    """[start, stop) of each tensor dim of the block each of ``pids`` holds: an array
    (len(pids), ndim, 2) (``DistAttr.local_slices`` for many processes at once)."""
    local = attr.local_shape(shape)
    mesh = attr.mesh
    if pids == mesh.process_ids:        # all, in order: their coordinates are row-major
        coords = np.stack(np.unravel_index(np.arange(len(pids)), mesh.shape), axis=1)
    else:
        coords = np.array([mesh.coord(p) for p in pids], dtype=np.int64).reshape(len(pids), -1)
    out = np.empty((len(pids), len(local), 2), dtype=np.int64)
    for i, n in enumerate(local):
        block = np.zeros(len(pids), dtype=np.int64)
        for name in attr.spec.entry(i):
            axis = mesh.dim_index(name)
            block = block * mesh.shape[axis] + coords[:, axis]
        out[:, i, 0], out[:, i, 1] = block * n, (block + 1) * n
    return out


def _send_recv_step(src: DistAttr, dst: DistAttr, shape, dtype) -> ReshardStep:
    """p2p tiles from ``src`` (no Partial) to ``dst``. Where ``dst`` is Partial, only the
    processes at coordinate 0 of those mesh dims receive; the others hold zeros."""
    return _Tiles(src, dst, shape, dtype).step()


class _Tiles:
    """The p2p tiles of :func:`_send_recv_step` as arrays, with their senders chosen and
    each sender's load: what :func:`_plan_cross_mesh` compares its candidates by, before
    the one it keeps is made a ReshardStep of Transfer values."""

    def __init__(self, src: DistAttr, dst: DistAttr, shape, dtype):
        self.src, self.dst, self.shape, self.dtype = src, dst, shape, dtype
        itemsize = dtypes.itemsize(dtype)
        holders: dict = {}      # region -> its processes, regions in first-held order
        senders = list(src.mesh.process_ids)
        for p, box in zip(senders, _boxes(src, shape, senders).tolist()):
            holders.setdefault(tuple(map(tuple, box)), []).append(p)
        regions = list(holders)
        self.load = load = {p: 0 for p in senders}
        partial_axes = [dst.mesh.dim_index(m) for m in dst.spec.partial]
        self.receivers = receivers = list(dst.mesh.process_ids) if not partial_axes else [
            q for q in dst.mesh.process_ids if not any(dst.mesh.coord(q)[a] for a in partial_axes)]
        # every (receiver, region) tile at once, receiver-major as the transfers go
        held = np.array(regions, dtype=np.int64).reshape(len(regions), len(shape), 2)
        wanted = _boxes(dst, shape, receivers)
        ks, rs = _meeting(wanted, held)
        lo = np.maximum(wanted[ks, :, 0], held[rs, :, 0])
        hi = np.minimum(wanted[ks, :, 1], held[rs, :, 1])
        self.ks, self.lo, self.hi = ks, lo, hi
        self.sizes = sizes = (hi - lo).prod(axis=1) * itemsize
        # a tile its receiver holds (a process holds one region) is a local copy; the
        # others go to their region's replicas, in tile order
        region_of = {p: r for r, pids in enumerate(holders.values()) for p in pids}
        to = np.asarray(receivers, dtype=np.int64)[ks]
        held_by_receiver = np.asarray([region_of.get(q, -1) for q in receivers],
                                      dtype=np.int64)[ks] == rs
        self.sender = sender = np.where(held_by_receiver, to, 0)
        remote = np.flatnonzero(~held_by_receiver)
        remote = remote[np.argsort(rs[remote], kind="stable")]
        bounds = np.searchsorted(rs[remote], np.arange(len(regions) + 1))
        for r, pids in enumerate(holders.values()):
            _pick_senders(pids, remote[bounds[r]:bounds[r + 1]], sizes, sender, load)
        self.busiest = max(load.values(), default=0)
        self.bytes = collective_bytes(StepKind.SEND_RECV, 2, self.busiest)

    def remote_bytes(self) -> int:
        """Bytes of the tiles a process sends to another."""
        to = np.asarray(self.receivers, dtype=np.int64)[self.ks]
        return int(self.sizes[self.sender != to].sum()) if len(self.ks) else 0

    def step(self) -> ReshardStep:
        lows, highs = self.lo.tolist(), self.hi.tolist()
        sizes, sender, receivers = self.sizes.tolist(), self.sender.tolist(), self.receivers
        transfers = [Transfer(sender[i], receivers[k], tuple(zip(lows[i], highs[i])), sizes[i])
                     for i, k in enumerate(self.ks.tolist())]
        src, dst = self.src, self.dst
        return ReshardStep(StepKind.SEND_RECV, src.mesh, src.spec, dst.spec, self.shape,
                           self.dtype, self.bytes, self.busiest, dst_mesh=dst.mesh,
                           transfers=tuple(transfers))


def _meeting(wanted: np.ndarray, held: np.ndarray, dense_up_to: int = 1 << 16) -> tuple:
    """(receiver indices, region indices) of every (wanted box, held box) pair that
    meets, receiver-major and then in region order: ``np.nonzero`` of the dense
    receivers x regions test, made where there are at most ``dense_up_to`` pairs (it is
    the faster there, measured); else found without it (the receivers of a big mesh
    meet few of its many regions). Boxes are arrays (n, ndim, 2) of [start, stop)."""
    n_recv, n_held, ndim = len(wanted), len(held), wanted.shape[1]
    if n_recv * n_held <= dense_up_to:
        lo = np.maximum(wanted[:, None, :, 0], held[None, :, :, 0])
        hi = np.minimum(wanted[:, None, :, 1], held[None, :, :, 1])
        return np.nonzero((lo < hi).all(axis=2))
    if not ndim:
        return np.repeat(np.arange(n_recv), n_held), np.tile(np.arange(n_held), n_recv)
    # per dim, the distinct intervals and which of them meet; pairs are drawn from the
    # dim whose held intervals are most distinct, then checked on the others
    w_ivals, h_ivals = [], []
    for d in range(ndim):
        w_ivals.append(np.unique(wanted[:, d, :], axis=0, return_inverse=True))
        h_ivals.append(np.unique(held[:, d, :], axis=0, return_inverse=True))
    best = max(range(ndim), key=lambda d: len(h_ivals[d][0]))
    (w_u, w_inv), (h_u, h_inv) = w_ivals[best], h_ivals[best]
    w_inv, h_inv = w_inv.reshape(-1), h_inv.reshape(-1)
    overlap = (np.maximum(w_u[:, None, 0], h_u[None, :, 0])
               < np.minimum(w_u[:, None, 1], h_u[None, :, 1]))
    # regions grouped by their interval along ``best`` (CSR), in region order
    by_interval = np.argsort(h_inv, kind="stable")
    starts = np.searchsorted(h_inv[by_interval], np.arange(len(h_u) + 1))
    # per distinct wanted interval, the regions whose interval meets it
    counts = np.array([(starts[1:] - starts[:-1])[row].sum() for row in overlap],
                      dtype=np.int64)
    members = [np.concatenate([by_interval[starts[h]:starts[h + 1]]
                               for h in np.flatnonzero(row)]) if counts[i] else
               np.empty(0, dtype=np.int64) for i, row in enumerate(overlap)]
    per_recv = counts[w_inv]
    ks = np.repeat(np.arange(n_recv), per_recv)
    rs = np.concatenate([members[w] for w in w_inv]) if n_recv else np.empty(0, np.int64)
    rs = rs.astype(np.int64, copy=False)
    keep = np.ones(len(ks), dtype=bool)
    for d in range(ndim):
        if d != best:
            keep &= (np.maximum(wanted[ks, d, 0], held[rs, d, 0])
                     < np.minimum(wanted[ks, d, 1], held[rs, d, 1]))
    ks, rs = ks[keep], rs[keep]
    order = np.lexsort((rs, ks))
    return ks[order], rs[order]


def _pick_senders(pids, tiles, sizes, sender, load) -> None:
    """Senders of ``tiles`` (an index array into the arrays ``sizes`` and ``sender``, in
    order), all held by the replicas ``pids``: each the least-loaded replica, among
    equals the first from the tile's turn round the replicas. Tiles of one size take the
    replicas in turn."""
    n = len(pids)
    if not len(tiles):
        return
    first = int(sizes[tiles[0]])
    if (sizes[tiles] == first).all():
        sender[tiles] = np.asarray(pids, dtype=np.int64)[np.arange(len(tiles)) % n]
        for j, p in enumerate(pids):
            load[p] += first * (len(tiles) // n + (j < len(tiles) % n))
        return
    for turn, (i, size) in enumerate(zip(tiles.tolist(), sizes[tiles].tolist())):
        best = min(range(n), key=lambda j: (load[pids[j]], (j - turn) % n))
        sender[i] = pids[best]
        load[pids[best]] += size


def _plan_cross_mesh(src: DistAttr, dst: DistAttr, shape, dtype) -> list[ReshardStep]:
    reduced = _reduced_spec(src.mesh, src.spec, shape)
    head = _plan_same_mesh(src.mesh, src.spec, reduced, shape, dtype)
    # Which replicated destination mesh dims receive slices and all-gather them (Alpa's
    # local all-gather): try every subset, keep the one with the least busiest-sender
    # p2p bytes, then least total p2p bytes, then least all-gather bytes.
    replicated = [m for m in dst.mesh.dim_names
                  if dst.mesh.dim_size(m) > 1 and m not in dst.spec.mesh_dims()]
    best = None
    for chosen in itertools.product((False, True), repeat=len(replicated)):
        split = [m for m, c in zip(replicated, chosen) if c]
        receive = _receive_spec(dst.mesh, dst.spec, shape, split)
        if receive is None:
            continue
        p2p = _Tiles(DistAttr(src.mesh, reduced), DistAttr(dst.mesh, receive), shape, dtype)
        tail = _plan_same_mesh(dst.mesh, receive, dst.spec, shape, dtype)
        key = (p2p.bytes, p2p.remote_bytes(), steps_bytes(tail), len(tail))
        if best is None or key < best[0]:
            best = (key, p2p, tail)
    return head + [best[1].step()] + best[2]
