"""The pure parts of emulated clusters (no root needed): the layout a resource file gets,
subnet choice, namespace names, fault lines, and the relabelling of a calibration."""

import argparse
import os

import pytest

import distgraph as dg
from distgraph.errors import PlanError
from distgraph.tools.calibrate import build_cluster
from distgraph.tools.emulated import comparison, relabel, speed_comparison
from distgraph.runtime.emulate.cgroups import (CpuController, find_controller, quota,
                                               require_controller)
from distgraph.runtime.emulate.faults import parse_fault
from distgraph.runtime.emulate.launch import run_command
from distgraph.runtime.emulate.layout import (choose_subnet, namespace_name, parse_namespace,
                                              emulated_job, process_start, subnets_of, this_job)

CLUSTERS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "resources", "clusters")
FILE_2X2 = os.path.join(CLUSTERS, "emulated_2x2.yaml")


def two_by_two():
    return dg.Cluster.from_file(FILE_2X2)


def test_layout_places_rank_r_on_device_r_and_shapes_every_pair_to_the_file():
    cluster = two_by_two()
    layout = emulated_job(cluster, 4, job="77.5", subnet="10.9.8")
    assert [m.hostname for m in layout.machines] == ["node0", "node1"]
    assert [m.ranks for m in layout.machines] == [(0, 1), (2, 3)]
    assert [m.address for m in layout.machines] == ["10.9.8.2", "10.9.8.3"]
    assert layout.hub_address == "10.9.8.1"
    assert layout.namespaces == ["distgraph-77.5-hub", "distgraph-77.5-m0", "distgraph-77.5-m1"]
    assert layout.hosts_argument() == "10.9.8.2:2,10.9.8.3:2"
    assert layout.host_map() == {"10.9.8.2": ["distgraph-77.5-m0", "node0"],
                                 "10.9.8.3": ["distgraph-77.5-m1", "node1"]}
    assert sorted((s.src, s.dst) for s in layout.shapes) == [(0, 1), (1, 0)]
    for s in layout.shapes:
        assert s.bandwidth_GBps == cluster.bandwidth(0, 2) == 0.125
        assert s.latency_us == cluster.latency(0, 2) == 100
        assert s.rate_bits == 10**9
    assert layout.notes == ()


def test_layout_of_fewer_ranks_holds_only_their_machines():
    layout = emulated_job(two_by_two(), 2, job="1.2", subnet="10.1.1")
    assert [m.hostname for m in layout.machines] == ["node0"]
    assert layout.shapes == ()
    assert emulated_job(two_by_two(), 3, "1.2", "10.1.1").rank_machine == (0, 0, 1)


@pytest.mark.parametrize("nprocs, message", [(5, "at most 4 ranks"), (0, "at least 1")])
def test_layout_refuses_a_rank_count_the_file_cannot_hold(nprocs, message):
    with pytest.raises(PlanError, match=message):
        emulated_job(two_by_two(), nprocs, "1.2", "10.1.1")


def test_interleaved_devices_give_one_hydra_host_entry_per_run_of_ranks():
    def machine(mid, ids):
        return {"id": mid, "hostname": f"h{mid}", "devices": [
            {"global_id": i, "type": "CPU", "memory": 1, "gflops": {"float32": 1}} for i in ids]}
    cluster = dg.Cluster.from_dict({
        "machines": [machine(0, [0, 2]), machine(1, [1, 3])],
        "links": [{"source": a, "target": b, "bandwidth": 1, "latency": 5}
                  for a, b in ((0, 1), (0, 3), (2, 1), (2, 3))]})
    layout = emulated_job(cluster, 4, "1.2", "10.1.1")
    assert layout.rank_machine == (0, 1, 0, 1)
    assert layout.hosts_argument() == "10.1.1.2:1,10.1.1.3:1,10.1.1.2:1,10.1.1.3:1"


