"""The status folder of a launched job: what each rank and its supervisor leave there.

The launcher makes a private folder per job and names it to every rank in
``DISTGRAPH_STATUS_DIR`` (and the per-rank log folder in ``DISTGRAPH_LOG_DIR``). Files,
each named after the rank (``PMI_RANK``):

- ``<rank>.pids``     the supervisor's and the rank's process ids, written at start;
- ``<rank>.host``     the name of the host the rank runs on (by its supervisor);
- ``<rank>.mpi``      ``starting`` while the rank waits in MPI's start for its peers,
  ``running`` once MPI runs (by the rank's bootstrap, before the script);
- ``<rank>.files``    the files MPI made for the job that outlive a rank killed before
  ``MPI_Finalize`` (its shared-memory segments, its proxy's topology file), one per
  line, for the launcher to remove (see :mod:`distgraph.runtime.launch.hostside`);
- ``<rank>.failed``   the one-line error of an uncaught exception, or of ``sys.exit``
  with a non-zero code (by the rank);
- ``<rank>.done``     the script ended well: it returned (empty), or how it ended
  early (``sys.exit(0)``) (by the rank);
- ``<rank>.exit``     how the rank's process ended (by its supervisor: ``exited with
  code 0``, ``killed by signal 9``); alone, without ``done`` or ``failed``, the rank
  ended without a word (killed, crashed, ``os._exit``);
- ``<rank>.progress`` where the rank is (see :mod:`distgraph.runtime.launch.progress`).

On a job over several hosts each host keeps its ranks' files in a folder of its own at
the same path, and the launcher brings them together after the job
(:mod:`distgraph.runtime.launch.remote`).

Reading them back::

    states = read_states(folder, nprocs)
    print("\\n".join(failure_lines(states)))
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from distgraph.errors import RuntimeFault

STATUS_DIR = "DISTGRAPH_STATUS_DIR"
LOG_DIR = "DISTGRAPH_LOG_DIR"
CLUSTER_VAR = "DISTGRAPH_CLUSTER"     # the resource file of ``distgraph run --cluster``
RANK_HOSTS = "DISTGRAPH_RANK_HOSTS"   # over several hosts: each rank's host, comma-separated
TIMEOUT_VAR = "DISTGRAPH_COMM_TIMEOUT"
DEFAULT_TIMEOUT = 60.0


def default_timeout(env=None) -> float:
    """Seconds a rank may wait for its peers (a receive, a collective, MPI's start):
    $DISTGRAPH_COMM_TIMEOUT of ``env`` (default: this process's), else 60."""
    raw = (os.environ if env is None else env).get(TIMEOUT_VAR)
    if raw is None:
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        raise RuntimeFault(f"{TIMEOUT_VAR}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise RuntimeFault(f"{TIMEOUT_VAR}={raw!r} must be positive")
    return value


def env_rank() -> str:
    """This process's rank as the MPI launcher set it (readable before MPI starts)."""
    return os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "?"))


def get_rank() -> int:
    """This script's rank in the job as its launcher (``distgraph run``, ``mpiexec``) set
    it, readable before an Engine or MPI exists (``dg.get_rank()``: e.g. rank 0 writes a
    file the others read); 0 when the script runs alone."""
    rank = env_rank()
    return 0 if rank == "?" else int(rank)


def get_world_size() -> int:
    """How many ranks the job has, as its launcher set it (``dg.get_world_size()``); 1
    when the script runs alone."""
    return int(os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", 1)))


def status_folder() -> str | None:
    return os.environ.get(STATUS_DIR) or None


def log_path(rank=None) -> str | None:
    """This rank's log file under the launcher (None when not launched by it)."""
    folder = os.environ.get(LOG_DIR)
    if not folder:
        return None
    return os.path.join(folder, f"rank-{env_rank() if rank is None else rank}.log")


def write_status(kind: str, text: str = "", folder: str | None = None) -> None:
    """Write ``<rank>.<kind>`` in the status folder (nothing when there is none)."""
    folder = folder or status_folder()
    if folder:     # whole or not at all: a rank may be killed while it writes
        path = os.path.join(folder, f"{env_rank()}.{kind}")
        with open(f"{path}.tmp", "w") as f:
            f.write(text)
        os.replace(f"{path}.tmp", path)


def read_status(folder: str, rank, kind: str) -> str | None:
    try:
        with open(os.path.join(folder, f"{rank}.{kind}")) as f:
            return f.read()
    except OSError:
        return None


@dataclass(frozen=True)
class RankState:
    """How one rank ended (or where it is): the contents of its status files."""

    rank: int
    failed: str | None
    done: bool
    exit: str | None
    pids: tuple
    host: str | None = None
    mpi: str | None = None          # ``starting``, ``running``; None: MPI not begun

    @property
    def silent(self) -> bool:
        """The rank's process ended without finishing its script or saying why."""
        return self.exit is not None and self.failed is None and not self.done


def read_states(folder: str, nprocs: int) -> list[RankState]:
    states = []
    for rank in range(nprocs):
        pids = read_status(folder, rank, "pids") or ""
        states.append(RankState(rank, read_status(folder, rank, "failed"),
                                read_status(folder, rank, "done") is not None,
                                read_status(folder, rank, "exit"),
                                tuple(int(p) for p in pids.split() if p.isdigit()),
                                read_status(folder, rank, "host"),
                                read_status(folder, rank, "mpi")))
    return states


def _ranks(states: list[RankState], hosts: bool) -> str:
    """``rank 1`` / ``ranks 1, 2``, with ``on HOST`` after each when ``hosts``."""
    def one(s):
        return f"{s.rank} on {s.host or 'an unknown host'}" if hosts else str(s.rank)
    return f"rank {one(states[0])}" if len(states) == 1 else \
        f"ranks {', '.join(map(one, states))}"


def _cause(state: RankState) -> str:
    """The error of a failed rank without the rank's own name in front (``RuntimeFault:
    rank 2 (process 1): ...`` -> ``RuntimeFault: ...``): ranks that failed alike then
    group under one line, which names them anyway."""
    kind, sep, text = state.failed.partition(": ")
    own = re.match(rf"rank {state.rank}(?: \(process \d+\))?: ", text)
    return f"{kind}{sep}{text[own.end():]}" if sep and own else state.failed


def failure_lines(states: list[RankState], hosts: bool = False,
                  moments: dict | None = None) -> list[str]:
    """One line per distinct cause: the ranks that failed with the same error together
    (an error that names the rank raising it counts as the same for every rank; a lone
    rank's keeps its words), then each rank that died without a word, with where it was
    when ``moments`` (rank -> ``in step 3``, see
    :func:`~distgraph.runtime.launch.progress.moment`) has it; each rank named with its
    host when ``hosts`` (a job over several hosts)."""
    by_error: dict[str, list[RankState]] = {}
    for s in states:
        if s.failed is not None:
            by_error.setdefault(_cause(s), []).append(s)
    # an error of several lines keeps them, indented under the first
    lines = [f"{_ranks(ranks, hosts)} failed: "
             + (error if len(ranks) > 1 else ranks[0].failed).rstrip("\n").replace("\n", "\n  ")
             for error, ranks in by_error.items()]
    for s in states:
        if s.silent:
            where = (moments or {}).get(s.rank)
            lines.append(f"{_ranks([s], hosts)} died without reporting an error ({s.exit}"
                         f"{' ' + where if where else ''}); the other ranks were stopped "
                         "after it")
    return lines
