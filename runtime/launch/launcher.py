"""Start N ranks of a Python script with the mpiexec that pip installs (mpich wheel).

The pieces, each a function of its own:

- :func:`launch_command` builds the mpiexec command line; every rank runs through
  :mod:`distgraph.runtime.launch.bootstrap`, which makes an uncaught exception on any rank abort
  the whole job (MPICH otherwise waits forever for the dead rank), and which gets the
  launch context (the cluster file, a ``distgraph plan`` request:
  :mod:`distgraph.runtime.launch.context`) as its arguments.
- :func:`rank_env` builds the ranks' environment: one BLAS thread per rank and memory
  kept for reuse unless the caller chose otherwise, the job's status and log folders.
- :func:`check_launch` validates everything the user gave before anything starts.
- :class:`~distgraph.runtime.launch.job.Job` runs mpiexec, shows the ranks' output, and stops
  the job and every rank (:mod:`distgraph.runtime.launch.job`), leaving no file of MPI's
  behind; :class:`~distgraph.runtime.launch.watch.RankWatch` stops it as soon as a rank's
  end (or a wait in MPI's start past the ranks' timeout) means it can no longer finish.
- :func:`stop_on_signals` turns SIGTERM, SIGHUP and SIGINT into stopping the job.
- :func:`report` reads the status folder and says, one line per cause, why a job failed.
  A job succeeds only when every rank finished its script: a rank gone without a word
  fails it, whatever mpiexec's exit code.

On several hosts (a :class:`~distgraph.runtime.launch.hosts.HostAssignment`), hydra starts the
ranks over its launcher (ssh by default) at exactly the assignment's hosts, after every
host passed :func:`~distgraph.runtime.launch.remote.preflight`; each host keeps its ranks'
status files and logs in a folder of its own, which
:func:`~distgraph.runtime.launch.remote.collect` brings to this host after the job, killing
what is left there, before the report. Over ssh these and hydra share one connection per
host (:mod:`~distgraph.runtime.launch.connections`), closed when the job is over.

Example::

    from distgraph.runtime.launch.launcher import launch
    rc = launch(4, ["tutorials/02_spmd_gpt.py", "--steps", "3"])
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
from contextlib import ExitStack, contextmanager

from distgraph.callbacks import TERMINAL_VAR, is_terminal
from distgraph.errors import PlanError, RuntimeFault
from distgraph.threads import limit_blas_threads
from distgraph.runtime.launch import remote
from distgraph.runtime.launch.connections import Masters
from distgraph.runtime.launch.context import LaunchContext, current
from distgraph.runtime.launch.hostside import LAUNCHER_FILE
from distgraph.runtime.launch.hosts import HostAssignment
from distgraph.runtime.launch.job import Job
from distgraph.runtime.launch.progress import moment
from distgraph.runtime.launch.status import (
    DEFAULT_TIMEOUT,
    LOG_DIR,
    RANK_HOSTS,
    STATUS_DIR,
    default_timeout,
    failure_lines,
    read_states,
)
from distgraph.runtime.launch.watch import RankWatch

# glibc hands a freed block of 128 KiB or more back to the OS, and a training step that
# frees each gradient after its update then page-faults the same megabytes back in on
# the next step (about 0.12 ms per MiB on a 2-core VM: 2 ms per 16 MiB gradient).
# Serving blocks below 1 GiB from the heap, trimmed only past 1 GiB free, keeps them
# for reuse, as the caching allocators of GPU frameworks do (a rank holds its peak).
ALLOCATOR_VARS = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
TIMED_OUT = 124     # what timeout(1) returns


def mpiexec_path() -> str:
    """The mpiexec beside this interpreter (the mpich wheel's), else the one on PATH."""
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.exists(local):
        return local
    found = shutil.which("mpiexec")
    if found is None:
        raise PlanError(
            "no mpiexec found: install the 'mpich' wheel into this environment "
            "(pip install mpich) or put an MPI's mpiexec on PATH"
        )
    return found


def rank_env(base: dict | None = None, status_dir: str | None = None,
             log_dir: str | None = None) -> dict:
    """Environment for ranks: one BLAS thread each and the allocator settings unless
    already set, whether the job's output reaches a terminal (progress bars or plain
    lines, :func:`distgraph.callbacks.is_terminal`), and the job's status and log
    folders."""
    env = dict(os.environ if base is None else base)
    limit_blas_threads(env)       # unless the user chose (any of the variables set)
    # the ranks write into pipes: whether their progress bars reach a terminal is ours
    env.setdefault(TERMINAL_VAR, "1" if is_terminal(sys.stderr) else "0")
    for var, value in ALLOCATOR_VARS.items():
        env.setdefault(var, value)
    if status_dir is not None:
        env[STATUS_DIR] = status_dir
    if log_dir is not None:
        env[LOG_DIR] = os.path.abspath(log_dir)
    return env


def launch_command(nprocs: int, argv: list[str], mpiexec_args=(), prefix=(),
                   context: LaunchContext | None = None) -> list[str]:
    """The mpiexec command line that runs ``argv`` (a script and its args) on N ranks
    under ``context`` (the bootstrap's options; None: none); ``mpiexec_args`` go before
    the program (hosts, launcher options), ``prefix`` before mpiexec (e.g.
    ``ip netns exec NS`` to start it in a network namespace)."""
    if nprocs < 1:
        raise PlanError(f"cannot launch {nprocs} processes: -n must be at least 1")
    options = context.argv() if context is not None else []
    return [*prefix, mpiexec_path(), *mpiexec_args, "-n", str(nprocs), sys.executable, "-m",
            "distgraph.runtime.launch.bootstrap", *options, "--", *argv]


def check_launch(nprocs: int, argv: list[str], cluster: str | None = None) -> None:
    """Everything checkable before a rank starts: the rank count, the script, and the
    cluster file (loaded and validated, with enough devices for the ranks)."""
    if nprocs < 1:
        raise PlanError(f"cannot launch {nprocs} processes: -n must be at least 1")
    if not argv:
        raise PlanError("no script given: distgraph run -n N script.py [args]")
    if not os.path.isfile(argv[0]):
        raise PlanError(f"{argv[0]}: no such script; give the path of a Python file")
    if cluster is not None:
        # here, not above: reading a resource file needs numpy, networkx and scipy, a
        # second of the start of a job that has none
        from distgraph.resources.cluster import Cluster

        devices = len(Cluster.from_file(cluster).devices)
        if devices < nprocs:
            raise PlanError(f"{cluster}: the cluster has {devices} devices but -n {nprocs} "
                            f"starts {nprocs} ranks (one per device); use -n {devices} or "
                            "a larger cluster")


@contextmanager
def stop_on_signals(job: Job):
    """While the block runs, SIGTERM, SIGHUP and SIGINT stop the job (see ``Job.stop``)
    instead of ending this process and leaving mpiexec and the ranks behind. Only the
    main thread can take signals; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, lambda signum, frame: job.request_stop(signum))
                for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def launch(nprocs: int, argv: list[str], cluster: str | None = None,
           env: dict | None = None, timeout: float | None = None,
           log_dir: str | None = None, mpiexec_args=(), prefix=(), extra_env=None,
           watch=None, assignment: HostAssignment | None = None, restart: int | None = None,
           on_start=None, plan_file: str | None = None) -> int:
    """Run ``argv`` on ``nprocs`` ranks; returns the exit code (mpiexec's; 128 + the
    signal when stopped by one; 124 after ``timeout`` seconds; 1 when ``watch``, a
    callable polled while the job runs, returns a reason to stop it).
    ``mpiexec_args`` and ``prefix`` go into :func:`launch_command`, ``extra_env`` into
    the ranks' environment; with a ``assignment`` the ranks run on its hosts (see the
    module docstring), else on this one. The ranks run under the launch context this
    process runs under (:func:`~distgraph.runtime.launch.context.current`), with
    ``cluster`` as its cluster file when one is given, ``plan_file`` as its plan file
    (``distgraph run --plan``) and ``restart`` as the start of an elastic job
    (:mod:`distgraph.runtime.launch.elastic`); ``on_start(job)`` is called
    once the job runs (its status folder is ``job.status_dir``).

    Each rank's output is shown and also kept in ``log_dir/rank-<r>.log`` (default: a
    temporary folder, removed when the job succeeds). When the job fails, the terminal
    gets one line per cause (which ranks failed with which error, or died without a
    word) and the log folder; tracebacks stay in the logs."""
    check_launch(nprocs, argv, cluster)
    with ExitStack() as shared:
        launcher = None
        if assignment is not None:
            if assignment.nprocs != nprocs:
                raise PlanError(f"the assignment ({assignment.source}) has {assignment.nprocs} "
                                f"ranks, the job {nprocs}")
            launcher = remote.Launcher.from_env(os.environ if env is None else env)
            # one ssh connection per host for the check, hydra and the clean-up, closed
            # when this block ends (connections.Masters)
            masters = shared.enter_context(Masters.for_launcher(launcher))
            if masters.folder is not None:
                launcher = launcher.sharing(masters.folder)
            remote.preflight(launcher, assignment.distinct_hosts,
                             [argv[0]] + ([os.path.abspath(cluster)] if cluster else []),
                             masters=masters)
            # hydra reaches the hosts as the check and the clean-up do, not as it
            # would guess (its own reading of a Slurm allocation, say)
            mpiexec_args = [*mpiexec_args, "-launcher", launcher.kind, "-hosts",
                            assignment.hydra_hosts()]
        here = current()
        context = LaunchContext(os.path.abspath(cluster) if cluster else here.cluster,
                                here.plan, here.restart if restart is None else restart,
                                os.path.abspath(plan_file) if plan_file else here.plan_file,
                                here.report)
        command = launch_command(nprocs, argv, mpiexec_args, prefix, context)
        keep_logs = log_dir is not None
        if log_dir is None:
            log_dir = tempfile.mkdtemp(prefix="distgraph-logs-")
        os.makedirs(log_dir, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="distgraph-status-") as status:
            # Over several hosts every rank logs into the status folder of its host (the
            # same path everywhere); the logs come here when the job is over.
            rank_logs = log_dir if assignment is None else os.path.join(status, "logs")
            ranks = rank_env(env, status, rank_logs)
            ranks.update(extra_env or {})
            if assignment is not None:
                ranks[RANK_HOSTS] = ",".join(assignment.hosts)
                ranks.update(launcher.hydra_env(ranks))
                open(os.path.join(status, LAUNCHER_FILE), "w").close()
            job = Job(command, ranks, status, log_dir)
            # MPI's start is bounded by the ranks' timeout where every rank's status is
            # here to say who did not come (over several hosts, hydra's ssh start may be
            # slow and the ranks elsewhere unseen)
            ranks_watch = RankWatch(status, nprocs,
                                    _comm_timeout(ranks) if assignment is None else None)

            def watching():
                return (watch() if watch is not None else None) or ranks_watch()

            with stop_on_signals(job):
                job.start()
                if on_start is not None:
                    on_start(job)
                returncode = job.wait(timeout, watching)
                problems = []
                if assignment is not None:
                    problems = remote.collect(launcher, assignment.distinct_hosts, status,
                                              job.marker, masters)
                    remote.move_logs(status, log_dir)
            lines = report(job, nprocs, returncode, timeout, assignment, ranks_watch.reason)
            if lines and returncode == 0:    # mpiexec said 0, but a rank did not finish
                returncode = 1
            lines += problems
    for line in lines:
        sys.stderr.write(f"distgraph: {line}\n")
    sys.stderr.flush()
    if returncode == 0 and not keep_logs and not problems:
        shutil.rmtree(log_dir, ignore_errors=True)
    return returncode


def _comm_timeout(env: dict) -> float:
    """The ranks' communication timeout (a value they refuse counts as the default:
    they say so themselves)."""
    try:
        return default_timeout(env)
    except RuntimeFault:
        return DEFAULT_TIMEOUT


def report(job: Job, nprocs: int, returncode: int, timeout: float | None,
           assignment: HostAssignment | None = None, stopped: str | None = None) -> list[str]:
    """The lines the terminal gets about how the job ended (none when it succeeded:
    mpiexec exited with 0 and every rank finished its script). ``stopped``: why the
    launcher's :class:`RankWatch` stopped the job, if it did."""
    logs = f"each rank's full output is in {job.log_dir}{os.sep}rank-<r>.log"
    ranks = f"its {nprocs} ranks"
    if assignment is not None:
        count = len(assignment.distinct_hosts)
        ranks += f" on {count} host{'s' if count != 1 else ''}"
    if job.stopped_by is not None:
        name = signal.Signals(job.stopped_by).name
        return [f"received {name}: stopped mpiexec and {ranks} ({logs})"]
    if job.timed_out:
        return [f"the job did not finish within {timeout:g} s: stopped mpiexec and "
                + f"{ranks} ({logs})"]
    if job.stopped_because is not None and stopped is None:
        return [f"{job.stopped_because}: stopped mpiexec and {ranks} ({logs})"]
    states = read_states(job.status_dir, nprocs)
    unfinished = [s.rank for s in states if not s.done]
    if returncode == 0 and not unfinished:
        return []
    moments = {s.rank: moment(job.status_dir, s.rank) for s in states if s.silent}
    if stopped is not None:
        # the errors ranks reported say more than the watch's summary of them; a rank
        # that ended silently is the watch's reason itself or was ended by the stop
        said = failure_lines([s for s in states if s.failed is not None],
                             hosts=assignment is not None)
        return (said or [stopped]) + [f"stopped mpiexec and {ranks}; the job failed; {logs}"]
    lines = failure_lines(states, hosts=assignment is not None, moments=moments)
    if not lines and returncode != 0:
        said = job.mpiexec_output_tail()
        said = f"; mpiexec said: {said}" if said else ""
        lines = [f"mpiexec exited with code {returncode} and no rank reported an error{said}"]
    if not lines:
        who = f"rank{'s' if len(unfinished) > 1 else ''} {', '.join(map(str, unfinished))}"
        lines = [f"{who} ended without finishing the script or reporting an error"]
    code = f"mpiexec exit code {returncode}" + (", but not every rank finished its script"
                                                 if returncode == 0 else "")
    return lines + [f"the job failed ({code}); {logs}"]
