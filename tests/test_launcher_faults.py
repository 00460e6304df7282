"""The launcher under faults: signals end the whole job, a hung rank is named, the cluster
file is checked before any rank starts and reaches the Engine, failures print one line
per cause (tracebacks in the per-rank logs), argument errors print one line, collective
calls made on some ranks only are caught early, calibration works with more ranks than
cores."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distgraph.resources.cluster import Cluster

sys.path.insert(0, str(Path(__file__).parent))
from job_traces import Traced, marked  # noqa: E402

JOBS = Path(__file__).parent / "mpi_scripts" / "fault_jobs.py"
CLUSTERS = Path(__file__).parent.parent / "resources" / "clusters"
DEADLINE = 30.0   # a failing job must be over by then (the comm timeout is 60 s)
TIMEOUT = 90


@pytest.fixture(autouse=True)
def _job_temp(tmp_path, monkeypatch):
    """Jobs that fail or are stopped keep their default log folder: keep it here."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))


def command(*args):
    return [sys.executable, "-m", "distgraph.cli", *map(str, args)]


def run(argv, **env):
    """(exit code, stdout + stderr, seconds) of a command with one BLAS thread."""
    start = time.monotonic()
    proc = subprocess.run(argv, env=dict(os.environ, OMP_NUM_THREADS="1", **env), check=False,
                          capture_output=True, text=True, timeout=TIMEOUT)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


# ---- 1. signals -------------------------------------------------------------------------

@pytest.mark.mpi
@pytest.mark.parametrize("sig,to_group,n", [(signal.SIGTERM, False, 4), (signal.SIGHUP, False, 2),
                                            (signal.SIGINT, False, 2), (signal.SIGINT, True, 4)],
                         ids=["SIGTERM", "SIGHUP", "SIGINT", "ctrl-c-to-the-group"])
def test_a_signal_ends_mpiexec_and_every_rank(tmp_path, sig, to_group, n):
    job = Traced(tmp_path, "run", "-n", n, JOBS, "long")
    deadline = time.monotonic() + TIMEOUT
    while job.output.count("STARTED") < n and time.monotonic() < deadline:
        assert job.proc.poll() is None, job.output
        time.sleep(0.2)
    assert len(marked(job.marker.encode())) >= 2 + 2 * n   # launcher, mpiexec, supervisors, ranks
    if to_group:      # what a terminal does on Ctrl-C: the whole foreground group
        os.killpg(job.proc.pid, sig)
    else:
        job.proc.send_signal(sig)
    code = job.wait(timeout=5)
    text = job.output
    assert code == 128 + sig, text
    job.trace.assert_nothing_left(ran_mpi=True)
    ours = [ln for ln in text.splitlines() if ln.startswith("distgraph")]
    assert len(ours) == 1 and f"received {signal.Signals(sig).name}" in ours[0], text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text


# ---- 2. a hung rank -----------------------------------------------------------------------

@pytest.mark.mpi
def test_a_rank_that_stops_making_progress_is_the_one_named():
    rc, out, seconds = run(command("run", "-n", 4, JOBS, "hang"), DISTGRAPH_COMM_TIMEOUT="3")
    assert rc != 0 and seconds < DEADLINE, out
    failed = [ln for ln in out.splitlines() if " failed: " in ln]
    assert failed, out
    for line in failed:       # every rank that gave up names rank 2, and only rank 2
        assert "rank 2 is at step 1, op 'relu'" in line and "not waiting" in line, out
        for other in (0, 1, 3):
            assert f"rank {other} is at" not in line, out
    assert "rank 2 failed" not in out, out


# ---- 3. --cluster -------------------------------------------------------------------------

@pytest.mark.mpi
@pytest.mark.parametrize("content,expected", [
    (None, "no such resource file"),
    ("machines: [ {id: 0, devices: 3\n", "invalid YAML"),
    ("machines: []\n", "machines"),
])
def test_a_bad_cluster_file_fails_before_any_rank_starts(tmp_path, content, expected):
    path = tmp_path / "cluster.yaml"
    if content is not None:
        path.write_text(content)
    marks, logs = tmp_path / "marks", tmp_path / "logs"
    marks.mkdir()
    rc, out, _ = run(command("run", "-n", 2, "--cluster", path, "--log-dir", logs, JOBS,
                             "cluster"), FAULT_JOB_MARKS=str(marks))
    assert rc == 2, out
    assert out.count("\n") == 1 and out.startswith("distgraph run: "), out
    assert expected in out and str(path) in out, out
    assert not list(marks.iterdir()) and not logs.exists()      # nothing started


