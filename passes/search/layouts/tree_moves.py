"""Group moves for the double-recursive search: many ops leave their layouts together.

A descent that moves one op at a time (:mod:`distgraph.passes.search.layouts.recursive`) stops
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
A move costs O(edges x strategies), like one level of the descent, in a few numpy steps
per depth of the forest (:class:`_Levels`). The optimistic trials of a forest (below)
choose every class afresh, whatever the current choice, so they are found once per
forest and prices; and a run of moves that reaches a state (the choice at a forest,
whether its round gained) an earlier run at those prices passed ends as that one did
(both kept in the planning's session, table "tree moves").

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

from typing import NamedTuple

import numpy as np

from distgraph.passes.session import Session

TREES = 6                # forests per round: the heaviest first, then random ones
ROUNDS = 8               # rounds of moves (it stops at a round that finds no gain)
TIE = 1e-9               # relative gain below which a move is not taken
SETTLE = 4               # re-pricings of an optimistic move against itself
SEED = 0                 # of the random weights of the forests after the heaviest


def objective(red, cost, per_class) -> float:
    """The reduced problem's objective of ``per_class`` with node costs ``cost``."""
    total = sum(float(c[i]) for c, i in zip(cost, per_class))
    return total + sum(float(p.cost[p.rows[per_class[p.u]], p.cols[per_class[p.v]]])
                       for p in red.pairs)


class Flat:
    """A reduced problem's pairs as flat arrays, built once per problem, so that a
    choice's objective and a move's off-forest prices are gathered in one step each
    (the same sums, in the same order, as :func:`objective` and the per-pair loops);
    the forests of its moves, drawn once; the ends of its runs of moves and its
    optimistic trials kept in ``session``'s "tree moves" (a fresh session by default).

    Example::

        flat = Flat(red)
        flat.objective(flat.costs(cost), per_class)      # == objective(red, cost, per_class)
    """

    def __init__(self, red, session: Session | None = None):
        pairs = red.pairs
        self.n = len(red.cost)
        sizes = np.array([len(c) for c in red.cost], dtype=np.intp)
        self.offs = np.concatenate(([0], np.cumsum(sizes)))
        self.u = np.array([p.u for p in pairs], dtype=np.intp)
        self.v = np.array([p.v for p in pairs], dtype=np.intp)
        self.ncols = np.array([p.cost.shape[1] for p in pairs], dtype=np.intp)
        self.mat = np.concatenate([p.cost.ravel() for p in pairs]) if pairs else np.zeros(0)
        self.mat_off = np.concatenate(([0], np.cumsum([p.cost.size for p in pairs])))[:-1]
        self.rows = np.concatenate([p.rows for p in pairs]) if pairs else np.zeros(0, np.intp)
        self.cols = np.concatenate([p.cols for p in pairs]) if pairs else np.zeros(0, np.intp)
        self.rows_off = np.concatenate(([0], np.cumsum([len(p.rows) for p in pairs])))[:-1]
        self.cols_off = np.concatenate(([0], np.cumsum([len(p.cols) for p in pairs])))[:-1]
        # per pair and end (v, then u), its strategies by group (_padded), for _Levels
        self.padded = [(_padded(p.cols), _padded(p.rows)) for p in pairs]
        self.cheapest = [(p.cost.min(axis=1)[p.rows], p.cost.min(axis=0)[p.cols])
                         for p in pairs]
        self._draw, self._drawn = _forests(red, self), []    # the forests drawn so far
        # (self, prices, last forest, choice, forest, gained) -> what improve_rounds from
        # that state returns; (self, prices, forest) -> that forest's optimistic trials
        self.moves = (session or Session()).table("tree moves")

    def forest(self, i: int) -> tuple:
        """The ``i``-th forest of :func:`improve`'s moves, drawn once."""
        while len(self._drawn) <= i:
            self._drawn.append(next(self._draw))
        return self._drawn[i]

    def costs(self, cost) -> np.ndarray:
        """``cost`` (a list of per-class arrays) as one flat float array."""
        return np.concatenate([np.asarray(c, float) for c in cost]) if len(cost) else \
            np.zeros(0)

    def objective(self, flat_cost, per_class) -> float:
        """:func:`objective` of ``per_class``, node costs ``flat_cost`` (:meth:`costs`)."""
        choice = np.asarray(per_class, dtype=np.intp)
        nodes = flat_cost[self.offs[:-1] + choice]
        total = float(np.cumsum(nodes)[-1]) if len(nodes) else 0.0
        if not len(self.u):
            return total
        at = self.mat_off + self.rows[self.rows_off + choice[self.u]] * self.ncols + \
            self.cols[self.cols_off + choice[self.v]]
        return total + float(np.cumsum(self.mat[at])[-1])


