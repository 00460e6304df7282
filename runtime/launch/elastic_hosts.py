"""Elastic jobs on hosts over ssh: ``distgraph run --elastic --hostfile FILE`` (or ``--hosts``),
or on the nodes of a Slurm allocation (through srun: :mod:`distgraph.runtime.launch.slurm`).

Each attempt (:mod:`distgraph.runtime.launch.elastic`) is an ordinary multi-host job
(:func:`~distgraph.runtime.launch.launcher.launch`: the check of every host before it
starts, the clean-up of every host after it) on the hosts that answer, as many ranks on
each as the first assignment gave it. A host answers when ``true`` runs there over the
job's launcher (ssh in batch mode, or srun) within :data:`ANSWER_TIMEOUT` seconds and, in
a Slurm allocation, Slurm still runs work on its node (a node drained or draining, down
or not responding is lost, as ``scontrol update nodename=N state=drain`` asks); while an
attempt runs, a thread asks every :data:`PROBE_EVERY` seconds, and the ranks' status
files on this host are read: a host that stops answering, or a rank here that died or
failed, stops the attempt at once. A rank that dies on another host ends the job through
hydra, as without ``--elastic``; so does a host whose sshd is gone (mpiexec exits 255), and
the hosts are then asked once for the cause. With ``--max-ranks``
(:meth:`ElasticPolicy.may_grow`), an attempt on fewer ranks also asks the hosts it left out; once one answers, the attempt
stops after the next checkpoint that rank 0 reports complete (``<status>/0.checkpoint``
on rank 0's host, read over ssh) and the next one, on the hosts that answer, resumes
from it.

Example::

    rc = launch_elastic_hosts(assign_hosts(4, hosts="node0:2,node1:2"), ["train.py"],
                              ElasticPolicy(min_ranks=2))
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time

from distgraph.errors import PlanError
from distgraph.runtime.launch import remote, slurm
from distgraph.runtime.launch.elastic import ElasticPolicy, ElasticRun, Machine, Outcome
from distgraph.runtime.launch.hosts import HostAssignment
from distgraph.runtime.launch.launcher import launch
from distgraph.runtime.launch.status import failure_lines, read_states, read_status

ANSWER_TIMEOUT = 5.0    # seconds a host has to run `true` over ssh
PROBE_EVERY = 2.0       # seconds between two probes of a running attempt's hosts
STATES_EVERY = 0.3


class HostAttempts:
    """Runs the attempts of an elastic job on ``assignment``'s hosts."""

    def __init__(self, assignment: HostAssignment, argv, log, env=None, log_dir=None,
                 timeout=None, policy=None):
        self.assignment, self.argv, self.log = assignment, argv, log
        self.policy = policy or ElasticPolicy()  # when to grow back
        self.env = dict(os.environ if env is None else env)
        self.log_dir, self.timeout = log_dir, timeout
        self.launcher = remote.Launcher.from_env(self.env)

    def machines(self) -> list[Machine]:
        return [Machine(h, len(self.assignment.ranks_on(h)))
                for h in self.assignment.distinct_hosts]

    def answering(self, names) -> set[str]:
        return {h for h, why in self.why_not(names).items() if why is None}

    def why_not(self, names) -> dict[str, str | None]:
        """Host -> None when it answers, else why not: ``stopped answering``, or in a
        Slurm allocation ``is draining in Slurm`` (a node Slurm runs no work on,
        :func:`~distgraph.runtime.launch.slurm.unavailable`, is lost though it answers)."""
        why: dict[str, str] = {}
        if self.launcher.kind == "slurm":
            try:
                states = slurm.unavailable(names, self.env)
            except PlanError:      # the controller is busy: the nodes are asked below
                states = {}
            why.update({h: f"is {state} in Slurm" for h, state in states.items()})
        far = [h for h in names if h not in why and not remote.is_local(h)]
        # a host that does not answer is asked once more, given twice the time: on a
        # loaded machine ssh alone can take the first timeout, and a host taken for lost
        # restarts the job without it (one that is down refuses at once, both times)
        for seconds in (ANSWER_TIMEOUT, 2 * ANSWER_TIMEOUT):
            answers = remote.run_everywhere(self.launcher, {h: ["true"] for h in far},
                                            seconds) if far else {}
            far = [h for h, a in answers.items() if a.returncode != 0]
        why.update(dict.fromkeys(far, "stopped answering"))
        return {h: why.get(h) for h in names}

    def __call__(self, world, restart: int) -> Outcome:
        hosts = tuple(m.name for m in world for _ in range(m.slots))
        assignment = HostAssignment(hosts, self.assignment.source)
        seen: dict = {}
        stop = threading.Event()
        prober = threading.Thread(target=self._probe, args=(world, restart, seen, stop),
                                  daemon=True)
        prober.start()
        log_dir = self.log_dir
        if log_dir is not None and restart:
            log_dir = os.path.join(log_dir, f"restart-{restart}")
        try:
            rc = launch(len(hosts), self.argv, env=self.env, timeout=self.timeout,
                        log_dir=log_dir, assignment=assignment, restart=restart,
                        watch=self._watch(len(hosts), seen),
                        on_start=lambda job: seen.setdefault("status", job.status_dir))
        finally:
            stop.set()
            prober.join()
        cause = seen.get("cause")
        if rc != 0 and cause is None:
            # hydra may see a host's proxy go before the prober sees the host: ask now
            cause = _lost_line(self.why_not([m.name for m in world]))
        return Outcome(rc, cause if rc != 0 else None, seen.get("detected") or time.time())

    def _probe(self, world, restart: int, seen: dict, stop: threading.Event) -> None:
        names = [m.name for m in world]
        out = [m.name for m in self.machines() if m.name not in names]
        grow = self.policy.may_grow(self.assignment.nprocs, sum(m.slots for m in world),
                                    restart)
        while not stop.wait(PROBE_EVERY):
            lost = _lost_line(self.why_not(names))
            if lost:
                seen["stop"] = lost
                return
            if not grow or "status" not in seen:
                continue
            if "back" not in seen:
                back = sorted(self.answering(out)) if out else []
                if back:
                    seen["back"], seen["saved"] = back, self._saved(names[0], seen["status"])
                continue
            saved = self._saved(names[0], seen["status"])
            if saved > seen["saved"]:
                seen["stop"] = (f"host {', '.join(seen['back'])} answers again; growing from "
                                f"the checkpoint of step {saved}")
                return

    def _saved(self, host: str, status: str) -> int:
        """The step of the last checkpoint rank 0 (on ``host``) reported complete; -1."""
        path = os.path.join(status, "0.checkpoint")
        if remote.is_local(host):
            text = read_status(status, 0, "checkpoint")
        else:
            answer = remote.run_everywhere(self.launcher, {host: ["cat", path]},
                                           ANSWER_TIMEOUT)[host]
            text = answer.stdout.decode(errors="replace") if answer.returncode == 0 else None
        return int(text) if text and text.strip().isdigit() else -1

    def _watch(self, nprocs: int, seen: dict):
        clock = {"states": time.monotonic()}

        def watch():
            cause = seen.get("stop")
            status, now = seen.get("status"), time.monotonic()
            if cause is None and status is not None and now - clock["states"] >= STATES_EVERY:
                clock["states"] = now
                lines = failure_lines(read_states(status, nprocs), hosts=True)
                cause = lines[0].split("\n")[0] if lines else None
            if cause is not None:
                seen.setdefault("detected", time.time())
                seen.setdefault("cause", cause)
                return seen["cause"]
            return None

        return watch


