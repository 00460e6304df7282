"""Partition: one local program per logical process, with its reshard points.

For process ``p`` the local program holds the ops whose mesh contains ``p``, on local
shapes (an op whose sharded form differs adapts through its registry ``localize``).
Wherever a consumer wants an operand laid out differently from how its producer made it
(``op.dist_attr.input_specs[i]`` vs ``value.dist_attr``), a
:class:`~distgraph.plan.reshard.ReshardPoint` with the
steps of :func:`plan_reshard` is placed before the consumer — in the programs of every
process of the source and destination meshes, at the same place of the global op order,
so all processes meet their collectives and messages in one order. A value resharded
once to a given layout is reused by every later consumer that wants that layout, except
that the backward does not reuse a forward copy larger than the value it gathers (on the
value's own mesh): it gathers again, so the forward keeps only its shard for the backward
(Megatron-SP's activations, gathered over ``t`` for a column-split matmul, are saved
split and gathered again for the weight gradient, as Korthikanti et al. count them).
A value sent to another mesh is sent once: a later consumer there that wants another
layout reshards the copy that arrived (a pipeline stage's input read again by its
recomputation or its weight gradients is not sent twice, nor kept by its sender); the
backward reshards from the smallest copy there, gathering again what the forward
gathered there (a stage whose first LayerNorm reads its input whole keeps the input
split over ``t`` for the backward, as a block inside the stage keeps its own and as
the stage search counts it).

:class:`Partitions` holds the local programs of every process of one plan: each made on
first use, every reshard planned once for all of them, the numbering of the points (the
same on every process) found once so that a process visits only the ops of its own
meshes and the points it sends or receives, and the processes grouped by the
meshes they are on (processes of one group run local programs alike up to their
coordinates, so what every process does in kind is read from one of each group).

Example::

    local = partition(completed_program, process_id=1)
    print(local.pretty())
    parts = Partitions(completed_program)
    parts[3] is parts[3]              # process 3, partitioned once
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from distgraph.errors import PlanError
from distgraph.ir import Operation, Program, Role, Value
from distgraph.mesh import ProcessMesh
from distgraph.passes.reshard import plan_reshard
from distgraph.placement import DistAttr, ShardSpec
from distgraph.plan.local import LocalProgram
from distgraph.plan.reshard import ReshardPoint
from distgraph.registry import LocalSite, get_op


def process_ids(program: Program) -> list[int]:
    """Every process id any op or value of a completed program lives on."""
    ids = set()
    for op in program.ops:
        ids.update(op.dist_attr.mesh.process_ids)
    for v in program.values.values():
        ids.update(v.dist_attr.mesh.process_ids)
    return sorted(ids)


def world_mesh(program: Program, ids=None) -> ProcessMesh:
    """Every process of ``program`` (its ``ids`` where known) on one dim, ``world``."""
    return ProcessMesh(list(process_ids(program) if ids is None else ids), dim_names=["world"])


def local_view_only(src: DistAttr, dst: DistAttr) -> bool:
    """A replicated value read on a sub-mesh of its own processes needs no message."""
    replicated = all(e is None for e in src.spec.dims) and not src.spec.partial
    return (replicated and all(e is None for e in dst.spec.dims) and not dst.spec.partial
            and set(dst.mesh.process_ids) <= set(src.mesh.process_ids))


def _check_completed(program: Program) -> None:
    if any(op.dist_attr is None for op in program.ops):
        raise PlanError("partition needs a completed program: call dg.passes.complete first")


class _Decision(NamedTuple):
    """What one reshard call decided, alike on every process: the local name of the
    result; the layout a new point reshards from (None: an earlier copy is read again,
    no point); the copy that arrived on the destination mesh it reshards instead of the
    value (None: the value itself); the point's number."""

    name: str
    src: DistAttr | None
    near: str | None
    seq: int


