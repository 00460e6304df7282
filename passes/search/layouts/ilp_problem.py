"""The input of the intra-op sharding ILP: a validated :class:`ShardingProblem`.

Nodes are ``0..n-1`` (ops, or tensors such as parameters); node ``v`` has
``strategy_counts[v]`` candidate strategies and, per strategy, a compute time, a
communication time and a memory size (``compute[v][i]``, ``comm[v][i]``,
``memory[v][i]``). The rest describes how choices interact:

- ``edges``: ``(u, v, R)`` with ``R`` of shape ``(k_u, k_v)``: ``R[i][j]`` is the
  resharding cost paid when ``u`` takes strategy ``i`` and ``v`` takes ``j``. Between
  tied nodes (follow, share: they take one index) ``R`` may be its diagonal alone, of
  shape ``(k,)``: ``R[i]`` is paid when both take ``i`` (an edge inside a tie class of
  thousands of strategies costs thousands of numbers, not millions).
- ``aliases``: ``(u, v, V)``, same shape; ``V[i][j] == 1`` forbids that pair (a
  parameter and its update must agree on a layout).
- ``follow``: ``follow[i] == j`` makes node ``i`` take node ``j``'s strategy index (a
  light op following its operand); ``-1`` leaves it free.
- ``share``: classes of nodes tied to one strategy index, e.g. the same op in every
  identical transformer block: ``share = list(zip(*nodes_of_block))``.
- ``liveness``: the nodes whose memory is live together at each time; with
  ``memory_budget`` the summed memory at every time must stay within it.
- ``workspace`` and ``running``: ``workspace[v][i]`` the bytes node ``v``'s op kernel
  allocates while it runs under strategy ``i`` (its temporaries), ``running[t]`` the
  node whose op runs at liveness time ``t`` (-1: none): the memory at time ``t`` is the
  live nodes' plus the running node's workspace (none given: zeros).
- ``released``: ``(v, first, last, bytes)``: from liveness time ``first`` to ``last``
  node ``v`` (live then) holds ``bytes[i]`` less than ``memory[v][i]`` (a result of its
  op freed at its own last use while another is still live).
- ``copies``: ``(u, v, C, F)``, each shaped as an edge's matrix: the copy of ``u``'s
  result resharded into the layout ``v`` reads, ``C[i][j]`` bytes when ``u`` takes
  ``i`` and ``v`` takes ``j`` (0 where ``v`` reads the layout as made: no reshard), and
  ``F[i][j]`` the bytes of the result it was made from that are freed once it is made
  (the result's last read; else 0). The partitioner makes each reshard a new array just
  before its reader runs, so at ``v``'s time the live nodes are held with, beside them,
  the larger of the copies made less ``v``'s own memory (its results not made yet) and
  the copies with ``v``'s workspace less what they freed, where that is more (what a
  copy frees below the live nodes is not counted: an original is held to its reader).
- ``other_processes``: where the mesh's processes do not all pay alike (devices whose
  figures differ), one entry per further kind of process: per node, the seconds of each
  strategy there (its compute and collectives, as ``compute[v] + comm[v]`` are the
  priced process's). A step lasts as long as its slowest process, so the objective is
  then the edges plus the largest of the kinds' node sums (Alpa's sum where there is
  one kind: none given).

An ``inf`` entry in ``compute``, ``comm`` or ``R`` forbids that strategy or pair. Tied
nodes (follow, share) need equal strategy counts: their strategies correspond by index.
Errors are :class:`~distgraph.errors.PlanError` naming the node (by ``names`` when given),
the field and the fix.

Example::

    >>> p = ShardingProblem([2, 2], compute=[[1, 2], [1, 1]], comm=[[0, 0], [0, 0]],
    ...                     memory=[[2, 1], [2, 1]], edges=[(0, 1, [[0, 5], [5, 0]])])
    >>> p.n, p.strategy_counts
    (2, (2, 2))
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from distgraph.errors import PlanError


def _set(obj, name, value):
    object.__setattr__(obj, name, value)


@dataclass(frozen=True, eq=False)
class ShardingProblem:
    """One sharding ILP (see the module docstring for the meaning of every field)."""

    strategy_counts: Sequence[int]
    compute: Sequence[Sequence[float]]
    comm: Sequence[Sequence[float]]
    memory: Sequence[Sequence[float]]
    edges: Sequence[tuple[int, int, Any]] = ()
    aliases: Sequence[tuple[int, int, Any]] = ()
    follow: Sequence[int] | None = None
    liveness: Sequence[Sequence[int]] = ()
    memory_budget: float | None = None
    share: Sequence[Sequence[int]] = ()
    names: Sequence[str] | None = None
    workspace: Sequence[Sequence[float]] | None = None
    running: Sequence[int] = ()
    other_processes: Sequence[Sequence[Sequence[float]]] = ()
    released: Sequence[tuple[int, int, int, Sequence[float]]] = ()
    copies: Sequence[tuple[int, int, Any, Any]] = ()

    def __post_init__(self):
        counts = tuple(self.strategy_counts)
        for v, k in enumerate(counts):
            if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
                raise PlanError(f"ShardingProblem: strategy_counts[{v}] = {k!r}; every node "
                                "needs a whole number >= 1 of candidate strategies")
        _set(self, "strategy_counts", tuple(int(k) for k in counts))
        n = len(counts)
        if self.names is not None:
            if len(self.names) != n:
                raise PlanError(f"ShardingProblem: {len(self.names)} names for {n} nodes; "
                                "give one name per node or none")
            _set(self, "names", tuple(str(s) for s in self.names))
        for field in ("compute", "comm", "memory"):
            _set(self, field, self._vectors(field, getattr(self, field)))
        _set(self, "edges", self._matrices("edges", self.edges, self._cost_matrix))
        _set(self, "aliases", self._matrices("aliases", self.aliases, self._alias_matrix))
        _set(self, "follow", self._follow())
        _set(self, "share", self._share())
        _set(self, "liveness", self._liveness())
        _set(self, "memory_budget", self._budget(self.memory_budget))
        if self.workspace is not None:
            _set(self, "workspace", self._vectors("workspace", self.workspace))
        _set(self, "running", self._running())
        _set(self, "other_processes", tuple(
            self._vectors(f"other_processes[{k}]", rows)
            for k, rows in enumerate(self.other_processes)))
        _set(self, "released", self._released())
        _set(self, "copies", self._copies())
        # the nodes' own bytes, as given (with_held scales what micro-batches in flight
        # keep; a reader's results not yet made are its own micro-batch's)
        _set(self, "own", self.memory)

    def with_budget(self, budget: float | None) -> "ShardingProblem":
        """This problem with ``memory_budget`` = ``budget``, its other fields shared (a
        search of the same problem under another budget)."""
        other = copy.copy(self)
        _set(other, "memory_budget", self._budget(budget))
        return other

    def with_edges_scaled(self, edges, factor: float) -> "ShardingProblem":
        """This problem with the prices of the edges at indices ``edges`` times
        ``factor``, its other fields shared."""
        other = copy.copy(self)
        chosen = set(edges)
        _set(other, "edges", tuple((u, v, mat * factor) if k in chosen else (u, v, mat)
                                   for k, (u, v, mat) in enumerate(self.edges)))
        return other

    def with_held(self, nodes, times: int) -> "ShardingProblem":
        """This problem with the memory of ``nodes`` counted ``times`` times, its other
        fields shared (the activations a pipeline stage keeps for ``times`` micro-batches
        in flight, :func:`~distgraph.passes.search.layouts.intra_op.search`)."""
        other = copy.copy(self)
        _set(other, "memory", tuple(m * times if v in nodes else m
                                    for v, m in enumerate(self.memory)))
        _set(other, "released", tuple((v, a, b, m * times if v in nodes else m)
                                      for v, a, b, m in self.released))
        return other

    def _budget(self, budget) -> float | None:
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, (int, float, np.number)) \
                    or not (budget >= 0 and math.isfinite(budget)):
                raise PlanError(f"ShardingProblem: memory_budget = {budget!r}; give a finite "
                                "number >= 0 (in the unit of `memory`) or None for no limit")
            if not self.liveness:
                raise PlanError("ShardingProblem: memory_budget is set but liveness is empty, "
                                "so the budget would bound nothing; pass liveness (e.g. "
                                "[list(range(n))] to bound the total) or memory_budget=None")
            return float(budget)
        return None

    # ---- views -------------------------------------------------------------------------
    @property
    def n(self) -> int:
        """Number of nodes."""
        return len(self.strategy_counts)

    def node(self, v: int) -> str:
        """``node 3`` or ``node 3 ('blocks.0.mlp.fc1')`` for messages."""
        return f"node {v}" + (f" ({self.names[v]!r})" if self.names is not None else "")

    # ---- validation --------------------------------------------------------------------
    def _vectors(self, field: str, rows) -> tuple[np.ndarray, ...]:
        if len(rows) != self.n:
            raise PlanError(f"ShardingProblem: {field} has {len(rows)} rows for {self.n} "
                            f"nodes; give one row per node")
        out = []
        for v, row in enumerate(rows):
            arr = np.asarray(row, dtype=np.float64).reshape(-1)
            k = self.strategy_counts[v]
            if arr.size != k:
                raise PlanError(f"ShardingProblem: {field}[{v}] has {arr.size} entries but "
                                f"{self.node(v)} has strategy_counts[{v}] = {k}; give one "
                                "entry per strategy")
            if field in ("memory", "workspace"):
                bad, allowed = ~np.isfinite(arr) | (arr < 0), "finite numbers >= 0"
            else:
                bad, allowed = np.isnan(arr) | (arr == -np.inf), "numbers, or inf to forbid it"
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise PlanError(f"ShardingProblem: {field}[{v}][{i}] = {arr[i]} for "
                                f"{self.node(v)}; expected {allowed}")
            arr.setflags(write=False)
            out.append(arr)
        return tuple(out)

    def _node_id(self, where: str, v) -> int:
        return _node_id(self.n, where, v)

    def _running(self) -> tuple[int, ...]:
        if not len(self.running):
            return ()
        if len(self.running) != len(self.liveness):
            raise PlanError(f"ShardingProblem: running has {len(self.running)} entries for "
                            f"{len(self.liveness)} liveness sets; give the node running at "
                            "each time (-1: none)")
        return tuple(-1 if v == -1 else self._node_id(f"running[{t}]", v)
                     for t, v in enumerate(self.running))

    def beside(self, choice: Sequence[int]) -> np.ndarray:
        """The bytes at each liveness time under ``choice`` beyond the live nodes'
        ``memory``: the running node's workspace and the copies it reads, less what
        ``released`` frees."""
        out = np.zeros(len(self.liveness))
        if self.workspace is not None:
            for t, v in enumerate(self.running):
                if v != -1:
                    out[t] = self.workspace[v][choice[v]]
        if self.copies:
            made, kept = {}, {}         # reader -> bytes of the copies; less what they free
            for u, v, mat, freed in self.copies:
                i, j = choice[u], choice[v]
                at = j if mat.ndim == 1 else (i, j)
                made[v] = made.get(v, 0.0) + float(mat[at])
                kept[v] = kept.get(v, 0.0) + float(mat[at] - freed[at])
            for t, v in enumerate(self.running):
                if v in made:
                    out[t] = max(0.0, made[v] - float(self.own[v][choice[v]]), out[t] + kept[v])
        for v, first, last, freed in self.released:
            out[first:last + 1] -= freed[choice[v]]
        return out

    def held_at(self, nodes, t: int, choice: Sequence[int]) -> float:
        """The bytes ``nodes`` (live at liveness time ``t``) hold then under ``choice``:
        their memory less what ``released`` frees at ``t``."""
        held = sum(float(self.memory[v][choice[v]]) for v in nodes)
        return held - sum(float(freed[choice[v]]) for v, first, last, freed in self.released
                          if v in nodes and first <= t <= last)

    def _released(self) -> tuple:
        out = []
        for k, item in enumerate(self.released):
            try:
                v, first, last, freed = item
            except (TypeError, ValueError):
                raise PlanError(f"ShardingProblem: released[{k}] is {item!r}; expected "
                                "(node, first time, last time, bytes per strategy)") from None
            v = self._node_id(f"released[{k}]", v)
            if not 0 <= first <= last < len(self.liveness) or v not in \
                    self.liveness[first] or v not in self.liveness[last]:
                raise PlanError(f"ShardingProblem: released[{k}] frees {self.node(v)} from "
                                f"time {first} to {last}, where it is not live; give times "
                                f"within its liveness")
            freed = np.asarray(freed, dtype=np.float64).reshape(-1)
            if freed.size != self.strategy_counts[v] or not np.isfinite(freed).all() or \
                    (freed < 0).any() or (freed > self.memory[v] * (1 + 1e-9)).any():
                raise PlanError(f"ShardingProblem: released[{k}] frees {freed.tolist()} bytes of "
                                f"{self.node(v)}, which holds {self.memory[v].tolist()}; give "
                                f"one entry per strategy, 0 <= bytes <= its memory")
            freed.setflags(write=False)
            out.append((v, int(first), int(last), freed))
        return tuple(out)

    def _matrices(self, field: str, items, convert) -> tuple:
        out = []
        for k, item in enumerate(items):
            try:
                u, v, mat = item
            except (TypeError, ValueError):
                raise PlanError(f"ShardingProblem: {field}[{k}] is {item!r}; expected a "
                                "triple (u, v, matrix)") from None
            u, v = self._node_id(f"{field}[{k}]", u), self._node_id(f"{field}[{k}]", v)
            if u == v:
                raise PlanError(f"ShardingProblem: {field}[{k}] joins {self.node(u)} to "
                                "itself; an edge or alias joins two different nodes")
            arr = np.asarray(mat, dtype=np.float64)
            shape = (self.strategy_counts[u], self.strategy_counts[v])
            if field in ("edges", "copies", "copies (freed)") and arr.ndim == 1 and \
                    shape[0] == shape[1]:
                shape = shape[:1]               # a tied pair's diagonal
            if arr.shape != shape:
                raise PlanError(f"ShardingProblem: {field}[{k}] ({self.node(u)} -> "
                                f"{self.node(v)}) has a matrix of shape {arr.shape}; expected "
                                f"{shape} = (strategies of {u}, strategies of {v})")
            arr = convert(f"{field}[{k}]", arr)
            arr.setflags(write=False)
            out.append((u, v, arr))
        return tuple(out)

    @staticmethod
    def _cost_matrix(where: str, arr: np.ndarray) -> np.ndarray:
        bad = np.isnan(arr) | (arr == -np.inf)
        if bad.any():
            i, j = map(int, np.argwhere(bad)[0])
            raise PlanError(f"ShardingProblem: {where} R[{i}][{j}] = {arr[i, j]}; expected a "
                            "number, or inf to forbid the pair")
        return arr

    def _copies(self) -> tuple:
        items = []
        for k, item in enumerate(self.copies):
            try:
                u, v, mat, freed = item
            except (TypeError, ValueError):
                raise PlanError(f"ShardingProblem: copies[{k}] is {item!r}; expected "
                                "(u, v, copy bytes, freed bytes)") from None
            items.append((u, v, mat, freed))
        made = self._matrices("copies", [(u, v, m) for u, v, m, _ in items], _bytes)
        freed = self._matrices("copies (freed)", [(u, v, f) for u, v, _, f in items], _bytes)
        for k, ((u, v, m), (_, _, f)) in enumerate(zip(made, freed)):
            if m.shape != f.shape:
                raise PlanError(f"ShardingProblem: copies[{k}] gives {m.shape} copy bytes but "
                                f"{f.shape} freed bytes; give both for every pair")
        if made and not len(self.running):
            raise PlanError("ShardingProblem: copies are held while their reader runs, but "
                            "running is empty; give the node running at each liveness time")
        return tuple((u, v, m, f) for (u, v, m), (_, _, f) in zip(made, freed))

    @staticmethod
    def _alias_matrix(where: str, arr: np.ndarray) -> np.ndarray:
        bad = (arr != 0) & (arr != 1)
        if bad.any():
            i, j = map(int, np.argwhere(bad)[0])
            raise PlanError(f"ShardingProblem: {where} V[{i}][{j}] = {arr[i, j]}; expected 0 "
                            "(pair allowed) or 1 (pair forbidden)")
        return arr.astype(bool)

    def _tie(self, where: str, i: int, j: int) -> None:
        if self.strategy_counts[i] != self.strategy_counts[j]:
            raise PlanError(f"ShardingProblem: {where} ties {self.node(i)} "
                            f"({self.strategy_counts[i]} strategies) to {self.node(j)} "
                            f"({self.strategy_counts[j]}); tied nodes take the same strategy "
                            "index, so they need the same strategy count")

    def _follow(self) -> tuple[int, ...]:
        if self.follow is None:
            return (-1,) * self.n
        if len(self.follow) != self.n:
            raise PlanError(f"ShardingProblem: follow has {len(self.follow)} entries for "
                            f"{self.n} nodes; give one per node (-1 = free)")
        out = []
        for i, j in enumerate(self.follow):
            if j == -1:
                out.append(-1)
                continue
            j = self._node_id(f"follow[{i}]", j)
            if j == i:
                raise PlanError(f"ShardingProblem: follow[{i}] = {i}: {self.node(i)} follows "
                                "itself; use -1 for a free node")
            self._tie(f"follow[{i}]", i, j)
            out.append(j)
        for start in range(self.n):
            # Walk the chain; a chain longer than n nodes has a cycle.
            path, v = [start], out[start]
            while v != -1 and len(path) <= self.n:
                path.append(v)
                v = out[v]
            if v != -1:
                cycle = path[path.index(path[-1]):]
                raise PlanError("ShardingProblem: follow has a cycle "
                                f"{' -> '.join(self.node(c) for c in cycle)}; let one node of "
                                "the cycle lead (follow = -1) and the others follow it")
        return tuple(out)

    def _share(self) -> tuple[tuple[int, ...], ...]:
        seen: dict[int, int] = {}
        out = []
        for c, group in enumerate(self.share):
            ids = tuple(self._node_id(f"share[{c}]", v) for v in group)
            for v in ids:
                if v in seen:
                    raise PlanError(f"ShardingProblem: {self.node(v)} is in share[{seen[v]}] "
                                    f"and share[{c}]; put each node in at most one class "
                                    "(merge the classes if they are meant to be tied)")
                seen[v] = c
                self._tie(f"share[{c}]", ids[0], v)
            out.append(ids)
        return tuple(out)

    def _liveness(self) -> "LiveSets":
        if isinstance(self.liveness, LiveSets) and self.liveness.n == self.n:
            return self.liveness            # checked for this many nodes already
        return checked_liveness(self.liveness, self.n, self.node)

    @classmethod
    def one_each(cls, compute, comm, memory, edges=(), aliases=(), liveness=(),
                 names=None, workspace=None, running=(),
                 other_processes=(), released=()) -> "ShardingProblem":
        """The problem of one strategy per node (a fixed choice priced): ``compute``,
        ``comm``, ``memory`` (and ``workspace``, and each of ``other_processes``) one
        number per node, ``released`` one number per entry, ``edges`` (u, v, seconds) and
        ``aliases`` (u, v, forbidden) one per pair, checked as a whole rather than node
        by node. Where a number is wrong, the checks of ``ShardingProblem(...)`` name it.

        >>> p = ShardingProblem.one_each([1.0, 2.0], [0.0, 0.5], [4, 4], [(0, 1, 0.25)])
        >>> evaluate(p, [0, 0])
        3.75
        """
        n = len(compute)
        rows = np.array([compute, comm, memory], dtype=np.float64).reshape(3, n, 1)
        cost = np.array([x for _, _, x in edges], dtype=np.float64).reshape(-1, 1, 1)
        ends = np.array([(u, v) for u, v, _ in edges] + [(u, v) for u, v, _ in aliases],
                        dtype=np.int64).reshape(-1, 2)
        if isinstance(liveness, LiveSets) and liveness.n != n:
            liveness = tuple(liveness)
        if np.isnan(rows[:2]).any() or (rows[:2] == -np.inf).any() or \
                not np.isfinite(rows[2]).all() or (rows[2] < 0).any() or \
                np.isnan(cost).any() or (cost == -np.inf).any() or \
                ((ends < 0) | (ends >= n)).any() or (ends[:, 0] == ends[:, 1]).any():
            return cls([1] * n, rows[0], rows[1], rows[2],
                       [(u, v, [[x]]) for u, v, x in edges],
                       [(u, v, [[float(x)]]) for u, v, x in aliases], None, liveness,
                       None, (), names,
                       None if workspace is None else [[float(x)] for x in workspace],
                       running, [[[float(x)] for x in xs] for xs in other_processes],
                       released)
        rows.setflags(write=False)
        cost.setflags(write=False)
        banned = np.array([bool(x) for _, _, x in aliases], dtype=bool).reshape(-1, 1, 1)
        banned.setflags(write=False)
        problem = object.__new__(cls)
        for name, value in (
                ("strategy_counts", (1,) * n), ("compute", rows[0]), ("comm", rows[1]),
                ("memory", rows[2]),
                ("edges", tuple((int(u), int(v), m) for (u, v, _), m in zip(edges, cost))),
                ("aliases", tuple((int(u), int(v), m) for (u, v, _), m in zip(aliases, banned))),
                ("follow", (-1,) * n), ("memory_budget", None), ("share", ()),
                ("liveness", liveness),
                ("names", None if names is None else tuple(str(x) for x in names)),
                ("workspace", None), ("running", running), ("other_processes", ()),
                ("released", released)):
            _set(problem, name, value)
        _set(problem, "liveness", problem._liveness())
        if workspace is not None:
            _set(problem, "workspace", problem._vectors("workspace", [[float(x)] for x in
                                                                      workspace]))
        _set(problem, "running", problem._running())
        _set(problem, "other_processes", tuple(
            problem._vectors(f"other_processes[{k}]", [[float(x)] for x in xs])
            for k, xs in enumerate(other_processes)))
        _set(problem, "released", problem._released())
        _set(problem, "copies", ())
        _set(problem, "own", problem.memory)
        return problem


class LiveSets(tuple):
    """Liveness sets checked for a problem of ``n`` nodes (a ShardingProblem given them
    does not check them again: a space's sets serve every problem built on it)."""

    n: int

    def __new__(cls, sets, n: int):
        out = super().__new__(cls, sets)
        out.n = n
        return out


def checked_liveness(liveness, n: int, node=None) -> LiveSets:
    """``liveness`` (node ids live together at each time) checked for ``n`` nodes:
    PlanError naming the first id out of range or listed twice in one set (``node``:
    how to name a node, ``ShardingProblem.node``)."""
    node = node or (lambda v: f"node {v}")
    out = []
    for t, live in enumerate(liveness):
        ids = tuple(live)
        # node ids as the builders give them (ints in range) pass at once; others
        # are checked one by one, to name the first wrong one
        if not all(type(v) is int and 0 <= v < n for v in ids):
            ids = tuple(_node_id(n, f"liveness[{t}]", v) for v in live)
        if len(set(ids)) != len(ids):
            dup = next(v for v in ids if ids.count(v) > 1)
            raise PlanError(f"ShardingProblem: liveness[{t}] lists {node(dup)} "
                            "twice; a live set names each node once")
        out.append(ids)
    return LiveSets(out, n)


def _node_id(n: int, where: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v < n:
        raise PlanError(f"ShardingProblem: {where} names node {v!r}; nodes are 0..{n - 1}")
    return int(v)


def evaluate(problem: ShardingProblem, choice: Sequence[int]) -> float:
    """The objective of ``choice`` (one strategy index per node); ``inf`` when it picks a
    forbidden strategy or pair or breaks a follow/share tie. Ignores the memory budget."""
    c = _check_choice(problem, choice)
    ties = [(i, j) for i, j in enumerate(problem.follow) if j != -1]
    ties += [(g[0], v) for g in problem.share for v in g]
    if any(c[i] != c[j] for i, j in ties):
        return math.inf
    if any(mat[c[u], c[v]] for u, v, mat in problem.aliases):
        return math.inf
    return _slowest(problem, c, range(problem.n)) + \
        sum(_paid(mat, c[u], c[v]) for u, v, mat in problem.edges)


def share_of(problem: ShardingProblem, choice: Sequence[int], nodes) -> float:
    """The part of :func:`evaluate`'s objective that ``nodes`` (node indices) spend under
    ``choice``: their compute and collectives (at the kind of process that spends most
    on them) and the reshards into them."""
    c, inside = [int(i) for i in choice], set(nodes)
    return _slowest(problem, c, inside) + \
        sum(_paid(mat, c[u], c[v]) for u, v, mat in problem.edges if v in inside)


def _paid(mat, i: int, j: int) -> float:
    """An edge's price when its ends take ``i`` and ``j`` (a diagonal: inf off it)."""
    if mat.ndim == 1:
        return float(mat[j]) if i == j else math.inf
    return float(mat[i, j])


def kind_seconds(problem: ShardingProblem, choice: Sequence[int]) -> tuple:
    """:func:`evaluate`'s objective of a valid ``choice`` at each kind of process, the
    priced one then each of ``other_processes``: its nodes' compute and collectives
    there and the reshards (their largest is the objective); () where every process
    pays alike. A stage of several parts waits for the process whose parts' sum is the
    largest, not for each part's slowest (:func:`~distgraph.passes.cost.stage.
    stage_cost`)."""
    if not problem.other_processes:
        return ()
    c = [int(i) for i in choice]
    edges = sum(_paid(mat, c[u], c[v]) for u, v, mat in problem.edges)
    return tuple(t + edges for t in _kind_sums(problem, c, range(problem.n)))


def _slowest(problem: ShardingProblem, c: list, nodes) -> float:
    """The seconds ``nodes`` spend under choice ``c`` at the kind of process that spends
    the most on them (the priced process, or one of ``other_processes``)."""
    return max(_kind_sums(problem, c, nodes))


def _kind_sums(problem: ShardingProblem, c: list, nodes) -> list:
    """The seconds ``nodes`` spend under choice ``c`` at each kind of process (the priced
    one first)."""
    nodes = list(nodes)
    sums = [sum(float(problem.compute[v][c[v]] + problem.comm[v][c[v]]) for v in nodes)]
    return sums + [sum(float(rows[v][c[v]]) for v in nodes)
                   for rows in problem.other_processes]


def peak_memory(problem: ShardingProblem, choice: Sequence[int]) -> float:
    """The largest summed memory over the liveness sets under ``choice``, each with the
    running node's workspace and less what is released then (0 without any set)."""
    c = _check_choice(problem, choice)
    per_node = [float(problem.memory[v][c[v]]) for v in range(problem.n)]
    at = per_node.__getitem__
    beside = problem.beside(c)
    return max((sum(map(at, live)) + float(w) for live, w in zip(problem.liveness, beside)),
               default=0.0)


def largest_peak(problem: ShardingProblem) -> float:
    """A bound no choice's :func:`peak_memory` exceeds: at each liveness time the live
    nodes' largest memory, the running node's largest workspace and the largest of each
    copy it reads (nothing released counted)."""
    most = [float(np.max(m)) for m in problem.memory]
    beside = np.zeros(len(problem.liveness))
    read: dict = {}
    for _, v, mat, _ in problem.copies:
        read[v] = read.get(v, 0.0) + float(np.max(mat))
    for t, v in enumerate(problem.running):
        if v != -1:
            work = float(np.max(problem.workspace[v])) if problem.workspace is not None else 0.0
            beside[t] = work + read.get(v, 0.0)
    return max((sum(most[v] for v in live) + float(b)
                for live, b in zip(problem.liveness, beside)), default=0.0)


def _bytes(where: str, arr: np.ndarray) -> np.ndarray:
    bad = ~np.isfinite(arr) | (arr < 0)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise PlanError(f"ShardingProblem: {where} has {arr[at]} at {list(at)}; expected "
                        "bytes, a finite number >= 0")
    return arr


def _check_choice(problem: ShardingProblem, choice: Sequence[int]) -> list[int]:
    c = [int(i) for i in choice]
    if len(c) != problem.n:
        raise PlanError(f"choice has {len(c)} entries for {problem.n} nodes")
    for v, i in enumerate(c):
        if not 0 <= i < problem.strategy_counts[v]:
            raise PlanError(f"choice[{v}] = {i} but {problem.node(v)} has "
                            f"{problem.strategy_counts[v]} strategies")
    return c
