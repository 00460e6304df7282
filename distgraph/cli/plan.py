"""``distgraph plan SCRIPT.py [--cluster FILE] [-n N] [--json] [-- ARGS]``: print the plan
a training script's Engine would use, without training.

How: the script runs as it would (``python SCRIPT.py ARGS``, one process) with
``$DISTGRAPH_PLAN_OUT`` set. The first ``Engine.fit`` / ``evaluate`` / ``predict`` of any
process of the script (a script that launches its ranks or its runs as child processes
included) plans its first batch, writes the report there and ends that process; the
command then stops the script and everything it started, and prints the report: the
processes and stages, per-op layouts summarised per layer, every reshard with its bytes,
the search's report under ``Strategy(auto_mode="full")``, and the predicted step time
(compute / communication / bubble) and peak memory per device. ``--json`` prints the
same as JSON (``Plan.to_dict()`` with the estimate and the layer summary). A script whose
Engine cannot plan (a ``PlanError`` such as stages that form a cycle) prints that error
and exits 1.

``--cluster FILE`` is exported as ``$DISTGRAPH_CLUSTER`` (the cluster the search plans
for when the Engine has none, and the one the estimate prices); ``-n N`` without a file
stands for ``Cluster.local(N)``. A plan whose processes the cluster cannot hold is
printed without an estimate.

Example::

    distgraph plan tutorials/02_spmd_gpt.py -n 4
    distgraph plan tutorials/01_serial_gpt.py -- --steps 10     # the script's own options
    distgraph plan tutorials/03_auto_parallel.py --cluster resources/clusters/local4.yaml --json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from distgraph.resources.cluster import Cluster

PLAN_OUT = "DISTGRAPH_PLAN_OUT"
GRACE = 10.0           # seconds a stopped script gets to clean up (emulated clusters do)


def _options(p) -> None:
    p.add_argument("--cluster", help="resource file the plan is made and priced for")
    p.add_argument("-n", "--nprocs", type=int, help="without --cluster: Cluster.local(N)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def add_plan_parser(commands) -> None:
    p = commands.add_parser("plan", help="print the plan a training script would use",
                            description=__doc__.splitlines()[0])
    _options(p)
    p.add_argument("script", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER,
                   help="options above, then -- and the script's arguments")
    p.set_defaults(func=_plan)


def _split(args):
    """The command's options may also follow the script; the script's own are the rest
    (after ``--`` when they share a name with the command's)."""
    rest = list(args.args)
    cut = rest.index("--") if "--" in rest else len(rest)
    after = argparse.ArgumentParser(prog="distgraph plan SCRIPT")
    _options(after)
    mine, theirs = after.parse_known_args(rest[:cut])
    for name in ("cluster", "nprocs", "json"):
        if getattr(mine, name):
            setattr(args, name, getattr(mine, name))
    args.args = theirs + rest[cut + 1:]
    return args


def _plan(args) -> int:
    args = _split(args)
    with tempfile.TemporaryDirectory(prefix="distgraph-plan-") as tmp:
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        out = os.path.join(tmp, "plan.json")
        env[PLAN_OUT] = out
        if args.cluster:
            env["DISTGRAPH_CLUSTER"] = os.path.abspath(args.cluster)
            Cluster.from_file(args.cluster)            # a bad file fails here, named
        elif args.nprocs:
            path = os.path.join(tmp, f"local{args.nprocs}.yaml")
            Cluster.local(args.nprocs).save(path)
            env["DISTGRAPH_CLUSTER"] = path
        log = os.path.join(tmp, "script.log")
        with open(log, "w") as sink:
            proc = subprocess.Popen([sys.executable, args.script, *args.args], env=env,
                                    stdout=sink, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            while not os.path.exists(out) and proc.poll() is None:
                time.sleep(0.05)
            _stop(proc)
        if not os.path.exists(out):
            with open(log) as f:
                tail = f.read()[-3000:]
            print(f"distgraph plan: {args.script} ended (exit code {proc.returncode}) "
                  "without planning a step: it must call Engine.fit, evaluate or predict. "
                  f"Its output:\n{tail}", file=sys.stderr)
            return 1
        with open(out) as f:
            data = json.load(f)
    if "error" in data:
        print(f"distgraph plan: {args.script} cannot be planned: {data['error']}",
              file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({k: v for k, v in data.items() if k != "text"}, indent=2))
    else:
        print(data["text"])
        if "estimate_error" in data:
            print(f"no estimate: {data['estimate_error']}")
    return 0


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
