"""``distgraph run`` under Slurm: first what it reads of an allocation (its environment, as
salloc, sbatch and srun set it), then jobs on a real Slurm (root only): Debian's slurmctld
and two slurmd nodes in network namespaces (:class:`slurm_cluster.SlurmCluster`), the
user's commands typed on the login host.

Inside ``sbatch``, ``salloc`` and a one-task ``srun`` the ranks go on the allocation's
nodes without a host file, ``-n`` from the allocation, and train equal to serial; more
ranks than the allocation has, or ``distgraph run`` started as several srun tasks, is one
line before anything starts; ``scancel`` leaves no rank and no hydra proxy on either
node; under ``--elastic`` a node drained mid-run (``scontrol update ... state=drain``) is
dropped and the job resumes on the other node from its newest checkpoint, with the serial
run's weights. The real-Slurm tests skip, with the reason, where this process cannot make
network namespaces or the packages (slurmd slurmctld slurm-client munge) are missing.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from distgraph.errors import PlanError
from distgraph.runtime.emulate.namespaces import our_namespaces
from distgraph.runtime.launch import slurm
from distgraph.runtime.launch.remote import Launcher
from slurm_cluster import SlurmCluster, missing_packages
from test_emulate import _cannot_emulate, root_network
from test_spmd_mpi import check_report

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "mpi_scripts"
TRAIN = [SCRIPTS / "train_plans.py", "float64", "gpt:dp_tp"]
# what Slurm puts in a batch script's (or an salloc shell's) environment
BATCH = {"SLURM_JOB_ID": "12", "SLURM_JOB_NODELIST": "node[0-1]", "SLURM_JOB_NUM_NODES": "2",
         "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_CPUS_PER_NODE": "2(x2)",
         "SLURM_NTASKS": "4"}
# Slurm's own paths, which the test cluster must leave alone
SLURM_PLACES = ("/var/spool/slurmd", "/var/spool/slurmctld", "/var/log/slurm", "/run/munge",
                "/var/lib/slurm", "/var/log/munge", "/run/slurm")


# ---- the allocation, from the environment --------------------------------------------------

@pytest.mark.parametrize("text,names", [
    ("node7", ("node7",)),
    ("node[0-2,7]", ("node0", "node1", "node2", "node7")),
    ("gpu[08-10],cpu1", ("gpu08", "gpu09", "gpu10", "cpu1")),
    ("r[1-2]n[1-2]", ("r1n1", "r1n2", "r2n1", "r2n2")),
])
def test_a_slurm_host_list_expands_as_slurm_writes_it(text, names):
    assert slurm.expand_nodelist(text) == names


@pytest.mark.parametrize("text", ["node[0-", "node[3-1]", "a,,b", "node]0["])
def test_a_bad_host_list_is_a_plan_error_naming_it(text):
    with pytest.raises(PlanError, match=re.escape(f"SLURM_JOB_NODELIST={text!r}")):
        slurm.expand_nodelist(text)


def test_counts_per_node_expand():
    assert slurm.expand_counts("2(x3),1") == (2, 2, 2, 1)
    with pytest.raises(PlanError, match="not a Slurm count list"):
        slurm.expand_counts("2x3")


def test_the_allocation_is_the_jobs_tasks_or_in_a_step_its_cpus_per_task():
    batch = slurm.allocation_from_env(BATCH)
    assert (batch.nodes, batch.slots, batch.default_ranks) == (("node0", "node1"), (2, 2), 4)
    assert batch.assignment(3).hosts == ("node0", "node0", "node1")
    # in a one-task srun step, SLURM_TASKS_PER_NODE and SLURM_NTASKS are the step's
    step = slurm.allocation_from_env({**BATCH, "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1",
                                      "SLURM_TASKS_PER_NODE": "1", "SLURM_NTASKS": "1",
                                      "SLURM_JOB_CPUS_PER_NODE": "8(x2)",
                                      "SLURM_CPUS_PER_TASK": "4"})
    assert (step.slots, step.default_ranks) == ((2, 2), 4)
    nodes_only = slurm.allocation_from_env({k: v for k, v in BATCH.items() if k != "SLURM_NTASKS"})
    assert nodes_only.default_ranks == 4
    assert slurm.allocation_from_env({}) is None


def test_over_slurm_the_checks_and_hydra_s_srun_overlap_the_job_s_steps():
    launcher = Launcher.from_env(BATCH)
    assert launcher.argv("node1", ["true"]) == [
        "srun", "--nodes=1", "--ntasks=1", "--nodelist=node1", "--quiet", "--overlap", "true"]
    assert launcher.hydra_env(BATCH) == {"SLURM_OVERLAP": "1"}


def _lost(states: dict, monkeypatch, tmp_path) -> dict:
    """``slurm.unavailable`` against a fake sinfo printing ``states``."""
    sinfo = tmp_path / "sinfo"
    sinfo.write_text("#!/bin/sh\n" + "".join(f"echo '{n} {s}'\n" for n, s in states.items()))
    sinfo.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    return slurm.unavailable(["node0", "node1", "node2", "node3", "node4"])


def test_a_node_drained_down_or_not_responding_is_lost(monkeypatch, tmp_path):
    assert _lost({"node0": "mixed", "node1": "draining", "node2": "allocated*",
                  "node3": "down"}, monkeypatch, tmp_path) == {
        "node1": "draining", "node2": "allocated*", "node3": "down", "node4": "unknown"}


def distgraph(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "distgraph.cli", *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def test_in_an_allocation_the_ranks_go_on_its_nodes_and_n_comes_from_it():
    proc = distgraph("run", "--dry-run", *TRAIN, env=BATCH)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "4 ranks on 2 hosts (Slurm job 12 on node[0-1] with 2(x2) tasks per node):",
        "  rank 0  node0", "  rank 1  node0", "  rank 2  node1", "  rank 3  node1"]


@pytest.mark.parametrize("args,env,line", [
    (["-n", 5], BATCH, "distgraph run: -n 5: Slurm job 12 on node[0-1] with 2(x2) tasks per "
     "node has 4 task slots; use -n 4 or fewer, or ask salloc/sbatch for more (-N, "
     "--ntasks-per-node)"),
    ([], {**BATCH, "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "0"},
     "distgraph run: started as 4 tasks of srun (job 12, step 0); it starts every rank "
     "itself: run it once, in the sbatch script or the salloc shell, or as one task (srun -N 1 "
     "-n 1 distgraph run ...)"),
    (["--hosts", "node0:2,node9:2"], BATCH, "distgraph run: --hosts node0:2,node9:2: node9 is "
     "not among the nodes of Slurm job 12 on node[0-1] with 2(x2) tasks per node; hydra starts "
     "ranks through srun, which reaches only those: name its nodes, or leave "
     "--hostfile/--hosts out"),
])
def test_what_does_not_fit_the_allocation_is_one_line_before_anything_starts(args, env, line):
    proc = distgraph("run", *args, *TRAIN, env=env)
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", line + "\n")


def test_only_the_first_of_several_srun_tasks_says_it():
    env = {**BATCH, "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "3"}
    proc = distgraph("run", *TRAIN, env=env)
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", "")


# ---- a real Slurm ------------------------------------------------------------------------

def _slurm_places() -> dict:
    return {p: sorted(os.listdir(p)) if os.path.isdir(p) else None for p in SLURM_PLACES}


def _skip_without_slurm() -> None:
    reason = _cannot_emulate()
    if reason is None and missing_packages():
        reason = (f"{', '.join(missing_packages())} not installed (apt-get install slurmd "
                  "slurmctld slurm-client munge; .ci/run does)")
    if reason is not None:
        pytest.skip(f"a Slurm cluster: {reason}")


# first: one process holds one cluster at a time (its namespaces are named after the
# process), and the module's cluster below stays up until its last test
@pytest.mark.slow      # a Slurm cluster's start
def test_the_daemons_namespaces_and_files_are_removed_after_an_error():
    _skip_without_slurm()
    with pytest.raises(RuntimeError, match="on purpose"):
        with SlurmCluster(log=open(os.devnull, "w")) as made:
            daemons, namespaces = made.daemon_pids, list(made.layout.namespaces)
            folder = made.folder
            assert made.slurm("sinfo", "-h", "-o", "%D %t").stdout.split() == ["2", "idle"]
            raise RuntimeError("on purpose")
    assert not set(namespaces) & set(our_namespaces())
    assert not any(os.path.exists(f"/proc/{pid}") for pid in daemons)
    assert not os.path.exists(folder)


@pytest.fixture(scope="module")
def cluster():
    _skip_without_slurm()
    network, places = root_network(), _slurm_places()
    with SlurmCluster(log=open(os.devnull, "w")) as made:
        namespaces, folder = list(made.layout.namespaces), made.folder
        yield made
    # whatever the tests did, the daemons, the namespaces and every file are gone
    assert not set(namespaces) & set(our_namespaces())
    assert not os.path.exists(folder)
    assert root_network() == network and _slurm_places() == places


def user(cluster) -> dict:
    """The environment of a user on the login host: Slurm's, MPI's, distgraph on PATH."""
    path = f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}"
    return {**os.environ, "OMP_NUM_THREADS": "1", "PATH": path, **cluster.env()}


def typed(cluster, *argv, timeout=300) -> subprocess.CompletedProcess:
    """``argv`` typed on the login host, to its end."""
    return subprocess.run(cluster.login_argv([str(a) for a in argv]), capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=user(cluster))


def batch_script(cluster, name: str, *lines) -> str:
    path = Path(cluster.shared) / name
    path.write_text("#!/bin/sh\n" + "".join(line + "\n" for line in lines))
    path.chmod(0o755)
    return str(path)


def submit(cluster, script: str, *options) -> tuple[str, Path]:
    """``sbatch OPTIONS SCRIPT``: the job id and its output file."""
    out = Path(cluster.shared) / f"{Path(script).stem}-%j.out"
    proc = typed(cluster, "sbatch", "-N", 2, "--ntasks-per-node=2", "-o", out, *options, script)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.split()[-1]
    return job, Path(str(out).replace("%j", job))


def result(text: str, tag: str) -> dict:
    lines = [ln for ln in text.splitlines() if ln.startswith(tag + " ")]
    assert len(lines) == 1, text[-3000:]
    return json.loads(lines[0].split(" ", 1)[1])


def wait_for(path: Path, pattern: str, seconds=120) -> None:
    deadline = time.monotonic() + seconds
    while not (path.exists() and re.search(pattern, path.read_text(), re.MULTILINE)):
        assert time.monotonic() < deadline, path.read_text() if path.exists() else "no output"
        time.sleep(0.2)


def wait_ended(cluster, job: str, seconds=120) -> None:
    """Until ``job`` has left the queue (``sbatch --wait`` asks only every few seconds)."""
    deadline = time.monotonic() + seconds
    while cluster.slurm("squeue", "-h", "-j", job, check=False).stdout.strip():
        assert time.monotonic() < deadline, f"job {job} did not end in {seconds} s"
        time.sleep(0.2)


def assert_clean(cluster, seconds=30) -> None:
    """No job in the queue, no process on the nodes but slurmd, no job folder in their
    /tmp, within ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        queue = cluster.slurm("squeue", "-h", "-o", "%i %T").stdout.split("\n")
        left = {n: cluster.processes(n) for n in cluster.nodes}
        folders = {n: [f for f in os.listdir(cluster.tmp_of(n))
                       if f.startswith(("distgraph-status-", "distgraph-logs-"))]
                   for n in cluster.nodes}
        if not any(q.strip() for q in queue) and not any(left.values()) \
                and not any(folders.values()):
            return
        assert time.monotonic() < deadline, f"left: {queue} {left} {folders}"
        time.sleep(0.3)


