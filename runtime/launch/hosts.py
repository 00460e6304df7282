"""Which host each rank of a job runs on: MPICH host files, ``--hosts`` lists and a
resource file's machines, turned into one :class:`HostAssignment` (rank r -> host).

Pure: parsing and values; :mod:`distgraph.runtime.launch.launcher` hands the assignment
to hydra as ``-hosts`` and :mod:`distgraph.runtime.launch.remote` reaches the hosts.

- A host file (MPICH's format, also what ``$HYDRA_HOST_FILE`` names): one ``host[:slots]``
  per line, ``#`` starts a comment, blank lines are skipped, slots default to 1.
- ``--hosts a:2,b:2``: the same entries, separated by commas.
- Ranks fill the slots in order, host by host; with more ranks than slots the filling
  starts again at the first host, as hydra does (the ranks then share the hosts' cores).
- A resource file: rank r runs on the machine of the cluster's r-th device (the Engine's
  convention: rank r owns ``cluster.devices[r]``; the rank mapping chooses which logical
  process runs on which device, hence on which rank), reached at the machine's ``addr``
  when it has one, else at its ``hostname``.

Example::

    >>> p = place_on_slots(parse_hosts("a:2,b:2"), 4, "--hosts a:2,b:2")
    >>> p.hosts, p.hydra_hosts()
    (('a', 'a', 'b', 'b'), 'a:2,b:2')
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from distgraph.errors import PlanError

_ENTRY = re.compile(r"^(?P<host>[A-Za-z0-9_.\-]+)(?::(?P<slots>\d+))?$")
FORMAT = "one 'host' or 'host:slots' per entry (slots a whole number >= 1)"


@dataclass(frozen=True)
class HostSlots:
    """One entry of a host list: ``slots`` ranks go to ``host`` before the next host."""

    host: str
    slots: int = 1

    def __str__(self):
        return f"{self.host}:{self.slots}"


@dataclass(frozen=True)
class HostAssignment:
    """Rank r runs on ``hosts[r]``. From a resource file, ``devices[r]`` is the global id
    of rank r's device and ``machines[r]`` its machine's hostname; ``source`` says where
    the assignment came from (``--hostfile FILE``, ``--hosts LIST``, ``--cluster FILE``)."""

    hosts: tuple[str, ...]
    source: str
    devices: tuple[int, ...] = ()
    machines: tuple[str, ...] = ()

    @property
    def nprocs(self) -> int:
        return len(self.hosts)

    @property
    def distinct_hosts(self) -> tuple[str, ...]:
        """The hosts in order of their first rank."""
        return tuple(dict.fromkeys(self.hosts))

    def ranks_on(self, host: str) -> tuple[int, ...]:
        return tuple(r for r, h in enumerate(self.hosts) if h == host)

    def hydra_hosts(self) -> str:
        """hydra's ``-hosts`` list for exactly this assignment: runs of consecutive ranks
        on one host, in rank order (a host whose ranks are not consecutive appears once
        per run)."""
        runs: list[list] = []
        for host in self.hosts:
            if runs and runs[-1][0] == host:
                runs[-1][1] += 1
            else:
                runs.append([host, 1])
        return ",".join(f"{host}:{count}" for host, count in runs)

    def describe(self) -> str:
        """Which rank goes to which host (and device), one line per rank."""
        hosts = self.distinct_hosts
        lines = [f"{self.nprocs} rank{'s' if self.nprocs != 1 else ''} on {len(hosts)} "
                 f"host{'s' if len(hosts) != 1 else ''} ({self.source}):"]
        width = max(len(h) for h in self.hosts)
        for r, host in enumerate(self.hosts):
            line = f"  rank {r:<{len(str(self.nprocs - 1))}}  {host:<{width}}"
            if self.devices:
                machine = self.machines[r]
                named = f" (machine {machine})" if machine != host else ""
                line += f"  device {self.devices[r]}{named}"
            lines.append(line.rstrip())
        return "\n".join(lines)


def parse_entry(text: str, where: str) -> HostSlots:
    """One ``host[:slots]`` entry; ``where`` names it in the error."""
    m = _ENTRY.match(text.strip())
    if m is None or (m["slots"] is not None and int(m["slots"]) < 1):
        raise PlanError(f"{where}: {text.strip()!r} is not a host entry; expected {FORMAT}, "
                        "e.g. 'node0:2'")
    return HostSlots(m["host"], int(m["slots"]) if m["slots"] is not None else 1)


def parse_hosts(text: str) -> tuple[HostSlots, ...]:
    """``--hosts a:2,b:2`` as entries."""
    items = text.split(",")
    if not text.strip() or any(not t.strip() for t in items):
        raise PlanError(f"--hosts {text!r}: expected comma-separated entries, {FORMAT}, "
                        "e.g. --hosts node0:2,node1:2")
    return tuple(parse_entry(t, f"--hosts {text}") for t in items)


def parse_hostfile(path: str) -> tuple[HostSlots, ...]:
    """An MPICH host file as entries; errors name the file and line."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as err:
        raise PlanError(f"{path}: cannot read the host file ({err.strerror}); give an MPICH "
                        "host file, one 'host[:slots]' per line") from None
    entries = []
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if text:
            entries.append(parse_entry(text, f"{path}, line {number}"))
    if not entries:
        raise PlanError(f"{path}: the host file names no host; write one 'host[:slots]' "
                        "per line")
    return tuple(entries)


