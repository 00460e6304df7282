"""Rank mapping (Paddle's 物理映射): place logical processes onto devices of a Cluster.

Cost of a mapping, in seconds per step, as the cost model charges communication::

    cost = sum over pairs {i, j}: messages_ij * alpha(d_i, d_j) + bytes_ij * beta(d_i, d_j)

with alpha and beta the seconds per message and per byte of the best path between the
two devices (:func:`distgraph.passes.cost.formulas.link_rates` of ``Cluster.latency`` µs
and ``Cluster.bandwidth`` GB/s), and the messages and bytes from the process graph: the
cost model's load of each step (:func:`~distgraph.passes.cost.formulas.ring_load`) spread
over the pairs it is sent on. So a collective costs the sum, over its processes, of
:func:`~distgraph.passes.cost.formulas.collective_time` on each one's own hop, where the
estimate charges the group once at its ring's slowest hop, shared with the other groups
that cross between the same machines (:class:`~distgraph.passes.cost.prices.Rings`). The
sum is what the swaps below can update one pair at a time (the ring's slowest hop and
the sharing of a link depend on where every other process is); it ranks placements, and
the traffic of collectives that overlap is summed, not raced.

:func:`map_ranks` works in two phases:

1. Greedy, heaviest traffic first: place the process with the largest total traffic;
   then repeatedly take the unplaced process with the most bytes to already placed ones
   and put it on the free compatible device that adds the least cost. Ties go to the
   machine of its heaviest placed neighbour, then to the fullest machine (so groups
   pack into machines instead of spreading), then to the lowest device id.
2. Improvement by pairwise swaps: for each process, the best exchange with another
   process (or a move to a free device) among compatible devices is applied when it
   lowers the cost; rounds repeat until one finds no gain or ``max_swap_rounds`` rounds
   (default 20) have run. The gain of every candidate exchange for one process is one
   numpy expression over a (processes x devices) matrix ``M[p, d]`` = cost of process p
   on device d given the others, updated incrementally after each swap; so a round costs
   O(P * D) and 1024 processes on 1024 devices map in a second or two.

Compatibility: a process that names a device type only goes on devices of that type, and
only on devices whose usable memory (``Device.usable_memory``: memory less its reserve) is
at least its memory need. The baselines :func:`bfs_first_free_mapping`
(Paddle's simple rule) and :func:`random_mapping` respect the same constraints.

Example::

    >>> from distgraph.resources.cluster import Cluster
    >>> from distgraph.passes.mapping.process_graph import ProcessGraph, grid_groups
    >>> c = Cluster.from_file("resources/clusters/gpu_2x8.yaml")    # doctest: +SKIP
    >>> g = ProcessGraph(16).with_group_traffic(grid_groups((2, 8), 1), 64e6)
    >>> m = map_ranks(g, c)                                           # doctest: +SKIP
    >>> sorted(c.device(m.process_to_device[p]).machine_id for p in range(8))  # doctest: +SKIP
    [0, 0, 0, 0, 0, 0, 0, 0]
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from distgraph.errors import PlanError
from distgraph.passes.cost.formulas import link_rates
from distgraph.passes.mapping.process_graph import ProcessGraph
from distgraph.resources.cluster import Cluster, FrozenMap, _ranges

DEFAULT_SWAP_ROUNDS = 20
MAX_MACHINE_LINES = 16


@dataclass(frozen=True)
class RankMapping:
    """Where each process runs, and the mapping's cost in seconds per step (see module)."""

    process_to_device: Mapping[int, int]
    cost: float
    method: str
    cluster_name: str = ""
    device_machine: Mapping[int, int] = field(default_factory=FrozenMap, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "process_to_device", FrozenMap(self.process_to_device))
        object.__setattr__(self, "device_machine", FrozenMap(self.device_machine))

    def __str__(self):
        n = len(self.process_to_device)
        lines = [f"RankMapping[{self.method}] {n} processes on cluster "
                 f"{self.cluster_name!r}: cost {self.cost * 1e3:.6g} ms/step"]
        by_machine: dict[int, list[str]] = {}
        for p, d in sorted(self.process_to_device.items()):
            by_machine.setdefault(self.device_machine.get(d, -1), []).append(f"p{p}->{d}")
        for k, (machine, items) in enumerate(sorted(by_machine.items())):
            if k == MAX_MACHINE_LINES:
                lines.append(f"  ... {len(by_machine) - k} more machines")
                break
            lines.append(f"  machine {machine}: " + " ".join(items))
        return "\n".join(lines)


