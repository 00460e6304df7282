"""Group moves for the double-recursive search: many ops leave their layouts together.

A descent that moves one op at a time (:mod:`distgraph.passes.search.recursive`) stops
where every single move costs more than it saves, even when a whole chain moving at once
would save: on slow links an MLP stays replicated, because the first matmul that splits
its weight pays a reshard that only the next matmul's split would remove (Megatron's
column-then-row pair moves as one). SAPP keeps such chains together by letting light
ops follow heavy ones; here the chains are found in the problem itself.

**A move is an exact solve on a spanning tree.** Given the current choice ``a``, pick a
spanning forest of the classes' interaction graph and solve, exactly and by dynamic
programming (leaves up, then root down), the problem of choosing every class at once
where the forest's edges are priced exactly and every other edge ``(u, v)`` is priced as
if the other end kept its current choice (``R[x_u][a_v] + R[a_u][x_v]``). Every
single-class move and every move of a path or subtree of the forest (a chain of layers,
a matmul with its weight, gradient and update) is in this neighbourhood. The candidate
is kept only if its true objective is lower, so a move never makes the choice worse.
The first forest keeps the heaviest interactions (the pairs whose reshard prices spread
most); later ones are drawn with seeded random weights, so different edges are exact.
A move costs O(edges x strategies), like one level of the descent.

**Cycles move too.** Priced against the current choice, an off-forest edge whose two
ends move together pays twice what moving one end alone would (``R[x_u][a_v] +
R[a_u][x_v]``, where the true price ``R[x_u][x_v]`` may be nothing): in a graph with
cycles (a transformer block's residual adds, q/k/v from one input) a move that takes a
whole block from replicated to Megatron's split on slow links then looks dearer than it
is, and the descent stays 1.4-1.8 x the optimum. So each forest also gets an optimistic
move: every off-forest edge priced at its cheapest entry in the row (column) of the
strategy its end takes, half to each end (as if the other end followed), and that
trial re-priced against itself (off-forest edges at half of ``R[x_u][t_v]`` and of
``R[t_u][x_v]``, exact where the trial ``t`` is kept) until it settles. As every move,
it is kept only if its true objective is lower.

Example::

    per_class = improve(red, cost, per_class)      # red: ilp.reduce_problem(problem)
"""

from __future__ import annotations

import numpy as np

TREES = 6                # forests per round: the heaviest first, then random ones
ROUNDS = 8               # rounds of moves (it stops at a round that finds no gain)
TIE = 1e-9               # relative gain below which a move is not taken
SETTLE = 4               # re-pricings of an optimistic move against itself


def objective(red, cost, per_class) -> float:
    """The reduced problem's objective of ``per_class`` with node costs ``cost``."""
    total = sum(float(c[i]) for c, i in zip(cost, per_class))
    return total + sum(float(p.cost[p.rows[per_class[p.u]], p.cols[per_class[p.v]]])
                       for p in red.pairs)


def improve(red, cost, per_class, seed: int = 0) -> list:
    """``per_class`` (a strategy per class of ``red``) improved by tree moves (module
    docstring), priced with node costs ``cost``; never worse than the input."""
    per_class = [int(i) for i in per_class]
    if not red.pairs:
        return per_class
    rng = np.random.default_rng(seed)
    spread = np.array([_spread(p.cost) for p in red.pairs])
    cheapest = [(p.cost.min(axis=1)[p.rows], p.cost.min(axis=0)[p.cols]) for p in red.pairs]
    best = objective(red, cost, per_class)
    for _ in range(ROUNDS):
        gained = False
        for k in range(TREES):
            weight = spread if k == 0 else np.where(
                np.isinf(spread), np.inf, spread * rng.uniform(0.0, 1.0, len(spread)))
            tree = _forest(len(cost), red.pairs, weight)
            for trial in _moves(red, cost, per_class, tree, cheapest):
                value = objective(red, cost, trial)
                if value < best - TIE * abs(best):
                    per_class, best, gained = trial, value, True
        if not gained:
            break
    return per_class


def _moves(red, cost, current, tree, cheapest):
    """The trials of one forest: priced against ``current``, then the optimistic one and
    its re-pricings against itself (module docstring)."""
    walk = _walk(len(cost), red.pairs, tree)
    yield _tree_move(red, cost, current, walk, _against(red, tree, current, 1.0))
    trial = _tree_move(red, cost, current, walk, _optimistic(red, tree, cheapest))
    yield trial
    for _ in range(SETTLE):
        settled = _tree_move(red, cost, current, walk, _against(red, tree, trial, 0.5))
        if settled == trial:
            break
        trial = settled
        yield trial


