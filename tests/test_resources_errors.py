"""Malformed resource files: each raises ResourceFileError naming file, key path and line.

Schema cases start from a valid cluster, break one thing, and are written both as YAML and
as JSON; the reported line must be the line that holds the offending key. Syntax cases
check the parser's line. Nothing may escape as KeyError/TypeError/ValueError.
"""

import copy
import json

import pytest
import yaml
from hypothesis import given, settings, strategies as st

from distgraph.errors import ResourceFileError
from distgraph.resources.cluster import Cluster


def valid():
    gpu = {"type": "GPU", "model": "m", "memory": 40, "gflops": {"float32": 100}}
    return {
        "name": "t",
        "machines": [
            {"hostname": "a",
             "devices": [{"global_id": 0, **gpu}, {"global_id": 1, **gpu}],
             "nics": [{"global_id": 10}],
             "links": [{"source": 0, "target": 1, "bandwidth": 300, "latency": 2},
                       {"source": 0, "target": 10, "bandwidth": 32, "latency": 1},
                       {"source": 1, "target": 10, "bandwidth": 32, "latency": 1}]},
            {"hostname": "b",
             "devices": [{"global_id": 2, **gpu}],
             "nics": [{"global_id": 11}],
             "links": [{"source": 2, "target": 11, "bandwidth": 32, "latency": 1}]},
        ],
        "links": [{"source": 10, "target": 11, "bandwidth": 12.5, "latency": 5}],
    }


def m(d, i):
    return d["machines"][i]


def dev(d, i, j):
    return d["machines"][i]["devices"][j]


def link(d, i, j):
    return d["machines"][i]["links"][j]


