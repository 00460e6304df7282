"""Rank mapping: traffic formulas, constraints, and cost against oracles.

Oracles: exhaustive search on tiny cases, brute-force 2-opt local optimality after the
swap phase, the cost formula recomputed from cluster.bandwidth/latency and from the cost
model's collective_time, BFS first-free and the best of 100 random placements on DPxTP,
PPxTP and a two-mesh heterogeneous plan.
"""

import itertools
import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import distgraph.resources
from distgraph.errors import PlanError
from distgraph.passes.cost.formulas import collective_time
from distgraph.passes.mapping.process_graph import (ProcessGraph, collective_messages,
                                            collective_traffic, grid_groups)
from distgraph.passes.mapping.rank_mapping import (best_random_mapping, bfs_first_free_mapping,
                                           improve_mapping, map_ranks, mapping_cost,
                                           random_mapping)
from distgraph.plan.kinds import COLLECTIVES
from distgraph.resources.cluster import Cluster, Device, Link, Machine

CLUSTERS = os.path.join(os.path.dirname(distgraph.resources.__file__), "clusters")


@pytest.fixture(scope="module")
def gpu_2x8():
    return Cluster.from_file(os.path.join(CLUSTERS, "gpu_2x8.yaml"))


@pytest.fixture(scope="module")
def hetero():
    return Cluster.from_file(os.path.join(CLUSTERS, "hetero_2gpu_2xpu.yaml"))


def dp_tp_pp(pp, dp, tp, device_types=None, tp_bytes=256e6, dp_bytes=64e6, pp_bytes=32e6):
    shape = (pp, dp, tp)
    g = ProcessGraph(pp * dp * tp, device_types=device_types)
    g = g.with_group_traffic(grid_groups(shape, 2), tp_bytes, "all_reduce")
    g = g.with_group_traffic(grid_groups(shape, 1), dp_bytes, "all_reduce")
    return g.with_group_traffic(grid_groups(shape, 0), pp_bytes, "p2p")


def two_mesh_plan():
    """0-7: GPU stage (dp=2 x tp=4); 8-15: XPU stage (dp=2 x tp=4); p2p p <-> p+8."""
    g = ProcessGraph(16, device_types=["GPU"] * 8 + ["XPU"] * 8)
    for base in (0, 8):
        g = g.with_group_traffic([[base + 4 * d + t for t in range(4)] for d in range(2)], 256e6)
        g = g.with_group_traffic([[base + t, base + 4 + t] for t in range(4)], 64e6)
    return g.with_group_traffic([[p, p + 8] for p in range(8)], 32e6, "p2p")


# ---- process graph ------------------------------------------------------------------
def test_collective_traffic_formulas():
    B = 1e6
    ring = collective_traffic([[0, 1, 2, 3]], B, "all_reduce")
    assert ring == {(0, 1): 1.5e6, (1, 2): 1.5e6, (2, 3): 1.5e6, (0, 3): 1.5e6}
    assert collective_traffic([[0, 1]], B, "all_reduce") == {(0, 1): 2e6}   # both directions
    assert collective_traffic([[3, 1, 2]], B, "all_gather") == \
        {(1, 3): 2 / 3 * B, (1, 2): 2 / 3 * B, (2, 3): 2 / 3 * B}
    assert collective_traffic([[0, 1, 2, 3]], B, "reduce_scatter")[(0, 1)] == 0.75e6
    a2a = collective_traffic([[0, 1, 2, 3]], B, "all_to_all")
    assert len(a2a) == 6 and set(a2a.values()) == {0.5e6}
    assert collective_traffic([[0, 1, 2]], B, "p2p") == {(0, 1): B, (1, 2): B}
    assert collective_traffic([[5]], B) == {}
    # messages: one per ring step to the successor, one each way per all_to_all pair
    assert collective_messages([[0, 1, 2, 3]], "all_reduce") == \
        {(0, 1): 6.0, (1, 2): 6.0, (2, 3): 6.0, (0, 3): 6.0}
    assert collective_messages([[0, 1]], "all_gather") == {(0, 1): 2.0}
    assert collective_messages([[0, 1, 2]], "all_to_all") == {(0, 1): 2.0, (0, 2): 2.0,
                                                             (1, 2): 2.0}
    assert collective_messages([[0, 1, 2]], "p2p") == {(0, 1): 1.0, (1, 2): 1.0}
    g = ProcessGraph(4).with_group_traffic([[0, 1], [2, 3]], B, "reduce_scatter")
    assert dict(g.messages) == {(0, 1): 2.0, (2, 3): 2.0}
    with pytest.raises(PlanError, match="unknown collective"):
        collective_traffic([[0, 1]], B, "broadcastish")


