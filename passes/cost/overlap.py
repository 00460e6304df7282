"""The price of gradient buckets reduced during the backward (``Strategy(overlap=True)``),
as the runtime runs them (:mod:`distgraph.plan.buckets`).

A bucket's reductions start after the op that makes its last gradient, in the step's last
micro-batch. Each reduction costs the processor the copies of its software
(:func:`~.prices.software_time`'s part per byte: packing, sums; and, inside one machine
of CPUs, the transfer itself, which the processes copy themselves) where it starts; the
rest runs while the backward computes: its alpha-beta time on the wires
(:meth:`~.prices.Ring.seconds` on its group's ring) and its software's part per
step, the wait at each round for the neighbour to reach it (with more ranks than cores,
a descheduled neighbour's), which the rank spends computing instead of waiting; a
bucket's reductions start together, so their group meets once for all of them: the bucket
pays the largest of their waits per group, each reduction its own alpha-beta. The wires
carry one collective at a time, in the order they start (a ZeRO-3 gather the backward
prefetched included, :func:`~.exposed.finishes`). After the backward's last op, each op
waits for the buckets of the reductions it reads: the update, whose ops run in the order
the backward made their gradients (:meth:`~distgraph.optim.Optimizer.append_update`), so
that the first bucket reduced is the first updated, and the update computes while the
later buckets are on the wire. The step pays what those waits add. A device whose
processor moves the bytes too (CPUs: ``Device.hides``, the calibrated
``overlap_efficiency``) hides only that share of the wire seconds behind the compute: the
rest its processor still pays.

Under ZeRO-3 the gathers a layer ahead (:func:`prefetch_seconds`) run on the same wires
while the layer before computes; each pays its copies and what its reader still waits
for.

Example::

    charged, hidden, seqs = bucket_seconds(plan, local, pid, rings, scale, op_seconds)
"""

from __future__ import annotations

import bisect

from distgraph.ir import Role
from distgraph.plan.buckets import (gradient_buckets, overlapping, prefetch_groups,
                                    prefetch_unit, prefetchable, prefetching)
from distgraph.passes.cost.prices import reshard_step_time, software_time
from distgraph.passes.cost.exposed import bucket_terms, exposed


def bucket_seconds(plan, local, pid: int, rings, scale, op_seconds: dict,
                   busy=()) -> tuple:
    """(seconds the step pays for the bucketed reductions of process ``pid``'s
    ``local`` program, seconds of them hidden behind the backward, the seqs of their
    points); ``op_seconds[i]``: one run of local op i; ``scale``: the process's
    :class:`~.shares.Scale`; ``busy``: (start, wire seconds) of the other collectives
    the backward starts on the same wires (its prefetched gathers,
    :func:`prefetch_seconds`), seconds into it, which a bucket started after one waits
    behind. Nothing where the plan does not overlap."""
    if not overlapping(plan):
        return 0.0, 0.0, frozenset()
    buckets = gradient_buckets(local, plan.strategy.bucket_mb)
    if not buckets:
        return 0.0, 0.0, frozenset()
    ops = local.program.ops
    backward = [i for i, op in enumerate(ops) if op.role is Role.BACKWARD]
    points = {p.seq: p for p in local.points()}
    priced = []
    for bucket in buckets:
        reductions = []
        for seq in bucket.points:
            p = points[seq]
            step = p.steps[0]
            reductions.append((reshard_step_time(step, pid, rings, scale.of_step(p, step)),
                               _wire(step, pid, rings, scale.of_step(p, step)),
                               _waits(step, pid, rings),
                               tuple(step.mesh.group_of(pid, step.mesh_dim))))
        priced.append((bisect.bisect_right(backward, bucket.after), *bucket_terms(reductions)))
    # after the backward, each op waits for the buckets of the reductions it reads (the
    # update, in the order the backward made its gradients)
    at = {p.seq: i for i, found in local.comm_points.items() for p in found}
    reads: dict = {}
    for b, bucket in enumerate(buckets):
        for seq in bucket.points:
            reads.setdefault(at[seq], set()).add(b)
    after = [(op_seconds.get(i, 0.0), reads.get(i, ()))
             for i in range(max(backward, default=-1) + 1, len(ops))]
    paid, hidden = exposed([op_seconds.get(i, 0.0) for i in backward], priced, after,
                           rings.device(pid).hides, busy)
    return paid, hidden, frozenset(s for b in buckets for s in b.points)


def _wire(step, pid: int, rings, scale: float) -> float:
    """:func:`wire_seconds` of a collective ``step`` at process ``pid``; 0 for a group of
    one."""
    if step.group_size <= 1 or pid not in step.mesh:
        return 0.0
    return wire_seconds(step.kind, step.group_size, step.buffer_bytes * scale,
                        rings.along(step.mesh, pid, step.mesh_dim), rings.device(pid))


