"""One running mpiexec job: start it, show the ranks' output, wait, and stop it entirely.

mpiexec runs in a session of its own, so a Ctrl-C at the terminal reaches only the
launcher (which then stops the job) and not every rank (which would each print a
KeyboardInterrupt traceback), and Linux sends it SIGTERM if the launcher dies, even by
SIGKILL. Its own messages go to ``mpiexec.log`` in the log folder; the ranks' output
comes through two FIFOs in the status folder (see :mod:`distgraph.runtime.launch.supervisor`).

Stopping sends mpiexec SIGTERM, which it passes to every rank; whatever is still alive
after ``GRACE`` seconds, mpiexec and every process a supervisor recorded, gets SIGKILL.

Example::

    job = Job(command, env, status_dir, log_dir)
    job.start()
    returncode = job.wait(timeout=60)
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

from distgraph.runtime.launch.status import STATUS_DIR, read_states

GRACE = 2.0     # seconds the ranks get to end after SIGTERM before SIGKILL
POLL = 0.1


def _die_with_launcher() -> None:
    """In mpiexec, before it starts: get SIGTERM when the launcher dies."""
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # 1 = PR_SET_PDEATHSIG


class Job:
    """mpiexec ``command`` with ``env``; ``status_dir`` and ``log_dir`` as the ranks
    know them. ``stopped_by`` is the signal that stopped it (None), ``timed_out``
    whether ``wait`` gave up."""

    def __init__(self, command, env, status_dir: str, log_dir: str):
        self.command, self.env = list(command), env
        self.status_dir, self.log_dir = status_dir, log_dir
        self.stopped_by: int | None = None
        self.stopped_because: str | None = None
        self.timed_out = False
        self._stop_requested: int | None = None
        self._proc = None
        self._fifos: dict = {}

    # ---- start ----------------------------------------------------------------------
    def start(self) -> None:
        self._open_fifos()
        log = os.open(os.path.join(self.log_dir, "mpiexec.log"),
                      os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            # preexec_fn only calls prctl, which is safe in a forked child
            self._proc = subprocess.Popen(self.command, env=self.env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True,
                                          preexec_fn=_die_with_launcher)  # noqa: PLW1509
        finally:
            os.close(log)

    def _open_fifos(self) -> None:
        """out.fifo and err.fifo: the ranks' stdout and stderr on their way here. This
        side also holds a write end, so that no rank connecting or leaving ends them."""
        for name, stream in (("out.fifo", sys.stdout), ("err.fifo", sys.stderr)):
            path = os.path.join(self.status_dir, name)
            os.mkfifo(path, 0o600)
            read_end = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            keep_open = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            self._fifos[read_end] = (stream, keep_open)

    # ---- wait -----------------------------------------------------------------------
    def request_stop(self, signum: int) -> None:
        """Called from a signal handler: stop at the next poll (twice: kill at once)."""
        if self._stop_requested is not None and self._proc is not None:
            self._kill_everything()
        self._stop_requested = signum

    def wait(self, timeout: float | None = None, watch=None) -> int:
        """Show the ranks' output until mpiexec ends; the exit code (128 + signal when
        stopped by one, 124 on timeout, 1 when ``watch()``, polled meanwhile, returned a
        reason to stop). Leaves no process of the job behind."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while self._proc.poll() is None:
                self._relay(POLL)
                reason = watch() if watch is not None else None
                if self._stop_requested is not None:
                    self.stopped_by = self._stop_requested
                    self.stop()
                elif deadline is not None and time.monotonic() > deadline:
                    self.timed_out = True
                    self.stop()
                elif reason is not None:
                    self.stopped_because = reason
                    self.stop()
            self._relay(0)
        finally:
            self._kill_leftovers()
            self._close()
        if self.stopped_by is not None:
            return 128 + self.stopped_by
        if self.timed_out:
            return 124
        if self.stopped_because is not None:
            return 1
        return self._proc.returncode

    def _relay(self, timeout: float) -> None:
        """Copy what the ranks printed to this process's stdout / stderr."""
        while self._fifos:
            ready, _, _ = select.select(list(self._fifos), [], [], timeout)
            if not ready:
                return
            for fd in ready:
                try:
                    data = os.read(fd, 1 << 16)
                except BlockingIOError:
                    continue
                stream = self._fifos[fd][0]
                buffer = getattr(stream, "buffer", None)
                if buffer is not None:
                    stream.flush()
                    buffer.write(data)
                    buffer.flush()
                else:
                    stream.write(data.decode("utf-8", "replace"))
                    stream.flush()
            timeout = 0

    # ---- stop -----------------------------------------------------------------------
    def stop(self) -> None:
        """SIGTERM to mpiexec (which passes it to every rank); SIGKILL to whatever of the
        job is still alive after GRACE seconds."""
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + GRACE
        while self._proc.poll() is None and time.monotonic() < end:
            self._relay(POLL)
        if self._proc.poll() is None:
            self._kill_everything()
        self._proc.wait()

    def _kill_everything(self) -> None:
        try:
            self._proc.kill()
        except OSError:
            pass
        self._kill_leftovers()

    def _job_pids(self) -> list[int]:
        """Live processes that supervisors recorded and that are still this job's (their
        environment names this status folder: a reused process id is not)."""
        marker = f"{STATUS_DIR}={self.status_dir}\0".encode()
        pids = []
        for state in read_states(self.status_dir, _recorded_ranks(self.status_dir)):
            for pid in state.pids:
                try:
                    with open(f"/proc/{pid}/environ", "rb") as f:
                        if marker in f.read() + b"\0":
                            pids.append(pid)
                except OSError:
                    pass
        return pids

    def _kill_leftovers(self) -> None:
        """SIGKILL every recorded process of the job that outlived mpiexec."""
        for pid in self._job_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def _close(self) -> None:
        for read_end, (_, keep_open) in self._fifos.items():
            os.close(read_end)
            os.close(keep_open)
        self._fifos = {}

    def mpiexec_output_tail(self, lines: int = 5) -> str:
        """The last lines mpiexec itself printed, joined with " | "."""
        try:
            with open(os.path.join(self.log_dir, "mpiexec.log"), errors="replace") as f:
                tail = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
        except OSError:
            return ""
        return " | ".join(tail[-lines:])


def _recorded_ranks(status_dir: str) -> int:
    """One past the highest rank that wrote a ``.pids`` file."""
    ranks = [int(name.split(".")[0]) for name in os.listdir(status_dir)
             if name.endswith(".pids") and name.split(".")[0].isdigit()]
    return max(ranks) + 1 if ranks else 0
