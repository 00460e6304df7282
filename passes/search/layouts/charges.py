"""What a search's problem charges (the terms :mod:`distgraph.passes.search.layouts.intra_op`'s
docstring lists), written once for its two users: :func:`build_problem`, every strategy
of every node (the ILP's :class:`~distgraph.passes.search.layouts.ilp_problem.ShardingProblem`),
and :func:`fixed_problem`, the one strategy each node of a choice moved to another mesh
offers (``SearchSpace.rebind``), where only the chosen strategies and the chosen pairs'
reshards are priced: no matrix, no strategy left unchosen.

:class:`Charges` holds what every node's terms read (the feeds, the gradients' buffers,
the boundary's targets and ties); its methods give a node's terms per strategy as lists
(``op``, ``source``) and an operand's reshards (``operands``), on
:class:`~distgraph.passes.cost.layout_prices.LayoutPrices`.

Example::

    problem = fixed_problem(space.rebind(mesh, result.choice), costs, weights, None,
                            None, {}, {}, None)
    evaluate(problem, [0] * problem.n)       # the choice's seconds on ``mesh``
"""

from __future__ import annotations

import math

import numpy as np

from distgraph.ir import Role
from distgraph.passes.cost.layout_prices import local_bytes
from distgraph.passes.partition import reuses
from distgraph.passes.search.layouts.ilp_problem import ShardingProblem, checked_liveness
from distgraph.passes.search.layouts.liveness import live_sets
from distgraph.passes.search.layouts.sharded_states import apply_zero, zero_terms
from distgraph.placement import DistAttr


def accumulating_updates(space, weights: dict) -> list:
    """The update ops (nodes) that read a gradient accumulated in a buffer: every update
    of a parameter from a gradient when the updates run fewer times a step than the
    backward (``weights``: micro-batches), else none."""
    if not weights.get(Role.OPTIMIZE, 1) < weights.get(Role.BACKWARD, 1):
        return []
    program = space.program
    return [n.index for n in space.nodes if not n.is_source and
            program.ops[n.op].role == Role.OPTIMIZE and len(program.ops[n.op].inputs) > 1
            and program.ops[n.op].inputs[0].is_parameter]


def gradient_buffers(space, weights: dict) -> dict:
    """{accumulating update node: the node whose memory holds its gradient's buffer}.
    The runtime accumulates a gradient as the backward makes it: it takes the first
    micro-batch's array as the buffer, and the update reshards the sum to its layout
    once a step. So where the op making the gradient makes nothing but such gradients
    (a weight's matmul, a bias's sum), that op's node holds the buffer, in the layout
    it is made in (a sum pending over a mesh dim is whole there); else (a gradient
    received from another part, or made beside an input's gradient, as layer_norm's)
    the update's node holds it, in the layout the update reads it in."""
    program, nodes = space.program, space.nodes
    updates = accumulating_updates(space, weights)
    gradient = {i: program.ops[nodes[i].op].inputs[1].name for i in updates}
    accumulated = set(gradient.values())
    held = {}
    for i, name in gradient.items():
        u = space.producer[name][0]
        alone = not nodes[u].is_source and all(
            o.alias_of or o.name in accumulated for o in program.ops[nodes[u].op].outputs)
        held[i] = u if alone else i
    return held


def once_nodes(space, weights: dict) -> set:
    """The op nodes whose results a micro-batched step makes once
    (:func:`~distgraph.plan.accumulation.made_once`: under amp the parameters' 16-bit
    copies): run once a step and held all of it, as the runtime makes them before the
    first micro-batch. None where the program runs one micro-batch a step (``weights``:
    the updates run as often as the backward)."""
    if not weights.get(Role.OPTIMIZE, 1) < weights.get(Role.BACKWARD, 1) or \
            not space.made_once:
        return set()
    program, once = space.program, space.made_once
    return {n.index for n in space.nodes if not n.is_source and program.ops[n.op].outputs
            and all(o.name in once for o in program.ops[n.op].outputs)}


