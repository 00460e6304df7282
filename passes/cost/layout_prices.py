"""The prices of layouts on one mesh, before any plan exists: what the intra-op search
charges (:mod:`distgraph.passes.search`), from the unit prices the estimate charges
(:mod:`distgraph.passes.cost.prices`), applied to one strategy, one reshard or one
tensor.

- an op's strategy: ``op_time`` on its local shapes (and its local attributes, as the
  partitioned op will have them) on the mesh's device, plus its own collectives on the
  ring of the group its kernel names (as the estimate charges them); a strategy whose distributed
  form overlaps its collectives with its compute (MeshSlice) costs its pipeline
  (``best_overlap``: with the number of slices the cost model prefers, which the
  planner then gives the op);
- a reshard between two layouts of a Value: ``plan_reshard``'s steps, each
  ``reshard_step_time`` on the ring of its mesh dim's group (:class:`~distgraph.passes.
  cost.prices.Rings`, the one ring model);
- memory: a strategy's local result bytes, and what its kernel keeps for the gradient
  beyond them (the op's ``saved`` hook, at the expected load).

A process of the mesh stands for all of its kind: every process of one SPMD mesh runs
the same local program, and processes whose devices' figures and rings are the same pay
the same for it. Where the mesh holds processes of other kinds (a calibrated machine's
devices each measure their own figures), :attr:`LayoutPrices.others` prices at one of
each, and the searches take the slowest kind's sum (the step waits for it). What it
prices is kept in the tables of its planning's session
(:class:`~distgraph.passes.session.Session`; a fresh one by default): "op prices" by op
signature, so the identical blocks of a transformer cost one computation each; "reshard
prices" per tensor and pair of layouts (layouts numbered, so a matrix's entries key on
ints), per matrix and per step, shared by the meshes priced alike (same shape, same
rings and software costs at the priced process: :attr:`LayoutPrices.alike`); "reshard
paths" per mesh shape. :func:`layout_prices` gives the one LayoutPrices of a mesh and
its devices in a session ("layout prices").

With ``sample_axes`` (``Strategy(balance=True)``: which dim of each Value carries the
batch's samples, :func:`distgraph.passes.samples.sample_axes`) an op's strategy is priced
on every device of the mesh at the share of the batch it would get, and the slowest
counts: where the strategy splits the samples over mesh dims D, the groups along D share
the rows in proportion to their speed (their slowest device's GFLOP/s), so a mixed
data-parallel group costs what its balanced split costs; where it does not, every
device does the same work and the slowest device sets the price.

Example::

    costs = layout_prices(cluster, mesh, {0: 0, 1: 1}, session=session)
    costs.reshard(ShardSpec(["x", None]), ShardSpec([None, None]), (8, 4), "float32")
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from distgraph import dtypes
from distgraph.registry import LocalSite, TensorType, comm_workspace, get_op, op_workspace
from distgraph.passes.cost.prices import (Rings, best_overlap, compute_dtype, feed_time,
                                          groups_along, mesh_step_time, op_comm_time,
                                          op_time, reshard_step_time)
from distgraph.passes.partition import local_view_only
from distgraph.passes.reshard import plan_reshard, plan_reshard_path
from distgraph.passes.session import Session
from distgraph.mesh import ProcessMesh
from distgraph.placement import DistAttr, ShardSpec


def layout_prices(cluster, mesh, device_of: dict, sample_axes: dict | None = None,
                  session: Session | None = None, pid: int | None = None) -> "LayoutPrices":
    """The LayoutPrices of ``mesh`` on those devices of ``cluster`` (and ``sample_axes``)
    in ``session``, priced at process ``pid`` (None: the mesh's first): one per
    planning, shared by every search and pricing there."""
    session = session or Session()
    pid = mesh.process_ids[0] if pid is None else pid
    # the cluster by identity (a Cluster hashes every device; the LayoutPrices kept holds
    # it, so its id names no other while the entry lives)
    key = (id(cluster), mesh, tuple(sorted(device_of.items())),
           None if sample_axes is None else tuple(sorted(sample_axes.items())), pid)
    return session.table("layout prices").memo(
        key, lambda: LayoutPrices(cluster, mesh, device_of, sample_axes, session, pid))


def process_kinds(cluster, mesh, device_of: dict) -> tuple:
    """What each process of ``mesh`` (in ``mesh.process_ids`` order), on device
    ``device_of[p]`` of ``cluster``, pays by: its device's figures (all but its ids) and
    its rings along the mesh's dims. Processes of one kind price every layout alike."""
    rings = Rings(cluster, device_of.__getitem__)
    ring_of: dict = {p: () for p in mesh.process_ids}
    for dim in mesh.dim_names:          # a group's ring is each of its processes'
        for group in groups_along(mesh, dim):
            ring = rings.along(mesh, group[0], dim)
            for p in group:
                ring_of[p] += (ring,)
    figures: dict = {}
    for d in set(device_of[p] for p in mesh.process_ids):
        figures[d] = dataclasses.replace(cluster.device(d), global_id=0, local_id=0,
                                         machine_id=0)
    return tuple((figures[device_of[p]], ring_of[p]) for p in mesh.process_ids)


class LayoutPrices:
    """Seconds and bytes of strategies on ``mesh``, whose process p runs on device
    ``device_of[p]`` of ``cluster``; what it prices is kept in ``session``'s tables
    (module docstring)."""

    def __init__(self, cluster, mesh, device_of: dict, sample_axes: dict | None = None,
                 session: Session | None = None, pid: int | None = None):
        self.cluster, self.mesh, self.device_of = cluster, mesh, dict(device_of)
        self.sample_axes = sample_axes
        self.session = session = session or Session()
        self.pid = mesh.process_ids[0] if pid is None else pid
        self._kinds = None          # the processes by what they pay (others), when asked
        self.device = cluster.device(self.device_of[self.pid])
        self.rings = Rings(cluster, self.device_of.__getitem__)
        self.world = ProcessMesh(sorted(mesh.process_ids), dim_names=["world"])
        self._ring_by_dim = {d: self.ring_of(d) for d in mesh.dim_names}
        self._ops = session.table("op prices")
        self._prices = session.table("reshard prices")
        self._paths = session.table("reshard paths")
        self._shape = (tuple(mesh.shape), tuple(mesh.dim_names))
        # the first LayoutPrices of the meshes priced alike, whose reshard prices these
        # share: a same-mesh reshard step costs the priced process the alpha-beta of its
        # mesh dim's ring there and its device's software (:func:`~distgraph.passes.cost.
        # prices.mesh_step_time`), and its path depends on the mesh's dim names and sizes
        # alone, so meshes of one shape whose priced process has the same ring along
        # every dim and the same software costs price every reshard alike, whichever
        # processes they hold (the stages of a homogeneous cluster)
        self.alike = session.table("layout prices").memo(
            ("priced alike", self._shape, tuple(self._ring_by_dim.values()),
             self.device.reshard_overhead), lambda: self)

    @property
    def others(self) -> tuple:
        """The LayoutPrices of this mesh at one process of each other kind: processes
        whose devices' figures (GFLOP/s, overheads, curves: all but their ids) or rings
        along a mesh dim differ from the priced one's pay otherwise for the same local
        program, and the step waits for the slowest (the searches take the largest
        kind's sum, ``ShardingProblem.other_processes``). Empty where every process pays
        alike (a homogeneous cluster), and with ``sample_axes``, whose balanced prices
        take the slowest device already."""
        if self.sample_axes is not None:
            return ()
        if self._kinds is None:
            kinds = dict(zip(self.mesh.process_ids, process_kinds(self.cluster, self.mesh,
                                                                  self.device_of)))
            first = {kinds[self.pid]: self.pid}
            for p in self.mesh.process_ids:
                first.setdefault(kinds[p], p)
            self._kinds = tuple(first.values())[1:]
        return tuple(layout_prices(self.cluster, self.mesh, self.device_of,
                                   session=self.session, pid=p) for p in self._kinds)

    def op(self, op, strategies) -> tuple[np.ndarray, np.ndarray]:
        """(compute seconds, own-collective seconds) of each strategy of ``op``."""
        def priced():
            both = [self._price(op, s) for s in strategies]
            return np.array([c for c, _ in both]), np.array([m for _, m in both])
        return self._ops.memo((self, _signature(op, strategies)), priced)

    def kept(self, op, strategies) -> np.ndarray:
        """Bytes each strategy's kernel keeps for the gradient beyond its results (the
        op's ``saved`` hook; zeros without one)."""
        hook = get_op(op.type).saved
        if hook is None:
            return np.zeros(len(strategies))

        def kept():
            out = []
            for s in strategies:
                attrs, context = self._localized(op, s)
                out.append(hook(attrs, context or {}, _local_types(op, s)[0]))
            return np.array(out, float)
        return self._ops.memo((self, "kept", _signature(op, strategies)), kept)

    def workspace(self, op, strategies) -> np.ndarray:
        """Bytes each strategy's kernel allocates beyond its results while it runs on the
        priced device (:func:`~distgraph.registry.op_workspace`: its hook, and on a CPU
        the float32 copies of its 16-bit operands; with its own all-to-alls their buffers,
        :func:`~distgraph.registry.comm_workspace`; zeros without any)."""
        widened = self.device.type == "CPU"       # numpy computes 16 bits in float32
        if get_op(op.type).workspace is None and not (widened and _half(op)) and \
                not any(s.comm for s in strategies):
            return np.zeros(len(strategies))

        def spare():
            out = []
            for s in strategies:
                attrs, _ = self._localized(op, s)
                out.append(op_workspace(op.type, *_local_types(op, s), attrs, widened) +
                           comm_workspace(s.comm or ()))
            return np.array(out, float)
        return self._ops.memo((self, "workspace", _signature(op, strategies)), spare)

    def _localized(self, op, s) -> tuple:
        """(attributes, kernel context) of ``op`` under strategy ``s``, as partition
        localizes it on the priced process."""
        opdef = get_op(op.type)
        if opdef.localize is None:
            return op.attrs, None
        site = LocalSite(self.pid, tuple(v.shape for v in op.inputs),
                         tuple(DistAttr(self.mesh, x) for x in s.in_specs),
                         tuple(o.shape for o in op.outputs),
                         tuple(DistAttr(self.mesh, x) for x in s.out_specs),
                         tuple(v.dtype for v in op.inputs), tuple(sorted(op.attrs.items())))
        return opdef.localize(dict(op.attrs), site)

    def _price(self, op, s) -> tuple[float, float]:
        opdef = get_op(op.type)
        attrs, context = self._localized(op, s)
        ins, outs = _local_types(op, s)
        ways = opdef.overlap(attrs, ins) if opdef.overlap is not None else ()
        if ways:
            _, compute, hidden = best_overlap(ways, self.device, self.ring_of)
            return compute, hidden
        comm = op_comm_time(s.comm, self.rings.of_op(self.mesh, self.pid, context),
                            self.device) if s.comm else 0.0
        if self.sample_axes is None:
            return op_time(op.type, ins, outs, attrs, self.device), comm
        split = self._sample_split(op, s)
        return max(op_time(op.type, self._scaled(ins, op.inputs, s.in_specs, split, rows),
                           self._scaled(outs, op.outputs, s.out_specs, split, rows), attrs,
                           self.cluster.device(device))
                   for device, rows in self._shares(split, compute_dtype(op.type, ins, outs))
                   ), comm

    def _sample_split(self, op, s) -> frozenset:
        """The mesh dims strategy ``s`` splits the op's samples over."""
        dims: set = set()
        for values, specs in ((op.inputs, s.in_specs), (op.outputs, s.out_specs)):
            for v, spec in zip(values, specs):
                axis = self.sample_axes.get(v.name)
                if axis is not None:
                    dims.update(spec.entry(axis))
        return frozenset(dims)

    def _shares(self, dims: frozenset, dtype: str) -> set:
        """{(device, rows over the even share)} of the mesh's processes when the groups
        along ``dims`` share the batch in proportion to their slowest device's speed."""
        def speed(pid):
            device = self.cluster.device(self.device_of[pid])
            return device.flops(dtype) or device.flops("float32")

        groups: dict = {}
        for pid in self.mesh.process_ids:
            coord = self.mesh.coord(pid)
            key = tuple(coord[self.mesh.dim_index(d)] for d in sorted(dims))
            groups.setdefault(key, []).append(pid)
        rate = {key: min(speed(p) for p in pids) for key, pids in groups.items()}
        total = sum(rate.values())
        return {(self.device_of[p], len(groups) * rate[key] / total if total else 1.0)
                for key, pids in groups.items() for p in pids}

    def _scaled(self, types, values, specs, dims: frozenset, rows: float) -> list:
        out = []
        for t, v, spec in zip(types, values, specs):
            axis = self.sample_axes.get(v.name)
            if axis is None or rows == 1.0 or not dims & set(spec.entry(axis)):
                out.append(t)
                continue
            shape = list(t.shape)
            shape[axis] = int(round(shape[axis] * rows))
            out.append(TensorType(tuple(shape), t.dtype))
        return out

    def ring_of(self, mesh_dim: str):
        """The Ring of the priced process along ``mesh_dim``."""
        return self.rings.along(self.mesh, self.pid, mesh_dim)

    def feed(self, local_shape, dtype: str) -> float:
        """Seconds for a process to copy in its ``local_shape`` part of a feed."""
        return feed_time(local_bytes([local_shape], [dtype]), self.device)

    def reshard(self, src: ShardSpec, dst: ShardSpec, shape, dtype: str) -> float:
        """Seconds to turn ``src`` into ``dst`` (both on the mesh), 0 when equal. Where
        both divide the tensor, priced once per pair of layouts' split dims and the
        tensor's bytes (:meth:`_path`: the price depends on nothing else); every price
        is shared with the LayoutPrices of meshes priced alike (:attr:`alike`)."""
        a, b = self._number(src), self._number(dst)
        if a == b:
            return 0.0
        shape = tuple(shape)
        key = (self.alike, shape, dtype, a, b)
        got = self._prices.find(key)
        if got is None:
            size = math.prod(shape) * dtypes.itemsize(dtype)
            got = self._prices[key] = self._fresh(
                src, dst, a, b, shape, dtype, size,
                bool(size) and self._divides(src, shape) and self._divides(dst, shape))
        return got

    def steps(self, src: ShardSpec, dst: ShardSpec, shape, dtype: str) -> tuple:
        """(kind, mesh dim, group size, buffer bytes) of each step of the reshard from
        ``src`` to ``dst`` of a tensor of ``shape`` and ``dtype`` that :meth:`reshard`
        prices: () where the layouts are equal."""
        if src == dst:
            return ()
        shape = tuple(shape)
        size = math.prod(shape) * dtypes.itemsize(dtype)
        if size and self._divides(src, shape) and self._divides(dst, shape):
            planned, path = self._path(src, dst, shape, dtype, size)
            return tuple((kind, dim, n, buffer * size // planned)
                         for kind, dim, n, buffer in path)
        return tuple((s.kind, s.mesh_dim, s.group_size, s.buffer_bytes) for s in plan_reshard(
            DistAttr(self.mesh, src), DistAttr(self.mesh, dst), shape, dtype))

    def _number(self, spec: ShardSpec) -> int:
        """The number of layout ``spec`` in the session (what the reshard prices and paths
        key on: a ShardSpec hashes in Python, an int pair in C)."""
        paths = self._paths
        got = paths.get(spec)           # (read directly: asked twice per reshard priced)
        if got is None:
            paths.misses += 1
            got = paths[spec] = len(paths)  # unique: entries are never removed
        else:
            paths.hits += 1
        return got

    def matrix(self, made: tuple, wanted: tuple, shape, dtype: str) -> np.ndarray:
        """R[i][j]: seconds from layout ``made[i]`` to ``wanted[j]``: each distinct pair
        of layouts priced as :meth:`reshard` prices it."""
        if len(made) == 1 and len(wanted) == 1:      # a choice priced (intra_op.price)
            return np.array([[self.reshard(made[0], wanted[0], shape, dtype)]])
        shape = tuple(shape)
        return self._prices.memo((self.alike, shape, dtype, made, wanted),
                                 lambda: self._matrix(made, wanted, shape, dtype))

    def _matrix(self, made: tuple, wanted: tuple, shape: tuple, dtype: str) -> np.ndarray:
        rows, row_of = _unique(made)
        cols, col_of = _unique(wanted)
        table, alike = self._prices, self.alike
        size = math.prod(shape) * dtypes.itemsize(dtype)
        number = self._number
        cols = [(number(w), w, None) for w in cols]     # None: whether it divides, unasked
        small, served = [], 0
        for m in rows:
            a = number(m)
            fits = None
            row = []
            for j, (b, w, fits_w) in enumerate(cols):
                key = (alike, shape, dtype, a, b)
                price = table.get(key)
                if price is None:
                    if a == b:
                        price = 0.0
                    else:
                        table.misses += 1
                        if fits is None:
                            fits = bool(size) and self._divides(m, shape)
                        if fits and fits_w is None:
                            fits_w = self._divides(w, shape)
                            cols[j] = (b, w, fits_w)
                        price = table[key] = self._fresh(m, w, a, b, shape, dtype, size,
                                                         fits and fits_w)
                else:
                    served += 1
                row.append(price)
            small.append(row)
        table.hits += served
        return np.array(small)[np.ix_(row_of, col_of)]

    def _fresh(self, src: ShardSpec, dst: ShardSpec, a: int, b: int, shape: tuple,
               dtype: str, size: int, fits: bool) -> float:
        """:meth:`reshard`'s price of ``src`` (number ``a``) to ``dst`` (number ``b``), not
        yet known for this tensor of ``size`` bytes; ``fits``: whether both divide it."""
        if fits:
            key = (self._shape, a, b)
            path = self._paths.find(key)
            if path is None:
                path = self._paths[key] = self._path(src, dst, shape, dtype, size)
            return self._path_time(path, size)
        # planned (and refused where it does not divide) as plan_reshard does
        return sum(reshard_step_time(s, self.pid, self.rings) for s in plan_reshard(
            DistAttr(self.mesh, src), DistAttr(self.mesh, dst), shape, dtype))

    def _path(self, src: ShardSpec, dst: ShardSpec, shape: tuple, dtype: str,
              size: int) -> tuple:
        """(bytes planned for, ((kind, mesh dim, group size, buffer bytes) of each step))
        of ``plan_reshard``'s path for a tensor that both layouts divide, planned once per
        pair (:func:`_pair`) on meshes of this shape: every state on its path keeps each
        tensor dim split by a prefix of the source's or the goal's entry there (its
        moves are goal-directed), so where both layouts divide a tensor every state
        does, the moves it may make are the same whatever the tensor's shape, dtype and
        the dims both leave whole, and each costs a fixed multiple of the tensor's bytes:
        the same path, each step's buffer scaled by the bytes (:meth:`_path_time`). The
        path reads the mesh's dim names and sizes only, not its processes."""
        return self._paths.memo((self._shape, _pair(src, dst)), lambda: (
            size, plan_reshard_path(self.mesh, src, dst, shape, dtype)))

    def _path_time(self, path: tuple, size: int) -> float:
        """Seconds of ``path`` (:meth:`_path`) for a tensor of ``size`` bytes at the priced
        process, as ``reshard_step_time`` prices the steps planned for the tensor: each
        step's buffer is ``size`` over the parts of its state (times the group for a
        gather), ``buffer x size / planned`` exactly (both layouts divide both tensors,
        so the parts divide the elements of each), each step's seconds known once per
        (kind, mesh dim, buffer) on the meshes priced alike."""
        planned, steps = path
        known, alike = self._prices, self.alike
        total = 0
        for kind, dim, n, buffer in steps:     # read directly: the hottest of the reads
            key = (alike, kind, dim, buffer * size // planned)
            t = known.get(key)
            if t is None:
                known.misses += 1
                t = known[key] = mesh_step_time(kind, n, key[3] * 1.0, self._ring_by_dim[dim],
                                                self.device)
            else:
                known.hits += 1
            total += t
        return total

    def _divides(self, spec: ShardSpec, shape: tuple) -> bool:
        """Whether ``spec`` splits every dim of ``shape`` evenly on the mesh."""
        return len(shape) == spec.ndim and all(
            n % math.prod(self.mesh.dim_size(m) for m in spec.entry(d)) == 0
            for d, n in enumerate(shape))

    def settle(self, spec: ShardSpec, value) -> float:
        """Seconds to settle ``spec``'s pending sum (an all-reduce, or a reduce-scatter
        onto an unsplit dim its mesh dim divides, whichever is cheaper); 0 if none."""
        if not spec.partial:
            return 0.0
        ways = [ShardSpec(spec.dims)]
        if len(spec.partial) == 1:
            (m,) = spec.partial
            size = self.mesh.dim_size(m)
            for d, (entry, n) in enumerate(zip(spec.dims, value.shape)):
                if entry is None and n % size == 0:
                    ways.append(ShardSpec(spec.dims[:d] + (m,) + spec.dims[d + 1:]))
        return min(self.reshard(spec, w, value.shape, value.dtype) for w in ways)

    def gather(self, spec: ShardSpec, value, world) -> float:
        """Seconds to bring ``value`` (laid out ``spec`` on the mesh) whole to every
        process of ``world`` (``partition.world_mesh``: how the runtime fetches the loss;
        :attr:`world`, the mesh's processes as one 1-D mesh, by default): as the
        partitioner plans it, nothing where the value is whole on every process of
        ``world`` already (a mesh of two dims holds its processes in another shape)."""
        def gathered():                 # planned once: p2p tiles to every process
            src = DistAttr(self.mesh, spec)
            dst = DistAttr(world, ShardSpec.replicated(len(value.shape)))
            steps = [] if src == dst or local_view_only(src, dst) else plan_reshard(
                src, dst, tuple(value.shape), value.dtype)
            return sum(reshard_step_time(s, self.pid, self.rings) for s in steps)
        return self._ops.memo((self, "gather", spec, tuple(value.shape), value.dtype, world),
                              gathered)


def _pair(src: ShardSpec, dst: ShardSpec) -> tuple:
    """What ``plan_reshard``'s path from ``src`` to ``dst`` depends on where both divide
    the tensor: the (source, goal) entries of the tensor dims either splits, in order,
    and both pending sums. A dim both leave whole is never a move's target (a move
    appends a mesh dim only where that extends the goal's entry there, and gathers only
    a split dim), so dropping it changes no move, their order, or which is cheapest (it
    scales every move's bytes by its extent alike)."""
    return (tuple((src.entry(d), dst.entry(d)) for d in range(src.ndim)
                  if src.entry(d) or dst.entry(d)), src.partial, dst.partial)


def _local_types(op, s) -> tuple:
    """(operands, results) of ``op`` under strategy ``s`` as local TensorTypes."""
    return ([TensorType(shape, v.dtype) for shape, v in zip(s.in_local_shapes, op.inputs)],
            [TensorType(shape, o.dtype) for shape, o in zip(s.out_local_shapes, op.outputs)])


def _half(op) -> bool:
    """Whether an operand or result of ``op`` is a 16-bit float (the executor computes
    such an op in float32, with copies: :func:`~distgraph.registry.op_workspace`)."""
    return any(dtypes.is_float(v.dtype) and dtypes.itemsize(v.dtype) == 2
               for v in list(op.inputs) + list(op.outputs))


def _signature(op, strategies) -> tuple:
    """What an op's prices depend on: its type, shapes, dtypes, attributes and the
    strategies offered (identical blocks' ops share it)."""
    return (op.type, tuple(tuple(v.shape) for v in op.inputs),
            tuple(tuple(o.shape) for o in op.outputs), tuple(v.dtype for v in op.inputs),
            repr(sorted(op.attrs.items())), tuple(s.name for s in strategies))


def local_bytes(shapes, dtype_names) -> int:
    """Bytes of local shards of ``shapes`` with those dtypes."""
    total = 0
    for shape, dtype in zip(shapes, dtype_names):
        n = 1
        for d in shape:
            n *= d
        total += n * dtypes.itemsize(dtype)
    return total


def _unique(specs: tuple):
    index: dict = {}
    order = []
    for s in specs:
        if s not in index:
            index[s] = len(order)
            order.append(s)
    return order, np.array([index[s] for s in specs], dtype=np.intp)