def ranks_hosts(logs: Path, n: int) -> list[str]:
    return [(logs / f"rank-{r}.log").read_text().split(",")[0].split()[-1] for r in range(n)]


@pytest.mark.mpi
@pytest.mark.slow
def test_sbatch_trains_on_both_nodes_equal_to_serial(cluster):
    logs = Path(cluster.shared) / "sbatch-logs"
    script = batch_script(cluster, "train.sh",
                          f"distgraph run --log-dir {logs} {' '.join(map(str, TRAIN))}")
    job, out = submit(cluster, script)
    wait_ended(cluster, job)
    check_report(result(out.read_text(), "PLANS-RESULT"), 4, ["gpt:dp_tp"])
    assert ranks_hosts(logs, 4) == ["node0", "node0", "node1", "node1"]
    assert_clean(cluster)


@pytest.mark.mpi
@pytest.mark.slow
def test_salloc_trains_on_both_nodes_from_the_login_host_equal_to_serial(cluster):
    proc = typed(cluster, "salloc", "-N", 2, "--ntasks-per-node=2", "distgraph", "run", *TRAIN)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_report(result(proc.stdout, "PLANS-RESULT"), 4, ["gpt:dp_tp"])
    assert_clean(cluster)


@pytest.mark.mpi
@pytest.mark.slow
def test_srun_of_distgraph_run_in_an_allocation_trains_equal_to_serial(cluster):
    logs = Path(cluster.shared) / "srun-logs"
    proc = typed(cluster, "salloc", "-N", 2, "--ntasks-per-node=2", "srun", "-N", 1, "-n", 1,
                 "distgraph", "run", "--log-dir", logs, *TRAIN)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_report(result(proc.stdout, "PLANS-RESULT"), 4, ["gpt:dp_tp"])
    assert ranks_hosts(logs, 4) == ["node0", "node0", "node1", "node1"]
    assert_clean(cluster)


