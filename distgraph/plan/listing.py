"""``Plan.explain(full=True)``: the full listing of a plan, everything once.

Every rank, stage mesh and chunk, the schedule of each group of processes that run the
same order, the backend and the communicator of every group, the gradient accumulation,
every parameter's layout per layer, the matmuls that run as MeshSlice, every reshard
point with its bytes, the collectives inside ops, the search's and the batch split's
reports in full, each process's estimate and the checkpoint interval. Its length grows
with the processes (a 1,024-process plan lists 1,024 ranks): the summary
(:mod:`distgraph.plan.explain`) is what stays small.

Example::

    print(plan.explain(full=True))
"""

from __future__ import annotations

from distgraph.units import fmt_bytes


def full_listing(plan, estimate=None) -> str:
    """The full listing of ``plan`` (module docstring); ``estimate``: the one to print
    where the plan has none (else the plan's)."""
    estimate = estimate if estimate is not None else plan.estimate
    lines = [f"Plan: {plan.world_size} process(es), "
             f"{'distributed' if plan.distributed else 'serial'}, "
             f"{len(plan.program.ops)} ops"]
    if plan.rank_of is not None:
        lines.append("  ranks: " + ", ".join(f"process {p} -> rank {r}"
                                             for p, r in sorted(plan.rank_of.items())))
    for s, mesh in enumerate(plan.stages):
        lines.append(f"  stage {s}: {mesh}")
    if len(plan.graph.chunks) != len(plan.stages):
        lines.append(f"  {len(plan.graph.chunks)} chunks: " + ", ".join(
            f"{c} on stage {plan.stages.index(m)}" for c, m in enumerate(plan.graph.chunks)))
    lines.append("  " + plan.order.pretty().replace("\n", "\n  "))
    if plan.devices is not None:
        op_groups = [(local.program.ops[i].type, group)
                     for local in plan.representatives()
                     for i, members in local.op_groups()
                     for group in _translates(local.program.ops[i].dist_attr.mesh, members)]
        lines.extend("  " + line for line in
                     plan.devices.explain(plan.reshards(), op_groups, plan.ranks))
    if plan.accumulation is not None:
        lines.append("  " + plan.accumulation.pretty().replace("\n", "\n  "))
    lines.append("  parameters (layer: name shape spec):")
    for layer, params in _parameters_by_layer(plan.program).items():
        lines.append(f"    {layer or '(model)'}:")
        for v in params:
            lines.append(f"      {v.name} {list(v.shape)} {v.dist_attr.spec}")
    if plan.sliced:
        lines.append(f"  MeshSlice: {len(plan.sliced)} matmul(s) run as 2-D GeMMs with K "
                     "sliced, overlapped collectives (dataflow over mesh dims (u, v)):")
        lines.extend(f"    {use}" for use in plan.sliced)
    points = plan.reshards() if plan.distributed else []
    sent = plan.bytes_sent() if plan.distributed else {}
    busiest = max((sum(k.values()) for k in sent.values()), default=0.0)
    lines.append(f"  reshards: {len(points)} per step; busiest process sends "
                 f"{fmt_bytes(busiest)} per step")
    for p in points:
        lines.append(f"    {p} ({fmt_bytes(p.bytes)})")
    inside = plan.op_collectives() if plan.distributed else []
    if inside:
        lines.append(f"  collectives inside ops: {len(inside)} per step (bytes a process "
                     f"sends, at the expected load)")
        lines.extend(f"    {line}" for line in inside)
    for extra in (plan.search, plan.batch_split):
        if extra is not None:
            lines.append("  " + str(extra).replace("\n", "\n  "))
    if estimate is not None:
        lines.append("  estimate: " + estimate.per_process().replace("\n", "\n  "))
    if plan.checkpoint is not None:
        lines.append(f"  {plan.checkpoint}")
    return "\n".join(lines)


def _parameters_by_layer(program) -> dict:
    layers: dict = {}
    for v in program.parameters:
        layer, _, _ = v.name.rpartition(".")
        layers.setdefault(layer, []).append(v)
    return layers


def _translates(mesh, members) -> list:
    """Every group of ``mesh`` laid out as ``members`` (a group one process of its group
    of processes communicates in, :meth:`Plan.groups`): the same coordinates along the
    mesh dims it spans, at every coordinate of the others, in the same order."""
    coords = [mesh.coord(q) for q in members]
    varying = [a for a in range(mesh.ndim) if len({c[a] for c in coords}) > 1]
    groups = []
    for q in mesh.process_ids:
        at = mesh.coord(q)
        if any(at[a] != coords[0][a] for a in varying):
            continue
        groups.append(tuple(int(mesh.mesh[tuple(c[a] if a in varying else at[a]
                                                for a in range(mesh.ndim))])
                            for c in coords))
    return groups