def place_on_slots(entries, nprocs: int, source: str) -> HostAssignment:
    """Ranks 0..nprocs-1 on ``entries`` (see the module docstring)."""
    if nprocs < 1:
        raise PlanError(f"cannot launch {nprocs} processes: -n must be at least 1")
    slots = [e.host for e in entries for _ in range(e.slots)]
    return HostAssignment(tuple(slots[r % len(slots)] for r in range(nprocs)), source)


def place_on_cluster(cluster, nprocs: int, source: str) -> HostAssignment:
    """Rank r on the machine of ``cluster.devices[r]`` (see the module docstring)."""
    devices = cluster.devices
    if nprocs > len(devices):
        raise PlanError(f"{source}: the cluster has {len(devices)} devices but -n {nprocs} "
                        f"starts {nprocs} ranks (one per device); use -n {len(devices)} or a "
                        "larger cluster")
    machines = [cluster.machine_of(d.global_id) for d in devices[:nprocs]]
    return HostAssignment(tuple(m.addr or m.hostname for m in machines), source,
                     tuple(d.global_id for d in devices[:nprocs]),
                     tuple(m.hostname for m in machines))


def assign_hosts(nprocs: int, hostfile: str | None = None, hosts: str | None = None,
                     cluster=None, cluster_file: str | None = None,
                     env=None) -> HostAssignment | None:
    """Where the ranks of ``distgraph run`` go: ``--hostfile``, else ``--hosts``, else the
    machines of the ``--cluster`` file (``cluster``, loaded from ``cluster_file``), else
    ``$HYDRA_HOST_FILE`` of ``env``; None when none is given (every rank on this host)."""
    if hostfile and hosts:
        raise PlanError("give either --hostfile FILE or --hosts LIST, not both")
    if hostfile:
        return place_on_slots(parse_hostfile(hostfile), nprocs, f"--hostfile {hostfile}")
    if hosts:
        return place_on_slots(parse_hosts(hosts), nprocs, f"--hosts {hosts}")
    if cluster is not None:
        return place_on_cluster(cluster, nprocs, f"--cluster {cluster_file}")
    named = (env or {}).get("HYDRA_HOST_FILE")
    if named:
        return place_on_slots(parse_hostfile(named), nprocs, f"HYDRA_HOST_FILE={named}")
    return None
