"""The gradient buckets of a search's choice, priced as the runtime runs them
(``Strategy(overlap=True)``; issue #64): the seconds of its reductions that the backward
hides.

The search's problem prices every reshard into an update alone, as if the runtime waited
for each after the backward. With overlap on, the runtime reduces the gradients in
buckets of ``bucket_mb`` while the backward goes on (:mod:`distgraph.plan.buckets`), and
the estimate prices what stays exposed (:func:`~distgraph.passes.cost.overlap.
bucket_seconds`). Here the same buckets are found on the search's nodes (the reductions
into the update of gradients the backward makes: one all-reduce or reduce-scatter each,
in the order the backward makes them, cut at ``bucket_mb``) and priced by the same
accountant (:func:`~distgraph.passes.cost.exposed.exposed_seconds`, the rule of
:func:`~distgraph.passes.cost.exposed.exposed`): each reduction's copies on the processor
and its wire seconds (:func:`~distgraph.passes.cost.overlap.wire_seconds`) at each kind
of process, the backward's ops at their seconds there, and the ops after the backward
waiting for the buckets they read.

A stage search's part (E, a block, H) keeps its choice's :func:`timeline`: a stage's
process runs its parts' backward one after another and cuts its buckets over all of
them, so the accountant prices a stage's buckets from its parts' timelines
(:func:`~distgraph.passes.cost.stage.stage_cost`), and a part's search chooses by what
its own buckets hide.

Example::

    hidden, reduced = hidden_seconds(result.space, result.problem, result.choice, costs,
                                     weights, 25)
    line = timeline(result, weights, bucketed(prepared, strategy), zero)
"""

from __future__ import annotations

import bisect
import dataclasses

from distgraph.ir import Role
from distgraph.plan.buckets import REDUCTIONS
from distgraph.passes.cost.overlap import waits_seconds, wire_seconds
from distgraph.passes.cost.prices import mesh_step_time
from distgraph.passes.cost.exposed import Timeline, exposed_seconds
from distgraph.passes.search.layouts.charges import distinct_operands, reused_reshards
from distgraph.passes.transforms.zero import zero_split
from distgraph.passes.search.layouts.ilp import lower_bound
from distgraph.passes.search.layouts.ilp_problem import _kind_sums, _paid, evaluate, peak_memory


# how a search whose gradient reductions the backward hides chose (:func:`overlapped`)
RESOLVED = ("then searched again with the gradient reductions priced at the share the "
            "backward leaves exposed")


def overlapped(space, problem, costs, weights: dict, bucket_mb: float, sol, again,
               zero=None) -> tuple:
    """(the solution, seconds of its objective the backward hides, whether another solve
    chose it) of a search whose gradient reductions the runtime buckets during the
    backward (:func:`hidden_seconds`): ``sol``, or a choice that pays less with what it
    hides counted. The problem prices each reduction into an update whole, which the
    backward may hide; so the search solves it again (``again(problem, start)``: SCIP
    warm started from the choice so far under ``Strategy(search="ilp")``, else the
    recursive search, which is fast; at most twice) with those edges at
    the share of them the choice so far leaves exposed, and keeps a choice that pays
    less: not where the LP bound of the problem with those edges free (the reshards the
    partitioner reuses aside) shows no choice could pay less. ``zero``: the search's
    ZeRO."""
    def paid(choice, hidden):   # what the report's step_time says of it
        return evaluate(problem, choice) - reused_reshards(space, problem, choice) - hidden

    hidden, reduced = hidden_seconds(space, problem, sol.choice, costs, weights, bucket_mb,
                                     zero)
    edges = into_updates(space, problem)
    if edges and lower_bound(problem.with_edges_scaled(edges, 0.0)) >= paid(sol.choice, hidden):
        edges = []      # with every reduction into the update free none could pay less
    resolved = False
    for _ in range(2 if edges else 0):
        exposed = 1.0 - hidden / reduced if reduced > 0 else 0.0
        other = again(problem.with_edges_scaled(edges, min(max(exposed, 0.0), 1.0)),
                      sol.choice)
        if tuple(other.choice) == tuple(sol.choice):
            break
        found, reduced_there = hidden_seconds(space, problem, other.choice, costs, weights,
                                              bucket_mb, zero)
        if paid(other.choice, found) >= paid(sol.choice, hidden):
            break
        sol = dataclasses.replace(other, objective=evaluate(problem, other.choice),
                                  solve_time=sol.solve_time + other.solve_time,
                                  peak_memory=peak_memory(problem, other.choice))
        hidden, reduced, resolved = found, reduced_there, True
    return sol, hidden, resolved


