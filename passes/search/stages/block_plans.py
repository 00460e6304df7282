"""The stage plan of a model of identical blocks: Alpa's stage DP
(:mod:`distgraph.passes.search.stages.run_dp`) on the options of
:class:`~distgraph.passes.search.stages.runs.RunCosts`, plain or interleaved, every stage's
transfers to its neighbours priced (:meth:`~distgraph.passes.search.stages.runs.RunCosts.
p2p_seconds`) as the plan's estimate counts them.

The variants are searched only when they can matter (:func:`plan_blocks`). A variant's
block is the fastest within a memory budget, so no faster than the fastest block: the
variants can only help the stages fit. The plans on the fastest options come first (the
interleaved ones, cheap, then the plain DP below their latency). A mesh's variants are
then searched only where nothing fits, or where its fastest option's stages tiling the
device mesh alike (plain or interleaved; plain, the faster of the layers and the blocks
split evenly: :func:`~distgraph.passes.search.stages.interleaved.even_splits`), the
devices' memory aside, beat the best plan found: memory held it back there (Korthikanti's
530B: three blocks on each of 35 stages once the variants of its (1, 8) mesh fit them, a
step of 38.3 s against 47.0 s where the layers' split, a fourth block on some stages, was
all the alike stages looked at). Elsewhere the variants could only fit a plan that is
slower anyway. (A plan of unlike stages that needs the variants of a mesh whose alike
stages do not beat the best is not looked for: on models of identical blocks the best
plans tile the devices alike.) The DPs then run again on the fastest options and the
variants searched, below the best latency so far: first with the variants of the (x, t)
meshes, then with the (dp, cp, tp) meshes too, whose variants are searched where their
alike stages beat the plan the first found. Where memory holds nothing back, the DPs
run again with the (dp, cp, tp) meshes' fastest options all the same (their variants
not): a sequence split can be the faster plan with memory to spare (Llama 3 405B, 8,192
tokens on 8,192 GPUs: 8 stages of (64, 4, 4), 402 TFLOP/s, against 362 for 16 stages
of (64, 8); at 131,072 tokens Meta's (8, 16, 8), which the (128, 8) plan fits without).

Example::

    costs = RunCosts(prepared, strategy, cluster, layering, micro=8)
    plan, chosen = plan_blocks(costs, cluster, micro_batches=8)   # variants if needed
"""

from __future__ import annotations

import math

from distgraph.errors import DoesNotFit, PlanError
from distgraph.passes.cost.stage import priced_stages, step_time
from distgraph.passes.search.stages.even import plan_even
from distgraph.passes.search.stages.interleaved import alike_stages, even_splits, plan_interleaved
from distgraph.passes.search.stages.run_dp import plan_runs


