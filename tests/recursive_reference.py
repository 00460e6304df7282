"""The recursive search's descents and tree moves as they were before they were made
cheaper (passes/search/recursive.py and tree_moves.py at b0b4df3): every forest's
dynamic programme edge by edge, its off-forest prices gathered pair by pair, every
trial of every forest found afresh (no run ends where an earlier one passed), every
re-pick priced, edge prices kept per walk only. The oracle that
tests/test_recursive_reference.py holds the search to, choice for choice.

Example::

    walks = reference_walks(problem, space, dims)
    solve_recursive(problem, space, dims, walks=walks)     # the old search's answer
"""

from __future__ import annotations

import numpy as np

from distgraph.passes.search import recursive as R
from distgraph.passes.search import tree_moves as T
from distgraph.passes.search.ilp import check_forbidden, peak_bound, reduce_problem


def reference_walks(problem, space, dims) -> R.Walks:
    """A :class:`~distgraph.passes.search.recursive.Walks` whose descents are the old
    ones (set up as Walks.setup does)."""
    walks = R.Walks()
    red = reduce_problem(problem)
    check_forbidden(problem, red)
    members = [[] for _ in red.cost]
    for v, c in enumerate(red.cls):
        members[c].append(v)
    levels = R._groups(space, members, dims)
    last = [np.arange(len(costs)) for costs in red.cost]
    orders = [levels + [last]] + ([levels[::-1] + [last]] if len(levels) > 1 else [])
    walks.walk = Descent(red, orders)
    walks.bound = peak_bound(red)
    return walks


class Descent(R._Descent):
    """The old walk, re-picks and prices; tree moves by :func:`improve_rounds`."""

    def __init__(self, red, level_orders):
        super().__init__(red, level_orders)
        self.forests: dict = {}

    def _improve(self, cost, moves, start, forests, before=None) -> list:
        red, out = self.red, []
        for k, price in enumerate([cost] if moves is cost else [cost, moves]):
            if before is None:
                out.append(self.rounds(price, out[-1][0] if out else start, forests))
            elif k and not before[k - 1][1]:
                out.append(self.rounds(price, out[-1][0], range(T.ROUNDS * T.TREES)))
            elif not before[k][1]:
                out.append(self.rounds(price, before[k][0], forests, before[k][2]))
            else:
                out.append(before[k])
        assert red is self.red
        return out

    def rounds(self, cost, per_class, forests, gained=False) -> tuple:
        """Old improve_rounds (seed 0) on this problem's Flat."""
        per_class = [int(i) for i in per_class]
        red, flat = self.red, self.flat
        if not red.pairs:
            return per_class, True, False
        flat_cost = flat.costs(cost)
        best = flat.objective(flat_cost, per_class)
        for f in forests:
            for trial in _moves(flat, flat_cost, per_class, self.forest(f)):
                value = flat.objective(flat_cost, trial)
                if value < best - T.TIE * abs(best):
                    per_class, best, gained = trial, value, True
            if f % T.TREES == T.TREES - 1:
                if not gained:
                    return per_class, True, False
                gained = False
        return per_class, forests.stop >= T.ROUNDS * T.TREES, gained

    def forest(self, i):
        if "draw" not in self.forests:
            self.forests["draw"], self.forests["drawn"] = _forests(self.red, self.flat), []
        while len(self.forests["drawn"]) <= i:
            self.forests["drawn"].append(next(self.forests["draw"]))
        return self.forests["drawn"][i]

    def _walk(self, cost, order, levels) -> list:
        mask = [np.isfinite(c) for c in cost]
        seen = _Seen(len(mask))
        for groups in levels:
            before = [m.copy() for m in mask]
            one = [R._one_group(groups[c][before[c]]) for c in range(len(mask))]
            chosen = list(one)
            for c in order:
                if one[c] is None:
                    chosen[c] = self.old_best(c, cost, mask, before, groups, seen=seen)
                    mask[c] = before[c] & (groups[c] == chosen[c])
                    seen.moved(c)
            for _ in range(R.SWEEPS):
                changed = False
                for c in order:
                    if one[c] is not None:
                        continue
                    g = self.old_best(c, cost, mask, before, groups, chosen[c], seen)
                    if g != chosen[c]:
                        chosen[c] = g
                        mask[c] = before[c] & (groups[c] == g)
                        seen.moved(c)
                        changed = True
                if not changed:
                    break
        return [int(np.flatnonzero(m)[0]) for m in mask]

    def old_best(self, c, cost, mask, before, groups, current=None, seen=None) -> int:
        open_ = np.flatnonzero(before[c])
        price = self.prices(c, cost, mask, seen=seen)
        per_group = np.full(int(groups[c].max()) + 1, np.inf)
        np.minimum.at(per_group, groups[c][open_], price[open_])
        least = per_group.min()
        bar = least + R.TIE * abs(least)
        if current is not None and per_group[current] <= bar:
            return int(current)
        tied = np.flatnonzero(per_group <= bar)
        if len(tied) == 1:
            return int(tied[0])
        mean = self.prices(c, cost, mask, with_mean=True, seen=seen)[1]
        second = np.full(len(per_group), np.inf)
        np.minimum.at(second, groups[c][open_], mean[open_])
        return int(tied[np.argmin(second[tied])])

    def prices(self, c, cost, mask, with_mean=False, seen=None):
        price = cost[c].copy()
        mean = cost[c].copy() if with_mean else None
        for k, (pair, safe, is_u) in enumerate(self.around[c]):
            other = pair.v if is_u else pair.u
            key = (c, k, seen.version[other]) if seen is not None else None
            got = seen.edge.get(key) if key is not None else None
            if got is None or (with_mean and got[1] is None):
                got = R._edge_prices(pair, safe, is_u, mask[other], with_mean)
                if key is not None:
                    seen.edge[key] = got
            price += got[0]
            if with_mean:
                mean += got[1]
        return (price, mean) if with_mean else price