# (id, mutation, key path in the message, text the offending line holds or None)
SCHEMA_CASES = [
    ("memory_negative", lambda d: dev(d, 1, 0).update(memory=-4),
     "machines[1].devices[0].memory", "memory"),
    ("memory_text", lambda d: dev(d, 0, 1).update(memory="forty"),
     "machines[0].devices[1].memory", "memory"),
    ("memory_bool", lambda d: dev(d, 0, 0).update(memory=True),
     "machines[0].devices[0].memory", "memory"),
    ("memory_missing", lambda d: dev(d, 0, 1).pop("memory"), "machines[0].devices[1].memory",
     None),
    # a reserve below 0, or one that leaves nothing of the device's memory (40 GB)
    ("reserved_negative", lambda d: dev(d, 1, 0).update(reserved_memory=-1),
     "machines[1].devices[0].reserved_memory", "reserved_memory"),
    ("reserved_all", lambda d: dev(d, 0, 1).update(reserved_memory=40),
     "machines[0].devices[1].reserved_memory", "reserved_memory"),
    ("reserved_more", lambda d: dev(d, 0, 0).update(reserved_memory="41"),
     "machines[0].devices[0].reserved_memory", "reserved_memory"),
    ("reserved_text", lambda d: dev(d, 0, 0).update(reserved_memory="some"),
     "machines[0].devices[0].reserved_memory", "reserved_memory"),
    # the share of a collective hidden behind compute: from 0 to 1
    ("overlap_above_one", lambda d: dev(d, 0, 0).update(overlap_efficiency=1.5),
     "machines[0].devices[0].overlap_efficiency", "overlap_efficiency"),
    ("overlap_negative", lambda d: dev(d, 1, 0).update(overlap_efficiency=-0.2),
     "machines[1].devices[0].overlap_efficiency", "overlap_efficiency"),
    ("hostname_missing", lambda d: m(d, 0).pop("hostname"), "machines[0].hostname", None),
    ("hostname_not_text", lambda d: m(d, 1).update(hostname=42), "machines[1].hostname",
     "hostname"),
    ("machines_missing", lambda d: d.pop("machines"), "machines", None),
    ("machines_not_list", lambda d: d.update(machines={"a": 1}), "machines", "machines"),
    ("machines_empty", lambda d: d.update(machines=[]), "machines", "machines"),
    ("machine_not_mapping", lambda d: d["machines"].append("node9"), "machines[2]", None),
    ("devices_empty", lambda d: m(d, 1).update(devices=[]), "machines[1].devices", "devices"),
    ("global_id_missing", lambda d: dev(d, 0, 0).pop("global_id"),
     "machines[0].devices[0].global_id", None),
    ("global_id_negative", lambda d: dev(d, 1, 0).update(global_id=-2),
     "machines[1].devices[0].global_id", "global_id"),
    ("global_id_float", lambda d: dev(d, 1, 0).update(global_id=1.5),
     "machines[1].devices[0].global_id", "global_id"),
    ("global_id_duplicate", lambda d: dev(d, 1, 0).update(global_id=0),
     "machines[1].devices[0].global_id", "global_id"),
    ("nic_id_clashes_with_device", lambda d: m(d, 0)["nics"][0].update(global_id=1),
     "machines[0].nics[0].global_id", "global_id"),
    # one local id is one device, which ranks may share: two models cannot be it
    ("local_id_of_two_models", lambda d: [dev(d, 0, j).update(local_id=0, model=f"m{j}")
                                          for j in (0, 1)],
     "machines[0].devices[1].local_id", "local_id"),
    ("machine_id_duplicate", lambda d: [m(d, i).update(id=0) for i in (0, 1)],
     "machines[1].id", "id"),
    ("unknown_device_type", lambda d: dev(d, 0, 0).update(type="TPUX"),
     "machines[0].devices[0].type", "type"),
    ("nic_listed_as_device", lambda d: dev(d, 1, 0).update(type="NIC"),
     "machines[1].devices[0].type", "type"),
    ("gflops_not_mapping", lambda d: dev(d, 0, 0).update(gflops=100),
     "machines[0].devices[0].gflops", "gflops"),
    ("gflops_unknown_dtype", lambda d: dev(d, 0, 0).update(gflops={"fp32": 100}),
     "machines[0].devices[0].gflops.fp32", "fp32"),
    ("gflops_zero", lambda d: dev(d, 0, 1).update(gflops={"float32": 0}),
     "machines[0].devices[1].gflops.float32", "float32"),
    ("gflops_empty", lambda d: dev(d, 0, 1).update(gflops={}),
     "machines[0].devices[1].gflops", "gflops"),
    ("unknown_key_typo", lambda d: d["links"][0].update(bandwith=12.5),
     "links[0].bandwith", "bandwith"),
    ("link_unknown_device", lambda d: link(d, 0, 0).update(target=99),
     "machines[0].links[0].target", "target"),
    ("link_into_other_machine", lambda d: link(d, 0, 0).update(target=2),
     "machines[0].links[0].target", "target"),
    ("link_to_itself", lambda d: link(d, 0, 0).update(target=0),
     "machines[0].links[0].target", "target"),
    ("bandwidth_zero", lambda d: d["links"][0].update(bandwidth=0),
     "links[0].bandwidth", "bandwidth"),
    ("bandwidth_negative", lambda d: link(d, 0, 1).update(bandwidth=-1),
     "machines[0].links[1].bandwidth", "bandwidth"),
    ("bandwidth_missing", lambda d: d["links"][0].pop("bandwidth"), "links[0].bandwidth", None),
    ("latency_negative", lambda d: link(d, 1, 0).update(latency=-0.5),
     "machines[1].links[0].latency", "latency"),
    ("link_twice", lambda d: m(d, 0)["links"].append({"source": 1, "target": 0,
                                                       "bandwidth": 1, "latency": 1}),
     "machines[0].links[3]", None),
    ("top_level_link_inside_machine",
     lambda d: d["links"].append({"source": 0, "target": 1, "bandwidth": 1, "latency": 1}),
     "links[1].source", "source"),
    ("group_and_pair", lambda d: link(d, 0, 0).update(group=[0, 1]), "machines[0].links[0]",
     None),
    ("group_too_small", lambda d: m(d, 0)["links"].append({"group": [1], "bandwidth": 1,
                                                            "latency": 1}),
     "machines[0].links[3].group", "group"),
    ("machines_disconnected", lambda d: d.pop("links"), "links", None),
    ("mesh_shape_mismatch",
     lambda d: d.update(device_meshes=[{"name": "g", "shape": [2, 2], "device_ids": [0, 1, 2]}]),
     "device_meshes[0].device_ids", "device_ids"),
    ("mesh_unknown_device",
     lambda d: d.update(device_meshes=[{"name": "g", "shape": [2], "device_ids": [0, 7]}]),
     "device_meshes[0].device_ids", "device_ids"),
    ("mesh_mixes_models", lambda d: (dev(d, 1, 0).update(model="other"), d.update(
        device_meshes=[{"name": "g", "shape": [3], "device_ids": [0, 1, 2]}])),
     "device_meshes[0].device_ids", "device_ids"),
    ("meshes_overlap", lambda d: d.update(device_meshes=[
        {"name": "a", "shape": [2], "device_ids": [0, 1]},
        {"name": "b", "shape": [2], "device_ids": [1, 2]}]),
     "device_meshes[1].device_ids", "device_ids"),
    ("mesh_shape_zero",
     lambda d: d.update(device_meshes=[{"name": "g", "shape": [0], "device_ids": [0]}]),
     "device_meshes[0].shape[0]", None),
    ("switch_id_clash", lambda d: d.update(switches=[{"global_id": 2}]),
     "switches[0].global_id", "global_id"),
    ("calibration_not_number", lambda d: d.update(calibration={"p2p": "fast"}),
     "calibration.p2p", "p2p"),
    ("top_level_is_a_list", lambda d: d.update(_replace_with=[1, 2]), "<top level>", None),
]