def plan_blocks(costs, cluster, micro_batches: int = 1, virtual: int = 1,
                below: float = math.inf) -> tuple | None:
    """(StagePlan, the option of each stage) of ``costs``' layers on ``cluster``: the
    stage DP and, with ``virtual`` > 1, the interleaved pipelines of 2, 4 .. ``virtual``
    chunks per stage (:func:`~distgraph.passes.search.stages.interleaved.plan_interleaved`) on the
    fastest options, then on the memory variants of the meshes where memory held them
    back (module docstring); the least objective wins (under ``Strategy(target=...)``
    the even splits of :mod:`~distgraph.passes.search.stages.even` alone). ``below``: a latency another
    plan has (another micro-batch count's): only plans below it are looked for, and
    memory holds a mesh back only where its alike stages beat it (where the fastest
    options fit some plan, however slow; where they fit none, every mesh's variants are
    searched, as without ``below``); None where none is found."""
    if costs.strategy.target is not None:      # a framework's stages: split evenly
        return plan_even(costs, cluster, micro_batches, below)
    count, blocks = costs.layering.count, costs.blocks
    p2p, schedule = costs.p2p_seconds, costs.strategy.schedule
    chunks = [2 ** k for k in range(1, int(math.log2(max(virtual, 1))) + 1)]

    def best_of(options, plan, bound=below):
        latency = plan[0].objective if plan is not None else bound
        for v in chunks:
            found = plan_interleaved(count, blocks, options, cluster, micro_batches, v,
                                     costs.chunk_layers, p2p)
            if found is not None and found[0].objective < latency:
                plan, latency = found, found[0].objective
        try:
            plain = None
            fits = _fitting_alike(options, count, blocks, cluster, micro_batches, p2p,
                                  schedule)
            if fits < latency:      # a plan the DP can make: its caps pruned from the start
                plain = plan_runs(count, blocks, options, cluster, micro_batches, p2p=p2p,
                                  below=fits * (1 + 1e-9), schedule=schedule)
            plain = plain or plan_runs(count, blocks, options, cluster, micro_batches,
                                       p2p=p2p, below=latency, schedule=schedule)
        except PlanError:           # nothing fits
            plain = None
        return plain or plan

    fastest = costs.options(variants=False)
    plan = best_of(fastest, None)
    latency = plan[0].objective if plan is not None else below
    layouts: dict = {}

    def held_back(option) -> bool:
        """Whether ``option``'s alike stages beat the best plan, memory aside."""
        for v in [1] + chunks:
            found = alike_stages(option, count, blocks, cluster, micro_batches, v,
                                 costs.chunk_layers, p2p, layouts)
            if found is not None and found[0] < latency:
                return True
        return False

    # where the fastest options fit no plan at all, every mesh's variants are searched,
    # below a latency too (the search without one does: a plan of unlike stages may
    # need the variants of a mesh whose alike stages do not beat the latency)
    fits = plan is not None or (math.isfinite(below) and
                                best_of(fastest, None, math.inf) is not None)
    wanted = held_back if fits else None
    if wanted is None or any(held_back(o) for o in fastest):
        # the variants of the (x, t) meshes first: the plan they give holds the (dp, cp,
        # tp) meshes' variants back where those meshes' alike stages do not beat it
        plan = best_of(costs.options(variants=True, wanted=wanted, sequence=False), plan)
        latency = plan[0].objective if plan is not None else below
        plan = best_of(costs.options(variants=True, wanted=wanted), plan)
    elif plan is not None:      # memory held nothing back: the (dp, cp, tp) meshes' fastest
        plan = best_of(costs.options(variants=True, wanted=lambda o: False), plan)
    if plan is None and math.isfinite(below):
        return None
    if plan is None:
        how = f", interleaved ({virtual} chunks per stage at most) or not," if virtual > 1 else ""
        # the planner names the memory savers that make it fit (passes/fitting.py)
        raise DoesNotFit(f"no split of {count} layers ({len(blocks)} identical blocks) into "
                         f"stages{how} fits the devices' memory (with the activations "
                         f"{schedule} keeps in flight) while covering every device")
    return plan


def _fitting_alike(options, count: int, blocks: range, cluster, micro_batches: int,
                   p2p, schedule: str = "1F1B") -> float:
    """The least objective of a plan of alike stages tiling a device mesh (one option,
    the layers or the blocks split evenly as :func:`~distgraph.passes.search.stages.
    interleaved.alike_stages` splits them) whose every stage fits the memory as the
    stage DP counts it (``schedule``'s micro-batches in flight at the s-th stage),
    each stage paying its transfers' share as the DP's tables do (by the parts it
    holds, E and H having one neighbour): a plan the DP can make, so its optimum is no
    greater (inf where none)."""
    best = math.inf
    meshes = cluster.device_meshes
    limits: dict = {}               # device ids of a mesh -> their least usable memory
    for option in options:
        mesh = option.sub.mesh
        if len(meshes) != 1 or mesh.size % option.sub.size:
            continue
        S = mesh.size // option.sub.size
        if S > count:
            continue
        if mesh.ids not in limits:
            limits[mesh.ids] = min(cluster.device(i).usable_memory() for i in mesh.ids)
        limit = limits[mesh.ids]
        for parts in even_splits(S, blocks, count):
            times, memories, _ = priced_stages(option, parts, micro_batches,
                                               p2p(option) if p2p is not None else 0.0,
                                               schedule=schedule)
            if max(memories) <= limit:
                best = min(best, step_time(times, micro_batches))
    return best


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
