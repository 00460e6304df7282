"""Node groups (the compact resource-file form) and best paths from interchangeable machines.

Oracles: the same cluster written node by node; all-pairs best paths on every node
(``best_paths`` on the full graph) against the reduced computation; Meta's figures in the
shipped 16,384-H100 file.
"""

import json
import os

import numpy as np
import pytest
import yaml

import distgraph.resources
from distgraph.errors import ResourceFileError
from distgraph.resources.cluster import Cluster
from distgraph.resources.paths import best_paths

CLUSTERS = os.path.join(os.path.dirname(distgraph.resources.__file__), "clusters")

GROUP_YAML = """\
name: pods
node_groups:
  - count: 6
    hostname: "n{index:02d}"
    id_step: 4
    devices:
      - {global_id: 0, type: GPU, model: G, memory: 80, gflops: {bfloat16: 1000}}
      - {global_id: 1, type: GPU, model: G, memory: 80, gflops: {bfloat16: 1000}}
    nics:
      - {global_id: 2}
      - {global_id: 3}
    links:
      - {group: [0, 1], bandwidth: 300, latency: 3, type: NVL}
      - {source: 0, target: 2, bandwidth: 50, latency: 1}
      - {source: 1, target: 3, bandwidth: 50, latency: 1}
    uplinks:
      - {source: 2, target: 100, bandwidth: 40, latency: 2, every: 4, target_step: 2}
      - {source: 3, target: 101, bandwidth: 40, latency: 2, every: 4, target_step: 2}
switches:
  - {global_id: 100, name: pod0-rail0}
  - {global_id: 101, name: pod0-rail1}
  - {global_id: 102, name: pod1-rail0}
  - {global_id: 103, name: pod1-rail1}
  - {global_id: 104, name: top}
links:
  - {source: 100, target: 104, bandwidth: 400, latency: 1}
  - {source: 101, target: 104, bandwidth: 400, latency: 1}
  - {source: 102, target: 104, bandwidth: 400, latency: 1}
  - {source: 103, target: 104, bandwidth: 400, latency: 1}
"""


