"""The process graph of a completed program: what rank mapping needs to place it.

Bytes and messages between processes come from the reshard points of every process's partition
(collectives spread over their rings as in :mod:`distgraph.passes.mapping.process_graph`, p2p
tiles as sent); memory is each process's local persistable bytes (GB); compute its
local FLOPs (GFLOP per step); a process needs the device type given, if any.

Example::

    graph = process_graph(completed_program, device_type="GPU")
    mapping = map_ranks(graph, cluster)
"""

from __future__ import annotations

from distgraph.ir import Program
from distgraph.plan.kinds import COLLECTIVES
from distgraph.registry import TensorType, get_op
from distgraph.passes.partition import Partitions
from distgraph.passes.mapping.process_graph import (ProcessGraph, collective_messages,
                                            collective_traffic)



def _add(into: dict, pairs: dict) -> None:
    for pair, amount in pairs.items():
        into[pair] = into.get(pair, 0.0) + amount


def _point_traffic(point, traffic: dict, messages: dict, times: int = 1) -> None:
    """Add the bytes and messages per unordered pair of one reshard point (its steps, all
    processes), run ``times`` a step, to ``traffic`` and ``messages``."""
    for step in point.steps:
        if step.kind in COLLECTIVES:
            groups = step.mesh.groups(step.mesh_dim)
            _add(traffic, {pair: times * b for pair, b in
                           collective_traffic(groups, step.buffer_bytes, step.kind).items()})
            _add(messages, {pair: times * n for pair, n in
                            collective_messages(groups, step.kind).items()})
        elif step.kind == "send_recv":
            for t in step.transfers:
                if t.src != t.dst:
                    pair = (min(t.src, t.dst), max(t.src, t.dst))
                    _add(traffic, {pair: float(times * t.nbytes)})
                    _add(messages, {pair: float(times)})


def process_graph(program: Program, partitions: Partitions | None = None,
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
    traffic: dict = {}
    messages: dict = {}
    memory, compute = [0.0] * len(ids), [0.0] * len(ids)
    seen_points = set()
    roles = [op.role for op in program.ops]
    for group in parts.groups():
        local = parts[group[0]]
        for point in local.points():
            key = (point.value, point.dst, point.seq)
            if key in seen_points:
                continue
            seen_points.add(key)
            once = point.anchor >= 0 and roles[point.anchor] == "optimize"
            _point_traffic(point, traffic, messages, 1 if once else micro_batches)
        flops = 0
        for op in local.program.ops:
            ins = [TensorType(v.shape, v.dtype) for v in op.inputs]
            outs = [TensorType(v.shape, v.dtype) for v in op.outputs]
            flops += get_op(op.type).flops(ins, outs, **op.attrs) * (
                1 if op.role == "optimize" else micro_batches)
        held = sum(v.nbytes for v in local.program.persistables) / 1e9
        for pid in group:
            memory[pid], compute[pid] = held, flops / 1e9
    return ProcessGraph(len(ids), traffic, device_type, compute, memory, messages)
