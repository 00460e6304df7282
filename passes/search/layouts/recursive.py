"""The double-recursive strategy search (MindSpore's SAPP, in its docs): every op's layout
on a mesh chosen level by level, without an ILP, on the problem the ILP would solve.

**Levels: the device set bisected.** SAPP sees a cluster as a symmetric multi-level
machine and bisects its devices recursively: each level decides, for every op, which
tensor dim the next cut of the devices splits. Here a level is a mesh dim, the slowest
(the top of the machine: across machines) first. A mesh dim of 2^k devices is k
bisections that our layouts (one tensor dim per mesh dim) make cut the same tensor dim,
so they are decided together. A level's candidates for an op are its strategies grouped
by what that mesh dim does in them (which dim of each operand and result it splits, or
a pending sum over it), among those that agree with the levels above; after the last
mesh dim a final level picks one strategy of the chosen group (two may differ only in
how a pending sum is settled). For the mesh ``[x=2, y=4]`` a matmul first chooses what
the slow ``x`` cuts (batch: data parallel across machines), then what ``y`` cuts.

**Op-weight order: a level is linear in the graph.** SAPP visits heavy ops first (its
operator weights) and lets light ones follow what is around them. Here an op (a tie
class of the problem: a light op with the operand it follows, the same op in every
shared block, a parameter with its update) weighs its dearest allowed strategy's cost,
and the classes are visited heaviest first. Each picks its group once, given its
neighbours' current candidates; then a few sweeps in the same order let each re-pick
given all of them (iterated conditional modes), stopping when none changes. Each visit
looks at the class's edges once, so a level costs O(edges x strategies). A greedy
descent depends on its order, so the whole descent also runs in program order and in
its reverse, and the cheapest of the three choices is kept (on random problems of up to
six nodes, tests/test_recursive_search.py, this takes the share within 10% of the
optimum from 88% to 98%; the tree moves below make 99% of them optimal). On a mesh of
several dims the descents also run with the levels fastest first: a level-by-level
greedy descent that cuts the slow dim first can miss plans whose fast dim decides the
layouts (Megatron within a machine): on 8 x 8 and 4 x 8 A100 meshes
(bench/search_quality.py) this took three GPT/Llama graphs from 3-6% to within 0.3%.

**Group moves.** A descent of single-op moves stops where every op leaving its layout
alone pays reshards that its neighbours moving with it would save (on slow links an MLP
stays replicated rather than take Megatron's column-then-row pair). After the last level
each descent is improved by tree moves (:mod:`distgraph.passes.search.layouts.tree_moves`):
every class re-chosen at once, exactly on a spanning forest of the interactions (chains
of layers move together), kept only where the objective falls.

**What a search costs.** Every descent gets one forest of tree moves; only the ``KEEP``
(2) best after it, alike ends once, get the rest, which then follow exactly the
trajectory a full :func:`~distgraph.passes.search.layouts.tree_moves.improve` would (ends that
lose after one forest rarely win after all of them: on the Table 1 1T row's and GPT-3
``--engine``'s searches, the 20 of bench/search_quality.py and 229 brute-forced random
problems, the same choices as improving every descent fully). A walk
prices an edge once per set of candidates its far end has (per walk, by the far end's
version, raised when it re-picks; over that, per problem in the session's "edge
prices", shared by every walk and ``lam``: the prices depend on the far end's
candidates alone), a class with one group open at a level is
not priced, and a re-pick is skipped where no neighbour moved since the class last
picked (it would pick the same group). The
guided descents and the memory ladder below descend in op-weight order only. In all, a
search costs 1.8-3.5 x less than improving every descent of every order fully (the
same searches): 1.6 s against SCIP's 2.7 s on the 1T row's, 4.1 s against 19 s on
GPT-3 ``--engine``'s (where SCIP takes 4-5 s per (dp, cp, tp) mesh, this 0.5 s).

**Guided descents.** Unpriced, a descent may settle where the fast dim splits what
the slow one does (the sequence over cp and y, every weight whole) although Megatron's
split over y is faster: no single op or tree of ops gains by leaving. Memory, priced at
the unpriced choice's seconds per byte (its objective over its peak), leads the
descents to split weights; their choices, improved by tree moves at that price and then
at the price of time alone, are candidates too (on GPT 529.6B's block on a [9, 2, 4]
mesh: 50.19 ms -> 49.67 ms, the ILP's optimum, at a quarter of the memory).

**Relative costs.** A candidate is priced against the others of the same op only: its
own compute and collectives plus, per edge, the cheapest reshard to a layout the
neighbour may still take (a neighbour not yet decided at this level may take any of its
candidates; one decided takes its group's). The candidate with the least such price
wins; the lower levels' choices it leaves open are priced at their best.

**What the ILP respects, this respects.** It solves the same :class:`~distgraph.passes.
search.ilp_problem.ShardingProblem` (the same candidate enumeration and prices,
:mod:`distgraph.passes.search.layouts.intra_op`): follow and share ties are its classes,
forbidden strategies are never candidates, aliases (an update writes a parameter or
ZeRO-split state back in the layout it is stored in) forbid pairs. With a memory budget
the choice's peak over the liveness sets is checked; over it, the search runs again
with each byte a class holds priced at ``lam`` seconds (a Lagrange multiplier), ``lam``
raised 8 x at a time until the peak fits, then lowered by bisection (of ``log lam``,
three steps) to the cheapest choice that fits.
Where no ``lam`` fits, or the choice breaks an alias, the SCIP ILP decides
(:func:`~distgraph.passes.search.layouts.ilp.solve`, which finds a plan or names the smallest
peak) and the report says so.

**Searches of one problem under several budgets** (the memory variants of :mod:`~distgraph.
passes.search.stages.runs`: the same block, its budget halved each time) share a :class:`Descents`
(:func:`~distgraph.passes.search.layouts.intra_op.search` keeps one per problem):
a descent depends on the problem and ``lam``, not on the budget, so each ``lam``'s
descents are walked once for all of them (the session's "recursive descents"), and the
walk up ``lam``'s ladder, the same ladder every time, repeats no descent. Such a caller may also ask for no proof
(``prove=False``): a budget below :func:`~distgraph.passes.search.layouts.ilp.peak_bound` then
raises PlanError at once, without SCIP naming the smallest peak.

Example::

    sol, note = solve_recursive(problem, space, ["x", "y"])
    sol.objective, sol.status          # the same objective the ILP's evaluate() gives
"""

