"""Plans that fit, by construction: no plan on a cluster is returned whose estimate needs
more memory than a device may hold.

What a device may hold is its usable memory (its memory in the resource file less its
reserve), or ``Strategy(memory_budget_gb)`` where that is less
(:func:`~distgraph.passes.cost.fit.limit_of`); the devices' usable memory is a limit
whether or not a budget is given. The check is the estimate's
(:func:`~distgraph.passes.cost.fit.overflows`), made once per plan, after every choice,
whichever path made it: a searched plan with or without stages, micro-batches given or
searched, or a plan of the user's annotations (``auto_mode="semi"``).

- :func:`fitting` plans; where the plan does not fit and the search chose it, it searches
  again with its budget lowered by the excess (the search without stages holds its
  layouts to the devices' memory as the estimate counts it, reshard copies at their
  readers included, but a copy a later reader reuses is counted at its readers only; the
  stage search's block searches leave the copies out), ``BUDGET_ROUNDS`` searches at
  most. A plan of annotations is the user's and
  is not searched again. What does not fit ends in :class:`~distgraph.errors.DoesNotFit`,
  naming the smallest peak found, where, and the limit.
- :func:`with_savers` chooses what the strategy leaves to the search
  (``Strategy(recompute=None)``, the default under ``auto_mode="full"``): it plans
  without recomputation, recomputing the attention scores ("selective") and, where that
  does not fit, whole blocks (True), each as :func:`fitting` plans, and keeps the plan
  of least estimated step time that fits: with room, none (recomputation only adds
  work; where the search says memory held no faster plan back, the others are not
  planned at all), where memory binds the least that fits or the one whose memory lets
  faster layouts in. Each kind is asked of the search, which runs it only on the stages
  that need it (:mod:`distgraph.passes.search.stages.recompute_stages`: the last stages
  of a pipeline keep fewer micro-batches in flight), and the plan says what it chose,
  per stage, and what each other value needed (``Plan.savers``).
- :func:`named_fix` turns that error into the one the user sees: it plans again with the
  memory savers the strategy leaves off (sequence parallelism, more micro-batches chosen
  by the search, recomputation, ZeRO sharding of the optimizer states, stages) and names
  the first that fits, with its peak, so the fix it names is one that works.

Example::

    planned = fitting(strategy, cluster, lambda budget: plan_once(budget))
    planned = with_savers(strategy, cluster, plan_with, replan)   # recompute=None chosen
"""

from __future__ import annotations

import dataclasses
import math

from distgraph.errors import DoesNotFit, PlanError
from distgraph.passes.cost.fit import MemoryBinds, limit_of, overflows
from distgraph.passes.transforms.zero import updated_parameter
from distgraph.plan.savers import SaverChoice, stage_recomputation
from distgraph.units import GB

BUDGET_ROUNDS = 4
# recomputation the search weighs, least first; whole blocks only where "selective" does
# not fit (it recomputes a superset of selective's ops, for memory selective leaves)
RECOMPUTED = (False, "selective", True)
# why no recomputation was priced where the search says memory held no faster plan back
UNBOUND = ("not planned with: memory held no faster plan back (the search with memory "
           "unlimited finds none faster), and recomputation only adds work")
# why sequence parallelism was not priced where the plan without it fits (with_savers)
SPLIT_SEARCHED = "not planned with: the plan without it fits; it would rewrite the same layouts"
# the savers left to the search beside recomputation (with_savers): ZeRO sharding over the
# data dims (chosen per update inside the search), sequence parallelism
FREE = ("sharding", "sequence_parallel")


