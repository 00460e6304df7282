"""``Strategy(auto_mode="full", pipeline=True, micro_batches=None)``: the search chooses
the number of micro-batches M too.

M trades the pipeline's bubble against the work of one micro-batch: the stage DP's
latency ``sum t + (M - 1) max t`` falls as more, smaller micro-batches fill the
pipeline, until a micro-batch is too small to split over the data-parallel replicas
(or a device's fixed costs per micro-batch dominate), and more micro-batches in flight
need less activation memory each. Each candidate M is priced by the stage search
itself (:func:`distgraph.passes.search.stages.pipeline_latency`: stages, submeshes and
layouts chosen for the micro-batch program of M, by the method that prices the DP's
candidates, ``"recursive"`` under ``search="auto"``), and the least latency wins.

**Candidates.** The batch of B rows split into micro-batches of r rows, r any divisor
of B: the replicas of a stage split a micro-batch's rows, so r = 9 lets 9 replicas
take one sequence each, as Megatron's 530B run does (2,520 GPUs as 35 stages of 9 x
8; with powers of two only, its meshes of 5 nodes replicated work, at half the
published layout's throughput). The walk starts at the power of two closest below B /
(machines of the cluster): a micro-batch that every machine could hold a share of, as
Megatron's micro-batch of one sequence per data-parallel replica is; and no fewer rows
than stages of one block or more could split one to a machine (the power of two at least
machines / blocks), where the batch has a row for every machine (then its stages, of
that many machines each, have as many micro-batches as there are stages or more): the
counts after the first are priced on its layouts, and those of one row per micro-batch
split no rows, so its neighbours looked no faster (Llama 3 405B on 2,048 machines of
H100s, 126 blocks: from one sequence per micro-batch, 2,048 of them, at 0.25 x Meta's
layout; from 32, 64 micro-batches at 1.26 x). With fewer rows than machines, rows are
split inside the stages (by sequence, by tensor) and one row per micro-batch is the
start (Llama 3's 128 sequences of 128K tokens on 2,048 machines: from 32 rows, a
plan 0.7% slower, in 3.5 times the CPU). It then moves to
the next divisor either way while the latency falls; so it prices three candidates
where the start is best. The counts after the first are priced on its layouts, so the
start matters: on GPT-3 (B = 1,536 on 128 machines) starting at 12 ended at 128
micro-batches, 196 TFLOP/s, and starting at 8 at 192, 222. The latency is not unimodal
in M, though: where memory binds, a few large micro-batches fit only on few wide stages
and the next counts not at all, while one sequence per micro-batch fits on many narrow
ones (Korthikanti's 1T on 512 A100s: 64 stages of one node at 512 micro-batches, as
Megatron ran it). So a second walk starts at the other end, one row per micro-batch
(the least memory per micro-batch in flight, the most micro-batches), where that is
not bounded off by the first walk's best, and the better end wins. A candidate no plan
fits (memory) costs infinity.

**Bounds before prices.** A neighbour is first bounded: its stage DP on the fastest
options with the devices' memory unlimited (the memory variants can only make the
stages fit, not faster: :func:`~distgraph.passes.search.stages.block_plans.plan_blocks`) needs each
logical mesh's fastest parts only; where that bound does not beat the best latency so
far, the neighbour cannot win and its memory variants, the bulk of a price, are never
priced. Where it does, the stage search looks for plans below the best latency only
(its caps pruned by it, variants searched only for meshes whose alike stages beat it);
a neighbour is priced in full only where it has one.

**Searched once.** The first count priced is searched in full; the others price its
layouts on their own programs (the same ops, other batch shapes) and search only where
those do not divide their micro-batch (:mod:`distgraph.passes.search.stages.runs`, donors): a
count is compared by those prices and its bound, and the count chosen, if not the
first, is searched afresh for the plan (the priced plan kept where that is slower).
The other end, one row per micro-batch, is bounded off only where its own searches
bound it off too: its layouts are the farthest from the first count's (no replica can
split its rows), and priced on those it may look slower than it is (Korthikanti's 530B
with selective recomputation: bounded off at 89.8 s per step on the layouts of 10 rows
per micro-batch, planned at 47.3 s on its own).

**Within the budget in force.** The counts are priced within the planner's memory
budget. Where a plan's estimate overflows the devices, the planner searches again under
a lower budget (:func:`~distgraph.passes.fitting.fitting`), and the counts are weighed
again under it: what fits reorders them (Korthikanti's 1T on 512 A100s: 64 micro-batches
priced at 112 s per step within the devices' memory, but 295 s once held to what
fits).

The counts priced keep their split program and accumulation, their stage options and
stage plan in the planning's session, table "micro-batch programs": M -> (program,
accumulation), the split, which no strategy changes; (search, M) -> (RunCosts, (memory
budget, stage plan)) and (search, None, budget) -> the count chosen within budget
(bytes; None: the strategy's or the devices'), ``search`` the strategy as
the search reads it (:func:`searched_as`: what the stage options depend on). The plan of
the count chosen reuses them, and the plannings of one ``plan`` call that weigh other
recomputations (:func:`~distgraph.passes.fitting.with_savers`) split each count once.

Example::

    m = searched_count(built, strategy, cluster, session)     # Strategy(micro_batches=m)
"""

