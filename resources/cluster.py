"""The unified resource graph: devices, links, machines, device meshes and the cluster.

A :class:`Cluster` holds :class:`Machine` s; a machine holds compute :class:`Device` s
(CPU, GPU, XPU, ...), optional network interfaces (devices of type ``NIC``) and the
:class:`Link` s inside it. Links between machines (usually NIC to NIC, or NIC to a
:class:`Switch`) live on the cluster. Underneath is an undirected networkx graph whose
nodes are global ids and whose edges carry bandwidth (GB/s, 10^9 bytes/s) and latency (µs).

The *best path* between two nodes maximises the bottleneck bandwidth; among paths with
that bottleneck it minimises the summed latency. ``cluster.bandwidth(a, b)`` is that
bottleneck and ``cluster.latency(a, b)`` that latency (see :mod:`.paths`).

A :class:`DeviceMesh` is a homogeneous group (same type and model) of compute devices with
a shape; a cluster holds one or more (inferred from the machines when not given).

Example::

    >>> from distgraph.resources.cluster import Cluster
    >>> c = Cluster.local(4)
    >>> c.device_meshes[0].shape, c.device_meshes[0].device_ids
    ((4,), [0, 1, 2, 3])
    >>> c.bandwidth(0, 3), c.latency(0, 3)
    (10.0, 1.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Mapping

import numpy as np

from distgraph.errors import PlanError
from distgraph.keywords import keywords_checked
from distgraph.resources.local_cache import cached_local
from distgraph.resources.elements import (COMPUTE_TYPES, DEVICE_TYPES, NETWORK_TYPES, Device,
                                          DeviceMesh, FrozenMap, InvalidCluster, Link,
                                          LinkGroup, Links, Machine, Overlaps, Switch, _ranges,
                                          _set, clique)
from distgraph.resources import describe as _describe, schema as _schema
from distgraph.resources.gpus import detect_gpus
from distgraph.resources.symmetry import ReducedPaths

if TYPE_CHECKING:
    import networkx

# The value classes live in elements.py and are re-exported here, so that
# `from distgraph.resources.cluster import Cluster, Device, Link` is the one import needed.
__all__ = ["COMPUTE_TYPES", "DEVICE_TYPES", "NETWORK_TYPES", "Cluster", "Device", "DeviceMesh",
           "FrozenMap", "InvalidCluster", "Link", "LinkGroup", "Links", "Machine", "Switch"]

# Defaults of Cluster.local: rough figures for one CPU rank, not measurements
# (`distgraph cluster calibrate` measures them). Shared-memory MPI moves a few GB/s
# at about a microsecond of latency.
LOCAL_MODEL = "cpu"
LOCAL_GFLOPS = {"float32": 50.0, "float64": 25.0}
LOCAL_MEMORY_GB = 4.0
LOCAL_BANDWIDTH_GBPS = 10.0
LOCAL_LATENCY_US = 1.0
# Defaults of Cluster.local(n, device="GPU"): a GPU of the A100/H100 class, PCIe between
# two GPUs, and host staging (device -> host -> MPI -> host -> device) between ranks on one.
LOCAL_GPU_GFLOPS = {"float16": 100000.0, "bfloat16": 100000.0, "float32": 20000.0,
                    "float64": 10000.0}
LOCAL_PCIE_BANDWIDTH_GBPS = 12.0
LOCAL_PCIE_LATENCY_US = 10.0
LOCAL_STAGED_LATENCY_US = 30.0
# Where a cluster's figures come from (Cluster.figures): measured here, published, defaults.
FIGURES = ("measured", "published", "")


@keywords_checked          # a mistyped keyword names the nearest field
@dataclass(frozen=True)
class Cluster:
    """Machines, links between them, switches and device meshes.

    ``device_meshes=None`` infers one mesh per (type, model): shape ``(machines,
    devices per machine)`` when every machine holding them has the same count, else
    ``(count,)``. ``figures`` says where the devices' and links' figures come from:
    ``"measured"`` (``distgraph cluster calibrate`` measured them on the machine;
    ``calibration`` holds what it measured them with), ``"published"`` (published
    measurements of the machine, which the file names), or ``""``: defaults, and the
    plans priced on them are uncalibrated (:attr:`calibrated`). Construction validates ids, link endpoints, meshes and connectivity and
    raises :class:`InvalidCluster` (a ResourceFileError) naming the key at fault.
    """

    machines: tuple[Machine, ...]
    links: Links = ()
    switches: tuple[Switch, ...] = ()
    device_meshes: tuple[DeviceMesh, ...] | None = None
    name: str = ""
    calibration: Mapping[str, float] = field(default_factory=FrozenMap)
    figures: str = ""

    def __post_init__(self):
        if self.figures not in FIGURES:
            raise InvalidCluster("figures", f"got {self.figures!r}",
                                 " or ".join(repr(f) for f in FIGURES if f))
        _set(self, "machines", tuple(self.machines))
        _set(self, "links", Links(self.links))
        _set(self, "switches", tuple(self.switches))
        _set(self, "calibration", FrozenMap(self.calibration))
        self._check_nodes()
        self._check_links()
        meshes = self._infer_meshes() if self.device_meshes is None else tuple(self.device_meshes)
        _set(self, "device_meshes", tuple(self._complete_mesh(k, m) for k, m in enumerate(meshes)))
        self._check_meshes()

    # ---- construction checks -------------------------------------------------------
    def _check_nodes(self):
        if not self.machines:
            raise InvalidCluster("machines", "no machines", "at least one machine")
        seen: dict[int, str] = {}
        machine_ids: set[int] = set()
        for i, m in enumerate(self.machines):
            if m.id in machine_ids:
                raise InvalidCluster(f"machines[{i}].id", f"machine id {m.id} is used twice",
                                     "unique machine ids")
            machine_ids.add(m.id)
            for kind, group in (("devices", m.devices), ("nics", m.nics)):
                for j, d in enumerate(group):
                    key = f"machines[{i}].{kind}[{j}]"
                    if d.machine_id != m.id:
                        raise InvalidCluster(f"{key}.machine_id", f"device {d.global_id} says "
                                             f"machine {d.machine_id} but sits in machine {m.id}",
                                             f"machine_id {m.id}")
                    if d.is_compute != (kind == "devices"):
                        raise InvalidCluster(f"{key}.type", f"a {d.type} is listed in {kind}",
                                             "compute devices in devices, NICs in nics")
                    if d.global_id in seen:
                        raise InvalidCluster(f"{key}.global_id", f"global id {d.global_id} is "
                                             f"already used by {seen[d.global_id]}",
                                             "ids unique across devices, NICs and switches")
                    seen[d.global_id] = key
        for k, s in enumerate(self.switches):
            if s.global_id in seen:
                raise InvalidCluster(f"switches[{k}].global_id", f"global id {s.global_id} is "
                                     f"already used by {seen[s.global_id]}",
                                     "ids unique across devices, NICs and switches")
            seen[s.global_id] = f"switches[{k}]"
        if not any(m.devices for m in self.machines):
            raise InvalidCluster("machines", "the cluster has no compute device",
                                 "at least one device of type " + "/".join(COMPUTE_TYPES))

    def _check_links(self):
        owner = {nid: m.id for m in self.machines for nid in m.node_ids}
        switch_ids = {s.global_id for s in self.switches}
        overlaps = Overlaps()
        groups = [(f"machines[{i}].links", m.links, m.id) for i, m in enumerate(self.machines)]
        for where, links, machine in groups + [("links", self.links, None)]:
            for j, ln in enumerate(links.elements):
                key = f"{where}[{j}]"
                inside: dict[int, int] = {}     # machine -> an endpoint in it
                for end in ln.endpoints:
                    if end not in owner and (machine is not None or end not in switch_ids):
                        raise InvalidCluster(key, f"endpoint {end} is not defined",
                                             "a device or NIC" + (" of this machine" if machine
                                                                  is not None else " or switch"))
                    if machine is not None and owner[end] != machine:
                        raise InvalidCluster(key, f"endpoint {end} belongs to machine "
                                             f"{owner[end]}", "links between machines under "
                                             "the top-level 'links'")
                    if machine is None and end in owner:
                        if owner[end] in inside:
                            raise InvalidCluster(key, f"both endpoints of link "
                                                 f"{inside[owner[end]]}-{end} are in machine "
                                                 f"{owner[end]}", "it under that machine's "
                                                 "links")
                        inside[owner[end]] = end
                found = overlaps.add(ln, key)
                if found is not None:
                    (a, b), other = found[1], found[0]
                    raise InvalidCluster(key, f"link {a}-{b} is given twice (also at {other})",
                                         "each pair of endpoints linked once")
        compute = [d.global_id for d in self.devices]
        reach = _reachable(compute[0], self._elements)   # implied shared memory included
        lost = [g for g in compute if g not in reach]
        if lost:
            raise InvalidCluster("links", f"devices {_ranges(lost)} cannot reach device "
                                 f"{compute[0]}", "links joining every machine (e.g. between "
                                 "the machines' NICs, or through a switch)")

    def _infer_meshes(self) -> tuple[DeviceMesh, ...]:
        groups: dict[tuple[str, str], list[Device]] = {}
        for d in self.devices:
            groups.setdefault((d.type, d.model), []).append(d)
        names: dict[str, int] = {}
        meshes = []
        for (dtype, _model), devs in groups.items():
            per_machine: dict[int, list[Device]] = {}
            for d in devs:
                per_machine.setdefault(d.machine_id, []).append(d)
            counts = {len(v) for v in per_machine.values()}
            ordered = [d for m in self.machines for d in
                       sorted(per_machine.get(m.id, []), key=lambda d: (d.local_id, d.global_id))]
            if len(per_machine) > 1 and counts != {1} and len(counts) == 1:
                shape = (len(per_machine), counts.pop())
            else:
                shape = (len(devs),)
            base = dtype.lower()
            names[base] = names.get(base, 0) + 1
            name = base if names[base] == 1 else f"{base}_{names[base] - 1}"
            meshes.append(DeviceMesh(name, shape, tuple(d.global_id for d in ordered)))
        return tuple(meshes)

    def _complete_mesh(self, k: int, mesh: DeviceMesh) -> DeviceMesh:
        key = f"device_meshes[{k}]"
        if any(s < 1 for s in mesh.shape) or not mesh.shape:
            raise InvalidCluster(f"{key}.shape", f"got {list(mesh.shape)}",
                                 "a non-empty list of positive integers")
        if math.prod(mesh.shape) != len(mesh.ids):
            raise InvalidCluster(f"{key}.device_ids", f"{len(mesh.ids)} ids do not fill shape "
                                 f"{list(mesh.shape)}", f"{math.prod(mesh.shape)} device ids, "
                                 "row-major")
        by_id = self._device_index
        unknown = [i for i in mesh.ids if i not in by_id]
        if unknown:
            raise InvalidCluster(f"{key}.device_ids", f"ids {_ranges(unknown)} are not compute "
                                 "devices of this cluster", "ids of compute devices "
                                 f"({_ranges(by_id)})")
        devs = [by_id[i] for i in mesh.ids]
        kinds = sorted({(d.type, d.model) for d in devs})
        if len(kinds) > 1:
            raise InvalidCluster(f"{key}.device_ids", "the mesh mixes "
                                 f"{', '.join(f'{t} {m!r}' for t, m in kinds)}",
                                 "a homogeneous mesh: one device type and model")
        bws, lats = self._mesh_dims(mesh)
        return DeviceMesh(mesh.name, mesh.shape, mesh.ids, devs[0].type, devs[0].model,
                          bws, lats)

    def _check_meshes(self):
        names: set[str] = set()
        owner: dict[int, str] = {}
        for k, mesh in enumerate(self.device_meshes):
            if not mesh.name or mesh.name in names:
                raise InvalidCluster(f"device_meshes[{k}].name", f"name {mesh.name!r} is empty "
                                     "or used twice", "a unique, non-empty name")
            names.add(mesh.name)
            for i in mesh.ids:
                if i in owner:
                    raise InvalidCluster(f"device_meshes[{k}].device_ids", f"device {i} is "
                                         f"already in mesh {owner[i]!r}", "disjoint meshes")
                owner[i] = mesh.name

    def _mesh_dims(self, mesh: DeviceMesh) -> tuple[tuple[float, ...], tuple[float, ...]]:
        # Worst pair along each dim: min bandwidth / max latency over device pairs that
        # differ only in that coordinate.
        grid = np.array(mesh.ids, dtype=np.intp).reshape(mesh.shape)
        bws, lats = [], []
        for dim, n in enumerate(mesh.shape):
            if n == 1:
                bws.append(math.inf)
                lats.append(0.0)
                continue
            rows = np.moveaxis(grid, dim, -1).reshape(-1, n)
            bw, lat = self._paths.worst(rows)
            bws.append(bw)
            lats.append(lat)
        return tuple(bws), tuple(lats)

    # ---- graph and paths -------------------------------------------------------------
    @cached_property
    def _device_index(self) -> dict[int, Device]:
        return {d.global_id: d for m in self.machines for d in m.devices}

    @cached_property
    def _node_index(self) -> dict[int, Device | Switch]:
        nodes: dict[int, Device | Switch] = {}
        for m in self.machines:
            for d in m.devices + m.nics:
                nodes[d.global_id] = d
        for s in self.switches:
            nodes[s.global_id] = s
        return nodes

    @property
    def all_links(self) -> list[Link]:
        """Links inside every machine (the file's, then the shared memory implied between
        devices they leave apart: :attr:`implied_links`), then links between machines;
        one per pair of endpoints (a group's made one by one: see :attr:`_elements`)."""
        return [ln for e in self._elements
                for ln in (e.links() if isinstance(e, LinkGroup) else (e,))]

    @cached_property
    def _elements(self) -> tuple:
        """:attr:`all_links` as given: Links and LinkGroups (what scales with devices)."""
        implied = self.implied_links
        return tuple(e for m in self.machines for e in m.links.elements + implied.get(m.id, ())) \
            + self.links.elements

    @cached_property
    def implied_links(self) -> dict[int, tuple]:
        """Machine id -> the shared-memory links (type ``SHM``) between its compute
        devices that its own links do not join: the devices of one machine always reach
        each other (the ranks on them share its memory), whatever the file lists. A file
        without links inside its machines, whose devices reached each other only through
        another machine's links, so still plans with the other machine lost (an elastic
        restart on the machines left). Figures: :data:`LOCAL_BANDWIDTH_GBPS` and
        :data:`LOCAL_LATENCY_US` between CPUs, :data:`LOCAL_STAGED_LATENCY_US` (host
        staging) where an end is an accelerator. They are not written to files. Where
        the file joins none of a machine's devices, of one kind (CPUs, or none), they are
        one :class:`LinkGroup` of all of them.

        Example::

            >>> one = Machine(0, "node0", (Device(0, 0, 0, "CPU", "cpu", {"float32": 50.0}, 4.0),
            ...                            Device(1, 1, 0, "CPU", "cpu", {"float32": 50.0}, 4.0)))
            >>> Cluster((one,)).implied_links
            {0: (Link(source=0, target=1, bandwidth=10.0, latency=1.0, type='SHM'),)}
        """
        out = {}
        for m in self.machines:
            joined = _components(m.node_ids, m.links.elements)
            devices = m.devices
            part = np.array([joined[d.global_id] for d in devices])
            parts = len(set(part.tolist()))
            cpus = {d.type == "CPU" for d in devices}
            if parts < 2:
                continue
            if parts == len(devices) and len(cpus) == 1:
                latency = LOCAL_LATENCY_US if cpus == {True} else LOCAL_STAGED_LATENCY_US
                out[m.id] = (clique([d.global_id for d in devices], LOCAL_BANDWIDTH_GBPS,
                                    latency, "SHM"),)
                continue
            out[m.id] = tuple(Link(a.global_id, devices[j].global_id, LOCAL_BANDWIDTH_GBPS,
                                   LOCAL_LATENCY_US if a.type == devices[j].type == "CPU"
                                   else LOCAL_STAGED_LATENCY_US, "SHM")
                              for i, a in enumerate(devices)
                              for j in (np.flatnonzero(part[i + 1:] != part[i]) + i + 1).tolist())
        return out

    @cached_property
    def graph(self) -> networkx.Graph:
        """Undirected graph: nodes are global ids (attr ``node``), edges carry the Link."""
        import networkx   # a fifth of a second to import: only for those who ask for it

        g = networkx.Graph()
        for nid, node in self._node_index.items():
            g.add_node(nid, node=node)
        for ln in self.all_links:
            g.add_edge(ln.source, ln.target, link=ln, bandwidth=ln.bandwidth,
                       latency=ln.latency)
        return g

    @cached_property
    def _paths(self) -> ReducedPaths:
        # Interchangeable machines are computed once (see symmetry.py): a 16,384-GPU
        # cluster's paths come from some 300 nodes instead of 32,800.
        return ReducedPaths(self.machines, self.switches, self._elements)

    def _check_ids(self, ids) -> np.ndarray:
        try:
            ids = np.asarray(ids, dtype=np.intp)
        except (TypeError, ValueError):
            raise PlanError(f"{ids!r} are not device global ids of cluster "
                            f"{self.name or '(unnamed)'}") from None
        bad = ~self._paths.known(ids)
        if bad.any():
            raise PlanError(f"{int(ids[bad][0])!r} is not a device of cluster "
                            f"{self.name or '(unnamed)'}; device ids are "
                            f"{_ranges(sorted(self._device_index))}")
        return ids

    def _pair(self, a: int, b: int) -> tuple[float, float]:
        found = None
        if isinstance(a, (int, np.integer)) and isinstance(b, (int, np.integer)):
            found = self._paths.pair(int(a), int(b))
        if found is None:
            bad_a = not isinstance(a, (int, np.integer)) or self._paths.pair(int(a), int(a)) is None
            x = a if bad_a else b
            raise PlanError(f"{x!r} is not a device of cluster {self.name or '(unnamed)'}; "
                            f"device ids are {_ranges(sorted(self._device_index))}")
        return found

    def bandwidth(self, a: int, b: int) -> float:
        """Bottleneck bandwidth (GB/s) of the best path between global ids; inf when a == b."""
        return self._pair(a, b)[0]

    def latency(self, a: int, b: int) -> float:
        """Summed latency (µs) along the best path between global ids; 0 when a == b."""
        return self._pair(a, b)[1]

    def pairs(self, a, b) -> tuple[np.ndarray, np.ndarray]:
        """(bandwidth GB/s, latency µs) of the pairs ``(a[i], b[i])`` of global ids at once:
        :meth:`bandwidth` and :meth:`latency` of each pair, the same floats, on arrays
        (the cost model prices a message's hundreds of tiles in one look-up)."""
        a, b = self._check_ids(a), self._check_ids(b)
        if a.shape != b.shape:
            raise PlanError(f"pairs: {a.size} first ids against {b.size} second ids; give "
                            "one of each per pair")
        return self._paths.lookup(a, b)

    def path_matrices(self, ids) -> tuple[np.ndarray, np.ndarray]:
        """(bandwidth GB/s, latency µs) matrices between the given global ids, in that order."""
        return self._paths.matrices(self._check_ids(list(ids)))

    # ---- views -----------------------------------------------------------------------
    @property
    def calibrated(self) -> bool:
        """Whether the figures were measured (``figures`` "measured", or a file from
        ``distgraph cluster calibrate`` of before that key: its ``calibration``) or
        published for the machine; False for defaults."""
        return bool(self.figures) or bool(self.calibration)

    @property
    def calibrate_command(self) -> str:
        """The command that measures this cluster's figures (``distgraph cluster
        calibrate``), for people reading an uncalibrated plan."""
        name = self.name or "my_cluster"
        n = len(self.devices)
        if len(self.machines) == 1:
            return f"distgraph cluster calibrate -n {n} -o {name}.yaml"
        return (f"distgraph cluster calibrate -n {n} --hosts " + ",".join(
            f"{m.hostname}:{len(m.devices)}" for m in self.machines) + f" -o {name}.yaml")

    @property
    def devices(self) -> list[Device]:
        """Compute devices (no NICs), by global id."""
        return list(self._devices_by_id)

    @cached_property
    def _devices_by_id(self) -> tuple[Device, ...]:
        return tuple(sorted(self._device_index.values(), key=lambda d: d.global_id))

    @property
    def nics(self) -> list[Device]:
        return [n for m in self.machines for n in m.nics]

    def device(self, global_id: int) -> Device:
        try:
            return self._device_index[global_id]
        except KeyError:
            raise PlanError(f"{global_id!r} is not a compute device of cluster "
                            f"{self.name or '(unnamed)'}; device ids are "
                            f"{_ranges(sorted(self._device_index))}") from None

    def machine_of(self, global_id: int) -> Machine:
        mid = self.device(global_id).machine_id
        return next(m for m in self.machines if m.id == mid)

    def device_mesh(self, name: str) -> DeviceMesh:
        for mesh in self.device_meshes:
            if mesh.name == name:
                return mesh
        raise PlanError(f"cluster has no device mesh {name!r}; it has "
                        f"{', '.join(m.name for m in self.device_meshes)}")

    def describe(self) -> str:
        """Machines, device meshes and a link table, for people."""
        return _describe.describe(self)

    def __str__(self):
        return self.describe()

    def __repr__(self):
        return (f"Cluster(name={self.name!r}, machines={len(self.machines)}, "
                f"devices={len(self._device_index)}, meshes="
                f"{[m.name for m in self.device_meshes]})")

    # ---- files -----------------------------------------------------------------------
    @classmethod
    def from_file(cls, path) -> "Cluster":
        """Load a YAML or JSON resource file (distgraph schema or Paddle's cluster JSON)."""
        from distgraph.resources import files    # PyYAML: only for files

        return files.load_cluster(path, cls)

    @classmethod
    def from_dict(cls, data, source: str = "<dict>") -> "Cluster":
        """Build from already-parsed file content; errors name ``source``."""
        from distgraph.resources import files

        return files.cluster_from_data(data, cls, source)

    def to_dict(self, compact: bool = False) -> dict:
        """Plain data in the distgraph schema; ``compact``: runs of machines alike as
        node groups (resources/README.md)."""
        return _schema.cluster_to_dict(self, compact)

    def save(self, path, compact: bool | None = None) -> None:
        """Write the cluster as YAML (.yaml/.yml) or JSON (.json); ``compact`` as in
        ``to_dict`` (default: for clusters of 256 machines or more)."""
        from distgraph.resources import files

        files.save_cluster(self, path, compact)

    @classmethod
    @keywords_checked
    def local(cls, nprocs: int, device: str = "CPU") -> "Cluster":
        """This machine as ``nprocs`` devices on one mesh of shape (n,).

        ``device="CPU"``: ``nprocs`` CPU ranks on shared memory. ``device="GPU"``: this
        machine's GPUs, detected with CuPy (:mod:`distgraph.resources.gpus`; a
        :class:`~distgraph.resources.gpus.NoGPU` error when there are none), rank r on
        GPU ``r mod count`` (its ``local_id``): with more ranks than GPUs, ranks share
        one (see :func:`local_gpus`).

        Where this machine was measured for ``nprocs`` ranks of such devices (``distgraph
        run`` without ``--cluster`` measures it once and keeps it, as does ``distgraph
        cluster calibrate --local``: :mod:`distgraph.resources.local_cache`), that
        measured cluster; else one of default figures (see LOCAL_* in this module), not
        measurements, which a plan priced on them calls uncalibrated.
        """
        if not isinstance(nprocs, int) or nprocs < 1:
            raise PlanError(f"Cluster.local needs a positive number of processes, got {nprocs!r}")
        if device not in ("CPU", "GPU"):
            raise PlanError(f"Cluster.local(device={device!r}): this machine's devices are "
                            "'CPU' (its cores as ranks) or 'GPU' (its CUDA GPUs)")
        measured = cached_local(nprocs, device, cls.from_file)
        if measured is not None:
            return measured
        if device == "GPU":
            return local_gpus(nprocs, detect_gpus(f"Cluster.local({nprocs}, device='GPU')"))
        devices = tuple(Device(i, i, 0, "CPU", LOCAL_MODEL, LOCAL_GFLOPS, LOCAL_MEMORY_GB)
                        for i in range(nprocs))
        links = (clique(range(nprocs), LOCAL_BANDWIDTH_GBPS, LOCAL_LATENCY_US, "SHM"),) \
            if nprocs > 1 else ()
        return cls(machines=(Machine(0, "localhost", devices, links),), name=f"local{nprocs}")


def _joining(links):
    """Pairs of endpoints that join what ``links`` (Links and LinkGroups) join: a
    group's members one after the other (enough for who reaches whom)."""
    for ln in links:
        ends = ln.endpoints
        yield from zip(ends, ends[1:])


def _reachable(start: int, links) -> set[int]:
    """The nodes joined to ``start`` by ``links`` (a breadth-first walk)."""
    near: dict[int, list[int]] = {}
    for a, b in _joining(links):
        near.setdefault(a, []).append(b)
        near.setdefault(b, []).append(a)
    seen, todo = {start}, [start]
    while todo:
        for other in near.get(todo.pop(), ()):
            if other not in seen:
                seen.add(other)
                todo.append(other)
    return seen


def _components(nodes, links) -> dict[int, int]:
    """Each node's component under ``links`` (a node of it; links to other nodes ignored)."""
    root = {n: n for n in nodes}

    def find(n):
        while root[n] != n:
            root[n] = root[root[n]]
            n = root[n]
        return n

    for a, b in _joining(links):
        if a in root and b in root:
            root[find(a)] = find(b)
    return {n: find(n) for n in nodes}


def local_gpus(nprocs: int, gpus) -> Cluster:
    """One machine running ``nprocs`` ranks on the GPUs ``gpus`` (a list of
    :class:`~distgraph.resources.gpus.GPUInfo`, as detected): rank r on GPU ``r mod
    len(gpus)``. Ranks on one GPU are devices with the same ``local_id`` (the GPU shared),
    each with its share of the GPU's memory; a link between them is host staging through
    shared memory (``SHM``), one between two GPUs ``PCIe`` (default figures).

    Example::

        >>> from distgraph.resources.gpus import GPUInfo
        >>> c = local_gpus(4, [GPUInfo(0, "H100", 80.0, (9, 0))])
        >>> [d.local_id for d in c.devices], c.devices[0].memory
        ([0, 0, 0, 0], 20.0)
    """
    if not gpus:
        raise PlanError("local_gpus needs at least one GPU")
    owner = [gpus[r % len(gpus)] for r in range(nprocs)]
    sharers = {g.local_id: sum(1 for o in owner if o.local_id == g.local_id) for g in gpus}
    devices = tuple(Device(r, g.local_id, 0, "GPU", g.name, LOCAL_GPU_GFLOPS,
                           round(g.memory_gb / sharers[g.local_id], 3))
                    for r, g in enumerate(owner))
    links = tuple(Link(a.global_id, b.global_id,
                       *(LOCAL_BANDWIDTH_GBPS, LOCAL_STAGED_LATENCY_US, "SHM")
                       if a.local_id == b.local_id else
                       (LOCAL_PCIE_BANDWIDTH_GBPS, LOCAL_PCIE_LATENCY_US, "PCIe"))
                  for i, a in enumerate(devices) for b in devices[i + 1:])
    return Cluster(machines=(Machine(0, "localhost", devices, links),),
                   name=f"local{nprocs}_gpu{len(gpus)}")
