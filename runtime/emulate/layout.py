"""The plan of an emulated cluster: which namespaces, addresses and link shapes a job gets.

Pure: :func:`emulated_job` turns a Cluster and a rank count into a :class:`EmulatedJob`;
:mod:`distgraph.runtime.emulate.namespaces` carries it out with ``ip`` and ``tc``.

- Rank r runs on the cluster's r-th device (``cluster.devices[r]``, by global id): the
  Engine's convention, so a rank mapping (logical process -> device) moves processes,
  never ranks. Each machine that hosts a rank becomes one network namespace whose
  hostname is the machine's ``hostname``; ranks on one machine share memory.
- Every namespace of a job is named ``distgraph-<pid>.<start>-<role>``: the launching
  process's pid and start time (clock ticks since boot) say whether the job is still
  alive, so a later run can remove what a killed one left behind. Roles are ``hub`` (the
  bridge and ``mpiexec``) and ``m0``, ``m1``, ... (machines in rank order).
- Addresses come from one /24 under 10.0.0.0/8 picked by a hash of the job (hub ``.1``,
  machine i ``.(i + 2)``), moved on past any /24 already in use here.
- Each ordered pair of machines (a, b) is shaped on a's side to the file's figures
  between their devices: the bottleneck bandwidth and summed latency of the best path
  (``cluster.bandwidth`` / ``cluster.latency``). When the ranks of two machines see
  different figures (several NICs), the pair takes the slowest (least bandwidth, most
  latency), and the layout notes it.

Example::

    >>> from distgraph.resources.cluster import Cluster
    >>> layout = emulated_job(Cluster.from_file("resources/clusters/emulated_2x2.yaml"), 4,
    ...                      job="100.7", subnet="10.1.2")           # doctest: +SKIP
    >>> layout.hosts_argument()                                       # doctest: +SKIP
    '10.1.2.2:2,10.1.2.3:2'
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import os
from dataclasses import dataclass

from distgraph.errors import PlanError

PREFIX = "distgraph-"
HUB_ROLE = "hub"
MAX_MACHINES = 253           # .2 .. .254 of the job's /24


@dataclass(frozen=True)
class EmulatedMachine:
    """One machine of the file as a namespace: its ranks and the devices they run on."""

    index: int
    machine_id: int
    hostname: str
    namespace: str
    address: str
    ranks: tuple[int, ...]
    devices: tuple[int, ...]
    speed: float = 1.0

    @property
    def cpu_cores(self) -> float:
        """The CPU its ranks may use together: a core per rank, times its speed."""
        return len(self.ranks) * self.speed

    def __str__(self):
        ranks = (f"{self.hostname} ({self.namespace}, {self.address}): ranks "
                 f"{', '.join(map(str, self.ranks))}")
        if self.speed == 1.0:
            return ranks
        return f"{ranks}; computes at {self.speed:.3g} x the fastest ({self.cpu_cores:.3g} cores)"


@dataclass(frozen=True)
class PairShape:
    """What traffic from machine ``src`` to machine ``dst`` (indices) is shaped to."""

    src: int
    dst: int
    bandwidth_GBps: float
    latency_us: float

    @property
    def rate_bits(self) -> int:
        """The bandwidth in bit/s, as tc takes it (GB/s = 1e9 bytes/s)."""
        return max(8, round(self.bandwidth_GBps * 8e9))


@dataclass(frozen=True)
class EmulatedJob:
    """Namespaces, addresses, rank placement and link shapes of one emulated job."""

    job: str
    subnet: str
    cluster_name: str
    machines: tuple[EmulatedMachine, ...]
    shapes: tuple[PairShape, ...]
    rank_machine: tuple[int, ...]
    notes: tuple[str, ...] = ()
    speed_dtype: str | None = None

    @property
    def throttled(self) -> bool:
        """Whether some machine computes slower than the fastest (its ranks get a quota)."""
        return any(m.speed < 1.0 for m in self.machines)

    @property
    def hub_namespace(self) -> str:
        return namespace_name(self.job, HUB_ROLE)

    @property
    def hub_address(self) -> str:
        return f"{self.subnet}.1"

    @property
    def namespaces(self) -> list[str]:
        return [self.hub_namespace] + [m.namespace for m in self.machines]

    def machine(self, hostname: str) -> EmulatedMachine:
        for m in self.machines:
            if m.hostname == hostname:
                return m
        raise PlanError(f"machine {hostname!r} hosts no rank of this emulated job; its "
                        f"machines are {', '.join(m.hostname for m in self.machines)}")

    def shape(self, src: int, dst: int) -> PairShape:
        return next(s for s in self.shapes if (s.src, s.dst) == (src, dst))

    def hosts_argument(self) -> str:
        """Hydra's ``-hosts`` list: runs of consecutive ranks on one machine, in rank order
        (a machine whose ranks are not consecutive appears once per run)."""
        runs: list[list] = []
        for m in self.rank_machine:
            if runs and runs[-1][0] == m:
                runs[-1][1] += 1
            else:
                runs.append([m, 1])
        return ",".join(f"{self.machines[m].address}:{k}" for m, k in runs)

    def host_map(self) -> dict[str, list[str]]:
        """address -> [namespace, hostname], what the launcher helper needs."""
        return {m.address: [m.namespace, m.hostname] for m in self.machines}

    def describe(self) -> str:
        head = (f"emulated cluster {self.cluster_name!r}: "
                f"{_count(len(self.machines), 'machine')}, "
                f"{_count(len(self.rank_machine), 'rank')}, addresses {self.subnet}.0/24")
        lines = [head]
        lines += [f"  {m}" for m in self.machines]
        for s in self.shapes:
            if s.src < s.dst:
                lines.append(f"  {self.machines[s.src].hostname} <-> "
                             f"{self.machines[s.dst].hostname}: {s.bandwidth_GBps:g} GB/s, "
                             f"{s.latency_us:g} us")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def namespace_name(job: str, role: str) -> str:
    return f"{PREFIX}{job}-{role}"


def parse_namespace(name: str) -> tuple[int, int, str] | None:
    """(pid, start ticks, role) of one of our namespace names, else None."""
    if not name.startswith(PREFIX):
        return None
    job, _, role = name[len(PREFIX):].partition("-")
    pid, _, start = job.partition(".")
    if not (pid.isdigit() and start.isdigit() and role):
        return None
    return int(pid), int(start), role


def process_start(pid: int) -> int | None:
    """Start time of a live process in clock ticks since boot, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    return int(stat.rsplit(")", 1)[1].split()[19])


