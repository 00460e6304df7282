"""Per-rank entry point used by the launcher:
``python -m distgraph.runtime.launch.bootstrap [--cluster FILE] [--plan-out PATH]
[--plan-plot PATH] [--plan-save PATH] [--plan-file PATH] [--] script.py args``.

It runs the script as ``__main__`` under the launch context its options give
(:mod:`distgraph.runtime.launch.context`: the cluster of ``distgraph run --cluster``, the
request of ``distgraph plan``, which runs its script through here too; what they leave out
is what this process inherited), exported to the script's environment for the processes
it starts; a :class:`PlanReported` stop ends the script with exit code 0. It turns an
uncaught exception into ``MPI_Abort`` so that one failing rank ends the whole job with a
non-zero exit code instead of leaving the other ranks blocked in a collective.

Under the launcher (a status folder in ``DISTGRAPH_STATUS_DIR``, see
:mod:`distgraph.runtime.launch.status`) a supervisor forked first watches the rank
(:mod:`distgraph.runtime.launch.supervisor`), and MPI starts before the script does
(:func:`start_mpi`): ``MPI_Init`` returns only once every rank has called it, so started
at whatever point the script first imports mpi4py it would hold every rank for the
slowest, and for ever for a rank that ends before it gets there (its script returned, or
raised, first). Started here it is one known wait, which the launcher bounds
(:mod:`distgraph.runtime.launch.watch`). The rank writes ``<rank>.failed`` with its error,
``<rank>.done`` when the script returns or calls ``sys.exit(0)`` (saying which), and its
traceback goes to its log file only: the launcher prints the one-line causes. A non-zero
``sys.exit`` is a failure like an exception. A failing rank writes its line before
anything else and, before it aborts, gives the peers that are not waiting on it a moment
to write theirs (:func:`let_peers_report`), so that every rank that failed is listed.
"""

from __future__ import annotations

import os
import runpy
import sys
import time

from distgraph.errors import DistGraphError
from distgraph.runtime.launch.context import LaunchContext, PlanReported, opened
from distgraph.runtime.launch.progress import read_where
from distgraph.runtime.launch.status import log_path, status_folder, write_status


def _report(exc_type, exc, tb, previous) -> None:
    """The traceback: into the rank's log under the launcher, else as Python prints it."""
    logfile = log_path()
    if logfile is None:
        previous(exc_type, exc, tb)
        return
    import traceback
    with open(logfile, "a") as f:
        traceback.print_exception(exc_type, exc, tb, file=f)


def where_in_script(tb) -> str | None:
    """``file:line`` of the innermost frame of ``tb`` in the user's code (not distgraph's
    packages, Python's library or installed packages), or None."""
    import sysconfig

    skip = [os.path.dirname(m.__file__) + os.sep for m in
            (sys.modules.get(n) for n in ("distgraph", "distgraph.resources",
                                          "distgraph.passes", "distgraph.runtime"))
            if m is not None and getattr(m, "__file__", None)]
    skip += [sysconfig.get_paths()[k] + os.sep for k in ("stdlib", "platstdlib", "purelib",
                                                         "platlib")]
    found = None
    while tb is not None:
        name = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if not name.startswith("<") and not any(name.startswith(p) for p in skip):
            found = f"{name}:{tb.tb_lineno}"
        tb = tb.tb_next
    return found


def one_line(exc_type, exc, tb) -> str:
    """The error as the launcher shows it: ``Kind: message``; an error in the script's
    own terms (a mistyped keyword, any error not distgraph's) with the script's file
    and line at the end of its first line, which is otherwise only in the rank's log."""
    message = f"{exc_type.__name__}: {exc}"
    if issubclass(exc_type, DistGraphError) and not issubclass(exc_type, TypeError):
        return message
    where = where_in_script(tb)
    if where is None:
        return message
    first, sep, rest = message.partition("\n")
    return f"{first} ({where}){sep}{rest}"


ABORT_GRACE = 0.2    # seconds between the failure line and MPI_Abort under a plain mpiexec
PEER_GRACE = 3.0     # seconds a failing rank waits for peers failing too to say so (ranks
                     # start seconds apart on a busy machine; blocked peers are not waited for)
STUCK = 0.5          # seconds of waiting on a peer after which a peer counts as blocked


def let_peers_report(rank: int, size: int) -> None:
    """Under the launcher, before this rank's MPI_Abort ends the job: wait (at most
    PEER_GRACE) until each peer has reported how it ended or has waited on a peer for
    STUCK seconds. Ranks that reach the same error a little later (an error every rank
    raises) are then listed with it, not killed before they say so; a peer blocked in a
    collective is not waited for long."""
    folder = status_folder()
    if not folder:
        return
    deadline = time.monotonic() + PEER_GRACE
    peers = [r for r in range(size) if r != rank]
    while peers and time.monotonic() < deadline:
        peers = [r for r in peers if _may_report(read_where(folder, r))]
        if peers:
            time.sleep(0.01)


def _may_report(where) -> bool:
    """Whether a peer may still report: it runs, or its wait is a short one (ranks pass
    through waits all the time; one that waits for the failed rank waits on)."""
    return where.state in ("computing", "not started") or \
        (where.state == "waiting" and where.seconds < STUCK)


