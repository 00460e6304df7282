"""A rank that ends its own way (raises while the others finish, sys.exit(0) before its first
collective, sleeps, exits in the middle of fit, finishes while the others train on) ends
the whole job within seconds, non-zero, naming the rank and what it did, its traceback in
its log; and no job, however it ends (a rank killed, Ctrl-C, a label error, normally),
leaves a process, a shared-memory segment or a temporary file of MPI's behind.

Each job runs under a marker in its environment; while it runs, the test reads which
/dev/shm segments and /tmp files MPI made for it from the processes that carry the
marker (their memory maps and open files), and afterwards checks that none is left: the
machine is shared, so a listing of /dev/shm before and after would also see other jobs'.
"""

import os
import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from job_traces import Traced  # noqa: E402
from rank_faults import ENDING_CASES, ENDINGS, fault_time, stuck_before_mpi  # noqa: E402

JOBS = Path(__file__).parent / "mpi_scripts" / "fault_jobs.py"


@pytest.fixture(autouse=True)
def _job_temp(tmp_path, monkeypatch):
    """Failed jobs keep their default log folder: keep it here."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))


@pytest.mark.mpi
@pytest.mark.parametrize("case", list(ENDING_CASES))
def test_a_rank_that_ends_its_own_way_ends_the_job_named_and_leaves_nothing(tmp_path, case):
    mode, n, rank, env, said = ENDING_CASES[case]
    logs = tmp_path / "logs"
    job = Traced(tmp_path, "run", "-n", n, "--log-dir", logs, ENDINGS, mode, rank, **env)
    rc = job.wait()
    out = job.output
    print(f"{case}: {job.ended - fault_time(out):.2f} s from the fault to the end of the job")
    assert rc != 0, out
    for words in said:
        assert words in out, out
    assert out.rstrip().splitlines()[-1].startswith("distgraph: "), out
    if mode.startswith("raise"):      # the traceback, in the log the last line names
        log = (logs / f"rank-{rank}.log").read_text()
        assert "Traceback (most recent call last)" in log and "boom on rank" in log, log
        assert f"{logs}{os.sep}rank-<r>.log" in out, out
    job.trace.assert_nothing_left(ran_mpi=True)


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


@pytest.mark.mpi
def test_a_rank_stuck_before_mpi_starts_ends_the_job_at_the_users_timeout(tmp_path):
    """Rank 1 hangs as its interpreter starts, before the bootstrap, so before MPI starts
    (rank_faults.stuck_before_mpi): rank 0 waits in MPI_Init, where no timeout of its own
    reaches. DISTGRAPH_COMM_TIMEOUT bounds that wait too."""
    env, said, mark = stuck_before_mpi(tmp_path, 3)
    job = Traced(tmp_path, "run", "-n", 2, ENDINGS, "exit", 9, **env)
    rc = job.wait()
    out = job.output
    print(f"hangs before MPI starts: {job.ended - float(mark.read_text()):.2f} s from the "
          "fault to the end of the job")
    assert rc != 0, out
    for words in ["rank 0 " + said[0], *said[1:]]:      # of 2 ranks, rank 0 waited
        assert words in out, out
    job.trace.assert_nothing_left(ran_mpi=True)


def start_and_wait_for(tmp_path, n: int, *args) -> Traced:
    job = Traced(tmp_path, "run", "-n", n, JOBS, *args)
    deadline = time.monotonic() + 60
    while job.output.count("STARTED") < n:
        assert job.proc.poll() is None and time.monotonic() < deadline, job.output
        time.sleep(0.1)
    return job


@pytest.mark.mpi
@pytest.mark.parametrize("ending", ["a-rank-killed", "ctrl-c", "label-error", "normal-end"])
def test_no_ending_leaves_a_process_or_a_file_of_the_job(tmp_path, ending):
    if ending in ("a-rank-killed", "ctrl-c"):
        job = start_and_wait_for(tmp_path, 2, "long")
        if ending == "ctrl-c":
            os.killpg(job.proc.pid, signal.SIGINT)       # what a terminal does
        else:
            scripts = {pid for pid in job.trace.pids if _runs(pid, b"fault_jobs.py")}
            # a rank, not its supervisor: the rank's parent runs the script too
            rank = next(pid for pid in sorted(scripts) if parent(pid) in scripts)
            os.kill(rank, signal.SIGKILL)
    elif ending == "label-error":
        job = Traced(tmp_path, "run", "-n", 2, JOBS, "labels", 99)
    else:
        job = Traced(tmp_path, "run", "-n", 2, JOBS, "cluster")
    rc = job.wait()
    assert (rc == 0) == (ending == "normal-end"), job.output
    job.trace.assert_nothing_left(ran_mpi=True)


def _runs(pid: int, word: bytes) -> bool:
    """Whether live process ``pid``'s command line holds ``word``."""
    try:
        return word in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
