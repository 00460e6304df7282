"""Why a Value has its layout: the chain of ops back to the annotation it came from, the
conflicts the rules settled on the way (and what settling them cost), and where
consumers reshard it.

Example::

    dg.passes.complete(prog)
    print(dg.passes.why(prog, "fc1.bias"))
"""

from __future__ import annotations

from distgraph.errors import PlanError
from distgraph.ir import Program


def _producer_of(program: Program, name: str):
    """The op that produces Value ``name`` (None for inputs and parameters)."""
    return next((op for op in program.ops if any(o.name == name for o in op.outputs)), None)


def why(program: Program, name: str) -> str:
    """Why ``name`` has its spec: the chain of ops back to the annotation it came from,
    conflicts the rules resolved on the way, and where consumers reshard it."""
    if name not in program.values:
        raise PlanError(f"why: no value named {name!r}")
    v = program.values[name]
    if v.dist_attr is None:
        raise PlanError("why: the program is not completed; call dg.passes.complete first")
    origin = program.completion_origin
    lines, seen, todo = [], set(), [name]
    while todo:
        n = todo.pop(0)
        if n in seen:
            continue
        seen.add(n)
        val = program.values[n]
        if val.annotation is not None:
            lines.append(f"{n} {val.dist_attr.spec}: annotated by the user as "
                         f"{val.annotation.spec} on {val.annotation.mesh}")
            if val.annotation != val.dist_attr:
                op = _producer_of(program, n)
                lines.append(f"    its producer {op.type if op else '?'} cannot make that "
                             f"layout; consumers on {val.annotation.mesh} reshard it")
                for note in (op.dist_attr.notes if op else []):
                    lines.append(f"    note on {op.type}: {note}")
            continue
        if n not in origin:
            lines.append(f"{n} {val.dist_attr.spec}: no annotation reached it (unsplit by default)")
            continue
        op, srcs = origin[n]
        where = f" in {op.layer}" if op.layer else ""
        lines.append(f"{n} {val.dist_attr.spec}: from op {op.type}{where} "
                     f"(operands with known specs: {', '.join(srcs) or 'none'})")
        for note in op.dist_attr.notes:
            lines.append(f"    note on {op.type}: {note}")
        todo.extend(srcs)
    for k, op in enumerate(program.ops):
        for i, u in enumerate(op.inputs):
            if u.name == name and (op.dist_attr.input_specs[i] != v.dist_attr.spec
                                   or op.dist_attr.mesh != v.dist_attr.mesh):
                lines.append(f"reshard: op #{k} {op.type}{' in ' + op.layer if op.layer else ''} consumes "
                             f"{name} as {op.dist_attr.input_specs[i]} on "
                             f"{op.dist_attr.mesh} (produced {v.dist_attr})")
                for note in op.dist_attr.notes:      # the rule's reason, where it gave one
                    if note.startswith((f"input {i} ", "kept ")):
                        lines.append(f"    because on {op.type}: {note}")
    return "\n".join(lines)