def held_nodes(space, problem, weights: dict) -> tuple:
    """(the nodes held all step: parameters, states and gradient buffers; the nodes
    saved for the backward: live when it starts and made before it, as the estimate
    counts them, not the first backward op's result nor a gradient received for it;
    the liveness step where the backward starts, None without one) of ``space``'s
    ``problem``."""
    program = space.program
    always = {n.index for n in space.nodes if n.is_source and
              program.values[n.value].persistable}
    holders = gradient_buffers(space, weights)
    always.update(holders, holders.values(), once_nodes(space, weights))
    backward = next((t for t, k in enumerate(space.ops)
                     if program.ops[k].role == Role.BACKWARD), None)
    if not (backward and problem.liveness):
        return always, set(), backward
    before = set(problem.liveness[backward - 1])
    saved = {i for i in problem.liveness[backward] if i in before and i not in always}
    return always, saved, backward


def reused_reshards(space, problem, choice) -> float:
    """Seconds of ``problem``'s edges that ``choice`` pays again where the partitioner
    reshards once: a Value resharded to a layout is read in that copy by every later
    consumer that wants the layout (:func:`~distgraph.passes.partition.reuses`: not by
    a backward op where the forward's copy is larger than the Value), while the problem
    prices each consumer's edge alone (Alpa's pairs). The search's report takes them off
    its objective (:func:`~distgraph.passes.search.layouts.intra_op.search`), so that a
    choice costs what the estimate prices its plan at (GPT-3's block on 8 x 8 A100s:
    0.3 ms a micro-batch of the backward's gathers and all-to-alls)."""
    program, nodes = space.program, space.nodes
    mats: dict = {}
    for u, v, m in problem.edges:
        mats.setdefault((u, v), []).append(m)
    position = {k: t for t, k in enumerate(space.ops)}
    made: dict = {}         # (Value, layout wanted) -> the role of the op it was made for
    waived = 0.0
    for node in sorted((n for n in nodes if not n.is_source), key=lambda n: position[n.op]):
        op, v = program.ops[node.op], node.index
        mine = node.strategies[choice[v]]
        for i, u, j, value in distinct_operands(space, op):
            src, dst = nodes[u].strategies[choice[u]].out_specs[j], mine.in_specs[i]
            if src == dst or (mine.zero and i == 1):
                # (an update on ZeRO's slice reads its gradient in the slice's layout,
                # which its edge prices and no other op reads)
                continue
            key = (value.name, dst)
            if key in made and reuses(made[key], op.role, DistAttr(space.mesh, src),
                                      DistAttr(space.mesh, dst), value.shape):
                paid = mats.get((u, v), ())
                if len(paid) == 1:      # one Value from u to v: its edge alone
                    waived += float(paid[0][choice[v]] if paid[0].ndim == 1
                                    else paid[0][choice[u], choice[v]])
                continue
            made[key] = op.role
    return waived


