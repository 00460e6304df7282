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

from distgraph.ir import Role
from distgraph.plan.kinds import AccumulationMode
from distgraph.registry import get_op

# ops that draw random numbers: each micro-batch draws its own
RANDOM = ("dropout",)


@dataclass(frozen=True)
class Accumulation:
    """How one step splits into ``micro_batches`` micro-batches of ``batch // micro_batches``
    rows. ``split_axis[name]`` is the dim of Value ``name`` that carries the samples
    (absent: it carries none); ``partial`` names the Values that sum over the samples
    (gradients, losses). ``boundary`` lists the Values the update ops read from forward
    and backward, each accumulated by :meth:`mode`. ``prologue`` names the whole-batch
    sums the prologue makes, ``prologue_values`` every Value its ops make, and
    ``skipped`` the Values whose ops the micro-batches do not run again (the prologue's
    sums and what only they read); ``gathered_once``: whether a Value made once may gather
    its operands once a step (:func:`made_once`; not under ZeRO-3)."""

    micro_batches: int
    batch: int
    split_axis: MappingProxyType
    partial: frozenset
    boundary: tuple
    prologue: frozenset = frozenset()
    prologue_values: frozenset = frozenset()
    skipped: frozenset = frozenset()
    gathered_once: bool = True

    def made_once(self, program) -> frozenset:
        """:func:`made_once` of the plan's completed ``program`` under this accumulation
        (whose ``gathered_once`` is False for a ZeRO-3 program: a weight gathered where
        each micro-batch uses it)."""
        return made_once(program, self.gathered_once)

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


def made_once(program, gathered: bool = True) -> frozenset:
    """Names of the Values a micro-batched step makes once, before its first micro-batch,
    and holds to the last micro-batch's last use: the results of forward ops that read
    only persistables (and Values made so), draw no random numbers and have no
    collective of their own, read by no update, by no op on another mesh and not a
    program output. An operand may be resharded on the op's own mesh (a parameter split
    over the data-parallel dim gathered whole: once a step, with the op), unless not
    ``gathered`` (ZeRO-3, ``sharding_level`` 3, gathers a weight where each micro-batch
    uses it): then, on a completed program, none. Under ``Strategy(amp=...)`` these are
    the 16-bit copies of the parameters: made once a step and held once, as Megatron
    holds its 16-bit parameters beside float32 masters (and its distributed optimizer
    gathers them once a step from the masters' slices), not once per micro-batch in
    flight. Their ops and their operands' reshards run once a step (the carrier's
    ``step_ops``), and the estimate and the search count them so.

    Example: ``fc1.weight -> cast -> fc1.weight@bfloat16`` is made once; ``x ->
    matmul`` is not (it reads a feed)."""
    once: set = set()
    persistable = {v.name for v in program.values.values() if v.persistable}
    readers = program.consumers()
    outputs = {v.name for v in program.outputs}
    for op in program.ops:
        if op.role is not Role.FORWARD or op.type in RANDOM or not op.outputs or \
                get_op(op.type).comm is not None:
            continue
        if not all(v.name in persistable or v.name in once for v in op.inputs):
            continue
        da = op.dist_attr
        if da is not None and any(
                v.dist_attr is None or v.dist_attr.mesh != da.mesh or
                (not gathered and spec != v.dist_attr.spec)
                for v, spec in zip(op.inputs, da.input_specs)):
            continue
        names = [o.name for o in op.outputs]
        if any(n in outputs for n in names) or any(
                r.role is Role.OPTIMIZE or (da is not None and r.dist_attr is not None and
                                            r.dist_attr.mesh != da.mesh)
                for n in names for r in readers.get(n, ())):
            continue
        once.update(names)
    return frozenset(once)
