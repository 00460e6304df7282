"""``distgraph plan SCRIPT.py [--cluster FILE] [-n N] [--full] [--json] [--plot PNG] [--save PATH]
[--report PAGE] [-- ARGS]``: print the plan a training script's Engine would use, without
training.

How: the script runs as it would (``python SCRIPT.py ARGS``, one process), through the
rank bootstrap with the request as its arguments (``--plan-out PATH``, ``--plan-plot``,
``--cluster``, ...: :mod:`distgraph.runtime.launch.context`). The first ``Engine.fit`` /
``evaluate`` / ``predict`` of any process of the script (a script that launches its ranks
or its runs as child processes included) plans its first batch, writes the report there
(:mod:`distgraph.app.plan_report`) and ends that process (``PlanReported``); the command
then stops the script and everything it started, and prints ``Plan.explain()``: whether
the plan fits its devices, per stage its mesh, devices, layout, layers and each group of
alike processes' peak memory and time, the predicted step time, TFLOP/s per device and
MFU, the reshards and the search summarised. ``--full`` prints the full listing instead
(``Plan.explain(full=True)``: every rank, reshard point with its bytes, parameter, the
schedule, each process's estimate, the search's report, per-op layouts summarised per
layer). ``--json`` prints the plan as JSON
(``Plan.to_dict()`` with the estimate and the layer summary); ``--plot PNG`` also draws
the plan (``Plan.plot``); ``--save PATH`` writes its plan file (``Plan.save``: the
decisions and what they were made for, :mod:`distgraph.plan.file`), which
``distgraph run -n N --plan PATH SCRIPT`` runs without searching again; ``--report PAGE``
writes the plan's page (``Plan.report``: one self-contained HTML file, with the estimate
the summary prints);
``--export torchtitan|megatron`` prints the plan as that
framework's configuration instead (``Plan.export``: torchtitan's ParallelismConfig fields
as JSON, Megatron-LM's arguments on one line; exit 1 saying why where it cannot run the
plan). With ``-n N``, a plan of another number of processes is an
error, and a one-process plan of an unannotated model a warning. A script whose Engine
cannot plan (a ``PlanError`` such as stages that form a cycle) prints that error and
exits 1.

``--cluster FILE`` is the launch context's cluster (the one the search plans for when
the Engine has none, and the one the estimate prices); ``-n N`` without a file stands
for ``Cluster.local(N)``. A plan whose processes the cluster cannot hold is
printed without an estimate.

Example::

    distgraph plan tutorials/02_spmd_gpt.py -n 4
    distgraph plan tutorials/02_spmd_gpt.py -n 4 --full         # every rank, reshard, ...
    distgraph plan tutorials/01_serial_gpt.py -- --steps 10     # the script's own options
    distgraph plan tutorials/03_auto_parallel.py --cluster resources/clusters/local4.yaml --json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time

from distgraph.errors import DistGraphError

GRACE = 10.0           # seconds a stopped script gets to clean up (emulated clusters do)
USAGE = ("distgraph plan [-h] [--cluster FILE] [-n N] [--full] [--json] [--plot PNG] "
         "[--save PATH] [--report PAGE] [--export torchtitan|megatron] SCRIPT [options above] "
         "[ARGS] [-- ARGS]")
DESCRIPTION = """\
Print the plan a training script's Engine would use, without training: whether it fits
its devices, per stage its devices, layout, layers and each group of alike processes' peak
memory and time, the predicted step time, TFLOP/s per device and MFU (--full: every rank,
reshard and parameter, the schedule, each process's estimate). The script runs as one
plain process until its first Engine.fit, evaluate or predict has planned a batch."""
EPILOG = """\
The script's own arguments follow the script (after -- where they share a name with the
options above). -n N prices the plan on this machine as N processes and says when the plan
needs another number; --cluster FILE plans and prices it for FILE's machines.

