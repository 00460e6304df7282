"""The launcher's watch over its ranks: a job that can no longer finish is stopped, named.

hydra (MPICH's mpiexec) ends a job when a rank is killed by a signal or leaves MPI without
``MPI_Finalize``, but not when a rank ends well (its script returns, ``sys.exit(0)``)
or fails without aborting while its peers still need it: they wait in a collective until
their timeout, and where no timeout reaches (``MPI_Init``, ``MPI_Finalize``, a C call of
the script's own) for ever. Nor can a rank's own code see every way a peer ends. So the
launcher, which depends on no rank's cooperation, reads its ranks' status files
(:mod:`distgraph.runtime.launch.status`, written by each rank's bootstrap and supervisor)
at every poll and stops the job when

- a rank's process ended without finishing its script or saying why (killed, crashed,
  ``os._exit``): nothing it takes part in can complete;
- a rank failed (an uncaught exception, ``sys.exit`` with a non-zero code) and has not
  ended the job itself ``FAILED_GRACE`` seconds after it said so (it aborts the job once
  its failing peers have reported theirs,
  :func:`~distgraph.runtime.launch.bootstrap.let_peers_report`; one that failed before
  MPI started cannot);
- a rank has waited in MPI's start longer than the ranks' timeout
  (``DISTGRAPH_COMM_TIMEOUT``): a peer never got there. Every rank starts MPI before its
  script runs (:mod:`~distgraph.runtime.launch.bootstrap`), so that the script's own
  steps cannot turn this wait into an endless one, and the communicators bound the rest.

A rule that holds is acted on a moment later (``SETTLE``, ``FAILED_GRACE``), so that a
job hydra or its ranks end anyway (a rank killed by a signal: 0.2 s) ends as they end
it, and an elastic job's own watch sees its failures first. A rank that finishes while
its peers wait for it in a collective is named by those peers within two seconds
(:mod:`distgraph.runtime.comm.mpi`). Only the ranks of this host are watched: the others
keep their status files on their hosts.

Example::

    watch = RankWatch(job.status_dir, nprocs, timeout=60)
    watch()     # None, or "rank 2 died without reporting an error (exited with code 0
                # in step 3); the other ranks were stopped after it"
"""

from __future__ import annotations

import time

from distgraph.runtime.launch.progress import moment
from distgraph.runtime.launch.status import failure_lines, read_states

SETTLE = 1.0          # seconds a rank's silent end stands before the job is stopped for it
FAILED_GRACE = 5.0    # seconds a failed rank gets to end the job itself (PEER_GRACE + 2)


class RankWatch:
    """Polled by :meth:`Job.wait <distgraph.runtime.launch.job.Job.wait>`: returns why
    the job must stop (and keeps it in ``reason``), or None. ``timeout``: the ranks'
    communication timeout in seconds (None: no bound on MPI's start)."""

    def __init__(self, status_dir: str, nprocs: int, timeout: float | None):
        self.status_dir, self.nprocs, self.timeout = status_dir, nprocs, timeout
        self.reason: str | None = None
        self._since: dict = {}       # (rule, rank) -> when it was first seen to hold

    def __call__(self) -> str | None:
        now = time.monotonic()
        holding = {}
        for state in read_states(self.status_dir, self.nprocs):
            for key, (delay, reason) in self._rules(state).items():
                first = self._since.setdefault(key, now)
                holding[key] = first
                if now - first >= delay and self.reason is None:
                    self.reason = reason()
        # a rule that stopped holding (MPI started) starts afresh if it holds again
        self._since = holding
        return self.reason

    def _rules(self, s) -> dict:
        """{(rule, rank): (seconds it must hold, a function making the reason)} of the
        rules that hold for rank state ``s``."""
        folder = self.status_dir
        if s.silent:       # in the words of the report of a job hydra ended for it
            return {("ended", s.rank): (SETTLE, lambda: failure_lines(
                [s], moments={s.rank: moment(folder, s.rank)})[0])}
        if s.failed is not None:
            first = (s.failed.strip().splitlines() or ["an error"])[0]
            return {("failed", s.rank): (FAILED_GRACE, lambda: (
                f"rank {s.rank} failed ({first}) and the job did not end within "
                f"{FAILED_GRACE:g} s"))}
        if s.mpi == "starting" and s.exit is None and self.timeout is not None:
            return {("starting", s.rank): (self.timeout, lambda: self._late(s.rank))}
        return {}

    def _late(self, rank: int) -> str:
        """Why the job stops when ``rank`` waited too long in MPI's start."""
        states = read_states(self.status_dir, self.nprocs)
        absent = [s.rank for s in states if s.mpi is None]
        who = (f"rank{'s' if len(absent) > 1 else ''} {', '.join(map(str, absent))} never "
               f"began it" if absent else "a peer on another host did not come")
        return (f"rank {rank} waited {self.timeout:g} s for MPI to start on every rank "
                f"(DISTGRAPH_COMM_TIMEOUT) and {who}")
