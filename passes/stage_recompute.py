"""Recomputation chosen per stage (issue #50; Aceso, Galvatron): under 1F1B stage s holds
S - s micro-batches in flight, so where memory makes the search recompute, the first
stages may need it while the last ones have room to run faster without it.

:func:`~distgraph.passes.fitting.with_savers` chooses one recomputation for the whole plan
(none, the attention scores, whole blocks). Where it chose one and the plan has stages,
:func:`per_stage` tries to recompute on fewer stages, keeping the chosen plan's stages,
micro-batch count and every op's layout (the search is not run again; a plan of these
layouts is a plan of :func:`~distgraph.passes.planner.plan`'s ``choice=`` path):

1. **probe**: the chosen layouts without any recomputation, estimated (not compiled).
   A stage's peak depends on its own ops and the micro-batches it keeps in flight, so
   the stages whose probe peak exceeds what their devices may hold are the ones that
   need recomputation, and the others are those that have room.
2. **candidate**: the chosen recomputation on the blocks of the stages that need it, none
   elsewhere (the probe itself where no stage needs it), planned and checked to fit.

It is kept where it fits and its estimated step time is less than the chosen plan's
(it does less work on the same layouts, so it is, unless a reshard prices otherwise):
two plannings without a search at most, and none where the plan does not recompute
(with room, nothing to refine). The plan's strategy then names each layer
(``Strategy(recompute=[("blocks.0", "selective"), ...])``), which ``plan.save`` writes and
a plan file replays; ``Plan.savers``' recompute note says, per stage, what each got and
what the every-stage plan and the candidate were priced at.

Example::

    planned = with_savers(strategy, cluster, plan_with, replan)
    planned = per_stage(planned, strategy, cluster, replanned)
"""

from __future__ import annotations

import dataclasses
import functools

from distgraph.errors import DoesNotFit, PlanError
from distgraph.ir import RECOMPUTED, Role, is_recomputed
from distgraph.passes.choice import Choice
from distgraph.passes.cost.fit import overflows
from distgraph.passes.prepare import split, transformed
from distgraph.plan.savers import SaverChoice


def _kept(program) -> None:
    """PlanError unless completion kept every layout of ``program`` its annotations
    carry over from the chosen plan (:meth:`Replays.choice`; completion kept them in the
    chosen plan, whose ops these are)."""
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


def per_stage(planned, strategy, cluster, replanned):
    """``planned`` (with_savers' plan) or, where recomputing on fewer of its stages fits
    and is faster, that plan (module docstring); either way its recompute note says per
    stage what was chosen. ``replanned(recompute, checked)``: the plan of ``planned``'s
    decisions with ``Strategy.recompute`` set so (:class:`Replays`), checked to fit where
    ``checked`` (a DoesNotFit where it does not), else only estimated; the planner
    compiles the plan kept."""
    kind = planned.strategy.recompute
    if strategy.recompute is not None or kind not in ("selective", True) or \
            cluster is None or planned.estimate is None:
        return planned
    stage_of = block_stages(planned)
    if len(set(stage_of.values())) < 2:
        return planned
    probe = replanned(False, False)
    needs = {o.stage for o in overflows(probe.estimate, cluster, strategy.memory_budget_gb)}
    tried = ()
    if set(stage_of.values()) - needs:          # some stage of blocks has room
        value = per_layer(kind, [b for b, s in stage_of.items() if s in needs])
        try:
            candidate = replanned(value, True)
        except DoesNotFit as e:
            tried = ((value, e.peak, None),)
        else:
            est = candidate.estimate
            tried = ((value, est.peak_memory, est.step_time),)
            if est.step_time < planned.estimate.step_time:
                return _noted(candidate, planned, stage_of, ((kind, planned.estimate.peak_memory,
                                                              planned.estimate.step_time),))
    return _noted(planned, planned, stage_of, tried)


def per_layer(kind, blocks) -> tuple | bool:
    """``Strategy.recompute`` recomputing ``kind`` ("selective" or True) on ``blocks``
    only: False where there are none."""
    if not blocks:
        return False
    return tuple(b if kind is True else (b, "selective") for b in blocks)


