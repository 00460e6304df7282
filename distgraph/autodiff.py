"""Reverse-mode autodiff on the Program: appends backward ops for every parameter.

The gradient of Value ``n`` is named ``n@GRAD``. Each backward op records the forward op
it differentiates (``op.forward_op``) so completion can give it the same mesh. Ops that
do not lead to a parameter gradient are removed at the end.

Example::

    grads = append_backward(prog, loss)     # {"fc1.weight": Value(fc1.weight@GRAD), ...}
"""

from __future__ import annotations

from distgraph import dtypes
from distgraph.errors import DistGraphError
from distgraph.ir import Program, Role, Value
from distgraph.registry import get_op
from distgraph.trace import Builder


def _needs_grad(program: Program, params: set[str]) -> set[str]:
    """Values that depend on a parameter (only these need gradients)."""
    needs = set(params)
    for op in program.ops:
        if any(v.name in needs for v in op.inputs) and get_op(op.type).differentiable:
            needs.update(o.name for o in op.outputs if dtypes.is_float(o.dtype))
    return needs


def append_backward(program: Program, loss: Value, parameters=None) -> dict[str, Value]:
    """Append the backward pass of scalar ``loss``; returns {param name: grad Value}."""
    if loss.shape != ():
        raise DistGraphError(f"loss {loss.name} must be a scalar, got shape {list(loss.shape)}")
    params = [p for p in (parameters or program.parameters)]
    names = {p.name for p in params}
    needs = _needs_grad(program, names)
    if loss.name not in needs:
        raise DistGraphError(f"loss {loss.name} does not depend on any parameter")

    builder = Builder(program)
    forward_ops = list(program.ops)
    contributions: dict[str, list[Value]] = {}
    producers = program.producers()
    named: set[int] = set()  # gradient Values already renamed to some x@GRAD

    def finalize(v: Value) -> Value | None:
        """Sum the contributions to v's gradient into one Value named v@GRAD.

        One Value can be the gradient of two operands (``z = x + y``); it keeps the first
        name, and a parameter whose gradient is such a shared Value gets its own copy."""
        parts = contributions.pop(v.name, None)
        if not parts:
            return None
        total = parts[0]
        with builder.scope(role=Role.BACKWARD, forward_op=producers.get(v.name)):
            for extra in parts[1:]:
                total = builder.emit("add", [total, extra])[0]
            if id(total) in named and v.is_parameter:
                total = builder.emit("scale", [total], {"scale": 1.0, "bias": 0.0})[0]
        if id(total) not in named:
            program.rename_value(total, f"{v.name}@GRAD")
            named.add(id(total))
        return total

    with builder.active(), builder.scope(role=Role.BACKWARD):
        seed = builder.emit("full", [], {"shape": (), "value": 1.0, "dtype": loss.dtype})[0]
        contributions[loss.name] = [seed]
        for op in reversed(forward_ops):
            if not any(o.name in contributions for o in op.outputs):
                continue
            out_grads = [finalize(o) for o in op.outputs]
            if not any(v.name in needs for v in op.inputs):
                continue
            opdef = get_op(op.type)
            if not opdef.differentiable:
                raise DistGraphError(f"op '{op.type}' ({op.layer or 'top level'}) is on the path "
                                     "from a parameter to the loss but has no gradient")
            with builder.scope(role=Role.BACKWARD, layer=op.layer, forward_op=op):
                in_grads = opdef.grad(op, *out_grads)
            for v, g in zip(op.inputs, in_grads):
                if g is None or v.name not in needs:
                    continue
                if tuple(g.shape) != tuple(v.shape):
                    raise DistGraphError(f"gradient rule of '{op.type}' returned shape "
                                         f"{list(g.shape)} for operand {v.name} {list(v.shape)}")
                contributions.setdefault(v.name, []).append(g)
        grads = {}
        for p in params:
            g = finalize(p)
            if g is not None:
                grads[p.name] = g
    _remove_dead_backward(program, set(g.name for g in grads.values()))
    return grads


def _remove_dead_backward(program: Program, keep: set[str]) -> None:
    live = set(keep)
    kept = []
    for op in reversed(program.ops):
        if op.role is not Role.BACKWARD or any(o.name in live for o in op.outputs):
            kept.append(op)
            live.update(v.name for v in op.inputs)
        else:
            for o in op.outputs:
                program.values.pop(o.name, None)
    program.ops = kept[::-1]
