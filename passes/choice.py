"""What the planner makes a plan of when it does not search: one type, two makers.

A :class:`Choice` is a program with every chosen layout written on it as annotations and
what goes with them. :func:`~distgraph.passes.planner.plan` (``choice=``) completes it,
checks that completion kept the layouts, and partitions, maps, schedules and estimates
it as it would its own search's. Its makers:

- the search (:func:`distgraph.passes.search.choose`): its report, and a check against
  the strategies its problem chose;
- a plan file (:func:`distgraph.passes.plan_file.load`): no report (nothing was
  searched), and a check whose fault is a PlanFileError naming the file.

This module imports neither the search nor the planner: a plan file is loaded without
them.

Example::

    choice = choose(built, dg.Strategy(auto_mode="full"), cluster)
    plan = dg.passes.plan(built, cluster=cluster, choice=choice)    # searched once
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Choice:
    """One plan's decisions before completion (module docstring). ``built``: the
    program the plan runs (micro-batch program, recomputation applied) with the chosen
    layouts as annotations; ``strategy``: the plan's, with the micro-batch count and
    chunks per stage chosen; ``accumulation``: how a step accumulates its micro-batches
    (None: one); ``rank_mapping``: {process: device global id} as chosen (None: the rank
    mapper's); ``chunks``: (stage meshes, chunks per stage) where the stages are
    interleaved, else None; ``sharding_dim``: the mesh dims ZeRO shards the optimizer
    states over; ``report``: the search's report (None: nothing was searched);
    ``check(program)``: raises unless completion kept every chosen layout of
    ``program``; ``result``: the search's outcome, where a search made it;
    ``zero_params``: the parameters whose updates ZeRO shards, where the search chose
    them per update (None: every update it splits)."""

    built: object
    strategy: object
    accumulation: object
    rank_mapping: dict | None
    chunks: tuple | None
    sharding_dim: object
    report: object
    check: Callable
    result: object = None
    zero_params: frozenset | None = None
