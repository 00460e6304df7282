"""The ``distgraph cluster`` commands, driven through add_cluster_parser."""

import argparse
import os

import pytest

import distgraph.resources
from distgraph.cli.cluster import add_cluster_parser
from distgraph.resources.cluster import Cluster

CLUSTERS = os.path.join(os.path.dirname(distgraph.resources.__file__), "clusters")


def run(argv):
    parser = argparse.ArgumentParser(prog="distgraph")
    add_cluster_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_show_prints_machines_meshes_and_links(capsys):
    assert run(["cluster", "show", os.path.join(CLUSTERS, "hetero_2gpu_2xpu.yaml")]) == 0
    out = capsys.readouterr().out
    assert "hetero_2gpu_2xpu" in out and "xpu-node1" in out
    assert "gpu" in out and "xpu" in out and "(2, 4)" in out and "20 (tor0)" in out
    assert "between machines" in out and "12.5" in out


def test_show_says_inside_which_machines_a_link_row_is(capsys):
    assert run(["cluster", "show", os.path.join(CLUSTERS, "gpu_2x8.yaml")]) == 0
    rows = [ln.split("  ")[1] for ln in capsys.readouterr().out.split("Links:")[1].splitlines()[2:]]
    assert rows == ["inside each of machines 0-1", "inside each of machines 0-1",
                    "between machines"]
    assert run(["cluster", "show", os.path.join(CLUSTERS, "local4.yaml")]) == 0
    assert "  inside machine 0  SHM" in capsys.readouterr().out


def test_a_saved_yaml_file_is_block_style_one_figure_per_line(tmp_path):
    cluster = Cluster.from_file(os.path.join(CLUSTERS, "gpu_2x8.yaml"))
    cluster.save(tmp_path / "out.yaml")
    text = (tmp_path / "out.yaml").read_text()
    assert "{" not in text and max(len(ln) for ln in text.splitlines()) <= 100
    assert "    bandwidth: 300\n" in text and "  shape: [2, 8]\n" in text
    assert Cluster.from_file(tmp_path / "out.yaml").describe() == cluster.describe()


def test_show_reports_a_bad_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("machines: []\n")
    assert run(["cluster", "show", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "bad.yaml" in err and "machines" in err


def test_subcommand_is_required():
    with pytest.raises(SystemExit):
        run(["cluster"])


def test_calibrate_refuses_an_unknown_suffix(tmp_path, capsys):
    assert run(["cluster", "calibrate", "-n", "2", "-o", str(tmp_path / "out.txt")]) == 2
    assert ".yaml" in capsys.readouterr().err


@pytest.mark.mpi
def test_calibrate_two_ranks_writes_a_loadable_file(tmp_path, capsys):
    out = tmp_path / "measured.yaml"
    assert run(["cluster", "calibrate", "-n", "2", "-o", str(out), "--repeats", "1",
                "--timeout", "120", "--device", "CPU"]) == 0
    assert "wrote" in capsys.readouterr().out
    cluster = Cluster.from_file(out)
    assert [d.global_id for d in cluster.devices] == [0, 1]
    for d in cluster.devices:
        assert d.type == "CPU" and d.memory > 0
        assert d.gflops["float32"] > 0 and d.gflops["float64"] > 0
        assert {"all_gather", "reduce_scatter", "sliced"} <= set(d.reshard_overhead)
    assert cluster.bandwidth(0, 1) > 0 and cluster.latency(0, 1) > 0
    assert cluster.calibration["ranks"] == 2
    assert cluster.calibration["allreduce_bus_bandwidth"] > 0
    assert cluster.calibration["allreduce_latency"] > 0
    assert cluster.device_meshes[0].size == 2


@pytest.mark.mpi
def test_calibrating_gpus_where_there_are_none_fails_saying_why(tmp_path, capsys):
    from distgraph.resources.gpus import NoGPU, detect_gpus
    try:
        detect_gpus()
        pytest.skip("this machine has a GPU (tests/test_gpu.py calibrates it)")
    except NoGPU:
        pass
    out = tmp_path / "gpus.yaml"
    assert run(["cluster", "calibrate", "-n", "1", "-o", str(out), "--device", "GPU",
                "--timeout", "120"]) != 0
    err = capsys.readouterr().err
    assert "NoGPU: distgraph cluster calibrate --device GPU needs " in err
    assert not out.exists()
