"""The resource graph: shipped files, round trips, best-path bandwidth/latency, meshes.

Oracles: hand-computed paths on a small cluster, brute force over all simple paths on
random graphs, Cluster.local(4) against the shipped local4.yaml, the README's example.
"""

import functools
import itertools
import math
import os
import pickle
import re

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import distgraph.resources
from distgraph.errors import PlanError, ResourceFileError
from distgraph.resources.cluster import (Cluster, Device, FrozenMap, Link, LinkGroup, Machine,
                                        Switch)
from distgraph.resources.paths import best_paths

RESOURCES = os.path.dirname(distgraph.resources.__file__)
CLUSTERS = os.path.join(RESOURCES, "clusters")
SHIPPED = sorted(f for f in os.listdir(CLUSTERS) if f.endswith((".yaml", ".json")))


@functools.lru_cache(maxsize=None)
def shipped(name):
    # a Cluster is an immutable value: each shipped file is read once per session (the
    # 16,384-GPU one takes seconds)
    return Cluster.from_file(os.path.join(CLUSTERS, name))


def test_the_expected_examples_are_shipped():
    assert {"local4.yaml", "gpu_2x8.yaml", "hetero_2gpu_2xpu.yaml",
            "paddle_2x8.json"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_shipped_file_loads_prints_and_round_trips(name, suffix, tmp_path):
    cluster = shipped(name)
    text = str(cluster)
    assert cluster.name in text and "Device meshes" in text and "Links:" in text
    for mesh in cluster.device_meshes:
        assert mesh.name in text
    out = tmp_path / f"copy{suffix}"
    cluster.save(out)
    again = Cluster.from_file(out)
    assert again == cluster
    assert again.to_dict() == cluster.to_dict()
    assert [m.dim_bandwidths for m in again.device_meshes] == \
        [m.dim_bandwidths for m in cluster.device_meshes]
    # Saving twice gives the same bytes: the canonical form is stable.
    out2 = tmp_path / f"copy2{suffix}"
    again.save(out2)
    assert out.read_text() == out2.read_text()


def test_local4_file_is_cluster_local_4():
    assert shipped("local4.yaml") == Cluster.local(4)
    local = Cluster.local(3)
    assert [d.global_id for d in local.devices] == [0, 1, 2]
    assert {d.type for d in local.devices} == {"CPU"}
    assert len(local.device_meshes) == 1
    assert local.device_meshes[0].shape == (3,)
    assert local.device_meshes[0].device_ids == [0, 1, 2]
    with pytest.raises(PlanError):
        Cluster.local(0)


def test_gpu_2x8_paths_and_mesh():
    c = shipped("gpu_2x8.yaml")
    assert len(c.machines) == 2 and len(c.devices) == 16
    assert all(d.type == "GPU" and d.memory == 40.0 for d in c.devices)
    # Same machine: direct NVLink. Across: GPU -PCIe- NIC -NET- NIC -PCIe- GPU.
    assert c.bandwidth(0, 7) == 300.0 and c.latency(0, 7) == 2.0
    assert c.bandwidth(0, 8) == 12.5 and c.latency(0, 8) == 1 + 5 + 1
    (mesh,) = c.device_meshes
    assert mesh.shape == (2, 8) and mesh.device_ids == list(range(16))
    assert mesh.dim_bandwidths == (12.5, 300.0) and mesh.dim_latencies == (7.0, 2.0)


def test_hetero_has_one_mesh_per_device_type():
    c = shipped("hetero_2gpu_2xpu.yaml")
    meshes = {m.name: m for m in c.device_meshes}
    assert set(meshes) == {"gpu", "xpu"}
    assert meshes["gpu"].device_type == "GPU" and meshes["xpu"].device_type == "XPU"
    assert meshes["gpu"].shape == meshes["xpu"].shape == (2, 4)
    assert {c.device(i).type for i in meshes["xpu"].device_ids} == {"XPU"}
    # Through the switch: 1 + 2.5 + 2.5 + 1 us, bottleneck the 12.5 GB/s NIC links.
    assert c.bandwidth(0, 8) == 12.5 and c.latency(0, 8) == 7.0
    assert c.bandwidth(8, 9) == 100.0 and c.latency(8, 9) == 3.0


def test_paddle_json_is_imported():
    c = shipped("paddle_2x8.json")
    assert c.name == "paddle_2x8"
    gpus = [d for d in c.devices if d.type == "GPU"]
    assert len(gpus) == 16 and {d.model for d in gpus} == {"Tesla V100-SXM2-32GB"}
    assert gpus[0].gflops == {"float32": 15700.0, "float64": 7800.0} and gpus[0].memory == 32.0
    assert [n.global_id for n in c.nics] == [9, 19]
    # Both directions of each pair merge: 10 nodes per machine -> 45 undirected links.
    assert [len(m.links) for m in c.machines] == [45, 45]
    assert len(c.links) == 1 and c.links[0].endpoints == (9, 19)
    assert c.bandwidth(0, 10) == 12.5 and c.latency(0, 10) == 10.0
    assert c.bandwidth(0, 1) == 235.0


def test_paddle_link_directions_merge_conservatively():
    data = {"machines": [{"hostname": "h", "port": "6000", "devices": [
        {"global_id": 0, "local_id": 0, "type": "GPU", "model": "x", "memory": "16",
         "sp_gflops": "100"},
        {"global_id": 1, "local_id": 1, "type": "GPU", "model": "x", "memory": 16,
         "sp_gflops": 100, "dp_gflops": 50}],
        "links": [{"source_global_id": 0, "target_global_id": 1, "bandwidth": 100, "latency": 1},
                  {"source_global_id": 1, "target_global_id": 0, "bandwidth": "80",
                   "latency": 3}]}]}
    c = Cluster.from_dict(data, "p.json")
    assert c.machines[0].port == 6000
    (link,) = c.machines[0].links
    assert (link.bandwidth, link.latency) == (80.0, 3.0)
    assert c.devices[1].gflops == {"float32": 100.0, "float64": 50.0}


def small_cluster():
    """Hand-checked topology (bandwidth GB/s, latency us):

    machine 0: 0-1 (10, 1), 1-2 (10, 1), 0-2 (2, 0.5), 2-nic4 (5, 1)
    machine 1: 3-nic5 (5, 1)
    between:   nic4-nic5 (1, 10), nic4-switch6 (1, 2), switch6-nic5 (1, 2)
    """
    cpu = dict(type="CPU", model="c", gflops={"float32": 1.0}, memory=1.0)
    m0 = Machine(0, "a", [Device(i, i, 0, **cpu) for i in range(3)],
                 [Link(0, 1, 10, 1), Link(1, 2, 10, 1), Link(0, 2, 2, 0.5), Link(2, 4, 5, 1)],
                 [Device(4, 0, 0, "NIC")])
    m1 = Machine(1, "b", [Device(3, 0, 1, **cpu)], [Link(5, 3, 5, 1)], [Device(5, 0, 1, "NIC")])
    inter = [Link(4, 5, 1, 10), Link(4, 6, 1, 2), Link(6, 5, 1, 2)]
    return Cluster([m0, m1], inter, [Switch(6, "sw")], name="small")


def test_paths_match_hand_computation():
    c = small_cluster()
    # 0 -> 2: the direct link is slow (2 GB/s); via 1 the bottleneck is 10, latency 1 + 1.
    assert (c.bandwidth(0, 2), c.latency(0, 2)) == (10.0, 2.0)
    # 0 -> 3: bottleneck 1 GB/s between machines, so the direct 0-2 link (2 >= 1) is
    # allowed and is quicker than going through 1: 0.5 + 1 + (2 + 2 via switch) + 1.
    assert (c.bandwidth(0, 3), c.latency(0, 3)) == (1.0, 6.5)
    assert (c.bandwidth(1, 3), c.latency(1, 3)) == (1.0, 7.0)
    assert (c.bandwidth(3, 0), c.latency(3, 0)) == (1.0, 6.5)
    assert c.bandwidth(2, 2) == math.inf and c.latency(2, 2) == 0.0
    (mesh,) = c.device_meshes               # 3 + 1 CPUs: unequal machines -> flat mesh
    assert mesh.shape == (4,) and mesh.device_ids == [0, 1, 2, 3]
    assert mesh.dim_bandwidths == (1.0,) and mesh.dim_latencies == (7.0,)
    with pytest.raises(PlanError, match="not a device"):
        c.bandwidth(0, 42)


def brute_force(graph: nx.Graph, a, b):
    best = (0.0, math.inf)
    for path in nx.all_simple_paths(graph, a, b):
        edges = [graph.edges[u, v] for u, v in zip(path, path[1:])]
        bw = min(e["bw"] for e in edges)
        lat = sum(e["lat"] for e in edges)
        if bw > best[0] or (bw == best[0] and lat < best[1]):
            best = (bw, lat)
    return best


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 6).flatmap(lambda n: st.tuples(
    st.just(n),
    st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1),
                       st.sampled_from([1.0, 2.0, 5.0, 10.0]),
                       st.sampled_from([0.0, 0.5, 1.0, 3.0])), max_size=12))))
