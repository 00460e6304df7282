"""This machine measured once and kept: ``distgraph run`` without ``--cluster`` measures
it for N ranks (the calibration's own ranks, really started) the first time, keeps the
file under ``$DISTGRAPH_CACHE_DIR`` keyed by host, version and N, gives it to the job's
Engine and to ``Cluster.local(N)``; the next run reuses it, ``--recalibrate`` measures
again. Oracles: the files on disk and what the job's ranks print of their cluster."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

import distgraph as dg
from distgraph.resources.local_cache import LAYOUT, cache_dir, local_file

SCRIPT = """
import numpy as np
import distgraph as dg

class Rows:
    def __len__(self):
        return 16
    def __getitem__(self, i):
        x = np.random.default_rng(i).normal(size=16).astype("float32")
        return x, x[:4]

mesh = dg.ProcessMesh([0, 1], ["dp"])
dg.seed(0)
engine = dg.Engine(dg.nn.MLP(16, 32, 4), loss=dg.nn.MSELoss(), optimizer=dg.optim.SGD(0.1))
engine.fit(dg.shard_dataloader(Rows(), mesh, shard_dims="dp"), batch_size=8, verbose=0)
plan = engine.plan()
if engine.rank == 0:
    print("CLUSTER", engine.cluster.name, engine.cluster.figures,
          dg.Cluster.local(2) == engine.cluster)
    print("UNCALIBRATED" if "uncalibrated" in plan.explain() else "MEASURED")
"""


def test_cluster_local_is_the_kept_measurement_where_there_is_one(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTGRAPH_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    path = local_file(3)
    assert path.parent == tmp_path / "clusters" and path.name.endswith(
        f"-{dg.__version__}-c{LAYOUT}-n3.yaml")
    assert not dg.Cluster.local(3).calibrated                 # nothing kept: defaults
    measured = dataclasses.replace(dg.Cluster.local(3), name="local3", figures="measured")
    measured = dataclasses.replace(measured, machines=tuple(
        dataclasses.replace(m, devices=tuple(dataclasses.replace(d, gflops={"float32": 77.0})
                                             for d in m.devices)) for m in measured.machines))
    path.parent.mkdir(parents=True)
    measured.save(path)
    got = dg.Cluster.local(3)
    assert got.calibrated and got.device(0).flops("float32") == 77e9
    assert not dg.Cluster.local(2).calibrated                  # kept per number of ranks
    path.write_text("machines: [")                             # a broken file is not used
    assert not dg.Cluster.local(3).calibrated
    monkeypatch.delenv("DISTGRAPH_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "distgraph"


def run(tmp_path, *options):
    env = dict(os.environ, OMP_NUM_THREADS="1", DISTGRAPH_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("DISTGRAPH_CALIBRATE")                # the suite turns measuring off; not here
    script = tmp_path / "fit.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, "-m", "distgraph.cli", "run", "-n", "2", *options,
                           str(script)], capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.mpi
def test_distgraph_run_measures_this_machine_once_and_its_engine_plans_on_it(tmp_path):
    first = run(tmp_path)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    kept = sorted((tmp_path / "cache" / "clusters").iterdir())
    assert len(kept) == 1 and kept[0].name.endswith("-n2.yaml")
    assert f"measuring this machine for 2 rank(s), once: kept in {kept[0]}" in first.stderr
    assert "CLUSTER local2 measured True" in first.stdout and "MEASURED" in first.stdout
    written = kept[0].stat().st_mtime_ns
    again = run(tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "measuring" not in again.stderr and kept[0].stat().st_mtime_ns == written
    assert "CLUSTER local2 measured True" in again.stdout
    remeasured = run(tmp_path, "--recalibrate")
    assert remeasured.returncode == 0, remeasured.stderr[-3000:]
    assert "measuring this machine for 2 rank(s)" in remeasured.stderr
    assert kept[0].stat().st_mtime_ns != written
    wrong = run(tmp_path, "--recalibrate", "--cluster", str(kept[0]))
    assert wrong.returncode == 2 and "--recalibrate measures this machine" in wrong.stderr