from __future__ import annotations

import math
import time

import numpy as np
from scipy import sparse

from distgraph.errors import PlanError
from distgraph.passes.search.layouts.ilp import (BUDGET_RTOL, Solution, check_forbidden, evaluate,
                                         peak_bound, peak_memory, reduce_problem, solve)
from distgraph.passes.search.layouts.tree_moves import ROUNDS, TREES, Flat, improve_rounds
from distgraph.passes.session import Session

METHODS = ("ilp", "recursive", "auto")
KEEP = 2                 # descents per run whose tree moves go on after the first forests
FIRST = 1                # forests of tree moves every descent gets
SWEEPS = 4               # re-picks per level after the first pass (it stops when none changes)
GROW, LAM_STEPS, BISECTIONS = 8.0, 16, 3
TIE = 1e-9               # relative price difference below which candidates tie
BIG = 1e30               # a forbidden pair, counted so that the fewest are chosen


def bisection_levels(mesh, ring_of) -> list:
    """The mesh dims of more than one process, slowest ring first (``ring_of(dim)``:
    its Ring); ties keep the mesh's order."""
    dims = [d for d, n in zip(mesh.dim_names, mesh.shape) if n > 1]
    return sorted(dims, key=lambda d: (ring_of(d).bandwidth, dims.index(d)))


