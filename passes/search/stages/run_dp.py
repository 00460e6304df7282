"""Alpa's stage DP (:mod:`distgraph.passes.search.stages.stage_dp`) for layers that are runs of
identical blocks: the same recurrence and the same answer, in time linear in the layers.

With ``E``, identical blocks and ``H`` as the layers (:mod:`distgraph.passes.search.
runs`), a stage's time and memory depend on how many blocks it holds and whether it
holds E and H, not on where the blocks sit. For a time cap and ``s`` stages from here
on, an option can take at most ``w`` blocks (its time within the cap and its memory,
with ``s`` micro-batches in flight, within the device's), so

    F(s, k, d) = min over options o of  min_{k < j <= k + w} ( j t_o + F(s-1, j, d - size_o) ) - k t_o

for a stage of blocks only: a sliding-window minimum over the stage's end ``j``, taken
for every device count ``d`` at once (by doubling: about log2 w elementwise minima of
whole tables). Stages with E or H are single terms. The tables keep one axis per device
mesh, so taking an option's devices is a view, not a copy; how many blocks an option
may hold is computed per cap for every stage count at once. Device counts are kept
in units of the greatest common divisor of the option sizes on each device mesh. The
caps are bisected as in :class:`~distgraph.passes.search.stages.stage_dp._Search`, and the
objective ``sum t + (B - 1) max t`` is the same; :func:`plan_runs` equals
:func:`~distgraph.passes.search.stages.stage_dp.plan_stages` given the same costs and the
brute-force optimum (tests/test_run_dp.py), and its plans on a fixed corpus are pinned
(tests/test_search_pinned.py).

Example::

    plan, chosen = plan_runs(count, blocks, options, cluster, micro_batches=8)
"""

from __future__ import annotations

import math

import numpy as np

from distgraph.errors import PlanError
from distgraph.passes.cost.stage import flights, transfers
from distgraph.passes.search.stages.stage_dp import _place, _Search


class _Run:
    """An option as the DP sees it: its costs per (E?, blocks, H?) and its range costs."""

    def __init__(self, option, count, blocks, limit, unit, p2p=0.0):
        self.option, self.axis, self.sub = option, option.axis, option.sub
        self.size = option.sub.size // unit
        self.count, self.blocks, self.limit = count, blocks, limit
        n = len(blocks)
        self.table = {}
        for first in ((False, True) if blocks.start else (False,)):
            for last in ((False, True) if blocks.stop < count else (False,)):
                # (n+1, 5): cost(first, m, last); the option's own, read-only
                table = option.costs(first, n, last).copy()
                # the boundaries' transfers: a stage holding E (H) has no stage before
                # (after) it and pays half of a middle stage's (module docstring)
                table[:, 0] += transfers(p2p, first, last)
                self.table[first, last] = table

    def at(self, k: int, i: int) -> tuple:
        first, last = k < self.blocks.start, i >= self.blocks.stop
        m = len(range(max(k, self.blocks.start), min(i + 1, self.blocks.stop)))
        return tuple(float(x) for x in self.table[first, last][m])

    def reach(self, stages: int, cap: float, micro_batches: int | None = None,
              memory: dict | None = None, schedule: str = "1F1B") -> dict:
        """{(E?, H?): the most blocks such a stage may hold within ``cap`` with ``s``
        stages from it to the last, at index ``s`` for s = 0 .. ``stages``} (-1: none):
        ``schedule`` keeps :func:`~distgraph.passes.cost.stage.flights` micro-batches in
        flight there (1F1B ``min(s, micro_batches)``). ``memory``: :meth:`memory_reach`
        of these stages and micro-batches, where the caller has it."""
        out = {}
        memory = self.memory_reach(stages, micro_batches, schedule) if memory is None \
            else memory
        for (first, last), t in self.table.items():
            # costs grow with the blocks: the feasible counts are a prefix (from 0 or 1);
            # the first count over the cap or over the memory ends it
            start = 0 if (first or last) else 1
            slow = ~(t[start:, 0] <= cap)
            over = int(slow.argmax()) if slow.any() else len(t) - start
            top = np.minimum(memory[first, last], over) + start - 1
            out[first, last] = np.where(top >= start, top, -1)
        return out

    def memory_reach(self, stages: int, micro_batches, schedule: str = "1F1B") -> dict:
        """{(E?, H?): at index s, the position (from the first count :meth:`reach`
        counts) of the first block count over the memory with s stages to the last}:
        the same whatever the cap (a search finds it once per option)."""
        out = {}
        s = flights(schedule, micro_batches, stages)[:, None] if micro_batches else \
            np.arange(0, stages + 1)[:, None]
        # holding every micro-batch, all forwards run first (terms.held)
        every = s >= micro_batches if micro_batches else np.zeros_like(s, dtype=bool)
        for (first, last), t in self.table.items():
            start = 0 if (first or last) else 1
            one = np.where(every, t[:, 3], t[:, 1])
            bad = ~(one + (s - 1) * t[:, 2] <= self.limit)[:, start:]
            out[first, last] = np.where(bad.any(axis=1), bad.argmax(axis=1), len(t) - start)
        return out