def test_grid_groups():
    assert grid_groups((2, 3), 1) == [[0, 1, 2], [3, 4, 5]]
    assert grid_groups((2, 3), 0) == [[0, 3], [1, 4], [2, 5]]
    assert grid_groups((2, 2, 2), 1) == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_process_graph_is_a_validated_value():
    g = ProcessGraph(3, {(1, 0): 5, (0, 1): 2, (2, 1): 1})
    assert dict(g.traffic) == {(0, 1): 7.0, (1, 2): 1.0}
    assert g.with_traffic({(0, 2): 3}).traffic[(0, 2)] == 3.0 and (0, 2) not in g.traffic
    assert np.array_equal(g.traffic_matrix(), [[0, 7, 0], [7, 0, 1], [0, 1, 0]])
    assert hash(g) == hash(ProcessGraph(3, {(0, 1): 7, (1, 2): 1}))
    for bad in [dict(traffic={(0, 0): 1}), dict(traffic={(0, 3): 1}), dict(traffic={(0, 1): -1}),
                dict(device_types="FPGA"), dict(memory=[1, 2]), dict(compute=-1)]:
        with pytest.raises(PlanError):
            ProcessGraph(3, **bad)


# ---- the plans of the issue -----------------------------------------------------------
def machines_of(cluster, mapping, procs):
    return {cluster.device(mapping.process_to_device[p]).machine_id for p in procs}


def test_dp_tp8_puts_each_tp_group_in_one_machine(gpu_2x8):
    for order in ("tp-fastest", "dp-fastest"):
        g = ProcessGraph(16)
        tp_groups = grid_groups((2, 8), 1) if order == "tp-fastest" else grid_groups((8, 2), 0)
        dp_groups = grid_groups((2, 8), 0) if order == "tp-fastest" else grid_groups((8, 2), 1)
        g = g.with_group_traffic(tp_groups, 256e6).with_group_traffic(dp_groups, 64e6)
        mapping = map_ranks(g, gpu_2x8)
        for group in tp_groups:
            assert len(machines_of(gpu_2x8, mapping, group)) == 1, (order, str(mapping))
        # BFS first-free splits them, so it must cost more.
        assert mapping.cost < bfs_first_free_mapping(g, gpu_2x8).cost


@pytest.mark.parametrize("plan", ["dp2xtp8", "pp2xtp8", "two-mesh"])
def test_mapper_beats_bfs_first_free_and_best_of_100_random(plan, gpu_2x8, hetero):
    graph, cluster = {"dp2xtp8": (dp_tp_pp(1, 2, 8), gpu_2x8),
                      "pp2xtp8": (dp_tp_pp(2, 1, 8), gpu_2x8),
                      "two-mesh": (two_mesh_plan(), hetero)}[plan]
    mapping = map_ranks(graph, cluster)
    assert mapping.cost == pytest.approx(mapping_cost(graph, cluster, mapping.process_to_device))
    bfs = bfs_first_free_mapping(graph, cluster)
    rnd = best_random_mapping(graph, cluster, tries=100, seed=0)
    assert mapping.cost <= bfs.cost * (1 + 1e-12)
    assert mapping.cost <= rnd.cost * (1 + 1e-12)


def test_heterogeneous_types_are_respected(hetero):
    graph = two_mesh_plan()
    for mapping in (map_ranks(graph, hetero), bfs_first_free_mapping(graph, hetero),
                    random_mapping(graph, hetero, seed=3),
                    best_random_mapping(graph, hetero, tries=20)):
        for p, d in mapping.process_to_device.items():
            assert hetero.device(d).type == graph.device_types[p], str(mapping)
        assert len(set(mapping.process_to_device.values())) == 16


