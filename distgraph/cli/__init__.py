"""The ``distgraph`` console script: ``distgraph run ...``, ``distgraph plan ...`` and
``distgraph cluster ...``.

Each subcommand's parser sets ``func``, a handler that takes the parsed args and returns
the exit code.
"""

from __future__ import annotations

import argparse

from distgraph.cli.cluster import add_cluster_parser
from distgraph.cli.plan import add_plan_parser
from distgraph.cli.run import OneLineParser, add_run_parser


class VersionAction(argparse.Action):
    """``--version``: reads the installed version only when asked (importlib.metadata
    is a tenth of a second of every other command's start)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help="show distgraph's version and exit"):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from distgraph.version import __version__

        print(f"distgraph {__version__}")       # on stdout, as argparse's own action
        parser.exit()


def main(argv=None) -> int:
    parser = OneLineParser(prog="distgraph", description="distgraph command line: run a "
                           "training script on N ranks, print its plan, inspect or measure "
                           "resource files")
    parser.add_argument("--version", action=VersionAction)
    commands = parser.add_subparsers(dest="command", required=True)
    add_run_parser(commands)
    add_plan_parser(commands)
    add_cluster_parser(commands)
    args = parser.parse_args(argv)
    return args.func(args)