def write(tmp_path, name, suffix, data):
    path = tmp_path / f"{name}{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(data, indent=1))
    else:
        path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def load_error(path) -> str:
    with pytest.raises(ResourceFileError) as err:
        Cluster.from_file(path)
    return str(err.value)


def test_the_base_case_is_valid(tmp_path):
    for suffix in (".yaml", ".json"):
        c = Cluster.from_file(write(tmp_path, "ok", suffix, valid()))
        assert c.bandwidth(0, 2) == 12.5


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
@pytest.mark.parametrize("case_id, mutate, key, line_text", SCHEMA_CASES,
                         ids=[c[0] for c in SCHEMA_CASES])
def test_schema_error_names_file_key_and_line(tmp_path, suffix, case_id, mutate, key,
                                              line_text):
    data = copy.deepcopy(valid())
    mutate(data)
    if "_replace_with" in data:
        data = data["_replace_with"]
    path = write(tmp_path, f"bad_{case_id}", suffix, data)
    msg = load_error(path)
    assert path.name in msg
    assert f": {key}" in msg, msg
    assert "expected" in msg
    if line_text is not None:
        line = int(msg.split("(line ", 1)[1].split(")", 1)[0])
        assert line_text in path.read_text().splitlines()[line - 1], msg


SYNTAX_CASES = [
    ("unclosed_flow.yaml", "machines: [\n  {hostname: a\n", 3),
    ("bad_indent.yaml", "machines:\n  - hostname: a\n    devices: []\n   links: []\n", 4),
    ("tab_indent.yaml", "machines:\n\t- hostname: a\n", 2),
    ("trailing_comma.json", '{"machines": [1,]}', 1),
    ("missing_brace.json", '{\n "machines": [\n  {"hostname": "a"\n ]\n}\n', 4),
    ("single_quotes.json", "{\n 'machines': []\n}", 2),
]


@pytest.mark.parametrize("name, text, line", SYNTAX_CASES, ids=[c[0] for c in SYNTAX_CASES])
def test_syntax_error_names_file_and_line(tmp_path, name, text, line):
    path = tmp_path / name
    path.write_text(text)
    msg = load_error(path)
    assert path.name in msg and f"(line {line}," in msg, msg
    assert ("invalid JSON" if name.endswith(".json") else "invalid YAML") in msg


@pytest.mark.parametrize("name, text", [("empty.yaml", ""), ("blank.json", "  \n\n"),
                                        ("comments_only.yaml", "# nothing here\n")])
