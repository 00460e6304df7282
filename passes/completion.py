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
   Annotations are never changed. An annotated Value is consumed as annotated unless the
   consuming op's rule cannot take it so (another annotation wins a conflict, an axis
   that is never split): then the op consumes what its rule decided, its notes say why,
   and the difference is a reshard point. An annotated result is produced as annotated
   (its operands are resharded instead) wherever the op's rule can make that layout.
   A sweep visits only the ops whose operands changed since their last visit in that
   direction, and rule results are memoised per (op signature, specs) within the run:
   the result is the one full sweeps would give, in time linear in the op count.
3. Unknown entries end as None; a final forward sweep makes every op's produced specs
   consistent with what it consumes: each op's specs are then a fixpoint of its rule.

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
        used.update(entry_dims(e))
    return used


def fill(spec: DimsSpec, other: DimsSpec) -> DimsSpec:
    """Unknown entries of ``spec`` taken from ``other`` unless that would use a mesh dim
    twice; known entries and ``spec.partial`` stay."""
    dims = spec.dims
    if UNKNOWN not in dims:
        return spec
    odims = other.dims
    todo = [i for i, (a, b) in enumerate(zip(dims, odims)) if a is UNKNOWN and b is not UNKNOWN]
    if not todo:
        return spec
    used = _used(spec)
    out = list(dims)
    for i in todo:
        new = entry_dims(odims[i])
        if used.isdisjoint(new):
            out[i] = odims[i]
            used.update(new)
    return DimsSpec(tuple(out), spec.partial)