Examples:
  distgraph plan tutorials/02_spmd_gpt.py -n 4
  distgraph plan tutorials/02_spmd_gpt.py -n 4 --full
  distgraph plan tutorials/02_spmd_gpt.py -n 4 --plot plan.png
  distgraph plan tutorials/02_spmd_gpt.py -n 4 --report plan.html
  distgraph plan tutorials/03_auto_parallel.py -n 4 --save gpt.plan.json
  distgraph plan tutorials/03_auto_parallel.py -n 4 --export megatron -- --target megatron
  distgraph plan tutorials/01_serial_gpt.py -- --steps 10
  distgraph plan tutorials/03_auto_parallel.py --cluster resources/clusters/local4.yaml --json
"""


def _options(p) -> None:
    p.add_argument("--cluster", help="resource file the plan is made and priced for")
    p.add_argument("-n", "--nprocs", type=int, help="without --cluster: Cluster.local(N)")
    p.add_argument("--full", action="store_true", help="print the full listing: every rank, "
                   "reshard and parameter, the schedule, each process's estimate")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--plot", metavar="PNG", help="also draw the plan into PNG (or .svg, .pdf): "
                   "stages, layers, weight splits, reshards; needs matplotlib")
    p.add_argument("--save", metavar="PATH", help="also write the plan file (Plan.save) that "
                   "`distgraph run --plan PATH` runs without searching again")
    p.add_argument("--report", metavar="PAGE", help="also write the plan's page (Plan.report):"
                   " one HTML file a browser opens from disk, with the cluster, the schedule"
                   " as a timeline, memory and time per stage")
    p.add_argument("--export", choices=("torchtitan", "megatron"),
                   help="print the plan as that framework's configuration instead: "
                        "torchtitan's ParallelismConfig fields (JSON), Megatron-LM's "
                        "arguments (one line)")


def add_plan_parser(commands) -> None:
    p = commands.add_parser("plan", help="print the plan a training script would use",
                            description=DESCRIPTION, epilog=EPILOG, usage=USAGE,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    _options(p)
    # one positional that keeps every word, "--" included: a plain "script" positional
    # would swallow a "--" right after the script, and the script's own options after it
    # (``SCRIPT -- --nprocs 4``) would be read as the command's
    p.add_argument("script", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS]",
                   help="the training script, then options above, then -- and the "
                        "script's arguments")
    p.set_defaults(func=_plan)


def _split(args):
    """``args.script`` (every word from the script on) as the script, the command's
    options that follow it, and the script's own arguments: the rest, and all after
    ``--`` (there when they share a name with the command's)."""
    words = list(args.script)
    if words[:1] == ["--"]:
        words = words[1:]
    if not words:
        raise DistGraphError("give the training script: distgraph plan SCRIPT.py [-n N] "
                             "[-- ARGS]")
    args.script, rest = words[0], words[1:]
    cut = rest.index("--") if "--" in rest else len(rest)
    # no abbreviations: a script's --nproc or --js is the script's, not -n or --json
    after = argparse.ArgumentParser(prog="distgraph plan SCRIPT", allow_abbrev=False)
    _options(after)
    mine, theirs = after.parse_known_args(rest[:cut])
    for name in ("cluster", "nprocs", "full", "json", "plot", "save", "report", "export"):
        if getattr(mine, name):
            setattr(args, name, getattr(mine, name))
    args.args = theirs + rest[cut + 1:]
    return args


def _plan(args) -> int:
    # here, not above: ``distgraph run`` builds this parser too and needs neither
    from distgraph.resources.cluster import Cluster
    from distgraph.runtime.launch.context import LaunchContext, PlanRequest

    try:
        args = _split(args)
        if args.cluster:
            Cluster.from_file(args.cluster)            # a bad file fails here, named
        if args.nprocs is not None and args.nprocs < 1:
            raise DistGraphError(f"-n {args.nprocs}: give a number of processes >= 1")
        if not os.path.isfile(args.script):
            raise DistGraphError(f"{args.script}: no such file")
    except DistGraphError as err:
        print(f"distgraph plan: {err}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="distgraph-plan-") as tmp:
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        out = os.path.join(tmp, "plan.json")
        cluster = args.cluster
        if not cluster and args.nprocs:
            cluster = os.path.join(tmp, f"local{args.nprocs}.yaml")
            Cluster.local(args.nprocs).save(cluster)
        save = os.path.abspath(args.save) if args.save else None
        page = os.path.abspath(args.report) if args.report else None
        context = LaunchContext(cluster, PlanRequest(out, args.plot, save, page=page))
        data, code, tail = script_report([args.script, *args.args], context, env, tmp)
        if data is None:
            print(f"distgraph plan: {args.script} ended (exit code {code}) "
                  "without planning a step: it must call Engine.fit, evaluate or predict. "
                  f"Its output:\n{tail}", file=sys.stderr)
            return 1
    # -n N alone stands for N devices: a plan of more processes than that says which -n
    mismatch = _process_count(data, args) if "processes" in data and not (
        "error" in data and args.cluster) else ""
    if "error" in data and not mismatch:
        print(f"distgraph plan: {args.script} cannot be planned: {data['error']}",
              file=sys.stderr)
        return 1
    if mismatch and data.get("distributed", True):
        print(f"distgraph plan: {mismatch}", file=sys.stderr)
        return 1
    if args.export:
        exported = data["export"][args.export]
        if isinstance(exported, dict) and "error" in exported:
            print(f"distgraph plan: {exported['error']}", file=sys.stderr)
            return 1
        print(shlex.join(exported) if isinstance(exported, list) else
              json.dumps(exported, indent=2))
    elif args.json:
        print(json.dumps({k: v for k, v in data.items() if k not in ("text", "full_text")},
                         indent=2))
    else:
        print(data["full_text"] if args.full else data["text"])
        if "estimate_error" in data:
            print(f"no estimate: {data['estimate_error']}")
    if "plot_error" in data:
        print(f"distgraph plan: no picture: {data['plot_error']}", file=sys.stderr)
        return 1
    if args.plot and not args.json:
        print(f"wrote {args.plot}")
    if "save_error" in data:
        print(f"distgraph plan: no plan file: {data['save_error']}", file=sys.stderr)
        return 1
    if "saved" in data and not args.json:
        print(f"wrote plan file {args.save} ({data['saved']['bytes']:,} bytes)")
    if "page_error" in data:
        print(f"distgraph plan: no page: {data['page_error']}", file=sys.stderr)
        return 1
    if "page" in data and not args.json:
        print(f"wrote the plan's page {args.report} ({data['page']['bytes']:,} bytes)")
    if mismatch:
        print(f"distgraph plan: warning: {mismatch}", file=sys.stderr)
    return 0


def script_report(argv: list, context, env: dict, tmp: str) -> tuple:
    """Run ``argv`` (a script and its arguments) as one process under ``context`` (whose
    request writes its report to ``context.plan.out``) until the report is there, then
    stop it and everything it started: (the report, or None; the exit code; the tail of
    its output). ``tmp``: a folder for its log."""
    out = context.plan.out
    log = os.path.join(tmp, "script.log")
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "distgraph.runtime.launch.bootstrap",
                                 *context.argv(), "--", *argv], env=env, stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)
        while not os.path.exists(out) and proc.poll() is None:
            time.sleep(0.05)
        _stop(proc)
    if not os.path.exists(out):
        with open(log) as f:
            return None, proc.returncode, f.read()[-3000:]
    with open(out) as f:
        return json.load(f), proc.returncode, ""


def _process_count(data: dict, args) -> str:
    """What to say when the plan's processes are not the ``-n`` asked for ("" when they
    are, or when no -n was given)."""
    n, have = args.nprocs, len(data["processes"])
    if not n or n == have:
        return ""
    if not data.get("distributed", True):
        return (f"the model has no annotation, so under `distgraph run -n {n}` each of the "
                f"{n} ranks would train on the whole batch (the same work {n} times); split "
                "the batch with dg.shard_dataloader(dataset, mesh, shard_dims=\"dp\") or "
                "annotate the model with dg.shard_tensor")
    command = shlex.join([args.script, *args.args])
    return (f"this plan needs {have} processes (process ids {data['processes']}) but -n {n} "
            f"was given; plan it with -n {have} and launch it with `distgraph run -n {have} "
            f"{command}`")


def _stop(proc) -> None:
    """End the script and everything it started (its session): SIGTERM, then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, GRACE), (signal.SIGKILL, GRACE)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    proc.wait()
