"""Jobs over several real hosts (root only): ``distgraph run --hostfile/--hosts/--cluster``
against OpenSSH servers, each in a network namespace of its own with its own hostname,
``/etc/hosts`` and ``/tmp`` (:class:`~distgraph.runtime.emulate.ssh_hosts.SshHosts`).

The launcher runs on a "login" host of the same network; it reaches the hosts through
``HYDRA_LAUNCHER_EXEC``, a wrapper around ``ssh -F config`` with keys made for this run,
and MPI goes over TCP between hosts (``FI_PROVIDER=tcp``), as a site would set them: the
code under test is the ordinary multi-host path. Training equals serial on 2 hosts x 2
ranks; ``--cluster`` places ranks where the rank mapping says; a host that does not
answer or runs another distgraph version stops the job before any rank starts; the check,
hydra and the clean-up share one ssh connection per host; a failing rank and SIGTERM
leave nothing behind on any host, and the logs come back; ``--elastic`` drops a host
whose sshd is gone and takes it back from the next checkpoint once it answers
(``--max-ranks``). Debian's openssh-server is installed when missing; skipped with the reason where this process
cannot create network namespaces or install it.
"""

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pytest
import yaml

import distgraph as dg
from distgraph.runtime.emulate.namespaces import our_namespaces
from distgraph.runtime.emulate.ssh_hosts import SSHD, SshHosts
from test_emulate import _cannot_emulate, root_network
from test_pipeline_mpi import check as check_pipeline
from test_spmd_mpi import check_report

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "mpi_scripts"
INTERLEAVED = ROOT / "tests" / "clusters" / "two_hosts_interleaved.yaml"
LINK_GBPS = 0.125
# node0 and node1 with two ranks each, 1 Gbit/s apart; node2 gets another distgraph.
HOSTS = f"""
name: three_hosts
machines:
  - hostname: node0
    devices: [{{global_id: 0, type: CPU, memory: 1, gflops: {{float32: 1}}}},
              {{global_id: 1, type: CPU, memory: 1, gflops: {{float32: 1}}}}]
    links: [{{source: 0, target: 1, bandwidth: 10, latency: 1}}]
  - hostname: node1
    devices: [{{global_id: 2, type: CPU, memory: 1, gflops: {{float32: 1}}}},
              {{global_id: 3, type: CPU, memory: 1, gflops: {{float32: 1}}}}]
    links: [{{source: 2, target: 3, bandwidth: 10, latency: 1}}]
  - hostname: node2
    devices: [{{global_id: 4, type: CPU, memory: 1, gflops: {{float32: 1}}}}]
links:
  - {{source: 0, target: 2, bandwidth: {LINK_GBPS}, latency: 100}}
  - {{source: 0, target: 4, bandwidth: 0.0625, latency: 100}}
  - {{source: 2, target: 4, bandwidth: 0.0625, latency: 100}}
"""
OTHER_VERSION = "0.0.0.dev1"
pytestmark = pytest.mark.mpi


def _openssh() -> str | None:
    """None when sshd is installed (installed now, as root, with apt-get if missing),
    else why it is not."""
    if os.path.exists(SSHD) and shutil.which("ssh"):
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return "openssh-server is not installed, and only root with apt-get installs it"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "openssh-server", "openssh-client"]
    for argv in (install, ["apt-get", "update", "-q"], install):
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
        if argv is install and proc.returncode == 0:
            return None
    return f"could not install openssh-server: {proc.stderr.strip()[-300:]}"


def _metadata() -> str:
    """The METADATA of the distgraph the hosts' Python imports (whose Version the check
    compares)."""
    found = glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "distgraph-*.dist-info",
                                   "METADATA"))
    assert len(found) == 1, found
    return found[0]


@pytest.fixture(scope="module")
def network_before():
    return root_network()


