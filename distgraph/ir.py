"""The serial compute graph: a Program is an ordered list of Operations over SSA Values.

Every later stage (completion, partition, reshard, execution) reads and annotates these
objects, so they stay plain: a Value is a name, a static shape and a dtype; an Operation
is a type, its operand Values, its result Values, attributes and a role.

Example::

    prog = dg.trace(model, dg.InputSpec([4, 16], name="x"))
    print(prog.pretty())
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from distgraph import dtypes
from distgraph.errors import DistGraphError


class Kind(str, Enum):
    """A string enum that equals, hashes and formats as its value (``Role.LOSS ==
    "loss"``), so programs print and serialise as plain strings while code compares
    members. The plan contract's kinds (:mod:`distgraph.plan.kinds`) are written in it."""

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Role(Kind):
    """What an op or Value belongs to: the forward pass, the loss, the backward pass
    (gradients) or the update (optimizer)."""

    FORWARD = "forward"
    LOSS = "loss"
    BACKWARD = "backward"
    OPTIMIZE = "optimize"


ROLES = tuple(Role)

# Recomputation (distgraph.passes.transforms.recompute) copies forward ops into the
# backward; the Values a copy makes are named after the originals with this suffix. A
# copy is work the hardware does again, not the model's: model FLOPs leave it out.
RECOMPUTED = "@RECOMPUTE"


def is_recomputed(op) -> bool:
    """Whether ``op`` is recomputation's copy of a forward op (its results are named
    ``<original>@RECOMPUTE``)."""
    return bool(op.outputs) and all(o.name.endswith(RECOMPUTED) for o in op.outputs)


@dataclass(eq=False)
class Value:
    """One SSA value (``+ - * / @ .T`` trace ops: :mod:`distgraph.ops.operators`).
    ``dist_attr`` is what its producer makes (set by completion);
    ``annotation`` is the user's ``shard_tensor`` choice, which completion never changes.
    ``alias_of`` names the persistable value an update op writes back to. ``padded_from``:
    the shape of a persistable before ZeRO padded it with zeros to split it evenly
    (:mod:`distgraph.passes.transforms.zero`; None: not padded), the shape it has for the
    model, checkpoints and ``state_dict``: :attr:`logical_shape`."""

    name: str
    shape: tuple
    dtype: str
    is_parameter: bool = False
    persistable: bool = False
    role: Role = Role.FORWARD
    alias_of: str | None = None
    annotation: Any = None
    dist_attr: Any = None
    padded_from: tuple | None = None

    def __post_init__(self):
        self.role = Role(self.role)

    @property
    def logical_shape(self) -> tuple:
        """The shape without ZeRO's padding (``shape`` where it is not padded)."""
        return self.shape if self.padded_from is None else self.padded_from

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * dtypes.itemsize(self.dtype)

    def type_str(self) -> str:
        return f"{self.name}[{','.join(map(str, self.shape))}]:{self.dtype}"

    def __repr__(self) -> str:
        return f"Value({self.type_str()})"

    __hash__ = object.__hash__


@dataclass(eq=False)
class Operation:
    """One op. ``layer`` is the path of the Layer that emitted it (for errors and stage
    construction); ``forward_op`` links a backward op to the forward op it differentiates;
    ``annotation`` holds ``shard_op`` choices; ``dist_attr`` is set by completion."""

    type: str
    inputs: list
    outputs: list
    attrs: dict = field(default_factory=dict)
    role: Role = Role.FORWARD
    layer: str = ""
    forward_op: "Operation | None" = None
    annotation: Any = None
    dist_attr: Any = None

    def __post_init__(self):
        self.role = Role(self.role)

    def __repr__(self) -> str:
        ins = ", ".join(v.name for v in self.inputs)
        outs = ", ".join(v.name for v in self.outputs)
        return f"{self.type}({ins}) -> {outs}"

    __hash__ = object.__hash__