class _Rows:
    """A P x P matrix by compressed rows, as scipy's CSR holds it (``indptr``,
    ``indices`` sorted within a row, ``data``; duplicate entries summed, zeros kept), with
    what the mappers need of it. Not scipy's: importing scipy.sparse is a fifth of a second
    of every rank's start, for matrices of a few entries per process."""

    def __init__(self, rows, cols, values, size: int):
        keys, where = np.unique(np.asarray(rows) * size + np.asarray(cols), return_inverse=True)
        self.size = size
        self.row_of, self.indices = np.divmod(keys, size)
        self.data = np.bincount(where, weights=values, minlength=keys.size).astype(float)
        self.indptr = np.searchsorted(self.row_of, np.arange(size + 1))

    def row_sums(self) -> np.ndarray:
        return np.bincount(self.row_of, weights=self.data, minlength=self.size)

    def __matmul__(self, dense: np.ndarray) -> np.ndarray:
        """``self @ dense``: every row's k-th stored entry added at once, k = 0, 1, ...
        (each row summed in order, as scipy's CSR product does; no ``[entries, columns]``
        array: thousands of processes that all-to-all with a hundred peers each store
        hundreds of thousands of entries)."""
        out = np.zeros((self.size, dense.shape[1]))
        place = np.arange(self.row_of.size) - self.indptr[self.row_of]
        order = np.argsort(place, kind="stable")
        bounds = np.searchsorted(place[order], np.arange(place.max(initial=-1) + 2))
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            at = order[lo:hi]
            out[self.row_of[at]] += self.data[at, None] * dense[self.indices[at]]
        return out


