"""The ``distgraph cluster`` commands: ``show FILE`` and ``calibrate -n N -o FILE`` (on this
host, on the hosts of ``--hostfile FILE`` / ``--hosts LIST``, or emulated with ``--emulate``).

``add_cluster_parser(subparsers)`` registers them on an argparse subparsers object; each
parser sets ``func`` to a handler taking the parsed args and returning an exit code::

    parser = argparse.ArgumentParser(prog="distgraph")
    add_cluster_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["cluster", "show", "resources/clusters/gpu_2x8.yaml"])
    raise SystemExit(args.func(args))
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

from distgraph.errors import DistGraphError

# The handlers import what they run: the ``distgraph`` command builds every subcommand's
# parser, and ``distgraph run`` should not pay for resource files and calibration.


def add_cluster_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``cluster show`` and ``cluster calibrate`` to ``subparsers``; returns the parser."""
    parser = subparsers.add_parser("cluster", help="inspect or measure resource files",
                                   description="Inspect or measure resource files.")
    commands = parser.add_subparsers(dest="cluster_command", required=True)
    show = commands.add_parser("show", help="print a resource file's machines, meshes, links",
                               description="Print a resource file's machines, devices, "
                               "device meshes and links, as distgraph reads it.")
    show.add_argument("file", help="a .yaml or .json resource file (distgraph or Paddle format)")
    show.set_defaults(func=show_command)
    cal = commands.add_parser(
        "calibrate", help="measure N MPI ranks here, write a resource file",
        description="Measure this machine with N MPI ranks and write a resource file: each "
        "rank's GEMM rate, the links between ranks (one pair at a time while the others "
        "sleep), and what the cost model charges per op type and per reshard step. Each "
        "figure is printed as it comes; the file is written at the end.",
        epilog="Example: distgraph cluster calibrate -n 4 -o here.yaml (or --local: this "
        "machine, kept for Cluster.local(4) and distgraph run -n 4)")
    cal.add_argument("-n", "--nprocs", type=int, required=True, help="number of MPI ranks")
    cal.add_argument("-o", "--output", help="file to write (.yaml or .json)")
    cal.add_argument("--local", action="store_true",
                     help="measure this machine for N ranks into the file Cluster.local(N) "
                          "and distgraph run without --cluster use (kept under "
                          "$DISTGRAPH_CACHE_DIR, default ~/.cache/distgraph), instead of -o")
    cal.add_argument("--repeats", type=int, default=3, help="measurement batches (default 3)")
    cal.add_argument("--timeout", type=float, default=300.0,
                     help="seconds before the measurement is abandoned (default 300)")
    cal.add_argument("--device", choices=("auto", "CPU", "GPU"), default="auto",
                     help="what each rank measures: its GPU (GEMM rate per dtype, memory "
                          "bandwidth, op costs on CuPy) or the CPU; auto (default): the GPUs "
                          "when CuPy finds one")
    cal.add_argument("--emulate", metavar="FILE",
                     help="measure FILE's machines emulated as network namespaces (root only); "
                          "the output keeps FILE's machines and device ids")
    cal.add_argument("--hostfile", metavar="FILE",
                     help="measure ranks on the hosts of this MPICH host file (as distgraph run)")
    cal.add_argument("--hosts", metavar="LIST",
                     help="measure ranks on these hosts, e.g. node0:2,node1:2")
    cal.set_defaults(func=calibrate_command)
    return parser


def show_command(args) -> int:
    from distgraph.resources.cluster import Cluster

    try:
        cluster = Cluster.from_file(args.file)
    except DistGraphError as err:
        print(f"distgraph cluster show: {err}", file=sys.stderr)
        return 1
    print(cluster.describe())
    return 0


