"""Whether a plan fits its devices: each process's estimated peak memory against what its
device may hold.

A device may hold its usable memory (``Device.usable_memory``: its memory less what its
process cannot hand to its arrays, ``reserved_memory`` in the resource file or the
default for its type), or ``Strategy(memory_budget_gb=...)`` where that is less: the
budget can only lower it, never raise it. The peak is the estimate's
(:func:`~distgraph.passes.cost.estimate.estimate`: parameters, optimizer states, gradients
and the activations live at the process's peak), so what the planner checks is what
``plan.estimate`` and ``explain()`` say. :func:`overflows` lists the processes over their
limit; :class:`~distgraph.errors.DoesNotFit` is the error a plan that does not fit ends in.

Example::

    over = overflows(plan.estimate, cluster, budget_gb=None)
    if over:
        print(over[0])        # process 0 (stage 0, device 0): 119.2 GB of 74 GB
"""

from __future__ import annotations

from dataclasses import dataclass

from distgraph.units import GB


@dataclass(frozen=True)
class Overflow:
    """Process ``process`` on stage ``stage`` and device ``device`` (global id) peaks at
    ``peak`` bytes where ``limit`` bytes may be held."""

    process: int
    stage: int
    device: int
    peak: float
    limit: float

    @property
    def excess(self) -> float:
        return self.peak - self.limit

    def __str__(self) -> str:
        return (f"process {self.process} (stage {self.stage}, device {self.device}): "
                f"{self.peak / GB:.4g} GB of {self.limit / GB:.4g} GB")


def limit_of(cluster, device: int, budget_gb: float | None) -> float:
    """Bytes device ``device`` (global id) may hold: its usable memory, at most
    ``budget_gb`` (:meth:`~distgraph.resources.elements.Device.usable_memory`)."""
    return cluster.device(device).usable_memory(budget_gb) * GB


def overflows(estimate, cluster, budget_gb: float | None) -> list[Overflow]:
    """The processes of ``estimate`` whose peak exceeds their device's limit on
    ``cluster`` (:func:`limit_of`), largest excess first."""
    out = []
    limits: dict = {}
    for p in estimate.processes:
        if p.device not in limits:
            limits[p.device] = limit_of(cluster, p.device, budget_gb)
        if p.peak_memory > limits[p.device]:
            out.append(Overflow(p.process, p.stage, p.device, float(p.peak_memory),
                                limits[p.device]))
    return sorted(out, key=lambda o: (-o.excess, o.process))


class MemoryBinds(Exception):
    """The stage search, planning without recomputation where the planner weighs it
    (``Strategy(recompute=None)`` asked of the search), stopped at the first micro-batch
    count it priced that has a plan: ``count`` micro-batches at ``seconds`` per step, a
    plan memory held back (a faster one fits with the devices' memory unlimited). Not an
    error: the planner plans recomputation next, and without it in full only where
    ``seconds`` beats that (:func:`~distgraph.passes.fitting.with_savers`)."""

    def __init__(self, count: int, seconds: float):
        super().__init__(f"memory binds without recomputation at {count} micro-batches "
                         f"({seconds:.4g} s per step)")
        self.count, self.seconds = count, seconds