def block_stages(planned) -> dict:
    """{block path: the index of the stage its forward ops run on} of a completed plan."""
    stages = planned.stages
    first = {}
    for op in planned.built.program.ops:
        if op.role is Role.FORWARD and op.layer and op.dist_attr is not None:
            first.setdefault(op.layer, op.dist_attr.mesh.process_ids[0])
    out = {}
    for block in planned.built.block_paths:
        pid = next((p for layer, p in first.items()
                    if layer == block or layer.startswith(block + ".")), None)
        if pid is not None:
            out[block] = next(s for s, mesh in enumerate(stages) if pid in mesh.process_ids)
    return out


def stage_kinds(planned, stage_of: dict) -> tuple:
    """Per stage of ``planned``, the recomputation of its blocks: False, "selective" or
    True (a stage whose blocks differ: the most any of them gets)."""
    asked = planned.strategy.recompute
    order = (False, "selective", True)
    kinds = [False] * len(planned.stages)
    for block, s in stage_of.items():
        kind = asked if not isinstance(asked, tuple) else \
            True if block in asked else "selective" if (block, "selective") in asked else False
        kinds[s] = max(kinds[s], kind, key=order.index)
    return tuple(kinds)


def _noted(kept, chosen, stage_of, tried):
    """``kept`` with the recompute note of ``chosen`` (with_savers') saying per stage what
    ``kept`` recomputes and, beside what it priced, ``tried`` ((value, peak, seconds))."""
    est = kept.estimate
    savers = []
    for note in chosen.savers:
        if note.option == "recompute":
            top = max(est.processes, key=lambda p: p.peak_memory)
            note = SaverChoice("recompute", kept.strategy.recompute, float(top.peak_memory),
                               note.limit, est.step_time, note.others + tried,
                               stage_kinds(kept, stage_of))
        savers.append(note)
    return dataclasses.replace(kept, savers=tuple(savers))


class Replays:
    """``planned``'s decisions (a searched plan of ``built``) on its program prepared with
    other recomputations (:meth:`choice`). The micro-batch split and the chosen program
    are made once, at the first choice, and shared by the others (each choice prepares
    its own copy): the split is a third of a replay's time on GPT-3 175B."""

    def __init__(self, built, planned, rank_mapping=None):
        self.built, self.planned, self.rank_mapping = built, planned, rank_mapping

    @functools.cached_property
    def _split(self) -> tuple:
        """(the split program, its accumulation, the ops of the chosen program)."""
        d = self.planned.decisions
        if d is None or d.on != "prepared":
            raise PlanError("internal error: recomputing per stage needs the search's "
                            "decisions on the prepared program; please report it")
        program, accumulation = split(self.built, self.planned.micro_batches)
        return program, accumulation, transformed(program, self.planned.strategy).program.ops

    def choice(self, recompute) -> Choice:
        """The chosen plan's decisions on its program prepared with ``Strategy.recompute``
        set to ``recompute``: the same micro-batches, and every op and Value the two
        programs share laid out as chosen (the recomputed copies the new program lacks
        are left out; it has no copy the chosen one lacks)."""
        planned, d = self.planned, self.planned.decisions
        program, accumulation, chosen = self._split
        strategy = dataclasses.replace(planned.strategy, recompute=recompute)
        prepared = transformed(program, strategy)
        ops, values = prepared.program.ops, prepared.program.values
        index = _aligned(chosen, ops)
        for v in values.values():
            v.annotation = None
        for op in ops:
            op.annotation = None
        for name, attr in d.values:
            if name in values:
                values[name].annotation = attr
        for k, ann in d.ops:
            if k in index:
                ops[index[k]].annotation = _read_as(ann, ops[index[k]])
        mapping = self.rank_mapping
        if mapping is None and planned.rank_of is not None:     # as the chosen plan maps
            devices = planned.cluster.devices
            mapping = {p: devices[r].global_id for p, r in planned.rank_of.items()}
        return Choice(prepared, strategy, accumulation, mapping, d.chunks, d.zero_dim,
                      planned.search, _kept, zero_params=None if d.zero_params is None
                      else frozenset(d.zero_params))


def _read_as(annotation, op):
    """``annotation`` (a chosen op's) with each operand named as ``op`` reads it: a
    gradient that read a recomputed copy (``x@RECOMPUTE``) where ``op`` reads ``x``."""
    names = {v.name for v in op.inputs}
    specs = tuple((n[:-len(RECOMPUTED)] if n not in names and n.endswith(RECOMPUTED) else n, s)
                  for n, s in annotation.in_specs)
    return dataclasses.replace(annotation, in_specs=specs)


def _aligned(chosen, ops) -> dict:
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