def _padded(groups) -> tuple:
    """(per group, its strategies in increasing order padded with 0 to one length, where
    the padding is), so that a row's argmin with the padding priced inf is the group's
    first cheapest strategy."""
    order = np.argsort(groups, kind="stable")
    counts = np.bincount(groups)
    width = int(counts.max())
    slot = np.arange(len(order)) - np.repeat(np.cumsum(counts) - counts, counts)
    padded = np.zeros((len(counts), width), dtype=np.intp)
    padded[groups[order], slot] = order
    pad = np.ones((len(counts), width), dtype=bool)
    pad[groups[order], slot] = False
    return padded, pad


def improve(red, cost, per_class, flat: Flat | None = None) -> list:
    """``per_class`` (a strategy per class of ``red``) improved by tree moves (module
    docstring), priced with node costs ``cost``; never worse than the input. ``flat``:
    ``red``'s :class:`Flat` where the caller keeps one (its forests are then drawn once
    for all the calls: they depend on the problem alone)."""
    return improve_rounds(red, cost, per_class, flat)[0]


def improve_rounds(red, cost, per_class, flat: Flat | None = None,
                   forests: range = range(ROUNDS * TREES), gained: bool = False) -> tuple:
    """(the choice, whether it settled: a round found no gain, whether the round under
    way has gained) of :func:`improve` run over the moves of ``forests`` only (forest
    ``r * TREES + k``: round ``r``'s ``k``-th); ``gained``: whether the round under way
    had gained before them. Forest ``f`` is the same whoever draws it, so a run over
    ``range(0, f)`` then, where not settled, over ``range(f, ROUNDS * TREES)`` from its
    answer makes exactly :func:`improve`: a caller may try the first moves on many
    choices and finish only the promising ones.

    Example::

        first, settled, gained = improve_rounds(red, cost, start, forests=range(1))
        if not settled:
            first = improve_rounds(red, cost, first, forests=range(1, ROUNDS * TREES),
                                   gained=gained)[0]
    """
    per_class = [int(i) for i in per_class]
    if not red.pairs:
        return per_class, True, False
    flat = flat or Flat(red)
    flat_cost = flat.costs(cost)
    # the moves from a state (the choice at a forest, whether the round gained) are the
    # same whoever reaches it: a run that meets a state an earlier run passed (at these
    # prices, to the same last forest) ends as that one did
    price = (flat, flat_cost.tobytes(), forests.stop)
    ended = flat.moves.find(price + (tuple(per_class), forests.start, gained))
    if ended is not None:
        return list(ended[0]), ended[1], ended[2]
    passed = []
    best = flat.objective(flat_cost, per_class)
    for f in forests:
        state = price + (tuple(per_class), f, gained)
        if f > forests.start:
            ended = flat.moves.find(state)
            if ended is not None:
                break
        passed.append(state)
        for trial, value in _moves(flat, flat_cost, per_class, flat.forest(f),
                                   (flat, price[1], f)):
            if value < best - TIE * abs(best):
                per_class, best, gained = trial, value, True
        if f % TREES == TREES - 1:          # a round ends
            if not gained:
                ended = (tuple(per_class), True, False)
                break
            gained = False
    if ended is None:
        ended = (tuple(per_class), forests.stop >= ROUNDS * TREES, gained)
    for state in passed:
        flat.moves[state] = ended
    return list(ended[0]), ended[1], ended[2]


def _forests(red, flat):
    """The forests of the moves in turn, each as (its plan, its off-forest pairs): per
    round the heaviest, then ones of seeded random weights (module docstring)."""
    rng = np.random.default_rng(SEED)
    spread = np.array([_spread(p.cost) for p in red.pairs])
    while True:
        for k in range(TREES):
            weight = spread if k == 0 else np.where(
                np.isinf(spread), np.inf, spread * rng.uniform(0.0, 1.0, len(spread)))
            tree = _forest(len(red.cost), red.pairs, weight)
            yield _plan(red, flat, _walk(len(red.cost), red.pairs, tree)), \
                _OffForest(flat, tree)


def _moves(flat, flat_cost, current, forest, key):
    """The trials of one forest with their objectives: priced against ``current``, then
    the optimistic one and its re-pricings against itself (module docstring). Those
    depend on the forest and the prices alone (every class is chosen afresh), so they
    are found once per ``key`` (the Flat, the prices and the forest; in ``flat.moves``)."""
    plan, off = forest
    trial = _tree_move(flat, flat_cost, current, plan, off.against(current, 1.0))
    yield trial, flat.objective(flat_cost, trial)

    def optimistic():
        trial = _tree_move(flat, flat_cost, current, plan, (off.target, off.hopeful))
        chain = [(trial, flat.objective(flat_cost, trial))]
        for _ in range(SETTLE):
            settled = _tree_move(flat, flat_cost, current, plan, off.against(trial, 0.5))
            if settled == trial:
                break
            trial = settled
            chain.append((trial, flat.objective(flat_cost, trial)))
        return chain
    yield from flat.moves.memo(key, optimistic)