class Charges:
    """The terms of ``space``'s nodes on ``costs`` (module docstring); ``targets``
    ({leaving Value: spec}) and ``tied`` ({leaving Value: received Value}): the
    boundary's settle and periodic pairs."""

    def __init__(self, space, costs, weights: dict, targets: dict, tied: dict):
        self.space, self.costs, self.weights = space, costs, weights
        self.targets, self.tied = targets, tied
        self.feeds = {v.name for v in space.program.inputs}
        self.buffers = gradient_buffers(space, weights)
        self.once = once_nodes(space, weights)
        self.keeping_nothing = space.keeping_nothing

    def source(self, node, strategies) -> tuple:
        """(compute seconds, bytes) of each strategy of source ``node``: a feed's layout
        costs the copy of its local part, once per forward run (inf where not
        ``node.allowed``)."""
        v = self.space.program.values[node.value]
        w = self.weights.get(Role.FORWARD, 1)
        feed = self.costs.feed if v.name in self.feeds else None
        allowed = node.allowed if len(node.allowed) == len(strategies) else \
            (True,) * len(strategies)
        return ([(feed(s.out_local_shapes[0], v.dtype) * w if feed else 0.0 * w)
                 + (0.0 if ok else math.inf) for s, ok in zip(strategies, allowed)],
                [float(local_bytes(s.out_local_shapes, [v.dtype])) for s in strategies])

    def op(self, node, strategies, hints, allowed, memory: bool = True) -> tuple:
        """(compute, comm seconds, bytes) of each strategy of op ``node`` (``hints`` and
        ``allowed`` beside them): its compute and own collectives times its role's runs
        (inf where not allowed), a result leaving the part brought to its target, its
        tied layout or settled, its results and what its kernel keeps (None without
        ``memory``)."""
        costs, space = self.costs, self.space
        op = space.program.ops[node.op]
        w = self.weights.get(Role.OPTIMIZE if node.index in self.once else op.role, 1)
        c, m = costs.op(op, strategies)
        compute = [x * w + (0.0 if ok else math.inf) for x, ok in zip(c, allowed)]
        comm = list(m)
        for j, o in enumerate(op.outputs):
            if o.name in self.targets:      # brought to its neighbour's layout
                to = self.targets[o.name]
                extra = [costs.reshard(s.out_specs[j], to, o.shape, o.dtype) for s in strategies]
            elif o.name in self.tied:       # brought to the layout it is tied to
                extra = [costs.reshard(s.out_specs[j], hint[j], o.shape, o.dtype)
                         for s, hint in zip(strategies, hints)]
            elif o.name in space.leaving:   # a pending sum is settled before it leaves
                extra = [costs.settle(s.out_specs[j], o) for s in strategies]
            else:
                continue
            comm = [a + b for a, b in zip(comm, extra)]
        comm = [x * w for x in comm]
        if not memory:
            return compute, comm, None
        kept = [j for j, o in enumerate(op.outputs) if not o.alias_of]
        kept_types = [op.outputs[j].dtype for j in kept]
        own = [float(local_bytes([s.out_local_shapes[j] for j in kept], kept_types))
               for s in strategies]
        if self.buffers.get(node.index) == node.index:  # its gradient's buffer, in its layout
            own = [x + local_bytes([s.in_local_shapes[1]], [op.inputs[1].dtype])
                   for x, s in zip(own, strategies)]
        if node.op in self.keeping_nothing:
            memory = [x + 0.0 for x in own]
        else:
            memory = [x + k for x, k in zip(own, costs.kept(op, strategies))]
        return compute, comm, memory

    def operands(self, node):
        """(input index, producer node, its output index, Value, runs) of each distinct
        operand of op ``node`` (an op reading one Value twice pays its reshard once)."""
        space = self.space
        op = space.program.ops[node.op]
        # a Value made once reshards its operands once a step, with it
        w = self.weights.get(Role.OPTIMIZE if node.index in self.once else op.role, 1)
        for i, u, j, v in distinct_operands(space, op):
            yield i, u, j, v, w


def distinct_operands(space, op):
    """(input index, producer node, its output index, Value) of each distinct operand of
    ``op`` in ``space``: a Value read twice is read in one layout, resharded once."""
    seen = set()
    for i, v in enumerate(op.inputs):
        if v.name not in seen:
            seen.add(v.name)
            u, j = space.producer[v.name]
            yield i, u, j, v


