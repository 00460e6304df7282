"""The values of the resource graph: devices, links, switches, machines, device meshes.

All are frozen dataclasses, validated at construction; the Cluster (``cluster.py``)
checks what needs the whole picture. Units: memory GB, compute GFLOP/s per dtype,
bandwidth GB/s (10^9 bytes/s), latency µs.

Example::

    >>> Link(3, 1, bandwidth=300, latency=2, type="NVL").endpoints   # stored sorted
    (1, 3)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Mapping

from distgraph.errors import ResourceFileError
from distgraph.plan.kinds import ALL_TO_ALLV, RING_ROUND, StepKind

COMPUTE_TYPES = ("CPU", "GPU", "XPU", "NPU", "DCU", "MLU", "IPU", "TPU")
NETWORK_TYPES = ("NIC",)
DEVICE_TYPES = COMPUTE_TYPES + NETWORK_TYPES
# What an accelerator's training process cannot hand to its arrays, by default
# (resources/README.md, "Usable memory", gives the sources): a fixed part for the runtime's
# context (a CUDA context holds some 0.3-0.5 GB with lazy module loading) and the
# communicators' buffers (an NCCL communicator some 0.5-0.7 GB on A100s, a process of a
# 3-D plan is in several), and a share of the device for the caching allocator's slack
# (reserved but unallocated blocks: a few % of a full device).
RESERVE_FIXED_GB = 2.0
RESERVE_SHARE = 0.05
RESERVE_EXPECTED = ("a number of GB >= 0 and below the device's memory: what its process "
                    "cannot hand to its arrays (the runtime's context, the communicators' "
                    "buffers, the allocator's slack)")


OVERLAP_EXPECTED = ("a share from 0 to 1 of a collective's wire seconds hidden behind "
                    "compute (1: all of it)")


def default_reserve(device_type: str, memory: float) -> float:
    """GB of a device's ``memory`` (GB) its process cannot fill, where the resource file
    gives no ``reserved_memory``: ``RESERVE_FIXED_GB`` + ``RESERVE_SHARE`` of the memory on
    an accelerator, at most half of it (a device of a few GB is a share of a GPU that
    several ranks use, or a test's figure: half stays usable); 0 on a CPU, whose figure in
    a file is already the host memory a rank may use, its heap what the estimate counts
    (no device context, no communicator buffers in device memory), and on a NIC.

    Example::

        >>> default_reserve("GPU", 80.0), default_reserve("GPU", 2.0), default_reserve("CPU", 4.0)
        (6.0, 1.0, 0.0)
    """
    if device_type not in COMPUTE_TYPES or device_type == "CPU":
        return 0.0
    return min(RESERVE_FIXED_GB + RESERVE_SHARE * memory, memory / 2)


class FrozenMap(dict):
    """A read-only, hashable dict (GFLOP/s per dtype, calibration figures)."""

    def __hash__(self):
        return hash(tuple(sorted(self.items())))

    def _read_only(self, *args, **kwargs):
        raise TypeError(f"{type(self).__name__} is read-only; build a new one instead")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _read_only
    __ior__ = _read_only

    def __reduce__(self):
        return (type(self), (dict(self),))


class InvalidCluster(ResourceFileError):
    """A structural problem found while building a Cluster; ``key`` is the schema key path.

    The file loader catches it and adds the file name and line.
    """

    def __init__(self, key: str, problem: str, expected: str):
        super().__init__(f"{key}: {problem}; expected {expected}")
        self.key = key
        self.problem = problem
        self.expected = expected


def _set(obj, name, value):
    # Frozen dataclasses normalise their own fields once, in __post_init__.
    object.__setattr__(obj, name, value)


def _per_step_and_byte(cost) -> tuple:
    """A reshard step kind's software cost as ``(µs per step, ns per byte)``; a number is
    the µs per step alone."""
    if isinstance(cost, (int, float)):
        return (float(cost), 0.0)
    a, b = cost
    return (float(a), float(b))


@dataclass(frozen=True)
class GemmCurve:
    """How a device's GEMM rate depends on the GEMM's shape (the cost model's
    :func:`~distgraph.passes.cost.compute.gemm_seconds` reads it): the device runs a GEMM
    as output tiles, ``units`` at a time (a GPU's SMs; one BLAS thread's core), each tile
    at most ``tile`` = (rows, columns) and stepping through the contracted dim k with a
    cost per tile of ``k_fill`` more steps (loading its first operands, writing its
    result). A smaller tile reuses each element it loads fewer times: one with
    ``r x c / (r + c)`` below ``reuse`` runs at that fraction of a unit's rate (0: every
    tile at the full rate). With ``units`` > 1 a GEMM of few tiles splits k over several
    (``split-K``) to fill the units. The rate of a unit is the device's GFLOP/s of the
    dtype over ``units``: the large-GEMM rate the curve tends to.

    Example: ``GemmCurve(132, (256, 128), 160, 56)`` (an H100's, fitted to XLA's
    published table of cuBLAS GEMM rates: resources/clusters/h100_16384.yaml).
    """

    units: int = 1
    tile: tuple = (256, 128)
    k_fill: float = 0.0
    reuse: float = 0.0

    def __post_init__(self):
        _set(self, "tile", tuple(int(t) for t in self.tile))
        if int(self.units) < 1 or len(self.tile) != 2 or min(self.tile) < 1:
            raise InvalidCluster("gemm", f"units {self.units}, tile {self.tile}",
                                 "units >= 1 and a tile of two positive sizes")
        if not (self.k_fill >= 0 and self.reuse >= 0):
            raise InvalidCluster("gemm", f"k_fill {self.k_fill}, reuse {self.reuse}",
                                 "k_fill >= 0 and reuse >= 0")
        _set(self, "units", int(self.units))
        _set(self, "k_fill", float(self.k_fill))
        _set(self, "reuse", float(self.reuse))


@dataclass(frozen=True)
class Device:
    """One device. ``gflops`` maps a dtype name to GFLOP/s; ``memory`` is in GB;
    ``memory_bandwidth`` (GB/s) and ``op_overhead`` (µs per op launch: added to an op's
    work on a CPU, the op's least time on a GPU, whose launches are queued) feed the cost
    model and are None where the file does not give them (it then uses defaults per type);
    ``op_costs`` maps an op type to its measured ``(µs per call, ns per unit of work)``
    (work: FLOPs of a matmul, else elements read and written; see
    :func:`distgraph.registry.op_work`), which the cost model prefers;
    ``reshard_overhead`` maps a reshard step kind (``all_reduce``, ``slice``, ...) to the
    ``(µs per step, ns per byte of its buffer)`` of software one such step costs beyond
    its messages' alpha-beta (the runtime's own copies; a file may give the µs alone;
    the µs are a 2-process step's; a collective over more pays ``ring_round`` µs for
    each further round of its ring, or, without that entry, the step's µs again);
    ``sliced``: one collective inside MeshSlice's sliced pipeline (µs per step), and the
    ns per byte a partial GeMM reads again; ``gemm``: how its GEMM rate depends on a
    GEMM's m, n and k (a :class:`GemmCurve`; None: every GEMM at the GFLOP/s of its
    dtype, or at its memory bandwidth where that is slower); ``reserved_memory``: GB of
    ``memory`` the process cannot hand to its arrays (the resource file's; None: the
    default for the type, :func:`default_reserve`): what the planner may fill is
    :meth:`usable_memory`; ``overlap_efficiency``: the share (0 to 1) of a collective's
    seconds on the wires that its process hides behind compute when the runtime overlaps
    them (``Strategy(overlap=True)``; on CPUs whose cores also move the bytes, measured by
    ``distgraph cluster calibrate``; None: all of it, :attr:`hides`).

    Example: ``Device(0, 0, 0, "GPU", "A100-SXM4-40GB", {"float32": 19500}, 40)``
    (``.reserve`` 4.0 GB, ``.usable_memory()`` 36.0 GB).
    """

    global_id: int
    local_id: int
    machine_id: int
    type: str
    model: str = ""
    gflops: Mapping[str, float] = field(default_factory=FrozenMap)
    memory: float = 0.0
    memory_bandwidth: float | None = None
    op_overhead: float | None = None
    op_costs: Mapping[str, tuple] | None = None
    reshard_overhead: Mapping[str, tuple] | None = None
    gemm: GemmCurve | None = None
    reserved_memory: float | None = None
    overlap_efficiency: float | None = None

    def __post_init__(self):
        if self.type not in DEVICE_TYPES:
            raise InvalidCluster(f"device {self.global_id}.type",
                                 f"unknown device type {self.type!r}",
                                 f"one of {', '.join(DEVICE_TYPES)}")
        _set(self, "gflops", FrozenMap({str(k): float(v) for k, v in self.gflops.items()}))
        _set(self, "memory", float(self.memory))
        if self.reshard_overhead is not None:
            _set(self, "reshard_overhead", FrozenMap({str(k): _per_step_and_byte(v) for k, v
                                                      in self.reshard_overhead.items()}))
            if self.reshard_overhead.get(RING_ROUND, (0.0, 0.0))[1]:
                raise InvalidCluster(f"device {self.global_id}.reshard_overhead.{RING_ROUND}",
                                     f"got {self.reshard_overhead[RING_ROUND]}",
                                     "µs per further ring round alone (no cost per byte)")
        if self.op_costs is not None:
            _set(self, "op_costs", FrozenMap({str(k): (float(a), float(b))
                                              for k, (a, b) in self.op_costs.items()}))
        if self.reserved_memory is not None:
            reserve = float(self.reserved_memory)
            if not (math.isfinite(reserve) and 0 <= reserve < self.memory):
                raise InvalidCluster(f"device {self.global_id}.reserved_memory",
                                     f"got {reserve:g} of a device of {self.memory:g} GB",
                                     RESERVE_EXPECTED)
            _set(self, "reserved_memory", reserve)
        if self.overlap_efficiency is not None:
            share = float(self.overlap_efficiency)
            if not 0 <= share <= 1:
                raise InvalidCluster(f"device {self.global_id}.overlap_efficiency",
                                     f"got {share:g}", OVERLAP_EXPECTED)
            _set(self, "overlap_efficiency", share)

    @property
    def hides(self) -> float:
        """The share of a collective's wire seconds its process hides behind compute:
        the file's ``overlap_efficiency``, else 1 (the wires and DMA engines move the
        bytes while the processor computes)."""
        return 1.0 if self.overlap_efficiency is None else self.overlap_efficiency

    @property
    def reserve(self) -> float:
        """GB of its memory the process cannot fill: the file's ``reserved_memory``, else
        the default for its type (:func:`default_reserve`)."""
        if self.reserved_memory is not None:
            return self.reserved_memory
        return default_reserve(self.type, self.memory)

    def usable_memory(self, budget_gb: float | None = None) -> float:
        """GB the planner may fill on this device: its memory less :attr:`reserve`, and at
        most ``budget_gb`` where given (``Strategy(memory_budget_gb)``, which can only
        lower it). Every limit the planner fits a plan to is this one.

        Example::

            >>> d = Device(0, 0, 0, "GPU", "A100", {"bfloat16": 312000}, 80)
            >>> d.usable_memory(), d.usable_memory(budget_gb=40)
            (74.0, 40)
        """
        usable = self.memory - self.reserve
        return usable if budget_gb is None else min(usable, budget_gb)

    @property
    def memory_text(self) -> str:
        """Its memory in words: ``"80 GB, 74 GB usable"``; ``"4 GB"`` where all of it is."""
        usable = self.usable_memory()
        if usable == self.memory:
            return f"{self.memory:g} GB"
        return f"{self.memory:g} GB, {usable:.4g} GB usable"

    @property
    def is_compute(self) -> bool:
        return self.type in COMPUTE_TYPES

    def flops(self, dtype: str = "float32") -> float:
        """FLOP/s for ``dtype`` (0.0 when the device does not list it)."""
        return self.gflops.get(dtype, 0.0) * 1e9

    def __str__(self):
        return f"{self.type}{self.global_id}"


@dataclass(frozen=True)
class Link:
    """An undirected link; endpoints are stored with ``source < target``.

    ``bandwidth`` in GB/s (> 0), ``latency`` in µs (>= 0), ``type`` a free label such as
    ``NVL``, ``PCIe``, ``NET`` or ``SHM``.
    """

    source: int
    target: int
    bandwidth: float
    latency: float
    type: str = ""

    def __post_init__(self):
        if self.source == self.target:
            raise InvalidCluster(f"link {self.source}-{self.target}",
                                 "both endpoints are the same", "two different endpoints")
        if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)):
            raise InvalidCluster(f"link {self.source}-{self.target}.bandwidth",
                                 f"got {self.bandwidth}", "a finite number of GB/s > 0")
        if not (self.latency >= 0 and math.isfinite(self.latency)):
            raise InvalidCluster(f"link {self.source}-{self.target}.latency",
                                 f"got {self.latency}", "a finite number of µs >= 0")
        if self.source > self.target:
            a, b = self.target, self.source
            _set(self, "source", a)
            _set(self, "target", b)
        _set(self, "bandwidth", float(self.bandwidth))
        _set(self, "latency", float(self.latency))

    @property
    def endpoints(self) -> tuple[int, int]:
        return (self.source, self.target)


@dataclass(frozen=True)
class LinkGroup:
    """Every pair of ``members`` joined alike (``bandwidth`` GB/s, ``latency`` µs): a
    resource file's ``group`` link, or the shared memory of a machine whose devices the
    file joins by nothing. It is held as one value, not ``n (n - 1) / 2`` links, so a
    machine of 10,000 devices all linked to each other costs 10,000 ids. ``members`` are
    stored sorted.

    Example::

        >>> g = LinkGroup((2, 0, 1), bandwidth=300, latency=2, type="NVL")
        >>> g.members, g.count, [ln.endpoints for ln in g.links()]
        ((0, 1, 2), 3, [(0, 1), (0, 2), (1, 2)])
    """

    members: tuple[int, ...]
    bandwidth: float
    latency: float
    type: str = ""

    def __post_init__(self):
        members = tuple(sorted(int(m) for m in self.members))
        where = f"link group {_ranges(members)}"
        if len(members) < 2 or len(set(members)) != len(members):
            raise InvalidCluster(where, f"got members {list(self.members)}",
                                 "at least two different endpoints")
        if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)):
            raise InvalidCluster(f"{where}.bandwidth", f"got {self.bandwidth}",
                                 "a finite number of GB/s > 0")
        if not (self.latency >= 0 and math.isfinite(self.latency)):
            raise InvalidCluster(f"{where}.latency", f"got {self.latency}",
                                 "a finite number of µs >= 0")
        _set(self, "members", members)
        _set(self, "bandwidth", float(self.bandwidth))
        _set(self, "latency", float(self.latency))

    @property
    def endpoints(self) -> tuple[int, ...]:
        return self.members

    @property
    def count(self) -> int:
        """The links it stands for."""
        return len(self.members) * (len(self.members) - 1) // 2

    def links(self):
        """Its links, one per pair of members (an iterator: there may be millions)."""
        m = self.members
        for i, a in enumerate(m):
            for b in m[i + 1:]:
                yield Link(a, b, self.bandwidth, self.latency, self.type)


def clique(members, bandwidth: float, latency: float, type: str = "") -> "Link | LinkGroup":
    """Every pair of ``members`` joined alike: one Link for two, else a LinkGroup."""
    members = tuple(members)
    if len(members) == 2:
        return Link(members[0], members[1], bandwidth, latency, type)
    return LinkGroup(members, bandwidth, latency, type)


class Links(Sequence):
    """The links of a machine or between machines, as given: ``pairs`` (Link) and
    ``groups`` (LinkGroup). Read as a sequence it is every link they make, the pairs
    first, then each group's (``len``, indexing and iteration make a group's links as
    they go); code that must scale reads ``pairs`` and ``groups`` (``elements``: both).
    Equal to Links (or a sequence of links) that make the same links, however written."""

    def __init__(self, items=()):
        pairs, groups = [], []
        for item in items:
            if isinstance(item, Links):
                pairs += item.pairs
                groups += item.groups
            elif isinstance(item, LinkGroup):
                groups.append(item)
            elif isinstance(item, Link):
                pairs.append(item)
            else:
                raise InvalidCluster("links", f"got {item!r}", "Link or LinkGroup values")
        self.pairs, self.groups = tuple(pairs), tuple(groups)

    @property
    def elements(self) -> tuple:
        return self.pairs + self.groups

    def __len__(self) -> int:
        return len(self.pairs) + sum(g.count for g in self.groups)

    def __iter__(self):
        yield from self.pairs
        for g in self.groups:
            yield from g.links()

    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(self)[index]
        n = len(self)
        k = index + n if index < 0 else index
        if not 0 <= k < n:
            raise IndexError("link index out of range")
        if k < len(self.pairs):
            return self.pairs[k]
        k -= len(self.pairs)
        for g in self.groups:
            if k < g.count:
                return next(itertools.islice(g.links(), k, None))
            k -= g.count
        raise IndexError("link index out of range")

    def __eq__(self, other):
        if isinstance(other, (tuple, list)):
            other = Links(other)
        if not isinstance(other, Links):
            return NotImplemented
        if self.pairs == other.pairs and self.groups == other.groups:
            return True
        # the same links written otherwise (a group, or its pairs one by one)
        return len(self) == len(other) and set(self) == set(other)

    def __hash__(self):
        # what equal Links share however they are written: their count and endpoints
        return hash((len(self), frozenset(e for ln in self.elements for e in ln.endpoints)))

    def __repr__(self):
        return f"Links({list(self.elements)!r})"


class Overlaps:
    """Finds a pair of endpoints that two links (Link or LinkGroup) both join, without
    listing a group's pairs: :meth:`add` gives the earlier link's ``key`` and the pair,
    or None."""

    def __init__(self):
        self.pairs: dict = {}          # (a, b) -> key of the Link
        self.partners: dict = {}       # node -> [(other end, key)] of its Links
        self.groups_of: dict = {}      # node -> [index into self.groups]
        self.groups: list = []         # (member set, key)

    def add(self, link, key):
        """Record ``link`` (given at ``key``); the overlap with an earlier one, if any."""
        if isinstance(link, Link):
            a, b = link.endpoints
            if (a, b) in self.pairs:
                return self.pairs[a, b], (a, b)
            in_a, in_b = self.groups_of.get(a), self.groups_of.get(b)
            common = in_b and in_a and set(in_a).intersection(in_b)
            if common:
                return self.groups[min(common)][1], (a, b)
            self.pairs[a, b] = key
            for end, other in ((a, b), (b, a)):
                if end in self.partners:
                    self.partners[end].append((other, key))
                else:
                    self.partners[end] = [(other, key)]
            return None
        members = set(link.members)
        shared: dict = {}
        for m in link.members:
            for other, k in self.partners.get(m, ()):
                if other in members:
                    return k, (min(m, other), max(m, other))
            for g in self.groups_of.get(m, ()):
                if g in shared:
                    return self.groups[g][1], (shared[g], m)
                shared[g] = m
        for m in link.members:
            self.groups_of.setdefault(m, []).append(len(self.groups))
        self.groups.append((members, key))
        return None


@dataclass(frozen=True)
class Switch:
    """A network switch between machines: routes traffic, hosts no process."""

    global_id: int
    name: str = ""


@dataclass(frozen=True)
class Machine:
    """A host: compute ``devices``, network interfaces ``nics`` and the ``links`` among them
    (a :class:`Links`: pairs and groups)."""

    id: int
    hostname: str
    devices: tuple[Device, ...]
    links: Links = ()
    nics: tuple[Device, ...] = ()
    addr: str = ""
    port: int | None = None

    def __post_init__(self):
        _set(self, "devices", tuple(self.devices))
        _set(self, "links", Links(self.links))
        _set(self, "nics", tuple(self.nics))

    @property
    def node_ids(self) -> list[int]:
        return [d.global_id for d in self.devices + self.nics]


@dataclass(frozen=True)
class DeviceMesh:
    """A homogeneous group of compute devices arranged in ``shape`` (row-major ``ids``).

    ``dim_bandwidths[k]`` / ``dim_latencies[k]`` describe the worst pair of devices that
    differ only in coordinate ``k`` (GB/s and µs); the owning Cluster fills them in.

    Example: ``DeviceMesh("gpu", (2, 8), tuple(range(16)))``.
    """

    name: str
    shape: tuple[int, ...]
    ids: tuple[int, ...]
    device_type: str = field(default="", compare=False)
    model: str = field(default="", compare=False)
    dim_bandwidths: tuple[float, ...] = field(default=(), compare=False)
    dim_latencies: tuple[float, ...] = field(default=(), compare=False)

    def __post_init__(self):
        _set(self, "shape", tuple(int(s) for s in self.shape))
        _set(self, "ids", tuple(int(i) for i in self.ids))

    @property
    def device_ids(self) -> list[int]:
        """Device global ids, flat, in row-major order (a list, like ProcessMesh.process_ids)."""
        return list(self.ids)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return len(self.ids)

    def __str__(self):
        dims = ", ".join(f"{bw:g} GB/s {lat:g} us" for bw, lat in
                         zip(self.dim_bandwidths, self.dim_latencies))
        return (f"DeviceMesh {self.name}: {self.device_type} {self.model} shape "
                f"{self.shape} [{dims}]")


# A device's measured software cost per step (``reshard_overhead``) is given per reshard
# step kind (the plan contract's: collectives, local steps, point-to-point), for
# ``all_to_allv``: an op's all-to-all with variable counts (MoE's dispatch), and for
# ``sliced``: one collective inside a sliced pipeline (MeshSlice's kernel); ``ring_round``:
# what each further round of a collective's ring adds (:data:`~distgraph.plan.kinds.RING_ROUND`).
SOFTWARE_KINDS = tuple(kind.value for kind in StepKind) + (ALL_TO_ALLV, "sliced", RING_ROUND)

def _ranges(ids) -> str:
    """Compact id list: [0, 1, 2, 5] -> '0-2, 5'."""
    ids = sorted(ids)
    parts = []
    start = prev = None
    for i in ids:
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            parts.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = i
    if start is not None:
        parts.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ", ".join(parts)
