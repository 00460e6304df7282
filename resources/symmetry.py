"""Best paths of a large cluster from a few machines of each kind.

All-pairs matrices over every node cost n^2: 2 GB each for the 32,800 GPUs, NICs and
switches of a 16,384-GPU cluster. But such a cluster is made of machines that are the
same: two machines are *interchangeable* when their nodes, in order, have the same links
among themselves and the same links (bandwidth, latency) to the same switches, and no
link joins them to another machine's nodes. Swapping two interchangeable machines maps
the graph onto itself, so every path figure between nodes of the cluster equals one
between nodes of a *reduced* cluster that keeps up to three machines of each kind (the
switches and unique machines all kept):

- two nodes of one machine: the same nodes of the kind's first kept machine;
- nodes of two machines of one kind: the first and the second kept machine;
- nodes of machines of two kinds, or a switch: the first kept machine of each kind.

The third kept machine carries paths that pass through a machine other than both ends.
The reduction assumes that no best path passes through two other machines of one kind,
which holds for switched fabrics (a machine is a leaf of the network: a path through it
is never better than the switches'); tests compare it with the full matrices.

Example::

    >>> from distgraph.resources.cluster import Cluster
    >>> c = Cluster.local(2)
    >>> p = ReducedPaths(c.machines, c.switches, c.links)
    >>> p.lookup([0], [1])
    (array([10.]), array([1.]))
"""

from __future__ import annotations

import numpy as np

from distgraph.resources.paths import best_paths

KEPT = 3          # machines kept per kind: the two ends' and one to pass through
# Pairs looked up at once where a row must be measured pair by pair: bounds the index
# arrays to some 100 MB.
_PAIRS_AT_ONCE = 1 << 22


