"""Completion: give every Value and every operand of every Operation a DistAttr.

1. ProcessMesh propagation. An op takes, in order of preference: its ``shard_op`` mesh;
   the mesh of an annotated operand; the meshes of its inputs' producers (where two meet,
   the one that contains the other); the nearest resolved op before it (after it, for the
   ops ahead of every annotation). Ops without inputs (constants) take their first
   consumer's mesh, backward ops their forward op's, update ops their parameter's; the
   step counter shared by all updates lives on the union of their meshes.
2. ShardSpec propagation on the semilattice unknown < {None, 'x', ...}: forward sweeps
   (inputs -> outputs) and backward sweeps (outputs and consumers -> inputs) alternate until
   nothing changes. Each op's rule is its registry entry's (see ``distgraph.spmd``).
   Annotations are never changed: a consumer that wants something else keeps its own
   operand spec, and the difference is a reshard point.
3. Unknown entries end as None; a final forward sweep makes every op's produced specs
   consistent with what it consumes.

Example::

    dg.passes.complete(prog)
    print(prog.pretty())
    print(dg.passes.explain(prog, "fc1.bias"))
"""

from __future__ import annotations

from distgraph.annotation import OpDistAttr
from distgraph.errors import PlanError
from distgraph.ir import Program
from distgraph.mesh import ProcessMesh
from distgraph.ops.registry import get_op
from distgraph.placement import DistAttr, ShardSpec
from distgraph.spmd import UNKNOWN, DimsSpec, entry_dims

MAX_SWEEPS = 100


def _used(spec: DimsSpec) -> set:
    used = set(spec.partial)
    for e in spec.dims:
        used |= set(entry_dims(e))
    return used


def fill(spec: DimsSpec, other: DimsSpec) -> DimsSpec:
    """Unknown entries of ``spec`` taken from ``other`` unless that would use a mesh dim
    twice; known entries and ``spec.partial`` stay."""
    used = _used(spec)
    dims = list(spec.dims)
    for i, (a, b) in enumerate(zip(spec.dims, other.dims)):
        if a is UNKNOWN and b is not UNKNOWN:
            new = set(entry_dims(b))
            if not (new & used):
                dims[i] = b
                used |= new
    return DimsSpec(tuple(dims), spec.partial)


def _pick(meshes: list) -> ProcessMesh:
    for m in meshes:
        if all(m.contains_mesh(o) for o in meshes):
            return m
    return meshes[0]


