"""One part of a stage priced from its intra-op search's choice (Alpa's stage costs,
:mod:`~distgraph.passes.search.stages.runs`): seconds per micro-batch (and of them, the
update's once a step), and the bytes a device holds for it, persistent, saved for the
backward, and working memory, with the gradient buffers counted from the backward that
makes them (the runtime's first add).

Example::

    cost = measure(result, program, weights, strategy)
    cost.persistent, cost.saved, cost.transient, cost.making
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from distgraph.ir import Role
from distgraph.passes.pipeline.task_graph import op_kinds
from distgraph.passes.search.layouts.buckets import timeline
from distgraph.passes.search.layouts.charges import gradient_buffers, held_nodes, once_nodes
from distgraph.passes.search.layouts.ilp_problem import kind_seconds, share_of
from distgraph.passes.search.layouts.sharded_states import writeback_bytes, zero_asked
from distgraph.plan.kinds import TaskKind


@dataclass(frozen=True)
class PartCost:
    """One part of a stage (E, one block, or H) on one logical mesh: seconds per
    micro-batch, and bytes per device (module docstring). ``update``: the seconds of its
    update (and of the values a step makes once) once a step, of which ``time`` holds
    the share of one micro-batch (the search's weights). ``buffers``: the part of
    ``persistent`` that is gradient buffers, which the runtime makes in the first
    backward; ``forward`` / ``backward``: the working memory beyond ``saved`` over the
    forward's steps and over the backward's and the update's, without the buffers;
    ``making``: over the backward's and the update's with the part's own buffers made
    by then (its first backward). Left out, the three are ``transient`` (and the
    buffers, none, held from the start as persistent). ``writeback``: beyond
    ``persistent``, the most its updates hold at once: ZeRO's write-back buffer
    (Strategy(sharding=True), priced in the search: the updated slice and the
    parameter it is gathered into), held at the update, when no micro-batch keeps
    activations (a stage's price takes the larger of it and its activations' peak:
    :func:`~distgraph.passes.cost.stage.stage_cost`). ``kinds``: where the mesh's
    processes pay unlike, ``time`` at each kind of process (the priced one first;
    ``time`` is their largest), () where all pay alike. ``timeline``: its backward as
    the gradient buckets see it, where the plan reduces gradients during the backward
    (:class:`~distgraph.passes.cost.exposed.Timeline`; ``update`` and
    ``time`` price its reductions whole, a stage's price what its buckets leave
    exposed: :func:`~distgraph.passes.cost.stage.stage_cost`)."""

    time: float
    persistent: float
    saved: float
    transient: float
    buffers: float = 0.0
    forward: float | None = None
    backward: float | None = None
    making: float | None = None
    update: float = 0.0
    kinds: tuple = ()
    timeline: object = None
    writeback: float = 0.0

    def __post_init__(self):
        for name in ("forward", "backward", "making"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, self.transient)



def measure(result, program, weights, strategy, bucket_mb: float | None = None) -> PartCost:
    """Seconds and bytes of a search's choice (:mod:`~distgraph.passes.search.stages.runs`'s
    docstring): ``program`` the one searched, ``weights`` the search's weights of each
    role; ``bucket_mb``: the plan's gradient buckets
    (:func:`~distgraph.passes.search.layouts.buckets.bucketed`), None where it has none."""
    space, problem, choice = result.space, result.problem, result.choice
    memory = [float(problem.memory[n.index][choice[n.index]]) for n in space.nodes]
    # parameters, states and (with micro-batches) the gradients' buffers, which the
    # nodes making the gradients or the update nodes hold (charges.gradient_buffers),
    # and what the forward saved for the backward
    always, kept, backward = held_nodes(space, problem, weights)
    persistent = sum(memory[i] for i in always)
    saved = problem.held_at(kept, backward, choice) if kept else 0.0
    peak = result.report.peak_memory
    # Strategy(sharding=True), priced in the search (sharded_states): at an update,
    # beside what persists, the buffer its ZeRO write-back gathers into
    writeback = writeback_bytes(result, zero_asked(strategy))
    transient = max(peak - persistent - saved, 0.0)
    update = once_a_step(result, program, weights)
    # its reductions priced whole (the search's step has what the part hides alone
    # taken off): a stage prices what its buckets leave exposed (stage_cost)
    time = result.report.step_time + result.report.hidden
    kinds = tuple(t - result.report.reused for t in kind_seconds(problem, choice))
    line = timeline(result, weights, bucket_mb, zero_asked(strategy))
    if not (backward and problem.liveness):
        return PartCost(time, persistent, saved, transient, update=update,
                        kinds=kinds, timeline=line, writeback=writeback)
    buffers, forward, back, making = phases(result, weights, program, memory,
                                            persistent + saved, backward)
    # the liveness holds a buffer its gradient's node holds once: a later micro-batch's
    # gradient beside it is in ``back`` only
    return PartCost(time, persistent, saved, max(transient, back),
                    buffers, forward, back, making, update, kinds, line, writeback)


def once_a_step(result, program, weights) -> float:
    """Seconds a step spends once in the choice of ``result``: the update's ops and the
    values made once (:func:`~distgraph.passes.search.layouts.charges.once_nodes`), with
    the reshards into them, which the search's objective counts at the update's weight
    (its share of one micro-batch)."""
    w = weights.get(Role.OPTIMIZE, 1)
    space = result.space
    nodes = once_nodes(space, weights) | {
        n.index for n in space.nodes
        if not n.is_source and program.ops[n.op].role == Role.OPTIMIZE}
    return share_of(result.problem, result.choice, nodes) / w if w else 0.0


def weight_gradient_seconds(result, program, weights) -> float:
    """Seconds per micro-batch the choice of ``result`` spends in a zero-bubble
    schedule's weight gradients (W: the backward ops :func:`~distgraph.passes.pipeline.
    task_graph.op_kinds` splits off), with the reshards into them: what the accountant's
    :func:`~distgraph.passes.cost.stage.step_time` runs in a ZB pipeline's idle time."""
    kinds = op_kinds(program, split=True)
    nodes = {n.index for n in result.space.nodes
             if not n.is_source and kinds[n.op] is TaskKind.BACKWARD_WEIGHT}
    return share_of(result.problem, result.choice, nodes) / weights.get(Role.BACKWARD, 1)


def phases(result, weights, program, memory: list, held: float, backward: int) -> tuple:
    """(buffers, forward, backward, making) of :class:`PartCost` from the choice's
    liveness: a gradient buffer is made at the op that makes the gradient it
    accumulates (the runtime's first add to it), at the backward's start where another
    part makes it. Held by that op's node (:func:`~distgraph.passes.search.layouts.
    charges.gradient_buffers`), it is the first micro-batch's gradient itself, and a
    later one's gradient is live beside it at that op; held by the update's node, it
    is that gradient's array while the gradient is live. ``held``: persistent and
    saved."""
    space, problem = result.space, result.problem
    position = {k: t for t, k in enumerate(space.ops)}
    made_at: dict = {}
    of_gradient: dict = {}      # the gradient's node: its buffer's bytes (update-held)
    later = np.zeros(len(problem.liveness))     # a later micro-batch's gradient, by step
    seen = set()
    for i, h in gradient_buffers(space, weights).items():
        if h in seen:           # one op making several gradients holds their buffers
            continue
        seen.add(h)
        gradient = program.ops[space.nodes[i].op].inputs[1].name
        u = space.producer[gradient][0]
        t = backward if space.nodes[u].is_source else \
            max(position.get(space.nodes[u].op, backward), backward)
        made_at[t] = made_at.get(t, 0.0) + memory[h]
        if h == i:
            of_gradient[u] = of_gradient.get(u, 0.0) + memory[i]
        else:
            later[t] += memory[h]
    # per liveness set at once (a large block has hundreds, each of hundreds of nodes)
    sets = problem.liveness
    step = np.repeat(np.arange(len(sets)), [len(live) for live in sets])
    nodes = np.fromiter((i for live in sets for i in live), dtype=np.intp, count=len(step))
    adopted = np.zeros(len(memory))
    adopted[list(of_gradient)] = list(of_gradient.values())
    beyond = np.bincount(step, np.asarray(memory)[nodes], len(sets)) - held + \
        problem.beside(result.choice)       # the running kernel's workspace, released
    # the runtime takes a buffer's first gradient array as the buffer: one array
    # while that gradient is live
    shared = np.bincount(step, adopted[nodes], len(sets))
    made = np.zeros(len(sets))
    for t, b in made_at.items():
        made[t] += b
    made = np.cumsum(made)
    back_steps = slice(backward, None)
    forward = max(float(beyond[:backward].max(initial=0.0)), 0.0)
    back = max(float((beyond + later)[back_steps].max(initial=0.0)), 0.0)
    making = max(float((beyond + made - shared)[back_steps].max(initial=0.0)), 0.0)
    return sum(made_at.values()), forward, back, making
