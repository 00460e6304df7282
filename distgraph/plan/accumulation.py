"""How a step accumulates over its micro-batches: the value the planner's analysis gives
(:func:`distgraph.passes.pipeline.accumulate.split_micro_batches`).

Example::

    >>> acc = Accumulation(4, 32, MappingProxyType({"x": 0}), frozenset({"w@GRAD"}),
    ...                    ("w@GRAD",))
    >>> acc.micro_batch_rows, acc.mode("w@GRAD"), acc.mode("x"), acc.mode("lr")
    (8, <AccumulationMode.SUM: 'sum'>, <AccumulationMode.CONCAT: 'concat'>, <AccumulationMode.KEEP: 'keep'>)
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from distgraph.plan.kinds import AccumulationMode


@dataclass(frozen=True)
class Accumulation:
    """How one step splits into ``micro_batches`` micro-batches of ``batch // micro_batches``
    rows. ``split_axis[name]`` is the dim of Value ``name`` that carries the samples
    (absent: it carries none); ``partial`` names the Values that sum over the samples
    (gradients, losses). ``boundary`` lists the Values the update ops read from forward
    and backward, each accumulated by :meth:`mode`. ``prologue`` names the whole-batch
    sums the prologue makes, ``prologue_values`` every Value its ops make, and
    ``skipped`` the Values whose ops the micro-batches do not run again (the prologue's
    sums and what only they read)."""

    micro_batches: int
    batch: int
    split_axis: MappingProxyType
    partial: frozenset
    boundary: tuple
    prologue: frozenset = frozenset()
    prologue_values: frozenset = frozenset()
    skipped: frozenset = frozenset()

    @property
    def micro_batch_rows(self) -> int:
        return self.batch // self.micro_batches

    def mode(self, name: str) -> AccumulationMode:
        """How Value ``name`` combines over micro-batches (:class:`AccumulationMode`)."""
        if name in self.partial:
            return AccumulationMode.SUM
        if name in self.split_axis:
            return AccumulationMode.CONCAT
        return AccumulationMode.KEEP

    def pretty(self) -> str:
        lines = [f"gradient accumulation: {self.micro_batches} micro-batches of "
                 f"{self.micro_batch_rows} rows (batch {self.batch})"]
        for name in self.boundary:
            lines.append(f"  {self.mode(name):<6} {name}")
        for name in sorted(self.prologue):
            lines.append(f"  whole  {name} (summed over the micro-batches before the step)")
        return "\n".join(lines)