def build_problem(space, costs, weights, loss, world, budget, share, live, targets: dict,
                  tied: dict, zero=None, copies: bool = False) -> ShardingProblem:
    """The ILP of every strategy of ``space``'s nodes (``intra_op.search``); ``copies``
    (with ``live``): each reshard's copy beside its reader (``ShardingProblem.copies``)."""
    charges = Charges(space, costs, weights, targets, tied)
    nodes = space.nodes
    compute, comm, memory, spare = _terms(charges, loss, world)
    classes = _tie_classes(nodes, share)
    edges, aliases, made_copies = [], [], []
    liveness, released, ends = _liveness(space, charges) if live else ((), (), {})
    copies = copies and live
    frees = _last_reads(space, liveness, ends) if copies else None
    for leaving, received in tied.items():
        u, j = space.producer[leaving]
        r = space.source_node[received]
        layouts = [x.out_specs[0] for x in nodes[r].strategies]
        forbid = [[hint[j] != lay for lay in layouts] for hint in nodes[u].hints]
        aliases.append((u, r, np.array(forbid, dtype=float)))
    for node in nodes:
        if node.is_source:
            continue
        for i, u, j, v, w in charges.operands(node):
            made = tuple(s.out_specs[j] for s in nodes[u].strategies)
            wanted = tuple(s.in_specs[i] for s in node.strategies)
            tied_pair = classes[u] == classes[node.index]   # only the diagonal is taken
            if tied_pair:
                mat = np.array([costs.reshard(a, b, v.shape, v.dtype)
                                for a, b in zip(made, wanted)])
            else:
                mat = costs.matrix(made, wanted, v.shape, v.dtype)
            if mat.any():
                edges.append((u, node.index, mat * w))
            if copies:
                held = copy_bytes(made, wanted, [local_bytes([s.in_local_shapes[i]], [v.dtype])
                                                 for s in node.strategies], tied_pair)
                if held.any():
                    freed = np.zeros_like(held)
                    if frees(u, j, node.index):
                        own = np.array([local_bytes([s.out_local_shapes[j]], [v.dtype])
                                        for s in nodes[u].strategies], dtype=float)
                        freed = np.where(held > 0, own if tied_pair else own[:, None], 0.0)
                    made_copies.append((u, node.index, held, freed))
        for s_node, j in _aliased(space, node):
            layouts = [s.out_specs[0] for s in nodes[s_node].strategies]
            forbid = [[s.out_specs[j] != lay for lay in layouts] for s in node.strategies]
            aliases.append((node.index, s_node, np.array(forbid, dtype=float)))
    same = lambda a, b: classes[a] == classes[b]     # noqa: E731
    others = [_seconds_at(space, other, weights, loss, world, targets, tied, zero, edges, same)
              for other in costs.others]
    apply_zero(zero_terms(space, costs, zero), space, costs, weights, compute, comm, memory,
               edges, same)
    return ShardingProblem([len(n.strategies) for n in nodes], compute, comm, memory, edges,
                           aliases, [n.leader for n in nodes], liveness, budget, share,
                           [n.label for n in nodes], spare if liveness else None,
                           running(space) if liveness else (), others, released,
                           made_copies)


def _last_reads(space, liveness, ends: dict):
    """``frees(u, j, v)``: whether result ``j`` of node ``u`` is freed once op node ``v``
    has read it, by ``liveness``: ``u`` live while ``v`` runs and not after, or that
    result alone freed after ``v`` (``ends``: (node, result) -> the liveness time from
    which it is freed while the node's other results live, :func:`_liveness`)."""
    at = {v: t for t, v in enumerate(running(space))}
    sets: dict = {}

    def live(t) -> set:
        if t not in sets:
            sets[t] = set(liveness[t]) if t < len(liveness) else set()
        return sets[t]

    def frees(u, j, v) -> bool:
        if v not in at or u not in live(at[v]):
            return False
        return u not in live(at[v] + 1) or ends.get((u, j)) == at[v] + 1
    return frees


