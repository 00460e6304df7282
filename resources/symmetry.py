"""Best paths of a large cluster from a few machines of each kind, and a few nodes of each
kind inside a machine.

All-pairs matrices over every node cost n^2: 2 GB each for the 32,800 GPUs, NICs and
switches of a 16,384-GPU cluster, 800 MB for one machine of 10,000 devices. But such
clusters are made of parts that are the same:

- two machines are *interchangeable* when their nodes, in order (by *slot*), have the same
  links among themselves and the same links (bandwidth, latency) to the same switches, and
  no link joins them to another machine's nodes;
- two nodes of a machine are *twins* when they are in the same link groups (a
  :class:`~distgraph.resources.elements.LinkGroup`: NVLink through NVSwitches, a machine's
  shared memory) and have the same single links to the same other nodes (not to each
  other): the devices of a machine whose devices all reach each other alike.

Swapping two interchangeable machines, or two twins, maps the graph onto itself, so every
path figure between nodes of the cluster equals one between nodes of a *reduced* cluster
that keeps up to three machines of each kind (the switches and unique machines all kept)
and, in each machine kept, up to three nodes of each twin class. A pair of nodes is looked
up as:

- nodes of machines of two kinds, or a switch: each node's *first* stand-in, the node of
  its twin class that comes first, in the first kept machine of its kind;
- nodes of two machines of one kind: the first stand-in, and the second machine's;
- two twins of one machine: the first stand-in, and the class's second node.

The third machine (node) kept carries paths that pass through one other than both ends.
The reduction assumes that no best path passes through two other machines of one kind,
which holds for switched fabrics (a machine is a leaf of the network: a path through it
is never better than the switches'); for twins it holds always (a path through a fourth
twin is never better than one through the third). Tests compare it with the full
matrices.

Example::

    >>> from distgraph.resources.cluster import Cluster
    >>> c = Cluster.local(2)
    >>> p = ReducedPaths(c.machines, c.switches, c.all_links)
    >>> p.lookup([0], [1])
    (array([10.]), array([1.]))
"""

from __future__ import annotations

import numpy as np

from distgraph.resources.elements import LinkGroup
from distgraph.resources.paths import best_paths

KEPT = 3          # machines kept per kind, nodes per twin class: the two ends' and one between
# Pairs looked up at once where a row must be measured pair by pair: bounds the index
# arrays to some 100 MB.
_PAIRS_AT_ONCE = 1 << 22
_LONG_ROW = 64    # ids in a row measured by sorts (see ReducedPaths.worst) above this