class Program:
    """Ordered Operations over Values, plus the feeds (``inputs``) and ``outputs``."""

    def __init__(self) -> None:
        self.ops: list[Operation] = []
        self.values: dict[str, Value] = {}
        self.inputs: list[Value] = []
        self.outputs: list[Value] = []
        self._counters: dict[str, int] = {}
        # completion records, per Value name, the op that set its spec and the operands
        # it came from (read by passes.why)
        self.completion_origin: dict = {}

    # -- building -----------------------------------------------------------------------
    def unique_name(self, hint: str) -> str:
        while True:
            n = self._counters.get(hint, 0)
            self._counters[hint] = n + 1
            name = f"{hint}_{n}"
            if name not in self.values:
                return name

    def add_value(self, value: Value) -> Value:
        if value.name in self.values:
            raise DistGraphError(f"value name {value.name!r} is already used in this program")
        self.values[value.name] = value
        return value

    def rename_value(self, value: Value, new_name: str) -> None:
        if new_name in self.values:
            raise DistGraphError(f"value name {new_name!r} is already used in this program")
        del self.values[value.name]
        value.name = new_name
        self.values[new_name] = value

    def append_op(self, op: Operation) -> Operation:
        self.ops.append(op)
        return op

    def clone(self) -> "Program":
        """A copy with new Values and Operations (same names, shapes, roles, attrs and
        annotations; dist attributes and completion records left out), so that a planner
        can complete and rewrite it without touching this program."""
        new = Program()
        new._counters = dict(self._counters)
        for v in self.values.values():
            new.values[v.name] = Value(v.name, tuple(v.shape), v.dtype, v.is_parameter,
                                       v.persistable, v.role, v.alias_of, v.annotation,
                                       padded_from=v.padded_from)
        ops: dict[int, Operation] = {}
        for op in self.ops:
            ops[id(op)] = new.append_op(Operation(
                op.type, [new.values[v.name] for v in op.inputs],
                [new.values[v.name] for v in op.outputs], dict(op.attrs), op.role, op.layer,
                ops[id(op.forward_op)] if op.forward_op is not None else None,
                op.annotation))
        new.inputs = [new.values[v.name] for v in self.inputs]
        new.outputs = [new.values[v.name] for v in self.outputs]
        return new

    # -- queries ------------------------------------------------------------------------
    @property
    def parameters(self) -> list[Value]:
        return [v for v in self.values.values() if v.is_parameter]

    @property
    def persistables(self) -> list[Value]:
        return [v for v in self.values.values() if v.persistable]

    def producers(self) -> dict[str, Operation]:
        return {out.name: op for op in self.ops for out in op.outputs}

    def consumers(self) -> dict[str, list[Operation]]:
        result: dict[str, list[Operation]] = {}
        for op in self.ops:
            for v in op.inputs:
                result.setdefault(v.name, []).append(op)
        return result

    def ops_by_role(self, *roles: str) -> list[Operation]:
        return [op for op in self.ops if op.role in roles]

    # -- printing -----------------------------------------------------------------------
    def pretty(self) -> str:
        """Readable text: feeds, persistables, then one line per op (with dist attrs)."""
        lines = [f"Program: {len(self.ops)} ops, {len(self.parameters)} parameters"]
        lines.append("  inputs:  " + ", ".join(_value_str(v) for v in self.inputs))
        for v in self.persistables:
            kind = "param" if v.is_parameter else "state"
            lines.append(f"  {kind}:   {_value_str(v)}")
        for i, op in enumerate(self.ops):
            ins = ", ".join(v.name for v in op.inputs)
            outs = ", ".join(_value_str(v) for v in op.outputs)
            attrs = {k: a for k, a in op.attrs.items() if not k.startswith("_")}
            attr_s = " {" + ", ".join(f"{k}={a}" for k, a in attrs.items()) + "}" if attrs else ""
            lines.append(f"  #{i:<4} {op.role:<9} {op.type}({ins}) -> {outs}{attr_s}")
            if op.dist_attr is not None:
                lines.append(f"         {op.dist_attr}")
        lines.append("  outputs: " + ", ".join(v.name for v in self.outputs))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Program {len(self.ops)} ops>"


def _value_str(v: Value) -> str:
    s = v.type_str()
    if v.dist_attr is not None:
        s += f" {v.dist_attr}"
    return s