class _Numbering:
    """The reshard bookkeeping every process does alike (module docstring): which copy a
    consumer reads, which points are made, in which order."""

    def __init__(self):
        self.cache: dict = {}
        self.made_in: dict = {}   # cache key -> role of the op the copy was made for
        self.arrived: dict = {}   # (value name, mesh) -> cache key of a copy sent there
        self.there: dict = {}     # (value name, mesh) -> cache keys of its copies there
        self.copies: dict = {}
        self.points_made = 0

    def _smallest(self, v: Value, mesh) -> tuple | None:
        """The cache key of the smallest copy of ``v`` on ``mesh`` (another mesh than
        its own) that is held, the copy that arrived first among equals."""
        keys = [k for k in self.there.get((v.name, mesh), ()) if k in self.cache]
        return min(keys, key=lambda k: int(np.prod(k[1].local_shape(v.shape),
                                                   dtype=np.int64)), default=None)

    def decide(self, v: Value, dst: DistAttr, stores: str | None, role: Role | None):
        key = (v.name, dst)
        src, held = v.dist_attr, None
        other = src.mesh != dst.mesh and stores is None
        # a value sent to another mesh before is resharded from a copy there: the one
        # that arrived, in the backward the smallest
        near = None if not other else self._smallest(v, dst.mesh) \
            if role is Role.BACKWARD else self.arrived.get((v.name, dst.mesh))
        if key in self.cache:
            if reuses(self.made_in.get(key), role, src if near is None else near[1], dst,
                      v.shape):
                return _Decision(self.cache[key], None, None, -1)
            del self.cache[key]       # gathered again for the backward (and kept for it)
        made = self.copies.get(v.name, 0)        # copies of v resharded so far
        self.copies[v.name] = made + 1
        name = f"{v.name}@{made}"
        if near in self.cache:
            src, held = near[1], self.cache[near]
        elif other:
            self.arrived[v.name, dst.mesh] = key
        if other:
            self.there.setdefault((v.name, dst.mesh), []).append(key)
        seq = self.points_made
        self.points_made += 1
        self.cache[key] = name
        self.made_in[key] = role
        return _Decision(name, src, held, seq)


class _Skeleton:
    """What partitioning decides alike for every process of a program, found once for
    all: per op, the write-backs resharded before it, its inputs' reshards (None where
    an input is read as made) and its own write-backs; the write-backs after the last
    op; and, per mesh, the ops it takes part in (it runs the op, or a point sends from
    or to it). A process is partitioned from the ops of its meshes only."""

    def __init__(self, program: Program):
        numbering = _Numbering()
        values = program.values
        self.ops: list = []
        self.by_mesh: dict = {}
        writebacks: list = []
        for k, op in enumerate(program.ops):
            da = op.dist_attr
            meshes = {da.mesh}
            before = []
            for v, target in writebacks:
                d = numbering.decide(v, target.dist_attr, target.name, None)
                before.append((v, target, d))
                if d.src is not None:
                    meshes.update((d.src.mesh, target.dist_attr.mesh))
            ins = []
            for i, v in enumerate(op.inputs):
                if v.dist_attr.mesh == da.mesh and v.dist_attr.spec == da.input_specs[i]:
                    ins.append(None)
                    continue
                dst = DistAttr(da.mesh, da.input_specs[i])
                d = numbering.decide(v, dst, None, op.role)
                ins.append((dst, d))
                if d.src is not None:
                    meshes.update((d.src.mesh, dst.mesh))
            writebacks = [(o, values[o.alias_of]) for o in op.outputs if o.alias_of
                          and values[o.alias_of].dist_attr != o.dist_attr]
            self.ops.append((before, ins, writebacks))
            for m in meshes:
                self.by_mesh.setdefault(m, []).append(k)
        self.final = [(v, target, numbering.decide(v, target.dist_attr, target.name, None))
                      for v, target in writebacks]

    def ops_of(self, pid: int) -> list:
        """The indices of the ops process ``pid`` takes part in, in program order."""
        found: set = set()
        for mesh, ks in self.by_mesh.items():
            if pid in mesh:
                found.update(ks)
        return sorted(found)