class _RunSearch(_Search):
    """The DP of the module docstring (same bisection over caps as the generic one).
    The tables keep the device counts as axes (``(L + 1,) + dims``): a stage of ``size``
    units on mesh ``a`` reads the previous table shifted by ``size`` along axis ``1 + a``,
    a view, and the stages' windows are running minima (van Herk / Gil-Werman)."""

    def __init__(self, count, blocks, runs, capacities, B, schedule="1F1B"):
        self.L, self.blocks, self.B = count, blocks, B
        self.options = _undominated(runs)
        self.caps = capacities
        self.dims = tuple(c + 1 for c in capacities)
        self.max_stages = min(count, sum(capacities))
        self.runs = 0
        # the caps of every option, dominated ones included: the bisection visits the
        # caps it visited before they were pruned, so it returns the same plan
        times = np.concatenate([r.table[key][:, 0] for r in runs for key in r.table])
        self.caps_sorted = np.unique(times[np.isfinite(times)])
        # what every cap reads of the options, found once: the memory's reach, the pairs
        # of options as fast as each other (_live), what _relax reads of each (_fixed),
        # and the least cost of the stages before a table's entries (_prefix_bound)
        self._memory = [r.memory_reach(self.max_stages, B, schedule) for r in self.options]
        N = len(self.options)
        below = np.zeros((N, N), dtype=bool)
        for n, others in enumerate(_faster_pairs(self.options)):
            below[n, list(others)] = True
        self._pairs = (below, np.tri(N, k=-1, dtype=bool))
        self._fixed = {id(r): self._prepared(r, 1 + len(self.dims)) for r in self.options}
        self._prefix = self._prefix_bound()

    def solve_cap(self, cap: float):
        self.runs += 1
        F = np.full((self.L + 1,) + self.dims, np.inf)
        F[(self.L,) + (0,) * len(self.dims)] = 0.0
        full = (0,) + tuple(self.caps)
        reach = [r.reach(self.max_stages, cap, self.B, m)
                 for r, m in zip(self.options, self._memory)]
        keys = list(self.options[0].table) if self.options else []
        # reach as one array: (options, stages + 1, keys), (False, False) first
        most = np.stack([np.stack([v[key] for key in keys], axis=1) for v in reach])
        tables, best, best_s = [F], math.inf, None
        density = self._densities(most, keys)
        box, reached, live, bounded = _finite_box(F), None, None, None
        for s in range(1, self.max_stages + 1):
            G = np.full_like(F, np.inf)
            # the options live at s, found again only where their reaches changed
            if reached is None or not np.array_equal(most[:, s], reached):
                reached, live = most[:, s], self._live(most, keys, s)
            for n in live:
                self._relax(G, F, self.options[n], dict(zip(keys, most[n][s].tolist())), s,
                            box)
            tables.append(G)
            F, box = G, _finite_box(G)
            if G[full] < best:
                best, best_s = float(G[full]), s
            if box is None:                     # no finite entry
                break
            # a plan of more stages ends in s of them (an entry of G at k >= 1) after a
            # prefix that fits the units left and costs no less than _prefix_bound's
            # bound: where none beats ``best`` (or none can be made), no longer plan does
            row = density[min(s + 1, self.max_stages)]
            if bounded is None or not np.array_equal(row, bounded[0]):
                bounded = (row, self.extension(row))    # density changes now and then
            if self.longer_bound(G, bounded[1]) >= best:
                break
        self.levels = len(tables) - 1           # the stage counts tabled (tests read it)
        if best_s is None:
            return math.inf, None
        return best, self._walk(tables, best_s, most, keys)

    def _densities(self, most, keys) -> np.ndarray:
        """[s, a]: the most layers per unit a stage on device mesh a may hold with s
        stages from it to the last (one holding E: E and its blocks), over the options
        (``most``: their reach at the cap, as :meth:`solve_cap` keeps it); it only falls
        as s grows (more micro-batches in flight)."""
        out = np.zeros((self.max_stages + 1, len(self.dims)))
        plain = keys.index((False, False)) if (False, False) in keys else None
        first = keys.index((True, False)) if (True, False) in keys else None
        for r, m in zip(self.options, most):
            layers = np.zeros(len(m))
            if plain is not None:
                layers = np.maximum(layers, m[:, plain])
            if first is not None:
                layers = np.maximum(layers, np.where(m[:, first] >= 0, m[:, first] + 1, 0))
            out[:, r.axis] = np.maximum(out[:, r.axis], layers / r.size)
        return out

    def extension(self, density) -> np.ndarray:
        """P[k - 1, d] for k >= 1 (:meth:`_prefix_bound`) where layers 0..k-1 fit the units
        ``caps - d`` left, which hold at most ``sum_a (caps_a - d_a) density_a`` layers
        (``density``: :meth:`_densities` at s + 1, a stage that far from the last holding
        no more), inf elsewhere: G + that is G + P or inf (G and P are >= 0 or inf, never
        nan), so the least is the same."""
        shape = (1,) * len(self.dims)
        room = np.zeros(self.dims)
        for a, c in enumerate(self.caps):
            left = c - np.arange(self.dims[a])
            room = room + (left * density[a]).reshape(shape[:a] + (-1,) + shape[a + 1:])
        k = np.arange(1, self.L + 1).reshape((-1,) + shape)
        return np.where(k <= room[None] + 1e-9, self._prefix[1:], np.inf)

    def longer_bound(self, G, extension) -> float:
        """A lower bound on the summed time of every plan of more stages than ``G``'s
        (the table of s stages): its last s stages are an entry G[k, d] (k >= 1), its
        first ones cover layers 0..k-1 with the units ``caps - d`` left, at a cost no less
        than ``extension`` there (:meth:`extension` of the density at s + 1); inf where
        no entry can be so extended."""
        # over the box of G's finite entries alone (elsewhere G + P is inf), rows k >= 1
        box = _finite_box(G)
        if box is None or box[0][1] < 1:
            return math.inf
        at = tuple(slice(a, b + 1) for a, b in box[1:])
        rows = slice(max(box[0][0], 1), box[0][1] + 1)
        return float((G[(rows,) + at] + extension[(slice(rows.start - 1, rows.stop - 1),)
                                                  + at]).min())

    def _prefix_bound(self) -> np.ndarray:
        """P[k, d]: a lower bound on the summed time of any stages (one or more) that
        cover layers 0 .. k-1 with the units the table's ``d`` leaves (``caps - d`` per
        device mesh), inf where no option fits them; P[0] is inf (no prefix). Such a
        prefix holds no H (a table entry's stages cover the last layer); each of its
        stages on an option o of blocks only costs at least ``m beta_o`` for its m
        blocks (``beta_o``: o's least seconds per block over its stage lengths), the one
        holding E at least ``e + m beta`` (``e``: the least ``T_o(E, m) - m beta`` there),
        ``beta`` the least ``beta_o`` of the options that fit. So a plan of more than s
        stages sums to at least ``min_k,d (F(s, k, d) + P[k, d])`` (:meth:`solve_cap`
        stops when that is no less than its best). Made once per search, whatever the cap."""
        b0, b1, L = self.blocks.start, self.blocks.stop, self.L
        grid = np.full(self.dims, np.inf)       # beta over what the prefix may use
        fits = np.zeros(self.dims, dtype=bool)
        for r in self.options:
            t = r.table[False, False][1:, 0] / np.arange(1, b1 - b0 + 1) \
                if (False, False) in r.table and b1 > b0 else np.empty(0)
            beta = float(t[np.isfinite(t)].min()) if np.isfinite(t).any() else math.inf
            room = self._room(r)
            fits |= room
            grid = np.where(room, np.minimum(grid, beta), grid)
        # where every option that fits costs inf per block, 0 is still a lower bound
        grid = np.where(fits & ~np.isfinite(grid), 0.0, grid)
        first = np.full(self.dims, np.inf)
        if b0 > 0:
            for r in self.options:
                if (True, False) not in r.table:
                    continue
                times = r.table[True, False][:, 0]
                m = np.arange(len(times)).reshape((-1,) + (1,) * len(self.dims))
                with np.errstate(invalid="ignore"):     # 0 x inf where r has no room
                    low = np.where(np.isfinite(times).reshape(m.shape),
                                   times.reshape(m.shape) - m * grid[None],
                                   np.inf).min(axis=0)
                first = np.where(self._room(r), np.minimum(first, low), first)
        k = np.arange(L + 1).reshape((-1,) + (1,) * len(self.dims))
        blocks = np.clip(np.minimum(k, b1) - b0, 0, None)
        with np.errstate(invalid="ignore"):
            out = blocks * grid[None] + (first[None] if b0 > 0 else 0.0)
        out = np.where(fits[None] & ~np.isnan(out), out, np.inf)
        out[0] = np.inf
        return out

    def _room(self, r) -> np.ndarray:
        """Over the table's device counts d: whether the units ``caps - d`` left before
        them hold a stage of option ``r``."""
        shape = [1] * len(self.dims)
        shape[r.axis] = self.dims[r.axis]
        left = self.caps[r.axis] - np.arange(self.dims[r.axis]).reshape(shape)
        return np.broadcast_to(left >= r.size, self.dims)

    def _live(self, most, keys, s) -> list:
        """The options that may lower a table entry with ``s`` micro-batches in flight:
        some stage of theirs fits, and no option of the same mesh and size that is as
        fast at every length reaches as far in every kind of stage (its stages, then,
        cost no more from every start: dropping the slower one leaves the table as it
        is). Of two alike options the first is kept. Over all pairs at once (``most``:
        the options' reaches, (options, stages + 1, keys)); :meth:`solve_cap` asks again
        only where the reaches changed (they change with s only now and then)."""
        w = most[:, s]                                          # (options, keys)
        blocks = keys.index((False, False))
        fits = (w[:, blocks] >= 1) | (np.delete(w, blocks, axis=1) >= 0).any(axis=1)
        # [n, o]: whether o is in _faster_pairs' set of n, whether o < n
        below, earlier = self._pairs
        reaches = (w[None, :, :] >= w[:, None, :]).all(axis=2)     # [n, o]: o's >= n's
        # [n, o]: o drops n: o fits, is as fast, reaches as far, and is earlier or not
        # itself dropped by n (as fast as n and reached as far by it)
        drops = below & fits[None, :] & reaches & (earlier | ~(below.T & reaches.T))
        return np.flatnonzero(fits & ~drops.any(axis=1)).tolist()

    def _relax(self, G, F, r, most, s: int, box=None) -> None:
        """G[k] = min(G[k], the best stage of option r starting at k, then F), ``s``
        stages from k on: ``H`` is F with r's units taken (a view), ``Gv`` the part of G
        with room for them. Only starts k <= L - s can begin s stages (one layer or more
        each), and only F's rows up to L - s + 1 are finite; a stage holding H is the
        last (s = 1). ``box`` (:func:`_finite_box` of F) bounds F's finite entries: the
        sums and minima are taken over it alone (outside it every term is inf and lowers
        nothing), the same terms added in the same order, so G is the same."""
        b0, b1, L = self.blocks.start, self.blocks.stop, self.L
        if r.size >= self.dims[r.axis]:
            return
        src, dst, ramp, start, last, first = self._fixed[id(r)]
        H, Gv = F[src], G[dst]
        lo, hi = 0, L
        if box is not None:
            (lo, hi), cols = box[0], [slice(a, b + 1) for a, b in box[1:]]
            if any(c.start >= n for c, n in zip(cols, H.shape[1:])):
                return                              # no finite column with room for r
            H, Gv = H[(slice(None),) + tuple(cols)], Gv[(slice(None),) + tuple(cols)]
        w = most[False, False]
        top = min(b1, L - s + 1, hi)                # the last end j of a finite F row
        if w >= 1 and top > b0:                     # blocks only: k..j-1 in [b0, b1)
            ka = max(b0, min(lo, top) - w)          # ends before lo: inf; starts before
            window = _window_min(ramp[ka - b0:top - b0] + H[ka + 1:top + 1], w)
            window -= start[ka - b0:top - b0]       # ka reach no finite end
            np.minimum(Gv[ka:top], window, out=Gv[ka:top])
        if b1 < L and s == 1:                       # blocks k..b1-1, then H
            w = most[False, True]
            if w >= 0:
                k0 = max(b0, b1 - w)
                np.minimum(Gv[k0:b1 + 1], last[k0 - b0:] + H[L], out=Gv[k0:b1 + 1])
        if b0 > 0:                                  # E, blocks b0..i
            w = most[True, False]
            m0, m = max(0, lo - b0), min(w, b1 - b0, hi - b0)
            if w >= 0 and m0 <= m:
                np.minimum(Gv[0], (first[m0:m + 1] + H[b0 + m0:b0 + m + 1]).min(axis=0),
                           out=Gv[0])
            if b1 < L and s == 1 and most[True, True] >= b1 - b0:
                np.minimum(Gv[0], r.table[True, True][b1 - b0, 0] + H[L], out=Gv[0])

    def _prepared(self, r, ndim: int) -> tuple:
        """What :meth:`_relax` reads of option ``r`` whatever the cap and stage count:
        the table views' slices, and as vectors along the layers, a blocks-only stage's
        ``j tb`` at its end j and ``k tb - fixed`` at its start k (m blocks cost m tb plus
        the transfers' share, the table's row 0), the times of blocks k..b1-1 with H
        for k = b0 .. b1, those of E with 0, 1 .. blocks."""
        b0, b1 = self.blocks.start, self.blocks.stop
        axis, n = 1 + r.axis, self.dims[r.axis]
        src, dst = [slice(None)] * ndim, [slice(None)] * ndim
        src[axis], dst[axis] = slice(0, n - r.size), slice(r.size, None)
        col = (-1,) + (1,) * (ndim - 1)
        ramp = start = last = first = None
        if (False, False) in r.table and b1 > b0:
            table = r.table[False, False]
            fixed, tb = table[0, 0], table[1, 0] - table[0, 0]
            ramp = np.arange(b0 + 1, b1 + 1).reshape(col) * tb
            start = np.arange(b0, b1).reshape(col) * tb - fixed
        if (False, True) in r.table:
            last = r.table[False, True][b1 - np.arange(b0, b1 + 1), 0].reshape(col)
        if (True, False) in r.table:
            first = r.table[True, False][:, 0].reshape(col)
        return tuple(src), tuple(dst), ramp, start, last, first

    def _walk(self, tables, s, most, keys):
        """The stages of the best plan in ``s`` stages, recomputed from the tables: at
        each start the first (option, end) in order that reaches the least total
        (``most``: the options' reach at the cap, stacked as :meth:`solve_cap` keeps
        them). Each option's times are :meth:`_Run.times`', for all options at once."""
        stages, k, state = [], 0, list(self.caps)
        runs = self.options
        axes = np.array([r.axis for r in runs])
        sizes = np.array([r.size for r in runs])
        times = {key: np.stack([r.table[key][:, 0] for r in runs]) for key in keys}
        b0, b1 = self.blocks.start, self.blocks.stop
        rows = np.arange(len(runs))[:, None]
        while s:
            prev = tables[s - 1]
            room = np.array(state)[axes] >= sizes
            after = np.array(state)[:, None] - np.where(
                np.arange(len(state))[:, None] == axes[None, :], sizes[None, :], 0)
            rest = prev[(slice(k + 1, None),) + tuple(np.where(room, after, 0))].T
            i = np.arange(k, self.L)
            first = k < b0
            m = np.maximum(np.minimum(i + 1, b1) - max(k, b0), 0)
            value = np.full(rest.shape, np.inf)
            for last in (False, True):
                here = (i >= b1) == last
                if not here.any():
                    continue
                reach = most[:, s, keys.index((first, last))][:, None]
                ok = room[:, None] & here & (m <= reach) & ((m >= 1) | first | last)
                t = np.broadcast_to(times[first, last][rows, m], ok.shape)
                value[ok] = t[ok] + rest[ok]
            least = value.min(axis=1)
            if not np.isfinite(least).any():
                raise PlanError("the stage DP found a plan but could not retrace it")
            n = int(np.argmin(least))               # the first option of the least
            i = k + int(np.argmin(value[n]))
            stages.append((k, i, n))
            state[runs[n].axis] -= runs[n].size
            k, s = i + 1, s - 1
        return stages