def wire_seconds(kind, n: int, nbytes: float, ring, device) -> float:
    """The seconds of a collective of ``kind`` over a group of ``n`` on a buffer of
    ``nbytes`` that need no processor (module docstring): its alpha-beta seconds on the
    group's ``ring`` (not inside one machine of CPUs, whose transfers the processes copy
    themselves) and the waits of its software per step (:func:`waits_seconds`)."""
    waits = waits_seconds(kind, n, device)
    if ring.copied:
        return waits
    return waits + ring.seconds(kind, n, nbytes)


def _waits(step, pid: int, rings) -> float:
    """:func:`waits_seconds` of a collective ``step`` at process ``pid``."""
    if pid not in step.mesh:
        return 0.0
    return waits_seconds(step.kind, step.group_size, rings.device(pid))


def waits_seconds(kind, n: int, device) -> float:
    """The seconds of a collective's software per step on ``device`` (the waits at its
    rounds for the group to meet, :func:`~.prices.software_time` of no bytes); 0 for a
    group of one."""
    return software_time(device, kind, 0.0, n) if n > 1 else 0.0


def prefetched_order(plan, local, seqs) -> list | None:
    """The order in which a process holds its items (``seqs[k]``: the seq of item k's
    reshard point, None for an op) with its ZeRO-3 gathers prefetched: each group of
    gathers of a layer (:func:`~distgraph.plan.buckets.prefetch_groups`) moved to just
    after the first gather of the group before it in the same pass (forward or backward),
    where the runtime starts it; None where nothing is prefetched."""
    found = _groups(plan, local, seqs)
    if found is None:
        return None
    ahead = found[1]
    moved = {k for group in ahead.values() for k in group}
    order = []
    for k in range(len(seqs)):
        if k not in moved:
            order.append(k)
        for j in ahead.get(k, ()):
            if j not in order:
                order.append(j)
    return order


def prefetch_seconds(plan, local, pid: int, rings, scale, op_seconds: dict) -> tuple:
    """({seq: seconds one micro-batch pays for that prefetched ZeRO-3 gather} of process
    ``pid``'s ``local`` program (``op_seconds[i]``: one run of local op i), as the
    runtime runs them: at a layer's first gather, its group's gathers not yet started
    and the next group's of the same pass start, each costing the processor its
    software's copies there while the rest (:func:`_wire`) runs on the wires, one
    collective at a time; the gather's reader waits for what is left of it. A gather
    pays its copies and its wait. Also (start, wire seconds) of each gather the
    backward starts, seconds after its first op starts (what :func:`bucket_seconds`
    shares the wires with). Empty where nothing is prefetched."""
    seqs, ops_at = [], []
    ops = local.program.ops
    for i in range(len(ops) + 1):
        for p in local.comm_points.get(i, ()):
            seqs.append(p.seq)
            ops_at.append(None)
        if i < len(ops):
            seqs.append(None)
            ops_at.append(i)
    found = _groups(plan, local, seqs)
    if found is None:
        return {}, ()
    groups, ahead = found
    group_of = {j: group for group in groups for j in group}
    points = {p.seq: p for p in local.points()}
    clock = wires = 0.0
    backward = None             # the clock when the backward's first op starts
    done, paid, busy, wired = {}, {}, [], {}
    kept = 1.0 - rings.device(pid).hides
    for k, seq in enumerate(seqs):
        if seq is None:
            if backward is None and ops[ops_at[k]].role is Role.BACKWARD:
                backward = clock
            clock += op_seconds.get(ops_at[k], 0.0)
            continue
        if k not in group_of:
            continue
        group = group_of[k]
        for j in group + ahead.get(group[0], ()):
            if j in done:
                continue
            p = points[seqs[j]]
            step = p.steps[0]
            factor = scale.of_step(p, step)
            wire = _wire(step, pid, rings, factor)
            copies = reshard_step_time(step, pid, rings, factor) - wire
            clock += copies
            if backward is not None:
                busy.append((max(wires, clock) - backward, wire))
            wires = max(wires, clock) + wire
            done[j], wired[j] = wires, wire
            paid[seqs[j]] = copies
        wait = max(0.0, done[k] - clock)
        # the share of its wire seconds behind compute that the device does not hide
        wait += kept * max(wired[k] - wait, 0.0)
        clock += wait
        paid[seq] += wait
    return paid, tuple(busy)


def _groups(plan, local, seqs) -> tuple | None:
    """(the groups of prefetched gathers among the items ``seqs`` (as
    :func:`prefetched_order` takes them), {the first item of a group: the next group of
    the same pass, started after it}); None where nothing is prefetched."""
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
            key_of[k] = (reader.role, prefetch_unit(reader.layer))
    groups = prefetch_groups(found, key_of)
    if len(groups) < 2:
        return None
    ahead = {}
    for before, after in zip(groups, groups[1:]):
        if key_of[before[0]][0] == key_of[after[0]][0]:
            ahead[before[0]] = after
    return groups, ahead