class ReducedPaths:
    """Best-path bandwidth (GB/s) and latency (µs) between any two node global ids;
    ``links`` are Links and LinkGroups."""

    def __init__(self, machines, switches, links):
        node_ids = [n for m in machines for n in m.node_ids] + [s.global_id for s in switches]
        size = max(node_ids) + 1
        machine_of = np.full(size, -1, dtype=np.intp)
        slot = np.full(size, -1, dtype=np.intp)
        for k, m in enumerate(machines):
            ids = m.node_ids
            machine_of[ids] = k
            slot[ids] = np.arange(len(ids))
        links = list(links)
        kind, classes_of = _kinds(machines, links, machine_of, slot)
        kept_machines = []
        counts: dict[int, int] = {}
        for k, c in enumerate(kind):
            if c < 0 or counts.get(c, 0) < KEPT:
                counts[c] = counts.get(c, 0) + 1
                kept_machines.append(k)
        twins = {k: classes_of(k) for k in kept_machines}   # machines alike: alike twins
        # each kept machine's nodes, up to KEPT of each twin class, in slot order
        kept_nodes = []
        for k in kept_machines:
            ids, classes = machines[k].node_ids, twins[k]
            rank = _rank_in_class(classes)
            kept_nodes += [ids[s] for s in range(len(ids)) if rank[s] < KEPT]
        kept_nodes += [s.global_id for s in switches]
        reduced = np.full(size, -1, dtype=np.intp)
        reduced[kept_nodes] = np.arange(len(kept_nodes))
        # stand-ins: a node's first (its class's first node in its kind's first kept
        # machine), the second kept machine's, the class's second node
        first = reduced.copy()
        second_machine = np.full(size, -1, dtype=np.intp)
        second_twin = np.full(size, -1, dtype=np.intp)
        rep: dict[int, list] = {}          # kind -> its kept machines, in order
        for k in kept_machines:
            rep.setdefault(kind[k] if kind[k] >= 0 else -1 - k, []).append(k)
        leaders = {k: _leaders(twins[k]) for k in kept_machines}
        for k, m in enumerate(machines):
            reps = rep[kind[k] if kind[k] >= 0 else -1 - k]
            lead, follow = leaders[reps[0]]
            ids = np.array(m.node_ids, dtype=np.intp)
            base = np.array(machines[reps[0]].node_ids, dtype=np.intp)
            first[ids] = reduced[base[lead]]
            has = follow >= 0
            second_twin[ids[has]] = reduced[base[follow[has]]]
            if len(reps) > 1:
                other = np.array(machines[reps[1]].node_ids, dtype=np.intp)
                second_machine[ids] = reduced[other[lead]]
        pairs, groups = _reduced_links(links, reduced)
        self._bw, self._lat = best_paths(
            len(kept_nodes), [a for a, _, _ in pairs] + [a for a, _, _ in groups],
            [b for _, b, _ in pairs] + [b for _, b, _ in groups],
            [ln.bandwidth for _, _, ln in pairs + groups],
            [ln.latency for _, _, ln in pairs + groups])
        node_kind = np.full(size, -1, dtype=np.intp)
        has = machine_of >= 0
        node_kind[has] = kind[machine_of[has]]
        self._known = np.zeros(size, dtype=bool)
        self._known[node_ids] = True
        self._machine, self._kind = machine_of, node_kind
        self._first, self._second_machine, self._second_twin = first, second_machine, second_twin
        self.size = size
        self.reduced_nodes = len(kept_nodes)
        self._lists = None        # the arrays as Python lists, made on the first pair()

    def pair(self, a: int, b: int) -> tuple[float, float] | None:
        """(bandwidth, latency) between two global ids (None: one is not a node), in
        plain Python: the cost model asks for single pairs hundreds of thousands of times
        while planning."""
        if self._lists is None:
            self._lists = (self._kind.tolist(), self._machine.tolist(), self._first.tolist(),
                           self._second_machine.tolist(), self._second_twin.tolist(),
                           self._bw.tolist(), self._lat.tolist(), self._known.tolist())
        kind, machine, first, second_machine, second_twin, bw, lat, known = self._lists
        if not (0 <= a < self.size and 0 <= b < self.size and known[a] and known[b]):
            return None
        ra, rb = first[a], first[b]
        if a != b and machine[a] >= 0:
            if machine[a] != machine[b] and kind[a] == kind[b] >= 0:
                rb = second_machine[b]
            elif machine[a] == machine[b] and ra == rb:
                rb = second_twin[b]
        return bw[ra][rb], lat[ra][rb]

    def known(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.intp)
        ok = (ids >= 0) & (ids < self.size)
        ok[ok] = self._known[ids[ok]]
        return ok

    def indices(self, a, b) -> tuple[np.ndarray, np.ndarray]:
        """Reduced-matrix rows and columns standing for the pairs ``(a[i], b[i])``."""
        a = np.asarray(a, dtype=np.intp)
        b = np.asarray(b, dtype=np.intp)
        ra, rb = self._first[a], self._first[b]
        ma, mb = self._machine[a], self._machine[b]
        other = (a != b) & (ma >= 0) & (ma != mb) & (self._kind[a] == self._kind[b]) \
            & (self._kind[a] >= 0)
        twin = (a != b) & (ma >= 0) & (ma == mb) & (ra == rb)
        rb = np.where(other, self._second_machine[b], np.where(twin, self._second_twin[b], rb))
        return ra, rb

    def lookup(self, a, b) -> tuple[np.ndarray, np.ndarray]:
        """(bandwidth, latency) of the pairs ``(a[i], b[i])`` of global ids."""
        ra, rb = self.indices(a, b)
        return self._bw[ra, rb], self._lat[ra, rb]

    def worst(self, rows) -> tuple[float, float]:
        """(min bandwidth, max latency) over the pairs of different ids within each row of
        ``rows`` (an (r, n) array of global ids, n >= 2): a mesh dim's worst pair.

        Short rows of few pairs in all are looked up whole; a long row is measured on up
        to two ids of each of its *sorts*: ids of one first stand-in, and of one machine
        where the row holds several of that machine, else of any (two ids of one sort
        are interchangeable towards every other id of the row)."""
        rows = np.asarray(rows, dtype=np.intp)
        n = rows.shape[1]
        bw, lat = np.inf, 0.0
        if n > _LONG_ROW or rows.shape[0] * n * n > _PAIRS_AT_ONCE:
            for row in np.unique(self._sorted_rows(rows), axis=0, return_index=True)[1]:
                picked = self._picked(rows[row])
                a, b = np.repeat(picked, picked.size), np.tile(picked, picked.size)
                keep = a != b
                sub_bw, sub_lat = self.lookup(a[keep], b[keep])
                if sub_bw.size:
                    bw, lat = min(bw, float(sub_bw.min())), max(lat, float(sub_lat.max()))
            return bw, lat
        off = ~np.eye(n, dtype=bool)
        step = max(1, _PAIRS_AT_ONCE // (n * n))
        for start in range(0, rows.shape[0], step):
            part = rows[start:start + step]
            a = np.broadcast_to(part[:, :, None], part.shape + (n,))[:, off]
            b = np.broadcast_to(part[:, None, :], part.shape + (n,))[:, off]
            sub_bw, sub_lat = self.lookup(a.ravel(), b.ravel())
            bw, lat = min(bw, float(sub_bw.min())), max(lat, float(sub_lat.max()))
        return bw, lat

    def _sorts(self, row) -> np.ndarray:
        """Each id's sort within ``row`` (see :meth:`worst`), as one integer."""
        machine = self._machine[row]
        _, where, count = np.unique(machine, return_inverse=True, return_counts=True)
        shared = (count[where] > 1) & (machine >= 0)
        return self._first[row] * (row.size + 1) + np.where(shared, where + 1, 0)

    def _sorted_rows(self, rows) -> np.ndarray:
        """Each row's sorts, sorted: rows that equal are measured once."""
        return np.sort(np.array([self._sorts(r) for r in rows]), axis=1)

    def _picked(self, row) -> np.ndarray:
        """Up to two ids of each sort of ``row``."""
        sorts = self._sorts(row)
        order = np.argsort(sorts, kind="stable")
        s = sorts[order]
        start = np.r_[True, s[1:] != s[:-1]]
        second = np.r_[False, start[:-1]] & ~start
        return row[order[start | second]]

    def matrices(self, ids) -> tuple[np.ndarray, np.ndarray]:
        """(bandwidth, latency) matrices between ``ids``, in that order."""
        ids = np.asarray(ids, dtype=np.intp)
        n = ids.size
        a = np.repeat(ids, n)
        b = np.tile(ids, n)
        bw, lat = self.lookup(a, b)
        return bw.reshape(n, n), lat.reshape(n, n)


def _rank_in_class(classes) -> list:
    """Each slot's place among the slots of its twin class (0 for the first)."""
    seen: dict[int, int] = {}
    out = []
    for c in classes:
        out.append(seen.get(c, 0))
        seen[c] = seen.get(c, 0) + 1
    return out


def _leaders(classes) -> tuple[np.ndarray, np.ndarray]:
    """Per slot: the first slot of its twin class; the second (-1 where it has one)."""
    first: dict[int, int] = {}
    second: dict[int, int] = {}
    for s, c in enumerate(classes):
        if c not in first:
            first[c] = s
        elif c not in second:
            second[c] = s
    return (np.array([first[c] for c in classes], dtype=np.intp),
            np.array([second.get(c, -1) for c in classes], dtype=np.intp))


def _reduced_links(links, reduced) -> tuple[list, list]:
    """The links among kept nodes, as (reduced end, reduced end, link): each single link
    with both ends kept, and each pair of kept members of a group."""
    pairs, groups = [], []
    for ln in links:
        ends = [int(reduced[e]) for e in ln.endpoints if reduced[e] >= 0]
        if isinstance(ln, LinkGroup):
            groups += [(a, b, ln) for i, a in enumerate(ends) for b in ends[i + 1:]]
        elif len(ends) == 2:
            pairs.append((ends[0], ends[1], ln))
    return pairs, groups


def _kinds(machines, links, machine_of, slot) -> tuple[np.ndarray, object]:
    """(each machine's kind: interchangeable machines share one, -1 a unique machine;
    a function giving machine k's twin class per slot)."""
    size = machine_of.size
    inside: list[list] = [[] for _ in machines]
    outside: list[list] = [[] for _ in machines]
    single: list[dict] = [{} for _ in machines]     # slot -> its single links, described
    member: list[dict] = [{} for _ in machines]     # slot -> the groups it is in
    tied = np.zeros(len(machines), dtype=bool)
    machine_list, slot_list = machine_of.tolist(), slot.tolist()

    def at(node):
        return (machine_list[node], slot_list[node]) if node < size \
            and machine_list[node] >= 0 else (-1, -1)

    for j, ln in enumerate(links):
        figure = (ln.bandwidth, ln.latency)
        ends = [at(e) for e in ln.endpoints]
        within = {m for m, _ in ends if m >= 0}
        if isinstance(ln, LinkGroup):
            if len(within) > 1:
                tied[list(within)] = True       # a group across machines ties them
            for (m, s), e in zip(ends, ln.endpoints):
                if m >= 0:
                    member[m].setdefault(s, []).append(j)
            if len(within) == 1 and all(m >= 0 for m, _ in ends):
                (m,) = within
                inside[m].append(("group", tuple(s for _, s in ends)) + figure)
            elif len(within) == 1:
                (m,) = within
                outside[m].append(("group", tuple(s if mm >= 0 else -1 - e for (mm, s), e
                                                  in zip(ends, ln.endpoints))) + figure)
            continue
        (ms, ss), (mt, st) = ends
        if ms >= 0 and ms == mt:
            inside[ms].append(("link", min(ss, st), max(ss, st)) + figure)
            single[ms].setdefault(ss, []).append(("slot", st) + figure)
            single[ms].setdefault(st, []).append(("slot", ss) + figure)
        elif ms >= 0 and mt >= 0:
            tied[ms] = tied[mt] = True      # a machine joined to another machine directly
            single[ms].setdefault(ss, []).append(("node", ln.target) + figure)
            single[mt].setdefault(st, []).append(("node", ln.source) + figure)
        elif ms >= 0:
            outside[ms].append(("link", ss, ln.target) + figure)
            single[ms].setdefault(ss, []).append(("node", ln.target) + figure)
        elif mt >= 0:
            outside[mt].append(("link", st, ln.source) + figure)
            single[mt].setdefault(st, []).append(("node", ln.source) + figure)

    def twins(k: int) -> list:
        classes: dict[tuple, int] = {}
        return [classes.setdefault((tuple(member[k].get(s, ())),
                                    tuple(sorted(single[k].get(s, ())))), len(classes))
                for s in range(len(machines[k].node_ids))]

    signatures: dict[tuple, int] = {}
    out = np.full(len(machines), -1, dtype=np.intp)
    for k, m in enumerate(machines):
        if tied[k]:
            continue
        sig = (len(m.node_ids), tuple(sorted(inside[k])), tuple(sorted(outside[k])))
        out[k] = signatures.setdefault(sig, len(signatures))
    sizes = np.bincount(out[out >= 0], minlength=len(signatures))
    alone = np.zeros(len(machines), dtype=bool)
    alone[out >= 0] = sizes[out[out >= 0]] < 2
    out[alone] = -1
    return out, twins
