"""Emulated clusters for real (root only): namespaces, shaped links, MPI over TCP between
machines, training equal to serial, calibration, faults, signals, and no leftovers.

Each test starts ``distgraph run --emulate`` as a subprocess and, whatever happens,
stops it and removes what its job made (``launched``); the last test checks that this
module left no namespace, network device or qdisc behind. Skipped with the reason where
this process cannot create network namespaces.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import distgraph as dg
from distgraph.runtime.emulate.namespaces import (check_prerequisites, job_alive,
                                                  leftover_folders, other_jobs, our_namespaces,
                                                  remove_job)
from distgraph.runtime.emulate.layout import (namespace_name, parse_namespace, process_start,
                                              this_job)
from test_meshslice_mpi import check_cases
from test_spmd_mpi import check_report

ROOT = Path(__file__).resolve().parent.parent
FILE_2X2 = str(ROOT / "resources" / "clusters" / "emulated_2x2.yaml")
PROBE = str(ROOT / "tests" / "mpi_scripts" / "emulated_probe.py")
TRAIN = str(ROOT / "tests" / "mpi_scripts" / "train_plans.py")
MESHSLICE = str(ROOT / "tests" / "mpi_scripts" / "meshslice_cases.py")
LINK_GBPS = 0.125
TOLERANCE = 0.2
BOUND = 60      # seconds a job of a few seconds gets before the test fails saying so


def _cannot_emulate() -> str | None:
    try:
        check_prerequisites()
    except dg.DistGraphError as err:
        return str(err)
    probe = namespace_name(this_job(), "probe")
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


REASON = _cannot_emulate()
pytestmark = [pytest.mark.mpi, pytest.mark.skipif(REASON is not None,
                                                  reason=f"emulated clusters: {REASON}")]


def root_network() -> tuple:
    """This namespace's network devices and qdiscs, to compare before and after."""
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    qdiscs = subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True).stdout
    return (sorted(line.split(":")[1].strip() for line in links.splitlines()),
            sorted(qdiscs.splitlines()))


@pytest.fixture(scope="module")
def network_before():
    return root_network()


class Launcher:
    """Starts ``distgraph run`` jobs and, at teardown, ends and removes whatever is left."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, *args, env=None) -> subprocess.Popen:
        env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
        proc = subprocess.Popen([sys.executable, "-m", "distgraph.cli", *args], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=ROOT)
        self.procs.append(proc)
        return proc

    def run(self, *args, env=None, timeout=120) -> subprocess.CompletedProcess:
        """The job's result; a job still running after ``timeout`` seconds is stopped
        (its cluster removed) and the test fails saying so, with what the job printed and
        the other emulated jobs of this machine, not with a bare TimeoutExpired."""
        proc = self.start(*args, env=env)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            others = other_jobs(f"{proc.pid}.{process_start(proc.pid)}")
            proc.send_signal(signal.SIGTERM)
            try:
                out, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            pytest.fail(f"`distgraph {' '.join(args)}` was still running after {timeout} s "
                        f"and was stopped; other emulated jobs here then: "
                        f"{'; '.join(others) or 'none'}\n{out[-2000:]}{err[-2000:]}")
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def namespaces_of(self, proc) -> list[str]:
        return [n for n in our_namespaces() if parse_namespace(n)[0] == proc.pid]

    def cleanup(self) -> list[str]:
        left = []
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.communicate()
            for name in self.namespaces_of(proc):
                pid, start, _ = parse_namespace(name)
                left += remove_job(f"{pid}.{start}")
        return left


@pytest.fixture
def launched(network_before):
    launcher = Launcher()
    try:
        yield launcher
    finally:
        left = launcher.cleanup()
    assert left == [], f"the job left namespaces behind: {left}"


def probe(result) -> dict:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("EMULATED-PROBE ")]
    assert len(lines) == 1, result.stdout[-3000:]
    return json.loads(lines[0].split(" ", 1)[1])


def test_ranks_run_on_the_files_machines_and_cross_machines_over_the_shaped_link(launched):
    # Rank 0 and 1 share node0, so their MPI uses shared memory; ranks 0 and 2 are on
    # different machines, so theirs goes over TCP through the link shaped to 1 Gbit/s.
    # Were it shared memory (MPICH's default transport), it would run at GB/s.
    report = probe(launched.run("run", "-n", "4", "--emulate", FILE_2X2, PROBE, "0-1", "0-2",
                                "1-3", timeout=BOUND))
    assert report["hostnames"] == ["node0", "node0", "node1", "node1"]
    assert report["cluster"] == [FILE_2X2] * 4
    for pair in ("0-2", "1-3"):
        assert abs(report["bandwidth"][pair] / LINK_GBPS - 1) <= TOLERANCE, report
    assert report["bandwidth"]["0-1"] > 4 * LINK_GBPS, report


def test_two_emulated_jobs_at_once_do_not_meet(launched):
    """Issue #52: with another emulated job running, a job runs in namespaces and
    addresses of its own, says that the other shares the machine's cores, and leaves the
    other running and whole (the README's suite timed out here after 120 s while another
    job ran). Bandwidths are not checked: the two share 2 cores."""
    first = launched.start("run", "-n", "4", "--emulate", FILE_2X2, PROBE, "--allreduce",
                           "12", "0-2")
    names = _wait_for_namespaces(launched, first, 3)
    job = "{}.{}".format(*parse_namespace(names[0])[:2])
    second = launched.run("run", "-n", "4", "--emulate", FILE_2X2, PROBE, "0-1", "0-2",
                          timeout=BOUND)
    assert probe(second)["hostnames"] == ["node0", "node0", "node1", "node1"]
    assert "other emulated cluster" in second.stderr and f"job {job} (pid {first.pid}: " \
        in second.stderr, second.stderr[-2000:]
    assert first.poll() is None and sorted(launched.namespaces_of(first)) == sorted(names)
    out, err = first.communicate(timeout=BOUND)
    report = probe(subprocess.CompletedProcess(first.args, first.returncode, out, err))
    assert len({r["count"] for r in report["allreduce"]}) == 1
    subnets = [next(ln.split("addresses ")[1] for ln in e.splitlines() if "addresses " in ln)
               for e in (err, second.stderr)]
    assert subnets[0] != subnets[1], subnets


THREE_MACHINES = """
name: three
machines:
  - {hostname: ma, devices: [{global_id: 0, type: CPU, memory: 1, gflops: {float32: 1}}]}
  - {hostname: mb, devices: [{global_id: 1, type: CPU, memory: 1, gflops: {float32: 1}}]}
  - {hostname: mc, devices: [{global_id: 2, type: CPU, memory: 1, gflops: {float32: 1}}]}
