"""Completion: give every Value and every operand of every Operation a DistAttr.

1. ProcessMesh propagation (:mod:`distgraph.passes.completion.mesh_propagation`).
2. ShardSpec propagation on the semilattice unknown < {None, 'x', ...}: forward sweeps
   (inputs -> outputs) and backward sweeps (outputs and consumers -> inputs) alternate until
   nothing changes. Each op's rule is its registry entry's (see ``distgraph.spmd``). An
   op on another mesh of the same shape and dim names (the next pipeline stage) starts
   from the layout its input is made in, so a batch split over one stage's ``dp`` stays
   split over the next stage's.
   Annotations are never changed. An annotated Value is consumed as annotated unless the
   consuming op's rule cannot take it so (another annotation wins a conflict, an axis
   that is never split): then the op consumes what its rule decided, its notes say why,
   and the difference is a reshard point. An annotated result is produced as annotated
   (its operands are resharded instead) wherever the op's rule can make that layout.
   A sweep visits only the ops whose operands changed since their last visit in that
   direction, and rule results are memoised per (op signature, specs): the result is
   the one full sweeps would give, in time linear in the op count.
3. Unknown entries end as None; a final forward sweep makes every op consume and produce
   what its rule answers on the known specs: each op's specs are a fixpoint of its rule.
4. Conflicts settled by cost (:mod:`distgraph.passes.completion.resolution`). Where an op's rule
   reshards an operand, the answers with another operand in the lead are candidates,
   priced by the redistribution they cause on the op's edges. Per op signature (the
   ops of repeated layers alike), each candidate is tried as a whole completion, the
   locally cheapest first, and kept where the program's planned traffic per step goes
   down; the number of trials is bounded by the program size (``TRIAL_OPS``). A shard_op
   in_spec and an annotated result are never given up; annotated Values keep their
   layout, though a cheaper candidate may reshard one where an op consumes it.

Example::

    dg.passes.complete(prog)
    print(prog.pretty())
    print(dg.passes.why(prog, "fc1.bias"))
"""

from __future__ import annotations

import dataclasses

from distgraph.passes.completion.setup import CompletionSetup
from distgraph.passes.completion.why import why
from distgraph.passes.completion.resolution import (
    Candidate,
    Conflict,
    Outcome,
    conflict_note,
    planned_traffic,
)

from distgraph.annotation import OpDistAttr
from distgraph.errors import PlanError
from distgraph.ir import Program
from distgraph.mesh import ProcessMesh
from distgraph.registry import LocalSite, get_op
from distgraph.placement import DistAttr, ShardSpec
from distgraph.spmd import UNKNOWN, DimsSpec, RuleQuery

__all__ = ["complete", "why"]

MAX_SWEEPS = 100
# Settling conflicts tries whole completions: at most TRIAL_OPS / (ops in the program)
# of them (a 2-layer GPT training program, ~190 ops, gets 103; 12 layers 19; 128 layers 1).
TRIAL_OPS = 20_000


def _strip(spec: DimsSpec) -> DimsSpec:
    """``spec`` without its partial mesh dims."""
    return DimsSpec(spec.dims) if spec.partial else spec


