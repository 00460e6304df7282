"""The stages the stage DP chose for a model of identical blocks, restated before they
are annotated (:func:`~distgraph.passes.search.stages.pipeline.plan_pipeline`):

- :func:`refined`: under ``Strategy(search="auto")`` each chosen option's layouts refined
  by the ILP, kept where its stages still fit and are no slower;
- :func:`priced_as_placed`: each stage priced on the devices it is placed on where they
  pay otherwise than the first devices of its submesh shape, which priced it for the DP
  (Alpa's meshes of alike devices; each device of a calibrated machine has figures of
  its own), so that the step the search reports is the one the plan's estimate gives;
- :func:`priced_with_neighbours`: each boundary between two unlike stages priced as it
  runs there (the DP prices a stage's boundaries as if its neighbours were like it).

Example::

    stage_plan, chosen = refined(stage_plan, chosen, costs, capped)
    stage_plan = priced_as_placed(stage_plan, chosen, costs)
    stage_plan = priced_with_neighbours(stage_plan, chosen, costs)
"""

from __future__ import annotations

import dataclasses
import math

from distgraph.passes.cost.boundary import between, boundary_key
from distgraph.passes.cost.stage import priced_stages, step_time, transfers
from distgraph.passes.search.stages.interleaved import alike_stages
from distgraph.units import GB


def refined(stage_plan, chosen, costs, capped) -> tuple:
    """(``stage_plan``, ``chosen``) with each option the DP chose refined by the ILP
    (:meth:`~distgraph.passes.search.stages.runs.RunCosts.refine`; an option chosen for several
    stages refined once), its stages' memory restated. The refined block may take the
    room its stages leave on the devices (the least, per block they hold): the ILP then
    finds the layouts the recursive search's memory variants missed (GPT-3 310B: the
    block that the ILP-only plan takes, 2% faster). Its stages are then checked to fit,
    as the DP counts memory; where they do not, the block is refined within the peak it
    had, and where even that does not fit or is slower (E and H meet the refined block
    anew), the option is kept as the DP chose it."""
    stages = stage_plan.stages
    limits = [min(capped.device(d).usable_memory() for d in st.device_ids) for st in stages]
    room: dict = {}
    for stage, option, limit in zip(stages, chosen, limits):
        blocks = max(held_parts(stage, costs)[1], 1)
        room[id(option)] = min(room.get(id(option), math.inf),
                               max(limit - stage.memory, 0.0) * GB / blocks)
    best = {id(o): o for o in chosen}
    for option in list(best.values()):
        mine = [s for s, o in enumerate(chosen) if o is option]

        def seconds(candidate) -> float:
            share = costs.p2p_seconds(candidate)
            out = 0.0
            for s in mine:
                first, n, last = held_parts(stages[s], costs)
                out += candidate.cost(first, n, last)[0] + transfers(share, first, last)
            return out

        candidate = costs.refine(option, room[id(option)])
        tried = [candidate if o is option else best[id(o)] for o in chosen]
        restated = _memory_restated(stage_plan, tried, costs)
        fits = all(restated.stages[s].memory <= limits[s] for s in range(len(stages))
                   if stage_plan.virtual > 1 or s in mine)
        if fits and seconds(candidate) <= seconds(option) * (1 + 1e-12):
            best[id(option)] = candidate
    chosen = [best[id(o)] for o in chosen]
    return _memory_restated(stage_plan, chosen, costs), chosen


def priced_as_placed(stage_plan, chosen, costs):
    """``stage_plan`` with each stage priced on its own devices where they pay otherwise
    than those its option was priced on (:meth:`~distgraph.passes.search.stages.runs.
    RunCosts.placed`): its seconds, memory and update restated, the step with them, as
    the plan's estimate prices the stages where they run."""
    stages, M = stage_plan.stages, stage_plan.micro_batches
    placed = [costs.placed(option, stage.device_ids) for stage, option in zip(stages, chosen)]
    if all(p is o for p, o in zip(placed, chosen)):
        return stage_plan
    parts = [held_parts(stage, costs) for stage in stages]
    _, memories, updates = priced_stages(placed, parts, M, schedule=costs.strategy.schedule)
    restated = tuple(
        stage if new is old else dataclasses.replace(
            stage, time=stage.time - old.cost(*p).seconds + new.cost(*p).seconds,
            memory=float(m), update=float(u))
        for stage, old, new, p, m, u in zip(stages, chosen, placed, parts, memories, updates))
    return dataclasses.replace(stage_plan, stages=restated,
                               objective=step_time([s.time for s in restated], M))


def priced_with_neighbours(stage_plan, chosen, costs):
    """``stage_plan`` with the boundaries between unlike neighbours priced as they run
    (:func:`~distgraph.passes.cost.boundary.between`: the sender's layout on its devices
    to the receiver's on theirs) in place of the half of its own
    :meth:`~distgraph.passes.search.stages.runs.RunCosts.p2p_seconds` each side's
    seconds took for it (:func:`~distgraph.passes.cost.stage.transfers`), as the plan's
    estimate prices them. GPT-3 on 1,024 A100s: a first stage of 32 devices beside
    stages of 64 sends its Values in halves twice the size."""
    stages, M = stage_plan.stages, stage_plan.micro_batches
    keys = [boundary_key(option) for option in chosen]
    extra = [0.0] * len(stages)
    for s in range(len(stages) - 1):
        if keys[s] == keys[s + 1]:
            continue
        paid = between(chosen[s], stages[s].device_ids, chosen[s + 1],
                       stages[s + 1].device_ids, costs.cluster, costs.session)
        for k, seconds in zip((s, s + 1), paid):
            extra[k] += seconds - costs.p2p_seconds(chosen[k]) / 2
    if not any(extra):
        return stage_plan
    restated = tuple(dataclasses.replace(stage, time=stage.time + x) if x else stage
                     for stage, x in zip(stages, extra))
    return dataclasses.replace(stage_plan, stages=restated,
                               objective=step_time([s.time for s in restated], M))


def held_parts(stage, costs) -> tuple:
    """(E held, blocks held, H held) by ``stage`` of a block layering."""
    layers = stage.layers
    return (costs.has_first and 0 in layers,
            len(range(max(layers.start, costs.blocks.start),
                      min(layers.stop, costs.blocks.stop))),
            costs.has_last and costs.layering.count - 1 in layers)


def _memory_restated(stage_plan, chosen, costs):
    """``stage_plan`` with each stage's memory that of its option in ``chosen`` (the ILP's
    refinement of the option the DP chose lays the blocks out anew: the plan's memory
    is the refined one's), as the DP counts it: with the micro-batches the schedule keeps
    in flight on stage s (1F1B ``min(M, S - s)``)."""
    M, layering = stage_plan.micro_batches, costs.layering
    if stage_plan.virtual > 1:
        memories = alike_stages(chosen[0], layering.count, costs.blocks, None, M,
                                stage_plan.virtual, costs.chunk_layers)[2]
    else:
        parts = [held_parts(stage, costs) for stage in stage_plan.stages]
        memories = priced_stages(list(chosen), parts, M, schedule=costs.strategy.schedule)[1]
    return dataclasses.replace(stage_plan, stages=tuple(
        dataclasses.replace(stage, memory=float(m))
        for stage, m in zip(stage_plan.stages, memories)))