def copy_bytes(made, wanted, sizes, diagonal: bool = False) -> np.ndarray:
    """The bytes of the copy an operand is resharded into (the partitioner's new array):
    ``sizes[b]`` where the reader's layout ``wanted[b]`` is not ``made[a]``, the
    producer's, else 0; per pair (a, b), or per index where the two are tied."""
    ids: dict = {}
    rows = np.array([ids.setdefault(spec, len(ids)) for spec in made])
    cols = np.array([ids.setdefault(spec, len(ids)) for spec in wanted])
    sizes = np.asarray(sizes, dtype=float)
    if diagonal:
        return np.where(rows != cols, sizes, 0.0)
    return np.where(rows[:, None] != cols[None, :], sizes[None, :], 0.0)


def _terms(charges, loss, world, memory: bool = True) -> tuple:
    """(compute, comm, memory, workspace): per node of ``charges``'s space, each
    strategy's seconds and bytes at its priced process (:func:`build_problem`), the
    loss's gather onto ``world`` included (the bytes only with ``memory``: else the
    sources' alone, and no workspace)."""
    space, costs = charges.space, charges.costs
    program, nodes = space.program, space.nodes
    compute, comm, held, spare = [], [], [], []
    for node in nodes:
        if node.is_source:
            c, mem = charges.source(node, node.strategies)
            compute.append(np.array(c))
            comm.append(np.zeros(len(c)))
            spare.append(np.zeros(len(c)))
        else:
            c, m, mem = charges.op(node, node.strategies, node.hints, node.allowed, memory)
            compute.append(np.array(c))
            comm.append(np.array(m))
            if memory:
                spare.append(costs.workspace(program.ops[node.op], node.strategies))
            else:
                mem = np.zeros(len(c))
        held.append(np.array(mem, float))
    if loss is not None and loss in space.producer:
        u, j = space.producer[loss]
        v = program.values[loss]
        world = world or costs.world
        comm[u] = comm[u] + np.array([costs.gather(s.out_specs[j], v, world)
                                      for s in nodes[u].strategies])
    return compute, comm, held, spare


def _seconds_at(space, costs, weights, loss, world, targets: dict, tied: dict, zero,
                edges: list, same=None) -> list:
    """Per node of ``space``, each strategy's compute and collectives at the process
    ``costs`` prices (another kind of process of the mesh, ``LayoutPrices.others``), as
    :func:`build_problem` charges them at its own (``edges``: its edges, which ZeRO's
    terms may reprice: a copy is given them; ``same``: whether two nodes are tied, as
    :func:`~distgraph.passes.search.layouts.sharded_states.apply_zero` reads it)."""
    compute, comm, memory, _ = _terms(Charges(space, costs, weights, targets, tied), loss,
                                      world, memory=False)
    apply_zero(zero_terms(space, costs, zero), space, costs, weights, compute, comm, memory,
               list(edges), same)
    return [c + m for c, m in zip(compute, comm)]