class _Problem:
    """Arrays every mapper shares: devices, their pairwise cost, compatibility, traffic."""

    def __init__(self, graph: ProcessGraph, cluster: Cluster, devices=None):
        self.graph = graph
        self.cluster = cluster
        devs = cluster.devices if devices is None else [cluster.device(i) for i in devices]
        if len({d.global_id for d in devs}) != len(devs):
            raise PlanError("map_ranks: the allowed devices list a device twice")
        devs = sorted(devs, key=lambda d: d.global_id)
        self.devices = devs
        self.ids = np.array([d.global_id for d in devs])
        machine_ids = sorted({d.machine_id for d in devs})
        self.machine = np.array([machine_ids.index(d.machine_id) for d in devs])
        self.num_machines = len(machine_ids)
        per_message, per_byte = link_rates(*cluster.path_matrices(self.ids.tolist()))
        np.fill_diagonal(per_byte, 0.0)
        np.fill_diagonal(per_message, 0.0)
        P = graph.num_processes
        types = np.array([d.type for d in devs])
        memory = np.array([d.usable_memory() for d in devs])    # what a process may fill
        self.compat = np.empty((P, len(devs)), dtype=bool)
        for p in range(P):
            want = graph.device_types[p]
            ok = memory >= graph.memory[p]
            self.compat[p] = ok if want is None else ok & (types == want)
        keys = sorted(set(graph.traffic) | set(graph.messages))
        pairs = np.array(keys, dtype=np.intp).reshape(-1, 2)
        nbytes = np.array([graph.traffic.get(k, 0.0) for k in keys])
        msgs = np.array([graph.messages.get(k, 0.0) for k in keys])
        self.pairs = pairs
        rows = np.concatenate([pairs[:, 0], pairs[:, 1]])
        cols = np.concatenate([pairs[:, 1], pairs[:, 0]])
        # Every cost below is linear in (amount on a pair) x (cost per unit between two
        # devices); the bytes and the messages are two such terms, kept side by side.
        self.terms = [(_Rows(rows, cols, np.concatenate([w, w]), P), c, w)
                      for w, c in ((nbytes, per_byte), (msgs, per_message))]
        self.T = self.terms[0][0]            # bytes: what the heuristics weigh processes by
        self.total = self.T.row_sums()
        self._check(types, memory)

    def _check(self, types, memory):
        g, name = self.graph, self.cluster.name or "(unnamed)"
        asked: dict[str, int] = {}
        for t in g.device_types:
            if t is not None:
                asked[t] = asked.get(t, 0) + 1
        for t, n in asked.items():
            have = np.flatnonzero(types == t)
            if n > have.size:
                where = f"ids {_ranges(self.ids[have].tolist())}" if have.size else \
                    f"it has {', '.join(sorted(set(types.tolist())))}"
                raise PlanError(f"the plan has {n} processes that need a {t} device, but "
                                f"cluster {name!r} has only {have.size} {t} devices ({where}); "
                                f"use fewer {t} processes or a cluster with more {t} devices")
        if g.num_processes > len(self.devices):
            raise PlanError(f"the plan has {g.num_processes} processes but cluster {name!r} "
                            f"offers only {len(self.devices)} devices; use fewer processes")
        for p in np.flatnonzero(~self.compat.any(axis=1)):
            t = g.device_types[p]
            pool = memory if t is None else memory[types == t]
            raise PlanError(f"process {p} needs {g.memory[p]:g} GB on a {t or 'any'} device, "
                            f"but the largest such device of cluster {name!r} may hold "
                            f"{pool.max():.4g} GB (its usable memory); lower its memory need "
                            "(more model parallelism, recompute) or use devices with more "
                            "memory")
        unfit = np.flatnonzero(~self.compat.any(axis=0))     # devices that hold no process
        if g.num_processes > len(self.devices) - unfit.size:
            raise PlanError(f"the plan has {g.num_processes} processes, but only "
                            f"{len(self.devices) - unfit.size} of the {len(self.devices)} "
                            f"devices of cluster {name!r} can hold one: "
                            + "; ".join(self._unfit(d) for d in unfit[:5])
                            + (f"; and {unfit.size - 5} more" if unfit.size > 5 else "")
                            + ". Correct the resource file, or plan for fewer processes")

    def _unfit(self, d: int, p: int | None = None) -> str:
        """Why device ``d`` takes process ``p`` (None: any process) nowhere, in words."""
        g, dev = self.graph, self.devices[d]
        ps = range(g.num_processes) if p is None else [p]
        wanted = {g.device_types[q] for q in ps} - {None}
        what = f"device {dev.global_id} ({dev.type} {dev.model}, {dev.memory_text})"
        if wanted and dev.type not in wanted:
            return f"{what} is not a {' or '.join(sorted(wanted))}"
        need = min(g.memory[q] for q in ps)
        return (f"{what} has less memory than the {need:g} GB "
                + (f"process {p} needs" if p is not None else "the smallest process needs"))

    def neighbours(self, p: int):
        """(neighbour ids, their bytes with p); every term shares this sparsity."""
        lo, hi = self.T.indptr[p], self.T.indptr[p + 1]
        return self.T.indices[lo:hi], self.T.data[lo:hi]

    def weights(self, p: int):
        """Per term: (neighbour ids, amounts with p, cost matrix)."""
        for T, C, _ in self.terms:
            lo, hi = T.indptr[p], T.indptr[p + 1]
            yield T.indices[lo:hi], T.data[lo:hi], C

    def added_cost(self, p: int, dev_of: np.ndarray, placed: np.ndarray) -> np.ndarray:
        """Cost of p on each device towards its placed neighbours."""
        added = np.zeros(len(self.devices))
        for nb, w, C in self.weights(p):
            here = placed[nb]
            if here.any():
                added += w[here] @ C[dev_of[nb[here]]]
        return added

    def cost_of(self, dev_of: np.ndarray) -> float:
        if not self.pairs.size:
            return 0.0
        a, b = dev_of[self.pairs[:, 0]], dev_of[self.pairs[:, 1]]
        return float(sum(np.dot(w, C[a, b]) for _, C, w in self.terms))

    def result(self, dev_of: np.ndarray, method: str) -> RankMapping:
        mapping = {p: int(self.ids[d]) for p, d in enumerate(dev_of)}
        machines = {int(i): d.machine_id for i, d in zip(self.ids, self.devices)}
        return RankMapping(mapping, self.cost_of(dev_of), method, self.cluster.name, machines)

    def no_device(self, p: int, free):
        left = np.flatnonzero(free)
        said = "; ".join(self._unfit(d, p) for d in left[:5]) or "none is left"
        raise PlanError(f"no free device is left for process {p} "
                        f"({self.graph.device_types[p] or 'any'} type, "
                        f"{self.graph.memory[p]:g} GB): the free devices cannot hold it "
                        f"({said}); the processes with large memory needs take the only "
                        "devices that fit them; lower the needs or add devices")


