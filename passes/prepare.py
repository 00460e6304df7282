"""The program a plan runs, before any layout is chosen: the built program split into
micro-batches and rewritten for the memory savers and MeshSlice the strategy asks for.

Every plan starts here, searched or annotated: the search prices the program the plan
will run (:mod:`distgraph.passes.search`), and the planner completes that same program.

Example::

    prepared, accumulation = prepare(built, strategy, micro_batches=4)
"""

from __future__ import annotations

import dataclasses

from distgraph.passes.meshslice.slices import enable
from distgraph.plan.accumulation import made_once
from distgraph.passes.pipeline.accumulate import split_micro_batches
from distgraph.passes.transforms.recompute import (attention_cores, recompute, recompute_ops,
                                                   scores_of, segments)


def split(built, micro_batches: int, analyses=None) -> tuple:
    """(``built`` split into ``micro_batches`` micro-batches, its accumulation), or
    (``built``, None) for one; ``analyses``: the sample analyses shared by the counts a
    planning tries (:class:`~distgraph.passes.samples.SampleAnalyses`)."""
    if micro_batches > 1:
        return split_micro_batches(built, micro_batches, analyses)
    return built, None


def transformed(built, strategy):
    """A copy of ``built`` with MeshSlice enabled and recomputation applied as asked."""
    program = built.program.clone()
    prepared = dataclasses.replace(built, program=program)
    if strategy.meshslice:
        enable(program, strategy.meshslice)
    # what a micro-batched step holds anyway (the values it makes once) is not recomputed
    held = made_once(program) if (strategy.micro_batches or 1) > 1 and strategy.recompute \
        else frozenset()
    if strategy.recompute == "selective" and program.ops_by_role("backward"):
        recompute_ops(program, attention_cores(program, prepared.block_paths), held)
    elif isinstance(strategy.recompute, tuple) and program.ops_by_role("backward"):
        # per layer: the named layers' scores first, then the layers recomputed whole
        # (their segments are found on the program as it then is)
        scores = [e[0] for e in strategy.recompute if isinstance(e, tuple)]
        whole = [e for e in strategy.recompute if isinstance(e, str)]
        if scores:
            recompute_ops(program, scores_of(program, scores), held)
        if whole:
            recompute(program, segments(prepared, whole), held)
    elif strategy.recompute and program.ops_by_role("backward"):
        recompute(program, segments(prepared, strategy.recompute), held)
    return prepared


def prepare(built, strategy, micro_batches: int, analyses=None) -> tuple:
    """(the program the plan runs, as a BuiltProgram copy; its accumulation or None)."""
    built, accumulation = split(built, micro_batches, analyses)
    return transformed(built, strategy), accumulation