def hidden_seconds(space, problem, choice, costs, weights: dict, bucket_mb: float,
                   zero=None) -> tuple:
    """(seconds of ``problem``'s objective under ``choice`` that the backward hides,
    seconds of the reductions' edges): the objective less the step that pays, at its
    slowest kind of process, what its buckets leave exposed in place of the reductions'
    edges (module docstring); (0, 0) where no gradient is reduced into the update.
    ``costs``: the LayoutPrices the problem was built with (its ``others``: the other
    kinds of process, in the problem's order); ``weights``: the runs of each role a
    step, ``zero`` the ZeRO, as the search's."""
    found = _reductions(space, problem, choice, costs, zero)
    if not found:
        return 0.0, 0.0
    c = [int(i) for i in choice]
    edges = sum(_paid(mat, c[u], c[v]) for u, v, mat in problem.edges)
    bucketed = sum(edge for _, _, _, _, edge in found)
    sums = _kind_sums(problem, c, range(problem.n))
    paid = []
    for k, (prices, total) in enumerate(zip([costs, *costs.others], sums)):
        seconds = exposed_seconds([_timeline(space, problem, c, prices, weights, found, k)],
                                  bucket_mb, prices.device.hides)
        paid.append(total + edges - bucketed + seconds * weights.get(Role.OPTIMIZE, 1))
    return max(sums) + edges - max(paid), bucketed


def timeline(result, weights: dict, bucket_mb: float | None, zero=None) -> Timeline | None:
    """The :class:`Timeline` of a search's choice at its priced process (a stage's part,
    whose parts' timelines :func:`~distgraph.passes.cost.stage.stage_cost` joins into
    its process's buckets), with buckets of ``bucket_mb`` (:func:`bucketed`); None
    where the plan reduces no gradient during the backward (``bucket_mb`` None)."""
    if bucket_mb is None:
        return None
    space, problem, costs = result.space, result.problem, result.prices
    found = _reductions(space, problem, result.choice, costs, zero)
    c = [int(i) for i in result.choice]
    once = weights.get(Role.OPTIMIZE, 1)
    return dataclasses.replace(
        _timeline(space, problem, c, costs, weights, found, 0),
        reduced=sum(f[4] for f in found) / once if once else 0.0, share=once,
        bucket_mb=bucket_mb, hides=costs.device.hides)


def bucketed(prepared, strategy) -> float | None:
    """The buckets' size (MB) where the plan reduces its gradients in buckets during the
    backward (:func:`~distgraph.plan.buckets.overlapping`), priced so by the search;
    None where it does not, or where the estimate prices more than the buckets: an
    uneven batch split (``balance``) and ZeRO-3's prefetched gathers, which share the
    buckets' wires."""
    if not strategy.overlap or strategy.balance or \
            getattr(prepared, "sharding_level", 0) == 3:
        return None
    return strategy.bucket_mb