links:
  - {source: 0, target: 1, bandwidth: 0.25, latency: 10}
  - {source: 0, target: 2, bandwidth: 0.0625, latency: 10}
  - {source: 1, target: 2, bandwidth: 0.0625, latency: 10}
"""


def test_each_pair_of_machines_gets_its_own_bandwidth(launched, tmp_path):
    # Machine ma sends to mb at 2 Gbit/s and to mc at 0.5 Gbit/s over the same interface:
    # the shaping is per destination.
    path = tmp_path / "three.yaml"
    path.write_text(THREE_MACHINES)
    cluster = dg.Cluster.from_file(path)
    report = probe(launched.run("run", "-n", "3", "--emulate", str(path), PROBE, "0-1", "0-2",
                                "1-2"))
    assert report["hostnames"] == ["ma", "mb", "mc"]
    for pair, measured in report["bandwidth"].items():
        a, b = map(int, pair.split("-"))
        assert abs(measured / cluster.bandwidth(a, b) - 1) <= TOLERANCE, report


def test_training_over_emulated_machines_equals_serial(launched):
    keys = ["gpt:dp_tp", "mlp:two_stage"]
    result = launched.run("run", "-n", "4", "--emulate", FILE_2X2, TRAIN, "float64", *keys)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    line = next(ln for ln in result.stdout.splitlines() if ln.startswith("PLANS-RESULT "))
    check_report(json.loads(line.split(" ", 1)[1]), 4, keys)


def test_meshslice_over_the_shaped_link_equals_the_unsliced_matmul(launched):
    """MeshSlice's nonblocking partial collectives over TCP between the machines (mesh
    dim x) and shared memory inside them (y)."""
    result = launched.run("run", "-n", "4", "--emulate", FILE_2X2, MESHSLICE, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    line = next(ln for ln in result.stdout.splitlines() if ln.startswith("MESHSLICE-RESULT "))
    check_cases(json.loads(line.split(" ", 1)[1]), 4)


def test_calibrate_measures_the_files_link_figures(launched, tmp_path):
    out = tmp_path / "measured.yaml"
    result = launched.run("cluster", "calibrate", "--emulate", FILE_2X2, "-n", "4", "-o",
                          str(out), "--repeats", "2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    source, measured = dg.Cluster.from_file(FILE_2X2), dg.Cluster.from_file(out)
    assert [(m.id, m.hostname) for m in measured.machines] == \
        [(m.id, m.hostname) for m in source.machines]
    assert [d.global_id for d in measured.devices] == [d.global_id for d in source.devices]
    assert measured.device_meshes[0].shape == source.device_meshes[0].shape
    between = [ln for ln in measured.links]
    assert len(between) == 4
    for ln in between:
        assert abs(ln.bandwidth / LINK_GBPS - 1) <= TOLERANCE, (ln, result.stdout)
    assert "4 of 4 pairs measure within 20%" in result.stdout


def test_a_link_that_goes_down_ends_the_job_with_a_runtime_fault_naming_the_ranks(launched):
    # At 6 s the ranks are past MPI start-up (about 3 s here under load), so they are the
    # ones that notice: every all-reduce crosses the link and times out.
    timeout = 3
    result = launched.run("run", "-n", "4", "--emulate", FILE_2X2, "--emulate-fault",
                          "link node0-node1 down at 6s", PROBE, "--allreduce", "60",
                          env={"DISTGRAPH_COMM_TIMEOUT": str(timeout)}, timeout=90)
    assert result.returncode != 0
    err = result.stderr
    assert "emulated fault at" in err and "link node0-node1 down" in err
    assert f"timed out after {timeout} s" in err, err[-3000:]
    assert ("RuntimeFault: emulated fault 'link node0-node1 down at 6s'" in err
            and "ranks 0, 1 on node0 lost their peers, ranks 2, 3 on node1" in err), err


def test_a_fault_during_mpi_start_up_still_ends_the_job(launched):
    # Cut at once, the link fails MPI's own start-up, which has no distgraph timeout; the
    # launcher ends the job two timeouts later with the same report.
    timeout = 2
    result = launched.run("run", "-n", "4", "--emulate", FILE_2X2, "--emulate-fault",
                          "link node0-node1 down at 0s", PROBE, "--allreduce", "60",
                          env={"DISTGRAPH_COMM_TIMEOUT": str(timeout)}, timeout=90)
    assert result.returncode != 0
    assert "ranks 0, 1 on node0 lost their peers, ranks 2, 3 on node1" in result.stderr


def test_a_stall_shorter_than_the_timeout_delays_the_job_and_the_sums_stay_right(launched):
    result = launched.run("run", "-n", "4", "--emulate", FILE_2X2, "--emulate-fault",
                          "link node0-node1 stall at 1s for 1s", PROBE, "--allreduce", "3",
                          env={"DISTGRAPH_COMM_TIMEOUT": "20"})
    report = probe(result)
    assert "link node0-node1 stall" in result.stderr and "link node0-node1 up" in result.stderr
    assert len({r["count"] for r in report["allreduce"]}) == 1


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_to_the_launcher_removes_everything(launched, sig, code):
    proc = launched.start("run", "-n", "4", "--emulate", FILE_2X2, PROBE, "--allreduce", "60")
    _wait_for_namespaces(launched, proc, 3)
    time.sleep(2)          # let the ranks start
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err[-2000:]
    assert "the emulated cluster was removed" in err
    assert launched.namespaces_of(proc) == []


def test_namespaces_of_a_killed_launcher_go_at_the_next_start(launched):
    proc = launched.start("run", "-n", "4", "--emulate", FILE_2X2, PROBE, "--allreduce", "60")
    names = _wait_for_namespaces(launched, proc, 3)
    proc.kill()
    proc.communicate()
    assert sorted(launched.namespaces_of(proc)) == sorted(names)
    job = parse_namespace(names[0])
    assert not job_alive(job[0], job[1])
    folders = leftover_folders(f"{job[0]}.{job[1]}")       # its TemporaryDirectory
    assert len(folders) == 1 and os.path.isdir(folders[0])
    result = launched.run("run", "-n", "1", "--emulate", FILE_2X2, PROBE)
    probe(result)
    assert f"removed 3 namespaces left by emulated job {job[0]}.{job[1]}" in result.stderr
    assert launched.namespaces_of(proc) == [] and not os.path.exists(folders[0])


def test_without_root_the_launcher_says_so_before_creating_anything(launched):
    # A user namespace makes the launcher an unprivileged user (uid 65534); unshare execs
    # it in place, so its pid is the one its namespaces would be named after.
    proc = subprocess.Popen(["unshare", "--user", sys.executable, "-m", "distgraph.cli", "run",
                             "-n", "2", "--emulate", FILE_2X2, PROBE], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    launched.procs.append(proc)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "emulated clusters need root" in err
    assert launched.namespaces_of(proc) == []


def test_the_module_left_no_namespace_device_or_qdisc_behind(network_before):
    assert root_network() == network_before
    mine = [n for n in our_namespaces() if parse_namespace(n)[0] == os.getpid()]
    assert mine == []


def _wait_for_namespaces(launched, proc, count, seconds=60) -> list[str]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        names = launched.namespaces_of(proc)
        if len(names) == count:
            return names
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.1)
    raise AssertionError(f"the job made no {count} namespaces within {seconds} s")