def _lost_line(why: dict) -> str | None:
    """``host a, b stopped answering; host c is draining in Slurm``; None: none lost."""
    hosts: dict[str, list] = {}
    for host, reason in why.items():
        if reason is not None:
            hosts.setdefault(reason, []).append(host)
    return "; ".join(f"host {', '.join(h)} {reason}" for reason, h in hosts.items()) or None


def launch_elastic_hosts(assignment: HostAssignment | None, argv: list[str],
                         policy: ElasticPolicy, cluster: str | None = None,
                         log_dir: str | None = None, env: dict | None = None,
                         timeout: float | None = None, log=None) -> int:
    """Run ``argv`` as an elastic job on ``assignment``'s hosts (module docstring)."""
    log = sys.stderr if log is None else log
    if assignment is None:
        raise PlanError("--elastic needs hosts: give --hostfile FILE or --hosts LIST, or "
                        "run it in a Slurm allocation")
    if cluster is not None:
        raise PlanError("--elastic with --hostfile/--hosts takes no --cluster yet (the "
                        "file would describe machines that may be lost); give --emulate "
                        "FILE, or leave --cluster out")
    # without --log-dir, one temporary folder holds every attempt's logs: removed when
    # the job succeeds (its failed attempts included), kept and named when it fails
    temporary = log_dir is None
    log_dir = tempfile.mkdtemp(prefix="distgraph-logs-") if temporary else log_dir
    rc = 1
    try:
        attempts = HostAttempts(assignment, argv, log, env, log_dir, timeout, policy)
        rc = ElasticRun(attempts.machines(), assignment.nprocs, attempts, attempts.answering,
                        policy, log, os.path.join(log_dir, "elastic.jsonl")).run()
    finally:
        if temporary and rc == 0:
            shutil.rmtree(log_dir, ignore_errors=True)
        elif temporary:
            log.write(f"distgraph: elastic: every attempt's logs are in {log_dir}\n")
    return rc