class _Partitioner:
    """``plans``: {(src, dst, shape, dtype): steps}, shared by the partitions of one
    program so that each reshard is planned once; ``shapes``: {(DistAttr, global shape):
    local shape}, shared alike (a local shape is the same on every process)."""

    def __init__(self, program: Program, pid: int, plans: dict, shapes: dict | None = None):
        self.g, self.pid = program, pid
        self.local = Program()
        self.points: dict[int, list] = {}
        self.numbering = _Numbering()
        self.plans = plans
        self.shapes = {} if shapes is None else shapes
        self.at = -1      # global index of the op being partitioned (see ReshardPoint.anchor)
        self.context: dict = {}
        self.op_comm: dict = {}

    def held(self, v: Value) -> bool:
        return self.pid in v.dist_attr.mesh

    def local_shape(self, attr: DistAttr, shape) -> tuple:
        """``attr.local_shape(shape)``, validated and computed once per program."""
        key = (attr, tuple(shape))
        local = self.shapes.get(key)
        if local is None:
            local = self.shapes[key] = attr.local_shape(shape)
        return local

    def local_value(self, v: Value) -> Value:
        if v.name not in self.local.values:
            self.local.add_value(Value(v.name, self.local_shape(v.dist_attr, v.shape), v.dtype,
                                       v.is_parameter, v.persistable, v.role, v.alias_of,
                                       v.annotation, v.dist_attr))
        return self.local.values[v.name]

    def reshard(self, v: Value, dst: DistAttr, stores: str | None = None,
                role: Role | None = None) -> str | None:
        """Place a reshard point (once per value and layout, see the module docstring);
        the local name of the result. ``role``: the consuming op's."""
        return self.place(v, dst, stores, self.numbering.decide(v, dst, stores, role))

    def place(self, v: Value, dst: DistAttr, stores: str | None, d: _Decision) -> str:
        """The point ``d`` decided, in this process's program where it takes part."""
        src = d.src
        if src is not None and (self.pid in src.mesh or self.pid in dst.mesh):
            held = d.near if d.near is not None else v.name if self.held(v) else None
            steps = _steps(self.plans, src, dst, v.shape, v.dtype)
            reads = (held,) if held is not None and self.pid in src.mesh else ()
            writes = (d.name,) if self.pid in dst.mesh else ()
            if writes:
                self.local.add_value(Value(d.name, self.local_shape(dst, v.shape), v.dtype,
                                           role=v.role, dist_attr=dst))
            self.points.setdefault(len(self.local.ops), []).append(
                ReshardPoint(v.name, src, dst, tuple(v.shape), v.dtype, steps, reads, writes,
                             d.seq, (stores,) if stores and writes else (), self.at))
        return d.name

    def _start(self) -> None:
        for v in self.g.inputs:
            if self.held(v):
                self.local.inputs.append(self.local_value(v))
        for v in self.g.persistables:
            if self.held(v):
                self.local_value(v)

    def _result(self) -> LocalProgram:
        return LocalProgram(self.pid, self.local, self.points, self.context, self.op_comm)

    def run(self) -> LocalProgram:
        """Every op in turn, the reshard bookkeeping done here (the plain path)."""
        self._start()
        writebacks = []
        for k, op in enumerate(self.g.ops):
            for v, target in writebacks:     # updates stored in another layout, e.g. the
                self.reshard(v, target.dist_attr, target.name)  # all-gather after ZeRO
            self.at = k
            da = op.dist_attr
            ins = []
            for i, v in enumerate(op.inputs):
                if v.dist_attr.mesh == da.mesh and v.dist_attr.spec == da.input_specs[i]:
                    if self.pid in da.mesh:      # (compared without making a DistAttr: hot)
                        ins.append(self.local_value(v))
                else:
                    name = self.reshard(v, DistAttr(da.mesh, da.input_specs[i]), role=op.role)
                    if self.pid in da.mesh:
                        ins.append(self.local.values[name])
            # Every process notes the write-backs, so all number reshard points alike.
            writebacks = [(o, self.g.values[o.alias_of]) for o in op.outputs if o.alias_of
                          and self.g.values[o.alias_of].dist_attr != o.dist_attr]
            if self.pid in da.mesh:
                self._append(op, ins, writebacks)
        for v, target in writebacks:
            self.reshard(v, target.dist_attr, target.name)
        return self._result()

    def run_from(self, skeleton: _Skeleton) -> LocalProgram:
        """:meth:`run` with the bookkeeping ``skeleton`` did for every process: only
        the ops this process takes part in are visited."""
        self._start()
        ops = self.g.ops
        for k in skeleton.ops_of(self.pid):
            before, reshards, writebacks = skeleton.ops[k]
            self.at = k - 1                  # the write-backs of op k - 1
            for v, target, d in before:
                self.place(v, target.dist_attr, target.name, d)
            self.at = k
            op = ops[k]
            on = self.pid in op.dist_attr.mesh
            ins = []
            for v, r in zip(op.inputs, reshards):
                if r is None:
                    if on:
                        ins.append(self.local_value(v))
                else:
                    name = self.place(v, r[0], None, r[1])
                    if on:
                        ins.append(self.local.values[name])
            if on:
                self._append(op, ins, writebacks)
        self.at = len(ops) - 1
        for v, target, d in skeleton.final:
            self.place(v, target.dist_attr, target.name, d)
        return self._result()

    def _append(self, op: Operation, ins: list, writebacks: list) -> None:
        """Op ``op`` of this process's mesh on its local operands ``ins``."""
        da = op.dist_attr
        for j, o in enumerate(op.outputs):
            if o.dist_attr.mesh != da.mesh or o.dist_attr.spec != da.output_specs[j]:
                raise PlanError(f"op {op.type} ({op.layer}) produces {o.name} as "
                                f"{DistAttr(da.mesh, da.output_specs[j])}, but the value "
                                f"says {o.dist_attr}")
        outs = [self.local_value(o) for o in op.outputs]
        for o, _ in writebacks:
            self.local.values[o.name].alias_of = None
        attrs = dict(op.attrs)
        opdef = get_op(op.type)
        if opdef.localize is not None or opdef.comm is not None:
            site = LocalSite(self.pid, tuple(v.shape for v in op.inputs),
                             tuple(DistAttr(da.mesh, s) for s in da.input_specs),
                             tuple(o.shape for o in op.outputs),
                             tuple(DistAttr(da.mesh, s) for s in da.output_specs),
                             tuple(v.dtype for v in op.inputs), tuple(sorted(attrs.items())))
        if opdef.localize is not None:
            attrs, ctx = opdef.localize(attrs, site)
            if ctx:
                self.context[len(self.local.ops)] = ctx
        if opdef.comm is not None and opdef.comm(site):
            self.op_comm[len(self.local.ops)] = tuple(opdef.comm(site))
        self.local.append_op(Operation(op.type, ins, outs, attrs, op.role, op.layer,
                                       annotation=op.annotation, dist_attr=da))