def this_job() -> str:
    """The job id of this process: ``<pid>.<start ticks>``."""
    return f"{os.getpid()}.{process_start(os.getpid())}"


def choose_subnet(job: str, taken: set[str]) -> str:
    """A ``10.X.Y`` /24 prefix picked by a hash of ``job``, skipping prefixes in ``taken``
    and the first and last /24 of 10.0.0.0/8 (often used by hand)."""
    start = int.from_bytes(hashlib.sha256(job.encode()).digest()[:2], "big")
    for k in range(1 << 16):
        x, y = divmod((start + k) % (1 << 16), 256)
        prefix = f"10.{x}.{y}"
        if prefix not in taken and (x, y) not in ((0, 0), (255, 255)):
            return prefix
    raise PlanError("every /24 under 10.0.0.0/8 is in use here; remove some networks")


def subnets_of(cidrs) -> set[str]:
    """The 10.X.Y /24 prefixes that the IPv4 networks ``cidrs`` ("a.b.c.d/n") overlap."""
    out: set[str] = set()
    ten = ipaddress.ip_network("10.0.0.0/8")
    for cidr in cidrs:
        net = ipaddress.ip_network(cidr, strict=False)
        if not net.overlaps(ten):
            continue
        net = ten if net.prefixlen < 8 else net
        subs = net.subnets(new_prefix=24) if net.prefixlen < 24 else [net.supernet(new_prefix=24)]
        out.update("10.{1}.{2}".format(*s.network_address.packed) for s in subs)
    return out


