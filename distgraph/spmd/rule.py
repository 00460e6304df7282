"""The rule protocol: what every sharding rule answers, and the records it answers with.

A rule is bound to one call site (shapes, mesh, attributes) by :meth:`Rule.bind`; the
bound rule then answers two questions:

- ``solve(query)``: given what is known of the operands (a :class:`RuleQuery`: specs,
  which operands are fixed, the direction, optionally which operand leads), the specs
  the op consumes and produces (:class:`SpmdResult`);
- ``strategies()``: every layout the op can run in on that mesh, as
  :class:`OpStrategy` records (what the cost search chooses from).

``infer_forward`` / ``infer_backward`` / ``infer`` / ``strategies`` are the public
entry points built on those two.

Example::

    rule = dg.ops.spmd_rule("matmul")
    res = rule.infer_forward([["x", None], [None, None]], [(8, 4), (4, 6)], mesh)
    [str(s) for s in res.out_specs]                        # ['[x, None]']
    [s.name for s in rule.strategies([(8, 4), (4, 6)], [(8, 6)], mesh)][:2]
    # ['[None, None] x [None, None] -> [None, None]', '[x, None] x [None, None] -> [x, None]']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

from distgraph.placement import ShardSpec
from distgraph.spmd.specs import DimsSpec, SpmdRuleError, entry_dims


class Source(NamedTuple):
    """One operand of an op: ``Source("input", 0)``; prints as ``input 0``."""

    side: str
    index: int

    def __str__(self) -> str:
        return f"{self.side} {self.index}"


class RuleQuery(NamedTuple):
    """What a rule is asked: the known specs of the inputs and outputs; ``fixed_in`` /
    ``fixed_out`` (indices of annotated operands: they come first); ``outputs_first``
    (the backward direction: outputs before inputs); ``lead`` (an operand put first of
    all but the fixed outputs, to ask what keeping it costs)."""

    in_specs: tuple
    out_specs: tuple = ()
    fixed_in: frozenset = frozenset()
    fixed_out: frozenset = frozenset()
    outputs_first: bool = False
    lead: Source | None = None

    @classmethod
    def make(cls, in_specs, out_specs=(), fixed_in=(), fixed_out=(), outputs_first=False,
             lead=None) -> RuleQuery:
        """Accept specs as DimsSpecs, ShardSpecs or lists, indices as any iterable."""
        return cls(tuple(DimsSpec.of(s) for s in in_specs),
                   tuple(DimsSpec.of(s) for s in (out_specs or ())),
                   frozenset(fixed_in), frozenset(fixed_out), bool(outputs_first), lead)

    def sources(self) -> list:
        """The operands in priority order: fixed outputs, the lead, fixed inputs, then
        inputs and outputs (outputs first when ``outputs_first``)."""
        ins = [Source("input", i) for i in range(len(self.in_specs))]
        outs = [Source("output", j) for j in range(len(self.out_specs))]
        fixed_outs = [s for s in outs if s.index in self.fixed_out]
        fixed_ins = [s for s in ins if s.index in self.fixed_in]
        rest_in = [s for s in ins if s.index not in self.fixed_in]
        rest_out = [s for s in outs if s.index not in self.fixed_out]
        order = fixed_outs + fixed_ins + (rest_out + rest_in if self.outputs_first
                                          else rest_in + rest_out)
        if self.lead is not None and self.lead in order and self.lead not in fixed_outs:
            order.remove(self.lead)
            order.insert(len(fixed_outs), self.lead)
        return order

    def spec(self, source: Source) -> DimsSpec:
        return (self.in_specs if source.side == "input" else self.out_specs)[source.index]

    def is_fixed(self, source: Source) -> bool:
        return source.index in (self.fixed_in if source.side == "input" else self.fixed_out)


@dataclass(frozen=True, slots=True)
class SpmdResult:
    """What a rule decided: consumer specs of the inputs, producer specs of the outputs,
    notes on conflicts and dropped splits (for explain), and ``resharded``: the operands
    whose known layout the result does not keep."""

    in_specs: tuple
    out_specs: tuple
    notes: tuple = ()
    resharded: tuple = ()


@dataclass(frozen=True)
class OpStrategy:
    """One way an op runs on a mesh (CONVENTIONS 4: a strategy is one record).

    ``name`` reads ``[x, None] x [None, y] -> [x, y]`` (inputs as consumed ``x`` -ed
    together, then the outputs as produced); ``in_specs`` / ``out_specs`` are ShardSpecs
    (an output may be Partial); ``in_local_shapes`` / ``out_local_shapes`` the shards one
    process holds; ``flops_fraction`` the share of the op's FLOPs one process computes
    (1 / the product of the mesh dims that split its letters); ``comm`` the collectives
    the op's distributed form runs inside it, ``((kind, group size, buffer bytes), ...)``
    as the registry's ``comm`` hook declares them (what one process sends for them is
    ``distgraph.passes.cost.formulas.comm_bytes(strategy.comm)``). Resharding between ops is
    not part of a strategy: it is the cost of an edge. ``zero``: an optimizer update run on
    ZeRO's slice of its parameter, its states split (the search's choice per update:
    :mod:`distgraph.passes.search.layouts.sharded_states`); a parameter or state laid out
    by such an update says so too.
    """

    name: str
    in_specs: tuple
    out_specs: tuple
    in_local_shapes: tuple
    out_local_shapes: tuple
    flops_fraction: float
    comm: tuple = ()
    zero: bool = False

    def __str__(self) -> str:
        return self.name

    @classmethod
    def build(cls, mesh, in_specs, out_specs, in_shapes, out_shapes) -> OpStrategy:
        """A strategy from complete DimsSpecs and global shapes (no communication)."""
        sizes = dict(zip(mesh.dim_names, mesh.shape))

        def local(spec, shape):
            out = []
            for entry, n in zip(spec.dims, shape):
                for m in entry_dims(entry):
                    n //= sizes[m]
                out.append(n)
            return tuple(out)

        split = set()
        # a pending sum the op only passes on (a linear op's P x P -> P) splits no work
        kept = frozenset.intersection(*(frozenset(s.partial) for s in in_specs)) \
            if in_specs else frozenset()
        for spec in list(in_specs) + list(out_specs):
            for entry in spec.dims:
                split.update(entry_dims(entry))
        for spec in out_specs:
            split.update(spec.partial - kept)
        ways = 1
        for m in split:
            ways *= sizes[m]
        ins = tuple(ShardSpec(s.dims, s.partial) for s in in_specs)
        outs = tuple(ShardSpec(s.dims, s.partial) for s in out_specs)
        name = " x ".join(map(str, ins)) + " -> " + ", ".join(map(str, outs))
        return cls(name, ins, outs, tuple(local(s, n) for s, n in zip(in_specs, in_shapes)),
                   tuple(local(s, n) for s, n in zip(out_specs, out_shapes or ())), 1.0 / ways)


class BoundRule(Protocol):
    """A rule bound to one call site (shapes, mesh, attributes)."""

    def solve(self, query: RuleQuery) -> SpmdResult:
        ...

    def strategies(self) -> list:
        ...


class Rule:
    """Base of sharding rules: subclasses implement :meth:`bind`; the public calls below
    are built on it. Attributes are the op's attributes (``axis=-1``, ``shape=(4, 6)``).
    ``reads``: the names of the attributes :meth:`bind` reads, or None where any may be
    read (completion shares a rule's answers between ops alike in all it reads)."""

    reads: tuple | None = None

    def bind(self, in_shapes, out_shapes, mesh, attrs: dict) -> BoundRule:
        raise NotImplementedError

    def infer_forward(self, in_specs, in_shapes, mesh, fixed=(), **attrs) -> SpmdResult:
        """Inputs -> outputs. ``fixed`` lists the indices of inputs whose specs are
        annotations (they win conflicts)."""
        return self.infer(in_specs, None, in_shapes, None, mesh, fixed, **attrs)

    def infer_backward(self, in_specs, out_specs, in_shapes, out_shapes, mesh, fixed=(),
                       **attrs) -> SpmdResult:
        """Outputs (and what is known of inputs) -> inputs; outputs take priority."""
        return self.infer(in_specs, out_specs, in_shapes, out_shapes, mesh, fixed,
                          outputs_first=True, **attrs)

    def infer(self, in_specs, out_specs, in_shapes, out_shapes, mesh, fixed_in=(),
              fixed_out=(), outputs_first=False, lead=None, **attrs) -> SpmdResult:
        """The general form (see :class:`RuleQuery` for the arguments)."""
        if len(in_specs) != len(in_shapes):
            raise SpmdRuleError(f"{len(in_specs)} input specs for {len(in_shapes)} input shapes")
        query = RuleQuery.make(in_specs, out_specs, fixed_in, fixed_out, outputs_first, lead)
        return self.bind(in_shapes, out_shapes, mesh, attrs).solve(query)

    def strategies(self, in_shapes, out_shapes, mesh, in_dtypes=None, **attrs) -> list:
        """Every layout the op can run in on ``mesh``, replicated first (``in_dtypes``
        sizes the op's own communication, float32 if not given)."""
        return self.bind(in_shapes, out_shapes, mesh, attrs).strategies()
