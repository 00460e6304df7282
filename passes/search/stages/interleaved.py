"""Interleaved 1F1B and alike stages for layers that are runs of identical blocks (the
planner's options of :mod:`distgraph.passes.search.stages.runs`): stages of one option tiling its
device mesh, the layers or the blocks split evenly, or by chunks of equal work, priced in
closed form (no DP; :mod:`distgraph.passes.search.stages.run_dp` is the DP for unlike stages).

Example::

    plan_interleaved(count, blocks, options, cluster, 32, 8, chunk_layers)
"""

from __future__ import annotations

import numpy as np

from distgraph.passes.cost.stage import grid, priced_stages, step_time
from distgraph.passes.search.stages.stage_dp import StageChoice, StagePlan


def plan_interleaved(count: int, blocks: range, options: list, cluster, micro_batches: int,
                     virtual: int, chunk_layers, p2p=None) -> tuple | None:
    """(StagePlan, the option of each stage) of the best interleaved pipeline (Megatron's
    interleaved 1F1B: ``virtual`` chunks per stage, chunk c on stage c mod S), or None
    where none fits. Chunks move layers between the stages, so the stages are alike: S
    stages of one option covering a device mesh (``cluster`` has one). The planner cuts
    the forward into S v chunks of equal work (:func:`~distgraph.passes.pipeline.chunks.
    forward_chunks`); ``chunk_layers(n)`` returns the layers each of those ``n`` chunks
    holds. A stage's time is its chunks' parts' (``option.cost``) plus, per chunk, the
    transfers to and from its neighbours (``p2p(option)``: seconds per micro-batch of a
    chunk between two others; the first and the last chunk have one neighbour; None:
    not priced), its memory that with ``min(M, S - s)`` micro-batches in flight (as
    the estimate counts them), and the objective the estimate's:
    ``sum t / v + (M - 1 / v) max t`` (the last micro-batch drains a chunk, not a
    stage, after the one before it: bubble (S - 1) / v of a stage's time).

    Example::

        plan_interleaved(count, blocks, options, cluster, 32, 8, chunk_layers)
    """
    meshes = list(cluster.device_meshes)
    if len(meshes) != 1 or virtual < 2:
        return None
    limit = min(cluster.device(i).usable_memory() for i in meshes[0].ids)
    best, layouts = None, {}
    for option in options:
        found = alike_stages(option, count, blocks, cluster, micro_batches, virtual,
                             chunk_layers, p2p, layouts)
        if found is None or max(found[2]) > limit:
            continue
        if best is None or found[0] < best[0]:
            best = found + (option,)
    if best is None:
        return None
    objective, times, memories, updates, option = best
    S = len(times)
    return _alike_plan(option, S, count, times, memories, updates, objective, micro_batches,
                       virtual), (option,) * S


def alike_stages(option, count: int, blocks: range, cluster, micro_batches: int,
                 virtual: int, chunk_layers, p2p=None, layouts=None) -> tuple | None:
    """(objective, times, memories, updates) of ``option``'s stages tiling its device mesh alike,
    ``virtual`` chunks each (:func:`plan_interleaved`; with ``virtual`` 1: the faster of
    the splits of :func:`even_splits`, E on the first stage and H on the last), the
    devices' memory aside; None where the option cannot tile its mesh in two or more
    such stages. ``layouts``: a dict the calls of one search share (stage parts per
    stage count)."""
    mesh = option.sub.mesh
    if mesh.size % option.sub.size:
        return None
    S = mesh.size // option.sub.size
    if S < 2 or S * virtual > count:
        return None
    layouts = {} if layouts is None else layouts
    if (S, virtual) not in layouts:
        layouts[S, virtual] = [chunk_parts(chunk_layers(S * virtual), S, blocks, count)] \
            if virtual > 1 else even_splits(S, blocks, count)
    best = None
    for parts in layouts[S, virtual]:
        times, memories, updates = priced_stages(option, parts, micro_batches,
                                                 p2p(option) if p2p is not None else 0.0,
                                                 virtual)
        found = (step_time(times, micro_batches, virtual), times, memories, updates)
        best = found if best is None or found[0] < best[0] else best
    return best


def even_splits(S: int, blocks: range, count: int) -> list:
    """The even splits of ``count`` layers (E: those before ``blocks``, the blocks, H:
    those after) over ``S`` stages, each [(E?, blocks, H?)] per stage: the layers split
    evenly (stage s holds layers round(count s / S) .. round(count (s+1) / S)), and,
    where it differs, the blocks split evenly with E on the first stage and H on the
    last, as Megatron-LM splits them (Korthikanti's 530B: 105 blocks over 35 stages,
    three each; split by layers, E's and H's four layers put a fourth block on some)."""
    def split(n: int, start: int) -> list:
        bounds = [start + round(n * s / S) for s in range(S + 1)]
        return [(bounds[s] < blocks.start, len(range(max(bounds[s], blocks.start),
                                                     min(bounds[s + 1], blocks.stop))),
                 bounds[s + 1] > blocks.stop) for s in range(S)]
    by_layers = split(count, 0)
    by_blocks = [(s == 0 and blocks.start > 0, n, s == S - 1 and blocks.stop < count)
                 for s, (_, n, _) in enumerate(split(len(blocks), blocks.start))]
    return [by_layers] + ([by_blocks] if by_blocks != by_layers and
                          all(n for _, n, _ in by_blocks) else [])


def chunk_parts(chunks: list, S: int, blocks: range, count: int) -> list:
    """[(share of E, blocks, share of H)] of each of ``S`` stages holding chunks s,
    s + S, ... (``chunks``: {layer: share of its forward FLOPs} of each chunk; a layer
    cut between two chunks counts in each by its share there). ``count`` layers: E
    (the layers before ``blocks``), the blocks, H (those after)."""
    out = []
    for s in range(S):
        share = [0.0] * count
        for chunk in chunks[s::S]:
            for k, f in chunk.items():
                share[k] += f
        out.append((sum(share[:blocks.start]) / max(blocks.start, 1),
                    sum(share[blocks.start:blocks.stop]),
                    sum(share[blocks.stop:]) / max(count - blocks.stop, 1)))
    return out


def _alike_plan(option, S, count, times, memories, updates, objective, micro_batches,
                virtual):
    """The StagePlan of ``S`` alike stages of ``option``: stage s on the s-th submesh of
    the device mesh in row-major order, its layers (as annotated before the chunks move
    them: E on the first stage, H on the last) an even split of the ``count``."""
    rows, cols = grid(option.sub.mesh.shape)
    n, m = option.sub.shape
    ids = np.array(option.sub.mesh.ids).reshape(rows, cols)
    pieces = [ids[r:r + n, c:c + m].reshape(-1) for r in range(0, rows, n)
              for c in range(0, cols, m)]
    bounds = [round(count * s / S) for s in range(S + 1)]
    stages = tuple(StageChoice(range(bounds[s], bounds[s + 1]), option.sub.mesh.name,
                               option.sub.shape, tuple(int(d) for d in pieces[s]),
                               float(times[s]), float(memories[s]), float(updates[s]))
                   for s in range(S))
    return StagePlan(stages, float(objective), micro_batches, 1, virtual)
