"""What every completion run of a program shares (:mod:`distgraph.passes.completion.complete`
tries several runs when it settles conflicts by cost): each op's and Value's mesh, the
specs fixed by annotations, per-op metadata and signatures, each signature's bound rule
and the memo of its answers (rules are pure), the reshard prices (on the cluster given,
else ``Cluster.local`` of the program's processes), and the specs a run starts from.

Example::

    setup = CompletionSetup(program, default_mesh=None, cluster=None)
    setup.rule(k, RuleQuery.make(in_specs))       # op k's rule, memoised
"""

from __future__ import annotations

import functools

from typing import NamedTuple

from distgraph.passes.completion.mesh_propagation import assign_meshes
from distgraph.passes.completion.resolution import ReshardPricer

from distgraph.errors import PlanError
from distgraph.ir import Program
from distgraph.mesh import ProcessMesh
from distgraph.registry import spmd_rule
from distgraph.resources.cluster import Cluster
from distgraph.spmd import DimsSpec, RuleQuery, SpmdRuleError


class InputMeta(NamedTuple):
    """What a visit needs to know of one input, fixed for the run: its Value, the spec
    fixed for it (shard_op in_spec or annotation on the op's mesh; None if free), whether
    its Value lives on the op's mesh, whether the op may fill the Value's spec (an
    unannotated input or parameter on the op's mesh), and whether the op starts from the
    Value's layout: on its own mesh, or on a mesh of the same shape and dim names (the
    next pipeline stage: a batch split over one stage's "dp" stays split over the next's)."""

    index: int
    name: str
    fixed: DimsSpec | None
    same_mesh: bool
    source: bool
    alike: bool


class OutputMeta(NamedTuple):
    """One output: its Value, its annotation on the op's mesh (None if none) and the
    (op, operand) pairs on the op's mesh that consume it."""

    index: int
    name: str
    annotation: DimsSpec | None
    consumers: tuple


class OpMeta(NamedTuple):
    """Per op: its inputs and outputs, the indices of the fixed ones, ``hard``: the
    inputs whose consumer spec the user gave with shard_op (no cost choice changes
    those), and ``linear``: the op is a sum of its operands, so its rule is told their
    pending sums (it keeps a common one: ``P x P -> P``)."""

    ins: tuple
    outs: tuple
    fixed_in: frozenset
    fixed_out: frozenset
    hard: tuple
    linear: bool = False