def with_savers(strategy, cluster, plan_with, replan, applied=None):
    """``plan_with(strategy)`` (a Plan that fits, or a DoesNotFit) with the memory savers
    ``strategy`` leaves to the search chosen, and the choices on the plan
    (``Plan.savers``). What fits under no choice is the DoesNotFit of the last tried,
    with :func:`named_fix`'s fix (``replan``: as for it). ``applied(plan)``: {saver:
    whether it changed the plan} for the savers the plan's strategy turns on
    (:func:`distgraph.passes.planner.applied`; None: every saver asked acts).

    The order, and why so few plannings (each is a search; GPT-3 175B's is ~12 s):

    - ZeRO sharding (``sharding=None``) is the search's per update, inside its problem
      (:mod:`~distgraph.passes.search.layouts.sharded_states`): each update is offered
      with and without ZeRO's slice, priced as the gradient's reduce-scatter and the
      updated slice's all-gather (the bytes of the all-reduce it replaces, or a gather
      more where the gradient was not all-reduced over the dim), the update on a slice
      and the states' bytes, so no planning without it is needed to compare. Under a
      target (``Strategy(target=...)``), whose framework shards every update or none,
      every update is sharded where it splits, and where that plan does not recompute
      it is planned once more without ZeRO, the faster that fits kept. Where the plan
      shards no update, it says False.
    - Sequence parallelism (``sequence_parallel=None``) rewrites the searched layouts
      after the search, which sets it aside (:func:`~distgraph.passes.search.stages.
      micro.searched_as`): the plan with it has the layouts of the plan without it, and
      the search weighs splitting the light ops over the sequence itself. So the plan
      without it is made first, and the plan with it (completion and the estimate) only
      where that one does not fit. GPT-3 175B on the 1,024-A100 file: one planning of
      30 s CPU where two took 40, 20.7621 s per step against 20.7622 with it.
    - Recomputation as before, with those: none, the attention scores, and whole blocks
      only where neither fits. Where the search without recomputation says that memory
      held no faster plan back (``memory_binds`` of its report: the stage DP on the
      fastest options with memory unlimited finds none faster), recomputation is not
      priced: it only adds work to every option (GPT-3 175B on the 1,024-A100 file,
      bf16: one planning of about 36 s CPU saved). Where memory held back the plan of
      the first micro-batch count with a plan that the stage search priced without
      recomputation, the search stops at that count
      (:class:`~distgraph.passes.cost.fit.MemoryBinds`), the attention scores are
      planned next, and the plan without recomputation is planned on (the count's
      prices kept) only where that count's step beats theirs or they fit nothing (GPT-3
      175B on the 1,024-A100 file at 40 GB: stopped at its first count, 23.5 s per step,
      against 21.5 recomputing the attention scores per stage; 47.8 -> 39.0 s CPU). A
      plan without recomputation that the later counts would make faster than
      recomputing, though the count it stopped at is not, is not looked for.

    The plan kept is the one of least estimated step time that fits among those
    priced."""
    applied = applied or (lambda planned: {})
    kinds = RECOMPUTED if strategy.recompute is None else (strategy.recompute,)
    free = {s: True for s in FREE if getattr(strategy, s) is None}
    # sequence parallelism asked off first; ZeRO's sharding left None, the search's
    first = {s: False for s in free if s != "sharding"}
    priced, best, best_kind, refused, why = [], None, None, None, ""
    tried = {}          # recompute kind -> [(sequence_parallel, plan or DoesNotFit)]
    pending, stopped = list(kinds), None
    while pending:
        kind = pending.pop(0)
        if kind is True and best is not None:
            break
        if kind is False and stopped is not None and best is not None and \
                stopped.seconds >= best.estimate.step_time:
            priced.append((False, None, stopped.seconds))   # not planned on: slower
            continue
        asked = dataclasses.replace(strategy, recompute=kind, **first)
        # none asked of the search as None first: it stops where memory binds
        probe = kind is False and len(kinds) > 1 and stopped is None and \
            strategy.auto_mode == "full"
        try:
            candidates = _free_candidates(dataclasses.replace(asked, recompute=None)
                                          if probe else asked, free, plan_with, applied)
        except MemoryBinds as e:    # planned in full after the attention scores, if faster
            stopped = e
            pending.insert(1, False)
            continue
        except DoesNotFit as e:
            refused = (asked, e)
            priced.append((kind, e.peak, None))
            continue
        except PlanError:           # not one this model takes (no attention scores, blocks)
            if kind is kinds[0]:
                raise
            continue
        tried[kind] = candidates
        fitted = [c for _, c in candidates if not isinstance(c, DoesNotFit)]
        if not fitted:
            refused = (asked, candidates[-1][1])
            peaks = [c.peak for _, c in candidates if c.peak is not None]
            priced.append((kind, min(peaks) if peaks else None, None))
            continue
        if fitted[0].estimate is None:  # nothing to price or fit against: the first
            return _noted(fitted[0], strategy, kinds, [])
        planned = min(fitted, key=lambda p: p.estimate.step_time)
        # as the plan runs it: the search may have chosen it per stage
        priced.append((planned.strategy.recompute, planned.estimate.peak_memory,
                       planned.estimate.step_time))
        if best is None or planned.estimate.step_time < best.estimate.step_time:
            best, best_kind = planned, kind
        if kind is False and len(kinds) > 1 and not getattr(planned.search, "memory_binds",
                                                              True):
            why = UNBOUND       # recomputation only adds work: none priced
            break
    if best is None:
        asked, error = refused
        raise named_fix(error, asked, replan) from None
    zero_off = None
    if free.get("sharding") and strategy.target is not None and best.strategy.sharding \
            and not best.strategy.recompute:
        best, zero_off = _zero_priced(best, strategy, free, plan_with)
    # sequence parallelism's alternatives were priced with the sharding on
    alternatives = tried.get(best_kind) if zero_off is None or \
        zero_off[0] is False else ()
    return _noted(best, strategy, kinds, priced, cluster, alternatives, zero_off, why)