from __future__ import annotations

import dataclasses
import math

from distgraph.errors import DoesNotFit, PlanError
from distgraph.passes.prepare import split, transformed
from distgraph.passes.samples import SampleAnalyses
from distgraph.passes.cost.fit import MemoryBinds
from distgraph.passes.search.stages.pipeline import (memory_binds, pipeline_beaten,
                                                    pipeline_latency)
from distgraph.units import GB


def batch_rows(built) -> int:
    """The rows of the batch the program's inputs carry (dim 0 of each; they agree)."""
    rows = {int(built.program.values[name].shape[0]) for name in built.feed_names
            if built.program.values[name].shape}
    if len(rows) != 1:
        raise PlanError(f"Strategy(micro_batches=None) lets the search split the batch, but "
                        f"the program's inputs do not share one batch size (dim 0: "
                        f"{sorted(rows) or 'none'}); give Strategy(micro_batches=M)")
    return rows.pop()


def ladder(rows: int) -> list:
    """Micro-batch sizes r (rows): the divisors of ``rows``, ascending."""
    small = [r for r in range(1, math.isqrt(rows) + 1) if rows % r == 0]
    return sorted(set(small) | {rows // r for r in small})


def choose_micro_batches(built, strategy, cluster, latency, beaten=None) -> int:
    """The number of micro-batches M of least pipeline latency (module docstring).
    ``latency(built, strategy, M)``: seconds per step of the stage search's plan with M
    micro-batches, PlanError where none fits (the planner's, through
    :func:`~distgraph.passes.search.stages.pipeline_latency`); ``beaten(built, strategy,
    M, seconds)`` (optional): True where a bound shows M's latency is no less than
    ``seconds`` (then M is not priced: :func:`~distgraph.passes.search.stages.
    pipeline_beaten`)."""
    rows = batch_rows(built)
    sizes = ladder(rows)
    machines = max(len(cluster.machines), 1) if cluster is not None else 1
    # a share for every machine, and no fewer rows than stages of a block or more could
    # split one to a machine (module docstring)
    least = 1 << max(math.ceil(machines / len(built.block_paths)) - 1, 0).bit_length() \
        if built.block_paths and rows >= machines else 1
    start = max(i for i, r in enumerate(sizes)
                if r <= max(rows // machines, least, 1) and r & (r - 1) == 0)
    priced: dict = {}
    bounded: set = set()        # shown no faster than a best so far (so than every later)

    def cost(i, below=math.inf):
        """M's latency, or ``below`` where the bound shows it is no less."""
        if i not in priced:
            m = rows // sizes[i]
            asked = dataclasses.replace(strategy, micro_batches=m)
            if math.isfinite(below) and beaten is not None and beaten(built, asked, m, below):
                bounded.add(i)
                return below
            try:
                priced[i] = latency(built, asked, m)
            except PlanError:
                priced[i] = math.inf
        return priced[i]

    def walk(best):
        """The local walk from ``best``: towards smaller micro-batches, then larger."""
        first = best
        for step in (-1, 1):
            i = best + step
            while 0 <= i < len(sizes) and cost(i, cost(best)) < cost(best):
                best, i = i, i + step
            if best != first:
                break
        return best

    best = walk(start)
    # the other end: one row per micro-batch, first bounded against the best so far;
    # where it beats it, a walk from there
    if 0 not in priced and 0 not in bounded and cost(0, cost(best)) < cost(best):
        best = min(best, walk(0), key=cost)
    if math.isinf(cost(best)):
        raise DoesNotFit(f"Strategy(micro_batches=None): no plan fits the devices' memory with "
                        f"any of the micro-batch counts tried "
                        f"({', '.join(str(rows // sizes[i]) for i in sorted(priced))})")
    return rows // sizes[best]


def searched_count(built, strategy, cluster, session, budget=None,
                   stop: bool = False) -> int:
    """:func:`choose_micro_batches` with each count priced by the stage search
    (:func:`count_latency`, :func:`count_beaten`) within ``session``, under ``budget``
    bytes per device (None: the strategy's, else the devices' memory). ``stop``: raise
    :class:`~distgraph.passes.cost.fit.MemoryBinds` where memory held back the plan of the
    first count priced that has one (as :func:`~distgraph.passes.search.stages.pipeline.
    plan_pipeline` says it of a plan: interleaved plans always), the walk not gone on
    (its prices kept in the session for a planning that goes on). A count where nothing
    fits does not stop it: the walk goes on from there to counts that fit (stopped
    there too, Megatron's 529.6B row was planned recomputing, at 65.7 s per step, where
    the walk without recomputation finds 45.3)."""
    rows = batch_rows(built)
    priced = []             # the counts with a plan so far

    def latency(b, s, m):
        seconds = count_latency(b, s, cluster, m, session, budget)   # PlanError: none fits
        if stop and not priced:
            costs, _ = session.table("micro-batch programs").find((searched_as(s), m))
            if costs is not None and memory_binds(s, seconds, [(costs, m)], cluster):
                raise MemoryBinds(m, seconds)
        priced.append(m)
        return seconds

    return choose_micro_batches(
        built, strategy, cluster, latency,
        lambda b, s, m, seconds: count_beaten(b, s, cluster, m, seconds, session, budget,
                                              own=m == rows))


def searched_as(strategy):
    """``strategy`` as the stage search reads it, the key of a count's entries in "micro-
    batch programs" beside M: the count and sequence parallelism set aside (the
    planner's rewrite after the search, :func:`~distgraph.passes.planner._completed`);
    everything else, recomputation and ZeRO included, changes the program searched or
    its prices."""
    return dataclasses.replace(strategy, micro_batches=None, sequence_parallel=False)


def count_latency(built, strategy, cluster, micro: int, session, budget=None) -> float:
    """The stage search's seconds per step for ``built`` split into ``micro``
    micro-batches (:func:`~distgraph.passes.search.stages.pipeline.pipeline_latency`),
    within ``budget`` bytes per device (None: the strategy's, else the devices'
    memory); the stage options that priced it and its plan go into the session's
    "micro-batch programs" (the options :func:`count_beaten` began are reused, and the
    plan a walk that stopped there made within the same budget: :func:`searched_count`)."""
    programs = session.table("micro-batch programs")
    key = (searched_as(strategy), micro)
    known = programs.find(key)
    costs = known[0] if known is not None else None
    if known is not None and known[1] is not None and known[1][0] == _budget(strategy, budget):
        return known[1][1][0].objective
    program, accumulation = split_in(built, micro, session)
    prepared = costs.prepared if costs is not None else transformed(program, strategy)
    seconds, costs, planned = pipeline_latency(prepared, strategy, cluster, accumulation,
                                               _budget(strategy, budget), costs,
                                               first_searched(programs, strategy), session)
    programs[key] = (costs, planned)
    return seconds


def count_beaten(built, strategy, cluster, micro: int, seconds: float, session,
                 budget=None, own: bool = False) -> bool:
    """Whether the stage search finds no plan of ``micro`` micro-batches below
    ``seconds`` per step within ``budget`` (as :func:`count_latency`'s: its bound, then
    its search below ``seconds``: :func:`~distgraph.passes.search.stages.pipeline.
    pipeline_beaten`); the stage options it searched go into the session as
    :func:`count_latency`'s do (and those a count has there are reused: the bound of
    another budget's walk prices nothing again). ``own``: where the first count's layouts
    show it beaten, its own searches are asked too, and it is beaten only where both
    show it (their stage options kept for :func:`count_latency` where they do not)."""
    programs = session.table("micro-batch programs")
    key = (searched_as(strategy), micro)
    known = programs.find(key)
    costs = known[0] if known is not None else None
    program, accumulation = split_in(built, micro, session)
    prepared = costs.prepared if costs is not None else transformed(program, strategy)
    donor = first_searched(programs, strategy)
    beaten, costs = pipeline_beaten(prepared, strategy, cluster, accumulation, seconds,
                                    donor, _budget(strategy, budget), session, costs)
    if beaten and own and costs is not None and costs.donor is not None:
        beaten, mine = pipeline_beaten(prepared, strategy, cluster, accumulation, seconds,
                                       None, _budget(strategy, budget), session)
        if not beaten:
            programs[key] = (mine, None)
            return False
    if costs is not None and known is None:
        programs[key] = (costs, None)
    return beaten


def split_in(built, micro: int, session) -> tuple:
    """:func:`~distgraph.passes.prepare.split` of ``built`` (the one program a planning's
    session plans) into ``micro`` micro-batches, made once per session (table
    "micro-batch programs", by M: the split reads no strategy; each use prepares its own
    copy), its sample analysis shared with the other counts (table "sample analyses")."""
    return session.table("micro-batch programs").memo(micro, lambda: split(
        built, micro, SampleAnalyses(session.table("sample analyses"))))


def first_searched(programs, strategy):
    """The stage options of the first micro-batch count priced in full for ``strategy``'s
    search (searched, not priced from another count's): the later counts price its
    layouts on their programs (:mod:`distgraph.passes.search.stages.runs`); None before
    it."""
    search = searched_as(strategy)
    priced = (value for key, value in programs.items()
              if isinstance(key, tuple) and key[0] == search and key[1] is not None)
    return next((costs for costs, planned in priced
                 if planned is not None and costs is not None and costs.donor is None), None)


def _budget(strategy, budget=None):
    """Bytes per device the counts are priced within: ``budget`` (the planner's, which
    lowers the strategy's where a plan's estimate overflowed it), else the strategy's;
    None: the devices' memory."""
    if budget is not None:
        return budget
    return None if strategy.memory_budget_gb is None else strategy.memory_budget_gb * GB