def map_ranks(process_graph: ProcessGraph, cluster: Cluster, *, devices=None,
              max_swap_rounds: int = DEFAULT_SWAP_ROUNDS) -> RankMapping:
    """Greedy heaviest-traffic-first placement, then pairwise swaps (see module docstring);
    the BFS first-free placement improved by the same swaps is kept if it is cheaper.

    ``devices`` restricts the candidates to these global ids (e.g. one mesh's
    ``device_ids``); by default every compute device of the cluster is a candidate.
    """
    prob = _Problem(process_graph, cluster, devices)
    dev_of = _greedy(prob)
    rounds = _improve(prob, dev_of, max_swap_rounds)
    best = prob.result(dev_of, f"greedy+swap({rounds} rounds)")
    # Swaps only reach a local optimum; improving the BFS placement too and keeping the
    # cheaper result guarantees the mapper never loses to that baseline.
    bfs = _bfs(prob)
    rounds = _improve(prob, bfs, max_swap_rounds)
    other = prob.result(bfs, f"bfs+swap({rounds} rounds)")
    return other if other.cost < best.cost else best


def improve_mapping(process_graph: ProcessGraph, cluster: Cluster,
                    process_to_device: Mapping[int, int], *, devices=None,
                    max_swap_rounds: int = DEFAULT_SWAP_ROUNDS) -> RankMapping:
    """Phase 2 of :func:`map_ranks` alone: pairwise swaps starting from a given mapping."""
    prob = _Problem(process_graph, cluster, devices)
    pos = {int(g): k for k, g in enumerate(prob.ids)}
    try:
        dev_of = np.array([pos[int(process_to_device[p])]
                           for p in range(process_graph.num_processes)])
    except KeyError as err:
        raise PlanError(f"improve_mapping: process or device {err.args[0]!r} is missing from "
                        "the mapping or not a candidate device") from None
    if len(set(dev_of.tolist())) != dev_of.size:
        raise PlanError("improve_mapping: two processes share a device")
    if not prob.compat[np.arange(dev_of.size), dev_of].all():
        raise PlanError("improve_mapping: the start mapping puts a process on an "
                        "incompatible device (type or memory)")
    rounds = _improve(prob, dev_of, max_swap_rounds)
    return prob.result(dev_of, f"swap({rounds} rounds)")


def _greedy(prob: _Problem) -> np.ndarray:
    P, D = prob.compat.shape
    dev_of = np.full(P, -1)
    placed = np.zeros(P, dtype=bool)
    free = np.ones(D, dtype=bool)
    used = np.zeros(prob.num_machines)
    attach = np.zeros(P)
    for _ in range(P):
        score = np.where(placed, -1.0, attach)
        top = np.flatnonzero(score == score.max())
        if top.size > 1:
            top = top[prob.total[top] == prob.total[top].max()]
        p = int(top[0])
        nb, w = prob.neighbours(p)
        here = placed[nb]
        added = prob.added_cost(p, dev_of, placed)
        ok = free & prob.compat[p]
        if not ok.any():
            prob.no_device(p, free)
        cand = np.where(ok, added, np.inf)
        best = cand.min()
        idx = np.flatnonzero(cand <= best + 1e-9 * abs(best))
        if here.any():
            heaviest = nb[here][np.argmax(w[here])]
            same = idx[prob.machine[idx] == prob.machine[dev_of[heaviest]]]
            idx = same if same.size else idx
        fill = used[prob.machine[idx]]
        d = int(idx[np.argmax(fill)])
        dev_of[p] = d
        placed[p] = True
        free[d] = False
        used[prob.machine[d]] += 1
        attach[nb] += w
    return dev_of


def _improve(prob: _Problem, dev_of: np.ndarray, max_rounds: int) -> int:
    """Pairwise swaps in place; returns the number of rounds run."""
    P, D = prob.compat.shape
    compat = prob.compat
    slot = np.full(D, -1)
    slot[dev_of] = np.arange(P)
    M = sum(T @ C[dev_of, :] for T, C, _ in prob.terms)  # M[p, d]: p on d
    own = M[np.arange(P), dev_of]
    tol = 1e-12 * max(prob.cost_of(dev_of), 1e-300)
    order = np.argsort(-prob.total, kind="stable")
    order = order[prob.total[order] > 0]
    rounds = 0
    while rounds < max_rounds:
        rounds += 1
        swaps = 0
        for p in order:
            dp = dev_of[p]
            occ = slot >= 0
            qs = slot[occ]
            # Gain of p <-> q (q on d, dp where p is):
            # M[p,d] - M[p,dp] + M[q,dp] - M[q,d] + 2 T[p,q] C[dp,d]; a free d has no q.
            delta = M[p] - own[p]
            delta[occ] += M[qs, dp] - own[qs]
            for nb, w, C in prob.weights(p):
                t_at = np.zeros(D)
                t_at[dev_of[nb]] = w
                delta[occ] += 2.0 * t_at[occ] * C[dp, occ]
            ok = compat[p].copy()
            ok[occ] &= compat[qs, dp]
            ok[dp] = False
            delta[~ok] = np.inf
            d = int(np.argmin(delta))
            if delta[d] < -tol:
                _swap(prob, M, own, dev_of, slot, p, d)
                swaps += 1
        if swaps == 0:
            break
    return rounds