def test_pairs_of_a_heterogeneous_file_take_their_own_figures():
    cluster = dg.Cluster.from_file(os.path.join(CLUSTERS, "hetero_2gpu_2xpu.yaml"))
    n = len(cluster.devices)
    layout = emulated_job(cluster, n, "1.2", "10.1.1")
    assert len(layout.machines) == len(cluster.machines)
    for s in layout.shapes:
        a, b = layout.machines[s.src], layout.machines[s.dst]
        pairs = [(x, y) for x in a.devices for y in b.devices]
        assert s.bandwidth_GBps == min(cluster.bandwidth(x, y) for x, y in pairs)
        assert s.latency_us == max(cluster.latency(x, y) for x, y in pairs)


def test_subnets_are_picked_by_hash_and_skip_those_in_use():
    job = "4242.99"
    first = choose_subnet(job, set())
    assert first == choose_subnet(job, set())
    assert first.startswith("10.") and first not in ("10.0.0", "10.255.255")
    second = choose_subnet(job, {first})
    assert second != first
    assert subnets_of(["10.5.6.7/32"]) == {"10.5.6"}
    assert subnets_of(["192.168.1.2/24", "127.0.0.1/8"]) == set()
    assert len(subnets_of(["10.3.0.0/16"])) == 256
    assert choose_subnet(job, subnets_of(["10.0.0.0/9"])).split(".")[1] >= "128"


def test_namespace_names_say_which_job_owns_them():
    job = this_job()
    pid, start = map(int, job.split("."))
    assert pid == os.getpid() and start == process_start(os.getpid())
    assert parse_namespace(namespace_name(job, "m3")) == (pid, start, "m3")
    assert parse_namespace("someone-else") is None
    assert parse_namespace("distgraph-x.1-hub") is None


def test_fault_lines():
    hosts = ["node0", "node1", "gpu-a", "gpu-b"]
    f = parse_fault("link node0-node1 down at 5s", hosts)
    assert (f.a, f.b, f.state, f.at, f.duration) == ("node0", "node1", "down", 5.0, None)
    assert f.events() == [(5.0, "down")]
    f = parse_fault("link gpu-a-gpu-b stall at 500ms for 2", hosts)
    assert (f.a, f.b, f.state, f.at, f.duration) == ("gpu-a", "gpu-b", "stall", 0.5, 2.0)
    assert f.events() == [(0.5, "stall"), (2.5, "up")]


@pytest.mark.parametrize("line, message", [
    ("link node0-node9 down at 5s", "not two machines"),
    ("link node0-node1 down at soon", "not a time"),
    ("link node0-node0 down at 1s", "two different machines"),
    ("link node0-node1 broken at 1s", "expected 'link A-B down|stall"),
])
def test_bad_fault_lines_say_what_is_expected(line, message):
    with pytest.raises(PlanError, match=message):
        parse_fault(line, ["node0", "node1"])


