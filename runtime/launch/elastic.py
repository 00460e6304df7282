"""Elastic jobs (``distgraph run --elastic``): a machine is lost, the job goes on, re-planned
for what is left.

One elastic job is a sequence of *attempts*, each an ordinary job (mpiexec and its ranks)
on the machines that answer. When an attempt fails (a rank died or failed, or the
launcher's watch saw a machine stop answering), the launcher

1. ends what is left of it (the attempt's own stop: mpiexec, every rank, on every host),
2. checks every machine of the job, the lost ones too (ssh for hosts; for an emulated
   machine, its network answering),
3. starts the script again on the machines that answer, as many ranks as they held
   (a machine that answers again is taken back), at most ``max_ranks``; with fewer than
   ``min_ranks`` it stops, saying why in one line.

The restarted script runs under ``LaunchContext.restart`` = k (``engine.elastic_restart``),
sees its new world in ``engine.world_size`` and plans for it (its meshes are built from
the world size, or ``auto_mode="full"`` searches the new cluster); ``ModelCheckpoint``
resumes from its newest complete checkpoint. After ``max_restarts`` restarts a failure
ends the job. Every attempt is a line for the user and a JSON record in
``<log dir>/elastic.jsonl`` (the cause, the machines, the world size, the times of
detection, clean-up, check and start).

This module is the policy and the loop; what an attempt is (emulated namespaces, hosts
over ssh) is the caller's (:mod:`distgraph.runtime.emulate.elastic`).

Example::

    policy = ElasticPolicy(max_restarts=2, min_ranks=2)
    world = next_world(machines, answering={"node0"}, policy=policy, cap=4)
    # (Machine('node0', 2),)
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass, field

from distgraph.errors import PlanError

# The exit codes of an attempt stopped by SIGINT/SIGTERM/SIGHUP (the user's): they end the
# job. Other codes above 128 are failures: mpiexec exits with 255 when a host's proxy is gone.
STOPPED_BY_SIGNAL = frozenset(128 + s for s in (signal.SIGINT, signal.SIGTERM,
                                                signal.SIGHUP))


@dataclass(frozen=True)
class ElasticPolicy:
    """How far an elastic job bends: ``max_restarts`` restarts at most; at least
    ``min_ranks`` ranks per attempt; at most ``max_ranks`` (None: the first attempt's)."""

    max_restarts: int = 3
    min_ranks: int = 1
    max_ranks: int | None = None

    def may_grow(self, first: int, ranks: int, restart: int) -> bool:
        """Whether an attempt on ``ranks`` ranks (after ``restart`` restarts) of a job that
        began on ``first`` grows back when a machine answers again: only with
        ``max_ranks``, below it and ``first``, and with a restart left to grow with (a
        growth is a restart; without one left it would end a healthy job)."""
        return (self.max_ranks is not None and ranks < min(first, self.max_ranks)
                and restart < self.max_restarts)

    def __post_init__(self):
        if self.max_restarts < 0:
            raise PlanError(f"--max-restarts {self.max_restarts}: give 0 or more")
        if self.min_ranks < 1:
            raise PlanError(f"--min-ranks {self.min_ranks}: give 1 or more")
        if self.max_ranks is not None and self.max_ranks < self.min_ranks:
            raise PlanError(f"--max-ranks {self.max_ranks} is below --min-ranks "
                            f"{self.min_ranks}")


@dataclass(frozen=True)
class Machine:
    """A machine of the job: its ``name`` (hostname) and the ranks it can run."""

    name: str
    slots: int

    def __str__(self):
        return f"{self.name}:{self.slots}"


@dataclass
class Outcome:
    """How one attempt ended: ``rc`` (0: the script finished everywhere), ``cause`` (one
    line, None when it finished), ``detected`` (wall time the failure was seen), ``ended``
    (wall time nothing of it was left)."""

    rc: int
    cause: str | None = None
    detected: float | None = None
    ended: float = field(default_factory=time.time)


def next_world(machines, answering, policy: ElasticPolicy, cap: int) -> tuple[Machine, ...]:
    """The machines of the next attempt: those of ``machines`` (in order) whose name is
    in ``answering``, their slots filled in order up to ``cap`` ranks (and ``max_ranks``)."""
    limit = cap if policy.max_ranks is None else min(cap, policy.max_ranks)
    world, total = [], 0
    for m in machines:
        if m.name not in answering or total >= limit:
            continue
        take = min(m.slots, limit - total)
        world.append(Machine(m.name, take))
        total += take
    return tuple(world)


def describe(world) -> str:
    return ", ".join(str(m) for m in world)


def _ranks(world) -> int:
    return sum(m.slots for m in world)


class ElasticRun:
    """The loop of an elastic job over ``machines`` (:class:`Machine`, in rank order) on
    ``nprocs`` ranks at first. ``attempt(world, restart) -> Outcome`` runs one attempt and
    leaves nothing of it behind; ``answering(names) -> set`` says which machines answer.
    Lines go to ``log`` (a text stream); records to ``records`` (a path or None)."""

    def __init__(self, machines, nprocs: int, attempt, answering, policy: ElasticPolicy,
                 log, records: str | None = None):
        self.machines, self.nprocs = tuple(machines), nprocs
        self.attempt, self.answering = attempt, answering
        self.policy, self.log, self.records = policy, log, records
        if nprocs < policy.min_ranks:
            raise PlanError(f"-n {nprocs} is below --min-ranks {policy.min_ranks}")
        self.history: list[dict] = []

    def _say(self, line: str) -> None:
        self.log.write(f"distgraph: elastic: {line}\n")
        self.log.flush()

    def record(self, **fields) -> None:
        """Keep one record (``event`` and its fields) in ``history`` and the records file."""
        self.history.append(fields)
        if self.records is not None:
            os.makedirs(os.path.dirname(os.path.abspath(self.records)), exist_ok=True)
            with open(self.records, "a") as f:
                f.write(json.dumps(fields) + "\n")

    def run(self) -> int:
        """Run attempts until one finishes, a signal stops one, the restarts run out or
        too few ranks are left; the exit code of the last attempt (or 1)."""
        world = next_world(self.machines, {m.name for m in self.machines}, self.policy,
                           self.nprocs)
        restart = 0
        while True:
            self.record(event="start", restart=restart, time=time.time(),
                         world=_ranks(world), machines=[m.name for m in world])
            outcome = self.attempt(world, restart)
            if outcome.rc == 0:
                sizes = " -> ".join(str(r["world"]) for r in self.history
                                    if r["event"] == "start")
                if restart:
                    self._say(f"finished after {restart} restart{'s' * (restart != 1)} "
                              f"(world sizes {sizes})")
                return 0
            if outcome.rc in STOPPED_BY_SIGNAL and outcome.cause is None:
                return outcome.rc
            cause = outcome.cause or f"the job failed (exit code {outcome.rc})"
            if restart >= self.policy.max_restarts:
                self._say(f"{cause}; no restart left (--max-restarts "
                          f"{self.policy.max_restarts}): the job ends")
                self.record(event="end", restart=restart, cause=cause, time=time.time())
                return outcome.rc or 1
            checked = time.time()
            alive = self.answering([m.name for m in self.machines])
            probed = time.time()
            lost = [m.name for m in self.machines if m.name not in alive]
            new = next_world(self.machines, alive, self.policy, self.nprocs)
            self.record(event="failure", restart=restart, cause=cause,
                         detected=outcome.detected, ended=outcome.ended, checked=checked,
                         probed=probed, lost=lost)
            if _ranks(new) < self.policy.min_ranks:
                self._say(f"{cause}; {_ranks(new)} rank{'s' * (_ranks(new) != 1)} left on the "
                          f"machines that answer ({describe(new) or 'none'}), below "
                          f"--min-ranks {self.policy.min_ranks}: the job ends")
                return outcome.rc or 1
            restart += 1
            dropped = f"; dropped {', '.join(lost)}" if lost else ""
            self._say(f"{cause}; restart {restart} of {self.policy.max_restarts} on "
                      f"{_ranks(new)} ranks ({describe(new)}), was {_ranks(world)}{dropped}")
            world = new