def _strip(spec: DimsSpec) -> DimsSpec:
    """``spec`` without its partial mesh dims."""
    return DimsSpec(spec.dims) if spec.partial else spec


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
        unknown: dict = {}                  # one all-unknown spec per rank, shared

        def unknown_spec(ndim):
            spec = unknown.get(ndim)
            if spec is None:
                spec = unknown[ndim] = DimsSpec.unknown(ndim)
            return spec

        self.vspec, self.vfixed = {}, set()
        for v in self.program.values.values():
            if (v.annotation is not None and v.name not in self.producer
                    and v.annotation.mesh == self.vmesh[v.name]):
                self.vspec[v.name] = DimsSpec.of(v.annotation.spec)
                self.vfixed.add(v.name)
            else:
                self.vspec[v.name] = unknown_spec(v.ndim)
        # ispec: how each operand is consumed. A fixed operand (a shard_op in_spec, or an
        # annotated Value on the op's mesh) is given to the rule as ``fixed_spec``; its
        # ispec is what the rule decided, which differs only where the rule had to
        # reshard it (a conflict with another annotation, an axis that is never split).
        self.ispec, self.fixed_spec = {}, {}
        self.ospec: dict = {}
        self.notes: dict = {}
        self.origin: dict = {}
        for k, op in enumerate(self.ops):
            wanted = dict(op.annotation.in_specs) if op.annotation is not None else {}
            for i, v in enumerate(op.inputs):
                spec = unknown_spec(v.ndim)
                if v.name in wanted:
                    spec = DimsSpec.of(wanted[v.name])
                    self.fixed_spec[(k, i)] = spec
                elif v.annotation is not None and v.annotation.mesh == self.mesh[k]:
                    spec = DimsSpec(DimsSpec.of(v.annotation.spec).dims)
                    self.fixed_spec[(k, i)] = spec
                self.ispec[(k, i)] = spec
        n = len(self.ops)
        self.meta = [self._meta(k) for k in range(n)]
        # Work lists: an op is visited again (per direction) only when something it
        # reads changed since its last visit in that direction; a visit whose reads are
        # unchanged would recompute and rewrite exactly what it wrote before.
        self.dirty = {False: bytearray(b"\1" * n), True: bytearray(b"\1" * n)}
        # Rules are pure: within this run, the same (op signature, specs) gives the
        # same result, and the GPT blocks repeat the same signatures layer after layer.
        shared: dict = {}                   # equal signatures become one object
        self.signature = [self._signature(k, shared) for k in range(n)]
        self.plans: dict = {}
        self.memo: dict = {}
        self.last_forward: list = [None] * n

    def _meta(self, k: int) -> tuple:
        """What a visit of op k needs that never changes during the run.

        Per input: (index, name, fixed spec or None, same mesh as the op, a source whose
        spec the op may fill). Per output: (index, name, annotation on the op's mesh or
        None, the same-mesh consumers asked for its requirement)."""
        op, mesh = self.ops[k], self.mesh[k]
        ins = []
        for i, v in enumerate(op.inputs):
            same = self.vmesh[v.name] == mesh
            source = same and v.name not in self.producer and v.name not in self.vfixed
            ins.append((i, v.name, self.fixed_spec.get((k, i)), same, source))
        outs = []
        for j, o in enumerate(op.outputs):
            ann = None
            if o.annotation is not None and o.annotation.mesh == mesh:
                ann = DimsSpec.of(o.annotation.spec)
            wanted = tuple((c, i) for c, i in self.consumers.get(o.name, ())
                           if self.mesh[c] == mesh)
            outs.append((j, o.name, ann, wanted))
        fixed_in = tuple(i for i, _, f, _, _ in ins if f is not None)
        fixed_out = tuple(j for j, _, a, _ in outs if a is not None)
        return tuple(ins), tuple(outs), fixed_in, fixed_out

    def _signature(self, k: int, shared: dict):
        """What, besides the specs, a rule call of op k depends on: op type, shapes,
        mesh and attributes (None if an attribute is unhashable: never memoised)."""
        op = self.ops[k]
        key = (op.type, tuple(tuple(v.shape) for v in op.inputs),
               tuple(tuple(o.shape) for o in op.outputs), self.mesh[k],
               tuple(sorted(op.attrs.items())))
        try:
            return shared.setdefault(key, key)
        except TypeError:
            return None

    def _mark_value(self, name: str) -> None:
        """vspec[name] changed: its producer and consumers read it."""
        fwd, bwd = self.dirty[False], self.dirty[True]
        p = self.producer.get(name)
        if p is not None:
            fwd[p[0]] = bwd[p[0]] = 1
        for c, _ in self.consumers.get(name, ()):
            fwd[c] = bwd[c] = 1

    def _mark_operand(self, k: int, name: str) -> None:
        """ispec of an operand ``name`` of op k changed: op k reads it, and so does the
        operand's producer when it asks what its consumers want."""
        self.dirty[False][k] = self.dirty[True][k] = 1
        p = self.producer.get(name)
        if p is not None:
            self.dirty[True][p[0]] = 1

    def _requirement(self, name: str, consumers) -> DimsSpec:
        """What the same-mesh ``consumers`` of ``name`` want, first consumer first."""
        spec = _strip(self.vspec[name])
        for key in consumers:
            spec = fill(spec, self.fixed_spec.get(key) or self.ispec[key])
        return spec

    def _rule(self, k: int, ins, outs, fixed_in, fixed_out, outputs_first):
        sig = self.signature[k]
        key = None
        if sig is not None:
            key = (sig, tuple(ins), tuple(outs), fixed_in, fixed_out, outputs_first)
            res = self.memo.get(key)
            if res is not None:
                return res
        op, mesh = self.ops[k], self.mesh[k]
        rule = get_op(op.type).spmd
        in_shapes = [v.shape for v in op.inputs]
        out_shapes = [o.shape for o in op.outputs]

        def run(fixed):
            if sig is not None and hasattr(rule, "compile"):
                plan = self.plans.get(sig)
                if plan is None:
                    plan = self.plans[sig] = rule.compile(in_shapes, out_shapes, mesh, op.attrs)
                return plan.solve(ins, outs, set(fixed), set(fixed_out), outputs_first)
            return rule.infer(ins, outs, in_shapes, out_shapes, mesh, fixed, fixed_out,
                              outputs_first, **op.attrs)

        def honours(r):
            return all(r.out_specs[j].dims == outs[j].dims for j in fixed_out)

        try:
            res = run(fixed_in)
            if fixed_in and not honours(res):
                # An annotated result is produced as annotated: a rule that ranks the
                # annotated operands first (reshape) is asked again with them free.
                again = run(())
                if honours(again):
                    res = again
        except ValueError as e:
            raise PlanError(f"sharding rule of op #{k} '{op.type}' ({op.layer or 'top level'}) "
                            f"on {mesh}: {e}") from None
        if key is not None:
            self.memo[key] = res
        return res

    def visit(self, k: int, outputs_first: bool) -> bool:
        """Run op k's rule on what is known of its operands and merge the result back;
        True if any spec changed."""
        in_meta, out_meta, fixed_in, fixed_out = self.meta[k]
        ispec, vspec = self.ispec, self.vspec
        ins = []
        for i, name, fixed, same, _ in in_meta:
            if fixed is not None:
                ins.append(fixed)
            else:
                s = ispec[(k, i)]
                ins.append(fill(s, _strip(vspec[name])) if same else s)
        outs = []
        for j, name, ann, wanted in out_meta:
            if ann is not None:
                outs.append(ann)
            elif outputs_first:
                outs.append(self._requirement(name, wanted))
            else:
                outs.append(_strip(vspec[name]))
        res = self._rule(k, ins, outs, fixed_in, fixed_out, outputs_first)
        if not outputs_first:
            self.last_forward[k] = res
        self.notes[k] = res.notes
        changed = False
        known = None
        for i, name, fixed, _, source in in_meta:
            if fixed is not None:
                # consumed as the rule decided (a reshard point where that differs)
                self.ispec[(k, i)] = DimsSpec(fill(res.in_specs[i], fixed).dims, fixed.partial)
                consumed = fixed
            else:
                old = ispec[(k, i)]
                consumed = fill(old, res.in_specs[i])
                if consumed != old:
                    changed = True
                    ispec[(k, i)] = consumed
                    self._mark_operand(k, name)
            if source:
                old = vspec[name]
                new = fill(old, consumed)
                if new != old:
                    changed = True
                    vspec[name] = new
                    self._mark_value(name)
                    if known is None:
                        known = _known_names(self.ops[k], ins, outs)
                    self.origin.setdefault(name, (k, tuple(n for n in known if n != name)))
        for j, name, _, _ in out_meta:
            out = res.out_specs[j]
            self.ospec[(k, j)] = out
            old = vspec[name]
            dims = fill(_strip(old), _strip(out)).dims
            partial = out.partial - _used(DimsSpec(dims)) if out.partial else out.partial
            new = DimsSpec(dims, partial)
            if new != old:
                changed = True
                vspec[name] = new
                self._mark_value(name)
                if any(e is not UNKNOWN for e in new.dims) or new.partial:
                    if known is None:
                        known = _known_names(self.ops[k], ins, outs)
                    self.origin.setdefault(name, (k, tuple(n for n in known if n != name)))
        return changed

    def fixpoint(self) -> None:
        """Forward sweeps (inputs -> outputs) and backward sweeps (outputs -> inputs)
        alternate until nothing changes, each visiting only the ops marked dirty."""
        n = len(self.ops)
        fwd, bwd = self.dirty[False], self.dirty[True]
        for _ in range(MAX_SWEEPS):
            if not (any(fwd) or any(bwd)):
                return
            for k in range(n):
                if fwd[k]:
                    fwd[k] = 0
                    self.visit(k, outputs_first=False)
            for k in reversed(range(n)):
                if bwd[k]:
                    bwd[k] = 0
                    self.visit(k, outputs_first=True)
        if any(fwd) or any(bwd):
            raise PlanError(f"completion did not reach a fixpoint in {MAX_SWEEPS} sweeps")

    def finish(self) -> None:
        for name in self.vspec:                       # sources nobody constrained: unsplit
            if name not in self.producer:
                new = DimsSpec(tuple(None if e is UNKNOWN else e
                                     for e in self.vspec[name].dims))
                if new != self.vspec[name]:
                    self.vspec[name] = new
                    self._mark_value(name)
        self.fixpoint()
        for (k, i), s in self.ispec.items():
            v = self.ops[k].inputs[i]
            if self.vmesh[v.name] == self.mesh[k]:
                s = fill(s, _strip(self.vspec[v.name]))
            s = s.known()
            if s != self.ispec[(k, i)]:
                self.ispec[(k, i)] = s
                self._mark_operand(k, v.name)
        for name, s in self.vspec.items():
            if UNKNOWN in s.dims:
                self.vspec[name] = s.known()
                self._mark_value(name)
        # One last forward sweep makes what each op produces follow what it consumes. An
        # op whose reads did not change since its last forward visit keeps that visit's
        # result (visiting it again would recompute exactly that).
        fwd = self.dirty[False]
        for k in range(len(self.ops)):
            if fwd[k] or self.last_forward[k] is None:
                fwd[k] = 0
                self.visit(k, outputs_first=False)
            else:
                self._keep(k, self.last_forward[k])

    def _keep(self, k: int, res) -> None:
        """Record ``res``, the result of op k's last forward visit, as its final one."""
        self.notes[k] = res.notes
        for j in range(len(self.ops[k].outputs)):
            self.ospec[(k, j)] = res.out_specs[j]
        for i, _, fixed, _, _ in self.meta[k][0]:
            if fixed is not None:
                self.ispec[(k, i)] = DimsSpec(fill(res.in_specs[i], fixed).dims, fixed.partial)

    def write(self) -> None:
        attrs: dict = {}

        def attr(mesh, spec, v):
            key = (mesh, spec.known(), tuple(v.shape))
            a = attrs.get(key)
            if a is None:
                a = attrs[key] = _attr(mesh, spec, v)
            return a

        for v in self.program.values.values():
            mesh = self.vmesh[v.name]
            if v.name in self.producer:
                spec = self.ospec[self.producer[v.name]].known()
            else:
                spec = self.vspec[v.name]
            v.dist_attr = attr(mesh, spec, v)
        for k, op in enumerate(self.ops):
            mesh = self.mesh[k]
            op.dist_attr = OpDistAttr(
                mesh,
                [attr(mesh, self.ispec[(k, i)], v).spec for i, v in enumerate(op.inputs)],
                [attr(mesh, self.ospec[(k, j)].known(), o).spec for j, o in enumerate(op.outputs)],
                list(self.notes.get(k, [])))
        self.program.completion_origin = {n: (self.ops[k], srcs) for n, (k, srcs)
                                          in self.origin.items()}


def _known_names(op, ins, outs) -> list:
    return [v.name for v, s in zip(op.inputs + op.outputs, ins + outs)
            if any(e not in (UNKNOWN, None) for e in s.dims)]


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


def _producer_of(program: Program, name: str):
    """The op that produces Value ``name`` (None for inputs and parameters)."""
    return next((op for op in program.ops if any(o.name == name for o in op.outputs)), None)


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
                    if note.startswith(f"input {i} "):
                        lines.append(f"    because on {op.type}: {note}")
    return "\n".join(lines)