@pytest.mark.mpi
def test_a_cluster_with_too_few_devices_for_the_ranks_fails_before_start(tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    rc, out, _ = run(command("run", "-n", 8, "--cluster", CLUSTERS / "local4.yaml", JOBS,
                             "cluster"), FAULT_JOB_MARKS=str(marks))
    assert rc == 2 and "has 4 devices but -n 8" in out, out
    assert not list(marks.iterdir())


@pytest.mark.mpi
def test_the_cluster_file_is_the_engines_cluster(tmp_path):
    rc, out, _ = run(command("run", "-n", 2, "--cluster", CLUSTERS / "local4.yaml", JOBS,
                             "cluster"))
    assert rc == 0, out
    name = Cluster.from_file(CLUSTERS / "local4.yaml").name
    assert sorted(ln for ln in out.splitlines() if ln.startswith("CLUSTER")) == \
        [f"CLUSTER 0 {name} 4", f"CLUSTER 1 {name} 4"], out


# ---- 6. one line per cause, logs per rank; argument errors ---------------------------------

@pytest.mark.mpi
def test_a_failing_rank_gives_one_line_and_its_traceback_goes_to_its_log(tmp_path):
    logs = tmp_path / "logs"
    rc, out, seconds = run(command("run", "-n", 4, "--log-dir", logs, JOBS, "fail"))
    assert rc != 0 and seconds < DEADLINE
    assert out.splitlines() == [
        ("distgraph: rank 1 failed: RuntimeFault: rank 1 (process 1): task forward of chunk 0 "
         "in step 1 failed: op 'relu' failed in step 1: ValueError: injected failure"),
        (f"distgraph: the job failed (mpiexec exit code {rc}); each rank's full output is "
         f"in {logs}{os.sep}rank-<r>.log")], out
    log = (logs / "rank-1.log").read_text()
    assert "Traceback" in log and "ValueError: injected failure" in log
    assert sorted(p.name for p in logs.iterdir()) == ["mpiexec.log"] + \
        [f"rank-{r}.log" for r in range(4)]


@pytest.mark.mpi
def test_output_reaches_the_terminal_and_the_logs_and_a_default_log_dir_is_removed(tmp_path):
    logs = tmp_path / "logs"
    rc, out, _ = run(command("run", "-n", 2, "--log-dir", logs, JOBS, "cluster"))
    assert rc == 0, out
    for r in (0, 1):
        assert f"CLUSTER {r} None" in out
        assert f"CLUSTER {r} None" in (logs / f"rank-{r}.log").read_text()
    temp = tmp_path / "temp"
    temp.mkdir()
    rc, out, _ = run(command("run", "-n", 2, JOBS, "cluster"), TMPDIR=str(temp))
    assert rc == 0 and out.count("CLUSTER") == 2, out
    assert not any(p.name.startswith("distgraph-logs-") for p in temp.iterdir())


@pytest.mark.parametrize("args,expected", [
    (["run", "-n", "0", str(JOBS)], "-n must be at least 1"),
    (["run", "-n", "2", "no/such/script.py"], "no/such/script.py: no such script"),
    (["run", "-n", "two", str(JOBS)], "invalid int value: 'two'"),
    (["run", str(JOBS)], "required: -n/--nprocs"),
])
def test_an_argument_error_is_one_line_and_starts_nothing(tmp_path, args, expected):
    marks = tmp_path / "marks"
    marks.mkdir()
    rc, out, _ = run(command(*args), FAULT_JOB_MARKS=str(marks))
    assert rc == 2, out
    assert out.count("\n") == 1 and expected in out and "Traceback" not in out, out
    assert not list(marks.iterdir())


@pytest.mark.mpi
def test_a_plan_for_two_processes_under_plain_python_is_the_same_one_line(tmp_path):
    rc, out, _ = run([sys.executable, str(JOBS), "two"])
    assert rc == 1 and out == (f"distgraph: PlanError: this plan needs 2 processes (process ids "
                               f"[0, 1]) but the job has 1; launch it with `distgraph run -n 2 "
                               f"{JOBS}` (or `mpiexec -n 2 python {JOBS}`)\n"), out
    rc, launched, _ = run(command("run", "-n", 1, JOBS, "two"))
    assert rc != 0 and launched.splitlines()[0] == "distgraph: rank 0 failed: " + \
        out.removeprefix("distgraph: ").strip(), launched


@pytest.mark.mpi
def test_an_error_of_several_lines_keeps_them(tmp_path):
    rc, out, _ = run(command("run", "-n", 2, JOBS, "lines"))
    lines = out.splitlines()
    # Both ranks raise; which of them reports before mpiexec stops the other is a race.
    assert rc != 0 and re.fullmatch(r"distgraph: ranks? (0, 1|0|1) failed: RuntimeFault: "
                                    r"the first line", lines[0]), out
    assert lines[1:3] == ["    then a second", "    and a third"], out


def test_run_help_is_plain_text():
    rc, out, _ = run(command("run", "--help"))
    assert rc == 0 and "--log-dir" in out and "--cluster" in out
    for markup in ("``", ":func:", ":mod:", ".. "):
        assert markup not in out, out


# ---- 7. calibration with more ranks than cores ----------------------------------------------

@pytest.mark.mpi
@pytest.mark.slow
def test_calibrate_four_ranks_finishes_and_reports_progress(tmp_path):
    out_file = tmp_path / "four.yaml"
    rc, out, _ = run(command("cluster", "calibrate", "-n", 4, "-o", out_file, "--repeats", 1,
                             "--timeout", 120))
    assert rc == 0, out
    for k, pair in enumerate(["0-1", "0-2", "0-3", "1-2", "1-3", "2-3"]):
        assert f"calibrate: pair {k + 1}/6 ranks {pair}:" in out, out
    cluster = Cluster.from_file(out_file)
    assert [d.global_id for d in cluster.devices] == [0, 1, 2, 3]
    assert all(cluster.bandwidth(a, b) > 0 for a in range(4) for b in range(a + 1, 4))


# ---- 8. collective calls on some ranks only --------------------------------------------------

@pytest.mark.mpi
def test_a_collective_call_on_one_rank_only_fails_early_saying_it_is_collective():
    rc, out, seconds = run(command("run", "-n", 2, JOBS, "subset"), DISTGRAPH_COMM_TIMEOUT="60")
    assert rc != 0 and seconds < DEADLINE, out      # not the 60 s timeout
    assert "rank 0 failed" in out, out
    assert "Engine.state_dict() is collective: call it on every rank" in out, out
    assert "rank 1 has finished its script" in out, out


@pytest.mark.mpi
def test_a_first_fit_with_a_batch_size_per_rank_fails_at_once_naming_it():
    """The job's first collective call is checked too (the Engine's MPI communicator is
    made for it), arguments included: the ranks trained mismatched steps before."""
    rc, out, seconds = run(command("run", "-n", 2, JOBS, "alike"), DISTGRAPH_COMM_TIMEOUT="60")
    assert rc != 0 and seconds < DEADLINE, out
    assert ("every rank must call Engine.fit() with the same arguments (each does its share "
            "of the same work); here rank 0 batch_size=8, rank 1 batch_size=4") in out, out


@pytest.mark.mpi
def test_different_collective_calls_on_different_ranks_fail_at_once():
    rc, out, seconds = run(command("run", "-n", 2, JOBS, "subset", "evaluate"),
                           DISTGRAPH_COMM_TIMEOUT="60")
    assert rc != 0 and seconds < DEADLINE, out
    assert ("Engine.state_dict() is collective: call it on every rank; here rank 1 called "
            "Engine.evaluate()") in out or \
        ("Engine.evaluate() is collective: call it on every rank; here rank 0 called "
         "Engine.state_dict()") in out, out
