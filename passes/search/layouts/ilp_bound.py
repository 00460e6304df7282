"""A proven lower bound on a sharding problem's optimum, for ``Strategy(search="auto")``:
where it shows that SCIP cannot improve a choice, the refinement skips SCIP.

**The bound** (of a :class:`~distgraph.passes.search.layouts.ilp.Reduced` problem, memory
ignored): for any numbers ``beta[p][a]`` (per pair ``p = (u, v)`` and row group ``a``)
and ``gamma[p][b]`` (per column group ``b``),

    L = sum_c min_i (cost[c][i] + sum_{p: u = c} beta[p][rows_p[i]]
                                + sum_{p: v = c} gamma[p][cols_p[i]])
      + sum_p min_{a, b} (R_p[a][b] - beta[p][a] - gamma[p][b])

is at most the objective of every choice ``x``. Proof: the objective of ``x`` is
``sum_c cost[c][x_c] + sum_p R_p[a_p][b_p]`` (``a_p = rows_p[x_u]``, ``b_p = cols_p[x_v]``);
adding and subtracting ``beta[p][a_p] + gamma[p][b_p]`` for every pair rewrites it as
the sum of one bracket per class (at ``i = x_c``) and one per pair (at ``a_p, b_p``),
and each bracket is at least its minimum. A forbidden entry (inf) only raises the
objective of the choices that take it. Dropping the memory budget only lowers the
optimum, so L bounds the budgeted optimum too. The bound holds for *any* beta and gamma,
so how they are found does not matter to its truth, only to how close it comes:

**Its multipliers** are the duals of the marginal constraints of the ILP's own LP
relaxation (:mod:`~distgraph.passes.search.layouts.ilp`'s ``e`` variables: ``sum_b e[a][b] ==
sum_{i in group a} s[u][i]`` and the columns'), solved by HiGHS (dual simplex). At an
exact LP optimum L equals the LP optimum, SCIP's root bound; computed again from the
duals as above, L stays a bound whatever the LP solver's tolerances. (HiGHS without its
presolve: on a GPT block's refinement, 17k variables, 32 ms against 90 ms with it and
SCIP's 0.42 s; the LP closed the gap there to 1e-15.)

**When SCIP is skipped** (:func:`proven_gap`, ``ilp.solve(bounded=True)``): SCIP solves
the model of the same reduced problem, so no choice it can return costs, on it, less
than L; where the start's objective on it is within ``GAIN_RTOL`` of L, SCIP could
gain at most that. ``GAIN_RTOL`` (1e-9) is below what SCIP itself resolves (its
tolerances, numerics/epsilon 1e-9 and dual feasibility 1e-7, apply to costs scaled to
about 1 each, :func:`~distgraph.passes.search.layouts.ilp._unit`) and far above the rounding of
L's sums. The tests run SCIP anyway on random problems wherever this skips.

Example::

    red = reduce_problem(problem)
    lower = lp_bound(red)          # <= evaluate(problem, x) for every allowed x
"""

from __future__ import annotations

import math

import numpy as np
from scipy import sparse
from scipy.optimize import linprog

from distgraph.passes.search.layouts.tree_moves import objective

GAIN_RTOL = 1e-9        # a proven gain below this (relative) is no gain: SCIP's own resolution


def lp_bound(red) -> float:
    """The lower bound L (module docstring) of ``red`` with the LP relaxation's duals as
    multipliers (zero multipliers where the LP fails: L is then the sum of minima)."""
    beta, gamma = _duals(red)
    return bound(red, beta, gamma)


def bound(red, beta, gamma) -> float:
    """L of ``red`` for the multipliers ``beta`` / ``gamma`` (per pair, per row / column
    group): a lower bound on every choice's objective whatever they are."""
    total = 0.0
    price = [np.asarray(c, float).copy() for c in red.cost]
    for p, pair in enumerate(red.pairs):
        price[pair.u] += beta[p][pair.rows]
        price[pair.v] += gamma[p][pair.cols]
        rest = pair.cost - beta[p][:, None] - gamma[p][None, :]
        total += float(rest.min())
    return total + sum(float(c.min()) for c in price)


