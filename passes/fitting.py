"""Plans that fit, by construction: no plan on a cluster is returned whose estimate needs
more memory than a device may hold.

What a device may hold is its memory in the resource file, or ``Strategy(memory_budget_gb)``
where that is less (:func:`~distgraph.passes.cost.fit.limit_of`); the devices' memory is
a limit whether or not a budget is given. The check is the estimate's
(:func:`~distgraph.passes.cost.fit.overflows`), made once per plan, after every choice,
whichever path made it: a searched plan with or without stages, micro-batches given or
searched, or a plan of the user's annotations (``auto_mode="semi"``).

- :func:`fitting` plans; where the plan does not fit and the search chose it, it searches
  again with its budget lowered by the excess (the searches count what is live at each
  op; the estimate also counts reshard buffers and the micro-batches a schedule keeps in
  flight), ``BUDGET_ROUNDS`` searches at most. A plan of annotations is the user's and
  is not searched again. What does not fit ends in :class:`~distgraph.errors.DoesNotFit`,
  naming the smallest peak found, where, and the limit.
- :func:`with_savers` chooses what the strategy leaves to the search
  (``Strategy(recompute=None)``, the default under ``auto_mode="full"``): it plans
  without recomputation, recomputing the attention scores ("selective") and, where that
  does not fit, whole blocks (True), each as :func:`fitting` plans, and keeps the plan
  of least estimated step time that fits: with room, none (recomputation only adds
  work), where memory binds the least that fits or the one whose memory lets faster
  layouts in. The choice is a per-plan one (every stage alike), and the plan says what
  it chose and what each other value needed (``Plan.savers``); the planner then tries
  recomputing on the stages that need it only
  (:func:`distgraph.passes.stage_recompute.per_stage`, on this plan's layouts).
- :func:`named_fix` turns that error into the one the user sees: it plans again with the
  memory savers the strategy leaves off (more micro-batches chosen by the search,
  recomputation, ZeRO sharding of the optimizer states, stages) and names the first that
  fits, with its peak, so the fix it names is one that works.

Example::

    planned = fitting(strategy, cluster, lambda budget: plan_once(budget))
    planned = with_savers(strategy, cluster, plan_with, replan)   # recompute=None chosen
"""

from __future__ import annotations

import dataclasses
import math

from distgraph.errors import DoesNotFit, PlanError
from distgraph.passes.cost.fit import limit_of, overflows
from distgraph.plan.savers import SaverChoice
from distgraph.units import GB

BUDGET_ROUNDS = 4
# recomputation the search weighs, least first; whole blocks only where "selective" does
# not fit (it recomputes a superset of selective's ops, for memory selective leaves)
RECOMPUTED = (False, "selective", True)


def with_savers(strategy, cluster, plan_with, replan):
    """``plan_with(strategy)`` (a Plan that fits, or a DoesNotFit) with the memory savers
    ``strategy`` leaves to the search chosen (module docstring), and the choices on the
    plan (``Plan.savers``). What fits under no choice is the DoesNotFit of the last tried,
    with :func:`named_fix`'s fix (``replan``: as for it)."""
    kinds = RECOMPUTED if strategy.recompute is None else (strategy.recompute,)
    priced, best, refused = [], None, None
    for kind in kinds:
        if kind is True and best is not None:
            break
        asked = dataclasses.replace(strategy, recompute=kind)
        try:
            planned = plan_with(asked)
        except DoesNotFit as e:
            refused = (asked, e)
            priced.append((kind, e.peak, None))
            continue
        except PlanError:           # not one this model takes (no attention scores, blocks)
            if kind is kinds[0]:
                raise
            continue
        if planned.estimate is None:    # nothing to price or fit against: the least
            return _noted(planned, strategy, kinds, [])
        priced.append((kind, planned.estimate.peak_memory, planned.estimate.step_time))
        if best is None or planned.estimate.step_time < best.estimate.step_time:
            best = planned
    if best is None:
        asked, error = refused
        raise named_fix(error, asked, replan) from None
    return _noted(best, strategy, kinds, priced, cluster)


def _noted(planned, strategy, kinds, priced, cluster=None):
    """``planned`` with the choices the search made for ``strategy`` on it."""
    notes = []
    if strategy.micro_batches is None:
        notes.append(SaverChoice("micro_batches", planned.micro_batches, None, math.inf, None))
    if len(kinds) > 1:
        est, value = planned.estimate, planned.strategy.recompute
        peak = seconds = None
        limit = math.inf
        if est is not None:
            top = max(est.processes, key=lambda p: p.peak_memory)
            peak, seconds = float(top.peak_memory), est.step_time
            if cluster is not None:
                limit = limit_of(cluster, top.device, strategy.memory_budget_gb)
        notes.append(SaverChoice("recompute", value, peak, limit, seconds,
                                 tuple(p for p in priced if p[0] != value)))
    if not notes:
        return planned
    return dataclasses.replace(planned, savers=planned.savers + tuple(notes))


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
        budget = _next_budget(strategy, cluster, budget, worst)
        if budget <= 0:
            break
    raise _refusal(searched, cluster, given, closest, floor)


def _next_budget(strategy, cluster, budget, worst) -> float:
    """The budget of the next search after ``worst`` overflowed: the device's limit where
    the search was not held to it (no budget, or one above the device's memory), else
    what it was held to less the excess (the searches count what is live at each op,
    the estimate also reshard buffers and micro-batches in flight)."""
    held = math.inf if budget is None else budget
    memory = cluster.device(worst.device).memory
    if strategy.pipeline and memory is not None:    # the stage search reads the devices'
        held = min(held, memory * GB)
    return worst.limit if held > worst.limit else held - worst.excess


def _refusal(searched: bool, cluster, given, closest, floor) -> DoesNotFit:
    """The DoesNotFit naming the closest plan made (as the estimate counts) and the least
    peak the search proved (as it counts), whichever are known."""
    text = "no plan found fits the devices' memory" if searched else \
        "the plan does not fit its devices' memory"
    if closest is not None:
        needs = "the closest needs" if searched else "it needs"
        text += (f": {needs} {closest.peak / GB:.4g} GB on {_where(closest)}, which may hold "
                 f"{closest.limit / GB:.4g} GB")
        limit, where = closest.limit, _where(closest)
    else:
        limit = min(limit_of(cluster, d.global_id, given) for d in cluster.devices)
        where = "every device"
        text += f", which may hold {limit / GB:.4g} GB"
    if floor is not None:
        text += (f"{';' if closest is not None else ':'} no layout peaks below "
                 f"{floor / GB:.4g} GB per device as the search counts it (the results "
                 f"live at once)")
    if closest is not None and given is not None:
        memory = cluster.device(closest.device).memory
        if memory is not None and closest.peak <= memory * GB:
            text += (f" (Strategy(memory_budget_gb={given:g}); the device has {memory:g} "
                     f"GB: a budget of {closest.peak / GB:.4g} GB fits this plan)")
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
    """The strategy changes to try, most likely first: the search choosing the
    micro-batches (with stages), recomputation, then ZeRO sharding on top of the last."""
    full = strategy.auto_mode == "full"
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
    return out


def _spelled(changes: dict) -> str:
    return "Strategy(" + ", ".join(f"{k}={v!r}" for k, v in changes.items()) + ")"