def reuses(made_for: Role | None, role: Role | None, src: DistAttr, dst: DistAttr,
           shape) -> bool:
    """Whether an op of ``role`` reads the copy of a value already resharded from ``src``
    (the value, or on another mesh its smallest copy there) to ``dst`` for an op of
    ``made_for`` (see the module docstring): always, except that the backward gathers
    again what the forward gathered on ``src``'s mesh."""
    if not (role is Role.BACKWARD and made_for is Role.FORWARD and src.mesh == dst.mesh):
        return True
    return (int(np.prod(dst.local_shape(shape), dtype=np.int64))
            <= int(np.prod(src.local_shape(shape), dtype=np.int64)))


def _steps(plans: dict, src: DistAttr, dst: DistAttr, shape, dtype) -> tuple:
    """The steps from ``src`` to ``dst`` (none where a replicated value is read on its
    own processes), planned once per ``plans``."""
    key = (src, dst, tuple(shape), dtype)
    if key not in plans:
        plans[key] = (() if local_view_only(src, dst)
                      else tuple(plan_reshard(src, dst, shape, dtype)))
    return plans[key]


def partition(program: Program, process_id: int) -> LocalProgram:
    """The local program of ``process_id`` (see the module docstring)."""
    if not any(process_id in op.dist_attr.mesh for op in program.ops) and \
            process_id not in process_ids(program):
        raise PlanError(f"process {process_id} has no part in this program "
                        f"(processes {process_ids(program)})")
    _check_completed(program)
    return _Partitioner(program, process_id, {}).run()


def gather_points(program: Program, names, process_id: int,
                  shapes=None) -> list[ReshardPoint]:
    """Reshard points that bring the global value of each of ``names`` to every process
    (used to report the loss and to read parameters whatever the plan); ``shapes``
    ({name: global shape}) gathers a value as if it had that shape (a padded one)."""
    return _gather_points(program, world_mesh(program), names, process_id, {}, shapes)


