"""The stage plan of a model of identical blocks: Alpa's stage DP
(:mod:`distgraph.passes.search.run_dp`) on the options of
:class:`~distgraph.passes.search.runs.RunCosts`, plain or interleaved.

The variants are searched only when they can matter (:func:`plan_blocks`). A variant's
block is the fastest within a memory budget, so no faster than the fastest block: the
variants can only help the stages fit. If the DP on the fastest options reaches the
latency it reaches with the devices' memory unlimited, memory costs nothing there and
the plan stands (the eager search would find the same latency; it could differ only where
a variant's re-searched E or H, or its layouts priced on another mesh, came out faster
than the fastest parts'); otherwise, or when nothing fits, the DP runs again with them.

Example::

    costs = RunCosts(copy, strategy, cluster, layering, micro=8)
    plan, chosen = plan_blocks(costs, cluster, micro_batches=8)   # variants if needed
"""

from __future__ import annotations

from distgraph.errors import PlanError
from distgraph.passes.search.run_dp import beats, plan_interleaved, plan_runs


def plan_blocks(costs, cluster, micro_batches: int = 1, virtual: int = 1) -> tuple:
    """(StagePlan, the option of each stage) of ``costs``' layers on ``cluster``: the
    stage DP on the fastest options, then on all the variants only if the devices'
    memory made it slower than without limits, or nothing fit (module docstring).
    With ``virtual`` > 1 the interleaved pipelines of 2, 4 .. ``virtual`` chunks per
    stage (:func:`~distgraph.passes.search.run_dp.plan_interleaved`, on every option
    and variant) compete with it; the least objective wins."""
    count, blocks = costs.layering.count, costs.blocks
    fastest = costs.options(variants=False)
    try:
        plan = plan_runs(count, blocks, fastest, cluster, micro_batches)
    except PlanError:               # nothing fits: the variants may
        plan = None
    if plan is None or beats(plan[0].objective, count, blocks, fastest, cluster,
                             micro_batches, fit_memory=False):
        try:
            plan = plan_runs(count, blocks, costs.options(variants=True), cluster,
                             micro_batches)
        except PlanError:
            if virtual < 2:
                raise
    if virtual < 2:
        return plan
    # compared with the p2p transfers priced in, which interleaving multiplies by v
    best = None if plan is None else \
        plan[0].objective + (len(plan[0].stages) + micro_batches - 1) * \
        max(p2p_seconds(o, cluster) for o in plan[1])
    for variants in (False, True):
        fits = False
        v = 2
        while v <= virtual:
            found = plan_interleaved(count, blocks, costs.options(variants=variants),
                                     cluster, micro_batches, v, costs.chunk_layers,
                                     p2p_seconds)
            fits = fits or found is not None
            if found is not None and (best is None or found[0].objective < best):
                plan, best = found, found[0].objective
            v *= 2
        if fits:
            break       # the memory variants are searched only where no alike stages fit
    if plan is None:
        raise PlanError(f"no split of {count} layers into stages, interleaved ({virtual} "
                        f"chunks per stage at most) or not, fits the devices' memory; use "
                        f"devices with more memory, recomputation or fewer micro-batches")
    return plan


def p2p_seconds(option, cluster) -> float:
    """Seconds a stage of ``option`` spends per micro-batch and chunk sending a block's
    output on and its gradient back (alpha-beta on the link from its first device to
    the device one submesh on)."""
    ids = option.sub.mesh.ids
    a = ids[0]
    b = ids[option.sub.size % len(ids)]
    if a == b:
        return 0.0
    per = cluster.latency(a, b) * 1e-6 + option.p2p_bytes() / (cluster.bandwidth(a, b) * 1e9)
    return 2 * per


def undominated(options: list) -> list:
    """``options`` without those another one matches or beats in every part's time and
    memory (the DP would never prefer them): variants searched on one mesh and priced on
    another may coincide there (on one device, every variant is the whole block)."""
    def figures(option) -> list:
        out = []
        for part in sorted(option.parts):
            cost = option.parts[part][0]
            out += [cost.time, cost.persistent, cost.saved, cost.transient]
        return out

    def covers(a, b) -> bool:
        return all(x <= y for x, y in zip(a, b))

    kept = []
    for option in options:
        mine = figures(option)
        if not any(covers(figures(other), mine) for other in kept):
            kept = [o for o in kept if not covers(mine, figures(o))]
            kept.append(option)
    return kept
