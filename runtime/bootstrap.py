"""Per-rank entry point used by the launcher: ``python -m distgraph.runtime.bootstrap script.py args``.

It runs the script as ``__main__`` and turns an uncaught exception into ``MPI_Abort`` so
that one failing rank ends the whole job with a non-zero exit code instead of leaving the
other ranks blocked in a collective.
"""

from __future__ import annotations

import runpy
import sys


def install_abort_hook() -> None:
    """Make an uncaught exception print its traceback, name the rank, and abort the job."""
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        previous(exc_type, exc, tb)
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
    install_abort_hook()
    sys.argv = args
    runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