def _undominated(runs: list) -> list:
    """``runs`` without those an earlier one of the same device mesh and size matches or
    beats in every time and memory figure: the DP's tables are the same without them,
    and its retrace, which keeps the first option of the least total, never took them."""
    kept = []
    for r in runs:
        if not any(o.axis == r.axis and o.size == r.size and
                   all((o.table[key][:, :4] <= r.table[key][:, :4]).all()
                       for key in r.table)
                   for o in kept):
            kept.append(r)
    return kept


def _faster_pairs(runs: list) -> list:
    """For each of ``runs``, the indices of the others of the same device mesh and size
    whose every stage is as fast (every time of their tables no greater)."""
    out = []
    for n, r in enumerate(runs):
        out.append({o for o, q in enumerate(runs) if o != n and q.axis == r.axis and
                    q.size == r.size and all((q.table[key][:, 0] <= r.table[key][:, 0]).all()
                                             for key in r.table)})
    return out


def _finite_box(F: np.ndarray) -> list | None:
    """[(first, last) index of F's finite entries along each axis], None where none is."""
    finite = np.isfinite(F)
    out = []
    for axis in range(F.ndim):
        at = np.flatnonzero(finite.any(axis=tuple(a for a in range(F.ndim) if a != axis)))
        if at.size == 0:
            return None
        out.append((int(at[0]), int(at[-1])))
    return out


