"""Where each rank is, in a small file the other ranks and the launcher can read.

Under the launcher every rank maps ``<rank>.progress`` (256 bytes) of the job's status
folder into memory and keeps in it the step it runs, the instruction it is at, and what
it waits for while it waits on a peer. Updating it is a store into shared memory (no
system call), so the executor marks every instruction. Instruction names are written
once per runner to ``<rank>.table-<n>``, one per line; the record holds the table number
and the index.

When a wait times out, :func:`behind` reads the peers' records and names the ranks that
have not reached the call and where they are, instead of blaming the rank that waited.
On a job over several hosts the records of ranks on other hosts are not here (each host
has its own status folder): those ranks are named with their host
(``$DISTGRAPH_RANK_HOSTS``), and where they are is left open.

Example (inside a rank)::

    progress = Progress.open(folder, rank)        # or NO_PROGRESS outside the launcher
    table = progress.table(["op 'matmul'", "op 'relu'"])
    progress.begin_step(3, table)
    progress.at(1)                               # now at op 'relu' of step 3
"""

from __future__ import annotations

import mmap
import os
import random
import struct
import time
from contextlib import contextmanager
from dataclasses import dataclass

from distgraph.runtime.launch.status import RANK_HOSTS, read_status

SIZE = 256
IDLE, STEP, WAITING = 0, 1, 2
# int64 fields at the start of the record: state, step, index, table, waits entered
_STATE, _STEP, _INDEX, _TABLE, _WAITS = range(5)
_INTS = 5
_SINCE = struct.Struct("<d")          # when the current wait began (time.time())
_SINCE_AT = 8 * _INTS
_PHASE_AT, _PHASE_LEN = 48, 64        # the collective API call in progress, if any
_TEXT_AT, _TEXT_LEN = 112, SIZE - 112  # what the rank waits for


def _put_text(mm, at: int, length: int, text: str) -> None:
    raw = text.encode("utf-8", "replace")[:length - 1]
    mm[at:at + len(raw) + 1] = raw + b"\0"


def _get_text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


class NullProgress:
    """Progress of a process that nobody watches: every method does nothing."""

    active = False

    def table(self, labels) -> int:
        return -1

    def begin_step(self, step: int, table: int) -> None:
        pass

    def at(self, index: int) -> None:
        pass

    def end_step(self) -> None:
        pass

    def wait_begin(self, what: str) -> None:
        pass

    def wait_end(self) -> None:
        pass

    @contextmanager
    def phase(self, name: str):
        yield


NO_PROGRESS = NullProgress()


class Progress(NullProgress):
    """This rank's record in ``<folder>/<rank>.progress``."""

    active = True

    def __init__(self, folder: str, rank: int):
        self.folder, self.rank = folder, rank
        path = os.path.join(folder, f"{rank}.progress")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, SIZE)
            self._mm = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self._ints = memoryview(self._mm)[:8 * _INTS].cast("q")
        self._ints[_STEP] = -1
        self._ints[_TABLE] = -1
        self._resume = IDLE
        # Table numbers start at a random point: two runners (or two communicators) of
        # one process never write the same table file.
        self._next_table = random.randrange(1 << 40)

    @classmethod
    def open(cls, folder: str | None, rank: int) -> NullProgress:
        """The record of ``rank`` in ``folder``, or NO_PROGRESS when there is no folder."""
        return cls(folder, rank) if folder else NO_PROGRESS

    def table(self, labels) -> int:
        """Write the names of a runner's instructions once; returns the table's number."""
        number = self._next_table
        self._next_table += 1
        path = os.path.join(self.folder, f"{self.rank}.table-{number}")
        with open(path, "w") as f:
            f.write("\n".join(label.replace("\n", " ") for label in labels))
        return number

    def begin_step(self, step: int, table: int) -> None:
        ints = self._ints
        ints[_STEP], ints[_TABLE], ints[_INDEX], ints[_STATE] = step, table, -1, STEP

    def at(self, index: int) -> None:
        self._ints[_INDEX] = index

    def end_step(self) -> None:
        self._ints[_STATE] = IDLE

    def wait_begin(self, what: str) -> None:
        _put_text(self._mm, _TEXT_AT, _TEXT_LEN, what)
        _SINCE.pack_into(self._mm, _SINCE_AT, time.time())
        self._ints[_WAITS] += 1
        if self._ints[_STATE] != WAITING:    # (a wait given up on is still on record)
            self._resume = self._ints[_STATE]
        self._ints[_STATE] = WAITING

    def wait_end(self) -> None:
        self._ints[_STATE] = self._resume

    @contextmanager
    def phase(self, name: str):
        """Name the collective API call this rank is in (``Engine.state_dict()``). Left
        by an exception (``sys.exit`` in a callback included), the call stays on record:
        it is where the rank was when it failed or ended, which its peers then say."""
        _put_text(self._mm, _PHASE_AT, _PHASE_LEN, name)
        yield
        _put_text(self._mm, _PHASE_AT, _PHASE_LEN, "")