def calibrate_command(args) -> int:
    from distgraph.resources.cluster import Cluster
    from distgraph.runtime.launch.hosts import assign_hosts
    from distgraph.runtime.launch.launcher import TIMED_OUT, launch
    from distgraph.runtime.launch.remote import is_local
    from distgraph.tools.calibrate import SCRIPT as CALIBRATE_SCRIPT
    from distgraph.tools.emulated import calibrate_command_emulated

    if args.local == bool(args.output):
        print("distgraph cluster calibrate: give -o FILE (a resource file to write) or "
              "--local (this machine, kept for Cluster.local and distgraph run), one of "
              "them", file=sys.stderr)
        return 2
    if args.local:
        if args.emulate or args.hostfile or args.hosts:
            print("distgraph cluster calibrate: --local measures this machine; give it no "
                  "--emulate, --hostfile or --hosts", file=sys.stderr)
            return 2
        from distgraph.tools.local_calibration import calibrated_local

        try:
            path = calibrated_local(args.nprocs, recalibrate=True)
        except DistGraphError as err:
            print(f"distgraph cluster calibrate: {err}", file=sys.stderr)
            return 1
        print(f"wrote {path} (what Cluster.local({args.nprocs}) and distgraph run -n "
              f"{args.nprocs} without --cluster use)")
        print(Cluster.from_file(path).describe())
        return 0
    output = os.path.abspath(args.output)
    if not output.lower().endswith((".yaml", ".yml", ".json")):
        print(f"distgraph cluster calibrate: {args.output}: expected a name ending in .yaml, "
              ".yml or .json", file=sys.stderr)
        return 2
    if args.emulate:
        if args.device == "GPU":
            print("distgraph cluster calibrate: --emulate measures CPU ranks in network "
                  "namespaces; give it no --device GPU", file=sys.stderr)
            return 2
        if args.hostfile or args.hosts:
            print("distgraph cluster calibrate: --emulate measures this machine's namespaces; "
                  "give it no --hostfile or --hosts", file=sys.stderr)
            return 2
        return calibrate_command_emulated(args)
    try:
        assignment = assign_hosts(args.nprocs, args.hostfile, args.hosts, env=os.environ)
        if assignment is not None and all(map(is_local, assignment.distinct_hosts)):
            assignment = None
        if assignment is None:
            code = launch(args.nprocs, [CALIBRATE_SCRIPT, "-o", output, "--repeats",
                                        str(args.repeats), "--device", args.device],
                          timeout=args.timeout)
        else:
            code = _calibrate_hosts(args, assignment, output)
    except DistGraphError as err:
        print(f"distgraph cluster calibrate: {err}", file=sys.stderr)
        return 2
    if code == TIMED_OUT:
        print(f"distgraph cluster calibrate: the {args.nprocs} ranks did not finish within "
              f"{args.timeout:g} s; try fewer ranks or a larger --timeout", file=sys.stderr)
        return 1
    if code != 0:
        print(f"distgraph cluster calibrate: the measuring ranks failed (exit code {code})",
              file=sys.stderr)
        return code
    try:
        cluster = Cluster.from_file(output)
    except DistGraphError as err:
        print(f"distgraph cluster calibrate: wrote an unreadable file: {err}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}")
    print(cluster.describe())
    return 0


def _calibrate_hosts(args, assignment, output: str) -> int:
    """Measure on the assignment's hosts: rank 0 (on some host) writes the file into its
    log folder, which the launcher brings back here; it then goes to ``output``. The
    logs stay (and the failure report names them) when the ranks fail."""
    from distgraph.runtime.launch.launcher import launch
    from distgraph.tools.calibrate import SCRIPT as CALIBRATE_SCRIPT

    logs = tempfile.mkdtemp(prefix="distgraph-calibrate-")
    name = os.path.basename(output)
    code = 2
    try:
        code = launch(args.nprocs, [CALIBRATE_SCRIPT, "-o", name, "--in-log-dir", "--repeats",
                                    str(args.repeats), "--device", args.device],
                      timeout=args.timeout, log_dir=logs, assignment=assignment)
        if code == 0:
            shutil.move(os.path.join(logs, name), output)
        return code
    finally:
        if code == 0 or not os.listdir(logs):
            shutil.rmtree(logs, ignore_errors=True)