class _OffForest:
    """The off-forest pairs of one forest, as flat gathers: per pair in order, its u end's
    strategies then its v end's (the order in which the per-pair loop added them)."""

    def __init__(self, flat, tree):
        in_tree = np.zeros(len(flat.u), bool)
        in_tree[tree] = True
        self.flat = flat
        self.off = off = np.flatnonzero(~in_tree)
        u, v = flat.u[off], flat.v[off]
        ku, kv = flat.offs[u + 1] - flat.offs[u], flat.offs[v + 1] - flat.offs[v]
        self.lengths = np.stack([ku, kv], axis=1).ravel()          # u0, v0, u1, v1, ...
        starts = np.stack([flat.offs[u], flat.offs[v]], axis=1).ravel()
        self.target = _ranges(starts, self.lengths)              # where each price adds
        # the fixed part of each price's place in flat.mat: the u end's row (its column
        # comes from the other end's choice), the v end's column (likewise its row)
        rows = flat.rows[_ranges(flat.rows_off[off], ku)] * np.repeat(flat.ncols[off], ku) + \
            np.repeat(flat.mat_off[off], ku)
        cols = flat.cols[_ranges(flat.cols_off[off], kv)] + np.repeat(flat.mat_off[off], kv)
        # per pair, its rows' then its columns' part
        starts = np.stack([np.cumsum(ku) - ku, len(rows) + np.cumsum(kv) - kv], axis=1).ravel()
        self.fixed = np.concatenate([rows, cols])[_ranges(starts, self.lengths)]
        # the optimistic move's prices: half the cheapest reshard each strategy can meet
        parts = [x for e in off for x in flat.cheapest[e]]
        self.hopeful = 0.5 * np.concatenate(parts) if parts else np.zeros(0)

    def against(self, ref, share: float) -> tuple:
        """(places, prices): ``share`` of the reshard to (from) ``ref``'s choice at the
        other end."""
        flat, off = self.flat, self.off
        ref = np.asarray(ref, dtype=np.intp)
        col = flat.cols[flat.cols_off[off] + ref[flat.v[off]]]
        row = flat.rows[flat.rows_off[off] + ref[flat.u[off]]] * flat.ncols[off]
        step = np.stack([col, row], axis=1).ravel()
        return self.target, share * flat.mat[self.fixed + np.repeat(step, self.lengths)]


def _ranges(starts, lengths) -> np.ndarray:
    """The concatenation of ``arange(s, s + n)`` over ``starts`` and ``lengths``."""
    if not len(lengths):
        return np.zeros(0, np.intp)
    total = int(lengths.sum())
    ends = np.cumsum(lengths)
    out = np.arange(total, dtype=np.intp) - np.repeat(ends - lengths, lengths)
    return out + np.repeat(starts, lengths)


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


def _plan(red, flat, walk) -> "_Levels":
    """The forest of ``walk`` (:func:`_walk`) as the gathers of :func:`_tree_move`,
    level by level (:class:`_Levels`)."""
    order, parent_edge = walk
    roots, edges = [], []
    for c in reversed(order):           # leaves first
        e = parent_edge[c]
        if e < 0:
            roots.append(c)
            continue
        p = red.pairs[e]
        if p.v == c:        # (child, parent, parent group x child group, parent's groups,
            edges.append((c, p.u, p.cost, p.rows, flat.padded[e][0]))   # child's: _padded)
        else:
            edges.append((c, p.v, p.cost.T, p.cols, flat.padded[e][1]))
    return _Levels(flat, roots, edges)