def test_best_paths_equal_brute_force(case):
    """Both methods (numpy's dense Floyd-Warshall, scipy's Dijkstra) against every path."""
    n, raw = case
    graph = nx.Graph()
    graph.add_nodes_from(range(n))
    for u, v, bw, lat in raw:
        if u != v and not graph.has_edge(u, v):
            graph.add_edge(u, v, bw=bw, lat=lat)
    edges = list(graph.edges(data=True))
    for dense in (True, False):
        bw, lat = best_paths(n, [u for u, _, _ in edges], [v for _, v, _ in edges],
                             [e["bw"] for *_, e in edges], [e["lat"] for *_, e in edges],
                             dense=dense)
        for a, b in itertools.permutations(range(n), 2):
            expect = brute_force(graph, a, b)
            assert (bw[a, b], lat[a, b]) == pytest.approx(expect), dense


@pytest.mark.parametrize("name", ["hetero_2gpu_2xpu.yaml", "gpu_2x8.yaml", "emulated_2x2.yaml"])
def test_dense_and_sparse_best_paths_agree_on_shipped_clusters(name):
    """With parallel links and switches too: the matrices of both methods are equal."""
    c = shipped(name)
    ids = sorted(c._node_index)
    index = {nid: k for k, nid in enumerate(ids)}
    links = c.all_links + [c.all_links[0]]            # a parallel link, kept once
    args = (len(ids), [index[ln.source] for ln in links], [index[ln.target] for ln in links],
            [ln.bandwidth for ln in links], [ln.latency for ln in links])
    dense, sparse = best_paths(*args, dense=True), best_paths(*args, dense=False)
    np.testing.assert_allclose(dense[0], sparse[0], rtol=1e-12)
    np.testing.assert_allclose(dense[1], sparse[1], rtol=1e-12)


