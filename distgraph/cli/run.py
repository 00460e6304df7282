"""distgraph run -n N [--hostfile FILE | --hosts LIST] [--cluster FILE | --recalibrate]
[--plan PATH] [--dry-run]
[--report PAGE] [--log-dir DIR] [--elastic [--max-restarts N] [--min-ranks K]] script.py
[args]: start N ranks of a script with the mpiexec that pip installs, one BLAS thread per
rank, on this host or on several (also ``python -m distgraph.cli run``). Scripts also run
under a plain ``mpiexec -n N python script.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile

from distgraph.errors import DistGraphError
from distgraph.runtime.launch import slurm
from distgraph.runtime.launch.context import current, opened
from distgraph.runtime.launch.hosts import assign_hosts
from distgraph.runtime.launch.launcher import check_launch, launch
from distgraph.runtime.launch.remote import is_local

DESCRIPTION = "Start N ranks of a training script with the mpiexec that pip installs."
EPILOG = """\
Every rank gets one BLAS thread unless OMP_NUM_THREADS (or OPENBLAS/MKL_NUM_THREADS) is set.
Each rank's output is shown and also written to DIR/rank-<r>.log; without --log-dir, DIR
is a temporary folder, kept and named only when the job fails. When a rank fails, the
terminal shows one line per cause; the tracebacks are in the logs. A job succeeds only
when every rank finishes its script: a rank that ends while the others still need it
(sys.exit, os._exit, killed) or waits for MPI's start longer than DISTGRAPH_COMM_TIMEOUT
ends the job within seconds, named; nothing of MPI's is left in /dev/shm or /tmp.

With --cluster FILE the file is validated before any rank starts, and an Engine created
without a cluster uses it (its devices, in order, are ranks 0..N-1). Without it (and
without --plan or other hosts) the job runs on this machine as measured for N ranks: the
first such run measures it (distgraph cluster calibrate's figures, a few tens of
seconds) and keeps the file under $DISTGRAPH_CACHE_DIR (default ~/.cache/distgraph),
keyed by host, distgraph version and N; --recalibrate measures it again, and
DISTGRAPH_CALIBRATE=never runs on default figures instead.

With --plan PATH (a plan file: plan.save(PATH), distgraph plan SCRIPT --save PATH) an
Engine created without a plan runs PATH's plan, made again without any search. Before any
rank starts the file is read and checked whole (its format version, that it is complete
and consistent), checked to have been made for N processes and, with --cluster, for
FILE's cluster, and then for the script's program: the script runs once as one process
until its Engine builds the training program, which is checked against the file and its
plan made from it (without search, compiling no rank's program), and the script stopped.

With --report PAGE rank 0 writes its training plan's page there (Plan.report: one HTML
file a browser opens from disk) once the Engine has planned, before the first step; with
Strategy(profile=True) it writes it again after each fit, with the run's measured timeline.

