"""Rank-mapping benchmark: speed at scale, and quality against two baselines.

Part 1 maps a DPxTPxPP plan of 1024 processes (pp=4, dp=32, tp=8) onto a cluster of
128 machines x 8 GPUs (NVLink inside, PCIe to one NIC per machine, every NIC on one
switch), built in code, and prints the seconds it took (target: < 10 s) and the cost
ratio against Paddle's BFS first-free rule.

Part 2 prints, for three plans on the shipped resource files, the mapper's cost divided by
the BFS first-free cost and by the best of 100 random placements (< 1 means better):

- DPxTP with TP degree 8 on gpu_2x8.yaml,
- PPxTP (pp=2, tp=8) on gpu_2x8.yaml,
- a two-mesh heterogeneous plan on hetero_2gpu_2xpu.yaml: stage 0 (dp=2 x tp=4) on the
  GPUs, stage 1 (dp=2 x tp=4) on the XPUs, p2p between matching processes of the stages.

Run: ``python bench/mapping_scale.py``
"""

from __future__ import annotations

import os
import time

from distgraph.passes.mapping.process_graph import ProcessGraph, grid_groups
from distgraph.passes.mapping.rank_mapping import (best_random_mapping, bfs_first_free_mapping,
                                           improve_mapping, map_ranks, random_mapping)
from distgraph.resources.cluster import Cluster, Device, Link, Machine, Switch

CLUSTERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "resources", "clusters")
GFLOPS = {"float32": 19500.0, "float64": 9700.0}


def big_cluster(machines: int = 128, per_machine: int = 8) -> Cluster:
    """machines x per_machine GPUs; NIC ids follow the GPUs, the switch id comes last."""
    ngpu = machines * per_machine
    switch = ngpu + machines
    hosts = []
    for m in range(machines):
        ids = range(m * per_machine, (m + 1) * per_machine)
        nic = ngpu + m
        devices = [Device(g, g - m * per_machine, m, "GPU", "A100-SXM4-40GB", GFLOPS, 40)
                   for g in ids]
        links = [Link(a, b, 300, 2, "NVL") for a in ids for b in ids if a < b]
        links += [Link(g, nic, 32, 1, "PCIe") for g in ids]
        hosts.append(Machine(m, f"node{m}", devices, links,
                             (Device(nic, 0, m, "NIC", "ConnectX-6"),)))
    net = [Link(ngpu + m, switch, 12.5, 2.5, "NET") for m in range(machines)]
    return Cluster(hosts, net, (Switch(switch, "core"),), name=f"gpu_{machines}x{per_machine}")


def dp_tp_pp_graph(pp: int, dp: int, tp: int, device_type=None) -> ProcessGraph:
    """Megatron-like traffic per step: TP all-reduce of activations (heaviest), DP
    all-reduce of gradients, PP activations/gradients between neighbouring stages."""
    shape = (pp, dp, tp)
    g = ProcessGraph(pp * dp * tp, device_types=device_type)
    g = g.with_group_traffic(grid_groups(shape, 2), 256e6, "all_reduce")
    g = g.with_group_traffic(grid_groups(shape, 1), 64e6, "all_reduce")
    return g.with_group_traffic(grid_groups(shape, 0), 32e6, "p2p")


def hetero_graph() -> ProcessGraph:
    """Processes 0-7 (GPU stage: dp=2 x tp=4), 8-15 (XPU stage: dp=2 x tp=4)."""
    types = ["GPU"] * 8 + ["XPU"] * 8
    g = ProcessGraph(16, device_types=types)
    for base in (0, 8):
        tp = [[base + 4 * d + t for t in range(4)] for d in range(2)]
        dp = [[base + t, base + 4 + t] for t in range(4)]
        g = g.with_group_traffic(tp, 256e6, "all_reduce").with_group_traffic(dp, 64e6)
    return g.with_group_traffic([[p, p + 8] for p in range(8)], 32e6, "p2p")


def scale():
    cluster_start = time.perf_counter()
    cluster = big_cluster()
    graph = dp_tp_pp_graph(4, 32, 8)
    cluster.bandwidth(0, len(cluster.devices) - 1)  # path matrices are ready before timing
    built = time.perf_counter() - cluster_start
    start = time.perf_counter()
    mapping = map_ranks(graph, cluster)
    seconds = time.perf_counter() - start
    bfs = bfs_first_free_mapping(graph, cluster)
    print(f"scale: {graph.num_processes} processes on {cluster.name} "
          f"({len(cluster.devices)} GPUs): cluster + paths {built:.2f} s, "
          f"map_ranks {seconds:.2f} s (target < 10 s), {mapping.method}")
    print(f"  cost ratio vs BFS first-free: {mapping.cost / bfs.cost:.3f}")
    # The swap phase alone, from a random start, shows its own speed and reach.
    start_map = random_mapping(graph, cluster, seed=0)
    start = time.perf_counter()
    swapped = improve_mapping(graph, cluster, start_map.process_to_device)
    seconds = time.perf_counter() - start
    print(f"  swaps alone from a random start: {seconds:.2f} s, {swapped.method}, cost ratio "
          f"vs that start {swapped.cost / start_map.cost:.3f}, vs BFS first-free "
          f"{swapped.cost / bfs.cost:.3f}")


def quality():
    gpu = Cluster.from_file(os.path.join(CLUSTERS, "gpu_2x8.yaml"))
    hetero = Cluster.from_file(os.path.join(CLUSTERS, "hetero_2gpu_2xpu.yaml"))
    plans = [("DPxTP (dp=2, tp=8) on gpu_2x8", dp_tp_pp_graph(1, 2, 8), gpu),
             ("PPxTP (pp=2, tp=8) on gpu_2x8", dp_tp_pp_graph(2, 1, 8), gpu),
             ("two meshes GPU|XPU on hetero_2gpu_2xpu", hetero_graph(), hetero)]
    print(f"{'plan':42s} {'vs BFS first-free':>18s} {'vs best of 100 random':>22s}")
    for name, graph, cluster in plans:
        cost = map_ranks(graph, cluster).cost
        bfs = bfs_first_free_mapping(graph, cluster).cost
        rnd = best_random_mapping(graph, cluster, tries=100, seed=0).cost
        print(f"{name:42s} {cost / bfs:18.3f} {cost / rnd:22.3f}")


if __name__ == "__main__":
    scale()
    quality()