def _off_tree(red, tree) -> list:
    in_tree = np.zeros(len(red.pairs), bool)
    in_tree[tree] = True
    return [e for e, kept in enumerate(in_tree) if not kept]


def _against(red, tree, ref, share: float) -> list:
    """Off-forest prices per end: ``share`` of the reshard to (from) ``ref``'s choice at
    the other end."""
    return [(p.u, share * p.cost[:, p.cols[ref[p.v]]][p.rows],
             p.v, share * p.cost[p.rows[ref[p.u]], :][p.cols])
            for p in (red.pairs[e] for e in _off_tree(red, tree))]


def _optimistic(red, tree, cheapest) -> list:
    """Off-forest prices per end: half the cheapest reshard its strategy can meet."""
    return [(red.pairs[e].u, 0.5 * cheapest[e][0], red.pairs[e].v, 0.5 * cheapest[e][1])
            for e in _off_tree(red, tree)]


def _spread(mat) -> float:
    """How much a pair's price can change: the spread of its reshard prices; infinite
    where it forbids some pairs (an alias: its two ends can only move together, so
    every forest keeps it)."""
    finite = mat[np.isfinite(mat)]
    if finite.size < mat.size:
        return np.inf
    return float(finite.max() - finite.min()) if finite.size else 0.0


def _forest(n, pairs, weight) -> list:
    """Indices of ``pairs`` forming a maximum-``weight`` spanning forest (Kruskal)."""
    parent = list(range(n))

    def root(v):
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    chosen = []
    for e in np.argsort(-weight, kind="stable"):
        a, b = root(pairs[e].u), root(pairs[e].v)
        if a != b:
            parent[a] = b
            chosen.append(int(e))
    return chosen


def _walk(n, pairs, tree) -> tuple:
    """(classes in an order where each comes after its parent in ``tree``, the edge to
    each class's parent or -1 at a root)."""
    around = [[] for _ in range(n)]
    for e in tree:
        around[pairs[e].u].append(e)
        around[pairs[e].v].append(e)
    seen, order, parent_edge = np.zeros(n, bool), [], [-1] * n
    for start in range(n):
        if seen[start]:
            continue
        seen[start] = True
        queue = [start]
        while queue:
            c = queue.pop()
            order.append(c)
            for e in around[c]:
                p = pairs[e]
                other = p.v if p.u == c else p.u
                if not seen[other]:
                    seen[other], parent_edge[other] = True, e
                    queue.append(other)
    return order, parent_edge


def _tree_move(red, cost, current, walk, off) -> list:
    """The exact optimum over the forest walked by ``walk`` (:func:`_walk`), the
    off-forest pairs priced by ``off`` (per pair: u, its price per strategy of u, v, the
    same for v)."""
    order, parent_edge = walk
    local = [c.astype(float).copy() for c in cost]
    for u, at_u, v, at_v in off:
        local[u] += at_u
        local[v] += at_v
    back = {}                           # child -> its best strategy per parent strategy
    for c in reversed(order):
        e = parent_edge[c]
        if e < 0:
            continue
        p = red.pairs[e]
        child_is_v = p.v == c
        mat = p.cost if child_is_v else p.cost.T
        groups = p.cols if child_is_v else p.rows          # the child's groups in mat
        upper = p.rows if child_is_v else p.cols           # the parent's
        # the child's cheapest strategy in each group (the first of equal ones)
        by = np.lexsort((local[c], groups))
        first = np.ones(len(by), bool)
        first[1:] = groups[by[1:]] != groups[by[:-1]]
        arg_in = by[first]
        total = mat + local[c][arg_in][None, :]
        pick = np.argmin(total, axis=1)
        local[p.u if child_is_v else p.v] += total[np.arange(len(pick)), pick][upper]
        back[c] = arg_in[pick][upper]
    choice = list(current)
    for c in order:
        e = parent_edge[c]
        if e < 0:
            choice[c] = int(np.argmin(local[c]))
        else:
            p = red.pairs[e]
            choice[c] = int(back[c][choice[p.u if p.v == c else p.v]])
    return choice