def _window_min(A: np.ndarray, w: int) -> np.ndarray:
    """out[q] = min(A[q : q + w]) along axis 0 (the window cut at the end), by doubling:
    minima over 1, 2, 4 .. p <= w rows, then two overlapping windows of p rows. ``A``
    is overwritten and returned."""
    n = A.shape[0]
    w = min(w, n)
    p = 1
    while p < w:
        step = min(p, w - p)        # p, 2p, 4p .. then the last, overlapping step
        # in place: numpy reads the overlapping rows as they were before the call
        np.minimum(A[:n - step], A[step:], out=A[:n - step])
        p += step
    return A


def plan_runs(count: int, blocks: range, options: list, cluster,
              micro_batches: int = 1, fit_memory: bool = True, p2p=None,
              below: float = math.inf, schedule: str = "1F1B") -> tuple | None:
    """(StagePlan, the option of each stage): stages of ``count`` layers whose
    ``blocks`` are identical, on ``options`` (:class:`~distgraph.passes.search.stages.runs.
    RunOption`, each with ``cost(first, blocks, last)`` and ``costs``) of ``cluster``'s
    device meshes;
    see the module docstring. Without ``fit_memory`` the devices' memory is not a
    limit (a lower bound on the latency of options that only save memory).
    ``p2p(option)``: seconds per micro-batch a stage of the option between two others
    spends on the transfers to and from them (None: not priced); ``below``: only a plan
    of objective below it, None where there is none (its caps pruned from the start);
    ``schedule``: whose micro-batches in flight a stage holds
    (:func:`~distgraph.passes.cost.stage.in_flight`)."""
    runs, search = _setup(count, blocks, options, cluster, micro_batches, fit_memory, p2p,
                          schedule)
    devices = sum(m.size for m in cluster.device_meshes)
    best = None if _bound(runs, search, devices) >= below else search.run(below=below)
    if best is None and math.isfinite(below):
        return None
    if best is None:
        raise PlanError(f"no split of {count} layers ({len(blocks)} identical blocks) into "
                        f"stages fits the devices' memory (with the activations {schedule} "
                        f"keeps in flight) while covering every device; use devices with more "
                        f"memory, recomputation (Strategy(recompute=True)), or fewer "
                        f"micro-batches in flight")
    runs = search.options
    plan = _place([(k, i, runs[n]) for k, i, n in best], list(cluster.device_meshes),
                  micro_batches, search.runs, schedule)
    return plan, tuple(runs[n].option for _, _, n in best)