class Descents:
    """The recursive search of one problem (built on ``space``, bisected over the mesh
    dims ``dims``) whatever its ``memory_budget``: its reduced problem's levels and
    descents, and the peak bound; the descents at each memory price ``lam`` (each
    ``lam``'s choices with their objectives and peaks) kept in ``session``'s "recursive
    descents" for the searches of the problem under other budgets (module docstring).

    Example::

        descents = Descents(problem, space, dims)
        for budget in (8e9, 4e9, 2e9):
            solve_recursive(problem.with_budget(budget), space, dims, descents=descents)
    """

    def __init__(self, problem, space, dims, session: Session | None = None):
        session = session or Session()
        red = reduce_problem(problem)
        check_forbidden(problem, red)
        members = [[] for _ in red.cost]
        for v, c in enumerate(red.cls):
            members[c].append(v)
        levels = _groups(space, members, dims)
        last = [np.arange(len(costs)) for costs in red.cost]
        # slowest level first (SAPP's order), and on 2-D meshes fastest first as well
        orders = [levels + [last]] + ([levels[::-1] + [last]] if len(levels) > 1 else [])
        self.walk = _Descent(red, orders, session)
        self.bound = peak_bound(red)              # of the reduced problem
        self._found = session.table("recursive descents")

    def run(self, problem, lam: float) -> list:
        """[(choice, objective, peak)] of the descents at ``lam``; at ``lam`` = 0 also
        the guided ones (module docstring: memory priced at the unpriced choice's
        seconds per byte for the descent, then tree moves at the price of time alone).
        At ``lam`` > 0 (the memory ladder) only the op-weight order descends."""
        def descents():
            priced: dict = {}       # descents that end alike are priced once

            def add(choices):
                for c in choices:
                    if tuple(c) not in priced:
                        priced[tuple(c)] = (c, evaluate(problem, c), peak_memory(problem, c))
            add(self.walk.run(lam, heaviest_only=lam > 0))
            if lam == 0.0:
                _, objective, peak = min(priced.values(), key=lambda f: f[1])
                if math.isfinite(objective) and objective > 0 and peak > 0:
                    add(self.walk.run(objective / peak, improve_at=0.0, heaviest_only=True))
            return list(priced.values())
        return self._found.memo((self, lam), descents)


def solve_recursive(problem, space, dims, time_limit: float = 60.0, descents=None,
                    prove: bool = True):
    """(Solution, note) of ``problem`` (built on ``space``) by recursive bisection over
    the mesh dims ``dims`` in that order (module docstring). ``note`` is "" or says why
    the ILP decided (``time_limit`` bounds it then). The Solution's status is
    "recursive" and its gap inf (no bound is known), unless the ILP decided. ``descents``:
    a :class:`Descents` of this problem under other budgets, whose descents are reused;
    ``prove=False``: a budget below the peak bound raises PlanError without SCIP."""
    start = time.perf_counter()
    descents = descents or Descents(problem, space, dims)
    choice, objective, peak = min(descents.run(problem, 0.0), key=lambda f: f[1])
    budget = problem.memory_budget
    note = ""
    if math.isinf(objective):
        note = "the recursive choice broke an alias"
    elif budget is not None and peak > budget:
        # below the bound no lam can fit: the ILP names the smallest peak at once
        fits = descents.bound <= budget * (1 + BUDGET_RTOL)
        if not fits and not prove:
            raise PlanError(f"no choice peaks within memory_budget = {budget:g} bytes: "
                            f"every one peaks at {descents.bound:g} or more")
        choice = _fit(problem, descents, objective, peak, budget) if fits else None
        if choice is None:
            note = "no recursive choice fit the memory budget"
    if note:
        sol = solve(problem, time_limit=max(time_limit - (time.perf_counter() - start), 0.1))
        return sol, note + "; the ILP decided"
    return Solution(tuple(choice), evaluate(problem, choice), "recursive", math.inf,
                    time.perf_counter() - start, peak_memory(problem, choice), 0, 0), ""