class _Seen:
    def __init__(self, n: int):
        self.version = [0] * n
        self.edge: dict = {}

    def moved(self, c: int):
        self.version[c] += 1


def _forests(red, flat, seed: int = 0):
    rng = np.random.default_rng(seed)
    spread = np.array([T._spread(p.cost) for p in red.pairs])
    while True:
        for k in range(T.TREES):
            weight = spread if k == 0 else np.where(
                np.isinf(spread), np.inf, spread * rng.uniform(0.0, 1.0, len(spread)))
            tree = T._forest(len(red.cost), red.pairs, weight)
            yield _plan(red, T._walk(len(red.cost), red.pairs, tree)), _off_forest(flat, tree)


def _off_forest(flat, tree):
    """tree_moves._OffForest with its fixed places found pair by pair."""
    off = T._OffForest(flat, tree)
    u, v = flat.u[off.off], flat.v[off.off]
    ku, kv = flat.offs[u + 1] - flat.offs[u], flat.offs[v + 1] - flat.offs[v]
    fixed = []
    for k, e in enumerate(off.off):
        rows = flat.rows[flat.rows_off[e]:flat.rows_off[e] + ku[k]]
        cols = flat.cols[flat.cols_off[e]:flat.cols_off[e] + kv[k]]
        fixed += [flat.mat_off[e] + rows * flat.ncols[e], flat.mat_off[e] + cols]
    off.fixed = np.concatenate(fixed) if fixed else np.zeros(0, np.intp)
    return off


def _plan(red, walk) -> tuple:
    order, parent_edge = walk
    roots, edges = [], []
    for c in reversed(order):
        e = parent_edge[c]
        if e < 0:
            roots.append(c)
            continue
        p = red.pairs[e]
        if p.v == c:
            edges.append((c, p.u, p.cost, p.rows, p.cols))
        else:
            edges.append((c, p.v, p.cost.T, p.cols, p.rows))
    return roots, edges


def _moves(flat, flat_cost, current, forest):
    plan, off = forest
    yield _tree_move(flat, flat_cost, current, plan, off.against(current, 1.0))
    trial = _tree_move(flat, flat_cost, current, plan, off.optimistic(flat.cheapest))
    yield trial
    for _ in range(T.SETTLE):
        settled = _tree_move(flat, flat_cost, current, plan, off.against(trial, 0.5))
        if settled == trial:
            break
        trial = settled
        yield trial


def _tree_move(flat, flat_cost, current, plan, off) -> list:
    """The forest's exact optimum, edge by edge (leaves up, then root down)."""
    roots, edges = plan
    places, prices = off
    buffer = flat_cost.copy()
    np.add.at(buffer, places, prices)
    offs = flat.offs
    local = [buffer[offs[c]:offs[c + 1]] for c in range(flat.n)]
    back = []
    for c, parent, mat, upper, down in edges:
        arg_in = np.array([np.flatnonzero(down == g)[local[c][down == g].argmin()]
                           for g in range(mat.shape[1])], dtype=np.intp)
        total = mat + local[c][arg_in][None, :]
        pick = total.argmin(axis=1)
        local[parent] += total[np.arange(mat.shape[0]), pick][upper]
        back.append((arg_in, pick))
    choice = list(current)
    for c in roots:
        choice[c] = int(local[c].argmin())
    for (c, parent, _, upper, _), (arg_in, pick) in zip(reversed(edges), reversed(back)):
        choice[c] = int(arg_in[pick[upper[choice[parent]]]])
    return choice