def written_out() -> dict:
    """GROUP_YAML's cluster written node by node, as a person would without groups."""
    machines, links = [], []
    for k in range(6):
        s = 4 * k
        machines.append({
            "id": k, "hostname": f"n{k:02d}",
            "devices": [{"global_id": s + i, "local_id": i, "type": "GPU", "model": "G",
                         "memory": 80, "gflops": {"bfloat16": 1000}} for i in range(2)],
            "nics": [{"global_id": s + 2, "local_id": 0}, {"global_id": s + 3, "local_id": 1}],
            "links": [{"group": [s, s + 1], "bandwidth": 300, "latency": 3, "type": "NVL"},
                      {"source": s, "target": s + 2, "bandwidth": 50, "latency": 1},
                      {"source": s + 1, "target": s + 3, "bandwidth": 50, "latency": 1}]})
        pod = 2 * (k // 4)
        links += [{"source": s + 2, "target": 100 + pod, "bandwidth": 40, "latency": 2},
                  {"source": s + 3, "target": 101 + pod, "bandwidth": 40, "latency": 2}]
    data = yaml.safe_load(GROUP_YAML)
    links += data["links"]
    return {"name": "pods", "machines": machines, "switches": data["switches"], "links": links}


def load(text: str, tmp_path, name="c.yaml") -> Cluster:
    path = tmp_path / name
    path.write_text(text)
    return Cluster.from_file(path)


def test_a_group_equals_its_nodes_written_out(tmp_path):
    grouped = load(GROUP_YAML, tmp_path)
    plain = Cluster.from_dict(written_out())
    assert grouped == plain
    assert grouped.to_dict() == plain.to_dict()
    assert [m.hostname for m in grouped.machines] == [f"n{k:02d}" for k in range(6)]
    assert grouped.device_meshes[0].shape == (6, 2)
    # node 5 sits in the second pod: its NICs meet switches 102 and 103
    assert {(ln.source, ln.target) for ln in grouped.links if ln.source in (22, 23)} == \
        {(22, 102), (23, 103)}


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_compact_round_trip(tmp_path, suffix):
    plain = Cluster.from_dict(written_out())
    compact = plain.to_dict(compact=True)
    assert "machines" not in compact and len(compact["node_groups"]) == 1
    group = compact["node_groups"][0]
    assert (group["count"], group["id_step"], group["hostname"]) == (6, 4, "n{index:02d}")
    assert [(u["every"], u["target_step"]) for u in group["uplinks"]] == [(4, 2), (4, 2)]
    out = tmp_path / f"copy{suffix}"
    plain.save(out, compact=True)
    again = Cluster.from_file(out)
    assert again == plain and again.to_dict() == plain.to_dict()
    # saving the loaded copy gives the same bytes
    out2 = tmp_path / f"copy2{suffix}"
    again.save(out2, compact=True)
    assert out.read_text() == out2.read_text()


def test_machines_that_differ_stay_written_out():
    data = written_out()
    data["machines"][3]["devices"][1]["memory"] = 40        # one node is not like the rest
    cluster = Cluster.from_dict(data)
    compact = cluster.to_dict(compact=True)
    # nodes 0-2 are alike, but a written-out node would load before them: none grouped
    assert "node_groups" not in compact
    assert Cluster.from_dict(compact) == cluster


def edit(mutate) -> str:
    data = yaml.safe_load(GROUP_YAML)
    mutate(data["node_groups"][0])
    return yaml.safe_dump(data, sort_keys=False)


@pytest.mark.parametrize("mutate, where, words", [
    (lambda g: g["devices"][1].update(memory=-4), "node_groups[0].devices[1].memory",
     "got -4"),
    (lambda g: g.update(count=0), "node_groups[0].count", "integer >= 1"),
    (lambda g: g.update(id_step=2), "node_groups[0].devices[0].global_id",
     "global id 2 (node 1) is already used at node_groups[0].nics[0]"),
    (lambda g: g.update(hostname="node"), "node_groups[0].hostname", "same name"),
    (lambda g: g.update(hostname="n{idx}"), "node_groups[0].hostname", "does not format"),
    (lambda g: g["uplinks"][0].update(evry=4), "node_groups[0].uplinks[0].evry",
     "unknown key"),
    (lambda g: g["uplinks"][1].update(target_step=7), "node_groups[0].uplinks[1].target",
     "global id 108 is not defined"),
    (lambda g: g["links"][0].update(bandwidth=0), "node_groups[0].links[0].bandwidth",
     "got 0"),
    (lambda g: g.update(colour="red"), "node_groups[0].colour", "unknown key"),
])
def test_group_errors_name_the_bad_field(tmp_path, mutate, where, words):
    with pytest.raises(ResourceFileError) as err:
        load(edit(mutate), tmp_path, "bad.yaml")
    text = str(err.value)
    assert text.startswith(f"{tmp_path / 'bad.yaml'}: {where} (line "), text
    assert words in text, text


def full_paths(cluster: Cluster):
    """All-pairs best paths over every node of the cluster, no reduction."""
    ids = sorted(cluster._node_index)
    index = {n: k for k, n in enumerate(ids)}
    links = cluster.all_links
    bw, lat = best_paths(len(ids), [index[ln.source] for ln in links],
                         [index[ln.target] for ln in links],
                         [ln.bandwidth for ln in links], [ln.latency for ln in links])
    return ids, bw, lat


def brute_mesh_dims(cluster: Cluster, mesh):
    ids, bw, lat = full_paths(cluster)
    index = {n: k for k, n in enumerate(ids)}
    grid = np.array([index[i] for i in mesh.ids]).reshape(mesh.shape)
    out = []
    for dim, n in enumerate(mesh.shape):
        rows = np.moveaxis(grid, dim, -1).reshape(-1, n)
        pairs = [(r[i], r[j]) for r in rows for i in range(n) for j in range(n) if i != j]
        out.append((float(min(bw[p] for p in pairs)), float(max(lat[p] for p in pairs))))
    return out


def pods(count=11, every=4, tie=False) -> Cluster:
    data = yaml.safe_load(GROUP_YAML)
    group = data["node_groups"][0]
    group["count"] = count
    for u in group["uplinks"]:
        u["every"] = every
    pods_needed = -(-count // every)
    data["switches"] = [{"global_id": 200 + 2 * p + r} for p in range(pods_needed)
                        for r in range(2)] + [{"global_id": 300}]
    for u in group["uplinks"]:
        u["target"] += 100
    data["links"] = [{"source": 200 + 2 * p + r, "target": 300, "bandwidth": 400,
                      "latency": 1 + p} for p in range(pods_needed) for r in range(2)]
    if tie:      # a cable between two nodes' GPUs: those nodes are no longer alike
        data["links"].append({"source": 0, "target": 5, "bandwidth": 500, "latency": 0.5})
    return Cluster.from_dict(data)


@pytest.mark.parametrize("count, every, tie", [(11, 4, False), (9, 9, False),
                                               (8, 3, True), (2, 1, False)])
def test_reduced_paths_equal_all_pairs_on_every_node(count, every, tie):
    cluster = pods(count, every, tie)
    ids, bw, lat = full_paths(cluster)
    rbw, rlat = cluster.path_matrices(ids)
    np.testing.assert_array_equal(rbw, bw)
    np.testing.assert_allclose(rlat, lat, rtol=1e-12)
    mesh = cluster.device_meshes[0]
    assert list(zip(mesh.dim_bandwidths, mesh.dim_latencies)) == \
        brute_mesh_dims(cluster, mesh)
    if count >= 9 and not tie:
        assert cluster._paths.reduced_nodes < len(ids)


def test_shipped_h100_file_is_metas_machine():
    c = Cluster.from_file(os.path.join(CLUSTERS, "h100_16384.yaml"))
    assert len(c.devices) == 16384 and len(c.machines) == 2048
    d = c.devices[0]
    assert (d.model, d.memory, d.gflops["bfloat16"]) == ("H100-SXM5-80GB", 80.0, 869000.0)
    assert (d.gemm.units, d.gemm.tile) == (132, (256, 128)) and c.figures == "published"
    mesh = c.device_meshes[0]
    assert mesh.shape == (2048, 8)
    assert (mesh.dim_bandwidths, mesh.dim_latencies) == ((46.0, 370.0), (11.0, 3.0))
    gpu = [dev.global_id for dev in c.devices]
    # inside a node: NVLink; across nodes of one pod (384 nodes): the NIC's 46 GB/s over
    # one rail switch; across pods: through the spines and the aggregation switch
    assert (c.bandwidth(gpu[0], gpu[1]), c.latency(gpu[0], gpu[1])) == (370.0, 3.0)
    assert (c.bandwidth(gpu[0], gpu[8 * 383]), c.latency(gpu[0], gpu[8 * 383])) == (46.0, 7.0)
    assert (c.bandwidth(gpu[0], gpu[8 * 384]), c.latency(gpu[0], gpu[8 * 384])) == (46.0, 11.0)
    assert c._paths.reduced_nodes < 400


def test_groups_do_not_change_the_written_out_a100_file():
    """The 1,024-A100 file (128 alike nodes on 8 rails) gets the same matrices from 3
    nodes as from all 128."""
    c = Cluster.from_file(os.path.join(CLUSTERS, "dgx_a100_1024.yaml"))
    ids, bw, lat = full_paths(c)
    rbw, rlat = c.path_matrices(ids)
    np.testing.assert_array_equal(rbw, bw)
    np.testing.assert_allclose(rlat, lat, rtol=1e-12)
    assert c._paths.reduced_nodes == 3 * 16 + 9


# ---- twins: the devices of a machine that reach everything alike -------------------------
def twin_machines(machines=2, gpus=12, shared=True) -> Cluster:
    """``machines`` machines of ``gpus`` GPUs and two NICs, the first half of the GPUs on
    NIC A, the rest on NIC B (PCIe), the NICs on one switch; the GPUs one NVLink group
    (``shared``), or no links among them (shared memory, implied)."""
    gpu = {"type": "GPU", "model": "G", "memory": 80, "gflops": {"bfloat16": 1000}}
    step = gpus + 2
    out, links = [], []
    for m in range(machines):
        base = m * step
        ids = list(range(base, base + gpus))
        inside = [{"source": g, "target": base + gpus + (k >= gpus // 2), "bandwidth": 25,
                   "latency": 2} for k, g in enumerate(ids)]
        if shared:
            inside.append({"group": ids, "bandwidth": 300, "latency": 3, "type": "NVL"})
        out.append({"hostname": f"n{m}", "devices": [{"global_id": g, **gpu} for g in ids],
                    "nics": [{"global_id": base + gpus}, {"global_id": base + gpus + 1}],
                    "links": inside})
        links += [{"source": base + gpus + r, "target": 1000, "bandwidth": 40, "latency": 1}
                  for r in range(2)]
    return Cluster.from_dict({"machines": out, "switches": [{"global_id": 1000}],
                              "links": links})


@pytest.mark.parametrize("machines, shared", [(1, True), (3, True), (4, False), (1, False)])
def test_twin_devices_give_the_full_matrices(machines, shared):
    """Best paths from three devices of each twin class (and three machines of a kind)
    equal the all-pairs matrices of every node, and so do the device meshes' worst pairs."""
    cluster = twin_machines(machines, shared=shared)
    ids, bw, lat = full_paths(cluster)
    rbw, rlat = cluster.path_matrices(ids)
    np.testing.assert_array_equal(rbw, bw)
    np.testing.assert_allclose(rlat, lat, rtol=1e-12)
    mesh = cluster.device_meshes[0]
    assert list(zip(mesh.dim_bandwidths, mesh.dim_latencies)) == \
        brute_mesh_dims(cluster, mesh)
    for a in ids[:20]:
        for b in ids[-20:]:
            assert (cluster.bandwidth(a, b), cluster.latency(a, b)) == \
                (bw[ids.index(a), ids.index(b)], lat[ids.index(a), ids.index(b)])
    assert cluster._paths.reduced_nodes < len(ids)


def test_a_machine_of_10000_devices_holds_its_links_as_one_group(tmp_path):
    """One machine of 10,000 GPUs in one NVLink group (and one with no links at all:
    shared memory implied): a group is one value, not 49,995,000 links, and the paths come
    from three of its devices."""
    gpu = {"type": "GPU", "model": "G", "memory": 80, "gflops": {"bfloat16": 1000}}
    devices = [{"global_id": i, **gpu} for i in range(10000)]
    for links, figures in (([{"group": list(range(10000)), "bandwidth": 300, "latency": 3,
                              "type": "NVL"}], (300.0, 3.0)), ([], (10.0, 30.0))):
        path = tmp_path / "big.json"
        path.write_text(json.dumps({"machines": [{"hostname": "big", "devices": devices,
                                                  "links": links}]}))
        c = Cluster.from_file(path)
        mesh = c.device_meshes[0]
        assert mesh.shape == (10000,)
        assert (mesh.dim_bandwidths[0], mesh.dim_latencies[0]) == figures
        assert (c.bandwidth(0, 9999), c.latency(17, 4242)) == figures
        assert c._paths.reduced_nodes == 3
        links = c.machines[0].links if links else c.implied_links[0]
        assert len(links) == 1 or len(links.groups) == 1
        assert "49995000" in c.describe()