def install_abort_hook() -> None:
    """Make an uncaught exception print its traceback, name the rank, and abort the job.
    Installed once per process: by this bootstrap, and by every MPI communicator, so a
    script started with a plain ``mpiexec`` ends the same way instead of hanging. A
    script started as one plain process (``python script.py``, MPI's world of 1) has
    nobody to abort: a distgraph error is the one line it is under ``distgraph run``
    (``distgraph: PlanError: ...``), anything else Python's traceback."""
    previous = sys.excepthook
    if getattr(previous, "distgraph_abort", False):
        return

    def hook(exc_type, exc, tb):
        message = one_line(exc_type, exc, tb)        # its lines kept: the launcher indents them
        world = _running_world()
        if (world is None or world.Get_size() == 1) and log_path() is None:
            if issubclass(exc_type, DistGraphError):
                sys.stderr.write(f"distgraph: {message}\n")
            else:
                previous(exc_type, exc, tb)
            return
        # the one line first: the launcher's summary reads it, and MPI_Abort from a peer
        # that failed too may end this process at any moment after
        write_status("failed", message)
        _report(exc_type, exc, tb, previous)
        # after a wait past the timeout every peer has had that long to fail on its own
        abort_job(message, peers_may_report=not getattr(exc, "timed_out", False))

    hook.distgraph_abort = True
    sys.excepthook = hook


def _running_world():
    """MPI's world communicator if MPI runs in this process, else None. Never starts MPI:
    its start waits for every rank, and a rank that failed before it started MPI would
    wait there for ever."""
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
        return None
    return MPI.COMM_WORLD


def abort_job(message: str, code: int = 1, peers_may_report: bool = True) -> None:
    """After this rank's error is on record: abort the whole job with ``code``, once the
    peers failing too have said so (``peers_may_report``; False: at once). Returns where
    MPI does not run (the process then ends by itself, and the launcher stops the
    job)."""
    world = _running_world()
    if world is None or world.Get_size() == 1:
        return
    if peers_may_report:
        let_peers_report(world.Get_rank(), world.Get_size())
    logfile = log_path()
    if logfile is None:
        sys.stderr.write(f"distgraph: rank {world.Get_rank()} failed: {message}; "
                         "aborting the job\n")
        sys.stderr.flush()
        # MPI_Abort ends mpiexec's proxies too; give them a moment to forward this line
        # (without it the cause is sometimes lost)
        time.sleep(ABORT_GRACE)
    else:   # MPI's own abort notice goes with the traceback, not to the terminal
        _let_output_out()
        fd = os.open(logfile, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 2)
    _remove_job_files()
    world.Abort(code)


def _remove_job_files() -> None:
    """Before MPI_Abort: remove the files MPI made for the job on this host, which the
    abort leaves behind (hydra kills every rank, so none reaches the MPI_Finalize that
    removes the shared-memory segment, and its proxy, whose exit removes the topology
    file). Under a plain mpiexec nobody else would: this rank, its parent (hydra's
    proxy) and under the launcher its supervisor's parent hold them. The processes
    that map them keep their memory; the job is ending."""
    from distgraph.runtime.launch.hostside import held_by, parent_of, remove_files

    parent = os.getppid()
    remove_files(held_by("self") | held_by(parent) | held_by(parent_of(parent)))


def _let_output_out(limit: float = 1.0) -> None:
    """Wait (at most ``limit`` seconds) until this rank's supervisor has read what the
    rank printed: MPI_Abort gets the supervisors killed, and with them the last lines
    still in the pipes (the rank's last words before its error)."""
    import fcntl
    import struct
    import termios

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    end = time.monotonic() + limit
    for fd in (1, 2):
        while time.monotonic() < end:
            try:
                unread, = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))
            except OSError:
                break
            if unread == 0:
                break
            time.sleep(0.005)
    time.sleep(0.01)     # from the supervisor's read to its write: the same loop


def start_mpi() -> None:
    """Under the launcher, before the script runs: start MPI, saying so in
    ``<rank>.mpi`` (``starting``, then ``running``), and list in ``<rank>.files`` the
    files MPI made for the job, which a rank killed leaves behind
    (:mod:`~distgraph.runtime.launch.hostside`)."""
    if not status_folder():
        return
    write_status("mpi", "starting")
    from mpi4py import MPI  # noqa: F401  MPI_Init_thread: returns once every rank called it

    # hydra's proxy, this rank's supervisor's parent, holds the topology file it made
    # (read only under the launcher: a plain import of the communicator stays light)
    from distgraph.runtime.launch.hostside import held_by, parent_of
    proxy = parent_of(os.getppid())
    write_status("files", "\n".join(sorted(held_by("self") | held_by(proxy))))
    write_status("mpi", "running")


def _exited(stop: SystemExit) -> None:
    """The script called ``sys.exit``: code 0 (or None) is a finish, on record as such;
    any other code (a number, or a message that Python prints) fails the job as an
    uncaught exception does."""
    code = stop.code
    if code is None or code == 0:
        write_status("done", f"sys.exit({'' if code is None else 0})")
        return
    message = f"SystemExit: sys.exit({code!r})"
    write_status("failed", message)
    abort_job(message, code if isinstance(code, int) else 1)


def main(argv: list[str] | None = None) -> None:
    context, args = LaunchContext.parse(sys.argv[1:] if argv is None else argv,
                                        LaunchContext.inherited())
    if not args:
        sys.exit("usage: python -m distgraph.runtime.launch.bootstrap [--cluster FILE] "
                 "[--plan-out PATH] [--plan-plot PATH] [--plan-save PATH] [--plan-file PATH] "
                 "[--] script.py [args...]")
    # here, not above: the communicator imports this module's abort hook, not the watcher
    from distgraph.runtime.launch.supervisor import supervise_this_rank
    supervise_this_rank()
    install_abort_hook()
    start_mpi()
    sys.argv = args
    # as `python script.py` does: the script's folder comes first on the import path
    sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
    os.environ.update(context.environ())       # for the processes the script starts
    with opened(context):
        try:
            runpy.run_path(args[0], run_name="__main__")
        except PlanReported:       # distgraph plan has its report: the script ends here
            pass
        except SystemExit as stop:
            _exited(stop)
            raise
    write_status("done")


if __name__ == "__main__":
    main()