def _fit(problem, descents, objective, peak, budget):
    """The cheapest choice found whose peak fits ``budget``, raising the price of memory
    from the unpriced choice's ``objective`` / ``peak`` (module docstring); None if none
    fits."""
    lam = 1e-3 * objective / max(peak, 1.0)
    walk = descents.walk

    def fitting(lam):
        found = [(o, c) for c, o, p in descents.run(problem, lam) if p <= budget]
        return min(found, key=lambda f: f[0], default=(None, None))[1]

    low, high, best = 0.0, None, None
    for _ in range(LAM_STEPS):
        best = fitting(lam)
        if best is not None and math.isfinite(evaluate(problem, best)):
            high = lam
            break
        low, lam, best = lam, lam * GROW, None
    if best is None:
        return None
    for _ in range(BISECTIONS):
        mid = math.sqrt(low * high) if low > 0 else 0.5 * high
        c = fitting(mid)
        if c is not None and math.isfinite(evaluate(problem, c)):
            high = mid
            best = min(best, c, key=lambda x: evaluate(problem, x))
        else:
            low = mid
    return _tighten(problem, walk, best, budget)


def _tighten(problem, walk, choice, budget) -> list:
    """``choice`` improved by re-picks at the price of time alone that keep the peak
    within ``budget`` (memory priced by ``lam`` is only a proxy for the peak): each class,
    in op-weight order, takes the cheapest strategy given its neighbours that fits."""
    red = walk.red
    rows = [(t, v) for t, live in enumerate(problem.liveness) for v in live]
    live = sparse.csr_matrix((np.ones(len(rows)), ([t for t, _ in rows], [v for _, v in rows])),
                             shape=(len(problem.liveness), problem.n))
    members = [np.flatnonzero(red.cls == c) for c in range(len(red.cost))]
    choice = list(choice)
    per_class = [choice[m[0]] for m in members]
    memory = np.array([problem.memory[v][choice[v]] for v in range(problem.n)])
    mask = [np.arange(len(k)) == i for k, i in zip(red.cost, per_class)]
    for c in walk.orders[0]:
        price = walk.prices(c, red.cost, mask)
        for i in np.argsort(price, kind="stable"):
            if not price[i] < price[per_class[c]] - TIE * abs(price[per_class[c]]):
                break
            trial = memory.copy()
            trial[members[c]] = [problem.memory[v][i] for v in members[c]]
            picks = per_class[:c] + [int(i)] + per_class[c + 1:]
            beside = problem.beside([picks[k] for k in red.cls])    # workspace, released
            if (live @ trial + beside).max() <= budget:
                per_class[c], memory = int(i), trial
                mask[c] = np.arange(len(price)) == i
                break
    return [per_class[c] for c in red.cls]


