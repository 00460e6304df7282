"""Recomputation chosen per stage by the stage search (issue #50; Aceso, Galvatron): under
1F1B stage s keeps ``min(M, S - s)`` micro-batches in flight, so where memory makes a plan
recompute, the first stages may need it while the last ones have room to run faster
without it.

Where the search runs with recomputation left to it (``Strategy(recompute=None)``,
asked as "selective" or True by :func:`~distgraph.passes.fitting.with_savers`),
:func:`per_stage` prices each chosen stage's layouts on the program without it (the
same strategy for every op and Value the two programs share: :func:`plain_option`), by
the accountant that prices every option (:func:`~distgraph.passes.search.stages.
part_cost.measure`, :func:`~distgraph.passes.cost.stage.priced_stages`), and a stage
runs without recomputation where that fits its devices with its micro-batches in flight
and is faster. A value the user gives is run on every stage. The plan's strategy then names each recomputed layer
(``Strategy(recompute=[("blocks.0", "selective"), ...])``) and :func:`realised` lays the
chosen layouts onto the program prepared so. What the search reports is what it priced
for that plan: the estimate's figure.

Example::

    stage_plan, recompute = per_stage(stage_plan, chosen, costs, capped, plain, held)
    ran = transformed(split_program, dataclasses.replace(strategy, recompute=recompute))
    realised(searched, ran)         # the chosen layouts, on the program it runs
"""

from __future__ import annotations

import dataclasses

from distgraph.errors import PlanError
from distgraph.ir import RECOMPUTED, is_recomputed
from distgraph.passes.cost.stage import priced_stages, step_time
from distgraph.passes.search.layouts.buckets import bucketed
from distgraph.passes.search.layouts.intra_op import price
from distgraph.passes.search.layouts.sharded_states import zero_asked
from distgraph.passes.search.layouts.space import SearchSpace
from distgraph.passes.search.stages.chosen import held_parts
from distgraph.passes.search.stages.interleaved import chunk_parts
from distgraph.passes.search.stages.part_cost import measure
from distgraph.passes.search.stages.run_options import RunOption


def per_stage(stage_plan, chosen, costs, capped, plain, held=None) -> tuple:
    """(``stage_plan`` restated, the ``Strategy.recompute`` it runs: None where every
    stage keeps the search's recomputation) with each stage that fits ``capped``'s
    devices without recomputation, and is faster so, priced without it (module
    docstring). ``chosen``: the option of each stage; ``plain``: a function giving the
    program without recomputation (a BuiltProgram, split as ``costs``' is); ``held``:
    under virtual stages, the layer ranges of each stage's chunks."""
    kind = costs.strategy.recompute
    stages, M, virtual = stage_plan.stages, stage_plan.micro_batches, stage_plan.virtual
    if kind not in ("selective", True) or len(stages) < 2:
        return stage_plan, None
    plain = plain()
    index = aligned(costs.program.ops, plain.program.ops)
    placed = [costs.placed(option, stage.device_ids) for stage, option in zip(stages, chosen)]
    bare = {}
    for option in placed:
        if id(option) not in bare:
            bare[id(option)] = plain_option(option, costs, plain, index)
    without = [bare[id(o)] or o for o in placed]
    if virtual > 1:     # stage s holds chunks s, s + S, ..., each a share of its layers
        parts = chunk_parts(costs.chunk_layers(len(stages) * virtual), len(stages),
                            costs.blocks, costs.layering.count)
    else:
        parts = [held_parts(stage, costs) for stage in stages]
        held = [[stage.layers] for stage in stages]
    schedule = costs.strategy.schedule
    before = priced_stages(placed, parts, M, virtual=virtual, schedule=schedule)[0]
    after, memories, updates = priced_stages(without, parts, M, virtual=virtual,
                                             schedule=schedule)
    limits = [min(capped.device(d).usable_memory() for d in st.device_ids) for st in stages]
    restated, kept = [], []
    for s, stage in enumerate(stages):
        if without[s] is placed[s] or not parts[s][1] or memories[s] > limits[s] or \
                after[s] >= before[s]:
            restated.append(stage)
            kept.append(True)
            continue
        restated.append(dataclasses.replace(stage, time=stage.time - before[s] + after[s],
                                            memory=float(memories[s]),
                                            update=float(updates[s])))
        kept.append(False)
    if all(kept):
        return stage_plan, None
    paths = costs.prepared.block_paths
    blocks = [paths[layer - costs.blocks.start] for s in range(len(stages)) if kept[s]
              for layers in held[s] for layer in layers if layer in costs.blocks]
    value = tuple(b if kind is True else (b, "selective") for b in blocks) or False
    return dataclasses.replace(stage_plan, stages=tuple(restated), objective=step_time(
        [s.time for s in restated], M, virtual)), value


