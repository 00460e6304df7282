"""Placing ranks on hosts without starting them: host files and ``--hosts`` lists, a
resource file's machines, ``--dry-run``, hydra's launcher as the environment chooses it,
the per-host clean-up (:mod:`distgraph.runtime.launch.hostside`) on this machine, the
shared connections' masters (:mod:`distgraph.runtime.launch.connections`) with a stand-in
for ssh that runs the command here, and how the launcher tells ranks' output from hydra's
own messages. The jobs themselves, over
real ssh, are in tests/test_multihost.py."""

import io
import json
import os
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import pytest

import distgraph as dg
from distgraph.runtime.launch import hostside
from distgraph.runtime.launch.connections import Masters
from distgraph.runtime.launch.hosts import (
    HostSlots,
    assign_hosts,
    parse_hostfile,
    parse_hosts,
    place_on_cluster,
    place_on_slots,
)
from distgraph.runtime.launch.job import _Demux
from distgraph.runtime.launch.remote import Answer, Launcher, _difference, is_local
from distgraph.runtime.launch.supervisor import MARK

ROOT = Path(__file__).resolve().parent.parent
INTERLEAVED = ROOT / "tests" / "clusters" / "two_hosts_interleaved.yaml"
SCRIPT = ROOT / "tests" / "mpi_scripts" / "placement_probe.py"


# ---- host lists -----------------------------------------------------------------------------