def _timeline(space, problem, c: list, prices, weights: dict, found: list,
              k: int) -> Timeline:
    """The :class:`Timeline` of choice ``c`` at kind of process ``k`` (``prices``
    its), ``found`` its :func:`_reductions`; ``reduced`` left 0."""
    ops = space.program.ops
    nodes = sorted((n for n in space.nodes if not n.is_source), key=lambda n: n.op)
    backward = [n.index for n in nodes if ops[n.op].role is Role.BACKWARD]
    last = max((space.nodes[v].op for v in backward), default=-1)

    def run(v):         # one run of node v's op at this kind of process
        seconds = problem.compute[v][c[v]] if k == 0 else \
            problem.other_processes[k - 1][v][c[v]] - problem.comm[v][c[v]]
        return float(seconds) / weights.get(ops[space.nodes[v].op].role, 1)
    made = [space.nodes[v].op for v in backward]
    ready = [bisect.bisect_right(made, f[0]) for f in found]
    cuts = sorted(set(ready))
    segments = [sum(run(v) for v in backward[a:b])
                for a, b in zip([0, *cuts], [*cuts, len(backward)])]
    reads: dict = {}
    for r, f in enumerate(found):
        reads.setdefault(f[1], set()).add(r)
    after = []
    for n in nodes:
        if n.op > last:
            if after and not reads.get(n.index):
                after[-1] = (after[-1][0] + run(n.index), after[-1][1])
            else:
                after.append((run(n.index), frozenset(reads.get(n.index, ()))))
    return Timeline(tuple(segments),
                    tuple((cuts.index(t) + 1, f[3], _terms(f, prices))
                          for t, f in zip(ready, found)),
                    tuple(after), 0.0)


def into_updates(space, problem) -> list:
    """The indices of ``problem``'s edges that carry a gradient the backward makes into
    an update: the reshards a choice may bucket (:func:`hidden_seconds`)."""
    ops = space.program.ops

    def role(u):
        node = space.nodes[u]
        return None if node.is_source else ops[node.op].role
    return [k for k, (u, v, _) in enumerate(problem.edges)
            if role(v) is Role.OPTIMIZE and role(u) is Role.BACKWARD]


def _reductions(space, problem, choice, costs, zero) -> list:
    """[(op making the gradient, update node, step, bytes, edge seconds)] of every
    gradient the backward makes that ``choice`` reduces into an update in one
    all-reduce or reduce-scatter (:func:`~distgraph.plan.buckets.reduction`), in the
    order the backward makes them; ``zero``: the search's ZeRO (an update on its slice
    reads its gradient there, :mod:`~distgraph.passes.search.layouts.sharded_states`)."""
    program, nodes = space.program, space.nodes
    mats: dict = {}
    for u, v, mat in problem.edges:
        mats.setdefault((u, v), []).append(mat)
    found = []
    for node in nodes:
        if node.is_source or program.ops[node.op].role is not Role.OPTIMIZE:
            continue
        v = node.index
        for i, u, j, value in distinct_operands(space, program.ops[node.op]):
            if nodes[u].is_source or program.ops[nodes[u].op].role is not Role.BACKWARD:
                continue
            src = nodes[u].strategies[choice[u]].out_specs[j]
            mine = node.strategies[choice[v]]
            dst = mine.in_specs[i]
            if mine.zero and i == 1 and zero is not None:    # read in ZeRO's slice
                op = program.ops[node.op]
                z = zero_split(mine.in_specs[0], op.inputs[0].shape, space.mesh, zero.dim)
                if z is None or z.pads:     # padded first: the pad makes what is reduced
                    continue
                dst = z.spec
            steps = costs.steps(src, dst, value.shape, value.dtype)
            if len(steps) != 1 or steps[0][0] not in REDUCTIONS:
                continue
            edge = sum(_paid(mat, choice[u], choice[v]) for mat in mats.get((u, v), ()))
            found.append((nodes[u].op, v, steps[0], steps[0][3], edge))
    found.sort(key=lambda f: f[0])
    return found


def _terms(reduction, prices) -> tuple:
    """(seconds, wire, waits, group) of a reduction of :func:`_reductions` at the process
    ``prices`` prices, as :func:`~distgraph.passes.cost.exposed.bucket_terms` takes them
    (its group: its mesh dim, one group per process on one mesh)."""
    kind, dim, n, nbytes = reduction[2]
    ring = prices.ring_of(dim)
    return (mesh_step_time(kind, n, nbytes, ring, prices.device),
            wire_seconds(kind, n, nbytes, ring, prices.device) if n > 1 else 0.0,
            waits_seconds(kind, n, prices.device), dim)