@pytest.mark.slow      # a Slurm cluster's start
def test_more_ranks_than_the_allocation_or_several_srun_tasks_start_nothing(cluster):
    proc = typed(cluster, "salloc", "-N", 2, "--ntasks-per-node=2", "distgraph", "run",
                 "-n", 5, *TRAIN)
    job = re.search(r"Granted job allocation (\d+)", proc.stderr)[1]
    said = [ln for ln in proc.stderr.splitlines() if ln.startswith("distgraph")]
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert said == [f"distgraph run: -n 5: Slurm job {job} on node[0-1] with 2(x2) tasks per "
                    "node has 4 task slots; use -n 4 or fewer, or ask salloc/sbatch for more "
                    "(-N, --ntasks-per-node)"]
    proc = typed(cluster, "srun", "-N", 2, "--ntasks-per-node=2", "distgraph", "run", *TRAIN)
    said = [ln for ln in proc.stderr.splitlines() if ln.startswith("distgraph")]
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert len(said) == 1 and said[0].startswith("distgraph run: started as 4 tasks of srun")
    assert_clean(cluster)       # the queue may show the refused job COMPLETING a moment


@pytest.mark.mpi
@pytest.mark.slow
def test_scancel_leaves_no_rank_and_no_proxy_on_either_node(cluster):
    script = batch_script(cluster, "long.sh",
                          f"distgraph run {SCRIPTS / 'fault_jobs.py'} long")
    job, out = submit(cluster, script)
    wait_for(out, r"^STARTED 3$")
    for n in cluster.nodes:          # the ranks and a hydra proxy run on both nodes
        running = " ".join(cluster.processes(n))
        assert "hydra_pmi_proxy" in running and "fault_jobs.py long" in running, running
    cluster.slurm("scancel", job)
    wait_ended(cluster, job)
    deadline = time.monotonic() + 30
    while any(cluster.processes(n) for n in cluster.nodes):
        assert time.monotonic() < deadline, {n: cluster.processes(n) for n in cluster.nodes}
        time.sleep(0.3)
    text = out.read_text()
    assert "received SIGTERM: stopped mpiexec and its 4 ranks on 2 hosts" in text, text
    # Slurm refuses a cancelled job a step to clean node1's files with: the launcher says
    # where they are (each rank's log and status files; the processes are gone)
    # a node's /tmp is its own folder: the job's temporary folder (TMPDIR) is below it
    below = os.path.relpath(os.path.realpath(tempfile.gettempdir()), os.path.realpath("/tmp"))
    here = os.path.join("/tmp", below) if below != "." else "/tmp"

    def node_tmp(n):
        return os.path.normpath(os.path.join(cluster.tmp_of(n), below))

    left = [f for f in os.listdir(node_tmp("node1")) if f.startswith("distgraph-status")]
    assert len(left) == 1 and f"look for {here}/{left[0]} there" in text, text
    for n in cluster.nodes:
        for name in os.listdir(node_tmp(n)):
            if name.startswith(("distgraph-status-", "distgraph-logs-")):
                shutil.rmtree(os.path.join(node_tmp(n), name))
    assert_clean(cluster, seconds=0)


