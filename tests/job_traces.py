"""Jobs followed while they run, and what they leave behind: the processes that carry a
job's marker in their environment, the files MPI made for them (a shared-memory segment
in /dev/shm, hydra's topology file in /tmp: :data:`MPI_FILES`) and the status folders
of ``distgraph run``, read from those processes (their memory maps, open files and
environment) while they live; after the job, which of them are still there.

The machine is shared, so a listing of /dev/shm before and after a job would also see
other jobs': a job is known by its marker, which every process it starts inherits.

Two ways in:

- :class:`Traced` starts ``distgraph ARGS`` under a marker of its own and follows it (for
  tests and benches that time a job or signal it);
- the ``job_trace`` fixture (tests/conftest.py) puts a marker into the test's
  environment, so every command the test starts carries it, however it starts it
  (``run_user``, ``subprocess.run``, ``Popen``).

Either way ``trace.assert_nothing_left(ran_mpi=...)`` is the check.

Example::

    job = Traced(tmp_path, "run", "-n", 2, "script.py")
    rc = job.wait()
    job.trace.assert_nothing_left(ran_mpi=True)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid

MPI_FILES = ("/dev/shm/mpich_shm_", "/tmp/hydra_hwloc_xmlfile_")
STATUS_VAR = b"DISTGRAPH_STATUS_DIR="      # runtime/launch/status.py's STATUS_DIR
POLL = 0.02
SETTLE = 1.0      # seconds a process killed at its job's end gets to be gone
TIMEOUT = 60      # how long a traced job may run before it is stopped: a guard, no figure


def environments(marker: bytes) -> dict[int, bytes]:
    """{pid: environment} of the live processes (other than this one) whose environment
    holds ``marker``."""
    found = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        if int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if marker in env:
            found[int(name)] = env
    return found


def marked(marker: bytes) -> list[int]:
    """Live processes whose environment holds ``marker``."""
    return sorted(environments(marker))


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


def status_folder(env: bytes) -> str | None:
    """The ``distgraph run`` status folder an environment names, if any."""
    for entry in env.split(b"\0"):
        if entry.startswith(STATUS_VAR):
            return entry[len(STATUS_VAR):].decode()
    return None


class Trace:
    """Follows, in a thread of this process, the processes whose environment holds
    ``marker`` (``KEY=VALUE``): their pids, the MPI files they held (``files``), the status
    folders they named (``folders``), and when any of them but ``ignore`` was last seen
    alive (``last_seen``, ``time.time()``)."""

    def __init__(self, marker: str, ignore=()):
        self.marker = marker
        self.ignore = set(ignore)
        self.pids: set = set()
        self.files: set = set()
        self.folders: set = set()
        self.last_seen: float | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    @property
    def env(self) -> dict:
        """The marker as an environment entry."""
        key, value = self.marker.split("=", 1)
        return {key: value}

    def _follow(self) -> None:
        while not self._done.is_set():
            self.scan()
            time.sleep(POLL)

    def scan(self) -> None:
        found = environments(self.marker.encode())
        now = time.time()
        for pid, env in found.items():
            self.pids.add(pid)
            self.files |= mpi_files(pid)
            folder = status_folder(env)
            if folder is not None:
                self.folders.add(folder)
        if set(found) - self.ignore:
            self.last_seen = now

    def stop(self) -> None:
        """Stop following (a last look first)."""
        if not self._done.is_set():
            self._done.set()
            self._thread.join()
            self.scan()

    def leftovers(self) -> tuple[list, list, list]:
        """(processes still alive, killed here; MPI files still there; status folders
        still there). Stops following first. A process killed as its job ended (hydra and
        the launcher send SIGKILL and go) gets ``SETTLE`` seconds to be gone."""
        self.stop()
        end = time.monotonic() + SETTLE
        while marked(self.marker.encode()) and time.monotonic() < end:
            time.sleep(POLL)
        alive = marked(self.marker.encode())
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return (alive, sorted(p for p in self.files if os.path.exists(p)),
                sorted(p for p in self.folders if os.path.exists(p)))

    def assert_nothing_left(self, ran_mpi: bool) -> None:
        """No process of the job alive, none of MPI's files it held, no status folder
        of it; ``ran_mpi``: the job's ranks started MPI, so its files must have been seen
        (else this would check nothing); False: no rank was to start (a refusal before
        launch), so none may have been made."""
        alive, files, folders = self.leftovers()
        assert not alive, f"processes of the job still alive: {alive}"
        assert not files, f"MPI's files of the job left behind: {files}"
        assert not folders, f"status folders of the job left behind: {folders}"
        if ran_mpi:
            assert self.files, "the job's MPI files were never seen: nothing was checked"
        else:
            assert not self.files, f"MPI started, though no rank was to: {self.files}"


def new_marker(prefix: str = "DGTEST_JOB_MARK") -> str:
    return f"{prefix}={uuid.uuid4().hex}"


class Traced:
    """``distgraph ARGS`` (``env`` added to the environment, one BLAS thread), its output
    in ``folder/out.txt``, in a session of its own, followed by a :class:`Trace` that
    ignores the launcher itself (``trace.last_seen``: the last moment any other process
    of the job lived)."""

    def __init__(self, folder, *args, **env):
        marker = new_marker("RANK_ENDINGS_MARK")
        self.out_path = folder / "out.txt"
        key, value = marker.split("=", 1)
        with open(self.out_path, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "distgraph.cli", *map(str, args)], stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
                env=dict(os.environ, OMP_NUM_THREADS="1", **{key: value}, **env))
        self.trace = Trace(marker, ignore={self.proc.pid})
        self.ended: float | None = None

    @property
    def marker(self) -> str:
        return self.trace.marker

    @property
    def output(self) -> str:
        return self.out_path.read_text()

    def wait(self, timeout: float = TIMEOUT) -> int:
        """The exit code; past ``timeout`` the job is stopped (SIGINT to the launcher, as
        Ctrl-C) and AssertionError raised with its output."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout=10)
            raise AssertionError(f"the job did not end within {timeout} s:\n{self.output}")
        finally:
            self.ended = time.time()
            self.trace.stop()
