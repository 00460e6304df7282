"""Where each rank runs, and what it computes and communicates with: pure planning.

A plan's ranks own the first devices of its cluster (rank r the r-th; this machine's CPU
cores without a cluster). :func:`placement` records each rank's device as a
:class:`RankDevice`; the :class:`Placement` then says

- the array **backend**: ``cupy`` when every rank's device is a GPU, ``numpy`` when none
  is (CPUs, and the other device types, which run emulated on CPU ranks); a plan over GPUs
  and other devices at once cannot run (:meth:`Placement.backend` raises PlanError);
- the **communicator** of every group of ranks that communicates (:meth:`Placement.route`):
  ``NCCL`` between distinct GPUs; ``MPI (host staging)`` when two ranks of the group share
  one GPU (the same machine and ``local_id``: NCCL refuses two ranks on one device, so the
  arrays go device -> host -> MPI -> host -> device); ``MPI`` on CPU ranks.

:func:`comm_groups` lists the groups a plan's process communicates in (mesh-dim groups of
its reshard steps and of ops that communicate inside their kernels, the pairs of its
point-to-point transfers, the gathers of fetched values and of the state), so that the
runtime makes each group's communicator once per plan, and :func:`explain` prints the
choice per mesh dim.

Example::

    >>> from distgraph.resources.cluster import local_gpus
    >>> from distgraph.resources.gpus import GPUInfo
    >>> one = placement(local_gpus(2, [GPUInfo(0, "H100", 80.0, (9, 0))]), 2)
    >>> one.backend, one.route((0, 1))
    ('cupy', 'MPI (host staging)')
"""

from __future__ import annotations

from dataclasses import dataclass

from distgraph.errors import PlanError
from distgraph.passes.partition import gather_points

NUMPY, CUPY = "numpy", "cupy"
NCCL, STAGED, MPI = "NCCL", "MPI (host staging)", "MPI"
COLLECTIVE_KINDS = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")


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
class Placement:
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

    def to_dict(self) -> dict:
        try:
            backend = self.backend
        except PlanError:
            backend = None
        return {"backend": backend,
                "devices": [{"rank": d.rank, "type": d.type, "local_id": d.local_id,
                             "host": d.host, "global_id": d.global_id} for d in self.devices]}


def placement(cluster, world_size: int) -> Placement:
    """The devices of a job of ``world_size`` ranks on ``cluster`` (None: this machine's
    CPU cores): rank r on the cluster's r-th compute device."""
    if cluster is None:
        return Placement(tuple(RankDevice(r, "CPU", r, 0, "localhost", r)
                               for r in range(world_size)))
    devices = cluster.devices
    if len(devices) < world_size:
        raise PlanError(f"this plan has {world_size} processes but the cluster has only "
                        f"{len(devices)} devices")
    hosts = {m.id: m.hostname for m in cluster.machines}
    return Placement(tuple(RankDevice(r, d.type, d.local_id, d.machine_id, hosts[d.machine_id],
                                      d.global_id) for r, d in enumerate(devices[:world_size])))


# ---- the groups a plan communicates in ------------------------------------------------------
@dataclass(frozen=True)
class CommGroup:
    """Ranks that communicate: a collective's group (in coordinate order) or a p2p pair
    (sender, receiver). ``label`` says where it comes from (a mesh dim, an op)."""

    kind: str            # "collective" | "p2p"
    ranks: tuple
    label: str = ""

    @property
    def key(self) -> tuple:
        """The order every rank makes its groups' communicators in (the same everywhere,
        so that no two ranks wait for each other in opposite orders)."""
        return (self.kind != "collective", self.ranks)


def step_groups(step, pid: int, ranks) -> list:
    """The groups ``pid`` communicates in for one reshard step (mapped to ranks)."""
    if step.kind == "send_recv":
        return [CommGroup("p2p", (ranks(t.src), ranks(t.dst)), "point to point")
                for t in step.transfers if t.src != t.dst and pid in (t.src, t.dst)]
    if step.kind not in COLLECTIVE_KINDS or pid not in step.mesh:
        return []
    members = step.mesh.group_of(pid, step.mesh_dim)
    if len(members) < 2:
        return []
    return [CommGroup("collective", ranks.of(members), f"mesh dim {step.mesh_dim!r}")]


def comm_groups(plan, pid: int) -> list:
    """Every group process ``pid`` of ``plan`` communicates in during a step, while
    gathering fetched values and while gathering the state (``state_dict``, checkpoints),
    once each, in :attr:`CommGroup.key` order."""
    local = plan.local(pid)
    points = list(local.points()) + list(plan.graph.gathers.get(pid, ()))
    persistables = sorted(v.name for v in plan.program.persistables)
    points += gather_points(plan.program, persistables, pid)
    found: dict = {}
    for point in points:
        for step in point.steps:
            for g in step_groups(step, pid, plan.ranks):
                found.setdefault(g.key, g)
    for index, ctx in local.op_context.items():
        groups = ctx.get("groups") or ((ctx["group"],) if ctx.get("group") else ())
        for members in groups:
            if pid in members and len(members) > 1:
                g = CommGroup("collective", plan.ranks.of(members),
                              f"op {local.program.ops[index].type}")
                found.setdefault(g.key, g)
    return [found[k] for k in sorted(found)]


def explain(plan, where: Placement) -> list:
    """Lines for Plan.explain: the backend, then per mesh dim of the plan's reshard steps
    (and per op that communicates inside its kernel, and for point-to-point transfers)
    its groups' communicator."""
    lines = [where.pretty()]
    uses: dict = {}
    for point in plan.reshards():
        for step in point.steps:
            if step.kind == "send_recv":
                for t in step.transfers:
                    if t.src != t.dst:
                        uses.setdefault("point to point", set()).add(
                            (plan.ranks(t.src), plan.ranks(t.dst)))
            elif step.kind in COLLECTIVE_KINDS and step.group_size > 1:
                label = f"mesh dim {step.mesh_dim!r} of {step.mesh}"
                uses.setdefault(label, set()).update(
                    plan.ranks.of(g) for g in step.mesh.groups(step.mesh_dim))
    for pid in plan.process_ids:
        local = plan.local(pid)
        for index, ctx in local.op_context.items():
            groups = ctx.get("groups") or ((ctx["group"],) if ctx.get("group") else ())
            for members in groups:
                if len(members) > 1:
                    label = f"op {local.program.ops[index].type}"
                    uses.setdefault(label, set()).add(plan.ranks.of(members))
    if not uses:
        return lines
    lines.append("communicators:")
    for label in sorted(uses):
        by_route: dict = {}
        for ranks in sorted(uses[label]):
            by_route.setdefault(where.route(ranks), []).append(ranks)
        text = "; ".join(f"{route} for {_groups(gs)}" for route, gs in sorted(by_route.items()))
        lines.append(f"  {label}: {text}")
    return lines


def _groups(groups) -> str:
    shown = "ranks " + ", ".join("(" + ", ".join(map(str, g)) + ")" for g in groups[:4])
    return shown + (f" and {len(groups) - 4} more" if len(groups) > 4 else "")