def test_cluster_is_a_hashable_picklable_value():
    c = shipped("hetero_2gpu_2xpu.yaml")
    assert pickle.loads(pickle.dumps(c)) == c
    assert hash(c) == hash(Cluster.from_file(os.path.join(CLUSTERS, "hetero_2gpu_2xpu.yaml")))
    with pytest.raises(TypeError):
        c.devices[0].gflops["float32"] = 1.0
    with pytest.raises(Exception):
        c.name = "other"
    assert FrozenMap({"a": 1}) == {"a": 1}


def test_cluster_constructor_validates_like_the_loader():
    cpu = dict(type="CPU", model="c", gflops={"float32": 1.0}, memory=1.0)
    lone = [Machine(0, "a", [Device(0, 0, 0, **cpu)]), Machine(1, "b", [Device(1, 0, 1, **cpu)])]
    with pytest.raises(ResourceFileError, match="cannot reach"):
        Cluster(lone)
    with pytest.raises(ResourceFileError, match="already used"):
        Cluster([Machine(0, "a", [Device(0, 0, 0, **cpu), Device(0, 1, 0, **cpu)])])
    with pytest.raises(ResourceFileError, match="bandwidth"):
        Link(0, 1, 0.0, 1.0)
    with pytest.raises(ResourceFileError, match="unknown device type"):
        Device(0, 0, 0, "QPU")


def two_machines_without_links_inside(device="CPU"):
    """A user's file (issue #52): 2 machines x 2 devices, every device linked to the other
    machine's, none inside a machine; its devices reached each other only through the
    other machine's devices."""
    def machine(k):
        return {"id": k, "hostname": f"node{k}", "devices": [
            {"global_id": 2 * k + i, "local_id": i, "type": device, "model": "m",
             "memory": 4, "gflops": {"float32": 50}} for i in range(2)]}
    return {"name": "elastic_2x2", "machines": [machine(0), machine(1)],
            "links": [{"source": a, "target": b, "bandwidth": 0.125, "latency": 100,
                       "type": "NET"} for a in (0, 1) for b in (2, 3)]}