class _Completion:
    def __init__(self, program: Program, default_mesh: ProcessMesh | None):
        self.program = program
        self.ops = program.ops
        self.default_mesh = default_mesh
        self.producer = {o.name: (k, j) for k, op in enumerate(self.ops)
                         for j, o in enumerate(op.outputs)}
        self.consumers: dict[str, list] = {}
        for k, op in enumerate(self.ops):
            for i, v in enumerate(op.inputs):
                self.consumers.setdefault(v.name, []).append((k, i))

    # -- 1. meshes ------------------------------------------------------------------------
    def assign_meshes(self) -> None:
        n = len(self.ops)
        mesh: list = [None] * n
        vmesh: dict = {v.name: v.annotation.mesh for v in self.program.values.values()
                       if v.annotation is not None and v.name not in self.producer}

        def set_op(k, m):
            mesh[k] = m
            for o in self.ops[k].outputs:
                vmesh[o.name] = m

        forward = [k for k, op in enumerate(self.ops) if op.role in ("forward", "loss")]
        last = None
        for k in forward:
            op = self.ops[k]
            if not op.inputs and op.annotation is None:
                continue                      # constants: from their consumer, below
            if op.annotation is not None:
                m = op.annotation.mesh
            else:
                cands = [v.annotation.mesh for v in op.inputs + op.outputs if v.annotation]
                if not cands:
                    cands = [vmesh[v.name] for v in op.inputs if v.name in vmesh]
                m = _pick(cands) if cands else last
            if m is not None:
                set_op(k, m)
                last = m
        first = next((mesh[k] for k in forward if mesh[k] is not None), self.default_mesh)
        if first is None:
            raise PlanError("no ProcessMesh found: annotate at least one tensor with "
                            "dg.shard_tensor (or an op with dg.shard_op), or pass default_mesh")
        for k in forward:
            if mesh[k] is None and self.ops[k].inputs:
                set_op(k, first)
        def sources_from_consumers():
            for k, op in enumerate(self.ops):
                for v in op.inputs:
                    if v.name not in vmesh and mesh[k] is not None:
                        vmesh[v.name] = mesh[k]

        sources_from_consumers()                      # parameters and inputs
        index = {id(op): k for k, op in enumerate(self.ops)}
        for k, op in enumerate(self.ops):
            if op.role == "backward" and op.forward_op is not None:
                set_op(k, mesh[index[id(op.forward_op)]] or first)
        for k, op in enumerate(self.ops):
            if op.role == "optimize" and op.inputs and op.inputs[0].is_parameter:
                set_op(k, vmesh.get(op.inputs[0].name, first))
        update_meshes = [mesh[k] for k, op in enumerate(self.ops)
                         if op.role == "optimize" and mesh[k] is not None]
        for k, op in enumerate(self.ops):
            if op.role == "optimize" and mesh[k] is None:
                set_op(k, _union(update_meshes) if update_meshes else first)
        for k in reversed(range(n)):                # constants and the rest: first consumer
            if mesh[k] is None:
                cons = [c for o in self.ops[k].outputs for c, _ in self.consumers.get(o.name, [])]
                set_op(k, mesh[min(cons)] if cons and mesh[min(cons)] is not None else first)
        sources_from_consumers()                      # optimizer states
        for v in self.program.values.values():
            vmesh.setdefault(v.name, first)
        self.mesh, self.vmesh = mesh, vmesh

    # -- 2. specs -------------------------------------------------------------------------
    def init_specs(self) -> None:
        self.vspec, self.vfixed = {}, set()
        for v in self.program.values.values():
            if (v.annotation is not None and v.name not in self.producer
                    and v.annotation.mesh == self.vmesh[v.name]):
                self.vspec[v.name] = DimsSpec.of(v.annotation.spec)
                self.vfixed.add(v.name)
            else:
                self.vspec[v.name] = DimsSpec.unknown(v.ndim)
        self.ispec, self.ifixed = {}, set()
        self.ospec: dict = {}
        self.notes: dict = {}
        self.origin: dict = {}
        for k, op in enumerate(self.ops):
            wanted = dict(op.annotation.in_specs) if op.annotation is not None else {}
            for i, v in enumerate(op.inputs):
                spec = DimsSpec.unknown(v.ndim)
                if v.name in wanted:
                    spec = DimsSpec.of(wanted[v.name])
                    self.ifixed.add((k, i))
                elif v.annotation is not None and v.annotation.mesh == self.mesh[k]:
                    spec = DimsSpec(DimsSpec.of(v.annotation.spec).dims)
                    self.ifixed.add((k, i))
                self.ispec[(k, i)] = spec

    def _requirement(self, name: str, mesh) -> DimsSpec:
        """What the same-mesh consumers of ``name`` want, first consumer first."""
        spec = DimsSpec(self.vspec[name].dims)
        for k, i in self.consumers.get(name, []):
            if self.mesh[k] == mesh:
                spec = fill(spec, self.ispec[(k, i)])
        return spec

    def visit(self, k: int, outputs_first: bool) -> bool:
        op, mesh = self.ops[k], self.mesh[k]
        ins, fixed_in = [], []
        for i, v in enumerate(op.inputs):
            s = self.ispec[(k, i)]
            if (k, i) in self.ifixed:
                fixed_in.append(i)
            elif self.vmesh[v.name] == mesh:
                s = fill(s, DimsSpec(self.vspec[v.name].dims))
            ins.append(s)
        outs, fixed_out = [], []
        for j, o in enumerate(op.outputs):
            if o.annotation is not None and o.annotation.mesh == mesh:
                outs.append(DimsSpec.of(o.annotation.spec))
                fixed_out.append(j)
            else:
                outs.append(self._requirement(o.name, mesh) if outputs_first
                            else DimsSpec(self.vspec[o.name].dims))
        try:
            res = get_op(op.type).spmd.infer(ins, outs, [v.shape for v in op.inputs],
                                              [o.shape for o in op.outputs], mesh, fixed_in,
                                              fixed_out, outputs_first, **op.attrs)
        except ValueError as e:
            raise PlanError(f"sharding rule of op #{k} '{op.type}' ({op.layer or 'top level'}) "
                            f"on {mesh}: {e}") from None
        self.notes[k] = list(res.notes)
        changed = False
        known = [v.name for v, s in zip(op.inputs + op.outputs, ins + outs)
                 if any(e not in (UNKNOWN, None) for e in s.dims)]
        for i, v in enumerate(op.inputs):
            if (k, i) not in self.ifixed:
                new = fill(self.ispec[(k, i)], res.in_specs[i])
                changed |= new != self.ispec[(k, i)]
                self.ispec[(k, i)] = new
            if v.name not in self.producer and v.name not in self.vfixed \
                    and self.vmesh[v.name] == mesh:
                new = fill(self.vspec[v.name], self.ispec[(k, i)])
                if new != self.vspec[v.name]:
                    changed = True
                    self.vspec[v.name] = new
                    self.origin.setdefault(v.name, (k, [n for n in known if n != v.name]))
        for j, o in enumerate(op.outputs):
            out = res.out_specs[j]
            self.ospec[(k, j)] = out
            old = self.vspec[o.name]
            dims = fill(DimsSpec(old.dims), DimsSpec(out.dims)).dims
            new = DimsSpec(dims, out.partial - _used(DimsSpec(dims)))
            if new != old:
                changed = True
                self.vspec[o.name] = new
                if any(e is not UNKNOWN for e in new.dims) or new.partial:
                    self.origin.setdefault(o.name, (k, [n for n in known if n != o.name]))
        return changed

    def fixpoint(self) -> None:
        for _ in range(MAX_SWEEPS):
            changed = False
            for k in range(len(self.ops)):
                changed |= self.visit(k, outputs_first=False)
            for k in reversed(range(len(self.ops))):
                changed |= self.visit(k, outputs_first=True)
            if not changed:
                return
        raise PlanError(f"completion did not reach a fixpoint in {MAX_SWEEPS} sweeps")

    def finish(self) -> None:
        for name in self.vspec:                       # sources nobody constrained: unsplit
            if name not in self.producer:
                self.vspec[name] = DimsSpec(tuple(None if e is UNKNOWN else e
                                                  for e in self.vspec[name].dims))
        self.fixpoint()
        for (k, i), s in self.ispec.items():
            v = self.ops[k].inputs[i]
            if self.vmesh[v.name] == self.mesh[k]:
                s = fill(s, DimsSpec(self.vspec[v.name].dims))
            self.ispec[(k, i)] = s.known()
        for name, s in self.vspec.items():
            self.vspec[name] = s.known()
        for k in range(len(self.ops)):
            self.visit(k, outputs_first=False)

    def write(self) -> None:
        for v in self.program.values.values():
            mesh = self.vmesh[v.name]
            if v.name in self.producer:
                spec = self.ospec[self.producer[v.name]].known()
            else:
                spec = self.vspec[v.name]
            v.dist_attr = _attr(mesh, spec, v)
        for k, op in enumerate(self.ops):
            mesh = self.mesh[k]
            op.dist_attr = OpDistAttr(
                mesh,
                [_attr(mesh, self.ispec[(k, i)], v).spec for i, v in enumerate(op.inputs)],
                [_attr(mesh, self.ospec[(k, j)].known(), o).spec for j, o in enumerate(op.outputs)],
                self.notes.get(k, []))
        self.program.completion_origin = {n: (self.ops[k], srcs) for n, (k, srcs)
                                          in self.origin.items()}


def _attr(mesh, spec: DimsSpec, v) -> DistAttr:
    s = ShardSpec(spec.known().dims, spec.partial)
    s.validate(mesh, v.shape, v.name)
    return DistAttr(mesh, s)


def _union(meshes) -> ProcessMesh:
    first = meshes[0]
    if all(m == first for m in meshes):
        return first
    ids = sorted({p for m in meshes for p in m.process_ids})
    return ProcessMesh(ids, dim_names=["all"])


def complete(program: Program, default_mesh: ProcessMesh | None = None) -> Program:
    """Complete the distributed attributes of ``program`` in place and return it."""
    c = _Completion(program, default_mesh)
    c.assign_meshes()
    c.init_specs()
    c.fixpoint()
    c.finish()
    c.write()
    return program


def explain(program: Program, name: str) -> str:
    """Why ``name`` has its spec: the chain of ops back to the annotation it came from,
    conflicts the rules resolved on the way, and where consumers reshard it."""
    if name not in program.values:
        raise PlanError(f"explain: no value named {name!r}")
    v = program.values[name]
    if v.dist_attr is None:
        raise PlanError("explain: the program is not completed; call dg.passes.complete first")
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
    return "\n".join(lines)
