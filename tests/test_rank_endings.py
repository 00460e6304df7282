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
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "mpi_scripts"
ENDINGS = SCRIPTS / "rank_endings.py"
JOBS = SCRIPTS / "fault_jobs.py"
MPI_FILES = ("/dev/shm/mpich_shm_", "/tmp/hydra_hwloc_xmlfile_")
TIMEOUT = 60      # the test's own guard, never a figure asserted


@pytest.fixture(autouse=True)
def _job_temp(tmp_path, monkeypatch):
    """Failed jobs keep their default log folder: keep it here."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))


def marked(marker: bytes) -> list[int]:
    """Live processes whose environment holds ``marker``."""
    pids = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if marker in f.read():
                    pids.append(int(name))
        except OSError:
            pass
    return pids


def mpi_files(pid: int) -> set[str]:
    """The MPI_FILES that process ``pid`` maps or holds open."""
    paths = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            paths.update(line.split(None, 5)[5].strip() for line in f
                         if len(line.split(None, 5)) == 6)
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                paths.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                pass
    except OSError:
        pass
    return {p for p in paths if p.startswith(MPI_FILES) and not p.endswith("(deleted)")}


class Traced:
    """``distgraph`` with ``args``, its processes and MPI's files for it followed while
    it runs."""

    def __init__(self, tmp_path, *args, **env):
        self.marker = f"RANK_ENDINGS_MARK={uuid.uuid4().hex}"
        key, value = self.marker.split("=")
        self.out_path = tmp_path / "out.txt"
        with open(self.out_path, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "distgraph.cli", *map(str, args)], stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
                env=dict(os.environ, OMP_NUM_THREADS="1", **{key: value}, **env))
        self.files: set = set()
        self._done = threading.Event()
        self._follower = threading.Thread(target=self._follow, daemon=True)
        self._follower.start()

    def _follow(self):
        while not self._done.is_set():
            for pid in marked(self.marker.encode()):
                self.files |= mpi_files(pid)
            time.sleep(0.02)

    @property
    def output(self) -> str:
        return self.out_path.read_text()

    def wait(self) -> int:
        """The exit code; every process of the job killed if it ran past TIMEOUT."""
        try:
            return self.proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout=10)
            pytest.fail(f"the job did not end within {TIMEOUT} s:\n{self.output}")
        finally:
            self.ended = time.time()
            self._done.set()
            self._follower.join()

    def leftovers(self) -> tuple[list, list]:
        """(processes of the job still alive, MPI's files for it still there)."""
        alive = marked(self.marker.encode())
        for pid in alive:
            os.kill(pid, signal.SIGKILL)
        return alive, sorted(p for p in self.files if os.path.exists(p))

    def fault_to_end(self) -> float:
        """Seconds from the rank's ``FAULT`` line to the end of the job."""
        found = re.search(r"^FAULT \d+ (\S+)$", self.output, re.M)
        assert found, self.output
        return self.ended - float(found.group(1))


ENDING_CASES = {
    # id: (mode, ranks, the rank, environment, what the output says)
    "raises-while-the-other-finishes": ("raise", 2, 1, {},
                                        ["rank 1 failed: RuntimeError: boom on rank 1"]),
    "raises-by-PMI_RANK-without-distgraph": ("raise-pmi", 2, 0, {},
                                             ["rank 0 failed: RuntimeError: boom on rank 0"]),
    "sys.exit(0)-before-its-first-collective": (
        "exit", 4, 2, {}, ["rank 2 ended its script with sys.exit(0) before its first "
                           "collective", "Engine.fit() is collective"]),
    "sleeps-before-its-first-collective": (
        "sleep", 2, 1, {"DISTGRAPH_COMM_TIMEOUT": "5"},
        ["timed out after 5 s", "rank 1 has not started communicating"]),
    "sys.exit(0)-in-fit": ("exit-in-fit", 2, 1, {},
                           ["rank 1 ended its script with sys.exit(0) after step 1, in "
                            "Engine.fit()", "it ended inside Engine.fit(), which every rank "
                            "must run to its end"]),
    "os._exit(0)-in-fit": ("os-exit-in-fit", 2, 1, {},
                           ["rank 1 died without reporting an error (exited with code 0 "
                            "after step 1, in Engine.fit())"]),
    "finishes-while-the-others-train-again": (
        "finish-early", 2, 1, {}, ["rank 1 has finished its script after step 7",
                                   "Engine.fit() is collective: call it on every rank"]),
}


@pytest.mark.mpi
@pytest.mark.parametrize("case", list(ENDING_CASES))
def test_a_rank_that_ends_its_own_way_ends_the_job_named_and_leaves_nothing(tmp_path, case):
    mode, n, rank, env, said = ENDING_CASES[case]
    logs = tmp_path / "logs"
    job = Traced(tmp_path, "run", "-n", n, "--log-dir", logs, ENDINGS, mode, rank, **env)
    rc = job.wait()
    alive, files = job.leftovers()
    out = job.output
    print(f"{case}: {job.fault_to_end():.2f} s from the fault to the end of the job")
    assert rc != 0, out
    for words in said:
        assert words in out, out
    assert out.rstrip().splitlines()[-1].startswith("distgraph: "), out
    if mode.startswith("raise"):      # the traceback, in the log the last line names
        log = (logs / f"rank-{rank}.log").read_text()
        assert "Traceback (most recent call last)" in log and "boom on rank" in log, log
        assert f"{logs}{os.sep}rank-<r>.log" in out, out
    assert not alive, alive
    assert job.files, "the job's MPI files were never seen: the check below checks nothing"
    assert not files, files


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


HANG_BEFORE_MPI = """
import os, time
if os.environ.get("PMI_RANK") == "1" and "HANG_MARK" in os.environ:
    with open(os.environ["HANG_MARK"], "w") as f:
        f.write(str(time.time()))
    time.sleep(3600)
"""


@pytest.mark.mpi
def test_a_rank_stuck_before_mpi_starts_ends_the_job_at_the_users_timeout(tmp_path):
    """Rank 1 hangs as its interpreter starts (a sitecustomize that sleeps: a hung import
    of a network file system, say), before the bootstrap, so before MPI starts: rank 0
    waits in MPI_Init, where no timeout of its own reaches. DISTGRAPH_COMM_TIMEOUT
    bounds that wait too."""
    (tmp_path / "sitecustomize.py").write_text(HANG_BEFORE_MPI)
    mark = tmp_path / "hang.time"
    job = Traced(tmp_path, "run", "-n", 2, ENDINGS, "exit", 9, PYTHONPATH=str(tmp_path),
                 HANG_MARK=str(mark), DISTGRAPH_COMM_TIMEOUT="3")
    rc = job.wait()
    alive, files = job.leftovers()
    out = job.output
    print(f"hangs before MPI starts: {job.ended - float(mark.read_text()):.2f} s from the "
          "fault to the end of the job")
    assert rc != 0, out
    assert ("rank 0 waited 3 s for MPI to start on every rank (DISTGRAPH_COMM_TIMEOUT) and "
            "rank 1 never began it") in out, out
    assert not alive, alive
    assert job.files, "the job's MPI files were never seen: the check below checks nothing"
    assert not files, files


def start_and_wait_for(tmp_path, n: int, *args) -> Traced:
    job = Traced(tmp_path, "run", "-n", n, JOBS, *args)
    deadline = time.monotonic() + TIMEOUT
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
            scripts = {pid for pid in marked(job.marker.encode())
                       if b"fault_jobs.py" in Path(f"/proc/{pid}/cmdline").read_bytes()}
            # a rank, not its supervisor: the rank's parent runs the script too
            rank = next(pid for pid in sorted(scripts) if parent(pid) in scripts)
            os.kill(rank, signal.SIGKILL)
    elif ending == "label-error":
        job = Traced(tmp_path, "run", "-n", 2, JOBS, "labels", 99)
    else:
        job = Traced(tmp_path, "run", "-n", 2, JOBS, "cluster")
    rc = job.wait()
    alive, files = job.leftovers()
    assert (rc == 0) == (ending == "normal-end"), job.output
    assert not alive, alive
    assert job.files, "the job's MPI files were never seen: the check below checks nothing"
    assert not files, files