class _Levels:
    """A forest's dynamic programme as flat gathers, one set per depth of the forest.

    Leaves up, every child's cheapest strategy per group of its edge, then per strategy
    group of its parent the cheapest child group (the matrix entry plus that strategy's
    price), added to the parent's prices. The children of one depth are final once the
    depth below is done, and a parent's children all lie at one depth: so a depth is
    done in a few numpy steps over all its edges, which add to each parent in the
    order the edge-by-edge loop did (``np.add.at`` over the edges in that order), and
    every price is the same sum, to the last bit. Padding is priced inf (a slot of the
    buffer kept at inf), so each argmin takes the first of equal prices as before.
    Root down, each child then takes the strategy its parent's choice picked."""

    def __init__(self, flat, roots, edges):
        offs, n = flat.offs, int(flat.offs[-1])
        self.inf_at, self.zero_at = n, n + 1          # buffer slots: inf and 0.0
        depth = [0] * flat.n
        for c, parent, *_ in reversed(edges):         # root down
            depth[c] = depth[parent] + 1
        self.roots = np.array(roots, dtype=np.intp)
        width = max((offs[c + 1] - offs[c] for c in roots), default=1)
        self.root_at = np.full((len(roots), width), n, dtype=np.intp)
        for k, c in enumerate(roots):
            self.root_at[k, :offs[c + 1] - offs[c]] = np.arange(offs[c], offs[c + 1])
        self.root_off = offs[self.roots]
        self.levels = []
        for d in range(max(depth, default=0), 0, -1):   # deepest first
            at = [e for e in edges if depth[e[0]] == d]
            self.levels.append(self._level(offs, n, at))

    @staticmethod
    def _level(offs, n, edges) -> tuple:
        members, mats, cols, add_to, add_row, upper, children, parents = \
            [], [], [], [], [], [], [], []
        groups = rows = 0
        for c, parent, mat, up, (padded, pad) in edges:
            members.append(np.where(pad, n, offs[c] + padded))
            mats.append(mat)
            cols.append(groups + np.arange(mat.shape[1]))
            add_to.append(offs[parent] + np.arange(len(up)))
            add_row.append(rows + up)
            upper.append((rows, groups, up))
            children.append(c)
            parents.append(parent)
            groups += mat.shape[1]
            rows += mat.shape[0]
        member_at = np.full((groups, max(m.shape[1] for m in members)), n, dtype=np.intp)
        g = 0
        for m in members:
            member_at[g:g + m.shape[0], :m.shape[1]] = m
            g += m.shape[0]
        span = max(m.shape[1] for m in mats)
        mat = np.full((rows, span), np.inf)
        col = np.full((rows, span), groups, dtype=np.intp)   # -> the 0.0 slot
        r = 0
        for m, cs in zip(mats, cols):
            mat[r:r + m.shape[0], :m.shape[1]] = m
            col[r:r + m.shape[0], :m.shape[1]] = cs
            r += m.shape[0]
        up_at = np.concatenate([u[2] + u[0] for u in upper])     # rows by parent strategy
        up_off = np.cumsum([0] + [len(u[2]) for u in upper])[:-1]
        parents, children = np.array(parents, dtype=np.intp), np.array(children, dtype=np.intp)
        return _Level(member_at, np.arange(len(member_at)), mat, col, np.arange(rows),
                      np.concatenate(add_to), np.concatenate(add_row), parents, children,
                      up_at, up_off, np.array([u[1] for u in upper], dtype=np.intp),
                      offs[children])


def _tree_move(flat, flat_cost, current, plan, off) -> list:
    """The exact optimum over the forest of ``plan`` (:class:`_Levels`), the off-forest
    pairs priced by ``off`` ((places in ``flat_cost``, prices): each pair's price per
    strategy of its u end, then of its v end)."""
    places, prices = off
    buffer = np.empty(len(flat_cost) + 2)
    buffer[:-2] = flat_cost
    buffer[plan.inf_at], buffer[plan.zero_at] = np.inf, 0.0
    np.add.at(buffer, places, prices)       # in order: as adding pair by pair
    back = []
    for lv in plan.levels:
        # each child's cheapest strategy in each group (the first of equal ones)
        arg_in = lv.member_at[lv.groups, buffer[lv.member_at].argmin(axis=1)]
        total = lv.mat + buffer[np.append(arg_in, plan.zero_at)[lv.col]]
        pick = total.argmin(axis=1)
        np.add.at(buffer, lv.add_to, total[lv.rows, pick][lv.add_row])
        back.append((arg_in, pick))
    choice = np.array(current, dtype=np.intp)
    choice[plan.roots] = buffer[plan.root_at].argmin(axis=1)
    for lv, (arg_in, pick) in zip(reversed(plan.levels), reversed(back)):
        picked = pick[lv.up_at[lv.up_off + choice[lv.parents]]]
        choice[lv.children] = arg_in[lv.group_start + picked] - lv.child_off
    return choice.tolist()


class _Level(NamedTuple):
    """The gathers of one depth of a forest (:class:`_Levels`): per row of
    ``member_at``, a child's strategies in one group of its edge (padded with the inf
    slot); per row of ``mat`` (padded with inf), a parent group of an edge, its columns
    the child's groups (``col``: where their cheapest price lies in this depth's
    ``arg_in``; padding at the 0.0 slot); ``add_to`` / ``add_row``: each parent
    strategy's place in the buffer and its row; per edge, its parent, child, where its
    parent's strategies find their row (``up_at[up_off + strategy]``), its first group
    and its child's first place in the buffer."""
    member_at: np.ndarray
    groups: np.ndarray
    mat: np.ndarray
    col: np.ndarray
    rows: np.ndarray
    add_to: np.ndarray
    add_row: np.ndarray
    parents: np.ndarray
    children: np.ndarray
    up_at: np.ndarray
    up_off: np.ndarray
    group_start: np.ndarray
    child_off: np.ndarray
