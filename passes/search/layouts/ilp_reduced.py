"""A :class:`~distgraph.passes.search.layouts.ilp_problem.ShardingProblem` reduced for
SCIP (:mod:`distgraph.passes.search.layouts.ilp`): nodes tied by follow and share become
one class each (:func:`reduce_problem`), their pairs' matrices compressed to the groups
of alike rows and columns (:func:`unique_rows`), the liveness turned into the steps at
which a class's memory changes and, per step, the ops running beside the level: their
workspace and the reshard copies they read (:func:`_memory_steps`, priced by
:func:`spike`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from distgraph.errors import PlanError
from distgraph.passes.search.layouts.ilp_problem import ShardingProblem


@dataclass
class Pair:
    """An interaction between two classes after reduction: compressed matrix and groups."""

    u: int
    v: int
    cost: np.ndarray        # (row groups, column groups); inf = forbidden
    rows: np.ndarray        # group of each strategy of u
    cols: np.ndarray        # group of each strategy of v


@dataclass
class Reduced:
    cls: np.ndarray                      # class of each node
    cost: list[np.ndarray]               # per class, per strategy; inf = forbidden
    pairs: list[Pair]
    steps: list[dict[int, np.ndarray]]   # liveness: per changing step, class -> delta
    memory: list[np.ndarray]             # per class, per strategy: members' memory summed
    spikes: list = None                  # per step: the ops running at its level, beside
    #                                      it (_memory_steps)
    others: list = None                  # per further kind of process, its cost (as cost:
    #                                      the same edge terms, its own nodes' seconds)


def _classes(p: ShardingProblem) -> np.ndarray:
    parent = list(range(p.n))

    def root(v):
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    ties = [(i, j) for i, j in enumerate(p.follow) if j != -1]
    ties += [(g[0], v) for g in p.share for v in g[1:]]
    for i, j in ties:
        a, b = root(i), root(j)
        if a != b:
            parent[max(a, b)] = min(a, b)
    roots = [root(v) for v in range(p.n)]
    index = {r: c for c, r in enumerate(sorted(set(roots)))}
    return np.array([index[r] for r in roots], dtype=np.intp)


def reduce_problem(p: ShardingProblem) -> Reduced:
    cls = _classes(p)
    ncls = int(cls.max()) + 1 if p.n else 0
    # the priced process's cost first, then each other kind's: the edge terms moved into
    # the node costs below are every kind's
    kinds = [[p.compute[v] + p.comm[v] for v in range(p.n)], *p.other_processes]
    every = [[None] * ncls for _ in kinds]
    for seconds, kind in zip(kinds, every):
        for v in range(p.n):
            c = cls[v]
            kind[c] = seconds[v].copy() if kind[c] is None else kind[c] + seconds[v]
    cost = every[0]
    mats: dict[tuple[int, int], np.ndarray] = {}

    def oriented(u, v, mat):
        cu, cv = int(cls[u]), int(cls[v])
        if cu == cv:
            return cu, None
        key = (cu, cv) if cu < cv else (cv, cu)
        if key not in mats:
            mats[key] = np.zeros((len(cost[key[0]]), len(cost[key[1]])))
        return key, (mat if cu < cv else mat.T)

    for u, v, mat in p.edges:
        if mat.ndim == 1 and cls[u] != cls[v]:
            raise PlanError(f"ShardingProblem: the edge {p.node(u)} -> {p.node(v)} gives its "
                            f"diagonal only, but the two are not tied (follow/share)")
        key, m = oriented(u, v, mat)
        if m is None:
            for kind in every:
                kind[key] = kind[key] + (mat if mat.ndim == 1 else np.diag(mat))
        else:
            mats[key] += m
    for u, v, forbid in p.aliases:
        key, m = oriented(u, v, forbid)
        if m is None:
            for kind in every:
                kind[key] = np.where(np.diag(forbid), np.inf, kind[key])
        else:
            mats[key] = np.where(m, np.inf, mats[key])
    pairs = []
    for (cu, cv), mat in mats.items():
        if np.isfinite(mat).all():
            a, b = mat[:, 0], mat[0, :] - mat[0, 0]
            scale = max(1.0, float(np.abs(mat).max()))
            if float(np.abs(mat - (a[:, None] + b[None, :])).max()) <= 1e-12 * scale:
                for kind in every:
                    kind[cu], kind[cv] = kind[cu] + a, kind[cv] + b
                continue
        uniq, rows = unique_rows(mat)
        uniq, cols = unique_rows(uniq.T)
        pairs.append(Pair(cu, cv, np.ascontiguousarray(uniq.T), rows, cols))
    memory = [np.zeros(len(c)) for c in cost]
    for v in range(p.n):
        memory[cls[v]] = memory[cls[v]] + p.memory[v]
    steps, spikes = _memory_steps(p, cls)
    if len(every) > 1:      # a strategy forbidden to one kind of process is to all
        for c in range(ncls):
            barred = np.any([~np.isfinite(kind[c]) for kind in every], axis=0)
            for kind in every:
                kind[c] = np.where(barred, np.inf, kind[c])
    return Reduced(cls, every[0], pairs, steps, memory, spikes, every[1:])


def unique_rows(mat) -> tuple:
    """(the distinct rows of ``mat`` in increasing lexicographic order, each row's index
    among them): ``np.unique(mat, axis=0, return_inverse=True)``'s answer (rows equal as
    floats are one, -0.0 and 0.0 alike), found by hashing rows rather than sorting them
    all (a tenth of its time on the problems of a GPT block)."""
    mat = np.ascontiguousarray(mat, dtype=float) + 0.0        # -0.0 -> 0.0
    first: dict = {}
    seen = np.array([first.setdefault(row.tobytes(), r) for r, row in enumerate(mat)],
                    dtype=np.intp)
    heads = np.fromiter(first.values(), dtype=np.intp, count=len(first))
    order = np.lexsort(mat[heads].T[::-1]) if mat.shape[1] else np.arange(len(heads))
    rank = np.empty(mat.shape[0], dtype=np.intp)
    rank[heads[order]] = np.arange(len(heads))
    return mat[heads[order]], rank[seen]


def _memory_steps(p: ShardingProblem, cls: np.ndarray) -> tuple[list, list]:
    """(the liveness's changing steps: class -> delta; per step the ops running at its
    level: (class, workspace bytes per strategy, the copies it reads: (producer's class,
    bytes made, bytes made less those freed; per pair of strategies, or per strategy
    where the two are one class), its own bytes per strategy))."""
    steps, spikes, previous = [], [], set()
    running = p.running if p.workspace is not None or p.copies else ()
    changes: dict = {}          # time -> [(node, bytes)]: what ``released`` frees, returns
    for v, first, last, freed in p.released:
        changes.setdefault(first, []).append((v, -freed))
        changes.setdefault(last + 1, []).append((v, freed))
    read: dict = {}             # node -> the copies it reads
    for u, v, mat, freed in p.copies:
        if cls[u] == cls[v] and mat.ndim == 2:
            mat, freed = np.diag(mat), np.diag(freed)
        if mat.any():
            read.setdefault(v, []).append((int(cls[u]), mat, mat - freed))
    for t, live in enumerate(p.liveness):
        current = set(live)
        delta: dict[int, np.ndarray] = {}
        for sign, nodes in ((1.0, current - previous), (-1.0, previous - current)):
            for v in nodes:
                c = int(cls[v])
                delta[c] = delta.get(c, 0.0) + sign * p.memory[v]
        for v, d in changes.get(t, ()):
            c = int(cls[v])
            delta[c] = delta.get(c, 0.0) + d
        delta = {c: d for c, d in delta.items() if np.any(d)}
        if delta or not steps:        # an unchanged level needs no new row
            steps.append(delta)
            spikes.append([])
        previous = current
        v = running[t] if running else -1
        if v == -1:
            continue
        copies = tuple(read.get(v, ()))
        work = p.workspace[v] if p.workspace is not None else np.zeros(p.strategy_counts[v])
        if np.any(work) or copies:
            spikes[-1].append((int(cls[v]), work, copies, p.own[v]))
    if steps and not steps[0] and not spikes[0]:
        steps, spikes = steps[1:], spikes[1:]
    return steps, spikes


def spike(per_class: list, c: int, work, copies, own) -> float:
    """The bytes beside the level while a class-``c`` op runs under ``per_class``
    (:meth:`ShardingProblem.beside`): the copies it reads made, its results not yet, or
    its workspace beside the copies less what they freed."""
    i = per_class[c]

    def at(mat, cu):
        return float(mat[i] if mat.ndim == 1 else mat[per_class[cu], i])

    running = float(work[i]) + sum(at(kept, cu) for cu, _, kept in copies)
    if not copies:
        return running
    return max(0.0, sum(at(made, cu) for cu, made, _ in copies) - float(own[i]), running)