def test_empty_file(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    msg = load_error(path)
    assert path.name in msg and "<top level>" in msg and "empty" in msg


def test_missing_file_and_unknown_save_suffix(tmp_path):
    msg = load_error(tmp_path / "nowhere.yaml")
    assert "nowhere.yaml" in msg and "no such" in msg
    with pytest.raises(ResourceFileError, match=r"\.yaml, \.yml or \.json"):
        Cluster.local(2).save(tmp_path / "cluster.txt")


def paddle_valid():
    return {"machines": [{"hostname": "h", "addr": "1.2.3.4", "port": "60009", "devices": [
        {"global_id": 0, "local_id": 0, "type": "GPU", "model": "V100", "memory": "32",
         "sp_gflops": "15700", "dp_gflops": "7800"},
        {"global_id": 1, "local_id": 1, "type": "GPU", "model": "V100", "memory": "32",
         "sp_gflops": "15700", "dp_gflops": "7800"}],
        "links": [{"source_global_id": 0, "target_global_id": 1, "type": "NVL",
                   "bandwidth": 235.0}]}]}


PADDLE_CASES = [
    ("link_bandwidth_missing", lambda d: link(d, 0, 0).pop("bandwidth"),
     "machines[0].links[0].bandwidth"),
    ("memory_text", lambda d: dev(d, 0, 1).update(memory="lots"),
     "machines[0].devices[1].memory"),
    ("unknown_target", lambda d: link(d, 0, 0).update(target_global_id=5),
     "machines[0].links[0].target_global_id"),
    ("duplicate_global_id", lambda d: dev(d, 0, 1).update(global_id=0),
     "machines[0].devices[1].global_id"),
    ("unknown_type", lambda d: dev(d, 0, 1).update(type="FPGA"), "machines[0].devices[1].type"),
    ("bandwidth_negative", lambda d: link(d, 0, 0).update(bandwidth=-235),
     "machines[0].links[0].bandwidth"),
    ("reserved_all", lambda d: dev(d, 0, 1).update(reserved_memory="32"),
     "machines[0].devices[1].reserved_memory"),
    ("reserved_negative", lambda d: dev(d, 0, 0).update(reserved_memory=-2),
     "machines[0].devices[0].reserved_memory"),
    # a second machine and no link between the two (the devices of one machine reach
    # each other through its shared memory: one machine without links is connected)
    ("not_connected", lambda d: d["machines"].append(second_machine(d)), "links"),
]


def second_machine(data):
    """A copy of the first machine with global ids 2 and 3, linked to nothing outside."""
    other = json.loads(json.dumps(data["machines"][0]))
    other["hostname"] = "h2"
    for device in other["devices"]:
        device["global_id"] += 2
    for ln in other["links"]:
        ln["source_global_id"] += 2
        ln["target_global_id"] += 2
    return other


def test_paddle_base_case_is_valid(tmp_path):
    c = Cluster.from_file(write(tmp_path, "paddle_ok", ".json", paddle_valid()))
    assert c.bandwidth(0, 1) == 235.0 and c.devices[0].memory == 32.0


@pytest.mark.parametrize("case_id, mutate, key", PADDLE_CASES, ids=[c[0] for c in PADDLE_CASES])
def test_paddle_error_names_file_and_key(tmp_path, case_id, mutate, key):
    data = paddle_valid()
    mutate(data)
    path = write(tmp_path, f"paddle_{case_id}", ".json", data)
    msg = load_error(path)
    assert path.name in msg and f": {key}" in msg, msg


def leaf_paths(data, prefix=()):
    """Every path (tuple of keys/indices) into nested dicts and lists."""
    yield prefix
    if isinstance(data, dict):
        for k, v in data.items():
            yield from leaf_paths(v, prefix + (k,))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from leaf_paths(v, prefix + (i,))


JUNK = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**12), st.floats(allow_nan=True),
                 st.text(max_size=5), st.lists(st.integers(-1, 3), max_size=3),
                 st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_any_corruption_is_a_resource_file_error_or_loads(data):
    base = valid() if data.draw(st.booleans()) else paddle_valid()
    paths = list(leaf_paths(base))[1:]
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths))
        parent = base
        try:
            for key in path[:-1]:
                parent = parent[key]
            if data.draw(st.booleans()):
                parent[path[-1]] = data.draw(JUNK)
            elif isinstance(parent, dict):
                parent.pop(path[-1], None)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier corruption removed this path; nothing to do
    try:
        Cluster.from_dict(base, "fuzz.json")
    except ResourceFileError as err:
        assert str(err).startswith("fuzz.json")