def test_calibration_is_relabelled_into_the_files_machines_and_ids():
    source = dg.Cluster.from_file(FILE_2X2)
    ranks = [{"rank": r, "host": f"node{r // 2}", "model": "cpu", "memory": 8.0,
              "gflops": {"float32": 10.0 + r}, "memory_bandwidth": 5.0 + r,
              "op_overhead": 30.0 + r, "op_costs": {"matmul": (2.0 + r, 0.01)}}
             for r in range(4)]
    pairs = {(a, b): (0.1 if a // 2 != b // 2 else 3.0, 40.0) for a in range(4)
             for b in range(a + 1, 4)}
    measured = build_cluster(ranks, pairs, (0.2, 300.0), "calibrated4")
    out = relabel(measured, source, 4)
    assert [(m.id, m.hostname) for m in out.machines] == [(0, "node0"), (1, "node1")]
    assert [d.global_id for d in out.devices] == [0, 1, 2, 3]
    assert [d.gflops["float32"] for d in out.devices] == [10.0, 11.0, 12.0, 13.0]
    # every measured figure the cost model reads comes along; type, model, memory stay
    assert [d.memory_bandwidth for d in out.devices] == [5.0, 6.0, 7.0, 8.0]
    assert [d.op_overhead for d in out.devices] == [30.0, 31.0, 32.0, 33.0]
    assert out.devices[3].op_costs["matmul"] == (5.0, 0.01)
    assert [d.memory for d in out.devices] == [d.memory for d in source.devices]
    assert [(m.name, m.shape, list(m.ids)) for m in out.device_meshes] == \
        [(m.name, m.shape, list(m.ids)) for m in source.device_meshes]
    assert out.bandwidth(0, 2) == pytest.approx(0.1)
    table, ratios = comparison(source, out)
    assert ratios == pytest.approx([0.8] * 4)
    assert "4 of 4 pairs measure within 20%" in table


def test_relabelling_keeps_each_devices_measured_costs():
    """An emulated calibration's file keeps what each rank measured besides GFLOP/s: the
    cost model (and MeshSlice's autotuner) price ops and reshard steps with them."""
    source = dg.Cluster.from_file(FILE_2X2)
    ranks = [{"rank": r, "host": f"node{r // 2}", "model": "cpu", "memory": 8.0,
              "gflops": {"float32": 10.0 + r}, "memory_bandwidth": 5.0 + r,
              "op_overhead": 30.0 + r, "op_costs": {"matmul": [1.0, 0.1 * (r + 1)]}}
             for r in range(4)]
    pairs = {(a, b): (0.1 if a // 2 != b // 2 else 3.0, 40.0) for a in range(4)
             for b in range(a + 1, 4)}
    steps = {"slice": [(4096, 1e-5)], "all_gather": [(4096, 2e-3), (65536, 3e-3)]}
    out = relabel(build_cluster(ranks, pairs, (0.2, 300.0), "calibrated4", steps), source, 4)
    for r, d in enumerate(out.devices):
        assert (d.memory_bandwidth, d.op_overhead) == (5.0 + r, 30.0 + r)
        assert d.op_costs["matmul"] == pytest.approx((1.0, 0.1 * (r + 1)))
        assert set(d.reshard_overhead) == {"slice", "all_gather"}


def _args(**kw):
    base = dict(nprocs=2, cluster=None, emulate=None, emulate_fault=[], script="x.py", args=[])
    return argparse.Namespace(**{**base, **kw})


def test_run_command_checks_its_options_before_anything_starts(capsys):
    assert run_command(_args(emulate_fault=["link node0-node1 down at 1s"])) == 2
    assert "--emulate-fault needs --emulate" in capsys.readouterr().err
    assert run_command(_args(emulate=FILE_2X2, cluster="other.yaml")) == 2
    assert "give only --emulate" in capsys.readouterr().err


MIXED_2X1 = os.path.join(CLUSTERS, "emulated_mixed_2x1.yaml")
MIXED_2X2 = os.path.join(CLUSTERS, "emulated_mixed_2x2.yaml")


def test_a_slower_machine_gets_its_share_of_the_fastest_machines_cores():
    layout = emulated_job(dg.Cluster.from_file(MIXED_2X2), 4, "1.2", "10.1.1")
    assert layout.throttled and layout.speed_dtype == "float32"
    assert [(m.speed, m.cpu_cores) for m in layout.machines] == [(1.0, 2.0), (0.5, 1.0)]
    assert "computes at 0.5 x the fastest (1 cores)" in layout.describe()
    # fewer ranks: the file's fastest machine still sets the scale
    one = emulated_job(dg.Cluster.from_file(MIXED_2X1), 2, "1.2", "10.1.1")
    assert [m.cpu_cores for m in one.machines] == [1.0, 0.5]
    assert not emulated_job(dg.Cluster.from_file(MIXED_2X2), 2, "1.2", "10.1.1").throttled


def test_machines_of_equal_speed_are_not_throttled():
    layout = emulated_job(two_by_two(), 4, "1.2", "10.1.1")
    assert not layout.throttled
    assert [m.speed for m in layout.machines] == [1.0, 1.0]


def test_speeds_compare_one_dtype_that_every_device_gives():
    def machine(mid, gflops):
        return {"id": mid, "hostname": f"h{mid}", "devices": [
            {"global_id": mid, "type": "CPU", "memory": 1, "gflops": gflops}]}
    links = [{"source": 0, "target": 1, "bandwidth": 1, "latency": 5}]
    apart = dg.Cluster.from_dict({"machines": [machine(0, {"float32": 4}),
                                               machine(1, {"float64": 2})], "links": links})
    with pytest.raises(PlanError, match="no dtype appears in every device"):
        emulated_job(apart, 2, "1.2", "10.1.1")
    f64 = dg.Cluster.from_dict({"machines": [machine(0, {"float64": 4}),
                                             machine(1, {"float64": 1})], "links": links})
    layout = emulated_job(f64, 2, "1.2", "10.1.1")
    assert layout.speed_dtype == "float64"
    assert [m.speed for m in layout.machines] == [1.0, 0.25]


def test_quota_period_weight_and_the_slowest_machine_it_can_emulate():
    assert quota(1.0) == (10_000, 10_000, 1024)
    assert quota(0.5) == (10_000, 5_000, 512)
    assert quota(2.0) == (10_000, 20_000, 2048)
    assert quota(0.05) == (100_000, 5_000, 51)      # under 1 ms per 10 ms: longer period
    with pytest.raises(PlanError, match="at least 1%"):
        quota(0.005)


V1 = ("30 25 0:26 / /sys/fs/cgroup/cpu rw,relatime shared:9 - cgroup cgroup rw,cpu\n"
      "35 25 0:31 / /sys/fs/cgroup/unified rw,relatime shared:14 - cgroup2 cgroup2 rw\n")
V2 = "25 1 0:22 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"


def test_the_cpu_controller_is_found_in_v1_or_v2_and_missing_is_one_line():
    assert find_controller(V1, lambda path: "") == CpuController(1, "/sys/fs/cgroup/cpu")
    assert find_controller(V2, lambda path: "cpuset cpu io memory") == \
        CpuController(2, "/sys/fs/cgroup")
    assert find_controller(V2, lambda path: "memory pids") is None
    with pytest.raises(PlanError) as err:
        require_controller(mountinfo=V2.replace("cgroup2", "tmpfs"))
    assert "no cgroup cpu controller" in str(err.value) and "\n" not in str(err.value)


def test_speed_table_compares_each_machines_share_with_the_files():
    source = dg.Cluster.from_file(MIXED_2X2)
    ranks = [{"rank": r, "host": f"node{r // 2}", "model": "cpu", "memory": 8.0,
              "gflops": {"float32": 40.0 if r < 2 else 24.0, "float64": 1.0}}
             for r in range(4)]
    pairs = {(a, b): (0.1, 40.0) for a in range(4) for b in range(a + 1, 4)}
    out = relabel(build_cluster(ranks, pairs, None, "calibrated4"), source, 4)
    table, shares = speed_comparison(source, out)
    assert shares == pytest.approx([1.0, 24.0 / 40.0 / 0.5])
    assert "1 of 2 machines compute within 15% of the file's speed ratio" in table


@pytest.mark.parametrize("name, windowed", [("emulated_2x2.yaml", False),
                                            ("emulated_mixed_2x2.yaml", True)])
def test_calibrating_an_emulated_file_sustains_gemm_windows_only_under_a_quota(
        name, windowed, monkeypatch, tmp_path):
    """``calibrate --emulate`` times GEMMs over sustained windows where a machine of the
    file computes slower (its ranks get a CPU quota), and by the fastest runs times the
    core share where none does (the measuring ranks' arguments, as launched)."""
    import distgraph.tools.emulated as E

    path = os.path.join(CLUSTERS, name)
    assert emulated_job(dg.Cluster.from_file(path), 4, "x", "10.0.0").throttled == windowed
    launched = []
    monkeypatch.setattr(E, "launch_emulated",
                        lambda file, n, argv, timeout=None: launched.append(argv) or 1)
    args = argparse.Namespace(emulate=path, nprocs=4, repeats=1, timeout=None,
                              output=str(tmp_path / "out.yaml"))
    assert E.calibrate_command_emulated(args) == 1           # the ranks "failed": no file
    assert ("--gemm-window" in launched[0]) == windowed
