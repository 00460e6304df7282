"""The traffic graph of a completed program: the process graph rank mapping places.

Bytes and messages between processes come from what every process's partition runs:
its reshard points' steps (collectives over the groups of their mesh dim, p2p tiles as
sent) and the collectives ops run themselves, over the group their kernel names (the
vocab-parallel cross-entropy's class-split group; a MeshSlice matmul's over the groups of
the mesh dims its slices gather and scatter along), each spread over its pairs as the
cost model's load of the step (:func:`distgraph.passes.mapping.process_graph.group_sends`);
memory is each process's local persistable bytes (GB); compute its local FLOPs (GFLOP per
step); a process needs the device type given, if any.

Example::

    graph = traffic_graph(completed_program, device_type="GPU")
    mapping = map_ranks(graph, cluster)
"""

from __future__ import annotations

from distgraph.ir import Program, Role
from distgraph.passes.cost.prices import dims_of_group, groups_along
from distgraph.passes.mapping.process_graph import ProcessGraph, group_sends
from distgraph.passes.partition import Partitions
from distgraph.plan.kinds import StepKind
from distgraph.registry import TensorType, get_op


class _Pairs:
    """Bytes and messages per unordered pair, accumulated."""

    def __init__(self):
        self.traffic: dict = {}
        self.messages: dict = {}

    def add(self, sends, times: int) -> None:
        """Add ``(sender, receiver, messages, bytes)`` sends, run ``times`` a step."""
        for a, b, messages, nbytes in sends:
            pair = (min(a, b), max(a, b))
            self.traffic[pair] = self.traffic.get(pair, 0.0) + times * nbytes
            self.messages[pair] = self.messages.get(pair, 0.0) + times * messages

    def point(self, point, times: int) -> None:
        """The sends of one reshard point's steps (all processes)."""
        for step in point.steps:
            if step.kind.is_collective:
                self.add(group_sends(step.mesh.groups(step.mesh_dim), step.buffer_bytes,
                                     step.kind), times)
            elif step.kind is StepKind.SEND_RECV:
                self.add(((t.src, t.dst, 1, t.nbytes) for t in step.transfers
                          if t.src != t.dst), times)

    def op(self, local, index: int, times: int) -> None:
        """The sends of the collectives local op ``index`` runs itself (every process of
        its mesh alike): a sliced op's (MeshSlice) along the mesh dims its slices name,
        at the fewest slices its layout allows (the planner gives K after mapping), else
        the op's own over the group its kernel context names (else its whole mesh)."""
        op = local.program.ops[index]
        mesh = op.dist_attr.mesh
        hook = get_op(op.type).overlap
        ways = hook(op.attrs, [TensorType(v.shape, v.dtype) for v in op.inputs]) \
            if hook is not None else ()
        if ways:
            way = min(ways, key=lambda w: w.slices)
            for kind, dim, _, nbytes in way.before + way.after:
                self.add(_sends(mesh.groups(dim), nbytes, kind), times * way.slices)
            return
        group = (local.op_context.get(index) or {}).get("group") or mesh.process_ids
        groups = groups_along(mesh, dims_of_group(mesh, group))
        for kind, _, nbytes in local.op_comm.get(index, ()):
            self.add(_sends(groups, nbytes, kind), times)


def _sends(groups, nbytes: float, kind) -> list:
    """The sends of one collective an op runs itself over every group of ``groups``: a
    point-to-point step inside an op is a hop round its group's ring (ring attention's
    k, v blocks: each member sends to the next, the last to the first)."""
    if StepKind.parse(kind) is not StepKind.SEND_RECV:
        return group_sends(groups, nbytes, kind)
    return [(g[i], g[(i + 1) % len(g)], 1, nbytes) for g in groups if len(g) > 1
            for i in range(len(g))]


def traffic_graph(program: Program, partitions: Partitions | None = None,
                  device_type: str | None = None, micro_batches: int = 1) -> ProcessGraph:
    """Traffic, memory and compute per process of a completed program (``partitions``:
    its processes' local programs where they are made already) in one step: with
    ``micro_batches`` M the program is one micro-batch's, and what its forward and
    backward move and compute counts M times (the update's once). Processes on the same
    meshes hold and compute alike (:meth:`Partitions.groups`): one of each group is read."""
    parts = partitions if partitions is not None else Partitions(program)
    ids = list(parts.ids)
    if ids != list(range(len(ids))):
        raise ValueError(f"process ids must be 0..{len(ids) - 1}, got {ids}")
    pairs = _Pairs()
    memory, compute = [0.0] * len(ids), [0.0] * len(ids)
    seen_points, seen_ops = set(), set()
    roles = [op.role for op in program.ops]

    def times(role) -> int:
        return 1 if role == Role.OPTIMIZE else micro_batches

    for group in parts.groups():
        local = parts[group[0]]
        for point in local.points():
            key = (point.value, point.dst, point.seq)
            if key not in seen_points:
                seen_points.add(key)
                pairs.point(point, times(roles[point.anchor]) if point.anchor >= 0 else
                            micro_batches)
        flops = 0
        for index, op in enumerate(local.program.ops):
            ins = [TensorType(v.shape, v.dtype) for v in op.inputs]
            outs = [TensorType(v.shape, v.dtype) for v in op.outputs]
            flops += get_op(op.type).flops(ins, outs, **op.attrs) * times(op.role)
            key = (op.type, tuple(o.name for o in op.outputs))
            if key not in seen_ops:
                seen_ops.add(key)
                pairs.op(local, index, times(op.role))
        held = sum(v.nbytes for v in local.program.persistables) / 1e9
        for pid in group:
            memory[pid], compute[pid] = held, flops / 1e9
    return ProcessGraph(len(ids), pairs.traffic, device_type, compute, memory, pairs.messages)
