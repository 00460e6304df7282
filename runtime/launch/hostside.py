"""What ``distgraph run`` does on each host of a job itself, before and after the ranks.

Run as a file with the job's Python (``python .../hostside.py COMMAND``), over the same
ssh (or rsh, srun) that hydra uses, so it imports nothing but the standard library:
importing distgraph would cost every host a second or more.

- ``check [--hold] CWD FILE...``: prints one JSON line describing this host: its name,
  the Python (path, version), the distgraph package (version, where it is imported from),
  whether the working directory exists here and which FILEs (relative to it: the script,
  the cluster file) do not. The launcher compares every host's line with its own before
  any rank starts. With ``--hold`` it then answers requests on its input until that
  ends, which keeps the ssh connection that ran it open for the rest of the job
  (:mod:`distgraph.runtime.launch.connections`): one JSON list per line,
  ``["collect", FOLDER, "VAR=VALUE"]`` as ``collect`` below, answered with the tar's
  length in bytes on a line of its own, then the tar.
- ``collect FOLDER VAR=VALUE``: after a job, on a host whose ranks kept their status
  files and logs in FOLDER (the job's status folder, the same path on every host): kills
  the job's processes still alive here (recorded in ``<rank>.pids`` and carrying
  ``VAR=VALUE`` in their environment, so a reused process id is never hit), removes the
  files MPI made for them that their end left behind (:func:`remove_files`), writes
  FOLDER as an uncompressed tar to stdout and removes it. FOLDER on the launching host
  itself (it holds :data:`LAUNCHER_FILE`) is written but never removed.

Files a job leaves outside its folders: MPICH's ranks on a host share memory through a
file in /dev/shm (``mpich_shm_*``) that ``MPI_Finalize`` removes, and hydra's proxy writes
the host's topology to ``/tmp/hydra_hwloc_xmlfile_*`` for its ranks and removes it when it
exits. A rank killed before ``MPI_Finalize`` (a signal, ``MPI_Abort``, hydra ending the
job after a peer died) or a proxy killed leaves them for good (2 MB of memory a job).
They are known by what the job's own processes hold (:func:`held_by`): each rank lists
its own and its proxy's into ``<rank>.files`` once MPI runs, and the launcher looks at
the processes of the job it kills; only those paths are removed. A rank that aborts the
job removes its host's itself first (under a plain ``mpiexec`` nobody else would:
:func:`~distgraph.runtime.launch.bootstrap.abort_job`).

Example (what the launcher runs, through ssh)::

    python /site/distgraph/runtime/launch/hostside.py check /home/me/proj train.py
"""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import sys
import time

LAUNCHER_FILE = ".launcher"     # marks the status folder of the launching host
JOB_FILES = ("/dev/shm/mpich_shm_", "/tmp/hydra_hwloc_xmlfile_")   # see the docstring
DELETED = " (deleted)"
KILL_GRACE = 1.0


def installed_version(name: str = "distgraph") -> str | None:
    """The version of the first installation of ``name`` on ``sys.path``, as
    ``importlib.metadata.version`` finds it, read without its e-mail parser (a tenth of a
    second of every host's check)."""
    for entry in sys.path:
        found = sorted(glob.glob(os.path.join(entry or ".", f"{name}-*.dist-info", "METADATA"))
                       + glob.glob(os.path.join(entry or ".", f"{name}*.egg-info", "PKG-INFO")))
        for path in found:
            try:
                with open(path, errors="replace") as f:
                    for line in f:
                        if line.startswith("Version:"):
                            return line.split(":", 1)[1].strip()
                        if not line.strip():          # the end of the headers
                            break
            except OSError:
                continue
    return None


def describe(cwd: str, files) -> dict:
    """This host as the launcher compares it (see the module docstring)."""
    import importlib.util

    version = installed_version()
    try:
        spec = importlib.util.find_spec("distgraph")
    except (ImportError, ValueError):
        spec = None
    return {"host": socket.gethostname(), "python": sys.executable,
            "python_version": sys.version.split()[0], "distgraph": version,
            "package": None if spec is None else os.path.dirname(spec.origin or ""),
            "cwd": os.path.isdir(cwd),
            "missing": [f for f in files if not os.path.isfile(os.path.join(cwd, f))]}


