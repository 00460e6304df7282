"""User annotations: ``shard_tensor`` and ``shard_op``, and the per-op DistAttr record.

Example::

    mesh = dg.ProcessMesh([0, 1, 2, 3], dim_names=["mp"])
    dg.shard_tensor(model.fc1.weight, mesh, [None, "mp"])      # a parameter
    def forward(self, x):
        x = dg.shard_tensor(x, mesh, ["mp", None])             # a traced activation
        return dg.shard_op(self.fc1, mesh, out_shard_specs=[[None, "mp"]])(x)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from distgraph.errors import ShardingError
from distgraph.ir import Value
from distgraph.mesh import ProcessMesh
from distgraph.parameter import Parameter
from distgraph.placement import DistAttr, Partial, Replicate, Shard, ShardSpec
from distgraph.registry import takes_attr
from distgraph.trace import current_builder, flatten_outputs


def to_shard_spec(spec, mesh: ProcessMesh, ndim: int, label: str = "tensor") -> ShardSpec:
    """Accept a ShardSpec, a list of entries, or a list of placements (one per mesh dim).
    ``label`` names the tensor in errors."""
    if isinstance(spec, ShardSpec):
        return spec
    if isinstance(spec, str):
        example = [spec] + [None] * (ndim - 1)
        raise ShardingError(f"{label}: shard spec {spec!r} is a string; pass a list with one "
                            f"entry per tensor dim ({ndim}), e.g. {example} on {mesh}")
    if not hasattr(spec, "__iter__"):
        raise ShardingError(f"{label}: shard spec {spec!r}; pass a list with one entry per "
                            f"tensor dim ({ndim}) on {mesh}")
    spec = list(spec)
    if spec and all(isinstance(p, (Shard, Replicate, Partial)) for p in spec):
        return ShardSpec.from_placements(spec, mesh, ndim)
    return ShardSpec(spec)


def _label_of(x) -> str:
    """How errors name ``x``: ``tensor 'h'`` or ``parameter 'weight' of Linear(16, 64)``."""
    return f"tensor {x.name!r}" if isinstance(x, Value) else x.describe()


def shard_tensor(x, mesh: ProcessMesh, shard_spec):
    """Annotate a Parameter or a traced Value with a mesh and spec; returns ``x``.

    Completion never changes an annotation; a conflicting consumer gets a reshard."""
    if not isinstance(mesh, ProcessMesh):
        raise ShardingError(f"shard_tensor: mesh must be a ProcessMesh, got {type(mesh).__name__}")
    if not isinstance(x, (Parameter, Value)):
        raise ShardingError(f"shard_tensor: expected a Parameter or a traced tensor, got "
                            f"{type(x).__name__}")
    label = _label_of(x)
    spec = to_shard_spec(shard_spec, mesh, len(x.shape), label)
    spec.validate(mesh, x.shape, label=label)
    x.annotation = DistAttr(mesh, spec)
    return x


@dataclass(frozen=True)
class OpAnnotation:
    """What ``shard_op`` fixes for the ops it traces: their mesh, and the consumer specs of
    the callable's arguments (``in_specs``: position -> spec)."""

    mesh: ProcessMesh
    in_specs: tuple = ()


def shard_op(fn_or_layer, mesh: ProcessMesh, in_shard_specs=None, out_shard_specs=None,
             meshslice=None):
    """Wrap a callable so the ops it traces run on ``mesh``. ``in_shard_specs`` fix how
    each argument is consumed (None entries leave one free); ``out_shard_specs`` annotate
    the results as ``shard_tensor`` would. ``meshslice`` (True, or a number of slices K)
    lets its matmuls, and their backward GeMMs, run as MeshSlice where their operands
    are 2-D sharded (as ``Strategy(meshslice=...)`` does for every matmul)."""
    if not isinstance(mesh, ProcessMesh):
        raise ShardingError(f"shard_op: mesh must be a ProcessMesh, got {type(mesh).__name__}")
    slices = _meshslice_setting(meshslice)

    def wrapped(*args):
        builder = current_builder()
        values = [builder.as_value(a) if isinstance(a, (Value, Parameter)) else a for a in args]
        in_specs = []
        for k, spec in enumerate(in_shard_specs or []):
            if spec is None:
                continue
            v = values[k]
            s = to_shard_spec(spec, mesh, len(v.shape), _label_of(v))
            s.validate(mesh, v.shape, v.name)
            in_specs.append((v.name, s))
        first = len(builder.program.ops)
        with builder.scope(op_annotation=OpAnnotation(mesh, tuple(in_specs))):
            out = fn_or_layer(*values)
        if out_shard_specs is not None:
            outs = flatten_outputs(out)
            if len(outs) != len(out_shard_specs):
                raise ShardingError(f"shard_op: {len(out_shard_specs)} out_shard_specs for "
                                    f"{len(outs)} outputs")
            for v, spec in zip(outs, out_shard_specs):
                if spec is not None:
                    shard_tensor(v, mesh, spec)
        if len(builder.program.ops) == first:
            raise ShardingError("shard_op: the wrapped callable traced no op")
        if slices is not None:
            takers = [op for op in builder.program.ops[first:] if takes_attr(op.type, "meshslice")]
            if not takers:
                raise ShardingError(f"shard_op(meshslice={meshslice!r}): the wrapped callable "
                                    "traced no matmul to run as MeshSlice")
            for op in takers:
                op.attrs["meshslice"] = slices
        return out

    return wrapped


def _meshslice_setting(value):
    """shard_op's ``meshslice`` as the op attribute: None, "auto" (True) or K."""
    if value is None or value is False:
        return None
    if value is True:
        return "auto"
    if isinstance(value, int) and value >= 1:
        return value
    raise ShardingError(f"shard_op(meshslice={value!r}): give True (the cost model picks the "
                        "number of slices K) or a number of slices K >= 1")


@dataclass
class OpDistAttr:
    """Completion's result for one op: its mesh, the spec of each operand as consumed,
    the spec of each result as produced, and notes on conflicts it resolved."""

    mesh: ProcessMesh
    input_specs: list
    output_specs: list
    notes: list = field(default_factory=list)

    def __str__(self) -> str:
        ins = ", ".join(map(str, self.input_specs))
        outs = ", ".join(map(str, self.output_specs))
        return f"mesh={list(self.mesh.process_ids)} in=({ins}) out=({outs})"
