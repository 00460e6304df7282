"""One ssh connection per host for the whole job: the check before the ranks, hydra's
start of them and the clean-up after share it (OpenSSH's ``ControlMaster``).

A job over ssh reaches each of its other hosts three times (see
:mod:`distgraph.runtime.launch.remote`), and every new ssh connection costs a key
exchange and an authentication: a third of a second between two hosts on one box, more
across a network, on the way to the first step twice. Shared, only the check pays it.

- The check of a host runs as the *master* of its connection: the site's launcher
  program with its options (``HYDRA_LAUNCHER_EXEC``, ``~/.ssh/config``) as ever, plus
  ``-o ControlMaster=yes -o ControlPath=DIR/%C -o ControlPersist=no``, running
  ``hostside.py check --hold``, which prints its line and then answers requests on its
  input until that ends: this keeps the connection open. The master is a child of the
  launcher, in a session of its own (a Ctrl-C at the terminal reaches the launcher only).
- Hydra's ssh to the host (``HYDRA_LAUNCHER_EXTRA_ARGS``) adds ``-o ControlPath=DIR/%C
  -o ControlMaster=no``: a session over the master, or an ordinary connection where
  there is none. The clean-up after the job is a request to the check itself
  (:meth:`Masters.ask`), answered over the master's own session: no new session, whose
  start runs the user's shell start-up files again (0.16 s of pyenv's in root's
  ``.bashrc`` on the test box); where that fails, it runs over ssh as well.
- :meth:`Masters.close` ends the masters' input; each then ends once its sessions have,
  and is waited for (killed after ``CLOSE_TIMEOUT`` seconds). When the launcher dies, even
  by SIGKILL, its end of their input closes with it: no master outlives the job.

DIR is a private temporary folder of the job (made with mode 0700), removed at close.
Other launchers (rsh, srun) and a DIR whose socket paths would be too long for a Unix
socket share nothing: each command connects as before.

Example::

    with Masters.for_launcher(launcher) as masters:
        shared = launcher.sharing(masters.folder) if masters.folder else launcher
        code, line, said = masters.start("node0", shared.argv("node0", check, master=True),
                                         time.monotonic() + 60)
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time

CLOSE_TIMEOUT = 10.0     # seconds a master gets to end after its input did
# A Unix socket's path holds 107 bytes; ssh binds the ControlPath with 17 more (a
# random suffix) before renaming it, and %C is 40 hexadecimal digits.
SOCKET_PATH_MAX = 107
SOCKET_SUFFIX = 17
HASH_DIGITS = 40


def control_folder() -> str | None:
    """A private folder for the job's control sockets, or None where their paths would
    not fit a Unix socket (or hold a space, which hydra's argument list would split)."""
    folder = tempfile.mkdtemp(prefix="distgraph-ssh-")
    if (len(folder) + 1 + HASH_DIGITS + SOCKET_SUFFIX > SOCKET_PATH_MAX
            or any(c.isspace() for c in folder)):
        os.rmdir(folder)
        return None
    return folder


class Masters:
    """The master connections of a job, by host (see the module docstring); ``folder``
    holds their control sockets (None: nothing is shared)."""

    def __init__(self, folder: str | None):
        self.folder = folder
        self._procs: dict[str, subprocess.Popen] = {}
        self._read: dict[str, bytes] = {}      # what a master printed past its answers

    @classmethod
    def for_launcher(cls, launcher) -> "Masters":
        """Masters for ``launcher`` (a :class:`~distgraph.runtime.launch.remote.Launcher`):
        over ssh only."""
        return cls(control_folder() if launcher.kind == "ssh" else None)

    def __enter__(self) -> "Masters":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self, host: str, argv: list[str], deadline: float):
        """Run ``argv``, the master of ``host``'s connection, until it prints its first
        line, and keep it running. Returns ``(0, line, "")``, or when it printed no line,
        ``(exit code, output, what it said)`` (exit code None: no line by ``deadline``,
        and it was killed)."""
        said = tempfile.TemporaryFile()
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=said, start_new_session=True)
        except OSError as err:
            said.close()
            return 127, b"", f"cannot run {argv[0]}: {err.strerror}"
        line, rest, ended = _read_line(proc.stdout.fileno(), b"", deadline)
        if line is None:
            if not ended:
                proc.kill()
            try:
                code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                code = None
            _close_pipes(proc)
            said.seek(0)
            text = said.read().decode(errors="replace")
            said.close()
            return (code if ended else None), rest, text
        said.close()      # the master's later messages go to the unlinked file, unread
        self._procs[host] = proc
        self._read[host] = rest
        return 0, line, ""

    def ask(self, host: str, request: list, deadline: float) -> bytes | None:
        """Send ``request`` to the check holding ``host``'s master (see
        :mod:`~distgraph.runtime.launch.hostside`) and return its answer, or None when
        there is no master, it is gone, or gave no whole answer by ``deadline``."""
        proc = self._procs.get(host)
        read = self._read.pop(host, None)      # None: an earlier answer went wrong
        if proc is None or proc.poll() is not None or read is None:
            return None
        try:
            proc.stdin.write(json.dumps(request).encode() + b"\n")
            proc.stdin.flush()
        except OSError:
            return None
        fd = proc.stdout.fileno()
        header, rest, _ = _read_line(fd, read, deadline)
        if header is None or not header.strip().isdigit():
            return None
        size = int(header)
        while len(rest) < size:
            chunk = _read_some(fd, deadline)
            if not chunk:
                return None
            rest += chunk
        self._read[host] = rest[size:]
        return rest[:size]

    def close(self) -> None:
        """End every master (see the module docstring) and remove the folder."""
        for proc in self._procs.values():
            try:
                proc.stdin.close()
            except OSError:
                pass
        deadline = time.monotonic() + CLOSE_TIMEOUT
        for proc in self._procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            _close_pipes(proc)
        self._procs, self._read = {}, {}
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None


def _read_line(fd: int, data: bytes, deadline: float):
    """``(line, rest, ended)``: the first line of ``data`` and what ``fd`` gives next, and
    what follows it; line None when there is no whole line by ``deadline`` (rest: what
    came) or before ``fd`` ended (ended True)."""
    while b"\n" not in data:
        chunk = _read_some(fd, deadline)
        if not chunk:
            return None, data, chunk == b""
        data += chunk
    cut = data.index(b"\n") + 1
    return data[:cut], data[cut:], False


def _read_some(fd: int, deadline: float) -> bytes | None:
    """What ``fd`` gives next: b"" at its end, None when nothing came by ``deadline``."""
    left = deadline - time.monotonic()
    if left <= 0 or not select.select([fd], [], [], left)[0]:
        return None
    return os.read(fd, 1 << 16)


def _close_pipes(proc: subprocess.Popen) -> None:
    for pipe in (proc.stdin, proc.stdout):
        try:
            pipe.close()
        except OSError:
            pass
