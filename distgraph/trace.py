"""Tracing: run a Python model on symbolic inputs and record a forward Program.

Example::

    prog = dg.trace(lambda x: dg.ops.relu(x @ w), dg.InputSpec([4, 16], name="x"))
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass

from distgraph import dtypes
from distgraph.errors import DistGraphError
from distgraph.ir import Operation, Program, Role, Value
from distgraph.registry import ShapeError, TensorType, get_op
from distgraph.parameter import Parameter


class _Active(threading.local):
    """The builders of this thread's traces in progress (innermost last); only ``trace``
    and autodiff push onto it, inside a with-block, so it is empty whenever no trace is
    running. Per thread: ranks simulated as threads trace their programs at once."""

    def __init__(self):
        self.builders: list["Builder"] = []


_ACTIVE = _Active()


@dataclass(frozen=True)
class InputSpec:
    """Shape, dtype and name of one model input: ``InputSpec([32, 64], "int64", "tokens")``.
    ``dist_attr`` (a DistAttr, optional) annotates the input as ``shard_tensor`` would
    (``dg.shard_dataloader`` sets it for the feeds it splits). ``sequence_chunks`` c > 1:
    dim 1 (the sequence) is stored in the load-balanced order of c chunks (chunk r, then
    chunk c-1-r, for r < c/2: context parallelism's); the ops that read positions
    (rotary, attention) take it from the trace."""

    shape: tuple
    dtype: str | None = None
    name: str | None = None
    dist_attr: object = None
    sequence_chunks: int = 1

    def __post_init__(self):
        shape = tuple(int(d) for d in self.shape)
        if self.sequence_chunks != 1 and (len(shape) < 2 or self.sequence_chunks % 2 or
                                          shape[1] % self.sequence_chunks):
            raise DistGraphError(f"InputSpec {self.name or ''}: sequence_chunks "
                                 f"{self.sequence_chunks} must be 1 or an even divisor of "
                                 f"dim 1 of {list(shape)}")
        if any(d <= 0 for d in shape):
            raise DistGraphError(f"InputSpec {self.name or ''}: every dim must be positive, "
                                 f"got {list(shape)}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", dtypes.canonical(self.dtype or dtypes.get_default_dtype()))


class Builder:
    """Appends ops to a Program; knows the current role, layer path and forward op."""

    def __init__(self, program: Program, param_names: dict[int, str] | None = None,
                 amp: str | None = None):
        self.program = program
        self.param_names = dict(param_names or {})
        self.param_values: dict[int, Value] = {}
        self.amp = amp                  # mixed precision: parameters read in this dtype
        self.amp_values: dict[str, Value] = {}
        self.role = Role.FORWARD
        self.layer_path: list[str] = []
        self.forward_op: Operation | None = None
        self.op_annotation = None
        self.sequence_chunks = 1        # the inputs' sequence order (InputSpec)
        self.context_parallel = None    # Strategy(context_parallel=...): attention's form

    @contextmanager
    def active(self):
        _ACTIVE.builders.append(self)
        try:
            yield self
        finally:
            _ACTIVE.builders.pop()

    @contextmanager
    def scope(self, role=None, layer=None, forward_op=None, op_annotation=None):
        saved = (self.role, list(self.layer_path), self.forward_op, self.op_annotation)
        if role is not None:
            self.role = role
        if layer is not None:
            self.layer_path.append(layer)
        if forward_op is not None:
            self.forward_op = forward_op
        if op_annotation is not None:
            self.op_annotation = op_annotation
        try:
            yield self
        finally:
            self.role, self.layer_path, self.forward_op, self.op_annotation = saved

    @property
    def layer(self) -> str:
        """The innermost layer's full path ('' at the top level)."""
        return next((p for p in reversed(self.layer_path) if p), "")

    def as_value(self, x) -> Value:
        if isinstance(x, Value):
            return x
        if isinstance(x, Parameter):
            v = self.parameter_value(x)
            return self.amp_value(v) if self.amp and dtypes.is_float(v.dtype) \
                and dtypes.itemsize(v.dtype) > 2 else v
        raise DistGraphError(f"expected a traced tensor or a Parameter, got {type(x).__name__} "
                             f"in layer '{self.layer}'")

    def parameter_value(self, p: Parameter) -> Value:
        v = self.param_values.get(id(p))
        if v is None:
            name = self.param_names.get(id(p)) or self.program.unique_name("param")
            v = Value(name, p.shape, p.dtype, is_parameter=True, persistable=True,
                      annotation=p.annotation)
            self.program.add_value(v)
            self.param_values[id(p)] = v
        return v

    def amp_value(self, v: Value) -> Value:
        """Parameter ``v`` cast to the mixed-precision dtype, once per trace: where the
        forward first reads it (its gradient is cast back to ``v``'s dtype)."""
        cast = self.amp_values.get(v.name)
        if cast is None:
            (cast,) = self.emit("cast", [v], {"dtype": self.amp}, names=[f"{v.name}@{self.amp}"])
            self.amp_values[v.name] = cast
        return cast

    def new_value(self, hint: str, t: TensorType, name: str | None = None) -> Value:
        return self.program.add_value(Value(name or self.program.unique_name(hint), tuple(t.shape),
                                            t.dtype, role=self.role))

    def emit(self, op_type: str, inputs, attrs: dict | None = None, names=None) -> list[Value]:
        """Infer result types, create result Values and append one op; returns the results."""
        opdef = get_op(op_type)
        attrs = dict(attrs or {})
        ins = [self.as_value(x) for x in inputs]
        try:
            outs = opdef.infer(*[TensorType(v.shape, v.dtype) for v in ins], **attrs)
        except ShapeError as e:
            shapes = ", ".join(f"{v.name}{list(v.shape)}:{v.dtype}" for v in ins)
            where = f" in layer '{self.layer}'" if self.layer else ""
            raise type(e)(f"op '{op_type}'{where}: {e} (operands: {shapes})") from None
        if isinstance(outs, TensorType):
            outs = [outs]
        names = names or [None] * len(outs)
        out_vals = [self.new_value(op_type, t, n) for t, n in zip(outs, names)]
        op = Operation(op_type, ins, out_vals, attrs, role=self.role, layer=self.layer,
                       forward_op=self.forward_op, annotation=self.op_annotation)
        self.program.append_op(op)
        return out_vals


def active_builder() -> Builder | None:
    """The builder of the trace in progress, None outside ``trace``."""
    return _ACTIVE.builders[-1] if _ACTIVE.builders else None


def current_builder() -> Builder:
    if not _ACTIVE.builders:
        raise DistGraphError("distgraph ops build a graph and must be called inside dg.trace(...) "
                             "or a Layer's forward during Engine preparation")
    return _ACTIVE.builders[-1]


def emit(op_type: str, inputs, attrs=None) -> list[Value]:
    return current_builder().emit(op_type, inputs, attrs)


def emit1(op_type: str, inputs, attrs=None) -> Value:
    return current_builder().emit(op_type, inputs, attrs)[0]


def flatten_outputs(out) -> list:
    if isinstance(out, (list, tuple)):
        return [v for o in out for v in flatten_outputs(o)]
    if isinstance(out, dict):
        return [v for o in out.values() for v in flatten_outputs(o)]
    return [out]


def make_inputs(builder: Builder, specs) -> list[Value]:
    values = []
    for i, spec in enumerate(specs):
        name = spec.name or f"input_{i}"
        v = builder.program.add_value(Value(name, spec.shape, spec.dtype, role=Role.FORWARD))
        if spec.dist_attr is not None:
            spec.dist_attr.spec.validate(spec.dist_attr.mesh, spec.shape, name)
            v.annotation = spec.dist_attr
        builder.program.inputs.append(v)
        values.append(v)
        if spec.sequence_chunks != 1:
            if builder.sequence_chunks not in (1, spec.sequence_chunks):
                raise DistGraphError(f"input {name}: sequence_chunks {spec.sequence_chunks}"
                                     f" differs from another input's "
                                     f"{builder.sequence_chunks}; store every sequence in "
                                     f"one order")
            builder.sequence_chunks = spec.sequence_chunks
    return values


def trace(fn_or_layer, *input_specs: InputSpec) -> Program:
    """Trace a Layer or function on symbolic inputs into a forward Program.

    Parameters of a Layer are named by their path (``blocks.0.attn.qkv.bias``).
    """
    param_names = {}
    if hasattr(fn_or_layer, "named_parameters"):     # a Layer (distgraph.nn builds on this)
        fn_or_layer.assign_paths()
        param_names = {id(p): n for n, p in fn_or_layer.named_parameters()}
    builder = Builder(Program(), param_names)
    inputs = make_inputs(builder, input_specs)
    with builder.active():
        out = fn_or_layer(*inputs)
    builder.program.outputs = [builder.as_value(o) for o in flatten_outputs(out)]
    return builder.program