class ReducedPaths:
    """Best-path bandwidth (GB/s) and latency (µs) between any two node global ids."""

    def __init__(self, machines, switches, links):
        node_ids = [n for m in machines for n in m.node_ids] + [s.global_id for s in switches]
        size = max(node_ids) + 1
        machine_of = np.full(size, -1, dtype=np.intp)
        slot = np.full(size, -1, dtype=np.intp)
        for k, m in enumerate(machines):
            ids = m.node_ids
            machine_of[ids] = k
            slot[ids] = np.arange(len(ids))
        kind = _kinds(machines, links, machine_of, slot)
        kept_machines = []
        counts: dict[int, int] = {}
        for k, c in enumerate(kind):
            if c < 0 or counts.get(c, 0) < KEPT:
                counts[c] = counts.get(c, 0) + 1
                kept_machines.append(k)
        kept_nodes = [n for k in kept_machines for n in machines[k].node_ids]
        kept_nodes += [s.global_id for s in switches]
        reduced = np.full(size, -1, dtype=np.intp)
        reduced[kept_nodes] = np.arange(len(kept_nodes))
        # rep[c, r, s]: reduced index of slot s of the kind c's r-th kept machine
        kinds = int(kind.max()) + 1 if kind.size and kind.max() >= 0 else 0
        width = max((len(m.node_ids) for m in machines), default=0)
        rep = np.full((max(kinds, 1), KEPT, max(width, 1)), -1, dtype=np.intp)
        seen: dict[int, int] = {}
        for k in kept_machines:
            c = kind[k]
            if c >= 0:
                r = seen.get(c, 0)
                seen[c] = r + 1
                ids = machines[k].node_ids
                rep[c, r, :len(ids)] = reduced[ids]
        keep = [ln for ln in links if reduced[ln.source] >= 0 and reduced[ln.target] >= 0]
        self._bw, self._lat = best_paths(
            len(kept_nodes), [reduced[ln.source] for ln in keep],
            [reduced[ln.target] for ln in keep], [ln.bandwidth for ln in keep],
            [ln.latency for ln in keep])
        node_kind = np.full(size, -1, dtype=np.intp)
        has = machine_of >= 0
        node_kind[has] = kind[machine_of[has]]
        self._known = np.zeros(size, dtype=bool)
        self._known[node_ids] = True
        self._machine, self._slot, self._kind = machine_of, slot, node_kind
        self._reduced, self._rep = reduced, rep
        self.size = size
        self.reduced_nodes = len(kept_nodes)
        self._lists = None        # the arrays as Python lists, made on the first pair()

    def pair(self, a: int, b: int) -> tuple[float, float] | None:
        """(bandwidth, latency) between two global ids (None: one is not a node), in
        plain Python: the cost model asks for single pairs hundreds of thousands of times
        while planning."""
        if self._lists is None:
            self._lists = (self._kind.tolist(), self._slot.tolist(), self._machine.tolist(),
                           self._reduced.tolist(), self._rep.tolist(), self._bw.tolist(),
                           self._lat.tolist(), self._known.tolist())
        kind, slot, machine, reduced, rep, bw, lat, known = self._lists
        if not (0 <= a < self.size and 0 <= b < self.size and known[a] and known[b]):
            return None
        ka, kb = kind[a], kind[b]
        ra = rep[ka][0][slot[a]] if ka >= 0 else reduced[a]
        if kb < 0:
            rb = reduced[b]
        else:
            rb = rep[kb][1 if ka == kb and machine[a] != machine[b] else 0][slot[b]]
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
        ka, kb = self._kind[a], self._kind[b]
        sa, sb = self._slot[a], self._slot[b]
        ra = np.where(ka >= 0, self._rep[np.maximum(ka, 0), 0, np.maximum(sa, 0)],
                      self._reduced[a])
        other = (ka == kb) & (self._machine[a] != self._machine[b])
        rb = np.where(kb >= 0, self._rep[np.maximum(kb, 0), other.astype(np.intp),
                                         np.maximum(sb, 0)], self._reduced[b])
        return ra, rb

    def lookup(self, a, b) -> tuple[np.ndarray, np.ndarray]:
        """(bandwidth, latency) of the pairs ``(a[i], b[i])`` of global ids."""
        ra, rb = self.indices(a, b)
        return self._bw[ra, rb], self._lat[ra, rb]

    def worst(self, rows) -> tuple[float, float]:
        """(min bandwidth, max latency) over the pairs of different ids within each row of
        ``rows`` (an (r, n) array of global ids, n >= 2): a mesh dim's worst pair.

        A row whose ids lie in n different machines is measured on one or two ids per
        kind and slot: any two of its ids that share those are interchangeable there.
        """
        rows = np.asarray(rows, dtype=np.intp)
        n = rows.shape[1]
        machines = np.sort(self._machine[rows], axis=1)
        apart = (machines >= 0).all(axis=1) & (np.diff(machines, axis=1) != 0).all(axis=1)
        bw, lat = np.inf, 0.0
        for row in rows[apart]:
            code = np.where(self._kind[row] >= 0, self.indices(row, row)[0],
                            -1 - np.arange(n))
            _, first, counts = np.unique(code, return_index=True, return_counts=True)
            picked = row[first]
            second = [row[np.flatnonzero(code == code[f])[1]] for f in first[counts > 1]]
            a = np.concatenate([np.repeat(picked, picked.size), picked[counts > 1]])
            b = np.concatenate([np.tile(picked, picked.size), np.array(second, dtype=np.intp)])
            keep = a != b
            sub_bw, sub_lat = self.lookup(a[keep], b[keep])
            if sub_bw.size:
                bw, lat = min(bw, float(sub_bw.min())), max(lat, float(sub_lat.max()))
        rest = rows[~apart]
        off = ~np.eye(n, dtype=bool)
        step = max(1, _PAIRS_AT_ONCE // (n * n))
        for start in range(0, rest.shape[0], step):
            part = rest[start:start + step]
            a = np.broadcast_to(part[:, :, None], part.shape + (n,))[:, off]
            b = np.broadcast_to(part[:, None, :], part.shape + (n,))[:, off]
            sub_bw, sub_lat = self.lookup(a.ravel(), b.ravel())
            bw, lat = min(bw, float(sub_bw.min())), max(lat, float(sub_lat.max()))
        return bw, lat

    def matrices(self, ids) -> tuple[np.ndarray, np.ndarray]:
        """(bandwidth, latency) matrices between ``ids``, in that order."""
        ids = np.asarray(ids, dtype=np.intp)
        n = ids.size
        a = np.repeat(ids, n)
        b = np.tile(ids, n)
        bw, lat = self.lookup(a, b)
        return bw.reshape(n, n), lat.reshape(n, n)


def _kinds(machines, links, machine_of, slot) -> np.ndarray:
    """Each machine's kind (interchangeable machines share one; -1: a unique machine)."""
    size = machine_of.size
    inside: list[list] = [[] for _ in machines]
    outside: list[list] = [[] for _ in machines]
    tied = np.zeros(len(machines), dtype=bool)
    for ln in links:
        ms = machine_of[ln.source] if ln.source < size else -1
        mt = machine_of[ln.target] if ln.target < size else -1
        figure = (ln.bandwidth, ln.latency)
        if ms >= 0 and ms == mt:
            inside[ms].append((min(slot[ln.source], slot[ln.target]),
                               max(slot[ln.source], slot[ln.target])) + figure)
        elif ms >= 0 and mt >= 0:
            tied[ms] = tied[mt] = True      # a machine joined to another machine directly
        elif ms >= 0:
            outside[ms].append((slot[ln.source], ln.target) + figure)
        elif mt >= 0:
            outside[mt].append((slot[ln.target], ln.source) + figure)
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
    return out