# ---- reading ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Where:
    """A rank's progress as read back: ``state`` is "finished", "failed", "ended",
    "not started", "computing" or "waiting"; ``at`` describes the place."""

    rank: int
    state: str
    step: int
    at: str
    phase: str
    seconds: float

    def __str__(self) -> str:
        phase = f" in {self.phase}" if self.phase else ""
        step = f"step {self.step}, " if self.step >= 0 else ""
        if self.state == "waiting":
            return (f"rank {self.rank} waits{phase} ({step}for {self.seconds:.1f} s) "
                    f"for {self.at}")
        if self.state == "computing":
            place = f"at {step}{self.at}" if self.step >= 0 else self.at
            return f"rank {self.rank} is {place}{phase}, not waiting for any peer"
        return f"rank {self.rank} {self.at}"


def _label(folder: str, rank: int, table: int, index: int) -> str:
    if table < 0:
        return "outside a training step"
    try:
        with open(os.path.join(folder, f"{rank}.table-{table}")) as f:
            labels = f.read().split("\n")
    except OSError:
        return f"instruction {index}"
    if index < 0:
        return "the start of the step"
    if index >= len(labels):
        return "the end of the step (fetching results)"
    return labels[index]


def read_where(folder: str, rank: int) -> Where:
    """Where ``rank`` is, from its status files and progress record."""
    failed = read_status(folder, rank, "failed")
    if failed is not None:       # (its error is reported on its own)
        return Where(rank, "failed", -1, "has failed", "", 0.0)
    done = read_status(folder, rank, "done")
    ended = read_status(folder, rank, "exit")
    raw = _record(folder, rank)
    if done is not None or ended is not None:     # phase: the call it was in at its end
        phase = "" if raw is None else _get_text(raw[_PHASE_AT:_PHASE_AT + _PHASE_LEN])
        if done is not None:
            how = f"ended its script with {done}" if done else "has finished its script"
            return Where(rank, "finished", -1, f"{how} {moment(folder, rank)}", phase, 0.0)
        return Where(rank, "ended", -1, f"has ended ({ended}) {moment(folder, rank)}", phase,
                     0.0)
    if raw is None:
        return Where(rank, "not started", -1, "has not started communicating", "", 0.0)
    state, step, index, table, _ = struct.unpack_from(f"<{_INTS}q", raw)
    phase = _get_text(raw[_PHASE_AT:_PHASE_AT + _PHASE_LEN])
    if state == WAITING:
        since, = _SINCE.unpack_from(raw, _SINCE_AT)
        return Where(rank, "waiting", step, _get_text(raw[_TEXT_AT:]), phase,
                     max(0.0, time.time() - since))
    at = _label(folder, rank, table, index) if state == STEP else "outside a training step"
    return Where(rank, "computing", step if state == STEP else -1, at, phase, 0.0)