def beats(latency: float, count: int, blocks: range, options: list, cluster,
          micro_batches: int = 1, fit_memory: bool = True, p2p=None,
          schedule: str = "1F1B") -> bool:
    """Whether :func:`plan_runs` with these arguments would find a plan of objective
    below ``latency`` (False where it finds none): the same search, its caps pruned by
    ``latency`` from the start, so it solves fewer of them.

    Example::

        plan, _ = plan_runs(count, blocks, options, cluster, 8)
        beats(plan.objective, count, blocks, options, cluster, 8, fit_memory=False)
    """
    runs, search = _setup(count, blocks, options, cluster, micro_batches, fit_memory, p2p,
                          schedule)
    devices = sum(m.size for m in cluster.device_meshes)
    return _bound(runs, search, devices) < latency and \
        search.run(below=latency) is not None


def _bound(runs: list, search, devices: int) -> float:
    """A lower bound on the objective of any plan of ``runs`` on ``devices`` devices,
    without the DP: the stages cover every device, so the slowest takes at least the
    least device-seconds the layers need spread over all of them, ``W / N``; their
    times sum to at least each layer's least time; the objective is then at least
    ``max(sum, W / N) + (B - 1) W / N``. Only options where a stage of the layer fits the
    memory with one micro-batch in flight (the less of terms.held's two counts of it) count
    (inf where a layer fits nowhere)."""
    b0, b1, L = search.blocks.start, search.blocks.stop, search.L
    parts = [((False, 1, False), b1 - b0)] + ([((True, 0, False), 1)] if b0 else []) + \
        ([((False, 0, True), 1)] if b1 < L else [])
    least_time = least_work = 0.0
    for where, n in parts:
        fits = [(price.seconds, price.seconds * r.option.sub.size) for r in runs
                for price in [r.option.cost(*where)] if min(price.one, price.before) <= r.limit]
        if not fits:
            return math.inf
        least_time += n * min(f[0] for f in fits)
        least_work += n * min(f[1] for f in fits)
    slowest = least_work / devices
    return max(least_time, slowest) + (search.B - 1) * slowest


def _setup(count, blocks, options, cluster, micro_batches, fit_memory, p2p=None,
           schedule="1F1B") -> tuple:
    """(the options as the DP sees them, the search): device counts in units of the
    greatest common divisor of the option sizes on each mesh."""
    units, capacities, limits = [], [], []
    for axis, mesh in enumerate(cluster.device_meshes):
        sizes = [o.sub.size for o in options if o.axis == axis]
        unit = math.gcd(*sizes, mesh.size) if sizes else mesh.size
        units.append(unit)
        capacities.append(mesh.size // unit)
        limits.append(min(cluster.device(i).usable_memory() for i in mesh.ids) if fit_memory
                      else math.inf)
    runs = [_Run(o, count, blocks, limits[o.axis], units[o.axis],
                 p2p(o) if p2p is not None else 0.0) for o in options]
    return runs, _RunSearch(count, blocks, runs, capacities, micro_batches, schedule)