def _zero_priced(best, strategy, free, plan_with):
    """(the plan kept, the other's (sharding, peak, seconds)): ``best``, which ZeRO's
    sharding of every update changed (under a target), against the plan of its
    recomputation and sequence parallelism without the sharding (:func:`with_savers`);
    the faster that fits is kept."""
    asked = dataclasses.replace(
        strategy, recompute=best.strategy.recompute, sharding=False,
        sequence_parallel=best.strategy.sequence_parallel
        if free.get("sequence_parallel") else strategy.sequence_parallel)
    try:
        off = plan_with(asked)
    except DoesNotFit as e:
        return best, _price(False, e)
    if off.estimate is not None and off.estimate.step_time < best.estimate.step_time:
        return off, _price(True, best)
    return best, _price(False, off)


def _free_candidates(asked, free, plan_with, applied) -> list:
    """[(sequence_parallel, plan or DoesNotFit)] of ``asked`` at one recomputation: the
    plan without sequence parallelism where it is the search's (ZeRO's sharding as
    ``free`` leaves it), its strategy saying False for a saver of ``free`` that changed
    nothing; where it does not fit, then the plan with sequence parallelism, kept where
    it acted (:func:`with_savers`). A saver of ``free`` that the model or its layouts do
    not take (a PlanError: no update on a mesh with ZeRO's dim, no region to split over
    the sequence) is planned without. Raises the DoesNotFit where the plan does not fit
    and there is no other."""
    searched_sp = free.get("sequence_parallel", False)
    try:
        planned = plan_with(asked)
    except DoesNotFit as e:
        if not searched_sp:
            raise
        planned = e
    except PlanError as refused:
        return _without_refused(asked, free, plan_with, applied, refused)
    if not isinstance(planned, DoesNotFit):
        idle = {s: False for s, acted in applied(planned).items() if s in free and not acted}
        return [(planned.strategy.sequence_parallel, _said(planned, idle) if idle
                 else planned)]
    try:
        on = plan_with(dataclasses.replace(asked, sequence_parallel=True))
    except DoesNotFit as e:
        on = e
    except PlanError:           # no blocks this model splits over the sequence
        on = None
    acted = {} if on is None or isinstance(on, DoesNotFit) else applied(on)
    if on is None or not acted.get("sequence_parallel", True):
        if isinstance(planned, DoesNotFit):
            raise planned
        return [(False, planned)]
    idle = {s: False for s, did in acted.items() if s in free and not did}
    return [(False, planned), (True, _said(on, idle) if idle else on)]


def _without_refused(asked, free, plan_with, applied, refused: PlanError) -> list:
    """:func:`_free_candidates` of ``asked`` with the fewest of ``free``'s savers off
    that the planner takes (``refused``: its PlanError with them all on, raised where
    none does)."""
    on = [s for s in FREE if free.get(s)]
    tried = [asked]         # a saver asked off already (sequence parallelism) plans asked
    for off in [(s,) for s in on] + ([tuple(on)] if len(on) > 1 else []):
        without = dataclasses.replace(asked, **dict.fromkeys(off, False))
        if without in tried:
            continue
        tried.append(without)
        try:
            return _free_candidates(without, {s: True for s in on if s not in off},
                                    plan_with, applied)
        except PlanError as e:
            if isinstance(e, DoesNotFit):
                raise
    raise refused


