"""Faults injected into an emulated cluster while a job runs, for tests of failure paths.

A fault is one line::

    link A-B down at T [for D]     every packet between machines A and B is dropped
    link A-B stall at T [for D]    traffic between A and B is held back (latency spike:
                                   1 kB/s trickles through); after D it all leaves at once
    machine A down at T [for D]    machine A is lost: every process on it is killed
                                   (SIGKILL), then its network is cut (nothing reaches
                                   it, not even the launcher); after D its network
                                   answers again, with nothing running (a rebooted host)

A and B are machine hostnames of the resource file; T and D are seconds after ``mpiexec``
starts (``5``, ``5s``, ``500ms``), or T is ``step N``: when a rank of the job begins
training step N (global, as the Engine counts them; read from the ranks' progress
records). Without ``for D`` the fault lasts until the job ends.
Control traffic (launcher to ranks) does not cross machine links, so a job whose link is
down still ends: its ranks time out (``DISTGRAPH_COMM_TIMEOUT``) with a RuntimeFault. A
rank blocked where that timeout does not reach (a fault that lands while MPI is still
starting, inside ``MPI_Init``) is ended by the launcher instead, two timeouts after a
lasting fault, with the same report.

Example::

    >>> f = parse_fault("link node0-node1 down at 5s", ["node0", "node1"])
    >>> (f.a, f.b, f.state, f.at, f.duration)
    ('node0', 'node1', 'down', 5.0, None)
    >>> f.events()
    [(5.0, 'down')]
    >>> parse_fault("machine node1 down at step 6", ["node0", "node1"]).step
    6
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass

from distgraph.errors import PlanError

GRAMMAR = ("'link A-B down|stall at T [for D]' or 'machine A down at T [for D]' (A, B "
           "hostnames; T, D like 5s or 500ms; T also 'step N')")
_FAULT = re.compile(r"^\s*link\s+(?P<pair>\S+)\s+(?P<state>down|stall)\s+at\s+(?P<at>step\s+\S+|\S+)"
                    r"(?:\s+for\s+(?P<duration>\S+))?\s*$")
_MACHINE = re.compile(r"^\s*machine\s+(?P<host>\S+)\s+(?P<state>down)\s+at\s+"
                      r"(?P<at>step\s+\S+|\S+)(?:\s+for\s+(?P<duration>\S+))?\s*$")
_STEP = re.compile(r"^step\s+(?P<n>\d+)$")
_SECONDS = re.compile(r"^(?P<value>\d+(?:\.\d*)?|\.\d+)(?P<unit>s|ms)?$")


@dataclass(frozen=True)
class Fault:
    """One fault: on the link ``a``-``b``, or on machine ``a`` (``b`` is None); from
    ``at`` seconds after the start or, when ``step`` is set, from training step ``step``;
    for ``duration`` seconds (None: to the end)."""

    a: str
    b: str | None
    state: str
    at: float
    duration: float | None
    text: str
    step: int | None = None

    @property
    def machine(self) -> bool:
        return self.b is None

    def events(self) -> list[tuple[float, str]]:
        """(seconds after the start, link state) changes this fault makes (a fault at a
        step: seconds after that step began)."""
        out = [(self.at, self.state)]
        if self.duration is not None:
            out.append((self.at + self.duration, "up"))
        return out

    def __str__(self):
        return self.text.strip()


def _seconds(text: str, what: str, fault: str) -> float:
    m = _SECONDS.match(text)
    if m is None:
        raise PlanError(f"emulated fault {fault!r}: {what} {text!r} is not a time; write "
                        f"seconds such as 5, 5s or 500ms")
    value = float(m["value"])
    return value / 1000 if m["unit"] == "ms" else value


def _start(text: str, fault: str) -> tuple[float, int | None]:
    """(seconds, step) of a fault's ``at``: ``5s`` -> (5.0, None), ``step 6`` -> (0.0, 6)."""
    m = _STEP.match(text)
    if m is not None:
        return 0.0, int(m["n"])
    if text.startswith("step"):
        raise PlanError(f"emulated fault {fault!r}: {text!r} is not a step; write 'step N' "
                        "with N a whole number")
    return _seconds(text, "the start", fault), None


def parse_fault(text: str, hostnames) -> Fault:
    """The :class:`Fault` a line describes; PlanError naming the problem otherwise."""
    m = _MACHINE.match(text)
    if m is not None:
        if m["host"] not in hostnames:
            raise PlanError(f"emulated fault {text!r}: {m['host']!r} is not a machine of this "
                            f"job; its machines are {', '.join(hostnames)}")
        at, step = _start(m["at"], text)
        duration = None if m["duration"] is None else _seconds(m["duration"], "the duration",
                                                               text)
        return Fault(m["host"], None, "down", at, duration, text, step)
    m = _FAULT.match(text)
    if m is None:
        raise PlanError(f"emulated fault {text!r}: expected {GRAMMAR}")
    pair = m["pair"]
    # Hostnames may hold '-': take the split whose both sides are machines of the job.
    splits = [(pair[:i], pair[i + 1:]) for i, c in enumerate(pair) if c == "-"]
    known = [(a, b) for a, b in splits if a in hostnames and b in hostnames]
    if not known:
        raise PlanError(f"emulated fault {text!r}: {pair!r} is not two machines of this job "
                        f"joined by '-'; its machines are {', '.join(hostnames)}")
    a, b = known[0]
    if a == b:
        raise PlanError(f"emulated fault {text!r}: a link joins two different machines")
    at, step = _start(m["at"], text)
    duration = None if m["duration"] is None else _seconds(m["duration"], "the duration", text)
    return Fault(a, b, m["state"], at, duration, text, step)