@pytest.mark.mpi
@pytest.mark.slow
def test_elastic_a_node_drained_mid_run_is_dropped_and_training_resumes_on_the_other(
        cluster, tmp_path):
    from test_elastic import SCRIPT, assert_equal_weights
    serial = tmp_path / "serial.npz"
    epochs = ["--epochs", "3"]      # 36 steps of 0.2 s: time for the drain to be seen
    subprocess.run([sys.executable, SCRIPT, "--out", str(serial), *epochs], check=True,
                   env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True)
    shared = Path(cluster.shared) / "elastic"
    script = batch_script(cluster, "elastic.sh",
                          f"distgraph run --elastic --min-ranks 2 --log-dir {shared}/logs "
                          f"{SCRIPT} --ckpt {shared}/ckpt --out {shared}/w.npz --step-time 0.2 "
                          f"{' '.join(epochs)}")
    job, out = submit(cluster, script)
    try:
        wait_for(out, r"^STEP \S+ ([6-9]|1\d) world=4")     # past the checkpoint of step 4
        cluster.slurm("scontrol", "update", "nodename=node1", "state=drain", "reason=repair")
        wait_for(out, r"^DONE ", seconds=240)
        wait_ended(cluster, job)
        text = out.read_text()
        assert "elastic: host node1 is draining in Slurm; restart 1 of 3 on 2 ranks " \
            "(node0:2), was 4; dropped node1" in text, text
        assert "finished after 1 restart (world sizes 4 -> 2)" in text, text
        assert "resumed from" in text and "DONE world=2 step=36" in text, text
        assert_equal_weights(shared / "w.npz", dict(np.load(serial)))
        records = [json.loads(ln) for ln in (shared / "logs" / "elastic.jsonl").open()]
        assert [r["world"] for r in records if r["event"] == "start"] == [4, 2]
        assert cluster.node_state("node1") == "drain"
        assert_clean(cluster)
    finally:
        cluster.slurm("scancel", job, check=False)
        cluster.resume("node1")       # for the tests after this one
