"""The price of gradient buckets reduced during the backward (``Strategy(overlap=True)``),
as the runtime runs them (:mod:`distgraph.plan.buckets`).

A bucket's reductions start after the op that makes its last gradient, in the step's last
micro-batch. Each reduction costs the processor the copies of its software
(:func:`~.prices.software_time`'s part per byte: packing, sums; and, inside one machine
of CPUs, the transfer itself, which the processes copy themselves) where it starts; the
rest runs while the backward computes: its alpha-beta time on the wires
(:func:`~.formulas.collective_time` on its group's ring) and its software's part per
step, the wait at each round for the neighbour to reach it (with more ranks than cores,
a descheduled neighbour's), which the rank spends computing instead of waiting. The wires carry one collective at a time, in the order they
start; the step waits for what is left after the backward's last op
(:func:`~.stage.exposed`).

Example::

    charged, hidden, seqs = bucket_seconds(plan, local, pid, rings, scale, op_seconds)
"""

from __future__ import annotations

from distgraph.ir import Role
from distgraph.plan.buckets import (gradient_buckets, overlapping, prefetch_groups, prefetchable,
                                    prefetching)
from distgraph.passes.cost.formulas import collective_time
from distgraph.passes.cost.prices import reshard_step_time, software_time
from distgraph.passes.cost.stage import exposed


def bucket_seconds(plan, local, pid: int, rings, scale, op_seconds: dict) -> tuple:
    """(seconds the step pays for the bucketed reductions of process ``pid``'s
    ``local`` program, seconds of them hidden behind the backward, the seqs of their
    points); ``op_seconds[i]``: one run of local op i; ``scale``: the process's
    :class:`~.shares.Scale`. Nothing where the plan does not overlap."""
    if not overlapping(plan):
        return 0.0, 0.0, frozenset()
    buckets = gradient_buckets(local, plan.strategy.bucket_mb)
    if not buckets:
        return 0.0, 0.0, frozenset()
    ops = local.program.ops
    backward = [i for i, op in enumerate(ops) if op.role is Role.BACKWARD]
    points = {p.seq: p for p in local.points()}
    processor = 0.0          # the buckets' software so far, run on the processor
    starts, paid = [], 0.0
    for bucket in buckets:
        wire = 0.0
        for seq in bucket.points:
            p = points[seq]
            step = p.steps[0]
            seconds = reshard_step_time(step, pid, rings, scale.of_step(p, step))
            w = _wire(step, pid, rings, scale.of_step(p, step))
            wire += w
            processor += seconds - w
        ready = sum(op_seconds.get(i, 0.0) for i in backward if i <= bucket.after) + processor
        starts.append((ready, wire))
    end = sum(op_seconds.get(i, 0.0) for i in backward) + processor
    left = exposed(starts, end)
    paid = processor + left
    hidden = sum(w for _, w in starts) - left
    return paid, hidden, frozenset(s for b in buckets for s in b.points)


def _wire(step, pid: int, rings, scale: float) -> float:
    """The seconds of a collective ``step`` that need no processor (module docstring):
    the alpha-beta seconds on its group's ring (not inside one machine of CPUs, whose
    transfers the processes copy themselves) and the waits of its software per step;
    0 for a group of one."""
    n = step.group_size
    if n <= 1 or pid not in step.mesh:
        return 0.0
    ring = rings.along(step.mesh, pid, step.mesh_dim)
    waits = software_time(rings.device(pid), step.kind, 0.0, n)
    if ring.copied:
        return waits
    return waits + collective_time(step.kind, n, step.buffer_bytes * scale, ring.bandwidth,
                                   ring.latency)


def prefetched_order(plan, local, seqs) -> list | None:
    """The order in which a process holds its items (``seqs[k]``: the seq of item k's
    reshard point, None for an op) with its ZeRO-3 gathers prefetched: each group of
    gathers of a layer (:func:`~distgraph.plan.buckets.prefetch_groups`) moved to just
    after the first gather of the group before it in the same pass (forward or backward),
    where the runtime starts it; None where nothing is prefetched."""
    if not prefetching(plan):
        return None
    ops = local.program.ops
    points = {p.seq: (i, p) for i in local.comm_points for p in local.comm_points[i]}
    found, key_of = [], {}
    for k, seq in enumerate(seqs):
        if seq is None or not prefetchable(points[seq][1], local):
            continue
        at, p = points[seq]
        reader = next((op for op in ops[at:] if p.writes[0] in
                       {v.name for v in op.inputs}), None)
        if reader is not None:
            found.append(k)
            key_of[k] = (reader.role, reader.layer)
    groups = prefetch_groups(found, key_of)
    if len(groups) < 2:
        return None
    ahead = {}
    for before, after in zip(groups, groups[1:]):
        if key_of[before[0]][0] == key_of[after[0]][0]:
            ahead[before[0]] = after
    moved = {k for group in ahead.values() for k in group}
    order = []
    for k in range(len(seqs)):
        if k not in moved:
            order.append(k)
        for j in ahead.get(k, ()):
            if j not in order:
                order.append(j)
    return order
