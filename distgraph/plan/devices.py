"""Where each rank runs, and which communicator each group of ranks talks through.

A plan's ranks own the first devices of its cluster (rank r the r-th; this machine's CPU
cores without a cluster). The planner records each rank's device as a
:class:`RankDevice` in a :class:`DeviceAssignment`, which then says

- the array **backend**: ``cupy`` when every rank's device is a GPU, ``numpy`` when none
  is (CPUs, and the other device types, which run emulated on CPU ranks); a plan over GPUs
  and other devices at once cannot run (:attr:`DeviceAssignment.backend` raises PlanError);
- the **communicator** of every group of ranks (:meth:`DeviceAssignment.route`): ``NCCL``
  between distinct GPUs; ``MPI (host staging)`` when two ranks of the group share one GPU
  (NCCL refuses two ranks on one device, so the arrays go device -> host -> MPI -> host ->
  device); ``MPI`` on CPU ranks.

A :class:`CommGroup` is a group of ranks that communicates (a collective's group or a
point-to-point pair); each process's program lists its groups so that the runtime makes
each group's communicator once.

Example::

    >>> one = DeviceAssignment((RankDevice(0, "GPU", 0, 0, "a", 0),
    ...                         RankDevice(1, "GPU", 0, 0, "a", 1)))
    >>> one.backend, one.route((0, 1))
    ('cupy', 'MPI (host staging)')
"""

from __future__ import annotations

from dataclasses import dataclass

from distgraph.errors import PlanError
from distgraph.plan.kinds import StepKind

NUMPY, CUPY = "numpy", "cupy"
NCCL, STAGED, MPI = "NCCL", "MPI (host staging)", "MPI"
COLLECTIVE, P2P = "collective", "p2p"


@dataclass(frozen=True)
class RankDevice:
    """The device rank ``rank`` runs on: its type, ``local_id`` on machine ``machine``
    (host ``host``) and cluster ``global_id``."""

    rank: int
    type: str
    local_id: int
    machine: int
    host: str
    global_id: int

    @property
    def slot(self) -> tuple:
        """What two ranks share when they share the device."""
        return (self.machine, self.type, self.local_id)

    def __str__(self) -> str:
        return f"{self.type} {self.local_id} of {self.host}"


@dataclass(frozen=True)
class CommGroup:
    """Ranks that communicate: a collective's group (in coordinate order) or a p2p pair
    (sender, receiver). ``label`` says where it comes from (a mesh dim, an op)."""

    kind: str            # COLLECTIVE | P2P
    ranks: tuple
    label: str = ""

    @property
    def key(self) -> tuple:
        """The order every rank makes its groups' communicators in (the same everywhere,
        so that no two ranks wait for each other in opposite orders)."""
        return (self.kind != COLLECTIVE, self.ranks)


def step_groups(step, pid: int, ranks) -> list:
    """The groups process ``pid`` communicates in for one reshard step (as ranks)."""
    if step.kind is StepKind.SEND_RECV:
        return [CommGroup(P2P, (ranks(t.src), ranks(t.dst)), "point to point")
                for t in step.transfers if t.src != t.dst and pid in (t.src, t.dst)]
    if not step.kind.is_collective or pid not in step.mesh:
        return []
    members = step.mesh.group_of(pid, step.mesh_dim)
    if len(members) < 2:
        return []
    return [CommGroup(COLLECTIVE, ranks.of(members), f"mesh dim {step.mesh_dim!r}")]


@dataclass(frozen=True)
class DeviceAssignment:
    """Each rank's device (``devices[r]`` for rank r); see the module docstring."""

    devices: tuple

    @property
    def types(self) -> tuple:
        return tuple(sorted({d.type for d in self.devices}))

    @property
    def backend(self) -> str:
        """``"cupy"`` (every device a GPU) or ``"numpy"`` (none); PlanError for a mix."""
        types = self.types
        if "GPU" not in types:
            return NUMPY
        if types == ("GPU",):
            return CUPY
        raise PlanError(f"this plan's ranks run on {' and '.join(types)} devices at once; "
                        "a job runs on one array backend: CuPy on GPUs or numpy on the "
                        "others. Plan it on a cluster (or the first devices of one) of GPUs "
                        "only, or of no GPU")

    def device(self, rank: int) -> RankDevice:
        return self.devices[rank]

    def sharing(self) -> list:
        """Groups of ranks (more than one) that run on the same GPU."""
        slots: dict = {}
        for d in self.devices:
            if d.type == "GPU":
                slots.setdefault(d.slot, []).append(d.rank)
        return [tuple(ranks) for ranks in slots.values() if len(ranks) > 1]

    def route(self, ranks) -> str:
        """The communicator of a group of ranks (a collective's group or a p2p pair)."""
        if self.backend != CUPY:
            return MPI
        slots = [self.devices[r].slot for r in ranks]
        return STAGED if len(set(slots)) < len(slots) else NCCL

    def pretty(self) -> str:
        """One line: the backend and the devices, with the ranks that share one."""
        try:
            backend = self.backend
        except PlanError:
            return f"backend: none (ranks on {' and '.join(self.types)} devices at once)"
        if backend == NUMPY:
            return f"backend: numpy on {'/'.join(self.types)} ranks"
        by_device: dict = {}
        for d in self.devices:
            by_device.setdefault(str(d), []).append(d.rank)
        return "backend: cupy; " + "; ".join(
            f"{where}: rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
            + (" (sharing it: MPI with host staging between them)" if len(ranks) > 1 else "")
            for where, ranks in by_device.items())

    def explain(self, points, op_groups, ranks) -> list:
        """Lines for ``Plan.explain``: the backend, then the communicator of the groups
        of each mesh dim of the reshard ``points``' steps, of each op that communicates
        inside its kernel (``op_groups``: (op type, process group) pairs) and of
        point-to-point transfers."""
        lines = [self.pretty()]
        uses: dict = {}
        for point in points:
            for step in point.steps:
                if step.kind is StepKind.SEND_RECV:
                    for t in step.transfers:
                        if t.src != t.dst:
                            uses.setdefault("point to point", set()).add(
                                (ranks(t.src), ranks(t.dst)))
                elif step.kind.is_collective and step.group_size > 1:
                    label = f"mesh dim {step.mesh_dim!r} of {step.mesh}"
                    uses.setdefault(label, set()).update(
                        ranks.of(g) for g in step.mesh.groups(step.mesh_dim))
        for op_type, members in op_groups:
            if len(members) > 1:
                uses.setdefault(f"op {op_type}", set()).add(ranks.of(members))
        if not uses:
            return lines
        lines.append("communicators:")
        for label in sorted(uses):
            by_route: dict = {}
            for group in sorted(uses[label]):
                by_route.setdefault(self.route(group), []).append(group)
            text = "; ".join(f"{route} for {_groups(gs)}"
                             for route, gs in sorted(by_route.items()))
            lines.append(f"  {label}: {text}")
        return lines

    def to_dict(self) -> dict:
        try:
            backend = self.backend
        except PlanError:
            backend = None
        return {"backend": backend,
                "devices": [{"rank": d.rank, "type": d.type, "local_id": d.local_id,
                             "host": d.host, "global_id": d.global_id} for d in self.devices]}


def _groups(groups) -> str:
    shown = "ranks " + ", ".join("(" + ", ".join(map(str, g)) + ")" for g in groups[:4])
    return shown + (f" and {len(groups) - 4} more" if len(groups) > 4 else "")
