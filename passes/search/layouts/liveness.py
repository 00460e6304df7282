"""Which results of a searched program are live together: the liveness sets of the
intra-op search's memory model (:mod:`distgraph.passes.search.layouts.intra_op`), one per op of
the program order, as node indices of its :class:`~distgraph.passes.search.layouts.space.
SearchSpace`.

An op's node is live from its op to the last use of any of its results (or its
gradient, where its kernel keeps something for it); a result used for less long is freed
at its own last use, as the runtime frees it (a dropout's output
read by the residual add, its mask kept for the backward): :func:`live_sets` names those
spans, in which the node holds its other results only.

Example::

    sets, freed = live_sets(space)  # sets[t]: the nodes live at op space.ops[t]
"""

from __future__ import annotations

from distgraph.ir import Role
from distgraph.registry import get_op


def live_sets(space, buffers=()) -> tuple[list, list]:
    """(the nodes whose results are live at each op, in program order; the spans in which
    a live node's result is already freed: (node, result index, first op, last op)).
    Live: persistable sources
    always, the program's feeds from the start to their last use, Values received from
    ops outside ``space.ops`` (another part's, a gradient from the next block) from
    their first use to their last (as the estimate's executor receives them: at their
    consumer), op results from their op to their last use, and an op that keeps what
    its gradient needs beyond its results (``saved``: moe_ffn) until that gradient
    (``<type>_grad``), unless it could never serve it
    (:func:`~distgraph.plan.instructions.keeps_nothing`). With ``buffers`` (the
    accumulating updates and the nodes holding their gradients' buffers,
    :func:`~distgraph.passes.search.layouts.charges.gradient_buffers`, and those making
    the Values a micro-batched step makes once, :func:`~distgraph.passes.search.layouts.
    charges.once_nodes`) those nodes are live always and, as the runtime adds each
    micro-batch's gradient to its buffer as it is made, an update's read ends no
    earlier op's result's life. A result (not written back to a source) is freed after
    its own last use (after its op where nothing reads it) where its node lives on: for
    another result, or for what its kernel keeps for its gradient."""
    program, nodes = space.program, space.nodes
    position = {k: t for t, k in enumerate(space.ops)}
    keeping_nothing = space.keeping_nothing
    node_of = {id(program.ops[n.op]): n.index for n in nodes if not n.is_source
               and get_op(program.ops[n.op].type).saved is not None and n.op not in keeping_nothing}
    first: dict = {}
    last: dict = {}
    used: dict = {}                 # (node, result index) -> its last use
    accumulated = bool(buffers)
    for k in space.ops:
        op = program.ops[k]
        updating = accumulated and op.role == Role.OPTIMIZE
        for v in op.inputs:
            u = space.producer[v.name][0]
            if updating and not nodes[u].is_source and \
                    program.ops[nodes[u].op].role != Role.OPTIMIZE:
                continue
            first.setdefault(u, position[k])
            last[u] = position[k]
            used[u, space.producer[v.name][1]] = position[k]
        f = op.forward_op
        if f is not None and op.type == f.type + "_grad" and id(f) in node_of:
            last[node_of[id(f)]] = max(last.get(node_of[id(f)], 0), position[k])
    feeds = {v.name for v in program.inputs}
    always, starts, freed = list(buffers), {}, []
    for n in nodes:
        if n.index in buffers:
            continue
        if n.is_source:
            if program.values[n.value].persistable:
                always.append(n.index)
                continue
            begin = 0 if n.value in feeds else first.get(n.index, 0)
            span = (begin, last.get(n.index, begin))
        else:
            t = position[n.op]
            span = (t, max(t, last.get(n.index, t)))
            freed += [(n.index, j, used.get((n.index, j), t) + 1, span[1])
                      for j, o in enumerate(program.ops[n.op].outputs)
                      if not o.alias_of and used.get((n.index, j), t) < span[1]]
        starts.setdefault(span[0], []).append((span[1], n.index))
    out, live = [], {}
    for t in range(len(space.ops)):
        for end, i in starts.get(t, ()):
            live[i] = end
        out.append(tuple(always) + tuple(live))
        live = {i: end for i, end in live.items() if end > t}
    return out, freed
