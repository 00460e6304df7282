"""``distgraph run -n N [--cluster FILE] script.py [args]`` (also ``python -m distgraph.run``):
start N ranks of a script with the mpiexec that pip installs, one BLAS thread per rank.
Scripts also run under a user's own ``mpiexec -n N python script.py``."""

from __future__ import annotations

import argparse
import sys

from distgraph.runtime.launcher import launch


def add_run_parser(commands) -> None:
    p = commands.add_parser("run", help="start N ranks of a training script",
                            description=__doc__.splitlines()[0])
    _arguments(p)
    p.set_defaults(func=_run)


def _arguments(p) -> None:
    p.add_argument("-n", "--nprocs", type=int, required=True, help="number of ranks")
    p.add_argument("--cluster", help="resource file (exported to ranks as DISTGRAPH_CLUSTER)")
    p.add_argument("--emulate", metavar="FILE",
                   help="run on an emulated cluster: FILE's machines as network namespaces "
                        "with links shaped to its figures (root only; see runtime/emulate.py)")
    p.add_argument("--emulate-fault", action="append", default=[], metavar="SPEC",
                   help="with --emulate: a fault to inject, e.g. 'link node0-node1 down at 5s'")
    p.add_argument("script", help="the Python script to run on every rank")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")


def _run(args) -> int:
    if args.emulate or args.emulate_fault:
        from distgraph.runtime.emulate_launch import run_command
        return run_command(args)
    return launch(args.nprocs, [args.script, *args.args], cluster=args.cluster)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distgraph.run", description=__doc__)
    _arguments(parser)
    return _run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