def test_restricting_to_one_mesh(hetero):
    xpu = hetero.device_mesh("xpu")
    g = ProcessGraph(8).with_group_traffic(grid_groups((2, 4), 1), 1e8)
    mapping = map_ranks(g, hetero, devices=xpu.device_ids)
    assert set(mapping.process_to_device.values()) == set(xpu.device_ids)
    for group in grid_groups((2, 4), 1):
        assert len(machines_of(hetero, mapping, group)) == 1


def test_too_many_devices_of_a_type(hetero):
    graph = ProcessGraph(9, device_types="GPU")
    for mapper in (map_ranks, bfs_first_free_mapping, random_mapping):
        with pytest.raises(PlanError) as err:
            mapper(graph, hetero)
        msg = str(err.value)
        assert "9 processes" in msg and "only 8 GPU devices" in msg and "0-7" in msg
    with pytest.raises(PlanError, match="only 0 NPU devices"):
        map_ranks(ProcessGraph(1, device_types="NPU"), hetero)
    with pytest.raises(PlanError, match="17 processes"):
        map_ranks(ProcessGraph(17), hetero)


def test_memory_needs(hetero):
    # a 40 GB GPU may hold 36: its default reserve (2 GB and 5%) is left free
    with pytest.raises(PlanError, match=r"process 1 needs 50 GB on a GPU device.* may hold "
                                        r"36 GB \(its usable memory\)"):
        map_ranks(ProcessGraph(2, device_types="GPU", memory=[1, 50]), hetero)
    # 20 GB fits the 40 GB GPUs only (XPUs have 16 GB), whatever the traffic says; 37 GB fits
    # none (36 GB usable)
    with pytest.raises(PlanError, match="process 0 needs 37 GB on a GPU device"):
        map_ranks(ProcessGraph(2, device_types="GPU", memory=[37, 1]), hetero)
    g = ProcessGraph(4, {(0, 1): 1e9, (1, 2): 1e9, (2, 3): 1e9}, memory=[20, 1, 20, 1])
    mapping = map_ranks(g, hetero)
    assert hetero.device(mapping.process_to_device[0]).type == "GPU"
    assert hetero.device(mapping.process_to_device[2]).type == "GPU"


def test_a_device_too_small_for_any_process_is_named_with_why():
    """local4 with device 3 given 1e-6 GB: four processes, three devices that hold one."""
    cpu = dict(type="CPU", model="c", gflops={"float32": 1.0})
    small = Machine(0, "a", [Device(i, i, 0, memory=1e-6 if i == 3 else 4.0, **cpu)
                             for i in range(4)])
    with pytest.raises(PlanError, match=r"the plan has 4 processes, but only 3 of the 4 "
                                        r"devices of cluster '\(unnamed\)' can hold one: device 3 \(CPU "
                                        r"c, 1e-06 GB\) has less memory than the 0.5 GB the "
                                        r"smallest process needs"):
        map_ranks(ProcessGraph(4, memory=[0.5, 1, 1, 1]), Cluster([small]))
    # enough devices in all, but the big ones taken: the free ones are named, with why
    mixed = Machine(0, "a", [Device(i, i, 0, memory=m, **cpu)
                             for i, m in enumerate([8.0, 1.0, 1.0])])
    with pytest.raises(PlanError, match=r"no free device is left for process \d \(any type, "
                                        r"6 GB\): the free devices cannot hold it \(device \d "
                                        r"\(CPU c, 1 GB\) has less memory than the 6 GB "
                                        r"process \d needs"):
        map_ranks(ProcessGraph(3, {(0, 1): 1e9, (1, 2): 1e9}, memory=[6, 6, 1]),
                  Cluster([mixed]))


# ---- oracles on small cases -------------------------------------------------------------
def tiny_cluster():
    """2 machines x 3 CPUs; inside 10 GB/s 1 us, between (via a direct link) 1 GB/s 5 us;
    machine 1's third device is slower to reach (a 2 GB/s, 2 us link)."""
    cpu = dict(type="CPU", model="c", gflops={"float32": 1.0}, memory=8.0)
    m0 = Machine(0, "a", [Device(i, i, 0, **cpu) for i in range(3)],
                 [Link(0, 1, 10, 1), Link(0, 2, 10, 1), Link(1, 2, 10, 1)])
    m1 = Machine(1, "b", [Device(3 + i, i, 1, **cpu) for i in range(3)],
                 [Link(3, 4, 10, 1), Link(3, 5, 2, 2), Link(4, 5, 2, 2)])
    return Cluster([m0, m1], [Link(2, 3, 1, 5)], name="tiny")


