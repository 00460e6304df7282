"""Faults injected into an emulated cluster while a job runs, for tests of failure paths.

A fault is one line::

    link A-B down at T [for D]     every packet between machines A and B is dropped
    link A-B stall at T [for D]    traffic between A and B is held back (latency spike:
                                   1 kB/s trickles through); after D it all leaves at once

A and B are machine hostnames of the resource file; T and D are seconds after ``mpiexec``
starts (``5``, ``5s``, ``500ms``). Without ``for D`` the fault lasts until the job ends.
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
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass

from distgraph.errors import PlanError

GRAMMAR = "'link A-B down|stall at T [for D]' (A, B hostnames; T, D like 5s or 500ms)"
_FAULT = re.compile(r"^\s*link\s+(?P<pair>\S+)\s+(?P<state>down|stall)\s+at\s+(?P<at>\S+)"
                    r"(?:\s+for\s+(?P<duration>\S+))?\s*$")
_SECONDS = re.compile(r"^(?P<value>\d+(?:\.\d*)?|\.\d+)(?P<unit>s|ms)?$")


@dataclass(frozen=True)
class Fault:
    a: str
    b: str
    state: str
    at: float
    duration: float | None
    text: str

    def events(self) -> list[tuple[float, str]]:
        """(seconds after the start, link state) changes this fault makes."""
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


def parse_fault(text: str, hostnames) -> Fault:
    """The :class:`Fault` a line describes; PlanError naming the problem otherwise."""
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
    at = _seconds(m["at"], "the start", text)
    duration = None if m["duration"] is None else _seconds(m["duration"], "the duration", text)
    return Fault(a, b, m["state"], at, duration, text)


class FaultInjector:
    """Applies faults to an :class:`~distgraph.runtime.emulate.namespaces.Emulation` at their times,
    on a thread, logging each change; ``applied`` lists (seconds, fault, state) done."""

    def __init__(self, emulation, faults: list[Fault], log):
        self.emulation = emulation
        self.log = log
        self.events = sorted((t, i, state, f) for i, f in enumerate(faults)
                             for t, state in f.events())
        self.applied: list[tuple[float, Fault, str]] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="emulated-faults", daemon=True)

    def start(self) -> "FaultInjector":
        self._t0 = time.monotonic()
        if self.events:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        for t, _, state, fault in self.events:
            if self._stop.wait(max(0.0, self._t0 + t - time.monotonic())):
                return
            try:
                self.emulation.set_link(fault.a, fault.b, state)
            except Exception as exc:    # reported by the launcher after the job
                self.error = exc
                return
            elapsed = time.monotonic() - self._t0
            self.applied.append((elapsed, fault, state))
            self.log.write(f"distgraph: emulated fault at {elapsed:.1f} s: link "
                           f"{fault.a}-{fault.b} {state} ({fault})\n")
            self.log.flush()

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
            a, b = layout.machine(fault.a), layout.machine(fault.b)
            lines.append(f"emulated fault '{fault}' (applied at {elapsed:.1f} s): ranks "
                         f"{_ranks(a.ranks)} on {a.hostname} lost their peers, ranks "
                         f"{_ranks(b.ranks)} on {b.hostname}, and the other way round")
        return "\n".join(lines)


def _ranks(ranks) -> str:
    return ", ".join(map(str, ranks))