def emulated_job(cluster, nprocs: int, job: str, subnet: str) -> EmulatedJob:
    """The layout of ``nprocs`` ranks on ``cluster`` (see the module docstring)."""
    devices = cluster.devices
    if not isinstance(nprocs, int) or nprocs < 1:
        raise PlanError(f"cannot emulate {nprocs!r} ranks: -n must be at least 1")
    if nprocs > len(devices):
        raise PlanError(f"cluster {cluster.name!r} has {len(devices)} devices, so it can run at "
                        f"most {len(devices)} ranks (rank r on its r-th device); got -n "
                        f"{nprocs}")
    order: list[int] = []           # machine ids in order of their first rank
    rank_mid = []
    for d in devices[:nprocs]:
        mid = cluster.machine_of(d.global_id).id
        if mid not in order:
            order.append(mid)
        rank_mid.append(mid)
    if len(order) > MAX_MACHINES:
        raise PlanError(f"an emulated job holds at most {MAX_MACHINES} machines; ranks "
                        f"{nprocs} span {len(order)}")
    by_id = {m.id: m for m in cluster.machines}
    names = [by_id[mid].hostname for mid in order]
    if len(set(names)) != len(names):
        raise PlanError(f"cluster {cluster.name!r}: machines share a hostname ({names}); "
                        "each emulated machine needs its own")
    machines = tuple(
        EmulatedMachine(i, mid, by_id[mid].hostname, namespace_name(job, f"m{i}"),
                        f"{subnet}.{i + 2}",
                        tuple(r for r in range(nprocs) if rank_mid[r] == mid),
                        tuple(devices[r].global_id for r in range(nprocs) if rank_mid[r] == mid))
        for i, mid in enumerate(order))
    shapes, notes = [], []
    for a in machines:
        for b in machines:
            if a is b:
                continue
            pairs = [(da, db) for da in a.devices for db in b.devices]
            bws = {cluster.bandwidth(da, db) for da, db in pairs}
            lats = {cluster.latency(da, db) for da, db in pairs}
            if (len(bws) > 1 or len(lats) > 1) and a.index < b.index:
                notes.append(f"{a.hostname} <-> {b.hostname}: the ranks' devices see "
                             f"{sorted(bws)} GB/s and {sorted(lats)} us; one namespace "
                             f"link takes the slowest")
            shapes.append(PairShape(a.index, b.index, min(bws), max(lats)))
    dtype, speeds, speed_notes = machine_speeds(cluster, machines)
    machines = tuple(dataclasses.replace(m, speed=s) for m, s in zip(machines, speeds))
    index_of = {m.machine_id: m.index for m in machines}
    return EmulatedJob(job, subnet, cluster.name, machines, tuple(shapes),
                  tuple(index_of[mid] for mid in rank_mid), tuple(notes + speed_notes), dtype)


def machine_speeds(cluster, machines) -> tuple[str, list[float], list[str]]:
    """(the dtype compared, each machine's speed as a share of the fastest device, notes).

    A machine's speed is the mean of its ranks' devices' shares of the file's fastest
    device (its ranks share one quota); the dtype is float32 where every device lists it,
    else the first dtype they all list (resource files give every compute device's gflops)."""
    devices = [cluster.device(g) for m in machines for g in m.devices]
    common = set.intersection(*(set(d.gflops) for d in devices))
    if not common:
        raise PlanError(f"cluster {cluster.name!r}: no dtype appears in every device's gflops "
                        f"({', '.join(sorted({k for d in devices for k in d.gflops}))}); give "
                        "each device's float32 rate so emulated machines can be compared")
    dtype = "float32" if "float32" in common else sorted(common)[0]
    # the file's fastest, not the job's: fewer ranks see the same speeds
    fastest = max(d.gflops.get(dtype, 0.0) for d in cluster.devices)
    speeds, notes = [], []
    for m in machines:
        shares = [cluster.device(g).gflops[dtype] / fastest for g in m.devices]
        if len(set(shares)) > 1:
            notes.append(f"{m.hostname}: its ranks' devices differ in speed ({sorted(shares)} "
                         "of the fastest); they share one quota at their mean")
        speeds.append(sum(shares) / len(shares))
    return dtype, speeds, notes


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"