class _Completion:
    """One completion run of a program (its :class:`CompletionSetup` part shared with other
    runs). ``choices`` maps an op signature to the operand that leads its rule's
    answers; the run records the conflicts it meets, per signature."""

    def __init__(self, static: CompletionSetup, choices: dict | None = None):
        self.static = static
        self.program, self.ops = static.program, static.ops
        self.producer, self.consumers = static.producer, static.consumers
        self.mesh, self.vmesh, self.meta = static.mesh, static.vmesh, static.meta
        self.fixed_spec, self.signature = static.fixed_spec, static.signature
        self.choices = dict(choices or {})
        self.conflicts: dict = {}
        self.outcomes: dict = {}
        self.vspec, self.ispec = dict(static.vspec), dict(static.ispec)
        self.ospec: dict = {}
        self.notes: dict = {}
        self.origin: dict = {}
        n = len(self.ops)
        # Work lists: an op is visited again (per direction) only when something it
        # reads changed since its last visit in that direction; a visit whose reads are
        # unchanged would recompute and rewrite exactly what it wrote before.
        self.dirty = {False: bytearray(b"\1" * n), True: bytearray(b"\1" * n)}
        self.last_forward: list = [None] * n      # (rule answer, query) per op
        self.final_query: list = [None] * n

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
            spec = spec.filled_from(self.fixed_spec.get(key) or self.ispec[key])
        return spec

    def _conflict(self, k: int, query: RuleQuery, res) -> Conflict:
        """The candidates of a conflict: ``res`` and the rule's answers with each other
        operand in the lead, priced on op k's edges. The op's shard_op in_specs stay as
        ``res`` consumes them; annotated results stay first."""
        op, meta = self.ops[k], self.meta[k]
        cands = [self._price(k, res, None, "", "")]
        seen = [res]
        for source in query.sources():
            if query.is_fixed(source) and source.side == "output":
                continue
            if all(e is UNKNOWN for e in query.spec(source).dims):
                continue
            alt = self.static.rule(k, query._replace(lead=source))
            if alt in seen or any(alt.in_specs[i] != res.in_specs[i] for i in meta.hard):
                continue
            seen.append(alt)
            value = (op.inputs if source.side == "input" else op.outputs)[source.index]
            cands.append(self._price(k, alt, source, value.name, str(query.spec(source))))
        others = sorted(cands[1:], key=lambda c: c.cost)
        return Conflict(k, tuple([cands[0]] + others))

    def _price(self, k: int, res, lead, lead_name: str, lead_spec: str) -> Candidate:
        """The reshards ``res`` needs on op k's edges: inputs from their Values' layouts,
        outputs to what their consumers on the op's mesh take."""
        op, mesh, meta = self.ops[k], self.mesh[k], self.meta[k]
        edges = []
        for m, v in zip(meta.ins, op.inputs):
            if m.same_mesh:
                edges.append(self.static.pricer.edge("input", v.name, mesh, self.vspec[v.name],
                                              res.in_specs[m.index], v.shape, v.dtype))
        for m, o in zip(meta.outs, op.outputs):
            for key in m.consumers:
                want = self.fixed_spec.get(key) or self.ispec[key]
                edges.append(self.static.pricer.edge("output", o.name, mesh, res.out_specs[m.index], want,
                                              o.shape, o.dtype))
        return Candidate(res, lead, lead_name, lead_spec, tuple(e for e in edges if e is not None))

    def visit(self, k: int, outputs_first: bool, final: bool = False) -> bool:
        """Run op k's rule on what is known of its operands and merge the result back;
        True if any spec changed. ``final`` (the last forward sweep): every spec is
        known, and the op consumes exactly what its rule answers."""
        meta = self.meta[k]
        ispec, vspec = self.ispec, self.vspec
        # (the records are unpacked in the loops: a visit is the hot path)
        ins = []
        for i, name, fixed, same, _, alike in meta.ins:
            if fixed is not None:
                ins.append(fixed)
            else:
                s = ispec[(k, i)]
                if meta.linear and same:        # told the pending sums it may keep
                    s = DimsSpec(s.filled_from(_strip(vspec[name])).dims, vspec[name].partial)
                ins.append(s.filled_from(_strip(vspec[name])) if alike else s)
        outs = []
        for _, name, annotation, consumers in meta.outs:
            if annotation is not None:
                outs.append(annotation)
            elif outputs_first:
                outs.append(self._requirement(name, consumers))
            else:
                outs.append(_strip(vspec[name]))
        query = RuleQuery(tuple(ins), tuple(outs), meta.fixed_in, meta.fixed_out,
                          outputs_first)
        res = self.static.rule(k, query)
        # Conflicts are settled per op signature: the ops of repeated layers alike.
        key = self.signature[k]
        if key is not None:
            if res.resharded and key not in self.conflicts:
                self.conflicts[key] = self._conflict(k, query, res)
            lead = self.choices.get(key)
            if lead is not None:
                res = self.static.rule(k, query._replace(lead=lead))
        if not outputs_first:
            self.last_forward[k] = (res, query)
        if final:
            self._keep(k, res, query)
            return False
        self.notes[k] = res.notes
        changed = False
        known = None
        for i, name, fixed, _, source, _ in meta.ins:
            key = (k, i)
            if fixed is not None:
                # consumed as the rule decided (a reshard point where that differs)
                ispec[key] = DimsSpec(res.in_specs[i].filled_from(fixed).dims, fixed.partial)
                consumed = fixed
            else:
                old = ispec[key]
                consumed = old.filled_from(res.in_specs[i])
                if meta.linear and consumed.partial != res.in_specs[i].partial:
                    consumed = DimsSpec(consumed.dims, res.in_specs[i].partial)
                if consumed != old:
                    changed = True
                    ispec[key] = consumed
                    self._mark_operand(k, name)
            if source:
                old = vspec[name]
                new = old.filled_from(consumed)
                if new != old:
                    changed = True
                    vspec[name] = new
                    self._mark_value(name)
                    if name not in self.origin:     # the first writer is the origin
                        if known is None:
                            known = _known_names(self.ops[k], ins, outs)
                        self.origin[name] = (k, tuple(n for n in known if n != name))
        for j, name, _, _ in meta.outs:
            out = res.out_specs[j]
            self.ospec[(k, j)] = out
            old = vspec[name]
            dims = _strip(old).filled_from(_strip(out)).dims
            partial = out.partial - DimsSpec(dims).used() if out.partial else out.partial
            new = DimsSpec(dims, partial)
            if new != old:
                changed = True
                vspec[name] = new
                self._mark_value(name)
                if name not in self.origin and (any(e is not UNKNOWN for e in new.dims)
                                                or new.partial):
                    if known is None:
                        known = _known_names(self.ops[k], ins, outs)
                    self.origin[name] = (k, tuple(n for n in known if n != name))
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
                s = s.filled_from(_strip(self.vspec[v.name]))
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
                self.visit(k, outputs_first=False, final=True)
            else:
                self._keep(k, *self.last_forward[k])

    def run(self) -> _Completion:
        self.fixpoint()
        self.finish()
        return self

    def _keep(self, k: int, res, query: RuleQuery) -> None:
        """Record ``res``, the answer of op k's rule to ``query`` on its known specs, as
        its final one: the op consumes and produces what the rule says."""
        self.final_query[k] = query
        self.notes[k] = res.notes
        for j in range(len(self.ops[k].outputs)):
            self.ospec[(k, j)] = res.out_specs[j]
        for m in self.meta[k].ins:
            spec = res.in_specs[m.index].known()
            if m.fixed is not None:
                spec = DimsSpec(res.in_specs[m.index].filled_from(m.fixed).dims, m.fixed.partial)
            self.ispec[(k, m.index)] = spec

    def layout(self) -> tuple:
        """The completed layout: {value name: DistAttr} and one OpDistAttr per op."""
        attrs: dict = {}

        def attr(mesh, spec, v):
            key = (mesh, spec.known(), tuple(v.shape))
            a = attrs.get(key)
            if a is None:
                a = attrs[key] = _attr(mesh, spec, v)
            return a

        values = {}
        for v in self.program.values.values():
            mesh = self.vmesh[v.name]
            if v.name in self.producer:
                spec = self.ospec[self.producer[v.name]].known()
            else:
                spec = self.vspec[v.name]
            values[v.name] = attr(mesh, spec, v)
        ops = []
        for k, op in enumerate(self.ops):
            mesh = self.mesh[k]
            notes = list(self.notes.get(k, [])) + self._cost_notes(k)
            ops.append(OpDistAttr(
                mesh,
                [attr(mesh, self.ispec[(k, i)], v).spec for i, v in enumerate(op.inputs)],
                [attr(mesh, self.ospec[(k, j)].known(), o).spec for j, o in enumerate(op.outputs)],
                notes))
        return values, ops

    def _cost_notes(self, k: int) -> list:
        """Op k's final answer settled a conflict: what it kept and what it cost."""
        query, sig = self.final_query[k], self.signature[k]
        if query is None or sig is None:
            return []
        default = self.static.rule(k, query)
        if not default.resharded:
            return []
        note = conflict_note(self._conflict(k, query, default), self.choices.get(sig),
                             self.outcomes.get(sig))
        return [note] if note else []

    def traffic(self):
        """The planned communication per step of this run's layout (what partition
        will place), computed from the specs: DistAttrs only where a reshard is."""
        attrs: dict = {}

        def attr(mesh, spec):
            key = (mesh, spec)
            if key not in attrs:
                attrs[key] = DistAttr(mesh, ShardSpec(spec.dims, spec.partial))
            return attrs[key]

        final = {}
        for name, spec in self.vspec.items():
            p = self.producer.get(name)
            final[name] = (self.ospec[p].known() if p is not None else spec.known())
        points, op_comm = [], []
        for k, op in enumerate(self.ops):
            mesh = self.mesh[k]
            for i, v in enumerate(op.inputs):
                dst = self.ispec[(k, i)].known()
                if self.vmesh[v.name] != mesh or final[v.name] != dst:
                    points.append((v.name, attr(self.vmesh[v.name], final[v.name]),
                                   attr(mesh, dst), v.shape, v.dtype, op.role))
            for o in op.outputs:
                if o.alias_of and (self.vmesh[o.alias_of] != mesh
                                   or final[o.alias_of] != final[o.name]):
                    points.append((o.name, attr(mesh, final[o.name]),
                                   attr(self.vmesh[o.alias_of], final[o.alias_of]),
                                   o.shape, o.dtype, op.role))
            opdef = get_op(op.type)
            if opdef.comm is not None:
                ins = tuple(attr(mesh, self.ispec[(k, i)].known()) for i in range(len(op.inputs)))
                outs = tuple(attr(mesh, self.ospec[(k, j)].known())
                             for j in range(len(op.outputs)))
                site = LocalSite(mesh.process_ids[0], tuple(v.shape for v in op.inputs), ins,
                                 tuple(o.shape for o in op.outputs), outs,
                                 tuple(v.dtype for v in op.inputs),
                                 tuple(sorted(op.attrs.items())))
                if opdef.comm(site):      # empty at one process, empty at all (registry)
                    op_comm.append((opdef, [dataclasses.replace(site, process_id=pid)
                                            for pid in mesh.process_ids]))
        return planned_traffic(points, op_comm, self.static.pricer)

    def write(self) -> None:
        values, ops = self.layout()
        for v in self.program.values.values():
            v.dist_attr = values[v.name]
        for op, da in zip(self.ops, ops):
            op.dist_attr = da
        self.program.completion_origin = {n: (self.ops[k], srcs) for n, (k, srcs)
                                          in self.origin.items()}


