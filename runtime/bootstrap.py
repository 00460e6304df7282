"""Per-rank entry point used by the launcher: ``python -m distgraph.runtime.bootstrap script.py args``.

It runs the script as ``__main__`` and turns an uncaught exception into ``MPI_Abort`` so
that one failing rank ends the whole job with a non-zero exit code instead of leaving the
other ranks blocked in a collective. When the launcher gives a status folder
(``DISTGRAPH_STATUS_DIR``), each rank writes ``<rank>.failed`` with its error, or
``<rank>.done`` when the script returns; and a supervisor forked before MPI starts writes
``<rank>.exit`` when its rank ended otherwise (killed, crashed, ``os._exit``), so the
launcher can name a rank that died without a word.
"""

from __future__ import annotations

import os
import runpy
import sys

STATUS_DIR = "DISTGRAPH_STATUS_DIR"


def _rank() -> str:
    # Set by MPICH's launcher before the process starts; readable without MPI.
    return os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "?"))


def _write_status(kind: str, text: str = "") -> None:
    folder = os.environ.get(STATUS_DIR)
    if folder:
        with open(os.path.join(folder, f"{_rank()}.{kind}"), "w") as f:
            f.write(text)


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (prctl PR_SET_PDEATHSIG)."""
    import ctypes
    import signal
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)    # 1 = PR_SET_PDEATHSIG


def supervise_this_rank() -> None:
    """Fork: the child goes on to be the rank; this process waits for it, writes
    ``<rank>.exit`` with how it ended, and ends the same way. The launcher kills every
    supervisor as soon as one rank ends badly, so only the rank that ended on its own
    leaves a status (and the killed supervisors' children follow them)."""
    import signal
    folder = os.environ.get(STATUS_DIR)
    if not folder or not hasattr(os, "fork"):
        return
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        _die_with_parent()
        if os.getppid() != parent:       # the supervisor died before prctl took effect
            os._exit(1)
        return
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda signum, frame: os.kill(child, signum))
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):
        how, code = f"killed by signal {os.WTERMSIG(status)}", 128 + os.WTERMSIG(status)
    else:
        code = os.WEXITSTATUS(status)
        how = f"exited with code {code}"
    if not os.path.exists(os.path.join(folder, f"{_rank()}.done")):
        with open(os.path.join(folder, f"{_rank()}.exit"), "w") as f:
            f.write(how)
    os._exit(code)


def install_abort_hook() -> None:
    """Make an uncaught exception print its traceback, name the rank, and abort the job.
    Installed once per process: by this bootstrap, and by every MPI communicator, so a
    script started with a plain ``mpiexec`` ends the same way instead of hanging."""
    previous = sys.excepthook
    if getattr(previous, "distgraph_abort", False):
        return

    def hook(exc_type, exc, tb):
        previous(exc_type, exc, tb)
        _write_status("failed", f"{exc_type.__name__}: {exc}")
        from mpi4py import MPI
        if MPI.Is_initialized() and not MPI.Is_finalized():
            world = MPI.COMM_WORLD
            sys.stderr.write(f"distgraph: rank {world.Get_rank()} failed: "
                             f"{exc_type.__name__}: {exc}; aborting the job\n")
            sys.stderr.flush()
            world.Abort(1)

    hook.distgraph_abort = True
    sys.excepthook = hook


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        sys.exit("usage: python -m distgraph.runtime.bootstrap script.py [args...]")
    supervise_this_rank()
    install_abort_hook()
    sys.argv = args
    # as `python script.py` does: the script's folder comes first on the import path
    sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
    runpy.run_path(args[0], run_name="__main__")
    _write_status("done")


if __name__ == "__main__":
    main()
