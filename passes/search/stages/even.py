"""The stage plan a framework's pipeline runs (``Strategy(target=...)``): Megatron-LM and
torchtitan split the transformer blocks evenly over stages of one mesh shape, the
embedding on the first stage and the head on the last.

So under a target the stage search is no DP: for each option of
:class:`~distgraph.passes.search.stages.runs.RunCosts` (a submesh in a logical (dp, tp) or
(dp, cp, tp) shape, its fastest parts or a memory variant) that tiles the device mesh in
``S`` stages with ``S`` dividing the blocks, the stages hold ``E`` + ``k`` blocks, ``k``
blocks ... ``k`` blocks + ``H`` (k = blocks / S), its data-parallel dim dividing the micro-batch's rows, priced as the stage DP prices a stage
(:func:`~distgraph.passes.search.stages.interleaved.alike_stages`: each stage's time with
its transfers' share, its memory with ``min(M, S - s)`` micro-batches in flight under
1F1B), and the least ``sum t + (M - 1) max t`` that fits wins. One stage (``S`` = 1,
the option's submesh the whole device mesh) is a plan too.

Example::

    plan, chosen = plan_even(costs, cluster, micro_batches=8)
"""

from __future__ import annotations

import math

import numpy as np

from distgraph.errors import DoesNotFit, PlanError
from distgraph.passes.cost.stage import grid, priced_stages, step_time
from distgraph.passes.search.stages.stage_dp import StageChoice, StagePlan


def even_blocks(S: int, blocks: range, count: int) -> list:
    """[(first layer, stop)] of ``S`` stages holding ``len(blocks) / S`` blocks each, the
    layers before the blocks on the first and those after on the last."""
    k = len(blocks) // S
    bounds = [0] + [blocks.start + k * s for s in range(1, S)] + [count]
    return [(bounds[s], bounds[s + 1]) for s in range(S)]


def plan_even(costs, cluster, micro_batches: int = 1, below: float = math.inf) -> tuple | None:
    """(StagePlan, the option of each stage) of the best even split (module docstring)
    of ``costs``' layers on ``cluster`` (one device mesh); None where none is below
    ``below``; DoesNotFit where none fits the devices' memory."""
    meshes = list(cluster.device_meshes)
    target = costs.strategy.target
    if len(meshes) != 1:
        raise PlanError(f"Strategy(target={target!r}) splits the blocks evenly over stages "
                        f"of one mesh shape: the cluster has {len(meshes)} device meshes; "
                        f"plan on one (target=None searches stages over several)")
    count, blocks = costs.layering.count, costs.blocks
    limit = min(cluster.device(i).usable_memory() for i in meshes[0].ids)
    rows = costs.batch_rows()

    def priced(option) -> tuple | None:
        """(objective, times, memories, option, S) of ``option``'s even split, or None."""
        S = option.sub.mesh.size // option.sub.size
        # every data-parallel rank reads its own rows of each micro-batch
        if option.sub.mesh.size % option.sub.size or len(blocks) % S or \
                rows % option.logical[0]:
            return None
        parts = []
        for start, stop in even_blocks(S, blocks, count):
            parts.append((start < blocks.start,
                          len(range(max(start, blocks.start), min(stop, blocks.stop))),
                          stop > blocks.stop))
        times, memories, updates = priced_stages(option, parts, micro_batches,
                                                 costs.p2p_seconds(option) if S > 1 else 0.0,
                                                 schedule=costs.strategy.schedule)
        return step_time(times, micro_batches), times, memories, option, S, updates

    best = None

    def consider(options) -> None:
        nonlocal best
        for found in filter(None, map(priced, options)):
            if max(found[2]) <= limit and found[0] < below and \
                    (best is None or found[0] < best[0]):
                best = found

    consider(costs.options(variants=False))
    # a mesh's memory variants (slower, smaller) matter only where its fastest parts'
    # split would beat the best but does not fit (as the stage DP's plan_blocks) ...
    latency = below if best is None else best[0]

    def held_back(option) -> bool:
        found = priced(option)
        return found is not None and found[0] < latency and max(found[2]) > limit
    # and the (dp, cp, tp) meshes' fastest parts
    consider(costs.options(variants=True, wanted=held_back))
    if best is None:
        if math.isfinite(below):
            return None
        raise DoesNotFit(f"no even split of {len(blocks)} blocks over stages of one mesh "
                         f"shape (Strategy(target={target!r})) fits the devices' memory "
                         f"(with the activations 1F1B keeps in flight)")
    objective, times, memories, option, S, updates = best
    rows, cols = grid(option.sub.mesh.shape)
    n, m = option.sub.shape
    ids = np.array(option.sub.mesh.ids).reshape(rows, cols)
    pieces = [ids[r:r + n, c:c + m].reshape(-1) for r in range(0, rows, n)
              for c in range(0, cols, m)]
    stages = tuple(StageChoice(range(start, stop), option.sub.mesh.name, option.sub.shape,
                               tuple(int(d) for d in pieces[s]), float(times[s]),
                               float(memories[s]), float(updates[s]))
                   for s, (start, stop) in enumerate(even_blocks(S, blocks, count)))
    return StagePlan(stages, float(objective), micro_batches, 1, 1), (option,) * S