def test_the_devices_of_one_machine_reach_each_other_without_links_inside_it():
    """Over the machine's shared memory (default figures, as Cluster.local's), not
    through another machine; and a machine kept alone (an elastic restart's cluster)
    is a cluster: it was 'links: devices 1 cannot reach device 0'."""
    from distgraph.resources.cluster import (LOCAL_BANDWIDTH_GBPS, LOCAL_LATENCY_US,
                                             LOCAL_STAGED_LATENCY_US)
    data = two_machines_without_links_inside()
    c = Cluster.from_dict(data)
    assert (c.bandwidth(0, 1), c.latency(0, 1)) == (LOCAL_BANDWIDTH_GBPS, LOCAL_LATENCY_US)
    assert (c.bandwidth(2, 3), c.latency(2, 3)) == (LOCAL_BANDWIDTH_GBPS, LOCAL_LATENCY_US)
    assert (c.bandwidth(0, 3), c.latency(0, 3)) == (0.125, 100.0)
    assert c.device_meshes[0].dim_bandwidths == (0.125, LOCAL_BANDWIDTH_GBPS)
    assert "SHM (implied)" in c.describe()
    assert "links" not in c.to_dict()["machines"][0]       # the file stays the user's
    assert Cluster.from_dict(c.to_dict()) == c
    alone = Cluster.from_dict({**data, "machines": data["machines"][:1], "links": []})
    assert [d.global_id for d in alone.devices] == [0, 1] and alone.bandwidth(0, 1) == 10.0
    gpus = Cluster.from_dict(two_machines_without_links_inside("GPU"))
    assert gpus.latency(0, 1) == LOCAL_STAGED_LATENCY_US   # staged through the host
    # devices the machine's own links join (here through its NIC) get no implied link
    assert shipped("gpu_2x8.yaml").implied_links == {}
    assert shipped("paddle_2x8.json").implied_links == {}


def test_readme_example_loads(tmp_path):
    text = open(os.path.join(RESOURCES, "README.md"), encoding="utf-8").read()
    section = text[text.index("## A complete example"):]
    block = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    path = tmp_path / "tiny_2x2.yaml"
    path.write_text(block)
    c = Cluster.from_file(path)
    assert c.device_meshes[0].shape == (2, 2)
    assert (c.bandwidth(0, 2), c.latency(0, 2)) == (12.5, 7.0)
    # The error quoted in the README is the one the loader gives.
    quoted = re.search(r"```\n(tiny_2x2\.yaml: .*?)\n```", section, re.S).group(1)
    bad = block.replace("      - {source: 0, target: 4, bandwidth: 32, latency: 1, type: PCIe}\n"
                        "      - {source: 1, target: 4, bandwidth: 32, latency: 1, type: PCIe}\n",
                        "      - {group: [0, 1, 4], bandwidth: 32, latency: 1, type: PCIe}\n")
    path.write_text(bad)
    with pytest.raises(ResourceFileError) as err:
        Cluster.from_file(path)
    assert str(err.value) == str(path.parent / quoted)


def test_group_shorthand_expands_to_all_pairs():
    data = {"machines": [{"hostname": "h", "devices": [
        {"global_id": i, "type": "CPU", "memory": 1, "gflops": {"float32": 1}} for i in range(4)],
        "links": [{"group": [0, 1, 2, 3], "bandwidth": 5, "latency": 1}]}]}
    c = Cluster.from_dict(data)
    assert sorted(ln.endpoints for ln in c.machines[0].links) == \
        list(itertools.combinations(range(4), 2))
    assert [d.local_id for d in c.devices] == [0, 1, 2, 3]
    assert np.all(c.path_matrices([0, 1, 2, 3])[0][~np.eye(4, dtype=bool)] == 5.0)


@pytest.mark.parametrize("links, said", [
    ([{"group": [0, 1, 2]}, {"source": 2, "target": 1}],
     "machines[0].links[1]: link 1-2 is also given at machines[0].links[0]"),
    ([{"group": [0, 1, 2]}, {"group": [3, 2, 1]}],
     "machines[0].links[1]: link 1-2 is also given at machines[0].links[0]"),
    ([{"source": 0, "target": 1}, {"group": [3, 1, 0]}],
     "machines[0].links[1]: link 0-1 is also given at machines[0].links[0]"),
])
def test_a_pair_linked_twice_is_refused_however_the_links_are_written(links, said):
    """Groups stay groups (never listed pair by pair), yet a pair in two of them, or in a
    group and a single link, is one error naming both."""
    data = {"machines": [{"hostname": "h", "devices": [
        {"global_id": i, "type": "CPU", "memory": 1, "gflops": {"float32": 1}} for i in range(4)],
        "links": [{**ln, "bandwidth": 5, "latency": 1} for ln in links]}]}
    with pytest.raises(ResourceFileError, match=re.escape(said)):
        Cluster.from_dict(data)
    made = [LinkGroup(ln["group"], 5, 1) if "group" in ln else Link(ln["source"],
                                                                   ln["target"], 5, 1)
            for ln in links]
    devices = [Device(i, i, 0, "CPU", "c", {"float32": 1.0}, 1.0) for i in range(4)]
    with pytest.raises(ResourceFileError, match=r"machines\[0\].links\[1\]: link \d-\d is "
                                                r"given twice \(also at machines\[0\]\.links\[0\]"):
        Cluster([Machine(0, "h", devices, made)])