def _gather_points(program, world, names, process_id, plans,
                   shapes=None) -> list[ReshardPoint]:
    points = []
    for seq, name in enumerate(names):
        v = program.values[name]
        shape = tuple((shapes or {}).get(name, v.shape))
        dst = DistAttr(world, ShardSpec.replicated(v.ndim))
        steps = () if v.dist_attr == dst else _steps(plans, v.dist_attr, dst, shape, v.dtype)
        points.append(ReshardPoint(name, v.dist_attr, dst, shape, v.dtype, steps,
                                   (name,) if process_id in v.dist_attr.mesh else (),
                                   (f"{name}@GLOBAL",), seq))
    return points


class Partitions(Mapping):
    """{process id: LocalProgram} of a completed ``program`` (module docstring): a
    process is partitioned when first asked for and kept; the reshards are planned once
    for all processes. :meth:`groups` gives the processes by the meshes they are on: the
    processes of one group have the same local ops, values, local shapes and reshard
    points (what differs is what depends on a process's coordinates: an op's shard
    offsets, a dropout's slice, its process groups, a p2p step's own tiles).

    Example::

        parts = Partitions(program)
        first = [parts[g[0]] for g in parts.groups()]     # one local program per group
    """

    def __init__(self, program: Program, ids=None):
        _check_completed(program)
        self.program = program
        self.ids = tuple(process_ids(program) if ids is None else ids)
        self._index = set(self.ids)
        self._made: dict = {}
        self._plans: dict = {}
        self._shapes: dict = {}
        self._groups: tuple | None = None
        self._group_of: dict | None = None
        self._world: ProcessMesh | None = None
        self._skeleton: _Skeleton | None = None

    @classmethod
    def given(cls, program: Program, locals_: dict) -> "Partitions":
        """The local programs ``locals_`` ({pid: LocalProgram}) made elsewhere (the member
        programs of an uneven batch split): each process is a group of its own, as the
        programs of two processes may differ in their rows."""
        parts = cls(program, sorted(locals_))
        parts._made = dict(locals_)
        parts._groups = tuple((pid,) for pid in parts.ids)
        return parts

    def __getitem__(self, pid: int) -> LocalProgram:
        if pid not in self._made:
            if pid not in self._index:
                raise KeyError(pid)
            if self._skeleton is None:
                self._skeleton = _Skeleton(self.program)
            self._made[pid] = _Partitioner(self.program, pid, self._plans,
                                              self._shapes).run_from(self._skeleton)
        return self._made[pid]

    def __contains__(self, pid) -> bool:
        return pid in self._index

    def __iter__(self):
        return iter(self.ids)

    def __len__(self) -> int:
        return len(self.ids)

    def groups(self) -> tuple:
        """Tuples of processes on the same meshes, each ascending, ordered by their first
        process: ``groups()[k][0]`` stands for the whole group."""
        if self._groups is None:
            meshes = {op.dist_attr.mesh for op in self.program.ops}
            meshes |= {v.dist_attr.mesh for v in self.program.values.values()}
            on: dict = {pid: [] for pid in self.ids}
            for n, pids in enumerate(sorted({tuple(m.process_ids) for m in meshes})):
                for q in pids:
                    on[q].append(n)
            by_meshes: dict = {}
            for pid in self.ids:
                by_meshes.setdefault(tuple(on[pid]), []).append(pid)
            self._groups = tuple(sorted(tuple(g) for g in by_meshes.values()))
        return self._groups

    def group_of(self, pid: int) -> tuple:
        """The group (see :meth:`groups`) of process ``pid``."""
        if self._group_of is None:
            self._group_of = {q: g for g in self.groups() for q in g}
        return self._group_of[pid]

    def gather_points(self, names, process_id: int, shapes=None) -> list[ReshardPoint]:
        """:func:`gather_points` with the reshards planned once for all processes."""
        if self._world is None:
            self._world = ProcessMesh(list(self.ids), dim_names=["world"])
        return _gather_points(self.program, self._world, names, process_id, self._plans,
                              shapes)