def _record(folder: str, rank: int) -> bytes | None:
    """``rank``'s progress record as bytes; None before it has one."""
    try:
        with open(os.path.join(folder, f"{rank}.progress"), "rb") as f:
            raw = f.read(SIZE)
    except OSError:
        return None
    return raw if len(raw) == SIZE else None


def moment(folder: str, rank: int) -> str:
    """When in the job ``rank`` is, or was when it ended, from its record:
    ``before its first collective``, ``in step 3``, ``after step 8``, ``while waiting for
    ...``, followed by the collective API call it is in (``, in Engine.fit()``)."""
    raw = _record(folder, rank)
    if raw is None:
        return "before its first collective"
    state, step, _, _, waits = struct.unpack_from(f"<{_INTS}q", raw)
    phase = _get_text(raw[_PHASE_AT:_PHASE_AT + _PHASE_LEN])
    if state == WAITING:
        place = f"while waiting for {_get_text(raw[_TEXT_AT:])}"
    elif state == STEP:
        place = f"in step {step}"
    elif step >= 0:
        place = f"after step {step}"
    elif waits == 0:
        place = "before its first collective"
    else:
        place = "before its first training step"
    return f"{place}, in {phase}" if phase else place


def last_step(folder: str, rank: int) -> int:
    """The last training step ``rank`` began (its record keeps it between steps); -1
    before its first step or without a record."""
    raw = _record(folder, rank)
    return -1 if raw is None else struct.unpack_from("<2q", raw)[1]


def rank_hosts(env=None) -> tuple[str, ...] | None:
    """Each rank's host in a job over several hosts (from the launcher), else None."""
    text = (os.environ if env is None else env).get(RANK_HOSTS)
    return tuple(text.split(",")) if text else None


def behind(folder: str | None, me: int, peers, hosts=None) -> tuple[str, set]:
    """(a sentence naming the peers that keep ``me`` waiting and where they are, the
    set of their states). Those that finished, failed or are not waiting come first
    (lowest step first: the furthest behind); if every peer waits too, the sentence says
    where each waits (the ranks called collectives in different orders). Peers on other
    hosts (``hosts``: each rank's host, default :func:`rank_hosts`) come last, by host.
    ("", set()) without a status folder."""
    if not folder:
        return "", set()
    hosts = rank_hosts() if hosts is None else hosts
    ranks = [r for r in sorted(set(peers)) if r != me]
    far = [r for r in ranks if hosts and hosts[r] != hosts[me]]
    others = [read_where(folder, r) for r in ranks if r not in far]
    sentence, states = _behind_here(others, "every peer on this host" if far else "every peer")
    if far:
        by_host: dict[str, list[int]] = {}
        for r in far:
            by_host.setdefault(hosts[r], []).append(r)
        there = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} on "
                          f"{host}" for host, rs in by_host.items())
        note = f"{there} (where {'they are' if len(far) > 1 else 'it is'} cannot be read " \
               f"from {hosts[me]})"
        sentence = f"{sentence}; {note}" if sentence else note
        states = states | {"elsewhere"}
    return sentence, states


def _behind_here(others: list, everyone: str) -> tuple[str, set]:
    """:func:`behind` for peers whose records are here (``everyone`` names them all)."""
    if not others:
        return "", set()
    stuck = [w for w in others if w.state not in ("waiting", "failed", "ended")]
    stuck = stuck or [w for w in others if w.state != "waiting"]
    if stuck:
        stuck.sort(key=lambda w: (w.step, w.rank))
        states = {w.state for w in stuck}
        if len(stuck) == 1:
            return str(stuck[0]), states
        names = ", ".join(str(w.rank) for w in stuck)
        return (f"ranks {names} did not reach the matching call: "
                + "; ".join(map(str, stuck)), states)
    lowest = min(w.step for w in others)
    late = [w for w in others if w.step == lowest]
    if lowest >= 0 and len(late) < len(others):
        return "furthest behind: " + "; ".join(map(str, late)), {"waiting"}
    return (f"{everyone} is waiting as well, for different calls: "
            + "; ".join(map(str, others)), {"waiting"})