def _settle(static: CompletionSetup, best: _Completion) -> _Completion:
    """Conflicts settled by cost: per op signature, in the order met, the other
    candidates are tried (one completion each, the locally cheapest first, at most
    TRIAL_OPS / ops in all) and the first that lowers the whole program's planned
    traffic is kept. Deterministic: the same program gives the same trials."""
    budget = TRIAL_OPS // max(len(static.ops), 1)
    total = best.traffic()
    tried: set = set()
    outcomes: dict = {}
    trials = 0
    while trials < budget:
        pending = [(key, c) for key, c in best.conflicts.items()
                   if key not in tried and key not in best.choices]
        if not pending:
            break
        key, conflict = pending[0]
        tried.add(key)
        for cand in conflict.candidates[1:1 + budget - trials]:
            trials += 1
            trial = _Completion(static, {**best.choices, key: cand.lead}).run()
            after = trial.traffic()
            kept = after.key() < total.key()
            if key not in outcomes or kept:
                outcomes[key] = Outcome(cand.lead_name, after, total, kept)
            if kept:
                best, total = trial, after
                break
    best.outcomes = outcomes
    return best


def _known_names(op, ins, outs) -> list:
    return [v.name for v, s in zip(op.inputs + op.outputs, ins + outs)
            if any(e not in (UNKNOWN, None) for e in s.dims)]


def _attr(mesh, spec: DimsSpec, v) -> DistAttr:
    s = ShardSpec(spec.known().dims, spec.partial)
    s.validate(mesh, v.shape, v.name)
    return DistAttr(mesh, s)


def complete(program: Program, default_mesh: ProcessMesh | None = None,
             cluster=None) -> Program:
    """Complete the distributed attributes of ``program`` in place and return it.

    ``cluster`` prices the reshards that conflicts between operands cost as the search
    does (process p on the cluster's p-th device); without one, ``Cluster.local`` of the
    program's processes does, as the estimate prices a plan without one
    (:mod:`~distgraph.passes.completion.resolution`)."""
    complete_run(program, default_mesh, cluster)
    return program


def complete_run(program: Program, default_mesh: ProcessMesh | None = None,
                 cluster=None) -> _Completion:
    """:func:`complete`, returning the run whose layout it wrote (what
    :func:`~distgraph.passes.completion.alike.complete_alike` replays on another mesh)."""
    static = CompletionSetup(program, default_mesh, cluster)
    best = _Completion(static).run()
    if best.conflicts:
        best = _settle(static, best)
    best.write()
    return best
