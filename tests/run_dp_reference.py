"""The stage DP for runs of identical blocks as it was before it was vectorised
(passes/search/run_dp.py at 0d97f02: a sliding-window minimum per option and a Python
walk): the oracle that tests/test_run_dp.py holds the fast DP to, plan for plan."""

from __future__ import annotations

import math

import numpy as np

from distgraph.errors import PlanError
from distgraph.passes.search.stage_dp import _place, _Search, _shift


class _Run:
    """An option as the DP sees it: its costs per (E?, blocks, H?) and its range costs."""

    def __init__(self, option, count, blocks, limit, unit):
        self.option, self.axis, self.sub = option, option.axis, option.sub
        self.size = option.sub.size // unit
        self.count, self.blocks, self.limit = count, blocks, limit
        n = len(blocks)
        self.table = {}
        for first in ((False, True) if blocks.start else (False,)):
            for last in ((False, True) if blocks.stop < count else (False,)):
                rows = [option.cost(first, m, last) for m in range(n + 1)]
                self.table[first, last] = np.array(rows, dtype=float)    # (n+1, 3)

    def at(self, k: int, i: int) -> tuple:
        first, last = k < self.blocks.start, i >= self.blocks.stop
        m = len(range(max(k, self.blocks.start), min(i + 1, self.blocks.stop)))
        return tuple(float(x) for x in self.table[first, last][m])

    def fits(self, k: int, i: int, s: int, cap: float) -> bool:
        """Whether layers k..i fit here within ``cap`` with ``s`` micro-batches in flight."""
        first, last = k < self.blocks.start, i >= self.blocks.stop
        m = len(range(max(k, self.blocks.start), min(i + 1, self.blocks.stop)))
        return (m >= 1 or first or last) and m <= self.most(first, last, s, cap)

    def most(self, first: bool, last: bool, s: int, cap: float) -> int:
        """The most blocks a stage with (E?, H?) may hold here within ``cap`` and the
        memory of ``s`` micro-batches in flight; -1 when none (not even 0) fits."""
        t = self.table[first, last]
        ok = (t[:, 0] <= cap) & (t[:, 1] + (s - 1) * t[:, 2] <= self.limit)
        if not (first or last):
            ok[0] = False                # a stage holds at least one layer
        bad = np.flatnonzero(~ok)
        # costs grow with the blocks: the feasible counts are a prefix (from 0 or 1)
        start = 0 if (first or last) else 1
        after = bad[bad >= start]
        top = (after[0] if after.size else len(t)) - 1
        return top if top >= start else -1