@pytest.fixture(scope="module")
def hosts(network_before, tmp_path_factory):
    reason = _cannot_emulate() or _openssh()
    if reason is not None:
        pytest.skip(f"hosts with sshd: {reason}")
    folder = tmp_path_factory.mktemp("multihost")
    metadata = _metadata()
    with open(metadata) as f:
        text = f.read()
    other = folder / "METADATA"
    other.write_text("".join(f"Version: {OTHER_VERSION}\n" if line.startswith("Version:")
                             else line for line in text.splitlines(keepends=True)))
    cluster = dg.Cluster.from_dict(yaml.safe_load(HOSTS), "three_hosts")
    with SshHosts(cluster, absent=["ghost"], mounts={"node2": [(str(other), metadata)]},
                  log=open(os.devnull, "w")) as made:
        namespaces = made.layout.namespaces
        yield made
    # whatever the tests did, the hosts and their servers are gone
    assert not set(namespaces) & set(our_namespaces())
    assert root_network() == network_before


def run(hosts, *args, timeout=300, env=None) -> subprocess.CompletedProcess:
    """``distgraph ARGS`` on the login host."""
    proc = start(hosts, *args, env=env)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def start(hosts, *args, env=None) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **hosts.env(), **(env or {})}
    return subprocess.Popen(hosts.login_argv([sys.executable, "-m", "distgraph.cli",
                                              *map(str, args)]),
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def result(proc, tag: str) -> dict:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(tag + " ")]
    assert len(lines) == 1, proc.stdout[-3000:]
    return json.loads(lines[0].split(" ", 1)[1])