def job_pids(folder: str, marker: str) -> list[int]:
    """Live processes recorded in ``folder/<rank>.pids`` whose environment holds
    ``marker`` (``VAR=VALUE``): this job's, not a later process that got the id."""
    want = marker.encode() + b"\0"
    pids = []
    for path in glob.glob(os.path.join(folder, "*.pids")):
        try:
            with open(path) as f:
                recorded = [int(p) for p in f.read().split() if p.isdigit()]
        except OSError:
            continue
        for pid in recorded:
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if want in f.read() + b"\0":
                        pids.append(pid)
            except OSError:
                pass
    return pids


def held_by(pid) -> set[str]:
    """The files of :data:`JOB_FILES` that process ``pid`` (or ``"self"``) maps or has
    open and that still exist by that name; empty for a process gone or not readable."""
    paths = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                fields = line.rstrip("\n").split(None, 5)
                if len(fields) == 6:
                    paths.add(fields[5])
        fds = f"/proc/{pid}/fd"
        for fd in os.listdir(fds):
            try:
                paths.add(os.readlink(os.path.join(fds, fd)))
            except OSError:
                pass
    except OSError:
        pass
    return {p for p in paths if p.startswith(JOB_FILES) and not p.endswith(DELETED)}


def parent_of(pid) -> int | None:
    """The parent process id of ``pid`` (or ``"self"``); None if it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def marked_pids(marker: str) -> list[int]:
    """Live processes (zombies aside) whose environment holds ``marker`` (``VAR=VALUE``)."""
    want = marker.encode() + b"\0"
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if want in f.read() + b"\0":
                    pids.append(int(name))
        except OSError:
            pass
    return pids


def recorded_files(folder: str) -> set[str]:
    """The files the ranks listed in ``folder/<rank>.files``."""
    paths = set()
    for path in glob.glob(os.path.join(folder, "*.files")):
        try:
            with open(path) as f:
                paths.update(line.strip() for line in f if line.strip())
        except OSError:
            pass
    return paths


def remove_files(paths) -> list[str]:
    """Remove those of ``paths`` that are :data:`JOB_FILES` and still there; the ones
    removed."""
    removed = []
    for path in sorted(paths):
        if not path.startswith(JOB_FILES):
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


def kill_job(folder: str, marker: str, grace: float = KILL_GRACE) -> int:
    """SIGTERM the job's processes here, SIGKILL what is left after ``grace`` seconds;
    how many there were."""
    pids = job_pids(folder, marker)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + grace
        while sig == signal.SIGTERM and time.monotonic() < deadline:
            if not job_pids(folder, marker):
                return len(pids)
            time.sleep(0.02)
    return len(pids)


def collect(folder: str, marker: str, out) -> None:
    """Kill what is left of the job here, write ``folder`` to ``out`` as a tar, and
    remove it unless it is the launching host's own."""
    import shutil
    import tarfile

    if not os.path.isdir(folder):
        tarfile.open(fileobj=out, mode="w|").close()
        return
    kill_job(folder, marker)
    remove_files(recorded_files(folder))
    with tarfile.open(fileobj=out, mode="w|") as tar:
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            if name != LAUNCHER_FILE and (os.path.isfile(path) or os.path.isdir(path)):
                tar.add(path, arcname=name)
    if not os.path.exists(os.path.join(folder, LAUNCHER_FILE)):
        shutil.rmtree(folder, ignore_errors=True)


def hold(requests, out) -> None:
    """Answer ``requests`` (lines, see the module docstring) on ``out`` until they end
    (the launcher closed them, or is gone)."""
    import io

    for line in requests:
        request = json.loads(line)
        if request[:1] != ["collect"] or len(request) != 3:
            raise SystemExit(f"hostside.py: unknown request {line!r}")
        tar = io.BytesIO()
        collect(request[1], request[2], tar)
        out.write(b"%d\n" % len(tar.getvalue()) + tar.getvalue())
        out.flush()


def main(argv: list[str]) -> int:
    holding = argv[1:2] == ["--hold"]
    if holding:
        argv = argv[:1] + argv[2:]
    if argv[:1] == ["check"] and len(argv) >= 2:
        sys.stdout.write(json.dumps(describe(argv[1], argv[2:])) + "\n")
        sys.stdout.flush()
        if holding:
            hold(sys.stdin.buffer, sys.stdout.buffer)
        return 0
    if argv[:1] == ["collect"] and len(argv) == 3:
        collect(argv[1], argv[2], sys.stdout.buffer)
        return 0
    sys.stderr.write("usage: hostside.py check [--hold] CWD FILE... | collect FOLDER VAR=VALUE\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