def exhaustive_best(graph, cluster):
    ids = [d.global_id for d in cluster.devices]
    return min(mapping_cost(graph, cluster, dict(enumerate(perm)))
               for perm in itertools.permutations(ids, graph.num_processes))


def test_cost_formula_by_hand():
    c = tiny_cluster()
    g = ProcessGraph(3, {(0, 1): 1e6, (1, 2): 3e6}, messages={(0, 1): 2, (1, 2): 5})
    placement = {0: 0, 1: 4, 2: 5}
    by_hand = 2 * c.latency(0, 4) * 1e-6 + 1e6 / (c.bandwidth(0, 4) * 1e9) \
        + 5 * c.latency(4, 5) * 1e-6 + 3e6 / (c.bandwidth(4, 5) * 1e9)
    # 0 -> 4: 1 + 5 + 1 us at 1 GB/s; 4 -> 5: 2 us at 2 GB/s.
    assert by_hand == pytest.approx(2 * 7e-6 + 1e6 * 1e-9 + 5 * 2e-6 + 3e6 * 0.5e-9)
    assert mapping_cost(g, c, placement) == pytest.approx(by_hand)
    with pytest.raises(PlanError, match="share a device"):
        mapping_cost(g, c, {0: 0, 1: 0, 2: 1})


def test_a_step_costs_each_process_its_price_on_its_own_hop():
    """The mapper's pairs carry the cost model's load of a step (ring_load): on like
    links a collective costs its processes' collective_time each, a pipeline chain one
    send_recv per stage boundary."""
    c = tiny_cluster()                        # machine 0: 3 devices, 10 GB/s, 1 us
    on = {0: 0, 1: 1, 2: 2}
    for kind in COLLECTIVES:
        g = ProcessGraph(3).with_group_traffic([[0, 1, 2]], 1e6, kind)
        assert mapping_cost(g, c, on) == pytest.approx(3 * collective_time(kind, 3, 1e6, 10, 1))
    chain = ProcessGraph(3).with_group_traffic([[0, 1, 2]], 1e6, "p2p")
    assert mapping_cost(chain, c, on) == pytest.approx(
        2 * collective_time("send_recv", 2, 1e6, 10, 1))


def test_structured_tiny_cases_reach_the_optimum():
    c = tiny_cluster()
    cases = [
        # two heavy triangles, lightly joined: one per machine, the join on the fast pair
        ProcessGraph(6, {(0, 1): 9e6, (1, 2): 9e6, (0, 2): 9e6, (3, 4): 9e6, (4, 5): 9e6,
                         (3, 5): 9e6, (2, 3): 1e6}),
        # a pipeline chain of 5 stages
        ProcessGraph(5).with_group_traffic([[0, 1, 2, 3, 4]], 4e6, "p2p"),
        # a star around process 0
        ProcessGraph(4, {(0, 1): 3e6, (0, 2): 2e6, (0, 3): 1e6}),
    ]
    for g in cases:
        assert map_ranks(g, c).cost == pytest.approx(exhaustive_best(g, c), rel=1e-12), str(g)


def assert_two_opt(graph, cluster, mapping):
    """No exchange of two processes and no move to a free device lowers the cost."""
    place = dict(mapping.process_to_device)
    free = [d.global_id for d in cluster.devices if d.global_id not in place.values()]
    base = mapping_cost(graph, cluster, place)
    for p in range(graph.num_processes):
        for q in range(p + 1, graph.num_processes):
            trial = dict(place)
            trial[p], trial[q] = place[q], place[p]
            assert mapping_cost(graph, cluster, trial) >= base * (1 - 1e-9)
        for d in free:
            trial = dict(place)
            trial[p] = d
            assert mapping_cost(graph, cluster, trial) >= base * (1 - 1e-9)


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 6).flatmap(lambda n: st.tuples(
    st.just(n), st.dictionaries(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1))
                                .filter(lambda t: t[0] != t[1]),
                                st.sampled_from([1e5, 1e6, 5e6, 2e7]), max_size=10))))
