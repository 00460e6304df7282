"""One job at a time writes a checkpoint directory.

A checkpoint directory ``ckpt`` is held through the lock file ``ckpt/.lock``; a series of
them (``ModelCheckpoint("ck/step-{step}")``) through ``ck/.step-{step}.lock``, beside the
first folder of its path that holds a placeholder. Holding is an exclusive ``flock`` on
that file, taken by rank 0 of a job, which writes its host, process id and start time
into it for the message another job gets. The kernel lets go of a ``flock`` when its
process ends, however it ends, so a job that was killed never leaves a directory held.
A process that holds a lock and asks again (``ModelCheckpoint`` holds ``ckpt`` for a fit,
and each of its saves asks) finds its own name in the file and goes on.

Example::

    lock = Lock("ckpt")
    lock.acquire()            # CheckpointError when another job holds it, or it cannot be written
    ...                       # save
    lock.release()
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time

from distgraph.errors import CheckpointError

LOCK_NAME = ".lock"      # in a checkpoint directory: its lock file


def _split(path) -> tuple[str, str | None]:
    """(the folder the lock file lives in, the series' templated folder name or None)."""
    parts = os.path.abspath(os.fspath(path)).split(os.sep)
    templated = next((i for i, p in enumerate(parts) if "{" in p), None)
    if templated is None:
        return os.sep.join(parts) or os.sep, None
    return os.sep.join(parts[:templated]) or os.sep, parts[templated]


def _me() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid()}


class Lock:
    """The lock of checkpoint directory (or series) ``path`` (module docstring)."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self.folder, series = _split(path)
        self.file = os.path.join(self.folder, LOCK_NAME if series is None else
                                 f".{series}.lock")
        self.fd = None
        self.unsupported = None     # why this filesystem takes no locks, where it takes none

    def acquire(self) -> None:
        """Hold the lock (no-op when this process holds it already), making the folders
        it lives in; CheckpointError when another job holds it or its folder cannot be
        written (so taking it is also the check that checkpoints can be written)."""
        if self.fd is not None:
            return
        try:
            os.makedirs(self.folder, exist_ok=True)
            fd = os.open(self.file, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise CheckpointError(f"cannot write checkpoints to {self.path}: {_why(e)}; "
                                  f"give a path in a folder this job can write") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _holder(fd)
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                self.unsupported = e.strerror      # (a filesystem without flock)
                return
            if {k: holder.get(k) for k in ("host", "pid")} == _me():
                return                            # held by this process, through another file
            raise CheckpointError(
                f"checkpoint directory {self.path} is held by another job "
                f"({_described(holder)}), which is writing checkpoints there; two jobs "
                f"saving into one directory delete each other's files. Give this job "
                f"another path, or wait until that job ends") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({**_me(), "since": time.strftime("%Y-%m-%d %H:%M:%S")})
                 .encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)         # closing the file lets go of its flock
            self.fd = None

    @property
    def held(self) -> bool:
        return self.fd is not None


def _holder(fd) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode())
    except (OSError, ValueError):         # being written this moment: not told who
        return {}


def _described(holder: dict) -> str:
    if not holder.get("pid"):
        return "who could not be read"
    return (f"process {holder['pid']} on host {holder.get('host')}, since "
            f"{holder.get('since', '?')}")


def _why(error: OSError) -> str:
    name = error.filename
    if isinstance(error, (NotADirectoryError, FileExistsError)) and name:
        while name != os.path.dirname(name) and not os.path.isfile(name):
            name = os.path.dirname(name)      # the file where a folder of the path must be
        return f"{name} is a file, where a folder is needed"
    return f"{error.strerror}" + (f" ({name})" if name else "")