def plain_option(option: RunOption, costs, plain, index: dict) -> RunOption | None:
    """``option`` (its parts' results on their devices) priced on ``plain``, the program
    without recomputation: each part holding recomputed ops searched no more, its
    chosen strategy kept for every op and Value ``plain`` shares with it (``index``:
    :func:`aligned`), the reshards into the ops that read a recomputed Value read the
    Value the forward kept; None where a strategy has no counterpart there."""
    program = costs.program
    parts = dict(option.parts)
    for part, (_, result) in option.parts.items():
        space = result.space
        if not any(is_recomputed(program.ops[k]) for k in space.ops):
            continue
        ops = tuple(index[k] for k in space.ops if k in index)
        bare = SearchSpace(plain.program, space.mesh, ops, received=dict(space.received),
                           session=costs.session, style=space.style, once=space.once,
                           zero=space.zero)
        bare.nodes = _fixed_as(result, bare, {j: k for k, j in index.items()})
        if bare.nodes is None:
            return None
        made = {o.name for k in ops for o in plain.program.ops[k].outputs}
        priced = price(bare, costs.cluster, result.prices.device_of, weights=costs.weights,
                       loss=plain.loss_name if plain.loss_name in made else None,
                       boundary=result.boundary, status=result.report.status,
                       zero=zero_asked(costs.strategy), session=costs.session)
        parts[part] = (measure(priced, plain.program, costs.weights, costs.strategy,
                               bucketed(plain, costs.strategy)), priced)
    return RunOption(option.axis, option.sub, option.logical, parts, option.origin)


def _fixed_as(result, bare, back: dict) -> list | None:
    """The nodes of ``bare``, each offering only ``result``'s choice for the same op or
    Value (``back``: {op of bare's program: op of result's}), its strategy and hint as
    chosen there (the same op, the same shapes: a recomputed Value read as the one the
    forward kept); None where one has no counterpart."""
    space, nodes = result.space, []
    for node in bare.nodes:
        i = space.source_node.get(node.value) if node.is_source else \
            space.op_node.get(back.get(node.op))
        if i is None:
            return None
        k = result.choice[i]
        nodes.append(dataclasses.replace(node, strategies=(space.nodes[i].strategies[k],),
                                         allowed=(True,), hints=(space.nodes[i].hints[k],)))
    return nodes


def realised(searched, prepared) -> None:
    """Lay the layouts annotated on ``searched``'s program (the program the search chose
    on) onto ``prepared``'s, the same program recomputed on fewer layers: every Value and
    op the two share laid out as chosen (the recomputed copies ``prepared`` lacks left
    out; an op that read a recomputed copy reads the Value the forward kept)."""
    chosen, ops, values = searched.program.ops, prepared.program.ops, prepared.program.values
    for name, v in searched.program.values.items():
        if name in values:
            values[name].annotation = v.annotation
    for k, j in aligned(chosen, ops).items():
        ann = chosen[k].annotation
        ops[j].annotation = None if ann is None else _read_as(ann, ops[j])


def kept(program) -> None:
    """PlanError unless completion kept every layout annotated on ``program`` (a
    :func:`realised` one)."""
    for v in program.values.values():
        if v.annotation is not None and v.dist_attr != v.annotation:
            raise PlanError(f"internal error: recomputing per stage, completion changed "
                            f"the chosen layout of {v.name!r} ({v.annotation.spec} on "
                            f"{v.annotation.mesh} to {v.dist_attr.spec}); please report it")
    for k, op in enumerate(program.ops):
        if op.annotation is None or op.dist_attr is None:
            continue
        specs = {v.name: s for v, s in zip(op.inputs, op.dist_attr.input_specs)}
        for name, spec in op.annotation.in_specs:
            if spec is not None and specs.get(name) != spec:
                raise PlanError(f"internal error: recomputing per stage, completion "
                                f"changed how op #{k} {op.type} ({op.layer}) consumes "
                                f"{name!r}: {spec} chosen, {specs.get(name)} made; "
                                f"please report it")


def _read_as(annotation, op):
    """``annotation`` (a chosen op's) with each operand named as ``op`` reads it: a
    gradient that read a recomputed copy (``x@RECOMPUTE``) where ``op`` reads ``x``."""
    names = {v.name for v in op.inputs}
    specs = tuple((n[:-len(RECOMPUTED)] if n not in names and n.endswith(RECOMPUTED) else n, s)
                  for n, s in annotation.in_specs)
    return dataclasses.replace(annotation, in_specs=specs)


def aligned(chosen, ops) -> dict:
    """{index in ``chosen``: index in ``ops``} of two programs that differ only in
    recomputed copies ``chosen`` has (the same ops, in the same order, otherwise)."""
    index, j = {}, 0
    for k, op in enumerate(chosen):
        if j < len(ops) and ops[j].type == op.type and \
                [o.name for o in ops[j].outputs] == [o.name for o in op.outputs]:
            index[k] = j
            j += 1
        elif not is_recomputed(op):
            raise PlanError(f"internal error: recomputing per stage, op #{k} {op.type} "
                            f"({op.layer}) of the chosen program has no counterpart; "
                            f"please report it")
    if j != len(ops):
        raise PlanError(f"internal error: recomputing per stage, op #{j} {ops[j].type} of "
                        f"the new program is not in the chosen one; please report it")
    return index