def _swap(prob: _Problem, M, own, dev_of, slot, p: int, d: int):
    dp, q = dev_of[p], slot[d]
    touched = [[p]]
    for nb_p, w_p, C in prob.weights(p):
        M[nb_p] += w_p[:, None] * (C[d] - C[dp])
        touched.append(nb_p)
    if q >= 0:
        for nb_q, w_q, C in prob.weights(q):
            M[nb_q] -= w_q[:, None] * (C[d] - C[dp])
            touched.append(nb_q)
        dev_of[q] = dp
        touched.append([q])
    dev_of[p] = d
    slot[d], slot[dp] = p, q
    rows = np.unique(np.concatenate(touched)).astype(np.intp)
    own[rows] = M[rows, dev_of[rows]]


def bfs_first_free_mapping(process_graph: ProcessGraph, cluster: Cluster, *,
                           devices=None) -> RankMapping:
    """Paddle-style baseline: BFS over the process graph from process 0 (neighbours by
    id; an unreached process restarts the search), each onto the first free compatible
    device in global-id order."""
    prob = _Problem(process_graph, cluster, devices)
    return prob.result(_bfs(prob), "bfs-first-free")


def _bfs(prob: _Problem) -> np.ndarray:
    P, D = prob.compat.shape
    dev_of = np.full(P, -1)
    free = np.ones(D, dtype=bool)
    seen = np.zeros(P, dtype=bool)
    for start in range(P):
        if seen[start]:
            continue
        seen[start] = True
        queue = deque([start])
        while queue:
            p = queue.popleft()
            ok = np.flatnonzero(free & prob.compat[p])
            if not ok.size:
                prob.no_device(p, free)
            dev_of[p] = ok[0]
            free[ok[0]] = False
            for q in sorted(prob.neighbours(p)[0].tolist()):
                if not seen[q]:
                    seen[q] = True
                    queue.append(q)
    return dev_of


def random_mapping(process_graph: ProcessGraph, cluster: Cluster, seed: int = 0, *,
                   devices=None) -> RankMapping:
    """Processes in random order, each onto a uniformly random free compatible device."""
    prob = _Problem(process_graph, cluster, devices)
    return prob.result(_random(prob, np.random.default_rng(seed)), f"random(seed={seed})")


def _random(prob: _Problem, rng) -> np.ndarray:
    P, D = prob.compat.shape
    dev_of = np.full(P, -1)
    free = np.ones(D, dtype=bool)
    for p in rng.permutation(P):
        ok = np.flatnonzero(free & prob.compat[p])
        if not ok.size:
            prob.no_device(int(p), free)
        d = ok[rng.integers(ok.size)]
        dev_of[p] = d
        free[d] = False
    return dev_of


def best_random_mapping(process_graph: ProcessGraph, cluster: Cluster, tries: int = 100,
                        seed: int = 0, *, devices=None) -> RankMapping:
    """The cheapest of ``tries`` random mappings (one seeded generator for all)."""
    prob = _Problem(process_graph, cluster, devices)
    rng = np.random.default_rng(seed)
    best = min((_random(prob, rng) for _ in range(tries)), key=prob.cost_of)
    return prob.result(best, f"best-of-{tries}-random(seed={seed})")


def mapping_cost(process_graph: ProcessGraph, cluster: Cluster,
                 process_to_device: Mapping[int, int]) -> float:
    """Cost (seconds per step, see module docstring) of any process -> device mapping."""
    P = process_graph.num_processes
    missing = [p for p in range(P) if p not in process_to_device]
    if missing:
        raise PlanError(f"mapping_cost: processes {_ranges(missing)} have no device")
    devs = [int(process_to_device[p]) for p in range(P)]
    if len(set(devs)) != P:
        raise PlanError("mapping_cost: two processes share a device")
    ids = sorted(set(devs))
    per_message, per_byte = link_rates(*cluster.path_matrices(ids))
    pos = {g: k for k, g in enumerate(ids)}
    total = 0.0
    for (i, j), nbytes in process_graph.traffic.items():
        total += nbytes * per_byte[pos[devs[i]], pos[devs[j]]]
    for (i, j), count in process_graph.messages.items():
        total += count * per_message[pos[devs[i]], pos[devs[j]]]
    return float(total)