def _groups(space, members, dims) -> list:
    """Per mesh dim of ``dims``, per class, the group of each strategy at that level:
    strategies in which that mesh dim does the same to every operand and result of every
    member. Groups are numbered in the order their first strategy comes."""
    if not dims:
        return []
    keys: dict = {}         # a placement tuple -> its number
    specs: dict = {}        # id(spec) -> (spec, its placement number per mesh dim)
    by_value: dict = {}     # spec -> its placement number per mesh dim
    strategies: dict = {}   # (id(strategy), id(hints)) -> its numbers per mesh dim
    per_node: dict = {}     # node -> (strategies x dims) numbers

    def placed(spec):
        if id(spec) not in specs:
            if spec not in by_value:
                by_value[spec] = [keys.setdefault(_placement(spec, m), len(keys)) for m in dims]
            specs[id(spec)] = (spec, by_value[spec])
        return specs[id(spec)][1]

    def node_keys(v):
        if v not in per_node:
            node, rows = space.nodes[v], []
            for s, hints in zip(node.strategies, node.hints):
                at = (id(s), id(hints))
                if at not in strategies:
                    cols = [placed(spec) for spec in s.in_specs + s.out_specs + tuple(hints)]
                    strategies[at] = (s, hints, [keys.setdefault(k, len(keys)) for k in
                                                 zip(*cols)] if cols else [0] * len(dims))
                rows.append(strategies[at][2])
            per_node[v] = np.array(rows, dtype=np.intp).reshape(len(rows), len(dims))
        return per_node[v]

    out = [[] for _ in dims]
    for nodes in members:
        table = np.stack([node_keys(v) for v in nodes])        # members x strategies x dims
        for d in range(len(dims)):
            column = table[:, :, d]
            if (column == column[0]).all():
                key = column[0]
            else:
                # the distinct members' placements in order, as one number per strategy
                distinct: dict = {}
                key = np.array([distinct.setdefault(k, keys.setdefault(
                    tuple(dict.fromkeys(k)), len(keys))) for k in zip(*column.tolist())],
                    dtype=np.intp)
            index: dict = {}
            out[d].append(np.array([index.setdefault(k, len(index)) for k in key.tolist()],
                                   dtype=np.intp))
    return out


def _placement(spec, mesh_dim: str) -> tuple:
    """What ``mesh_dim`` does to a tensor laid out ``spec``: the dims it splits (with its
    place among the mesh dims splitting each) and "P" for a pending sum over it."""
    cut = tuple((d, spec.entry(d).index(mesh_dim)) for d in range(len(spec.dims))
                if mesh_dim in spec.entry(d))
    return cut + (("P",) if mesh_dim in spec.partial else ())