def _duals(red) -> tuple:
    """(beta, gamma): the duals of the LP relaxation's row and column marginals."""
    zeros = ([np.zeros(p.cost.shape[0]) for p in red.pairs],
             [np.zeros(p.cost.shape[1]) for p in red.pairs])
    if not red.pairs:
        return zeros
    sizes = [len(c) for c in red.cost]
    s_off = np.concatenate(([0], np.cumsum(sizes)))
    n_s = int(s_off[-1])
    cost = [np.concatenate([np.asarray(c, float) for c in red.cost])]
    # no upper bounds but the forbidden strategies' 0 (one-hot makes them redundant, and
    # the marginal rows' duals then carry the whole bound)
    upper = [np.where(np.isfinite(cost[0]), np.inf, 0.0)]
    cost[0] = np.where(np.isfinite(cost[0]), cost[0], 0.0)
    # rows: one per class (sum of s == 1), then per pair its row groups, then its columns
    rows, cols, vals = [np.repeat(np.arange(len(sizes)), sizes)], [np.arange(n_s)], \
        [np.ones(n_s)]
    row_at = [len(sizes)]
    n_var = n_s
    for pair in red.pairs:
        nr, nc = pair.cost.shape
        r0, c0 = row_at[-1], row_at[-1] + nr
        row_at.append(c0 + nc)
        # -s[u][i] in its row group's row, -s[v][j] in its column group's row
        rows += [r0 + pair.rows, c0 + pair.cols]
        cols += [s_off[pair.u] + np.arange(len(pair.rows)), s_off[pair.v] +
                 np.arange(len(pair.cols))]
        vals += [-np.ones(len(pair.rows)), -np.ones(len(pair.cols))]
        a, b = np.nonzero(np.isfinite(pair.cost))
        e = n_var + np.arange(len(a))
        rows += [r0 + a, c0 + b]
        cols += [e, e]
        vals += [np.ones(len(a)), np.ones(len(a))]
        cost.append(pair.cost[a, b])
        upper.append(np.full(len(a), np.inf))
        n_var += len(a)
    matrix = sparse.csr_matrix((np.concatenate(vals), (np.concatenate(rows),
                                                        np.concatenate(cols))),
                               shape=(row_at[-1], n_var))
    rhs = np.zeros(row_at[-1])
    rhs[:len(sizes)] = 1.0
    c = np.concatenate(cost)
    scale = _scale(c)
    res = linprog(c / scale, A_eq=matrix, b_eq=rhs,
                  bounds=np.stack([np.zeros(n_var), np.concatenate(upper)], axis=1),
                  method="highs-ds", options={"presolve": False})
    if res.status != 0 or res.eqlin is None:
        return zeros
    y = np.asarray(res.eqlin.marginals) * scale
    beta, gamma = [], []
    for p, pair in enumerate(red.pairs):
        r0 = row_at[p]
        nr = pair.cost.shape[0]
        # the e[a][b] column's reduced cost is R - y_row(a) - y_col(b)
        beta.append(y[r0:r0 + nr].copy())
        gamma.append(y[r0 + nr:row_at[p + 1]].copy())
    if not all(np.isfinite(x).all() for x in beta + gamma):
        return zeros
    return beta, gamma


def _scale(c) -> float:
    """The median magnitude of the nonzero costs (the LP is solved on costs of order 1,
    as :func:`~distgraph.passes.search.layouts.ilp.solve` scales SCIP's)."""
    nonzero = np.abs(c[c != 0])
    return float(np.median(nonzero)) if nonzero.size else 1.0


def proven_gap(red, per_class) -> float | None:
    """How much (relative) any choice of ``red`` may undercut ``per_class`` (a strategy
    per class), by :func:`lp_bound`, where that is at most ``GAIN_RTOL``: SCIP could not
    improve it. None otherwise (or where ``per_class`` is forbidden, or the problem's
    processes pay unlike: the bound is the priced process's sum, not the slowest one's)."""
    if red.others:
        return None
    value = objective(red, red.cost, per_class)
    if not math.isfinite(value):
        return None
    gap = (value - lp_bound(red)) / max(abs(value), 1e-300)
    return max(gap, 0.0) if gap <= GAIN_RTOL else None