def _said(planned, idle: dict):
    """``planned`` with its strategy saying False for the savers of ``idle`` (and ZeRO's
    mesh dims recorded as none where sharding is one of them): each changed nothing, so
    the plan is the one without it, and it replays as such from a file."""
    out = dataclasses.replace(planned, strategy=dataclasses.replace(planned.strategy, **idle))
    if "sharding" in idle and out.decisions is not None:
        out = dataclasses.replace(out, decisions=dataclasses.replace(out.decisions,
                                                                     zero_dim=None))
    return out


def _noted(planned, strategy, kinds, priced, cluster=None, candidates=None, zero_off=None,
           why=""):
    """``planned`` with the choices the search made for ``strategy`` on it; ``priced``:
    (recompute kind, peak, seconds) of each kind tried; ``candidates``: the plans priced
    at the chosen kind, with and without sequence parallelism; ``zero_off``: (sharding,
    peak, seconds) of the other ZeRO value priced (:func:`_zero_priced`), if one was;
    ``why``: why no other recomputation was priced, if one was not for a reason."""
    notes = []
    if strategy.micro_batches is None:
        notes.append(SaverChoice("micro_batches", planned.micro_batches, None, math.inf, None))
    peak = seconds = None
    limit = math.inf
    est = planned.estimate
    if est is not None:
        top = max(est.processes, key=lambda p: p.peak_memory)
        peak, seconds = float(top.peak_memory), est.step_time
        if cluster is not None:
            limit = limit_of(cluster, top.device, strategy.memory_budget_gb)
    if len(kinds) > 1:
        value = planned.strategy.recompute
        stages = stage_recomputation(planned) if isinstance(value, tuple) else ()
        notes.append(SaverChoice("recompute", value, peak, limit, seconds,
                                 tuple(p for p in priced if p[0] != value), stages, why))
    for saver in FREE:
        if getattr(strategy, saver) is not None:
            continue
        value = getattr(planned.strategy, saver)
        others = tuple(_price(v, c) for v, c in candidates or () if c is not planned)
        said = SPLIT_SEARCHED if saver == "sequence_parallel" and not others and \
            not value else ""
        if saver == "sharding":
            others = (zero_off,) if zero_off is not None else ()
            said = _per_update(planned)
        notes.append(SaverChoice(saver, value, peak, limit, seconds, others, why=said))
    if not notes:
        return planned
    return dataclasses.replace(planned, savers=planned.savers + tuple(notes))


def _per_update(planned) -> str:
    """What the search chose of ZeRO per update for ``planned``, in words ("" where it
    did not choose per update: a target's plan, or ZeRO given)."""
    chosen = planned.decisions.zero_params if planned.decisions is not None else None
    if chosen is None:
        return ""
    program = planned.program
    updated = {v.name for v in (updated_parameter(program, op) for op in program.ops)
               if v is not None}
    return (f"weighed per update inside the search, each with and without its states "
            f"split: {len(chosen)} of the {len(updated)} updates sharded")


def _price(value, candidate) -> tuple:
    """(value, peak, seconds) of a candidate plan; seconds None for a DoesNotFit, the
    peak then its closest plan's."""
    if isinstance(candidate, DoesNotFit):
        return (value, candidate.peak, None)
    return (value, candidate.estimate.peak_memory, candidate.estimate.step_time)


def fitting(strategy, cluster, plan_once, searched: bool | None = None):
    """``plan_once(budget)`` (a Plan with its estimate; ``budget``: bytes per device for
    the search, None: none beyond what the search reads from the devices) that fits
    ``cluster``'s devices (module docstring). Without a cluster there is no memory to
    fit: the plan as made. ``searched``: whether a lower budget can change the plan
    (default: under ``auto_mode="full"``)."""
    if cluster is None:
        return plan_once(None)
    given = strategy.memory_budget_gb
    budget = None if given is None else given * GB
    if searched is None:
        searched = strategy.auto_mode == "full"
    closest = floor = None
    for _ in range(BUDGET_ROUNDS if searched else 1):
        try:
            planned = plan_once(budget)
        except DoesNotFit as e:     # the search found nothing under this budget
            floor = e.peak
            if closest is None and floor is None:
                raise
            break
        over = overflows(planned.estimate, cluster, given)
        if not over:
            return planned
        worst = over[0]
        if closest is None or worst.peak < closest.peak:
            closest = worst
        budget = _next_budget(worst, getattr(planned.search, "peak_memory", None))
        if budget <= 0:
            break
    raise _refusal(searched, cluster, given, closest, floor)