def test_a_host_file_is_read_as_mpich_writes_it(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# the cluster\nnode0:2\n\n  node1   # one slot\n10.0.0.3:4\n")
    assert parse_hostfile(str(path)) == (HostSlots("node0", 2), HostSlots("node1", 1),
                                         HostSlots("10.0.0.3", 4))


@pytest.mark.parametrize("text, expected", [
    ("node0:2\nnode1:x\n", "line 2: 'node1:x' is not a host entry"),
    ("node0:0\n", "line 1: 'node0:0' is not a host entry"),
    ("node0 slots=2\n", "line 1: 'node0 slots=2' is not a host entry"),
    ("# nothing\n\n", "names no host"),
])
def test_a_bad_host_file_names_the_file_and_line(tmp_path, text, expected):
    path = tmp_path / "hosts"
    path.write_text(text)
    with pytest.raises(dg.PlanError, match=expected) as err:
        parse_hostfile(str(path))
    assert str(path) in str(err.value)


def test_a_missing_host_file_and_a_bad_hosts_list_are_plan_errors(tmp_path):
    with pytest.raises(dg.PlanError, match="cannot read the host file"):
        parse_hostfile(str(tmp_path / "nowhere"))
    assert parse_hosts("a:2,b") == (HostSlots("a", 2), HostSlots("b", 1))
    for bad in ("", "a,,b", "a:two"):
        with pytest.raises(dg.PlanError, match="--hosts"):
            parse_hosts(bad)


def test_ranks_fill_the_slots_in_order_and_start_again_past_the_last():
    entries = parse_hosts("a:2,b:1")
    assert place_on_slots(entries, 3, "s").hosts == ("a", "a", "b")
    p = place_on_slots(entries, 5, "s")
    assert p.hosts == ("a", "a", "b", "a", "a")
    assert p.hydra_hosts() == "a:2,b:1,a:2"             # exactly this assignment
    assert p.distinct_hosts == ("a", "b") and p.ranks_on("a") == (0, 1, 3, 4)
    with pytest.raises(dg.PlanError, match="-n must be at least 1"):
        place_on_slots(entries, 0, "s")


def test_a_resource_file_puts_rank_r_on_the_machine_of_its_r_th_device():
    cluster = dg.Cluster.from_file(INTERLEAVED)
    p = place_on_cluster(cluster, 4, "--cluster f")
    assert p.hosts == ("node0", "node1", "node0", "node1") and p.devices == (0, 1, 2, 3)
    assert p.hydra_hosts() == "node0:1,node1:1,node0:1,node1:1"
    gpus = dg.Cluster.from_file(ROOT / "resources" / "clusters" / "gpu_2x8.yaml")
    p = place_on_cluster(gpus, 16, "--cluster g")     # reached at the machines' addr
    assert p.hosts == ("10.0.0.1",) * 8 + ("10.0.0.2",) * 8
    assert p.machines == ("node0",) * 8 + ("node1",) * 8
    with pytest.raises(dg.PlanError, match="has 4 devices but -n 5"):
        place_on_cluster(cluster, 5, "--cluster f")


def test_the_placement_comes_from_hostfile_hosts_cluster_then_hydra_host_file(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("h0:1\nh1:1\n")
    cluster = dg.Cluster.from_file(INTERLEAVED)
    env = {"HYDRA_HOST_FILE": str(hostfile)}
    assert assign_hosts(2, str(hostfile), None, cluster, "c", env).hosts == ("h0", "h1")
    assert assign_hosts(2, None, "x:2", cluster, "c", env).hosts == ("x", "x")
    assert assign_hosts(2, None, None, cluster, "c", env).hosts == ("node0", "node1")
    placed = assign_hosts(2, None, None, None, None, env)
    assert placed.hosts == ("h0", "h1") and placed.source == f"HYDRA_HOST_FILE={hostfile}"
    assert assign_hosts(2, None, None, None, None, {}) is None
    with pytest.raises(dg.PlanError, match="either --hostfile FILE or --hosts LIST"):
        assign_hosts(2, str(hostfile), "x:2")


# ---- the command --------------------------------------------------------------------------

def distgraph(*args, env=None):
    return subprocess.run([sys.executable, "-m", "distgraph.cli", *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env=dict(os.environ, **(env or {})))


def test_dry_run_prints_each_rank_s_host_and_device_and_starts_nothing():
    proc = distgraph("run", "-n", 4, "--cluster", INTERLEAVED, "--dry-run", SCRIPT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"4 ranks on 2 hosts (--cluster {INTERLEAVED}):",
        "  rank 0  node0  device 0", "  rank 1  node1  device 1",
        "  rank 2  node0  device 2", "  rank 3  node1  device 3"]
    proc = distgraph("run", "-n", 3, "--hosts", "a:2,b", "--dry-run", SCRIPT)
    assert proc.stdout.splitlines()[0] == "3 ranks on 2 hosts (--hosts a:2,b):"
    proc = distgraph("run", "-n", 2, "--dry-run", SCRIPT, env={"HYDRA_HOST_FILE": ""})
    assert proc.stdout.startswith("2 ranks on this host")


@pytest.mark.parametrize("args, expected", [
    (["--hosts", "a:2", "--hostfile", "f"], "either --hostfile FILE or --hosts LIST"),
    (["--hosts", "a:2", "--emulate", "resources/clusters/emulated_2x2.yaml"],
     "--emulate runs every rank on this machine's network namespaces"),
    (["--hosts", "a:0"], "'a:0' is not a host entry"),
])
def test_conflicting_or_bad_host_options_fail_in_one_line(args, expected):
    proc = distgraph("run", "-n", 2, *args, SCRIPT)
    assert proc.returncode == 2 and expected in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stdout == ""


@pytest.mark.mpi
def test_hosts_that_are_all_this_machine_run_as_a_local_job(tmp_path):
    script = ROOT / "tests" / "mpi_scripts" / "fault_jobs.py"
    proc = distgraph("run", "-n", 2, "--hosts", f"localhost,{socket.gethostname()}",
                     "--log-dir", tmp_path / "logs", script, "cluster")
    assert proc.returncode == 0, proc.stderr
    assert sorted(ln for ln in proc.stdout.splitlines() if ln.startswith("CLUSTER")) == \
        ["CLUSTER 0 None", "CLUSTER 1 None"]
    first = (tmp_path / "logs" / "rank-1.log").read_text().splitlines()[0]
    assert first.startswith(f"distgraph: rank 1 on host {socket.gethostname()}, pid ")


# ---- hydra's launcher --------------------------------------------------------------------------

def test_the_launcher_is_chosen_as_hydra_chooses_it():
    assert Launcher.from_env({}) == Launcher("ssh", "ssh")
    wrapped = Launcher.from_env({"HYDRA_LAUNCHER_EXEC": "/site/ssh-wrap",
                                 "HYDRA_LAUNCHER_EXTRA_ARGS": "-p 2222"})
    assert wrapped.argv("node1", ["python", "x y.py"]) == [
        "/site/ssh-wrap", "-x", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-p", "2222",
        "node1", "python 'x y.py'"]
    assert Launcher.from_env({"HYDRA_BOOTSTRAP": "rsh"}).argv("n", ["ls"]) == ["rsh", "n", "ls"]
    slurm = {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NNODES": "2", "SLURM_TASKS_PER_NODE": "2(x2)"}
    assert Launcher.from_env(slurm).argv("n1", ["ls"]) == [
        "srun", "--nodes=1", "--ntasks=1", "--nodelist=n1", "--quiet", "--overlap", "ls"]
    assert Launcher.from_env({**slurm, "HYDRA_LAUNCHER": "ssh"}).kind == "ssh"
    with pytest.raises(dg.PlanError, match="HYDRA_LAUNCHER=lsf"):
        Launcher.from_env({"HYDRA_LAUNCHER": "lsf"})


def test_over_ssh_the_check_hydra_and_the_clean_up_share_one_connection():
    wrapped = Launcher.from_env({"HYDRA_LAUNCHER_EXEC": "/site/ssh-wrap",
                                 "HYDRA_LAUNCHER_EXTRA_ARGS": "-p 2222"})
    shared = wrapped.sharing("/tmp/dg-x")
    common = ["/site/ssh-wrap", "-x", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
    assert shared.argv("n1", ["ls"], master=True) == [
        *common, "-o", "ControlMaster=yes", "-o", "ControlPath=/tmp/dg-x/%C",
        "-o", "ControlPersist=no", "-p", "2222", "n1", "ls"]
    assert shared.argv("n1", ["ls"]) == [
        *common, "-o", "ControlPath=/tmp/dg-x/%C", "-o", "ControlMaster=no", "-p", "2222",
        "n1", "ls"]
    # hydra's ssh: the site's own extra arguments first
    assert shared.hydra_env({"HYDRA_LAUNCHER_EXTRA_ARGS": "-p 2222"}) == {
        "HYDRA_LAUNCHER_EXTRA_ARGS": "-p 2222 -o ControlPath=/tmp/dg-x/%C -o ControlMaster=no"}
    assert wrapped.hydra_env({}) == {} and wrapped.argv("n1", ["ls"])[-2:] == ["n1", "ls"]
    rsh = Launcher.from_env({"HYDRA_LAUNCHER": "rsh"})
    assert rsh.sharing("/tmp/dg-x") == rsh and Masters.for_launcher(rsh).folder is None


def test_no_sharing_where_the_sockets_paths_would_not_fit(tmp_path, monkeypatch):
    deep = tmp_path / ("d" * 80)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    masters = Masters.for_launcher(Launcher("ssh", "ssh"))
    assert masters.folder is None and os.listdir(deep) == []
    masters.close()


def _here(tmp_path) -> Launcher:
    """A launcher whose "ssh" runs the command (its last argument) on this machine."""
    program = tmp_path / "ssh-here"
    program.write_text('#!/bin/sh\nfor last; do :; done\nexec sh -c "$last"\n')
    program.chmod(0o755)
    return Launcher("ssh", str(program))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_master_is_kept_after_its_check_and_ends_at_close(tmp_path):
    launcher = _here(tmp_path)
    with Masters.for_launcher(launcher) as masters:
        folder = masters.folder
        assert folder is not None and os.stat(folder).st_mode & 0o777 == 0o700
        shared = launcher.sharing(folder)
        check = [sys.executable, hostside.__file__, "check", "--hold", str(ROOT), "README.md"]
        code, line, said = masters.start("n1", shared.argv("n1", check, master=True),
                                         time.monotonic() + 60)
        assert (code, said) == (0, "") and json.loads(line)["missing"] == []
        held = [int(p) for p in subprocess.run(["pgrep", "-f", f"check --hold {ROOT}"],
                                               capture_output=True, text=True).stdout.split()]
        assert held and all(map(_alive, held))        # still waiting for its input to end
    assert not os.path.exists(folder) and not any(map(_alive, held))


def test_the_clean_up_is_a_request_to_the_held_check(tmp_path):
    launcher = _here(tmp_path)
    folder = tmp_path / "distgraph-status-y"
    (folder / "logs").mkdir(parents=True)
    (folder / "logs" / "rank-1.log").write_text("distgraph: rank 1 on host h\n")
    marker = f"DISTGRAPH_STATUS_DIR={folder}"
    with Masters.for_launcher(launcher) as masters:
        shared = launcher.sharing(masters.folder)
        check = [sys.executable, hostside.__file__, "check", "--hold", str(ROOT)]
        assert masters.start("n1", shared.argv("n1", check, master=True),
                             time.monotonic() + 60)[0] == 0
        names = []
        for _ in range(2):            # answers stay in step, request after request
            tar = masters.ask("n1", ["collect", str(folder), marker], time.monotonic() + 60)
            with tarfile.open(fileobj=io.BytesIO(tar)) as read:
                names.append(sorted(read.getnames()))
            assert not folder.exists()
        assert names == [["logs", "logs/rank-1.log"], []]   # the second found it gone
        assert masters.ask("n2", ["collect", str(folder), marker], time.monotonic()) is None


def test_a_master_that_fails_or_says_nothing_in_time_is_not_kept(tmp_path):
    launcher = _here(tmp_path)
    with Masters.for_launcher(launcher) as masters:
        shared = launcher.sharing(masters.folder)
        code, line, said = masters.start(
            "n1", shared.argv("n1", ["sh", "-c", "echo refused >&2; exit 255"], master=True),
            time.monotonic() + 60)
        assert (code, line, said.strip()) == (255, b"", "refused")
        start = time.monotonic()
        code, _, _ = masters.start("n2", shared.argv("n2", ["sleep", "30"], master=True),
                                   time.monotonic() + 0.5)
        assert code is None and time.monotonic() - start < 10
        assert masters._procs == {}


def test_this_machine_is_local_other_addresses_are_not():
    assert is_local("localhost") and is_local(socket.gethostname()) and is_local("127.0.0.1")
    assert not is_local("192.0.2.7")                    # TEST-NET-1: never assigned
    assert not is_local("no-such-host.invalid")


def test_a_host_that_differs_is_one_line_naming_it_and_what_differs(tmp_path):
    here = hostside.describe(str(ROOT), ["tests/test_hosts.py"])
    launcher = Launcher("ssh", "ssh")

    def line(**changed):
        there = dict(here, **changed)
        answer = Answer("node7", 0, json.dumps(there).encode(), "")
        return _difference(here, answer, launcher, str(ROOT))

    assert line() is None
    assert line(distgraph="9.9").startswith(f"node7: distgraph 9.9 at {here['package']}, "
                                            f"this host has distgraph {here['distgraph']}")
    assert line(python_version="3.9.1").startswith("node7: Python 3.9.1 at ")
    assert "is imported from /elsewhere" in line(package="/elsewhere")
    assert line(missing=["train.py"]) == (f"node7: no {ROOT / 'train.py'} there (the job's "
                                          "files must be at the same paths on every host)")
    refused = Answer("node7", 255, b"", "ssh: connect to host node7 port 22: Connection refused")
    assert _difference(here, refused, launcher, str(ROOT)) == (
        "node7: not reachable over ssh in batch mode (ssh: connect to host node7 port 22: "
        "Connection refused)")
    assert "no answer over ssh within" in _difference(here, Answer("node7", None, b"", ""),
                                                      launcher, str(ROOT))


# ---- a host's clean-up --------------------------------------------------------------------------

def test_collect_kills_the_job_here_sends_its_files_and_removes_them(tmp_path):
    folder = tmp_path / "distgraph-status-x"
    (folder / "logs").mkdir(parents=True)
    (folder / "logs" / "rank-2.log").write_text("distgraph: rank 2 on host h\n")
    (folder / "2.failed").write_text("ValueError: no")
    marker = f"DISTGRAPH_STATUS_DIR={folder}"
    mine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env=dict(os.environ, DISTGRAPH_STATUS_DIR=str(folder)))
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (folder / "2.pids").write_text(f"{mine.pid} {other.pid}")   # other lacks the marker
        out = io.BytesIO()
        hostside.collect(str(folder), marker, out)
        assert mine.wait(timeout=10) != 0 and other.poll() is None
    finally:
        other.kill()
        other.wait()
    with tarfile.open(fileobj=io.BytesIO(out.getvalue())) as tar:
        assert sorted(tar.getnames()) == ["2.failed", "2.pids", "logs", "logs/rank-2.log"]
    assert not folder.exists()
    folder.mkdir()                    # the launching host's own folder is never removed
    (folder / hostside.LAUNCHER_FILE).write_text("")
    hostside.collect(str(folder), marker, io.BytesIO())
    assert folder.exists()


# ---- ranks' output through mpiexec ----------------------------------------------------------

class Stream:
    def __init__(self):
        self.text = ""

    def write(self, text):
        self.text += text

    def flush(self):
        pass


def piece(text: str) -> bytes:
    data = text.encode()
    return MARK + b"%04x" % len(data) + data


@pytest.mark.parametrize("cut", [1, 3, 7, 16, 1000])
def test_marked_pieces_reach_the_terminal_and_hydra_s_messages_the_log(tmp_path, cut):
    data = (piece("rank 2 says hi\n") + b"Abort(1) on node 3: application called MPI_Abort\n"
            + piece("half a li") + piece("ne\n") + b"[mpiexec@login] done\n")
    terminal, log_path = Stream(), tmp_path / "mpiexec.log"
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT)
    demux = _Demux(terminal, log)
    for k in range(0, len(data), cut):       # however the pipe cuts it
        demux.feed(data[k:k + cut])
    demux.feed(b"")
    os.close(log)
    assert terminal.text == "rank 2 says hi\nhalf a line\n"
    assert log_path.read_text() == ("Abort(1) on node 3: application called MPI_Abort\n"
                                    "[mpiexec@login] done\n")