def assert_clean(hosts, names=("node0", "node1"), seconds=20) -> None:
    """No process of a job left on the hosts (only their sshd) and no job folder in
    their /tmp, within ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        left = {h: hosts.processes(h) for h in names}
        folders = {h: [n for n in os.listdir(hosts.tmp_of(h)) if n.startswith("distgraph-")]
                   for h in names}
        if not any(left.values()) and not any(folders.values()):
            return
        assert time.monotonic() < deadline, f"left behind: processes {left}, folders {folders}"
        time.sleep(0.2)


def first_lines(logs: Path, nprocs: int) -> list[str]:
    return [(logs / f"rank-{r}.log").read_text().splitlines()[0] for r in range(nprocs)]


# ---- removal (first: one process holds one set of hosts at a time, and the module's
# ---- hosts below stay up until its last test) -------------------------------------------

def test_hosts_and_servers_are_removed_after_an_error(network_before):
    reason = _cannot_emulate() or _openssh()
    if reason is not None:
        pytest.skip(f"hosts with sshd: {reason}")
    cluster = dg.Cluster.from_file(ROOT / "resources" / "clusters" / "emulated_2x2.yaml")
    with pytest.raises(RuntimeError, match="on purpose"):
        with SshHosts(cluster, log=open(os.devnull, "w")) as made:
            servers = made.server_pids
            namespaces = list(made.layout.namespaces)
            folder = made.folder
            raise RuntimeError("on purpose")
    assert not set(namespaces) & set(our_namespaces())
    assert not any(os.path.exists(f"/proc/{pid}") for pid in servers)
    assert not os.path.exists(folder)


# ---- training equals serial ------------------------------------------------------------

@pytest.mark.slow
def test_gpt_dp_x_mp_on_two_hosts_equals_serial_and_the_logs_come_back(hosts, tmp_path):
    hostfile = hosts.hostfile(hosts=["# two ranks each", "node0:2", "node1:2"])
    logs = tmp_path / "logs"
    proc = run(hosts, "run", "-n", 4, "--hostfile", hostfile, "--log-dir", logs,
               SCRIPTS / "train_plans.py", "float64", "gpt:dp_tp")
    check_report(result(proc, "PLANS-RESULT"), 4, ["gpt:dp_tp"])
    assert [ln.split(",")[0] for ln in first_lines(logs, 4)] == [
        f"distgraph: rank {r} on host {h}" for r, h in enumerate(["node0"] * 2 + ["node1"] * 2)]
    assert "PLANS-RESULT" in (logs / "rank-0.log").read_text()
    assert_clean(hosts)


@pytest.mark.slow
def test_a_two_stage_1f1b_pipeline_on_two_hosts_equals_serial(hosts):
    items = ["mlp:two_stage:8:1F1B"]
    proc = run(hosts, "run", "-n", 4, "--hosts", "node0:2,node1:2",
               SCRIPTS / "train_pipeline.py", *items)
    check_pipeline(result(proc, "PIPELINE-RESULT"), 4, items)
    assert_clean(hosts)


# ---- placement ----------------------------------------------------------------------------

def test_cluster_placement_puts_each_process_on_the_machine_its_mapping_chose(hosts):
    cluster = dg.Cluster.from_file(INTERLEAVED)
    dry = run(hosts, "run", "-n", 4, "--cluster", INTERLEAVED, "--dry-run",
              SCRIPTS / "placement_probe.py")
    assert dry.returncode == 0 and hosts.processes("node0") == [], dry.stderr
    assert [ln.split()[2] for ln in dry.stdout.splitlines()[1:]] == \
        ["node0", "node1", "node0", "node1"]
    report = result(run(hosts, "run", "-n", 4, "--cluster", INTERLEAVED,
                        SCRIPTS / "placement_probe.py"), "PLACEMENT")
    device = {p: cluster.devices[r].global_id for p, r in report["rank_of"].items()}
    for p, rank in report["rank_of"].items():      # the process runs where its device is
        assert report["hosts"][rank] == cluster.machine_of(device[p]).hostname, report
    # the mapper kept each mp group (processes 0, 1 and 2, 3) inside one machine, which
    # on this file means ranks 0 and 2 (or 1 and 3): a placement by rank order would not
    host = {p: report["hosts"][r] for p, r in report["rank_of"].items()}
    assert host["0"] == host["1"] and host["2"] == host["3"] and host["0"] != host["2"], report
    assert_clean(hosts)


# ---- checks before any rank starts ----------------------------------------------------------

def test_a_host_that_does_not_answer_fails_before_any_rank_starts(hosts):
    proc = run(hosts, "run", "-n", 4, "--hosts", "node0:2,ghost:2", SCRIPTS / "fault_jobs.py",
               "long", timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert "no rank was started" in lines[0], proc.stderr
    assert len(lines) == 2 and lines[1].strip().startswith("ghost: not reachable over ssh"), \
        proc.stderr
    assert proc.stdout == ""
    assert_clean(hosts, seconds=0)


def test_a_host_with_another_distgraph_version_fails_before_any_rank_starts(hosts):
    proc = run(hosts, "run", "-n", 3, "--hosts", "node0:2,node2:1", SCRIPTS / "fault_jobs.py",
               "long", timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[1].strip().startswith(
        f"node2: distgraph {OTHER_VERSION} at "), proc.stderr
    assert f"this host has distgraph {version('distgraph')}" in lines[1]
    assert_clean(hosts, ("node0", "node2"), seconds=0)


# ---- failures and signals ---------------------------------------------------------------

def test_a_failing_rank_ends_the_job_on_every_host_with_one_line(hosts, tmp_path):
    logs = tmp_path / "logs"
    proc = run(hosts, "run", "-n", 4, "--hosts", "node0:2,node1:2", "--log-dir", logs,
               SCRIPTS / "fault_jobs.py", "fail")
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("distgraph: ")]
    assert lines[0] == ("distgraph: rank 1 on node0 failed: RuntimeFault: rank 1 (process 1): "
                        "task forward of chunk 0 in step 1 failed: op 'relu' failed in step 1: "
                        "ValueError: injected failure"), proc.stderr
    assert len(lines) == 2 and "rank-<r>.log" in lines[1], proc.stderr
    assert "injected failure" in (logs / "rank-1.log").read_text()
    assert [ln.split(",")[0] for ln in first_lines(logs, 4)][2:] == [
        "distgraph: rank 2 on host node1", "distgraph: rank 3 on host node1"]
    assert_clean(hosts)


def test_sigterm_to_the_launcher_leaves_nothing_on_either_host(hosts):
    proc = start(hosts, "run", "-n", 4, "--hosts", "node0:2,node1:2",
                 SCRIPTS / "fault_jobs.py", "long")
    started = set()
    deadline = time.monotonic() + 120
    while len(started) < 4:          # every rank past its first step
        line = proc.stdout.readline()
        assert line and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        if line.startswith("STARTED "):
            started.add(line.split()[1])
    assert all(hosts.processes(h) for h in ("node0", "node1"))
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-2000:]
    assert "received SIGTERM: stopped mpiexec and its 4 ranks on 2 hosts" in err
    assert_clean(hosts, seconds=0)


def test_the_check_hydra_and_the_clean_up_share_one_ssh_connection_per_host(hosts, tmp_path):
    log = tmp_path / "ssh.log"
    wrapper = tmp_path / "ssh-logged"
    wrapper.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {log}\nexec {hosts.launcher_exec} "$@"\n')
    wrapper.chmod(0o755)
    logs = tmp_path / "logs"
    proc = start(hosts, "run", "-n", 4, "--hosts", "node0:2,node1:2", "--log-dir", logs,
                 SCRIPTS / "fault_jobs.py", "long", env={"HYDRA_LAUNCHER_EXEC": str(wrapper)})
    started = set()
    deadline = time.monotonic() + 120
    while len(started) < 4:
        line = proc.stdout.readline()
        assert line and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        if line.startswith("STARTED "):
            started.add(line.split()[1])
    calls = log.read_text().splitlines()
    for host in ("node0", "node1"):
        mine = [c.split() for c in calls if f" {host} " in c]
        master, hydra = mine[0], mine[1]        # the check, then hydra's start of the ranks
        assert "ControlMaster=yes" in master and "ControlPersist=no" in master, mine
        path = next(o for o in master if o.startswith("ControlPath="))
        assert path in hydra and "ControlMaster=no" in hydra, mine
        assert "hydra_pmi_proxy" in " ".join(hydra[hydra.index(host) + 1:]), mine
        # the master is up, and hydra's session is one of its own
        check = subprocess.run(hosts.login_argv([hosts.launcher_exec, "-o", path, "-O", "check",
                                                 host]), capture_output=True, text=True)
        assert check.returncode == 0 and "Master running" in check.stderr, check.stderr
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-2000:]
    # the clean-up went through the checks' sessions: no other ssh, and the logs are back
    assert log.read_text().splitlines() == calls
    assert [ln.split(",")[0] for ln in first_lines(logs, 4)][2:] == [
        "distgraph: rank 2 on host node1", "distgraph: rank 3 on host node1"]
    assert not os.path.exists(os.path.dirname(path.split("=", 1)[1]))    # its sockets' folder
    assert_clean(hosts, seconds=0)


# ---- calibration ------------------------------------------------------------------------

@pytest.mark.slow
def test_calibrate_measures_the_links_between_the_hosts(hosts, tmp_path):
    out = tmp_path / "measured.yaml"
    hostfile = hosts.hostfile(hosts=["node0:2", "node1:2"])
    proc = run(hosts, "cluster", "calibrate", "--hostfile", hostfile, "-n", 4, "-o", out,
               "--repeats", 2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    measured = dg.Cluster.from_file(out)
    assert [m.hostname for m in measured.machines] == ["node0", "node1"]
    assert [d.global_id for d in measured.devices] == [0, 1, 2, 3]
    assert len(measured.links) == 4           # every pair across the hosts: the network
    for link in measured.links:
        assert abs(link.bandwidth / LINK_GBPS - 1) <= 0.2, (link, proc.stdout)
    for machine in measured.machines:         # inside a host: shared memory, unshaped
        assert [ln.type for ln in machine.links] == ["SHM"]
        assert machine.links[0].bandwidth > 4 * LINK_GBPS, (machine, proc.stdout)
    assert_clean(hosts)


# ---- elastic: a host lost mid-run --------------------------------------------------------

@pytest.mark.slow
def test_elastic_a_host_lost_mid_run_is_dropped_and_the_job_finishes_on_the_other(
        hosts, tmp_path):
    from test_elastic import SCRIPT, assert_equal_weights
    serial = tmp_path / "serial.npz"
    subprocess.run([sys.executable, SCRIPT, "--out", str(serial)], check=True,
                   env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True)
    # the checkpoint and the weights on storage both hosts share (each host's /tmp is its own)
    shared = Path(tempfile.mkdtemp(prefix="distgraph-elastic-", dir="/var/tmp"))
    logs = tmp_path / "logs"
    proc = start(hosts, "run", "-n", 4, "--hostfile", hosts.hostfile(hosts=["node0:2",
                 "node1:2"]), "--elastic", "--min-ranks", 2, "--log-dir", logs, SCRIPT,
                 "--ckpt", shared / "ckpt", "--out", shared / "w.npz", "--step-time", 0.2)
    try:
        deadline = time.monotonic() + 120
        while True:               # past the checkpoint of step 4, mid-epoch
            line = proc.stdout.readline()
            assert line and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            if line.startswith("STEP ") and int(line.split()[2]) >= 6:
                break
        hosts.stop("node1")
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, out[-3000:] + err[-3000:]
        assert "host node1 stopped answering; restart 1 of 3 on 2 ranks (node0:2), was 4; " \
            "dropped node1" in err, err
        assert "finished after 1 restart (world sizes 4 -> 2)" in err, err
        assert "resumed from" in err and "DONE world=2 step=24" in out, err
        assert_equal_weights(shared / "w.npz", dict(np.load(serial)))
        assert_clean(hosts, ("node0",))
        records = [json.loads(ln) for ln in (logs / "elastic.jsonl").open()]
        assert [r["world"] for r in records if r["event"] == "start"] == [4, 2]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        shutil.rmtree(shared, ignore_errors=True)
        hosts.start("node1")          # for the tests after this one


@pytest.mark.slow
def test_elastic_a_host_that_answers_again_is_taken_back_from_the_next_checkpoint(
        hosts, tmp_path):
    from test_elastic import SCRIPT, assert_equal_weights
    serial = tmp_path / "serial.npz"
    script = ["--epochs", "3", "--step-time", 0.2]       # 36 steps: room to grow back
    subprocess.run([sys.executable, SCRIPT, "--out", str(serial), *map(str, script)],
                   check=True, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True)
    shared = Path(tempfile.mkdtemp(prefix="distgraph-elastic-", dir="/var/tmp"))
    logs = tmp_path / "logs"
    proc = start(hosts, "run", "-n", 4, "--hosts", "node0:2,node1:2", "--elastic",
                 "--min-ranks", 2, "--max-ranks", 4, "--log-dir", logs, SCRIPT,
                 "--ckpt", shared / "ckpt", "--out", shared / "w.npz", *script)
    stopped = back = False
    try:
        deadline = time.monotonic() + 180
        for line in proc.stdout:  # node1 goes at step 6; comes back once node0 runs alone
            assert time.monotonic() < deadline, "no step on the smaller world in time"
            words = line.split()
            if not stopped and line.startswith("STEP ") and int(words[2]) >= 6:
                hosts.stop("node1")
                stopped = True
            elif stopped and line.startswith("STEP ") and words[3] == "world=2":
                hosts.start("node1")
                back = True
                break
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, out[-3000:] + err[-3000:]
        assert "host node1 stopped answering; restart 1 of 3 on 2 ranks (node0:2), was 4" \
            in err, err
        grown = [ln for ln in err.splitlines() if "elastic: host node1 answers again" in ln]
        assert len(grown) == 1 and "restart 2 of 3 on 4 ranks (node0:2, node1:2), was 2" \
            in grown[0], err
        assert "finished after 2 restarts (world sizes 4 -> 2 -> 4)" in err, err
        assert "DONE world=4 step=36" in out, out[-2000:]
        assert_equal_weights(shared / "w.npz", dict(np.load(serial)))
        assert_clean(hosts, ("node0",))
        assert hosts.processes("node1") == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        shutil.rmtree(shared, ignore_errors=True)
        if stopped and not back:
            hosts.start("node1")      # for the tests after this one
