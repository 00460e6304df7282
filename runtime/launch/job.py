"""One running mpiexec job: start it, show the ranks' output, wait, and stop it entirely.

mpiexec runs in a session of its own, so a Ctrl-C at the terminal reaches only the
launcher (which then stops the job) and not every rank (which would each print a
KeyboardInterrupt traceback), and Linux sends it SIGTERM if the launcher dies, even by
SIGKILL. Its own messages go to ``mpiexec.log`` in the log folder; the ranks' output
comes through two FIFOs in the status folder, and from ranks on other hosts through
mpiexec's stdout and stderr, marked (see :mod:`distgraph.runtime.launch.supervisor`).

Stopping sends mpiexec SIGTERM, which it passes to every rank; whatever is still alive
after ``GRACE`` seconds, mpiexec and every process here carrying the job's marker in its
environment (hydra's proxies and ssh clients, the supervisors, the ranks and what they
started), gets SIGKILL; so does whatever is left of the job when mpiexec ends by itself.
Then the files MPI made for the job that its end left
here (shared memory in /dev/shm, hydra's topology file in /tmp:
:mod:`~distgraph.runtime.launch.hostside`) are removed: those the ranks listed and those
the processes killed held. (What is left on other hosts is the launcher's to clean:
:func:`distgraph.runtime.launch.remote.collect`.)

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

from distgraph.runtime.launch.hostside import (
    held_by,
    marked_pids,
    recorded_files,
    remove_files,
)
from distgraph.runtime.launch.status import STATUS_DIR
from distgraph.runtime.launch.supervisor import MARK

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
        self._mpiexec: dict = {}
        self._log = -1
        self._held: set = set()      # files of JOB_FILES the job's processes held

    # ---- start ----------------------------------------------------------------------
    def start(self) -> None:
        self._open_fifos()
        self._log = os.open(os.path.join(self.log_dir, "mpiexec.log"),
                            os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            # preexec_fn only calls prctl, which is safe in a forked child
            self._proc = subprocess.Popen(self.command, env=self.env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, start_new_session=True,
                                          preexec_fn=_die_with_launcher)  # noqa: PLW1509
        except BaseException:
            os.close(self._log)
            self._log = -1
            raise
        for pipe, stream in ((self._proc.stdout, sys.stdout), (self._proc.stderr, sys.stderr)):
            os.set_blocking(pipe.fileno(), False)
            self._mpiexec[pipe.fileno()] = _Demux(stream, self._log)

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
            if self.stopped_by is None and self._stop_requested is not None and \
                    self._proc.returncode != 0:
                # the signal reached mpiexec too (scancel signals the whole step), which
                # ended before this loop saw the request: the job was stopped by it
                self.stopped_by = self._stop_requested
            self._relay(0)
        finally:
            self._kill_leftovers()
            self._close()
            remove_files(self._held | recorded_files(self.status_dir))
        if self.stopped_by is not None:
            return 128 + self.stopped_by
        if self.timed_out:
            return 124
        if self.stopped_because is not None:
            return 1
        return self._proc.returncode

    def _relay(self, timeout: float) -> None:
        """Copy what the ranks printed to this process's stdout / stderr, and mpiexec's
        own messages to ``mpiexec.log``."""
        while self._fifos or self._mpiexec:
            ready, _, _ = select.select([*self._fifos, *self._mpiexec], [], [], timeout)
            if not ready:
                return
            for fd in ready:
                try:
                    data = os.read(fd, 1 << 16)
                except BlockingIOError:
                    continue
                if fd in self._mpiexec:
                    self._mpiexec[fd].feed(data)
                    if not data:          # mpiexec closed it
                        del self._mpiexec[fd]
                elif data:
                    _show(self._fifos[fd][0], data)
            timeout = 0

    # ---- stop -----------------------------------------------------------------------
    def stop(self) -> None:
        """SIGTERM to mpiexec (which passes it to every rank); SIGKILL to whatever of the
        job is still alive after GRACE seconds."""
        self._note_held(marked_pids(self.marker))    # what a rank killed now leaves
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + GRACE
        while self._proc.poll() is None and time.monotonic() < end:
            self._relay(POLL)
        if self._proc.poll() is None:
            self._kill_everything()
        self._proc.wait()

    def _kill_everything(self) -> None:
        self._kill_leftovers()

    @property
    def marker(self) -> str:
        """``VAR=VALUE`` in the environment of every rank and supervisor of this job."""
        return f"{STATUS_DIR}={self.status_dir}"

    def _kill_leftovers(self) -> None:
        """SIGKILL every process of the job here that outlived mpiexec: mpiexec's session
        and every process carrying the job's marker; the files of JOB_FILES they hold are
        noted first, to be removed with them."""
        # hydra puts its proxies and ranks in sessions of their own: they are found by
        # the job's marker in their environment (so are the processes a rank started)
        leftovers = marked_pids(self.marker)
        self._note_held(leftovers)
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except OSError:
            pass
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def _note_held(self, pids) -> None:
        """Note the files of JOB_FILES that ``pids`` hold, to be removed after the job
        (a rank still in MPI's start has not listed its own)."""
        for pid in pids:
            self._held |= held_by(pid)

    def _close(self) -> None:
        for read_end, (_, keep_open) in self._fifos.items():
            os.close(read_end)
            os.close(keep_open)
        self._fifos = {}
        for demux in self._mpiexec.values():
            demux.feed(b"")
        self._mpiexec = {}
        for pipe in (self._proc.stdout, self._proc.stderr):
            pipe.close()
        if self._log >= 0:
            os.close(self._log)
            self._log = -1

    def mpiexec_output_tail(self, lines: int = 5) -> str:
        """The last lines mpiexec itself printed, joined with " | "."""
        try:
            with open(os.path.join(self.log_dir, "mpiexec.log"), errors="replace") as f:
                tail = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
        except OSError:
            return ""
        return " | ".join(tail[-lines:])


def _show(stream, data: bytes) -> None:
    buffer = getattr(stream, "buffer", None)
    if buffer is not None:
        stream.flush()
        buffer.write(data)
        buffer.flush()
    else:
        stream.write(data.decode("utf-8", "replace"))
        stream.flush()


class _Demux:
    """One of mpiexec's output streams: the marked pieces (a rank's output from another
    host) go to ``stream``, everything else (hydra's own messages) to the ``log`` fd."""

    HEADER = len(MARK) + 4

    def __init__(self, stream, log: int):
        self.stream, self.log, self.pending = stream, log, b""

    def feed(self, data: bytes) -> None:
        """Take ``data``; empty ``data`` (the end) writes out whatever is left."""
        self.pending += data
        while self.pending:
            at = self.pending.find(MARK)
            if at < 0:       # keep what could be the start of a mark cut in two
                keep = 0 if not data else _mark_prefix(self.pending)
                self._log(self.pending[:len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep:]
                return
            if at > 0:
                self._log(self.pending[:at])
                self.pending = self.pending[at:]
            if len(self.pending) < self.HEADER:
                break
            size = int(self.pending[len(MARK):self.HEADER], 16)
            if len(self.pending) < self.HEADER + size:
                break
            _show(self.stream, self.pending[self.HEADER:self.HEADER + size])
            self.pending = self.pending[self.HEADER + size:]
        if not data and self.pending:          # the end, with a piece cut short
            self._log(self.pending)
            self.pending = b""

    def _log(self, data: bytes) -> None:
        if data and self.log >= 0:
            os.write(self.log, data)


def _mark_prefix(data: bytes) -> int:
    """How many bytes at the end of ``data`` could begin :data:`MARK`."""
    for k in range(min(len(MARK) - 1, len(data)), 0, -1):
        if MARK.startswith(data[-k:]):
            return k
    return 0
