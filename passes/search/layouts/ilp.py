"""Alpa's intra-op sharding ILP (OSDI'22, §4), solved with SCIP through pyscipopt.
(The model is built with pyscipopt directly: cvxpy as a modelling layer added its own
compile step on top and hid SCIP's status, gap and time limit, so it is not used.)

:func:`solve` picks one strategy per node of a :class:`ShardingProblem` (see
:mod:`distgraph.passes.search.layouts.ilp_problem` for its fields), minimising

    sum_v (compute[v][c_v] + comm[v][c_v])  +  sum over edges (u, v, R) of R[c_u][c_v]

subject to the aliases, follow and share ties, and, with a ``memory_budget``, the summed
memory of every liveness set. Where the problem has ``other_processes`` (processes of a
mesh that pay unlike), the first sum is the largest of the kinds' sums (the step waits
for the slowest process). It returns a :class:`Solution`; when no choice fits the
budget it raises ``PlanError`` naming the smallest peak memory that any choice reaches.

The model (legend: the single-letter names below are used in this module only)::

    s[c][i]   binary: tie class c (the nodes tied by follow/share) takes strategy i;
              sum_i s[c][i] == 1
    e[a][b]   continuous in [0, 1], one per allowed entry of an edge's matrix; it
              linearises s[u][i] * s[v][j] (Alpa's edge variables) through both marginals:
              sum_b e[a][b] == sum_{i in row group a} s[u][i],
              sum_a e[a][b] == sum_{j in column group b} s[v][j].
              With one-hot s the marginals admit exactly one e, the outer product, so e
              needs no integrality; this is also tighter than Alpa's e <= s rows.
    R, V      an edge's resharding-cost matrix, an alias's forbidden-pair matrix
    m[t]      continuous: memory live at liveness step t, as a running sum
              m[t] == m[t-1] + memory of the nodes entering at t - of those leaving;
              m[t] <= budget. A node live over an interval appears in two rows, not in
              every row of its interval, so the model stays linear in program size.
              An op's kernel workspace while it runs (the problem's ``workspace`` at
              its ``running`` times) adds to its step's level in a row of its own:
              m[t] + sum_i w[i] s[c][i] <= budget.
    z         the peak, max_t m[t] (with the workspace rows); minimised only to name
              the smallest peak
    t         with ``other_processes``: the nodes' seconds at the slowest kind of
              process, t >= sum_c sum_i cost_k[c][i] s[c][i] for each kind k (the s
              then carry no cost of their own; the edges' e carry theirs)

Reductions before the model is built (each exact, so the optimum is unchanged):

1. Nodes tied by ``follow`` or ``share`` collapse into one class; their costs add, and
   edges between two classes add up (an edge inside a class adds its diagonal).
2. A matrix of the form a[i] + b[j] (a constant or zero one included) moves into the
   node costs and needs no e.
3. Identical rows (columns) of a matrix share one row (column) group of e: strategies
   that present the same layout to this edge.

Sharing one transformer block's choice across identical blocks (``share``) is step 1:
the model is one block's size, with the blocks' boundary edges as edges inside it.

Example::

    >>> p = ShardingProblem([2, 2], compute=[[1, 2], [3, 1]], comm=[[0, 0], [0, 0]],
    ...                     memory=[[1, 1], [1, 1]], edges=[(0, 1, [[0, 5], [5, 0]])])
    >>> sol = solve(p, time_limit=10)
    >>> sol.choice, sol.objective, sol.status       # 2 + 1 + R[1][1] = 3
    ((1, 1), 3.0, 'optimal')
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
from pyscipopt import Model, quicksum

from distgraph.errors import DoesNotFit, PlanError
from distgraph.passes.search.layouts.ilp_bound import lp_bound, proven_gap
from distgraph.passes.search.layouts.ilp_problem import ShardingProblem, evaluate, peak_memory
from distgraph.passes.search.layouts.ilp_reduced import (Pair, Reduced, reduce_problem, spike,
                                                         unique_rows)

__all__ = ["ShardingProblem", "Solution", "evaluate", "peak_memory", "solve", "reduce_problem",
           "check_forbidden", "peak_bound"]

BUDGET_RTOL = 1e-9      # a peak this far over the budget (relatively) is rounding, not over
CONFLICT = ("the sharding problem has no allowed choice, whatever the memory: its aliases "
            "and forbidden (inf) strategies and pairs contradict each other along a chain of "
            "nodes; check the aliases of tied (follow/share) nodes")


@dataclass(frozen=True)
class Solution:
    """A solver's answer.

    ``choice``: strategy index per node; ``objective``: its cost (recomputed on the
    problem); ``status``: "optimal" or "time_limit" (the best choice found in time);
    ``gap``: SCIP's relative gap between that choice and its lower bound (0 when
    optimal); ``solve_time``: seconds in :func:`solve`, model building included;
    ``peak_memory``: the largest liveness-set memory of the choice (0 without liveness);
    ``variables`` / ``constraints``: the size of the model SCIP solved.
    """

    choice: tuple[int, ...]
    objective: float
    status: str
    gap: float
    solve_time: float
    peak_memory: float
    variables: int
    constraints: int

    def __str__(self):
        return (f"{self.status}: objective {self.objective:.6g}, gap {self.gap:.3g}, peak "
                f"memory {self.peak_memory:.6g}, {self.solve_time:.3g} s, {self.variables} "
                f"variables, {self.constraints} constraints")


class _Model:
    """The SCIP model of a reduced problem, either minimising cost or the peak memory."""

    def __init__(self, red: Reduced, budget: float | None, minimise_peak: bool,
                 copies: bool = True):
        self.red = red
        self.scip = scip = Model()
        scip.hideOutput()
        weight = 0.0 if minimise_peak else 1.0 / _unit(red)
        # with several kinds of process, the nodes' seconds enter as the slowest kind's
        # sum, t (at least each kind's), and the edges as they are
        per_node = 0.0 if red.others else weight
        self.s = []
        for costs in red.cost:
            row = [scip.addVar(vtype="B", ub=0.0 if math.isinf(x) else 1.0,
                               obj=0.0 if math.isinf(x) else per_node * float(x))
                   for x in costs]
            scip.addCons(quicksum(row) == 1)
            self.s.append(row)
        self.t = None
        if red.others and not minimise_peak:
            self.t = scip.addVar(lb=0.0, obj=1.0)
            for kind in (red.cost, *red.others):
                scip.addCons(self.t - quicksum(
                    weight * float(x) * s for costs, row in zip(kind, self.s)
                    for x, s in zip(costs, row) if x and math.isfinite(x)) >= 0)
        self.e = [self._pair(pair, weight) for pair in red.pairs]
        self.y = []         # (variable, reader's class, producer's class, bytes): copies
        m_prev = None
        self.unit = unit = _memory_unit(red)
        ub = budget / unit if budget is not None and not minimise_peak else None
        self.z = z = scip.addVar(lb=0.0, obj=1.0) if minimise_peak else None
        self.m = []
        for delta, spikes in zip(red.steps, red.spikes):
            m = scip.addVar(lb=0.0, ub=ub)
            self.m.append(m)
            terms = [(-1.0, m)] if m_prev is None else [(-1.0, m), (1.0, m_prev)]
            for c, coefs in delta.items():
                terms += [(float(coef) / unit, self.s[c][i]) for i, coef in enumerate(coefs)
                          if coef]
            scip.addCons(quicksum(coef * x for coef, x in terms) == 0)
            if z is not None:
                scip.addCons(z - m >= 0)
            for c, work, read, own in spikes:       # beside the level (spike)
                if ub is None and z is None:
                    continue
                if not copies:      # each copy at its least over its producer's choice
                    for _, _, kept in read:
                        work = work + (kept if kept.ndim == 1 else kept.min(axis=0))
                    read = ()
                sides = [quicksum(float(w) / unit * self.s[c][i] for i, w in enumerate(work)
                                  if w) + quicksum(self._copy(c, cu, kept, unit)
                                                   for cu, _, kept in read)]
                if read:
                    sides.append(quicksum(self._copy(c, cu, made, unit)
                                          for cu, made, _ in read) -
                                 quicksum(float(x) / unit * self.s[c][i]
                                          for i, x in enumerate(own) if x))
                for extra in sides:
                    if ub is not None:
                        scip.addCons(m + extra <= ub)
                    if z is not None:
                        scip.addCons(z - m - extra >= 0)
            m_prev = m

    def _copy(self, c: int, cu: int, mat: np.ndarray, unit: float):
        """The bytes (in the model's unit) of a copy read by a class-``c`` op from a
        class-``cu`` result, ``mat[a][b]`` when ``cu`` takes ``a`` and ``c`` takes ``b``:
        linear in ``c``'s choice where the two are one class (``mat`` per strategy), else
        ``least + y`` with ``least`` the least entry and ``y >= 0`` held up to ``mat[a][b]
        - least`` by one row per set of alike columns (one layout read): ``y >= top *
        sum s_c[b] - sum_a (top - mat[a][b] + least) s_cu[a]``, ``top`` their largest
        entry less ``least``. Exact at every pair (the other sets' rows are <= 0) and
        sparse (a copy costs its reader's bytes except where the layouts agree)."""
        scip, sv = self.scip, self.s[c]
        if mat.ndim == 1:
            return quicksum(float(x) / unit * sv[i] for i, x in enumerate(mat) if x)
        su = self.s[cu]
        least = float(mat.min())
        y = scip.addVar(lb=0.0)
        self.y.append((y, c, cu, (mat - least) / unit))
        uniq, cols = unique_rows((mat.T - least) / unit)
        for k, column in enumerate(uniq):
            top = float(column.max())
            if top <= 0:
                continue
            scip.addCons(y - quicksum(top * sv[b] for b in np.flatnonzero(cols == k))
                         + quicksum(float(top - x) * su[a] for a, x in enumerate(column)
                                    if top - x) >= 0)
        return y + least / unit

    def _pair(self, pair: Pair, weight: float) -> dict:
        scip, su, sv = self.scip, self.s[pair.u], self.s[pair.v]
        nrow, ncol = pair.cost.shape
        # Each marginal row: sum of its e minus the s of its strategy group == 0.
        row_e = [[] for _ in range(nrow)]
        col_e = [[] for _ in range(ncol)]
        e_of = {}
        for a, b in zip(*np.nonzero(np.isfinite(pair.cost))):
            e = e_of[a, b] = scip.addVar(lb=0.0, ub=1.0, obj=weight * float(pair.cost[a, b]))
            row_e[a].append(e)
            col_e[b].append(e)
        for es, group, s in [(row_e[a], pair.rows == a, su) for a in range(nrow)] + \
                [(col_e[b], pair.cols == b, sv) for b in range(ncol)]:
            scip.addCons(quicksum(es) - quicksum(s[i] for i in np.flatnonzero(group)) == 0)
        return e_of

    def warm_start(self, per_class: list[int]) -> None:
        """Offer SCIP a starting choice; it keeps it only if it is feasible."""
        scip, red = self.scip, self.red
        sol = scip.createSol()
        for c, row in enumerate(self.s):
            for i, x in enumerate(row):
                scip.setSolVal(sol, x, float(i == per_class[c]))
        for pair, e_of in zip(red.pairs, self.e):
            key = (pair.rows[per_class[pair.u]], pair.cols[per_class[pair.v]])
            if key not in e_of:
                scip.freeSol(sol)
                return
            for ab, e in e_of.items():
                scip.setSolVal(sol, e, float(ab == key))
        level = peak = 0.0
        for delta, spikes, m in zip(red.steps, red.spikes, self.m):
            level += sum(float(d[per_class[c]]) for c, d in delta.items())
            peak = max([peak, level] + [level + spike(per_class, *s) for s in spikes])
            scip.setSolVal(sol, m, max(level, 0.0) / self.unit)
        for y, c, cu, held in self.y:
            scip.setSolVal(sol, y, float(held[per_class[cu], per_class[c]]))
        if self.z is not None:
            scip.setSolVal(sol, self.z, peak / self.unit)
        if self.t is not None:
            slowest = max(sum(float(costs[i]) for costs, i in zip(kind, per_class))
                          for kind in (red.cost, *red.others))
            if not math.isfinite(slowest):
                scip.freeSol(sol)
                return
            scip.setSolVal(sol, self.t, slowest / _unit(red))
        scip.addSol(sol, free=True)

    def run(self, deadline: float) -> str:
        scip = self.scip
        scip.setParam("limits/time", max(deadline - time.perf_counter(), 0.01))
        # no probing presolve: on these models (one-hot strategies, edge marginals) it
        # took 90% of SCIP's time (a GPT block of 1,427 strategies: 2.0 of 2.2 s) and
        # the root LP closes them without it (the same choices on Megatron's 7.5B row)
        scip.setParam("propagating/probing/maxprerounds", 0)
        scip.optimize()
        return scip.getStatus()

    def choice(self) -> tuple[int, ...] | None:
        if self.scip.getNSols() == 0:
            return None
        sol = self.scip.getBestSol()
        per_class = [int(np.argmax([sol[x] for x in row])) for row in self.s]
        return tuple(per_class[c] for c in self.red.cls)

    def size(self) -> tuple[int, int]:
        return self.scip.getNVars(transformed=False), self.scip.getNConss(transformed=False)


def _unit(red: Reduced) -> float:
    """The median magnitude of the model's nonzero finite costs: they are divided by it.
    SCIP's tolerances are absolute (reduced costs within 1e-7 count as zero), so costs
    in seconds of 1e-6 .. 1e-2 would let it call a choice optimal that is not (a GPT
    block 6% slower than the best one, found in tests)."""
    costs = np.concatenate([np.asarray(c, dtype=float).ravel() for c in red.cost] +
                           [pair.cost.ravel() for pair in red.pairs] + [np.zeros(0)])
    costs = np.abs(costs[np.isfinite(costs) & (costs != 0)])
    return float(np.median(costs)) if costs.size else 1.0


def _starts(red: Reduced) -> list[list[int]]:
    """Two starting choices for SCIP: the cheapest, and the one with the least memory."""
    lean = [np.where(np.isinf(c), np.inf, m) for c, m in zip(red.cost, red.memory)]
    return [_greedy(red, red.cost, edge_costs=True), _greedy(red, lean, edge_costs=False)]


def _greedy(red: Reduced, node_cost: list[np.ndarray], edge_costs: bool,
            sweeps: int = 5) -> list[int]:
    """Each class's best strategy by ``node_cost``, then a few sweeps that re-pick it given
    its neighbours' choices (iterated conditional modes); forbidden pairs always count,
    edge costs only with ``edge_costs``."""
    choice = [int(np.argmin(costs)) for costs in node_cost]
    around: list[list[Pair]] = [[] for _ in red.cost]
    for pair in red.pairs:
        around[pair.u].append(pair)
        around[pair.v].append(pair)
    for _ in range(sweeps):
        changed = False
        for c, costs in enumerate(node_cost):
            total = costs.copy()
            for pair in around[c]:
                mat = pair.cost if edge_costs else np.where(np.isinf(pair.cost), np.inf, 0.0)
                if pair.u == c:
                    total += mat[pair.rows, pair.cols[choice[pair.v]]]
                else:
                    total += mat[pair.rows[choice[pair.u]], pair.cols]
            best = int(np.argmin(total))
            if total[best] < total[choice[c]]:
                choice[c], changed = best, True
        if not changed:
            break
    return choice


def solve(problem: ShardingProblem, time_limit: float = 60.0, starts=(),
          bounded: bool = False) -> Solution:
    """Solve ``problem`` with SCIP within ``time_limit`` seconds (model building included).
    ``starts``: choices SCIP starts from. ``bounded``: where the first start is allowed,
    fits the budget and a proven lower bound (:func:`~distgraph.passes.search.layouts.ilp_bound.
    proven_gap`) leaves no choice more than ``GAIN_RTOL`` cheaper, it is the answer,
    without SCIP (status "optimal", gap the bound's; no model: 0 variables).

    Returns the optimal choice (``status == "optimal"``) or the best one found when time
    runs out (``"time_limit"``, with its ``gap``). Raises ``PlanError`` when no choice
    satisfies the constraints: for a memory budget it names the smallest peak memory any
    choice reaches (found by minimising the peak in the time left, or in a tenth of
    ``time_limit`` if less is left), otherwise the nodes whose forbidden strategies or
    pairs conflict.
    """
    if not isinstance(problem, ShardingProblem):
        raise PlanError(f"solve expects a ShardingProblem, got {type(problem).__name__}")
    if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)) \
            or not (time_limit > 0 and math.isfinite(time_limit)):
        raise PlanError(f"solve: time_limit = {time_limit!r}; give a finite number of seconds > 0")
    start = time.perf_counter()
    deadline = start + time_limit
    red = reduce_problem(problem)
    check_forbidden(problem, red)
    if problem.memory_budget is not None and \
            peak_bound(red) > problem.memory_budget * (1 + BUDGET_RTOL):
        _raise_budget(problem, red, start, time_limit)     # no model needed to know
    if bounded and starts:
        proven = _proven(problem, red, starts[0], start)
        if proven is not None:
            return proven
    given = [[int(c[v]) for v in np.unique(red.cls, return_index=True)[1]] for c in starts]
    # the copies' rows only where the choice without them breaks the budget with them
    # (without them the model is a relaxation: its optimum, where it fits, is the answer;
    # most choices read their operands as made where memory binds)
    for copies in (False, True) if _reads_copies(red, problem.memory_budget) else (True,):
        model = _Model(red, problem.memory_budget, minimise_peak=False, copies=copies)
        for choice in _starts(red) + given:
            model.warm_start(choice)
        status = model.run(deadline)
        choice = model.choice()
        if copies or choice is None or status == "infeasible" or \
                peak_memory(problem, choice) <= problem.memory_budget * (1 + BUDGET_RTOL):
            break
    if status == "infeasible":
        if problem.memory_budget is None:
            raise PlanError(CONFLICT)
        _raise_budget(problem, red, start, time_limit)
    if status not in ("optimal", "timelimit"):
        raise PlanError(f"SCIP ended with status {status!r} on the sharding problem")
    if choice is None:
        raise PlanError(f"SCIP found no feasible choice within time_limit = {time_limit} s; "
                        "raise the time limit (Strategy.solver_time_limit)")
    variables, constraints = model.size()
    scip = model.scip
    gap = 0.0 if status == "optimal" else float(scip.getGap())
    if gap >= scip.infinity():     # no lower bound yet (the root LP did not finish)
        gap = math.inf
    return Solution(choice, evaluate(problem, choice),
                    "optimal" if status == "optimal" else "time_limit", gap,
                    time.perf_counter() - start, peak_memory(problem, choice), variables,
                    constraints)


def _reads_copies(red: Reduced, budget) -> bool:
    """Whether a budget holds ``red``'s choices and one of its ops reads copies."""
    return budget is not None and any(read for spikes in red.spikes for _, _, read, _ in spikes)


def lower_bound(problem: ShardingProblem) -> float:
    """A lower bound on the objective of every choice of ``problem`` (its LP relaxation's,
    :func:`~distgraph.passes.search.layouts.ilp_bound.lp_bound`, the memory budget left
    out), without SCIP."""
    return lp_bound(reduce_problem(problem))


def _proven(problem, red, choice, start) -> Solution | None:
    """``choice`` as the Solution where it is allowed, fits the budget and the bound shows
    SCIP could not improve it (:func:`solve`'s ``bounded``); else None."""
    choice = tuple(int(i) for i in choice)
    first = np.unique(red.cls, return_index=True)[1]
    per_class = [choice[v] for v in first]
    if len(choice) != problem.n or any(choice[v] != per_class[c]
                                       for v, c in enumerate(red.cls)):
        return None
    value, peak = evaluate(problem, choice), peak_memory(problem, choice)
    if not math.isfinite(value) or (problem.memory_budget is not None and
                                    peak > problem.memory_budget * (1 + BUDGET_RTOL)):
        return None
    gap = proven_gap(red, per_class)
    if gap is None:
        return None
    return Solution(choice, value, "optimal", gap, time.perf_counter() - start, peak, 0, 0)


def check_forbidden(p: ShardingProblem, red: Reduced) -> None:
    """Name a node with no allowed strategy, or a pair that allows no combination."""
    first = {int(c): v for v, c in reversed(list(enumerate(red.cls)))}
    for c, costs in enumerate(red.cost):
        if np.isinf(costs).all():
            raise PlanError(f"{p.node(first[c])} has no allowed strategy: every strategy "
                            "costs inf, or an alias/edge among nodes tied to it forbids them "
                            "all; allow at least one")
    for pair in red.pairs:
        allowed = np.isfinite(pair.cost)[pair.rows][:, pair.cols]
        allowed &= np.isfinite(red.cost[pair.u])[:, None] & np.isfinite(red.cost[pair.v])[None]
        if not allowed.any():
            raise PlanError(f"the aliases/edges between {p.node(first[pair.u])} and "
                            f"{p.node(first[pair.v])} (and the nodes tied to them) forbid every "
                            "pair of their allowed strategies; allow at least one pair")


def _memory_unit(red: Reduced) -> float:
    """The power of 2 nearest below the largest memory in the model's rows: the rows and
    the budget are divided by it (exactly). In bytes (1e9 .. 1e10 against 0/1 variables)
    SCIP's presolve cut off choices that fit: on a GPT-3 block it called 0.387 s optimal
    under a 12.1 GB budget while a choice of 0.0211 s peaking at 6.3 GB fit it."""
    largest = max([float(np.abs(d).max()) for delta in red.steps for d in delta.values()] +
                  [float(np.max(w)) for spikes in red.spikes for _, w, _, _ in spikes],
                  default=0.0)
    return 2.0 ** math.floor(math.log2(largest)) if largest > 0 else 1.0


def peak_bound(red: Reduced) -> float:
    """A lower bound on the peak memory of every choice: at each liveness step, each
    class's least live memory over its allowed strategies, summed (exact when the
    choice of least memory everywhere is allowed, as full sharding usually is)."""
    allowed = [np.isfinite(c) for c in red.cost]
    live: dict = {}
    level = bound = 0.0
    for delta, spikes in zip(red.steps, red.spikes):
        for c, d in delta.items():
            old = live.get(c)
            new = d if old is None else old + d
            level += float(new[allowed[c]].min()) - \
                (0.0 if old is None else float(old[allowed[c]].min()))
            live[c] = new
        bound = max(bound, level)
        for c, w, copies, _ in spikes:
            # the running class's least level with its workspace and its copies less
            # what they free, each at its producer's least (at least what its op holds)
            for cu, _, kept in copies:
                w = w + (kept if kept.ndim == 1 else kept[allowed[cu]].min(axis=0))
            old = live.get(c)
            least = 0.0 if old is None else float(old[allowed[c]].min())
            with_work = w if old is None else old + w
            bound = max(bound, level - least + float(with_work[allowed[c]].min()))
    return bound


def _raise_budget(p: ShardingProblem, red: Reduced, start: float, time_limit: float):
    # Name the smallest peak, so the message can say what budget would work: the least-
    # memory start when it reaches peak_bound (then no choice peaks lower), else the
    # peak minimised by SCIP in the time left (at least a tenth of the limit).
    budget = f"memory_budget = {p.memory_budget:g}"
    lean = _starts(red)[1]
    choice = tuple(lean[c] for c in red.cls)
    peak = peak_memory(p, choice)
    if math.isfinite(evaluate(p, choice)) and peak <= peak_bound(red) * (1 + BUDGET_RTOL):
        status = "optimal"
    else:
        deadline = max(start + time_limit, time.perf_counter() + 0.1 * time_limit)
        model = _Model(red, None, minimise_peak=True)
        for choice in _starts(red):
            model.warm_start(choice)
        status = model.run(deadline)
        choice = model.choice()
        if status == "infeasible":
            raise PlanError(CONFLICT)
        if choice is None:
            raise PlanError(f"no sharding choice fits {budget}, and none was found in the "
                            "time limit to name the smallest peak; raise the budget or the "
                            "time limit")
        peak = peak_memory(p, choice)
    if status == "optimal":
        err = DoesNotFit(f"no sharding choice fits {budget}: the smallest peak memory any "
                        f"choice reaches is {peak:g}; raise the budget to at least that, or "
                        "add cheaper-memory strategies (e.g. more sharding)")
    else:
        bound = model.scip.getDualbound() * model.unit
        err = DoesNotFit(f"no sharding choice fits {budget}: the smallest peak memory found "
                        f"within the time limit is {peak:g} (none is below {bound:g}); raise "
                        "the budget")
    err.peak = peak                   # for callers that speak other units
    raise err
