"""Cost-aware conflict resolution (MindSpore's sharding propagation, in its docs): when an
op's operands disagree, price each way of settling it by the redistribution it causes.

A conflict is a visit of completion whose rule answer reshards an operand. Its
:class:`Candidate` s are the rule's answer and the answers with each other operand in
the lead (``RuleQuery.lead``); a candidate's :class:`Edge` s are the reshards it needs on
the op's edges (inputs from their Values' layouts, outputs to what each consumer takes),
priced by the time of their :func:`plan_reshard` steps on a cluster (the Engine's,
through the planner; without one, ``Cluster.local`` of the program's processes, as the
estimate prices the plan): what the search and the estimate charge for them
(:func:`distgraph.passes.cost.prices.slowest_reshard_step_time`: each on the ring of its
group, process p on the cluster's p-th device as before rank mapping; its slowest group
or sender counts). An op's own collectives (the vocab-parallel cross-entropy's) are
priced on the ring of the group its kernel names.

A local price does not see what a choice does downstream (keeping a split activation can
cost more gathers later than it saves), so completion keeps a locally cheaper answer
only where the whole program's planned traffic per step (:func:`planned_traffic`, what
partition will place) goes down; otherwise the rule's own order stands. Every conflict
gets a note saying what was kept and what the alternative would move.

Example::

    pricer = ReshardPricer(dg.Cluster.from_file("my4.yaml"))    # as the search prices
    edge = pricer.edge("input", "labels", mesh, DimsSpec(("x", None)), DimsSpec((None, None)),
                       (8, 16), "int64")
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from distgraph.errors import PlanError
from distgraph.passes.cost.formulas import comm_bytes
from distgraph.passes.cost.prices import Rings, op_comm_time, slowest_reshard_step_time
from distgraph.passes.partition import local_view_only, reuses
from distgraph.passes.reshard import plan_reshard
from distgraph.placement import DistAttr, ShardSpec
from distgraph.plan.reshard import steps_bytes
from distgraph.spmd import DimsSpec
from distgraph.units import fmt_bytes

@dataclass(frozen=True)
class Edge:
    """One operand's reshard under a candidate: ``name`` moves ``src`` -> ``dst``
    (``side``: "input" from its Value's layout, "output" to what a consumer takes)."""

    side: str
    name: str
    src: ShardSpec
    dst: ShardSpec
    time: float
    bytes: float


@dataclass(frozen=True)
class Candidate:
    """An answer of an op's rule (``result``), the operand that led it (``lead``, None:
    the rule's own order; ``lead_name`` and ``lead_spec`` its Value and known layout)
    and the reshards it needs."""

    result: object
    lead: object
    lead_name: str
    lead_spec: str
    edges: tuple

    @property
    def cost(self) -> tuple:
        return (sum(e.time for e in self.edges), sum(e.bytes for e in self.edges))

    def moves(self) -> str:
        """``a (6 KiB), b (96 B)``: the bytes each operand moves (over its consumers)."""
        per: dict = {}
        for e in self.edges:
            per[e.name] = per.get(e.name, 0.0) + e.bytes
        return ", ".join(f"{n} ({fmt_bytes(b)})" for n, b in per.items()) or "nothing"


class Conflict(NamedTuple):
    """Where a conflict was first met (op index) and its candidates, the rule's answer
    first, then the others from the cheapest."""

    op: int
    candidates: tuple


class Traffic(NamedTuple):
    """A program's planned communication per step: seconds of its reshard steps and of
    its ops' own collectives in sequence (the time decides, then the bytes), and bytes
    sent summed over all processes."""

    time: float
    bytes: float

    def key(self) -> tuple:
        return (self.time, self.bytes)

    def __str__(self) -> str:
        return f"{fmt_bytes(self.bytes)} taking {self.time * 1e6:.3g} us"


class ReshardPricer:
    """Prices reshards and ops' own collectives on ``cluster`` as the search does,
    process p on its p-th device (module docstring)."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.rings = Rings(cluster, self._device)
        self.cache: dict = {}
        self._ids = [d.global_id for d in cluster.devices]    # a list copied per call

    def _device(self, process: int) -> int:
        if process >= len(self._ids):
            raise PlanError(f"this plan has a process {process} but the cluster has only "
                            f"{len(self._ids)} devices")
        return self._ids[process]

    def reshard_time(self, step) -> float:
        """Seconds of one reshard step: its slowest group's or sender's."""
        return slowest_reshard_step_time(step, self.rings)

    def op_time(self, opdef, site) -> tuple[float, float]:
        """(seconds, bytes sent) of the collectives op ``opdef`` runs itself at ``site``
        (a LocalSite), on the ring of the group its kernel names there."""
        try:
            key = ("op", opdef.type, site)
            return self.cache[key]
        except TypeError:               # an unhashable attribute: priced every time
            key = None
        except KeyError:
            pass
        collectives = tuple(opdef.comm(site))
        time = 0.0
        if collectives:
            context = opdef.localize(dict(site.attrs), site)[1] \
                if opdef.localize is not None else None
            ring = self.rings.of_op(site.in_attrs[0].mesh, site.process_id, context)
            time = op_comm_time(collectives, ring, self.rings.device(site.process_id))
        if key is not None:
            self.cache[key] = (time, comm_bytes(collectives))
        return time, comm_bytes(collectives)

    def steps_cost(self, src: DistAttr, dst: DistAttr, shape, dtype) -> Traffic:
        """(seconds of the steps, bytes sent over all processes)."""
        key = (src, dst, tuple(shape), dtype)
        if key not in self.cache:
            if src == dst or local_view_only(src, dst):
                self.cache[key] = Traffic(0.0, 0.0)
            else:
                steps = plan_reshard(src, dst, shape, dtype)
                time = sum(self.reshard_time(s) for s in steps)
                procs = set(src.mesh.process_ids) | set(dst.mesh.process_ids)
                total = sum(s.bytes_sent_by(p) for s in steps for p in procs)
                self.cache[key] = Traffic(time, float(total))
        return self.cache[key]

    def edge(self, side, name, mesh, src: DimsSpec, dst: DimsSpec, shape, dtype) -> Edge | None:
        """The reshard of ``name`` from ``src`` to ``dst`` on ``mesh`` (unknown entries
        match the other side), None if it moves nothing; bytes are per process."""
        s = ShardSpec(src.filled_from(dst).known().dims, src.partial)
        d = ShardSpec(dst.filled_from(DimsSpec(s.dims)).known().dims, dst.partial)
        if s == d:
            return None
        key = ("edge", mesh, s, d, tuple(shape), dtype)
        if key not in self.cache:
            steps = plan_reshard(DistAttr(mesh, s), DistAttr(mesh, d), shape, dtype)
            time = sum(self.reshard_time(st) for st in steps)
            self.cache[key] = (time, steps_bytes(steps))
        time, nbytes = self.cache[key]
        return Edge(side, name, s, d, time, nbytes) if nbytes or time else None


def planned_traffic(points, op_comm, pricer: ReshardPricer) -> Traffic:
    """What partition will place for a completed layout, summed over all processes:
    ``points`` are the reshards ``(value name, src DistAttr, dst DistAttr, shape, dtype,
    role of the consuming op)`` (write-backs of updates included), counted as partition
    places them: once per value and destination layout, a forward gather again for the
    backward (:func:`~distgraph.passes.partition.reuses`); ``op_comm`` the ``(op
    definition, LocalSites)`` of every op that communicates inside its distributed form,
    a site per process (its slowest process's collectives count in the time, every
    process's in the bytes)."""
    made: dict = {}
    time = total = 0.0
    for name, src, dst, shape, dtype, role in points:
        key = (name, dst)
        if key in made and reuses(made[key], role, src, dst, shape):
            continue
        made[key] = role
        t = pricer.steps_cost(src, dst, shape, dtype)
        time, total = time + t.time, total + t.bytes
    for opdef, sites in op_comm:
        priced = [pricer.op_time(opdef, site) for site in sites]
        time += max((t for t, _ in priced), default=0.0)
        total += sum(b for _, b in priced)
    return Traffic(time, total)


class Outcome(NamedTuple):
    """How completion settled one op signature's conflicts: the lead it tried (None:
    no answer was locally cheaper than the rule's), the planned traffic with it and
    without it, and whether it was kept."""

    lead_name: str | None
    after: Traffic | None
    before: Traffic | None
    kept: bool


def conflict_note(conflict: Conflict, lead, outcome: Outcome | None) -> str | None:
    """What why() says about a settled conflict (None if nothing else was possible):
    what was kept, what the alternative would reshard, and the program-level check."""
    default, others = conflict.candidates[0], conflict.candidates[1:]
    if not others:
        return None
    if lead is not None:
        chosen = next((c for c in others if c.lead == lead), None)
        if chosen is None:
            return None
        text = (f"kept {chosen.lead_name} {chosen.lead_spec}: resharding {chosen.moves()} instead of "
                f"{default.moves()}")
        if outcome is not None and outcome.kept:
            text += f" (planned {outcome.after} per step against {outcome.before})"
        return text
    # the first answer that moves other operands than the rule's (same moves: no choice)
    alt = next((c for c in others if c.edges != default.edges), None)
    if alt is None:
        return None
    if alt.cost < default.cost and outcome is not None and outcome.after is not None:
        return (f"kept the rule's order: resharding {default.moves()} instead of "
                f"{alt.moves()} here, but keeping {outcome.lead_name} would plan "
                f"{outcome.after} per step against {outcome.before}")
    moved = {e.name for e in default.edges}
    kept = [f"{e.name} {e.src if e.side == 'input' else e.dst}" for e in alt.edges
            if e.name not in moved]
    return (f"kept {', '.join(kept) or 'the rule order'}: resharding {default.moves()} "
            f"instead of {alt.moves()}")
