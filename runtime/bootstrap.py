"""Per-rank entry point used by the launcher: ``python -m distgraph.runtime.bootstrap script.py args``.

It runs the script as ``__main__`` and turns an uncaught exception into ``MPI_Abort`` so
that one failing rank ends the whole job with a non-zero exit code instead of leaving the
other ranks blocked in a collective. When the launcher gives a status folder
(``DISTGRAPH_STATUS_DIR``), each rank writes ``<rank>.failed`` with its error, or
``<rank>.done`` when the script returns; and a watcher process forked before MPI starts
writes ``<rank>.ended`` (a timestamp) the moment its rank's process is gone, however it
ended. The rank that ended first without a word is the one that died.
"""

from __future__ import annotations

import os
import runpy
import sys
import time

STATUS_DIR = "DISTGRAPH_STATUS_DIR"


def _rank() -> str:
    # Set by MPICH's launcher before the process starts; readable without MPI.
    return os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "?"))


def _write_status(kind: str, text: str = "") -> None:
    folder = os.environ.get(STATUS_DIR)
    if folder:
        with open(os.path.join(folder, f"{_rank()}.{kind}"), "w") as f:
            f.write(text)


def watch_this_rank() -> None:
    """Fork a watcher that records when this process ends (a pipe's far end closes)."""
    folder = os.environ.get(STATUS_DIR)
    if not folder:
        return
    read_end, write_end = os.pipe()
    if os.fork() == 0:
        os.close(write_end)
        os.setsid()                       # outlive the rank's process group
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):              # never hold the launcher's pipes open
            os.dup2(null, fd)
        os.dup2(read_end, 3)              # nor MPI's process-manager socket
        os.closerange(4, os.sysconf("SC_OPEN_MAX"))
        os.read(3, 1)                     # returns at EOF: the rank is gone
        with open(os.path.join(folder, f"{_rank()}.ended"), "w") as f:
            f.write(repr(time.time()))
        os._exit(0)
    os.close(read_end)                    # the rank keeps write_end open until it ends


def install_abort_hook() -> None:
    """Make an uncaught exception print its traceback, name the rank, and abort the job."""
    previous = sys.excepthook

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

    sys.excepthook = hook


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        sys.exit("usage: python -m distgraph.runtime.bootstrap script.py [args...]")
    watch_this_rank()
    install_abort_hook()
    sys.argv = args
    # as `python script.py` does: the script's folder comes first on the import path
    sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
    runpy.run_path(args[0], run_name="__main__")
    _write_status("done")


if __name__ == "__main__":
    main()