class FaultInjector:
    """Applies faults to an :class:`~distgraph.runtime.emulate.namespaces.Emulation` at their
    times (or steps), on a thread, logging each change; ``applied`` lists (seconds, fault,
    state) done. Faults at a step need :meth:`follow` (the running job's status folder)."""

    POLL = 0.05

    def __init__(self, emulation, faults: list[Fault], log):
        self.emulation = emulation
        self.log = log
        # (seconds or None, step or None, order, state, fault); "up" events are added
        # when their fault is applied
        self.pending = [(None if f.step is not None else f.at, f.step, i, f.state, f)
                        for i, f in enumerate(faults)]
        self.applied: list[tuple[float, Fault, str]] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._status: tuple[str, int] | None = None
        self._thread = threading.Thread(target=self._run, name="emulated-faults", daemon=True)

    def start(self) -> "FaultInjector":
        self._t0 = time.monotonic()
        if self.pending:
            self._thread.start()
        return self

    def follow(self, status_dir: str, nprocs: int) -> None:
        """Read the training step from this job's status folder (its ``nprocs`` ranks)."""
        self._status = (status_dir, nprocs)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _step(self) -> int:
        """The highest training step a rank of the followed job has begun (-1: none)."""
        if self._status is None:
            return -1
        from distgraph.runtime.launch.progress import last_step

        folder, nprocs = self._status
        return max((last_step(folder, r) for r in range(nprocs)), default=-1)

    def _run(self) -> None:
        while self.pending and not self._stop.wait(self.POLL):
            elapsed = time.monotonic() - self._t0
            step = self._step() if any(e[1] is not None for e in self.pending) else -1
            due = [e for e in self.pending if (e[1] is not None and step >= e[1])
                   or (e[1] is None and elapsed >= e[0])]
            for event in sorted(due, key=lambda e: e[2]):
                self.pending.remove(event)
                if not self._apply(event[4], event[3]):
                    return

    def _apply(self, fault: Fault, state: str) -> bool:
        try:
            if fault.machine:
                self.emulation.set_machine(fault.a, state)
            else:
                self.emulation.set_link(fault.a, fault.b, state)
        except Exception as exc:    # reported by the launcher after the job
            self.error = exc
            return False
        elapsed = time.monotonic() - self._t0
        self.applied.append((elapsed, fault, state))
        if state != "up" and fault.duration is not None:
            self.pending.append((elapsed + fault.duration, None, len(self.applied), "up", fault))
        what = f"machine {fault.a}" if fault.machine else f"link {fault.a}-{fault.b}"
        self.log.write(f"distgraph: emulated fault at {elapsed:.1f} s: {what} {state} "
                       f"({fault})\n")
        self.log.flush()
        return True

    def applied_wall(self) -> list[tuple[float, Fault, str]]:
        """``applied`` with wall-clock times (``time.time()``) instead of seconds."""
        shift = time.time() - (time.monotonic() - self._t0)
        return [(shift + elapsed, fault, state) for elapsed, fault, state in self.applied]

    def cut_since(self) -> float | None:
        """Seconds since a link went down or stalled for good (no ``for D``): the
        earliest such fault applied so far; None when there is none."""
        since = [t for t, f, state in self.applied if state != "up" and f.duration is None]
        return time.monotonic() - self._t0 - min(since) if since else None

    def report(self, layout) -> str:
        """Which ranks the applied faults cut apart, one line per fault."""
        lines = []
        for elapsed, fault, state in self.applied:
            if state == "up":
                continue
            if fault.machine:
                m = layout.machine(fault.a)
                lines.append(f"emulated fault '{fault}' (applied at {elapsed:.1f} s): machine "
                             f"{m.hostname} and its ranks {_ranks(m.ranks)} were lost")
                continue
            a, b = layout.machine(fault.a), layout.machine(fault.b)
            lines.append(f"emulated fault '{fault}' (applied at {elapsed:.1f} s): ranks "
                         f"{_ranks(a.ranks)} on {a.hostname} lost their peers, ranks "
                         f"{_ranks(b.ranks)} on {b.hostname}, and the other way round")
        return "\n".join(lines)


def _ranks(ranks) -> str:
    return ", ".join(map(str, ranks))