def fixed_problem(moved, costs, weights, loss, world, targets: dict, tied: dict,
                  zero=None) -> ShardingProblem:
    """The problem of ``moved``, a space whose nodes offer one strategy each (a choice
    moved to another mesh), built as :func:`build_problem` builds it but pricing only
    the chosen pairs: every term a scalar (the one strategy's), each edge's reshard
    ``LayoutPrices.reshard`` of the chosen layouts (what its 1 x 1 matrix holds), tie
    classes unneeded (one strategy each: every tie holds). Its ``evaluate`` at the
    choice (all zeros) equals that of the full problem, ``peak_memory`` too."""
    charges = Charges(moved, costs, weights, targets, tied)
    program, nodes = moved.program, moved.nodes
    compute, comm, memory, spare = [], [], [], []
    for node in nodes:
        if node.is_source:
            (c,), (mem,) = charges.source(node, node.strategies)
            m = w = 0.0
        else:
            (c,), (m,), (mem,) = charges.op(node, node.strategies, node.hints, node.allowed)
            (w,) = costs.workspace(program.ops[node.op], node.strategies)
        compute.append(c)
        comm.append(m)
        memory.append(mem)
        spare.append(w)
    if loss is not None and loss in moved.producer:
        u, j = moved.producer[loss]
        comm[u] = comm[u] + costs.gather(nodes[u].strategies[0].out_specs[j],
                                         program.values[loss], world or costs.world)
    edges, aliases = [], []
    for leaving, received in tied.items():
        u, j = moved.producer[leaving]
        r = moved.source_node[received]
        aliases.append((u, r, nodes[u].hints[0][j] != nodes[r].strategies[0].out_specs[0]))
    for node in nodes:
        if node.is_source:
            continue
        s = node.strategies[0]
        for i, u, j, v, w in charges.operands(node):
            price = costs.reshard(nodes[u].strategies[0].out_specs[j], s.in_specs[i], v.shape,
                                  v.dtype)
            if price:
                edges.append((u, node.index, price * w))
        for s_node, j in _aliased(moved, node):
            aliases.append((node.index, s_node,
                            s.out_specs[j] != nodes[s_node].strategies[0].out_specs[0]))
    others = [[float(x[0]) for x in _seconds_at(
        moved, other, weights, loss, world, targets, tied, zero,
        [(u, v, np.array([[x]])) for u, v, x in edges])] for other in costs.others]
    terms = zero_terms(moved, costs, zero)
    if terms is not None:               # as build_problem adds them, on 1-entry arrays
        compute, comm, memory = ([np.array([x]) for x in xs] for xs in (compute, comm, memory))
        edges = [(u, v, np.array([[x]])) for u, v, x in edges]
        apply_zero(terms, moved, costs, weights, compute, comm, memory, edges)
        compute, comm, memory = ([float(x[0]) for x in xs] for xs in (compute, comm, memory))
        edges = [(u, v, float(x[0, 0])) for u, v, x in edges if x.any()]
    liveness, released, _ = _liveness(moved, charges)
    return ShardingProblem.one_each(compute, comm, memory, edges, aliases, liveness,
                                    [n.label for n in nodes], spare, running(moved), others,
                                    released)


def running(space) -> list:
    """The node whose op runs at each liveness time of ``space`` (its ops in program
    order, :func:`~distgraph.passes.search.layouts.liveness.live_sets`)."""
    node_of = {n.op: n.index for n in space.nodes if not n.is_source}
    return [node_of.get(k, -1) for k in space.ops]


def _aliased(space, node):
    """(source node, output index) of each write-back of op ``node`` (``alias_of``) not
    tied to its source by index: an alias constraint."""
    op = space.program.ops[node.op]
    for j, o in enumerate(op.outputs):
        if o.alias_of and o.alias_of in space.source_node:
            s_node = space.source_node[o.alias_of]
            if space.nodes[s_node].leader != node.index:
                yield s_node, j


def _liveness(space, charges: Charges) -> tuple:
    """(the liveness sets of ``space``, checked; what they release: (node, first, last,
    bytes of the freed result per strategy); (node, result) -> that first time), found
    again for each problem (cheaper than the pricing that asks for them), the nodes of
    ``charges``' gradient buffers and values made once live always."""
    buffers = charges.buffers
    always = sorted(set(buffers) | set(buffers.values()) | charges.once)
    sets, freed = live_sets(space, always)
    program, nodes = space.program, space.nodes
    released = []
    for v, j, first, last in freed:
        o = program.ops[nodes[v].op].outputs[j]
        released.append((v, first, last, [float(local_bytes([s.out_local_shapes[j]],
                                                             [o.dtype]))
                                          for s in nodes[v].strategies]))
    return checked_liveness(sets, len(nodes)), released, \
        {(v, j): first for v, j, first, _ in freed}


def _tie_classes(nodes, share) -> list:
    parent = list(range(len(nodes)))

    def root(v):
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    ties = [(n.index, n.leader) for n in nodes if n.leader >= 0]
    ties += [(g[0], v) for g in share for v in g[1:]]
    for a, b in ties:
        ra, rb = root(a), root(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    return [root(v) for v in range(len(nodes))]
