"""The ``distgraph`` console script: ``distgraph run ...``, ``distgraph plan ...`` and
``distgraph cluster ...``.

Each subcommand's parser sets ``func``, a handler that takes the parsed args and returns
the exit code.
"""

from __future__ import annotations

from distgraph.cli.cluster import add_cluster_parser
from distgraph.cli.plan import add_plan_parser
from distgraph.cli.run import OneLineParser, add_run_parser
from distgraph.version import __version__


def main(argv=None) -> int:
    parser = OneLineParser(prog="distgraph", description="distgraph command line: run a "
                           "training script on N ranks, print its plan, inspect or measure "
                           "resource files")
    parser.add_argument("--version", action="version", version=f"distgraph {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    add_run_parser(commands)
    add_plan_parser(commands)
    add_cluster_parser(commands)
    args = parser.parse_args(argv)
    return args.func(args)
