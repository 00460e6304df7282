"""The process graph that rank mapping places: logical processes and the bytes between them.

Processes are ``0..P-1``. Each has an optional required device type (``"GPU"``, ...),
a compute need (GFLOP per step) and a memory need (GB). Each unordered pair carries the
bytes the two exchange per step (both directions together) and the messages.

A collective becomes pairs by the cost model's own load of a step
(:func:`distgraph.passes.cost.formulas.ring_load`: the messages and bytes each process
sends, what :func:`~distgraph.passes.cost.formulas.collective_time` charges it) spread
over the peers each process sends to in the algorithm the model prices: on a ring
(``n`` = group size, ``B`` = the formula's buffer), the successor in the group's listed
order; in an all_to_all, every other process alike; in a pipeline chain (``p2p``), the
next stage, one send_recv message:

================  ========================================================================
``all_reduce``    ring: each process sends 2(n-1)/n * B to its successor, in 2(n-1) messages
``all_gather``    ring: (n-1)/n * B (B = gathered size), in n-1 messages
``reduce_scatter`` ring: (n-1)/n * B (B = input size), in n-1 messages
``all_to_all``    every ordered pair: B/n in one message, so 2B/n per unordered pair
``p2p``           chain, not ring: g[i] sends B to g[i+1] in one message (pipeline stages)
================  ========================================================================

A mapping then costs, per pair, ``messages x alpha + bytes x beta`` of the link between
its devices (:func:`~distgraph.passes.cost.formulas.link_rates`): the sum over every
process of the price of its part of each step on its own links
(:mod:`distgraph.passes.mapping.rank_mapping`).

Example::

    >>> g = ProcessGraph(4).with_group_traffic([[0, 1], [2, 3]], 1e6, "all_reduce")
    >>> g.traffic[(0, 1)]                     # 2 * (1/2) * 1e6 each way
    2000000.0
    >>> grid_groups((2, 2), axis=1)           # rows of a 2x2 grid: "tp" groups
    [[0, 1], [2, 3]]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from distgraph.errors import PlanError
from distgraph.passes.cost.formulas import ring_load
from distgraph.plan.kinds import ALL_TO_ALLV, COLLECTIVES, StepKind
from distgraph.resources.cluster import COMPUTE_TYPES, FrozenMap

CHAIN = "p2p"            # a chain of pipeline stages: each sends B to the next
KINDS = COLLECTIVES + (CHAIN,)


def group_sends(groups: Sequence[Sequence[int]], bytes_per_process: float,
                kind=StepKind.ALL_REDUCE) -> list[tuple[int, int, float, float]]:
    """``(sender, receiver, messages, bytes)`` of one collective run by every group of
    ``groups``: each process's :func:`~distgraph.passes.cost.formulas.ring_load` spread
    over its peers (module table)."""
    if kind == ALL_TO_ALLV:
        kind = StepKind.ALL_TO_ALL
    if kind not in KINDS:
        raise PlanError(f"unknown collective kind {kind!r}; expected one of "
                        f"{', '.join(map(str, KINDS))}")
    if kind != CHAIN:
        kind = StepKind.parse(kind)
    if not (bytes_per_process >= 0 and math.isfinite(bytes_per_process)):
        raise PlanError(f"{kind}: bytes_per_process must be a finite number >= 0, "
                        f"got {bytes_per_process}")
    sends = []
    for group in groups:
        g = [int(p) for p in group]
        n = len(g)
        if len(set(g)) != n:
            raise PlanError(f"{kind} group {g} lists a process twice")
        if n < 2:
            continue
        if kind == CHAIN:
            messages, nbytes = ring_load(StepKind.SEND_RECV, 2, bytes_per_process)
            sends += [(a, b, messages, nbytes) for a, b in zip(g, g[1:])]
            continue
        messages, nbytes = ring_load(kind, n, bytes_per_process)
        if kind is StepKind.ALL_TO_ALL:
            sends += [(a, b, messages / (n - 1), nbytes / (n - 1)) for a in g for b in g
                      if a != b]
        else:
            sends += [(g[i], g[(i + 1) % n], messages, nbytes) for i in range(n)]
    return sends


def collective_traffic(groups: Sequence[Sequence[int]], bytes_per_process: float,
                       kind=StepKind.ALL_REDUCE) -> dict[tuple[int, int], float]:
    """Bytes per unordered pair for one collective run by every group (module table)."""
    return _per_pair((a, b, nbytes) for a, b, _, nbytes in
                     group_sends(groups, bytes_per_process, kind))


def collective_messages(groups: Sequence[Sequence[int]],
                        kind=StepKind.ALL_REDUCE) -> dict[tuple[int, int], float]:
    """Messages per unordered pair for one collective run by every group (module text)."""
    return _per_pair((a, b, float(messages)) for a, b, messages, _ in
                     group_sends(groups, 0.0, kind))


def _per_pair(sends) -> dict[tuple[int, int], float]:
    out: dict[tuple[int, int], float] = {}
    for a, b, amount in sends:
        pair = (min(a, b), max(a, b))
        out[pair] = out.get(pair, 0.0) + amount
    return out


def grid_groups(shape: Sequence[int], axis: int) -> list[list[int]]:
    """Groups of process ids along ``axis`` of a row-major grid of ``shape``.

    ``grid_groups((pp, dp, tp), 2)`` are the tensor-parallel groups, axis 1 the
    data-parallel ones, axis 0 the pipeline chains.
    """
    ids = np.arange(math.prod(shape)).reshape(tuple(shape))
    return np.moveaxis(ids, axis, -1).reshape(-1, shape[axis]).tolist()


def _per_process(value, n: int, name: str):
    if value is None or isinstance(value, (str, int, float)):
        return (value,) * n
    values = tuple(value)
    if len(values) != n:
        raise PlanError(f"ProcessGraph: {name} has {len(values)} entries for {n} processes; "
                        f"give one per process or a single value for all")
    return values


@dataclass(frozen=True)
class ProcessGraph:
    """Logical processes with needs, and bytes exchanged per step per unordered pair.

    ``traffic`` maps ``(i, j)`` to bytes (either order; both orders are summed) and
    ``messages`` to the number of messages (a pair missing there counts none).
    ``device_types``, ``compute`` (GFLOP per step) and ``memory`` (GB) take one value per
    process or a single value for all. A graph is a value: ``with_traffic`` and
    ``with_group_traffic`` return new graphs.
    """

    num_processes: int
    traffic: Mapping[tuple[int, int], float] = field(default_factory=FrozenMap)
    device_types: Sequence[str | None] | str | None = None
    compute: Sequence[float] | float = 0.0
    memory: Sequence[float] | float = 0.0
    messages: Mapping[tuple[int, int], float] = field(default_factory=FrozenMap)

    def __post_init__(self):
        n = self.num_processes
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise PlanError(f"ProcessGraph needs at least one process, got {n!r}")
        for name, unit in (("traffic", "bytes"), ("messages", "messages")):
            object.__setattr__(self, name, _pairs(getattr(self, name), n, name, unit))
        types = _per_process(self.device_types, n, "device_types")
        for p, t in enumerate(types):
            if t is not None and t not in COMPUTE_TYPES:
                raise PlanError(f"ProcessGraph: process {p} asks for device type {t!r}; "
                                f"expected None or one of {', '.join(COMPUTE_TYPES)}")
        object.__setattr__(self, "device_types", types)
        for name in ("compute", "memory"):
            values = tuple(float(v) for v in _per_process(getattr(self, name), n, name))
            if any(not (v >= 0 and math.isfinite(v)) for v in values):
                raise PlanError(f"ProcessGraph: {name} needs must be finite and >= 0")
            object.__setattr__(self, name, values)

    def with_traffic(self, pairs: Mapping[tuple[int, int], float],
                     messages: Mapping[tuple[int, int], float] | None = None) -> "ProcessGraph":
        """A new graph with ``pairs`` bytes (and ``messages``) added to the existing ones."""
        return ProcessGraph(self.num_processes, _merged(self.traffic, pairs), self.device_types,
                            self.compute, self.memory, _merged(self.messages, messages or {}))

    def with_group_traffic(self, groups: Sequence[Sequence[int]], bytes_per_process: float,
                           kind=StepKind.ALL_REDUCE) -> "ProcessGraph":
        """A new graph with the traffic of ``kind`` (a collective, or ``"p2p"``: a chain
        of pipeline stages) run in every group added (module table)."""
        sends = group_sends(groups, bytes_per_process, kind)
        return self.with_traffic(_per_pair((a, b, nbytes) for a, b, _, nbytes in sends),
                                 _per_pair((a, b, messages) for a, b, messages, _ in sends))

    def traffic_matrix(self) -> np.ndarray:
        """Dense symmetric (P, P) matrix of bytes per step; zero diagonal."""
        t = np.zeros((self.num_processes, self.num_processes))
        for (i, j), nbytes in self.traffic.items():
            t[i, j] = t[j, i] = nbytes
        return t

    @property
    def total_bytes(self) -> float:
        return float(sum(self.traffic.values()))

    def __str__(self):
        types = {}
        for t in self.device_types:
            types[t or "any"] = types.get(t or "any", 0) + 1
        kinds = ", ".join(f"{k} x{v}" for k, v in types.items())
        return (f"ProcessGraph({self.num_processes} processes [{kinds}], "
                f"{len(self.traffic)} pairs, {self.total_bytes / 1e6:.3g} MB/step)")


def _pairs(raw, n: int, name: str, unit: str) -> FrozenMap:
    """Validated {(i, j): amount} with i < j, both orders of a pair summed."""
    pairs: dict[tuple[int, int], float] = {}
    for key, amount in dict(raw).items():
        try:
            i, j = (int(x) for x in key)
        except (TypeError, ValueError):
            raise PlanError(f"ProcessGraph {name} key {key!r} is not a pair of "
                            "process ids") from None
        if not (0 <= i < n and 0 <= j < n) or i == j:
            raise PlanError(f"ProcessGraph {name} pair {key!r}: expected two different "
                            f"process ids in 0..{n - 1}")
        if not (float(amount) >= 0 and math.isfinite(float(amount))):
            raise PlanError(f"ProcessGraph {name} {key!r}: {unit} must be finite and "
                            f">= 0, got {amount!r}")
        pair = (min(i, j), max(i, j))
        pairs[pair] = pairs.get(pair, 0.0) + float(amount)
    return FrozenMap(sorted(pairs.items()))


def _merged(base: Mapping, extra: Mapping) -> dict:
    out = dict(base)
    for (i, j), amount in extra.items():
        key = (min(i, j), max(i, j))
        out[key] = out.get(key, 0.0) + float(amount)
    return out
