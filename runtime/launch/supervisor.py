"""The supervisor of one rank under the launcher: a parent process forked before MPI starts.

It records the rank's process ids and host, copies everything the rank prints into the
rank's log file (``<log dir>/rank-<r>.log``, whose first line names the rank's host) and
on to the launcher's terminal, forwards termination signals to the rank, and when the
rank's process ends writes ``<rank>.exit`` saying how (``exited with code 0``, ``killed
by signal 9``): the launcher's watch (:mod:`distgraph.runtime.launch.watch`) reads it,
and without ``<rank>.done`` or ``<rank>.failed`` beside it the rank ended without a word
(killed, crashed, ``os._exit``). It then ends the way its rank did, which is what
mpiexec sees.

On the launching host the output reaches the terminal through the FIFOs ``out.fifo`` /
``err.fifo`` of the status folder, so it is not mixed with mpiexec's own messages. On
another host (no FIFO there: the status and log folders are made afresh, at the same
path, and the launcher collects them after the job) it goes through hydra, which
forwards each rank's stdout and stderr to mpiexec; each piece then carries
:data:`MARK` and its length, by which the launcher tells it from hydra's own messages.

Called by :mod:`distgraph.runtime.launch.bootstrap` as the first thing a rank does::

    supervise_this_rank()     # returns in the child, which goes on to be the rank
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys

from distgraph.runtime.launch.status import env_rank, log_path, status_folder, write_status

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
CHUNK = 4096    # at most PIPE_BUF: each chunk reaches the shared FIFO in one piece
MARK = b"\x1edistgraph\x1f"     # then 4 hex digits of length: a rank's piece via hydra


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (prctl PR_SET_PDEATHSIG)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)    # 1 = PR_SET_PDEATHSIG


def _terminal(folder: str, name: str, fallback: int) -> tuple[int, bool]:
    """(the write end of the launcher's FIFO ``name``, False), or when no launcher reads
    one here, (``fallback``, True): output then goes through mpiexec, marked."""
    try:
        fd = os.open(os.path.join(folder, name), os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return fallback, True
    os.set_blocking(fd, True)     # the terminal's pace is the rank's pace, as without us
    return fd, False


def _write_all(fd: int, data: bytes) -> bool:
    try:
        while data:
            data = data[os.write(fd, data):]
        return True
    except OSError:               # the launcher is gone: keep logging
        return False


def supervise_this_rank() -> None:
    """Fork: the child returns and becomes the rank; this process supervises it and
    never returns. Does nothing outside the launcher (no status folder)."""
    folder = status_folder()
    if not folder or not hasattr(os, "fork"):
        return
    os.makedirs(folder, 0o700, exist_ok=True)      # on a host other than the launcher's
    host = socket.gethostname()
    logfile = log_path()
    log = -1
    pipes = []
    if logfile:     # a fresh log, before the rank can write to it
        os.makedirs(os.path.dirname(logfile), exist_ok=True)
        log = os.open(logfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        _write_all(log, f"distgraph: rank {env_rank()} on host {host}, pid {os.getpid()}\n"
                   .encode())
        pipes = [os.pipe(), os.pipe()]
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        _die_with_parent()
        if os.getppid() != parent:       # the supervisor died before prctl took effect
            os._exit(1)
        for target, (read_end, write_end) in zip((1, 2), pipes):
            os.dup2(write_end, target)
            os.close(read_end)
            os.close(write_end)
        if log >= 0:
            os.close(log)
        return
    write_status("host", host)
    write_status("pids", f"{os.getpid()} {child}")
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, frame: os.kill(child, signum))
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    status = _copy_output(child, folder, log, pipes) if pipes else None
    if status is None:
        _, status = os.waitpid(child, 0)
    if os.WIFSIGNALED(status):
        how, code = f"killed by signal {os.WTERMSIG(status)}", 128 + os.WTERMSIG(status)
    else:
        code = os.WEXITSTATUS(status)
        how = f"exited with code {code}"
    write_status("exit", how, folder)
    os._exit(code)


def _copy_output(child: int, folder: str, log: int, pipes) -> int | None:
    """Copy the rank's stdout and stderr to its log and the terminal until both close;
    returns the rank's wait status if it was reaped meanwhile (a process the rank started
    may hold the pipes open after the rank is gone).

    The terminal gets whole lines where it can (a partial line after 50 ms of quiet), so
    that the lines of different ranks do not cut into each other."""
    for _, write_end in pipes:
        os.close(write_end)
    streams = {pipes[0][0]: _Lines(*_terminal(folder, "out.fifo", sys.stdout.fileno())),
               pipes[1][0]: _Lines(*_terminal(folder, "err.fifo", sys.stderr.fileno()))}
    status = None
    while streams:
        waiting = any(s.pending for s in streams.values())
        ready, _, _ = select.select(list(streams), [], [], 0.05 if waiting else 0.5)
        for fd in ready:
            data = os.read(fd, CHUNK)
            _write_all(log, data)
            streams[fd].add(data)
            if not data:
                os.close(fd)
                del streams[fd]
        if not ready:
            for stream in streams.values():
                stream.flush()
            if status is None and not waiting:
                pid, status = os.waitpid(child, os.WNOHANG)
                if pid != 0:
                    break
                status = None
    os.close(log)
    return status


class _Lines:
    """Output on its way to the terminal, sent in whole lines of at most CHUNK bytes,
    each with :data:`MARK` and its length when ``marked``."""

    def __init__(self, fd: int, marked: bool = False):
        self.fd, self.marked, self.pending = fd, marked, b""

    def add(self, data: bytes) -> None:
        """Queue ``data`` and send the complete lines; empty ``data`` (end) sends all."""
        self.pending += data
        if not data:
            self.flush()
            return
        while True:
            cut = max(self.pending.rfind(b"\n", 0, CHUNK), self.pending.rfind(b"\r", 0, CHUNK))
            if cut < 0 and len(self.pending) >= CHUNK:
                cut = CHUNK - 1
            if cut < 0:
                return
            self._send(self.pending[:cut + 1])
            self.pending = self.pending[cut + 1:]

    def flush(self) -> None:
        while self.pending:
            self._send(self.pending[:CHUNK])
            self.pending = self.pending[CHUNK:]

    def _send(self, data: bytes) -> None:
        if self.marked:
            data = MARK + b"%04x" % len(data) + data
        if self.fd >= 0 and not _write_all(self.fd, data):
            self.fd = -1