class CompletionSetup:
    """What every completion run of a program shares: meshes, the fixed specs, per-op
    metadata and signatures, the bound rules and the memo of their answers (rules are
    pure), the reshard prices on ``cluster`` (None: ``Cluster.local`` of the program's
    processes), and the specs a run starts from."""

    def __init__(self, program: Program, default_mesh: ProcessMesh | None, cluster=None):
        self.program, self.ops = program, program.ops
        self.producer = {o.name: (k, j) for k, op in enumerate(self.ops)
                         for j, o in enumerate(op.outputs)}
        self.consumers: dict[str, list] = {}
        for k, op in enumerate(self.ops):
            for i, v in enumerate(op.inputs):
                self.consumers.setdefault(v.name, []).append((k, i))
        self.mesh, self.vmesh = assign_meshes(program, self.producer, self.consumers,
                                              default_mesh)
        self._cluster = cluster
        unknown: dict = {}                  # one all-unknown spec per rank, shared

        def unknown_spec(ndim):
            spec = unknown.get(ndim)
            if spec is None:
                spec = unknown[ndim] = DimsSpec.unknown(ndim)
            return spec

        self.vspec, self.vfixed = {}, set()
        for v in program.values.values():
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
        self.hard: set = set()               # (op, operand) given by shard_op in_specs
        for k, op in enumerate(self.ops):
            wanted = dict(op.annotation.in_specs) if op.annotation is not None else {}
            for i, v in enumerate(op.inputs):
                spec = unknown_spec(v.ndim)
                if v.name in wanted:
                    spec = DimsSpec.of(wanted[v.name])
                    self.fixed_spec[(k, i)] = spec
                    self.hard.add((k, i))
                elif v.annotation is not None and v.annotation.mesh == self.mesh[k]:
                    spec = DimsSpec(DimsSpec.of(v.annotation.spec).dims)
                    self.fixed_spec[(k, i)] = spec
                self.ispec[(k, i)] = spec
        n = len(self.ops)
        self.meta = [self._meta(k) for k in range(n)]
        # The GPT blocks repeat the same signatures layer after layer.
        shared: dict = {}                   # equal signatures become one object
        self.signature = [self._signature(k, shared) for k in range(n)]
        # Rule answers are shared wider: by ops alike in all their rule reads (the
        # dropouts of repeated layers differ in their seeds only); conflicts stay per
        # signature.
        alike: dict = {}
        self.rule_key = [self._rule_key(k, alike) for k in range(n)]
        self.bound: dict = {}
        self.memo: dict = {}

    @functools.cached_property
    def pricer(self) -> ReshardPricer:
        """The reshard prices, made when a conflict is first priced: most completions
        meet none, and ``Cluster.local`` of many processes is not free to build."""
        cluster = self._cluster
        if cluster is None:
            meshes = set(self.mesh) | set(self.vmesh.values())
            cluster = Cluster.local(1 + max((p for m in meshes if m is not None
                                             for p in m.process_ids), default=0))
        return ReshardPricer(cluster)

    def _meta(self, k: int) -> OpMeta:
        """What a visit of op k needs that never changes during the run."""
        op, mesh = self.ops[k], self.mesh[k]
        ins = []
        for i, v in enumerate(op.inputs):
            there = self.vmesh[v.name]
            same = there == mesh
            source = same and v.name not in self.producer and v.name not in self.vfixed
            alike = there.shape == mesh.shape and there.dim_names == mesh.dim_names
            ins.append(InputMeta(i, v.name, self.fixed_spec.get((k, i)), same, source, alike))
        outs = []
        for j, o in enumerate(op.outputs):
            ann = None
            if o.annotation is not None and o.annotation.mesh == mesh:
                ann = DimsSpec.of(o.annotation.spec)
            wanted = tuple((c, i) for c, i in self.consumers.get(o.name, ())
                           if self.mesh[c] == mesh)
            outs.append(OutputMeta(j, o.name, ann, wanted))
        return OpMeta(tuple(ins), tuple(outs),
                      frozenset(m.index for m in ins if m.fixed is not None),
                      frozenset(m.index for m in outs if m.annotation is not None),
                      tuple(i for i in range(len(op.inputs)) if (k, i) in self.hard),
                      spmd_rule(op.type).linear)

    def _signature(self, k: int, shared: dict):
        """What, besides the specs, a rule call of op k depends on: op type, shapes,
        dtypes, mesh and attributes (None if an attribute is unhashable: never
        memoised)."""
        op = self.ops[k]
        key = (op.type, tuple(tuple(v.shape) for v in op.inputs),
               tuple(tuple(o.shape) for o in op.outputs), self.mesh[k],
               tuple(v.dtype for v in op.inputs + op.outputs), tuple(sorted(op.attrs.items())))
        try:
            return shared.setdefault(key, key)
        except TypeError:
            return None

    def _rule_key(self, k: int, alike: dict):
        """What op k's rule reads besides the specs: its signature, less the values of
        the attributes the rule declares it does not read (``Rule.reads``; their names
        stay: the registry checks them). None where the signature is."""
        sig = self.signature[k]
        reads = getattr(spmd_rule(self.ops[k].type).rule, "reads", None)
        if sig is None or reads is None:
            return sig
        attrs = self.ops[k].attrs
        key = sig[:5] + (tuple(sorted(attrs)), tuple((n, attrs[n]) for n in reads if n in attrs))
        return alike.setdefault(key, key)

    def rule(self, k: int, query: RuleQuery):
        """Op k's rule bound to its call site (once per rule key), asked ``query``;
        memoised per (rule key, query): rules are pure."""
        sig = self.rule_key[k]
        key = None
        if sig is not None:
            key = (sig, query)
            res = self.memo.get(key)
            if res is not None:
                return res
        op, mesh = self.ops[k], self.mesh[k]
        try:
            bound = self.bound.get(sig) if sig is not None else None
            if bound is None:
                bound = spmd_rule(op.type).bind([v.shape for v in op.inputs],
                                                [o.shape for o in op.outputs], mesh, op.attrs)
                if sig is not None:
                    self.bound[sig] = bound
            res = bound.solve(query)
        except SpmdRuleError as e:
            raise PlanError(f"sharding rule of op #{k} '{op.type}' ({op.layer or 'top level'}) "
                            f"on {mesh}: {e}") from None
        if key is not None:
            self.memo[key] = res
        return res