class _Descent:
    """The levels of one reduced problem (one list per level order), walked top-down
    with memory priced ``lam``."""

    def __init__(self, red, level_orders, session):
        self.red, self.level_orders = red, level_orders
        self.flat = Flat(red, session)
        self.around = [[] for _ in red.cost]
        for pair in red.pairs:
            safe = np.where(np.isinf(pair.cost), BIG, pair.cost)
            self.around[pair.u].append((pair, safe, True))
            self.around[pair.v].append((pair, safe, False))
        # (self, class, its pair, far end's candidates) -> prices (:meth:`prices`)
        self.edges = session.table("edge prices")
        self.neighbours = [[p.v if is_u else p.u for p, _, is_u in a] for a in self.around]
        weight = [float(np.max(c[np.isfinite(c)], initial=0.0)) for c in red.cost]
        heaviest = sorted(range(len(red.cost)), key=lambda c: (-weight[c], c))
        self.orders = (heaviest, list(range(len(red.cost))), list(range(len(red.cost)))[::-1])

    def run(self, lam: float, improve_at: float | None = None,
            heaviest_only: bool = False) -> list:
        """Choices (one strategy index per node of the problem), one per level order and
        visiting order: the op-weight order, then program order and its reverse (greedy
        descents are order-sensitive; the caller keeps the best, at a few times a linear
        cost). Memory is priced ``lam`` in the descents and their tree moves; with
        ``improve_at``, tree moves at that price follow. Every descent gets a first round
        of tree moves; only the ``KEEP`` best after it get the rest (module docstring).
        ``heaviest_only``: the op-weight order alone."""
        red = self.red
        cost = [c + lam * m for c, m in zip(red.cost, red.memory)]
        moves = cost if improve_at is None else \
            [c + improve_at * m for c, m in zip(red.cost, red.memory)]
        starts = [tuple(self._walk(cost, order, levels))
                  for levels in self.level_orders
                  for order in self.orders[:1 if heaviest_only else None]]
        first: dict = {}        # descents that end alike are improved once (it is exact)
        for start in starts:
            if start not in first:
                first[start] = self._improve(cost, moves, start, range(FIRST))
        flat_moves = self.flat.costs(moves)
        ends = {tuple(f[-1][0]): start for start, f in first.items()}   # alike ends once
        ranked = sorted(ends, key=lambda e: self.flat.objective(flat_moves, e))
        for end in ranked[:KEEP]:
            start = ends[end]
            done = self._improve(cost, moves, start, range(FIRST, ROUNDS * TREES),
                                 first[start])
            for s, f in first.items():
                if tuple(f[-1][0]) == end:
                    first[s] = done
        return [[first[s][-1][0][c] for c in red.cls] for s in starts]

    def _improve(self, cost, moves, start, forests, before=None) -> list:
        """[(choice, settled, gained)] after the tree moves of ``forests`` at ``cost``
        (then at ``moves`` where it is another price), continuing ``before`` (an earlier
        call's answer, whose forests came just before)."""
        red, flat = self.red, self.flat
        out = []
        for k, price in enumerate([cost] if moves is cost else [cost, moves]):
            if before is None:
                out.append(improve_rounds(red, price, out[-1][0] if out else start,
                                          flat=flat, forests=forests))
            elif k and not before[k - 1][1]:
                # the first price moved on: the second starts again from its answer
                out.append(improve_rounds(red, price, out[-1][0], flat=flat))
            elif not before[k][1]:
                out.append(improve_rounds(red, price, before[k][0], flat=flat,
                                          forests=forests, gained=before[k][2]))
            else:
                out.append(before[k])
        return out

    def _walk(self, cost, order, levels) -> list:
        """The descent's choice per class before the tree moves."""
        mask = [np.isfinite(c) for c in cost]
        seen = _Seen(len(mask), self.neighbours)
        for groups in levels:
            before = [m.copy() for m in mask]
            # a class with one group open keeps its candidates: nothing to price
            one = [_one_group(groups[c][before[c]]) for c in range(len(mask))]
            open_groups = [None if g is not None else _Open(groups[c], before[c])
                           for c, g in enumerate(one)]
            chosen = list(one)
            for c in order:                         # first pass: heaviest first
                if one[c] is None:
                    chosen[c] = self._best(c, cost, mask, open_groups, seen=seen)
                    mask[c] = before[c] & (groups[c] == chosen[c])
                    seen.moved(c)
            for _ in range(SWEEPS):                 # re-pick given every neighbour
                changed = False
                for c in order:
                    # a class none of whose neighbours moved since it picked picks
                    # the same group again (its prices are those it picked by)
                    if one[c] is not None or seen.picked[c] >= seen.last[c]:
                        continue
                    g = self._best(c, cost, mask, open_groups, chosen[c], seen)
                    if g != chosen[c]:
                        chosen[c] = g
                        mask[c] = before[c] & (groups[c] == g)
                        seen.moved(c)
                        changed = True
                if not changed:
                    break
        return [int(np.flatnonzero(m)[0]) for m in mask]

    def _best(self, c, cost, mask, open_groups, current=None, seen=None) -> int:
        """The group of class ``c`` (among those open to it: ``open_groups[c]``, an
        :class:`_Open`) of least price given its neighbours' candidates (``mask``);
        ``current`` wins ties. ``seen``: the walk's :class:`_Seen`, whose edge prices
        are reused."""
        at = open_groups[c]
        price = self.prices(c, cost, mask, seen=seen)
        if seen is not None:
            seen.picked[c] = seen.clock
        per_group = at.least(price)
        least = per_group.min()
        bar = least + TIE * abs(least)      # (reduced costs may be negative)
        if current is not None and per_group[current] <= bar:
            return int(current)
        # ties (a candidate's best completions cost alike) go to the candidate whose
        # neighbours' open layouts cost least on average: the safer bet
        tied = np.flatnonzero(per_group <= bar)
        if len(tied) == 1:
            return int(tied[0])
        second = at.least(self.prices(c, cost, mask, with_mean=True, seen=seen)[1])
        return int(tied[np.argmin(second[tied])])

    def prices(self, c, cost, mask, with_mean=False, seen=None):
        """Per strategy of class ``c``: its cost plus, per edge, the cheapest reshard to
        a layout the neighbour may take (``mask``); with ``with_mean`` also the mean.
        ``seen``: a :class:`_Seen` of ``mask``'s changes, whose per-edge prices are
        reused while the neighbour's candidates stay."""
        price = cost[c].copy()
        mean = cost[c].copy() if with_mean else None
        for k, (pair, safe, is_u) in enumerate(self.around[c]):
            other = pair.v if is_u else pair.u
            key = (c, k, seen.version[other]) if seen is not None else None
            got = seen.edge.get(key) if key is not None else None
            if got is None or (with_mean and got[1] is None):
                # the prices depend on the far end's candidates alone (not on lam or
                # the walk): kept for every walk of this problem
                at = (self, c, k, mask[other].tobytes())
                got = self.edges.find(at)
                if got is None or (with_mean and got[1] is None):
                    got = self.edges[at] = _edge_prices(pair, safe, is_u, mask[other],
                                                        with_mean)
                if key is not None:
                    seen.edge[key] = got
            price += got[0]
            if with_mean:
                mean += got[1]
        return (price, mean) if with_mean else price