def _next_budget(worst, counted=None) -> float:
    """The budget of the next search after ``worst`` overflowed: the limit the search was
    held to (every search reads the devices' usable memory, at most the strategy's
    budget), or the peak it counted for the plan where that is less, less the excess.
    The search without stages counts what the estimate counts at each op, a reshard's
    copy at its reader included, but not a copy a later reader reuses while it is held
    between them (a parameter gathered for the forward and read again by the recomputed
    forward); the stage search's block searches leave the copies out. Below the peak it counted, the next search cannot choose the same plan
    again (a GPT of 4 blocks at 0.7 of its pipeline's peak: three searches of 13 s each
    chose one plan under budgets 271 bytes apart)."""
    return min(worst.limit, counted if counted else math.inf) - worst.excess


def _refusal(searched: bool, cluster, given, closest, floor) -> DoesNotFit:
    """The DoesNotFit naming the closest plan made (as the estimate counts) and the least
    peak the search proved (as it counts), whichever are known."""
    text = "no plan found fits the devices' memory" if searched else \
        "the plan does not fit its devices' memory"
    if closest is not None:
        needs = "the closest needs" if searched else "it needs"
        reserve = cluster.device(closest.device).reserve
        text += (f": {needs} {closest.peak / GB:.4g} GB on {_where(closest)}, which may hold "
                 f"{closest.limit / GB:.4g} GB" + (f" (its {reserve:.4g} GB reserve left free)"
                                                   if reserve else ""))
        limit, where = closest.limit, _where(closest)
    else:
        limit = min(limit_of(cluster, d.global_id, given) for d in cluster.devices)
        where = "every device"
        text += f", which may hold {limit / GB:.4g} GB"
    if floor is not None:
        text += (f"{';' if closest is not None else ':'} no layout peaks below "
                 f"{floor / GB:.4g} GB per device as the search counts it")
    if closest is not None and given is not None:
        usable = cluster.device(closest.device).usable_memory()
        if closest.peak <= usable * GB:
            text += (f" (Strategy(memory_budget_gb={given:g}); the device has {usable:.4g} "
                     f"GB usable: a budget of {closest.peak / GB:.4g} GB fits this plan)")
    return DoesNotFit(text, closest.peak if closest is not None else floor, where, limit)


def _where(o) -> str:
    return f"process {o.process} (stage {o.stage}, device {o.device})"


def named_fix(error: DoesNotFit, strategy, replan) -> PlanError:
    """``error`` with the first memory saver that makes the plan fit named
    (``replan(strategy)``: the plan under another strategy, or a PlanError), or saying
    that none of those tried does (module docstring)."""
    tried = []
    for changes in _savers(strategy):
        what = _spelled(changes)
        try:
            planned = replan(dataclasses.replace(strategy, **changes))
        except DoesNotFit:
            tried.append(what)
            continue
        except PlanError:           # not a strategy this model can take
            continue
        peak = planned.estimate.peak_memory
        how = (f" with {planned.micro_batches} micro-batches"
               if changes.get("micro_batches", 1) is None else "")
        return DoesNotFit(f"{error}; {what} makes it fit: peak {peak / GB:.4g} GB{how}",
                          error.peak, error.where, error.limit)
    advice = "; " + ", ".join(tried) + " do not fit either" if tried else ""
    return DoesNotFit(f"{error}{advice}; use more devices or devices with more memory",
                      error.peak, error.where, error.limit)


def _savers(strategy) -> list:
    """The strategy changes to try, most likely first: sequence parallelism turned off
    by the user (the plan's own layouts split; no other search), the search choosing the
    micro-batches (with stages), recomputation, then ZeRO sharding on top of the last."""
    full = strategy.auto_mode == "full"
    split = [{"sequence_parallel": True}] if strategy.sequence_parallel is False else []
    first = []
    if full and not strategy.pipeline:
        first = [{"pipeline": True, "micro_batches": None}]
    elif full and strategy.micro_batches is not None:
        first = [{"micro_batches": None}]
    out = list(first)
    if strategy.recompute is False:
        out.append({"recompute": True})
        if first:
            out.append({**first[0], "recompute": True})
    if not strategy.sharding:
        out.append({**out[-1], "sharding": True} if out else {"sharding": True})
    return split + out


def _spelled(changes: dict) -> str:
    return "Strategy(" + ", ".join(f"{k}={v!r}" for k, v in changes.items()) + ")"
