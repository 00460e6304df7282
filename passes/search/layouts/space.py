"""The nodes of the intra-op search: what each op and each source tensor may choose.

A training program (forward, loss, backward and update ops: Alpa searches the whole
training graph, see :mod:`distgraph.passes.search.layouts.intra_op`) on one ProcessMesh becomes a list of
:class:`Node` records:

- one node per **source** Value (a feed, parameter or optimizer state, or for a stage the
  activations it receives), whose strategies are its layouts on the mesh: every mesh dim
  of size > 1 splits one of its dims (that it divides) or none;
- one node per **op**, whose strategies are its rule's (``OpStrategy`` records: specs
  consumed and produced, local shapes, the op's own collectives).

**Light ops follow an operand** (Alpa's graph simplification, OSDI'22 §4): an op that
contracts no letter shared by two operands (elementwise, reshape, transpose, reductions,
softmax, layer_norm, the update ops...) takes the strategy its rule answers to the
layout of its deepest operand (the one with the longest path from the sources; the
first on ties). Its strategy list is then one entry per strategy of that operand, in
the same order, so that the ILP can tie the two by index (``follow``). It follows the
deepest operand that leaves it a choice (a broadcast of a scalar, which has one layout,
would pin the loss gradient replicated; it then chooses freely). Heavy ops (matmul,
embedding gradients), ops without operands and light ops that sum a parameter's letter
away choose freely: the embedding looks rows up, so it is light, but following its ids
would leave the table whole or gathered, where Megatron splits its vocabulary (a
pending sum) or hidden dim.

**A Partial result offers each way to settle it.** An operand that comes as a pending
sum is resharded before a light op; which layout the op then takes is a choice (an
all-reduce leaves it unsplit, a reduce-scatter splits a dim, as after Megatron's row-split
matmul). So a freely choosing op lists each strategy with a Partial output once per way
to settle it (its ``hints``: what followers are given); the copies cost the same, and
the reshard from the true Partial layout is priced on the edge to each consumer.

**A parameter follows its update.** An update writes the parameter and its states back
in the update's layout (``alias_of``), so their sources take the update's strategy
index: the same choices as an alias constraint, in fewer variables.

**On a (dp, cp, tp) mesh ``cp`` splits the sequence and ``x`` the samples** (the stage
search's, :mod:`distgraph.passes.search.stages.runs`): only tensor dims as long as the
feeds' dim 1 over ``cp`` (:data:`SEQUENCE_DIM`), as long as their dim 0 (the rows, which
that ``x`` divides) over ``x``, or sums over them (weight gradients; ZeRO slices updates
over them): Megatron's cp and dp, not more tp, so a 3-D mesh offers fewer strategies
than a 2-D one (GPT-3's block on (8, 64, 2): 5,301, 18,077 with ``x`` free, 7,225 on
(8, 2)); what ``x`` split otherwise, the (x, tp) mesh of those devices offers.

**Under a target** (``style``: ``Strategy(target=...)``) the layouts of weights and feeds
that Megatron-LM / torchtitan do not run are forbidden (``allowed`` False, an infinite
price): the mesh's last dim is tensor parallel, the others data parallel
(:mod:`distgraph.plan.styles`, the predicate ``plan.export`` checks with).

**Annotations are hard constraints**: an annotated source keeps its layout, an annotated
result is produced as annotated, a ``shard_op`` in_spec is consumed as given; an op that
carries one chooses freely among the strategies that agree. A strategy that consumes
one Value in two different layouts is never offered (the program names an operand's
layout once per op).

Example::

    space = SearchSpace(program, mesh)
    node = space.nodes[space.op_node[3]]
    [s.name for s in node.strategies][:2]
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

from distgraph.errors import PlanError, ShardingError
from distgraph.mesh import ProcessMesh
from distgraph.registry import spmd_rule
from distgraph.placement import ShardSpec
from distgraph.passes.session import Session
from distgraph.plan.accumulation import made_once
from distgraph.plan.instructions import keeps_nothing
from distgraph.plan.styles import feed_problem, search_roles, weight_problem, weight_kinds
from distgraph.spmd import (UNKNOWN, DimsSpec, EinsumPlan, OpStrategy, RuleQuery,
                            SpmdRuleError)
from distgraph.passes.search.layouts.placements import (MESH_DIMS, local_shape, settlements,
                                                        without_unit_dims, layouts)
from distgraph.passes.search.layouts.sharded_states import offered, updates

# a search mesh dim of this name splits the sequence only (context parallelism): the
# dims as long as the feeds' dim 1, or a pending sum over it (module docstring)
SEQUENCE_DIM = "cp"


def logical_dims(logical) -> list:
    """The dim names of a logical mesh: ``x``, ``y`` of a (dp, tp) shape; ``x``,
    ``cp``, ``y`` of a (dp, cp, tp) one (``y`` inside a machine, ``cp`` next, as Meta
    orders tp, cp and dp)."""
    return [MESH_DIMS[0], SEQUENCE_DIM, MESH_DIMS[1]] if len(logical) == 3 else \
        list(MESH_DIMS[:len(logical)])


@dataclass(frozen=True)
class Node:
    """One choice of the search. ``op`` is the op's index in the program (None for a
    source Value, named by ``value``); ``strategies`` are OpStrategy records (a source's
    have one output: its layout); ``leader`` is the node whose strategy index this one
    takes (-1: free); ``allowed[i]`` is False where strategy i is forbidden (a follower's
    answer that consumes a Value in two layouts); ``hints[i]`` holds, per output, the
    layout a follower is given under strategy i: the output's spec, or for a Partial
    output one way to settle the sum (module docstring)."""

    index: int
    op: int | None
    value: str | None
    label: str
    layer: str
    strategies: tuple
    leader: int = -1
    allowed: tuple = ()
    hints: tuple = ()

    @property
    def is_source(self) -> bool:
        return self.op is None


@dataclass
class SearchSpace:
    """The nodes of ``program``'s ops (or of the op indices ``ops``: a stage) on ``mesh``;
    see the module docstring. ``op_node[k]`` / ``source_node[name]`` index :attr:`nodes`;
    ``producer[name]`` is (node, output index) of the node that makes a Value;
    ``boundary`` names the Values a stage receives from ops outside it (one source
    node each, replicated: any split of it is a local slice); ``leaving`` those it
    sends to ops outside it. ``received`` overrides what a received Value offers:
    ``{name: spec}`` that one layout (as a neighbour makes it), ``{name: None}`` every
    layout (a repeated block's input, tied to the output it makes for the next block).
    What ops offer on a mesh shape (bound rules, strategies, followers' answers, choices
    moved to other meshes) is kept in ``session``'s "op strategies", shared with every
    space of the planning; who makes and reads each Value, and the ops whose kept memory
    could never serve their gradient (``keeping_nothing``) and, with ``once``, the Values
    a micro-batched step makes once (``made_once``, whose ops choose freely), in its
    "program facts". ``zero``: how ZeRO is offered on the updates (a :class:`~distgraph.
    passes.search.layouts.sharded_states.Zero`, None: not at all; :meth:`_offer_zero`)."""

    program: object
    mesh: ProcessMesh
    ops: tuple = None
    nodes: list = field(default_factory=list)
    op_node: dict = field(default_factory=dict)
    source_node: dict = field(default_factory=dict)
    producer: dict = field(default_factory=dict)
    boundary: set = field(default_factory=set)
    leaving: set = field(default_factory=set)
    received: dict = field(default_factory=dict)
    session: Session | None = None
    style: str | None = None
    once: bool = False
    zero: object = None

    def __post_init__(self):
        whole = self.ops is None
        self.ops = tuple(range(len(self.program.ops)) if whole else self.ops)
        self.session = self.session or Session()
        facts = self.session.table("program facts")
        program = self.program
        # the program's ops whose kept memory could never serve their gradient
        # (keeps_nothing), found once per program: the liveness sets read them
        self.keeping_nothing = facts.memo((program, "keeping nothing"),
                                          lambda: keeps_nothing(program.ops))
        # with ``once`` (a micro-batched step's) the Values it makes once (made_once),
        # found once per program: their ops choose freely (their operands may be
        # resharded, once a step), and the charges and the liveness sets read them
        self.made_once = facts.memo((program, "made once"), lambda: made_once(program)) \
            if self.once else frozenset()
        # what ops offer on this mesh's shape, kept per op signature (module docstring)
        self._offers = self.session.table("op strategies")
        self._at = (tuple(self.mesh.shape), tuple(self.mesh.dim_names))
        # Values a part of the program receives from ops outside it (a stage's inputs)
        self._outside = set()
        if not whole:
            made_by, read_by = facts.memo((program, "index", len(program.ops)),
                                          lambda: _index(program))
            inside = set(self.ops)
            made_here = [o.name for k in self.ops for o in self.program.ops[k].outputs]
            self._outside = {v.name for k in self.ops for v in self.program.ops[k].inputs
                             if made_by.get(v.name, k) not in inside}
            self.leaving = {name for name in made_here
                            if any(k not in inside for k in read_by.get(name, ()))}
        # on a (dp, cp, tp) mesh, what cp and x may split: the feeds' dims 1 and 0
        shape = self.program.inputs[0].shape if self.program.inputs else ()
        self._only = tuple((dim, int(shape[d]) if len(shape) > d else -1) for dim, d in
                           ((SEQUENCE_DIM, 1), (MESH_DIMS[0], 0))) \
            if SEQUENCE_DIM in self.mesh.dim_names else None
        # Values a linear op (add, subtract) reads: a pending sum may reach it unsettled
        self._summed = {v.name for k in self.ops for v in self.program.ops[k].inputs
                        if spmd_rule(self.program.ops[k].type).linear}
        depth: dict = {}
        for k in self.ops:
            op = self.program.ops[k]
            self._check_mesh(op)
            for v in op.inputs:
                if v.name not in self.producer:
                    self._add_source(v)
            operands = [self.producer[v.name][0] for v in op.inputs]
            depth_of = [depth.get(n, 0) for n in operands]
            self._add_op(k, op, operands, depth_of)
            depth[len(self.nodes) - 1] = 1 + max(depth_of, default=0)
            for j, o in enumerate(op.outputs):
                self.producer[o.name] = (len(self.nodes) - 1, j)
        self._offer_zero()
        self._tie_sources_to_updates()
        if self.style is not None:
            self._keep_to_style()

    # -- nodes ------------------------------------------------------------------------------
    def _check_mesh(self, op) -> None:
        annotated = [op.annotation.mesh] if op.annotation is not None else []
        annotated += [v.annotation.mesh for v in op.inputs + op.outputs
                      if v.annotation is not None]
        for mesh in annotated:
            if mesh != self.mesh:
                raise PlanError(f"op {op.type} ({op.layer or 'top level'}) is annotated on "
                                f"{mesh}, but the search plans on {self.mesh}: with "
                                "Strategy(auto_mode='full') annotate on that mesh (or on "
                                "none), or use auto_mode='semi'")

    def _in_role(self, specs, shapes) -> bool:
        """Whether ``specs`` (of tensors of ``shapes``) split ``cp`` and ``x`` as their
        roles allow (module docstring; always on a mesh without ``cp``)."""
        return self._only is None or not any(
            n != length and dim in spec.entry(d) for spec, shape in zip(specs, shapes)
            for d, n in enumerate(shape) for dim, length in self._only)

    def _op_keeps(self, op, s) -> bool:
        return self._in_role(tuple(s.in_specs) + tuple(s.out_specs),
                             [v.shape for v in op.inputs] + [o.shape for o in op.outputs])

    def _add_source(self, v) -> None:
        offered = self._offers.memo((self._at, "layouts", tuple(v.shape)),
                                    lambda: tuple(layouts(v.shape, self.mesh)))
        found = [s for s in offered if self._in_role(s.out_specs, [v.shape])]
        if v.name in self._outside:
            # received from another stage: it arrives as the ops here consume it (the
            # p2p transfer is the same whatever they want), so it offers one layout
            # from which every split is a local slice
            if v.name not in self.received:
                found = found[:1]
            elif self.received[v.name] is not None:
                found = [x for x in found if x.out_specs[0] == self.received[v.name]]
            self.boundary.add(v.name)
        elif v.annotation is not None:
            wanted = without_unit_dims(v.annotation.spec, self.mesh)
            found = [s for s in found if s.out_specs[0] == wanted]
            if not found:
                raise PlanError(f"{v.name} {list(v.shape)} is annotated {v.annotation.spec} on "
                                f"{self.mesh}, which is not a layout of it there")
        index = len(self.nodes)
        self.nodes.append(Node(index, None, v.name, f"value {v.name}", _layer_of_value(v.name),
                               tuple(found), -1, (True,) * len(found),
                               tuple(s.out_specs for s in found)))
        self.source_node[v.name] = index
        self.producer[v.name] = (index, 0)

    def _add_op(self, k: int, op, operands: list, depth_of: list) -> None:
        index = len(self.nodes)
        label = f"#{k} {op.type} ({op.layer or 'top level'})"
        constrained = op.annotation is not None or any(o.annotation is not None
                                                       for o in op.outputs)
        once = op.outputs and all(o.name in self.made_once for o in op.outputs)
        if op.inputs and not constrained and not once and self._light(op) and \
                not self._sums_weight(op):
            for pick in sorted(range(len(op.inputs)), key=lambda i: (-depth_of[i], i)):
                induced, key = self._follow(op, pick, operands[pick])
                names = len({s.name for s in induced})
                if names >= 2 or names >= min(2, len(self._strategies(op))):
                    # which answers are allowed depends on what the key names, which
                    # operands are one Value (_consistent) and what cp and x split
                    allowed = self._offers.memo(
                        (self._at, "allowed", key, _aliasing(op), self._only),
                        lambda: tuple(_consistent(op, s) and self._op_keeps(op, s)
                                      for s in induced))
                    self.nodes.append(Node(
                        index, k, None, label, op.layer, tuple(induced), operands[pick],
                        allowed, tuple(s.out_specs for s in induced)))
                    self.op_node[k] = index
                    return
        summed = tuple(o.name in self._summed for o in op.outputs)
        if constrained:
            self._add_free(index, k, label, op, *self._free(op, label, summed))
            return
        # unannotated, an op's choices depend on its signature, which operands are one
        # Value, what cp and x split and which results a linear op reads: once per those
        self._add_free(index, k, label, op, *self._offers.memo(
            (self._at, "free", self._signature(op), _aliasing(op), self._only, summed),
            lambda: self._free(op, label, summed)))

    def _free(self, op, label, summed) -> tuple:
        """(strategies, hints) of an op choosing freely: its rule's strategies that agree
        with its annotations, each once per way to settle its Partial results."""
        found = [s for s in self._strategies(op) if _consistent(op, s) and _agrees(op, s)
                 and self._op_keeps(op, s)]
        if not found:
            raise PlanError(f"op {label} has no strategy on {self.mesh} that agrees with "
                            "its annotations; change the annotations")
        strategies, hints = [], []
        shapes = [o.shape for o in op.outputs]
        for s in found:
            for hint in settlements(s, shapes, self.mesh, summed):
                if not self._in_role(hint, shapes):
                    continue
                strategies.append(s)
                hints.append(hint)
        return tuple(strategies), tuple(hints)

    def _add_free(self, index, k, label, op, strategies, hints) -> None:
        self.nodes.append(Node(index, k, None, label, op.layer, strategies, -1,
                               (True,) * len(strategies), hints))
        self.op_node[k] = index

    def _offer_zero(self) -> None:
        """Each update's strategies as ZeRO (``zero``, a :class:`~distgraph.passes.search.
        layouts.sharded_states.Zero`) offers them: run on ZeRO's slice in their place, or,
        where sharding each update is the search's choice, beside them
        (:func:`~distgraph.passes.search.layouts.sharded_states.offered`). An update
        offered both keeps taking the index of the node it follows: every node of its
        tie (the node its chain of follows leads back to, and all that follow it) offers
        again, at each twin's index, what it offers at the strategy the twin runs as,
        so one index still names one strategy of each, and the twin's layouts cost
        every neighbour what the strategy's do."""
        members: dict = {}          # the node a tie's follows lead back to -> its nodes
        root = []
        for n in self.nodes:        # (a node follows one made before it)
            root.append(n.index if n.leader < 0 else root[n.leader])
            members.setdefault(root[-1], []).append(n.index)
        for found, op in list(updates(self)):
            node = self.nodes[found.index]      # as an earlier update's tie left it
            strategies, twin_of = offered(op, node.strategies, self.mesh, self.zero)
            if len(strategies) == len(node.strategies):     # ZeRO in place, or none
                self.nodes[node.index] = dataclasses.replace(node, strategies=strategies)
                continue
            for k in members[root[node.index]]:
                m = self.nodes[k]
                self.nodes[k] = dataclasses.replace(
                    m, strategies=strategies if k == node.index else
                    tuple(m.strategies[i] for i in twin_of),
                    allowed=tuple(m.allowed[i] for i in twin_of),
                    hints=tuple(m.hints[i] for i in twin_of))

    def _tie_sources_to_updates(self) -> None:
        """A parameter or state that an update writes back is laid out as the update
        writes it: the source takes its update's strategy index (unless it is annotated
        or another node already follows it)."""
        followed = {n.leader for n in self.nodes}
        for node in list(self.nodes):
            if node.is_source:
                continue
            op = self.program.ops[node.op]
            for j, o in enumerate(op.outputs):
                src = self.source_node.get(o.alias_of) if o.alias_of else None
                if src is None or src in followed or \
                        self.program.values[o.alias_of].annotation is not None:
                    continue
                made = [OpStrategy(str(s.out_specs[j]), (), (s.out_specs[j],), (),
                                   (s.out_local_shapes[j],), s.flops_fraction, zero=s.zero)
                        for s in node.strategies]
                old = self.nodes[src]
                self.nodes[src] = Node(src, None, old.value, old.label, old.layer, tuple(made),
                                       node.index, (True,) * len(made),
                                       tuple(m.out_specs for m in made))

    def _keep_to_style(self) -> None:
        """Forbid (``allowed`` False) the layouts of weights and feeds that ``style``'s
        framework does not run (:mod:`distgraph.plan.styles`): on a tied weight, its
        update's strategies that write it so."""
        tensor, sequence = search_roles(self.mesh)
        sizes = dict(zip(self.mesh.dim_names, self.mesh.shape))
        data = tuple(m for m in self.mesh.dim_names if m not in (tensor, sequence))
        kinds = self.session.table("program facts").memo(
            (self.program, "weight kinds"), lambda: weight_kinds(self.program))
        feeds = {v.name for v in self.program.inputs}

        def bad(name, spec) -> bool:
            v = self.program.values[name]
            if name in feeds:
                return feed_problem(name, v.shape, spec, sizes, tensor, sequence,
                                    data) is not None
            return weight_problem(name, kinds[name], v.shape, spec, sizes, tensor,
                                  experts_ok=self.style == "megatron") is not None
        for node in list(self.nodes):
            if node.is_source and node.value not in self.boundary and node.leader < 0 \
                    and (node.value in feeds or node.value in kinds):
                keep = tuple(ok and not bad(node.value, s.out_specs[0])
                             for ok, s in zip(node.allowed, node.strategies))
            elif not node.is_source and any(o.alias_of in kinds
                                            for o in self.program.ops[node.op].outputs):
                outs = [(j, o.alias_of) for j, o in enumerate(self.program.ops[node.op].outputs)
                        if o.alias_of in kinds]
                keep = tuple(ok and not any(bad(name, s.out_specs[j]) for j, name in outs)
                             for ok, s in zip(node.allowed, node.strategies))
            else:
                continue
            if not any(keep):
                raise PlanError(f"{node.label} has no layout on {self.mesh} that "
                                f"{self.style} runs (Strategy(target={self.style!r}))")
            self.nodes[node.index] = dataclasses.replace(node, allowed=keep)

    def rebind(self, mesh: ProcessMesh, choice, program=None) -> "SearchSpace":
        """These nodes on ``mesh`` (the same dim names, other sizes), each offering only
        the strategy ``choice`` picks for it here: a choice priced on another mesh. A
        PlanError names the first layout that does not divide there. ``program``: read
        the ops and Values from this one instead, a program of the same ops and Value
        names whose shapes may differ (the model split into other micro-batches)."""
        program = program or self.program
        if tuple(mesh.dim_names) != tuple(self.mesh.dim_names):
            raise PlanError(f"rebind: {mesh} names its dims {list(mesh.dim_names)}, the "
                            f"search's mesh {list(self.mesh.dim_names)}")
        # the records moved here, shared by the rebinds to meshes of this shape
        moved_to, at = self._offers, (tuple(mesh.shape), tuple(mesh.dim_names), "moved")
        nodes = []
        for node in self.nodes:
            s, hint = node.strategies[choice[node.index]], node.hints[choice[node.index]]
            if node.is_source:
                v = program.values[node.value]
                key = (s, hint, tuple(v.shape))
            else:
                op = program.ops[node.op]
                if op.type != self.program.ops[node.op].type:
                    raise PlanError(f"rebind: op {node.op} is {op.type} in the program given, "
                                    f"{self.program.ops[node.op].type} in the search's")
                key = (op.type, s.in_specs, s.out_specs, s.zero, hint,
                       tuple(v.dtype for v in op.inputs),
                       tuple(tuple(v.shape) for v in op.inputs),
                       tuple(tuple(o.shape) for o in op.outputs))
            moved = moved_to.find(at + key)
            if moved is None:
                moved = moved_to[at + key] = self._moved(program, node, s, hint, mesh)
            # a split or pending sum over a dim of one process here is none
            hint = tuple(without_unit_dims(h, mesh) for h in hint)
            nodes.append(Node(node.index, node.op, node.value, node.label, node.layer,
                              (moved,), node.leader, (True,), (hint,)))
        other = copy.copy(self)
        other.program, other.mesh, other.nodes = program, mesh, nodes
        return other

    @staticmethod
    def _moved(program, node, s, hint, mesh):
        """Strategy ``s`` (with ``hint``) of ``node`` of ``program`` as a record on
        ``mesh`` (PlanError where a layout does not divide there)."""
        if node.is_source:
            v = program.values[node.value]
            shapes, specs = [v.shape], list(s.out_specs) + list(hint)
        else:
            op = program.ops[node.op]
            shapes = [v.shape for v in op.inputs] + [o.shape for o in op.outputs] * 2
            specs = list(s.in_specs) + list(s.out_specs) + list(hint)
        for spec, shape in zip(specs, shapes):
            try:
                spec.validate(mesh, shape, node.label)
            except ShardingError as e:
                raise PlanError(f"the choice for {node.label} does not divide on "
                                f"{mesh}: {e}") from None
        # a split or pending sum over a dim of one process here is none (as completion
        # writes it)
        ins = tuple(without_unit_dims(x, mesh) for x in s.in_specs)
        outs = tuple(without_unit_dims(x, mesh) for x in s.out_specs)
        if node.is_source:
            return OpStrategy(s.name, (), outs, (),
                              (local_shape(outs[0], v.shape, mesh),), s.flops_fraction,
                              zero=s.zero)
        return dataclasses.replace(spmd_rule(op.type).strategy(
            ins, outs, [v.shape for v in op.inputs],
            [o.shape for o in op.outputs], mesh, [v.dtype for v in op.inputs]), zero=s.zero)

    # -- strategies ----------------------------------------------------------------------------
    def _signature(self, op) -> tuple:
        return (op.type, tuple(tuple(v.shape) for v in op.inputs),
                tuple(tuple(o.shape) for o in op.outputs),
                tuple(v.dtype for v in op.inputs), repr(sorted(op.attrs.items())))

    def _bound(self, op):
        """(rule, bound rule) of ``op`` on the mesh (its strategies: :meth:`_strategies`,
        enumerated only where asked: a light op that follows needs none)."""
        def bound():
            rule = spmd_rule(op.type)
            try:
                return rule, rule.bind([v.shape for v in op.inputs],
                                       [o.shape for o in op.outputs], self.mesh, op.attrs)
            except SpmdRuleError as e:
                raise PlanError(f"sharding rule of {op.type} ({op.layer or 'top level'}) on "
                                f"{self.mesh}: {e}") from None
        return self._offers.memo((self._at, "bound", self._signature(op)), bound)

    def _strategies(self, op) -> tuple:
        def strategies():
            rule = self._bound(op)[0]
            try:
                return tuple(rule.strategies([v.shape for v in op.inputs],
                                             [o.shape for o in op.outputs], self.mesh,
                                             [v.dtype for v in op.inputs], **op.attrs))
            except SpmdRuleError as e:
                raise PlanError(f"sharding rule of {op.type} ({op.layer or 'top level'}) on "
                                f"{self.mesh}: {e}") from None
        return self._offers.memo((self._at, "strategies", self._signature(op)), strategies)

    def _light(self, op) -> bool:
        """No letter is contracted between two operands (Alpa's "light" ops)."""
        bound = self._bound(op)[1]
        return isinstance(bound, EinsumPlan) and bound.light()

    def _sums_weight(self, op) -> bool:
        """Whether a letter of a parameter the op reads is summed away (a light op that
        still chooses freely: the embedding's vocabulary, split as Megatron splits it,
        leaves a pending sum; followed from its ids the weight was whole or gathered)."""
        bound = self._bound(op)[1]
        if not isinstance(bound, EinsumPlan):
            return False
        outs = set("".join(bound.out_letters))
        return any(v.is_parameter and set(word) - outs - set(bound.internal)
                   for v, word in zip(op.inputs, bound.in_letters))

    def _follow(self, op, pick: int, leader: int) -> tuple:
        """(One strategy per strategy of the leader: the rule's answer when the operand
        ``pick`` (and every other position of the same Value) comes as the leader makes
        it; the key they are kept by on this mesh's shape)."""
        node = self.nodes[leader]
        j = self.producer[op.inputs[pick].name][1]
        made = tuple(h[j] for h in node.hints)
        same = tuple(i for i, v in enumerate(op.inputs) if v.name == op.inputs[pick].name)
        key = (self._signature(op), same, made)
        found = self._offers.find((self._at, "follow") + key)
        if found is None:
            rule, bound = self._bound(op)
            in_shapes = [v.shape for v in op.inputs]
            out_shapes = [o.shape for o in op.outputs]
            answers = {}
            out = []
            # a linear op given a pending sum keeps it: its other operands come as
            # pending sums too (a replicated one becomes one for free)
            pending = rule.linear
            for spec in made:
                if spec not in answers:
                    kept = spec.partial if pending else frozenset()
                    given = DimsSpec(spec.dims, kept)
                    ins = [given if i in same else DimsSpec((UNKNOWN,) * len(v.shape), kept)
                           for i, v in enumerate(op.inputs)]
                    res = bound.solve(RuleQuery.make(
                        ins, [DimsSpec.unknown(len(o.shape)) for o in op.outputs],
                        fixed_in=same))
                    answers[spec] = rule.strategy(
                        [s.known() for s in res.in_specs], [s.known() for s in res.out_specs],
                        in_shapes, out_shapes, self.mesh, [v.dtype for v in op.inputs])
                out.append(answers[spec])
            found = self._offers[(self._at, "follow") + key] = out
        return found, key


def _index(program) -> tuple:
    """({Value name: the op index making it}, {Value name: the op indices reading it}) of
    ``program`` (a space keeps it per program and op count in its "program facts")."""
    made_by, read_by = {}, {}
    for k, op in enumerate(program.ops):
        for o in op.outputs:
            made_by[o.name] = k
        for v in op.inputs:
            read_by.setdefault(v.name, []).append(k)
    return made_by, read_by


def _layer_of_value(name: str) -> str:
    """The layer path of a parameter or its state (``blocks.0.ln1.weight@MOMENT1`` ->
    ``blocks.0.ln1``); '' for feeds and global states."""
    base = name.split("@")[0]
    layer, dot, _ = base.rpartition(".")
    return layer if dot else ""


def _aliasing(op) -> tuple:
    """Which operands of ``op`` are one Value: each operand's first position."""
    first: dict = {}
    return tuple(first.setdefault(v.name, i) for i, v in enumerate(op.inputs))


def _consistent(op, s) -> bool:
    """The strategy consumes each Value in one layout."""
    seen: dict = {}
    for v, spec in zip(op.inputs, s.in_specs):
        if seen.setdefault(v.name, spec) != spec:
            return False
    return True


def _agrees(op, s) -> bool:
    """The strategy keeps the op's annotations: shard_op in_specs, annotated results."""
    if op.annotation is not None:
        wanted = dict(op.annotation.in_specs)
        for v, spec in zip(op.inputs, s.in_specs):
            if v.name in wanted and ShardSpec(wanted[v.name].dims) != spec:
                return False
    for o, spec in zip(op.outputs, s.out_specs):
        if o.annotation is not None and o.annotation.spec != spec:
            return False
    return True