class _RunSearch(_Search):
    """The DP of the module docstring (same bisection over caps as the generic one)."""

    def __init__(self, count, blocks, runs, capacities, B):
        self.L, self.blocks, self.options, self.B = count, blocks, runs, B
        self.caps = capacities
        self.dims = tuple(c + 1 for c in capacities)
        self.max_stages = min(count, sum(capacities))
        self.runs = 0
        times = np.concatenate([r.table[key][:, 0] for r in runs for key in r.table])
        self.caps_sorted = np.unique(times[np.isfinite(times)])

    def solve_cap(self, cap: float):
        self.runs += 1
        L, R = self.L, math.prod(self.dims)
        F = np.full((L + 1, R), np.inf)
        F[L, 0] = 0.0
        full = np.ravel_multi_index(tuple(self.caps), self.dims)
        tables, best, best_s = [F], math.inf, None
        for s in range(1, self.max_stages + 1):
            G = np.full((L + 1, R), np.inf)
            prev = F.reshape((L + 1,) + self.dims)
            for r in self.options:
                H = _shift(prev, 1 + r.axis, r.size).reshape(L + 1, R)
                self._relax(G, H, r, s, cap)
            tables.append(G)
            F = G
            if G[0, full] < best:
                best, best_s = float(G[0, full]), s
            if not np.isfinite(G).any():
                break
        if best_s is None:
            return math.inf, None
        return best, self._walk(tables, best_s, cap)

    def _relax(self, G, H, r, s, cap) -> None:
        """G[k] = min(G[k], the best stage of option r starting at k, then H)."""
        b0, b1, L = self.blocks.start, self.blocks.stop, self.L
        first, last = b0 > 0, b1 < L
        tb = r.table[False, False][1, 0] if b1 > b0 else 0.0
        w = r.most(False, False, s, cap)
        if w >= 1:                                  # blocks only: k..j-1 in [b0, b1)
            A = np.full((L + 1, H.shape[1]), np.inf)
            j = np.arange(b0 + 1, b1 + 1)
            A[j] = j[:, None] * tb + H[j]
            window = _window_min(A, w)              # window[lo] = min A[lo .. lo+w-1]
            k = np.arange(b0, b1)
            G[k] = np.minimum(G[k], window[k + 1] - k[:, None] * tb)
        if last:                                    # blocks k..b1-1, then H
            w = r.most(False, True, s, cap)
            for k in range(max(b0, b1 - w), b1 + 1) if w >= 0 else ():
                G[k] = np.minimum(G[k], r.table[False, True][b1 - k, 0] + H[L])
        if first:                                   # E, blocks b0..i
            w = r.most(True, False, s, cap)
            for m in range(0, min(w, b1 - b0) + 1) if w >= 0 else ():
                G[0] = np.minimum(G[0], r.table[True, False][m, 0] + H[b0 + m])
            if last and r.most(True, True, s, cap) >= b1 - b0:
                G[0] = np.minimum(G[0], r.table[True, True][b1 - b0, 0] + H[L])

    def _walk(self, tables, s, cap):
        """The stages of the best plan in ``s`` stages, recomputed from the tables."""
        stages, k, state = [], 0, list(self.caps)
        L = self.L
        while s:
            prev = tables[s - 1].reshape((L + 1,) + self.dims)
            found = None
            for n, r in enumerate(self.options):
                if state[r.axis] < r.size:
                    continue
                after = list(state)
                after[r.axis] -= r.size
                rest = prev[(slice(None),) + tuple(after)]
                for i in range(k, L):
                    if not r.fits(k, i, s, cap):
                        continue
                    value = r.at(k, i)[0] + rest[i + 1]
                    if math.isfinite(value) and (found is None or value < found[0]):
                        found = (value, i, n)
            if found is None:
                raise PlanError("the stage DP found a plan but could not retrace it")
            _, i, n = found
            stages.append((k, i, n))
            state[self.options[n].axis] -= self.options[n].size
            k, s = i + 1, s - 1
        return stages

    def objective(self, stages) -> float:
        times = [self.options[n].at(k, i)[0] for k, i, n in stages]
        return float(sum(times) + (self.B - 1) * max(times))


def _window_min(A: np.ndarray, w: int) -> np.ndarray:
    """out[lo] = min(A[lo : lo + w]) along axis 0 (rows past the end count as inf)."""
    n = A.shape[0]
    blocks = -(-(n + w) // w)
    pad = np.full((blocks * w,) + A.shape[1:], np.inf)
    pad[:n] = A
    shaped = pad.reshape((blocks, w) + A.shape[1:])
    prefix = np.minimum.accumulate(shaped, axis=1).reshape(pad.shape)
    suffix = np.minimum.accumulate(shaped[:, ::-1], axis=1)[:, ::-1].reshape(pad.shape)
    lo = np.arange(n)
    return np.minimum(suffix[lo], prefix[lo + w - 1])


def plan_runs(count: int, blocks: range, options: list, cluster,
              micro_batches: int = 1, fit_memory: bool = True) -> tuple:
    """(StagePlan, the option of each stage): stages of ``count`` layers whose
    ``blocks`` are identical, on ``options`` (:class:`~distgraph.passes.search.runs.
    RunOption`, each with ``cost(first, blocks, last)``) of ``cluster``'s device meshes;
    see the module docstring. Without ``fit_memory`` the devices' memory is not a
    limit (a lower bound on the latency of options that only save memory)."""
    meshes = list(cluster.device_meshes)
    units, capacities, limits = [], [], []
    for axis, mesh in enumerate(meshes):
        sizes = [o.sub.size for o in options if o.axis == axis]
        unit = math.gcd(*sizes, mesh.size) if sizes else mesh.size
        units.append(unit)
        capacities.append(mesh.size // unit)
        limits.append(min(cluster.device(i).memory for i in mesh.ids) if fit_memory
                      else math.inf)
    runs = [_Run(o, count, blocks, limits[o.axis], units[o.axis]) for o in options]
    search = _RunSearch(count, blocks, runs, capacities, micro_batches)
    best = search.run()
    if best is None:
        raise PlanError(f"no split of {count} layers ({len(blocks)} identical blocks) into "
                        f"stages fits the devices' memory (with the activations 1F1B keeps "
                        f"in flight) while covering every device; use devices with more "
                        f"memory, recomputation (Strategy(recompute=True)), or fewer "
                        f"micro-batches in flight")
    plan = _place([(k, i, runs[n]) for k, i, n in best], meshes, micro_batches, search.runs)
    return plan, tuple(runs[n].option for _, _, n in best)