def test_random_tiny_graphs_against_exhaustive_search(case):
    n, traffic = case
    c = tiny_cluster()
    g = ProcessGraph(n, traffic)
    mapping = map_ranks(g, c)
    optimum = exhaustive_best(g, c)
    assert mapping.cost >= optimum * (1 - 1e-12)           # nothing beats exhaustive search
    assert mapping.cost <= bfs_first_free_mapping(g, c).cost * (1 + 1e-12)
    assert_two_opt(g, c, mapping)                           # the swap phase converged


def test_swaps_improve_a_random_start_to_a_local_optimum(gpu_2x8):
    g = dp_tp_pp(2, 2, 4)
    start = random_mapping(g, gpu_2x8, seed=7)
    better = improve_mapping(g, gpu_2x8, start.process_to_device)
    assert better.cost < start.cost
    assert_two_opt(g, gpu_2x8, better)


def test_deterministic_and_printable(gpu_2x8):
    g = dp_tp_pp(1, 2, 8)
    a, b = map_ranks(g, gpu_2x8), map_ranks(g, gpu_2x8)
    assert a == b
    assert random_mapping(g, gpu_2x8, seed=1) == random_mapping(g, gpu_2x8, seed=1)
    text = str(a)
    assert "greedy+swap" in text and "gpu_2x8" in text and "ms/step" in text
    assert "machine 0:" in text and "machine 1:" in text and "p0->" in text


def gpu_cluster(machines, per_machine):
    """machines x per_machine GPUs, NVLink inside, one NIC each, all NICs on one switch."""
    from distgraph.resources.cluster import Switch

    n = machines * per_machine
    hosts = []
    for m in range(machines):
        ids = range(m * per_machine, (m + 1) * per_machine)
        gpus = [Device(g, g % per_machine, m, "GPU", "A100", {"float32": 19500}, 40) for g in ids]
        links = [Link(a, b, 300, 2) for a, b in itertools.combinations(ids, 2)]
        links += [Link(g, n + m, 32, 1) for g in ids]
        hosts.append(Machine(m, f"n{m}", gpus, links, [Device(n + m, 0, m, "NIC")]))
    net = [Link(n + m, n + machines, 12.5, 2.5) for m in range(machines)]
    return Cluster(hosts, net, [Switch(n + machines)], name=f"gpu_{machines}x{per_machine}")


def test_tp_groups_stay_inside_machines_at_moderate_scale():
    cluster = gpu_cluster(16, 8)
    g = dp_tp_pp(2, 8, 8)
    mapping = map_ranks(g, cluster)
    for group in grid_groups((2, 8, 8), 2):
        assert len(machines_of(cluster, mapping, group)) == 1
    assert mapping.cost < 0.9 * bfs_first_free_mapping(g, cluster).cost


def test_compressed_rows_equal_scipy_csr():
    """The mapper's own compressed rows against scipy's CSR (the oracle): layout
    (duplicates summed, explicit zeros kept), row sums and products with dense matrices."""
    from scipy.sparse import csr_matrix

    from distgraph.passes.mapping.rank_mapping import _Rows

    rng = np.random.default_rng(0)
    for _ in range(100):
        size, count = int(rng.integers(1, 12)), int(rng.integers(0, 30))
        rows, cols = rng.integers(0, size, count), rng.integers(0, size, count)
        values = rng.choice([0.0, 1.5, 3.0, 1e6], count)
        ours, theirs = _Rows(rows, cols, values, size), csr_matrix((values, (rows, cols)),
                                                                    shape=(size, size))
        assert np.array_equal(ours.indptr, theirs.indptr)
        assert np.array_equal(ours.indices, theirs.indices)
        assert np.array_equal(ours.data, theirs.data)
        assert np.array_equal(ours.row_sums(), np.asarray(theirs.sum(axis=1)).ravel())
        dense = rng.normal(size=(size, 3))
        assert np.array_equal(ours @ dense, np.asarray(theirs @ dense))