def _one_group(open_groups) -> int | None:
    """The group of ``open_groups`` (the groups of a class's open strategies) where they
    are all one, else None."""
    if len(open_groups) and (open_groups == open_groups[0]).all():
        return int(open_groups[0])
    return None


class _Open:
    """A class's open strategies at a level, by group: :meth:`least` gives each group's
    least price among them (inf where none is open), as ``np.minimum.at`` over them."""

    def __init__(self, groups, open_):
        at = np.flatnonzero(open_)
        self.size = int(groups.max()) + 1
        if not len(at):
            self.members = self.starts = self.present = at
            return
        order = np.argsort(groups[at], kind="stable")
        self.members = at[order]
        grouped = groups[at][order]
        self.starts = np.flatnonzero(np.r_[True, grouped[1:] != grouped[:-1]])
        self.present = grouped[self.starts]

    def least(self, price) -> np.ndarray:
        out = np.full(self.size, np.inf)
        if len(self.members):
            out[self.present] = np.minimum.reduceat(price[self.members], self.starts)
        return out


class _Seen:
    """A walk's memo of edge prices: per class a version, raised when its candidates
    change, and the prices of an edge per version of its far end; per class, when it
    last picked and when a neighbour (``neighbours``: per class, the classes it shares
    a pair with) last moved, on one clock of moves."""

    def __init__(self, n: int, neighbours):
        self.version = [0] * n
        self.edge: dict = {}
        self.neighbours = neighbours
        self.clock = 0
        self.picked = [-1] * n
        self.last = [0] * n

    def moved(self, c: int):
        self.version[c] += 1
        self.clock += 1
        for other in self.neighbours[c]:
            self.last[other] = self.clock


def _edge_prices(pair, safe, is_u, open_, with_mean) -> tuple:
    """(per strategy of the near end: the cheapest reshard to a layout ``open_`` leaves
    the far end, the mean of those or None)."""
    if is_u:
        other = np.zeros(safe.shape[1], bool)
        other[pair.cols[open_]] = True
        sub = safe[:, other] if other.any() else np.full((safe.shape[0], 1), np.inf)
        return sub.min(axis=1)[pair.rows], sub.mean(axis=1)[pair.rows] if with_mean else None
    other = np.zeros(safe.shape[0], bool)
    other[pair.rows[open_]] = True
    sub = safe[other, :] if other.any() else np.full((1, safe.shape[1]), np.inf)
    return sub.min(axis=0)[pair.cols], sub.mean(axis=0)[pair.cols] if with_mean else None
