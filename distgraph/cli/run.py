"""distgraph run -n N [--cluster FILE] [--log-dir DIR] script.py [args]: start N ranks of a
script with the mpiexec that pip installs, one BLAS thread per rank (also
``python -m distgraph.cli run``). Scripts also run under a plain ``mpiexec -n N python script.py``.
"""

from __future__ import annotations

import argparse
import sys

from distgraph.errors import DistGraphError
from distgraph.runtime.emulate.launch import run_command
from distgraph.runtime.launch.launcher import launch

DESCRIPTION = "Start N ranks of a training script with the mpiexec that pip installs."
EPILOG = """\
Every rank gets one BLAS thread unless OMP_NUM_THREADS (or OPENBLAS/MKL_NUM_THREADS) is set.
Each rank's output is shown and also written to DIR/rank-<r>.log; without --log-dir, DIR
is a temporary folder, kept and named only when the job fails. When a rank fails, the
terminal shows one line per cause; the tracebacks are in the logs.

With --cluster FILE the file is validated before any rank starts, and an Engine created
without a cluster uses it (its devices, in order, are ranks 0..N-1).

SIGTERM, SIGHUP or SIGINT (Ctrl-C) stop the whole job, mpiexec and every rank, and exit
with 128 + the signal number.

Example:
  distgraph run -n 4 tutorials/02_spmd_gpt.py --steps 40
  distgraph run -n 4 --cluster resources/clusters/local4.yaml --log-dir logs train.py
"""


class OneLineParser(argparse.ArgumentParser):
    """An argument error is one line (``PROG: error: ...``), exit code 2, no usage dump."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_run_parser(commands) -> None:
    p = commands.add_parser("run", help="start N ranks of a training script",
                            description=DESCRIPTION, epilog=EPILOG,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    _arguments(p)
    p.set_defaults(func=_run)


def _arguments(p) -> None:
    p.add_argument("-n", "--nprocs", type=int, required=True, help="number of ranks")
    p.add_argument("--cluster", metavar="FILE",
                   help="resource file for the Engine (validated before the ranks start)")
    p.add_argument("--log-dir", metavar="DIR",
                   help="folder for the per-rank logs rank-<r>.log (default: a temporary one)")
    p.add_argument("--emulate", metavar="FILE",
                   help="run on an emulated cluster: FILE's machines as network namespaces "
                        "with links shaped to its figures (root only; the README's "
                        "'Emulated clusters' says more)")
    p.add_argument("--emulate-fault", action="append", default=[], metavar="SPEC",
                   help="with --emulate: a fault to inject, e.g. 'link node0-node1 down at 5s'")
    p.add_argument("script", help="the Python script to run on every rank")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")


def _run(args) -> int:
    try:
        if args.emulate or args.emulate_fault:
            return run_command(args)
        return launch(args.nprocs, [args.script, *args.args], cluster=args.cluster,
                      log_dir=args.log_dir)
    except DistGraphError as err:
        print(f"distgraph run: {err}", file=sys.stderr)
        return 2

