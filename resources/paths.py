"""All-pairs best paths on a graph whose edges carry bandwidth and latency.

The best path between two nodes maximises the bottleneck (smallest) bandwidth along it;
among the paths with that bottleneck it minimises the summed latency. This is what a
large transfer sees: its rate is set by the slowest hop, and of the routes that reach
that rate the quickest to start wins.

The lexicographic order (bandwidth, then latency) is not isotone, so a single Dijkstra
with pair labels would be wrong. Instead, for each distinct bandwidth level b, from the
highest down, the subgraph of edges with bandwidth >= b is formed: pairs that first become
connected at level b have bottleneck b, and their latency is the shortest-latency path
inside that subgraph. Up to :data:`DENSE_NODES` nodes (every machine of a few nodes, the
clusters a job starts with) that is Floyd-Warshall on a dense matrix in numpy; above, scipy's
Dijkstra, run only from sources that still have such pairs. Both give the same matrices;
the small case does not pay scipy's import, a fifth of a second of every rank's start.

Example::

    >>> bw, lat = best_paths(3, [0, 1, 0], [1, 2, 2], [10.0, 10.0, 1.0], [1.0, 1.0, 0.5])
    >>> float(bw[0, 2]), float(lat[0, 2])     # via node 1: bottleneck 10, latency 2
    (10.0, 2.0)
"""

from __future__ import annotations

import numpy as np

DENSE_NODES = 128     # n^3 / 128^3 = 2 M steps per level at most: milliseconds in numpy


def best_paths(num_nodes: int, sources, targets, bandwidths, latencies, dense=None):
    """Return (bandwidth, latency) matrices, shape (n, n), for undirected edges.

    Diagonal: bandwidth inf, latency 0. Unreachable pairs: bandwidth 0, latency inf.
    Parallel edges between the same pair keep the best (higher bandwidth, then lower
    latency) for the path they are on, as any path choice would. ``dense`` chooses the
    method (default: dense up to :data:`DENSE_NODES` nodes; see the module docstring).
    """
    n = num_nodes
    if dense is None:
        dense = n <= DENSE_NODES
    a = np.asarray(sources, dtype=np.intp)
    b = np.asarray(targets, dtype=np.intp)
    src, dst = np.minimum(a, b), np.maximum(a, b)
    ebw = np.asarray(bandwidths, dtype=float)
    elat = np.asarray(latencies, dtype=float)
    bw = np.zeros((n, n))
    lat = np.full((n, n), np.inf)
    np.fill_diagonal(bw, np.inf)
    np.fill_diagonal(lat, 0.0)
    done = np.eye(n, dtype=bool)
    # the distinct bandwidths, highest first; not np.unique, which imports numpy.ma on
    # numpy 2.4 (10-15 ms of CPU in the first plan of every rank: Cluster.local comes here)
    levels = np.sort(ebw)[::-1]
    levels = levels[np.r_[True, levels[1:] != levels[:-1]]] if levels.size else levels
    for level in levels:
        keep = np.flatnonzero(ebw >= level)
        if dense:
            dist = _shortest_dense(n, src[keep], dst[keep], elat[keep])
            fresh = np.isfinite(dist) & ~done
            rows = np.flatnonzero(fresh.any(axis=1))
            if rows.size == 0:
                continue
            dist = dist[rows]
        else:
            fresh, rows, dist = _shortest_sparse(n, src, dst, elat, keep, done)
            if rows.size == 0:
                continue
        mask = fresh[rows]
        bw[rows] = np.where(mask, level, bw[rows])
        lat[rows] = np.where(mask, dist, lat[rows])
        done[rows] |= mask
    return bw, lat


def _shortest_dense(n: int, src, dst, elat) -> np.ndarray:
    """All-pairs shortest latencies (inf: not connected) by Floyd-Warshall; parallel
    edges keep the quickest."""
    dist = np.full((n, n), np.inf)
    np.minimum.at(dist, (src, dst), elat)
    np.minimum.at(dist, (dst, src), elat)
    np.fill_diagonal(dist, 0.0)
    for k in range(n):      # row and column k do not change in step k (dist[k, k] = 0)
        np.minimum(dist, dist[:, k, None] + dist[None, k, :], out=dist)
    return dist


def _shortest_sparse(n: int, src, dst, elat, keep, done):
    """(pairs first connected, their source rows, latencies from those rows) with scipy."""
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import connected_components, shortest_path

    # csr_matrix sums duplicate coordinates: keep only the fastest parallel edge.
    order = keep[np.lexsort((elat[keep], src[keep] * n + dst[keep]))]
    _, first = np.unique(src[order] * n + dst[order], return_index=True)
    keep = order[first]
    # Explicit zero latencies stay edges in a csr matrix built from coordinates.
    sub = csr_matrix((elat[keep], (src[keep], dst[keep])), shape=(n, n))
    _, labels = connected_components(sub, directed=False)
    fresh = (labels[:, None] == labels[None, :]) & ~done
    rows = np.flatnonzero(fresh.any(axis=1))
    if rows.size == 0:
        return fresh, rows, None
    return fresh, rows, shortest_path(sub, method="D", directed=False, indices=rows)