Several machines: --hostfile FILE (MPICH's host file, one host[:slots] per line) or
--hosts a:2,b:2 puts the ranks on those hosts, slots filled in order; without either, a
--cluster FILE whose machines are other hosts puts rank r on the machine of the file's
r-th device (at its addr, else its hostname), and $HYDRA_HOST_FILE is read last. hydra
starts the ranks over ssh (HYDRA_LAUNCHER, HYDRA_LAUNCHER_EXEC apply). Before any rank
starts, every host must answer over ssh in batch mode with the same Python and distgraph
at the same paths; after the job its logs come back to DIR. --dry-run prints which rank
goes to which host (and device) and starts nothing.

Slurm: inside an allocation (salloc, sbatch, a one-task srun) the ranks go on its nodes,
as many per node as it has tasks there, and -n defaults to its tasks; hydra starts them
through srun (docs/machines.md's "Slurm").

Elastic (--elastic, with --emulate, --hostfile, --hosts or in a Slurm allocation): when a
rank dies or a machine stops answering (or Slurm drains its node), the job's ranks are
ended, the machines that do not answer dropped and the script started again on the ranks
left (--max-restarts N, --min-ranks K); the script sees its new world in
engine.world_size, and ModelCheckpoint resumes from its newest complete checkpoint
(docs/machines.md's "Elastic training").

Everything after the script is the script's, exactly as after `python script.py`: a --
there reaches the script too (distgraph's own options go before the script; a -- before
the script ends them).

SIGTERM, SIGHUP or SIGINT (Ctrl-C) stop the whole job, mpiexec and every rank, and exit
with 128 + the signal number.

Example:
  distgraph run -n 4 tutorials/02_spmd_gpt.py --steps 40
  distgraph run -n 4 --cluster resources/clusters/local4.yaml --log-dir logs train.py
  distgraph run -n 4 --hosts node0:2,node1:2 train.py
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
    p.add_argument("-n", "--nprocs", type=int, default=None,
                   help="number of ranks (inside a Slurm allocation: its tasks by default)")
    p.add_argument("--cluster", metavar="FILE",
                   help="resource file for the Engine (validated before the ranks start)")
    p.add_argument("--recalibrate", action="store_true",
                   help="without --cluster: measure this machine again (the kept "
                        "measurement of it for N ranks is replaced)")
    p.add_argument("--plan", metavar="PATH",
                   help="plan file the Engine runs without searching (checked before the "
                        "ranks start)")
    p.add_argument("--report", metavar="PAGE",
                   help="rank 0 writes its training plan's page (Plan.report) to PAGE before "
                        "training")
    p.add_argument("--hostfile", metavar="FILE",
                   help="run the ranks on the hosts of this MPICH host file (host[:slots] "
                        "per line)")
    p.add_argument("--hosts", metavar="LIST",
                   help="run the ranks on these hosts, e.g. node0:2,node1:2")
    p.add_argument("--dry-run", action="store_true",
                   help="print which rank goes to which host (and device); start nothing")
    p.add_argument("--log-dir", metavar="DIR",
                   help="folder for the per-rank logs rank-<r>.log (default: a temporary one)")
    p.add_argument("--emulate", metavar="FILE",
                   help="run on an emulated cluster: FILE's machines as network namespaces "
                        "with links shaped to its figures (root only; docs/machines.md's "
                        "'Emulated clusters' says more)")
    p.add_argument("--emulate-fault", action="append", default=[], metavar="SPEC",
                   help="with --emulate: a fault to inject, e.g. 'link node0-node1 down at 5s'")
    p.add_argument("--elastic", action="store_true",
                   help="with --emulate, --hostfile, --hosts or in a Slurm allocation: when a "
                        "rank dies or a machine stops answering, end the job's ranks, drop the "
                        "machines that do not answer and start the script again on the ranks "
                        "left (docs/machines.md's 'Elastic training')")
    p.add_argument("--max-restarts", type=int, default=None, metavar="N",
                   help="with --elastic: restarts at most (default 3)")
    p.add_argument("--min-ranks", type=int, default=None, metavar="K",
                   help="with --elastic: stop when fewer ranks are left (default 1)")
    p.add_argument("--max-ranks", type=int, default=None, metavar="M",
                   help="with --elastic: grow back to at most M ranks (and -n) "
                        "when a lost machine answers again, from the next checkpoint on "
                        "(default: never grow)")
    # one positional that keeps every word, "--" included (a plain "script" positional
    # would swallow a "--" right after it): the script's words reach it verbatim
    p.add_argument("script", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS]",
                   help="the Python script to run on every rank, then its arguments, "
                        "exactly as after `python SCRIPT` (a -- among them included)")


def script_words(args):
    """``args.script`` (every word from the script on) split into the script and its
    arguments. A ``--`` before the script ends distgraph's options and is distgraph's;
    every word after the script is the script's, ``--`` included, as ``python SCRIPT
    ARGS`` gives them (``distgraph plan`` reads its own options after the script up to a
    ``--``, since it takes options there; ``run`` takes none there)."""
    words = list(args.script)
    if words[:1] == ["--"]:
        words = words[1:]
    if not words:
        raise DistGraphError("give the script to run: distgraph run -n N SCRIPT.py [ARGS]")
    args.script, args.args = words[0], words[1:]
    return args


def _run(args) -> int:
    if args.report:        # what the ranks' Engines read (the launch context), in every launch
        folder = os.path.dirname(os.path.abspath(args.report))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            print(f"distgraph run: --report {args.report}: {folder} is not a folder this "
                  "user can write; give a page path in one", file=sys.stderr)
            return 2
        page = os.path.abspath(args.report)
        with opened(dataclasses.replace(current(), report=page)):
            return _launched(args)
    return _launched(args)


def _launched(args) -> int:
    try:
        args = script_words(args)
        allocation = slurm.allocation_from_env(os.environ)
        args.nprocs = slurm.ranks(args.nprocs, allocation)
        if args.plan and (args.elastic or args.emulate):
            raise DistGraphError("--plan runs a plan file made for -n processes on a plain "
                                 "launch; an elastic or emulated job (--elastic, --emulate) "
                                 "plans for the ranks it has: leave --plan out")
        if args.elastic:
            return _run_elastic(args, allocation)
        given = [f"--{name.replace('_', '-')}" for name in ELASTIC_ONLY
                 if getattr(args, name) is not None]
        if given:
            raise DistGraphError(f"{', '.join(given)} only bend an elastic job: add "
                                 "--elastic (with --emulate, --hostfile or --hosts), or "
                                 "leave them out")
        if args.emulate or args.emulate_fault:
            if args.hostfile or args.hosts or args.dry_run:
                print("distgraph run: --emulate runs every rank on this machine's network "
                      "namespaces; it takes no --hostfile, --hosts or --dry-run",
                      file=sys.stderr)
                return 2
            from distgraph.runtime.emulate.launch import run_command

            return run_command(args)
        argv = [args.script, *args.args]
        if _measures_here(args, allocation):
            from distgraph.tools.local_calibration import calibrated_local

            args.cluster = calibrated_local(args.nprocs, args.recalibrate)
        check_launch(args.nprocs, argv, args.cluster)
        cluster = None
        if args.cluster:     # resource files need numpy, networkx and scipy: only then
            from distgraph.resources.cluster import Cluster

            cluster = Cluster.from_file(args.cluster)
        if args.plan:       # --dry-run starts nothing: the file alone is checked
            _check_plan_file(args.plan, args.nprocs, cluster, args.cluster,
                             None if args.dry_run else argv)
        assignment = slurm.placement(assign_hosts(args.nprocs, args.hostfile, args.hosts,
                                                  cluster, args.cluster, os.environ),
                                     allocation, args.nprocs, os.environ)
        if args.dry_run:
            print(assignment.describe() if assignment is not None else
                  f"{args.nprocs} rank{'s' if args.nprocs != 1 else ''} on this host (no "
                  "--hostfile, --hosts, --cluster or $HYDRA_HOST_FILE)")
            return 0
        if assignment is not None and all(map(is_local, assignment.distinct_hosts)):
            assignment = None                   # hydra starts them all here, as without
        return launch(args.nprocs, argv, cluster=args.cluster, log_dir=args.log_dir,
                      assignment=assignment, plan_file=args.plan)
    except DistGraphError as err:
        if os.environ.get("SLURM_PROCID", "0") == "0":    # one line from srun's tasks
            print(f"distgraph run: {err}", file=sys.stderr)
        return 2



def _measures_here(args, allocation) -> bool:
    """Whether this launch runs on this machine's measured figures: no cluster file, no
    plan file, no other hosts, not a dry run, and measuring not turned off
    (``$DISTGRAPH_CALIBRATE=never``); ``--recalibrate`` asks for it."""
    from distgraph.tools.local_calibration import wanted

    here = not (args.cluster or args.plan or args.hostfile or args.hosts or allocation
                or args.dry_run or os.environ.get("HYDRA_HOST_FILE"))
    if args.recalibrate and not here:
        raise DistGraphError("--recalibrate measures this machine for a job without "
                             "--cluster, --plan, --hostfile, --hosts or --dry-run; leave "
                             "it out here")
    return here and (wanted() or args.recalibrate)


def _check_plan_file(path, nprocs: int, cluster, cluster_path, argv: list | None) -> None:
    """Refuse a plan file before any rank starts: one that cannot be read whole, of a
    newer format, made for another number of processes or (given) another cluster; then
    (unless ``argv`` is None) one made for another program: the script runs once as one
    process, up to its Engine's first plan, which checks the file against the
    script's program and cluster and makes its plan, compiling no rank's program (a
    launch context's ``PlanRequest(check=True)``)."""
    from distgraph.cli.plan import script_report
    from distgraph.plan.file import read
    from distgraph.runtime.launch.context import LaunchContext, PlanRequest

    saved = read(path)
    saved.check_world(nprocs)
    if cluster is not None:
        saved.check_cluster(cluster)
    if argv is None:
        return
    with tempfile.TemporaryDirectory(prefix="distgraph-plan-check-") as tmp:
        context = LaunchContext(os.path.abspath(cluster_path) if cluster_path else None,
                                PlanRequest(os.path.join(tmp, "check.json"), check=True),
                                plan_file=os.path.abspath(path))
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        data, code, tail = script_report(argv, context, env, tmp)
    if data is None:
        raise DistGraphError(f"{argv[0]} ended (exit code {code}) before its Engine planned, "
                             f"so the plan file {path} could not be checked against it: with "
                             f"--plan the script must train with a dg.Engine. Its output:\n"
                             f"{tail}")
    if "error" in data:
        raise DistGraphError(data["error"])
    if not data.get("checked"):
        print(f"distgraph run: warning: {argv[0]}'s Engine did not train first, so the plan "
              f"file {path} was not checked against its program before the ranks start",
              file=sys.stderr)


# the options that only an elastic job reads (each None unless given)
ELASTIC_ONLY = ("max_restarts", "min_ranks", "max_ranks")


def _run_elastic(args, allocation) -> int:
    """``distgraph run --elastic``: on an emulated cluster, or on hosts over ssh or the
    nodes of ``allocation`` (a Slurm allocation, None outside one)."""
    from distgraph.runtime.launch.elastic import ElasticPolicy

    given = {name: getattr(args, name) for name in ELASTIC_ONLY
             if getattr(args, name) is not None}
    policy = ElasticPolicy(**given)
    if policy.max_ranks is not None and policy.max_ranks < args.nprocs:
        # the first attempt would start on max_ranks ranks, not -n: say so instead
        print(f"distgraph run: --max-ranks {policy.max_ranks} is below -n {args.nprocs}: "
              f"the job would start on {policy.max_ranks} ranks; give -n "
              f"{policy.max_ranks}, or --max-ranks {args.nprocs} or more", file=sys.stderr)
        return 2
    check_launch(args.nprocs, [args.script, *args.args], args.cluster)
    if args.emulate:
        if args.hostfile or args.hosts or args.dry_run:
            print("distgraph run: --emulate runs every rank on this machine's network "
                  "namespaces; it takes no --hostfile, --hosts or --dry-run", file=sys.stderr)
            return 2
        from distgraph.runtime.emulate.elastic import launch_elastic

        return launch_elastic(args.emulate, args.nprocs, [args.script, *args.args], policy,
                              faults=args.emulate_fault, log_dir=args.log_dir)
    if args.emulate_fault:
        print("distgraph run: --emulate-fault needs --emulate FILE", file=sys.stderr)
        return 2
    if not (args.hostfile or args.hosts or allocation):
        print("distgraph run: --elastic needs machines to lose and take back: give "
              "--hostfile FILE, --hosts LIST or --emulate FILE, or run it in a Slurm "
              "allocation", file=sys.stderr)
        return 2
    from distgraph.runtime.launch.elastic_hosts import launch_elastic_hosts

    assignment = slurm.placement(assign_hosts(args.nprocs, args.hostfile, args.hosts, None,
                                              None, os.environ),
                                 allocation, args.nprocs, os.environ)
    return launch_elastic_hosts(assignment, [args.script, *args.args], policy,
                                cluster=args.cluster, log_dir=args.log_dir)
