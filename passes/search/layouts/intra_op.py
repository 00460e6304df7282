"""The intra-op search (Alpa, OSDI'22 §4): one strategy per op and source tensor of a
training program on one ProcessMesh, chosen by the ILP of :mod:`distgraph.passes.search.layouts.ilp`
(SCIP) on the costs of :mod:`distgraph.passes.cost.layout_prices`.

**The whole training graph is searched** — forward, loss, backward and update ops — as
Alpa does: the backward holds two thirds of the FLOPs and all of the gradient traffic
(data parallelism costs exactly the reshard from a Partial gradient to its update's
layout). Backward ops may differ from their forward op; the edges price that.

The problem (:class:`~distgraph.passes.search.layouts.ilp_problem.ShardingProblem`):

- **nodes**: :class:`~distgraph.passes.search.layouts.space.SearchSpace` (ops and source Values;
  light ops follow their deepest operand);
- **node costs**: an op strategy's compute and own collectives, times the op's
  ``weights`` (a micro-batched program's forward and backward run once per micro-batch);
  a feed's layout costs the copy of its local part; the fetched loss pays its gather,
  as the runtime does;
- **stage outputs** (a search of part of the program): a Partial result read outside
  is settled first, at its cheapest settlement's cost;
- **edges**: per operand of an op, the reshard seconds from each layout its producer may
  make to each layout the op may consume (an op reading one Value twice pays once);
- **aliases**: an update's write-back (``alias_of``) is laid out as what it replaces, no
  write-back reshard planned (tied by index where the source follows its update, else
  an alias constraint);
- **sharing**: the interior blocks of ``blocks`` (repeated layers such as the
  TransformerBlocks, checked identical op by op) take one strategy per position, with
  their boundary edges in the problem; the first and last block stay free;
- **memory** (with ``memory_budget`` bytes): every live result at each op of the
  program order (parameters and states always, split as ZeRO over ``zero`` will) within
  the budget, and what an op keeps for its gradient beyond its results (``saved``:
  moe_ffn's routes); with micro-batches each gradient's buffer, always, in the layout
  the backward makes it in (:func:`~distgraph.passes.search.layouts.charges.
  gradient_buffers`). With ``copies`` (the search without stages), each reshard's copy
  beside its reader, less its original where that was the original's last read
  (``ShardingProblem.copies``; a copy a later reader reuses only at its readers); the
  stage search leaves copies out (with them Llama 3 405B row a planned in 476-595 s of
  CPU, not 93 s). The planner checks the estimate (:mod:`distgraph.passes.fitting`),
  searching again with less. With ``in_flight`` = k the activations saved for the
  backward count k times (a stage holds them for each micro-batch in flight; the result
  is priced as one micro-batch, :func:`held_peak` gives the weighted peak).

The objective is the estimate (:func:`distgraph.passes.estimate`) of the plan the
choice makes plus, for a Value resharded to one layout for several consumers (once by
the partitioner, per consumer here), those repeated reshards (tests check this). The
estimate takes the busiest process, the search one process for all: they agree where
the mesh's links are uniform per dim.

Example::

    result = search(program, mesh, cluster, {p: p for p in mesh.process_ids})
    print(result.report)
    result.annotate(program)          # hard constraints for completion
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import numpy as np

from distgraph.annotation import OpAnnotation
from distgraph.errors import PlanError
from distgraph.ir import Role
from distgraph.mesh import ProcessMesh
from distgraph.passes.samples import sample_axes
from distgraph.units import fmt_bytes
from distgraph.passes.search.layouts.buckets import RESOLVED, overlapped
from distgraph.passes.search.layouts.charges import (build_problem, fixed_problem, held_nodes,
                                                    reused_reshards)
from distgraph.passes.cost.layout_prices import LayoutPrices, layout_prices
from distgraph.passes.search.layouts.ilp import Solution, solve
from distgraph.passes.search.layouts.ilp_problem import (ShardingProblem, evaluate, largest_peak,
                                                         peak_memory)
from distgraph.passes.search.layouts.recursive import (METHODS, Descents, bisection_levels,
                                                       solve_recursive)
from distgraph.passes.search.layouts.sharded_states import Zero, zero_params
from distgraph.passes.search.layouts.space import SearchSpace
from distgraph.passes.session import Session, describe, memo_tables
from distgraph.placement import DistAttr


# search="auto"'s note where SCIP was not run (ilp.solve's ``bounded``)
PROVEN = "kept: the ILP's LP bound proves SCIP cannot gain (SCIP not run)"


@dataclass(frozen=True)
class SearchReport:
    """What the search did: the mesh, the solver's status, objective (s), gap and solve
    time, the time spent building the problem, the problem's size, how many blocks
    shared one strategy, the seconds of the objective's reshards the plan makes once and
    reuses (``reused``; :attr:`step_time` is the objective less them), the memory budget (bytes, or None) and the peak the ILP sees,
    and the chosen layouts (``layouts``: (layer, what, strategy, role) of every
    parameter and every op that chose freely). ``str`` summarises them per layer:
    parameters and forward ops; ``to_dict`` lists them all. The report of a planning's
    search (``Plan.search``) also holds its session's tables (``memos``: (name, entries,
    hits, misses) of each, :meth:`~distgraph.passes.session.Session.stats`)."""

    mesh: ProcessMesh
    status: str
    objective: float
    gap: float
    solve_time: float
    build_time: float
    nodes: int
    free_nodes: int
    shared_blocks: int
    variables: int
    constraints: int
    memory_budget: float | None
    peak_memory: float
    layouts: tuple
    method: str = "ilp"
    recursive_objective: float | None = None
    note: str = ""
    memos: tuple = ()
    in_flight: int = 1
    reused: float = 0.0
    hidden: float = 0.0

    @property
    def step_time(self) -> float:
        """Seconds per step of the choice as its plan runs it: the objective (every op
        times the runs its role makes a step, each consumer's reshard of its operands)
        less the ``reused`` seconds of reshards the partitioner makes once for several
        consumers (:func:`~distgraph.passes.search.layouts.charges.reused_reshards`)
        and the ``hidden`` seconds of gradient reductions the backward hides
        (``Strategy(overlap=True)``: :mod:`~distgraph.passes.search.layouts.buckets`):
        what ``plan.estimate`` says of the plan made from it."""
        return self.objective - self.reused - self.hidden

    @property
    def memory_binds(self) -> bool:
        """Whether memory may have held back a faster choice: only a budget limits the
        ILP's memory (:attr:`~distgraph.passes.search.stages.pipeline.PipelineReport.
        memory_binds` says the same of a stage search)."""
        return self.memory_budget is not None

    @property
    def chosen_by(self) -> str:
        """Which search chose the layouts, in words (``Strategy.search``)."""
        if self.method == "recursive":
            return "recursive bisection" + (f" ({self.note})" if self.note else "")
        if self.method == "auto" and self.recursive_objective is not None:
            gain = 1 - self.objective / self.recursive_objective \
                if self.recursive_objective > 0 else 0.0
            if self.note == PROVEN:
                return f"recursive bisection ({self.recursive_objective * 1e3:.4f} ms), {PROVEN}"
            if self.note == RESOLVED:   # objectives of two problems: not compared
                return (f"recursive bisection ({self.recursive_objective * 1e3:.4f} ms), "
                        f"refined by the SCIP ILP, {RESOLVED}")
            return (f"recursive bisection ({self.recursive_objective * 1e3:.4f} ms), refined "
                    f"by the SCIP ILP: {gain:.2%} faster")
        return "SCIP ILP" + (f" ({self.note})" if self.note else "")

    def __str__(self) -> str:
        return self.describe(str(self.mesh))

    def describe(self, where: str) -> str:
        """``str``, naming the mesh searched as ``where`` (a pipeline stage's devices)."""
        budget = "none" if self.memory_budget is None else fmt_bytes(self.memory_budget)
        if self.in_flight > 1 and self.memory_budget is not None:
            budget += (f" (the activations saved for the backward counted {self.in_flight}"
                       " times)")
        size = f"{self.variables} variables, {self.constraints} constraints" \
            if self.variables else "no ILP"
        hides = f" and {self.hidden * 1e3:.4f} ms of gradient reductions the backward " \
            f"hides" if self.hidden else ""
        lines = [f"search on {where}: {self.status}, objective "
                 f"{self.objective * 1e3:.4f} ms ({self.step_time * 1e3:.4f} ms with the "
                 f"reshards it reuses made once{hides}), gap {self.gap:.3g}, solved in "
                 f"{self.solve_time:.2f} s (problem built in {self.build_time:.2f} s)",
                 f"  chosen by {self.chosen_by}",
                 f"  {self.nodes} nodes ({self.free_nodes} choosing freely, the rest following "
                 f"an operand), {_tied(self.shared_blocks)}, {size}; memory budget "
                 f"{budget}"]
        current, hidden = None, 0
        for layer, what, name, role in self.layouts:
            if role not in ("parameter", Role.FORWARD, Role.LOSS):
                hidden += 1
                continue
            if layer != current:
                lines.append(f"  {layer or '(model)'}:")
                current = layer
            lines.append(f"    {what}: {name}")
        if hidden:
            lines.append(f"  ({hidden} backward and update ops chose freely too; "
                         "Plan.to_json() lists them)")
        if self.memos:
            lines.append(f"  {describe(self.memos)}")
        return "\n".join(lines)

    def summary(self) -> str:
        """Two lines for ``Plan.explain()``: the status, objective (and, where the
        backward hides reductions, the step it leaves) and solve time, who chose, and the
        problem's size (``str`` lists the layouts)."""
        size = f"{self.variables} variables" if self.variables else "no ILP"
        dims = ", ".join(self.mesh.dim_names)
        step = f" ({self.step_time * 1e3:.4f} ms a step, {self.hidden * 1e3:.4f} ms of its " \
            f"gradient reductions hidden behind the backward)" if self.hidden else ""
        return (f"search on mesh {list(self.mesh.shape)} ({dims}): {self.status}, objective "
                f"{self.objective * 1e3:.4f} ms{step}, gap {self.gap:.3g}, solved in "
                f"{self.solve_time:.2f} s; {self.nodes} nodes, {size}\n  chosen by "
                f"{self.chosen_by}")

    def to_dict(self) -> dict:
        return {"mesh": {"process_ids": list(self.mesh.process_ids),
                         "shape": list(self.mesh.shape),
                         "dim_names": list(self.mesh.dim_names)},
                "status": self.status, "objective": self.objective,
                "step_time": self.step_time, "reused": self.reused, "hidden": self.hidden,
                "gap": self.gap,
                "solve_time": self.solve_time, "build_time": self.build_time,
                "nodes": self.nodes, "free_nodes": self.free_nodes,
                "shared_blocks": self.shared_blocks, "variables": self.variables,
                "constraints": self.constraints, "memory_budget": self.memory_budget,
                "in_flight": self.in_flight,
                "peak_memory": self.peak_memory, "method": self.method,
                "recursive_objective": self.recursive_objective, "note": self.note,
                "layouts": [list(x) for x in self.layouts],
                "memo_tables": memo_tables(self.memos)}


@dataclass
class SearchResult:
    """The chosen strategy index of every node of ``space``, and the report."""

    space: SearchSpace
    choice: tuple
    report: SearchReport
    problem: ShardingProblem
    boundary: object = None         # the Boundary it was searched with (None: none)
    prices: object = field(default=None, compare=False, repr=False)   # its LayoutPrices

    def strategy(self, node: int):
        return self.space.nodes[node].strategies[self.choice[node]]

    def annotate(self, program, mesh: ProcessMesh | None = None, ops: dict | None = None,
                 values: dict | None = None) -> None:
        """Write the choice onto ``program`` (the program the space was built on, or a
        clone of it) as annotations: every source Value's layout, every op's consumed
        specs (as ``shard_op`` in_specs) and produced specs. ``mesh``: a mesh of the same
        shape and dim names to place them on instead (a stage's own processes);
        ``ops`` / ``values``: where to write them instead ({op index: op index}, {name:
        name}: another of identical blocks)."""
        mesh = mesh or self.space.mesh
        if (mesh.shape, mesh.dim_names) != (self.space.mesh.shape, self.space.mesh.dim_names):
            raise PlanError(f"the choice was made on {self.space.mesh}; {mesh} has another "
                            "shape or dim names")
        for node in self.space.nodes:
            s = self.strategy(node.index)
            if not _mapped(node, ops, values):
                continue
            if node.is_source:
                if node.value not in self.space.boundary:
                    name = node.value if values is None else values[node.value]
                    program.values[name].annotation = DistAttr(mesh, s.out_specs[0])
                continue
            op = program.ops[node.op if ops is None else ops[node.op]]
            wanted = dict((v.name, spec) for v, spec in zip(op.inputs, s.in_specs))
            op.annotation = OpAnnotation(mesh, tuple(wanted.items()))
            for o, spec in zip(op.outputs, s.out_specs):
                o.annotation = DistAttr(mesh, spec)

    def zero_params(self, values: dict | None = None) -> frozenset:
        """The parameters whose updates the choice runs on ZeRO's slice (named as in
        ``values``, as in :meth:`annotate`)."""
        return zero_params(self.space, self.choice, values)

    def check(self, program, ops: dict | None = None, values: dict | None = None) -> None:
        """Raise PlanError unless the completed ``program`` has the chosen layouts
        (``ops`` / ``values`` as in :meth:`annotate`)."""
        for node in self.space.nodes:
            s = self.strategy(node.index)
            if node.value in self.space.boundary or not _mapped(node, ops, values):
                continue
            if node.is_source:
                name = node.value if values is None else values[node.value]
                got = program.values[name].dist_attr.spec
                if got != s.out_specs[0]:
                    raise PlanError(f"completion laid {name} out as {got}, the search "
                                    f"chose {s.out_specs[0]}")
                continue
            da = program.ops[node.op if ops is None else ops[node.op]].dist_attr
            if tuple(da.input_specs) != s.in_specs or tuple(da.output_specs) != s.out_specs:
                raise PlanError(f"completion gave op {node.label} {da}, the search chose "
                                f"{s.name}")


@dataclass(frozen=True)
class Boundary:
    """How a search of part of a program meets the rest (a stage of repeated blocks).
    ``received`` (see :class:`~distgraph.passes.search.layouts.space.SearchSpace`): the layouts a
    received Value offers; ``settle`` ({leaving Value: spec}): the layout a Value the
    part sends out is brought to (its reshard charged), instead of its cheapest
    settlement; ``periodic`` ((received, leaving), ...): the received Value arrives in
    the layout the leaving one is brought to, as when the same block runs again (the
    leaving Value's reshard to it is charged)."""

    received: tuple = ()
    settle: tuple = ()
    periodic: tuple = ()


def _mapped(node, ops, values) -> bool:
    """Whether ``node`` has a place in the ops / values maps (no maps: always)."""
    if node.is_source:
        return values is None or node.value in values
    return ops is None or node.op in ops


@dataclass(frozen=True)
class _Built:
    """What :func:`search` builds for its inputs (the session's "search problems"): the
    space, the shared blocks, the problem (no budget) and, once a recursive search asked,
    its :class:`~distgraph.passes.search.layouts.recursive.Descents`."""

    space: SearchSpace
    share: list
    problem: ShardingProblem
    descents: Descents | None = None


def search(program, mesh: ProcessMesh, cluster, device_of: dict, *, ops=None,
           weights: dict | None = None, loss: str | None = None, world=None,
           memory_budget: float | None = None, time_limit: float = 60.0,
           blocks=(), memory: bool = False, balance: bool = False,
           boundary: Boundary | None = None, method: str = "ilp",
           costs: LayoutPrices | None = None, refined=None, prove: bool = True,
           zero: Zero | None = None, session: Session | None = None,
           style: str | None = None, in_flight: int = 1,
           bucket_mb: float | None = None, copies: bool = False,
           limit: float | None = None) -> SearchResult:
    """Choose a strategy for every op (of ``ops``, default all) and source Value of
    ``program`` on ``mesh`` (module docstring). ``device_of``: process -> device global id
    of ``cluster``; ``weights``: op role -> times it runs per step (default 1);
    ``loss``: the fetched Value whose gather onto ``world`` (a ProcessMesh; default the
    mesh's processes) the runtime pays; ``memory_budget``: bytes per process;
    ``blocks``: layer paths of repeated blocks (interior ones share a choice);
    ``memory``: model the live memory even without a budget (the report's peak);
    ``balance``: price data-parallel groups of mixed devices at their balanced split
    (:class:`~distgraph.passes.cost.layout_prices.LayoutPrices`); ``boundary``: how a part of the
    program meets the rest (:class:`Boundary`); ``method``: who chooses (``Strategy.search``:
    "ilp" SCIP, "recursive" the double-recursive search of :mod:`distgraph.passes.search.
    recursive`, "auto" the recursive choice refined by SCIP, warm-started from it);
    ``costs``: a LayoutPrices of the same cluster, mesh and device_of (by default the
    session's, :func:`~distgraph.passes.cost.layout_prices.layout_prices`); ``refined``:
    under "auto", a SearchResult of the same ops on a mesh of the same dim names whose
    choice, where every node can take it here within the budget, SCIP refines instead
    of a new recursive search's; ``prove``: the recursive search's (no SCIP proof that
    a budget below the peak bound fits nothing: :func:`~distgraph.passes.search.layouts.
    recursive.solve_recursive`); ``zero``: how ZeRO shards the states after the search
    (its mesh dim; every update, or those the search chooses), priced here
    (:mod:`~distgraph.passes.search.layouts.sharded_states`); ``session``: the planning's (a fresh one by default, or that of
    ``costs``), which keeps the space and problem of each inputs (and the annotations
    they read) in "search problems", with the recursive search's descents: searches of
    these ops under other budgets, or by another method, build nothing again;
    ``style``: ``Strategy.target``, the framework whose layouts alone are allowed
    (:meth:`~distgraph.passes.search.layouts.space.SearchSpace._keep_to_style`);
    ``in_flight``: the micro-batches a pipeline stage keeps in flight, whose activations
    saved for the backward the budget counts that many times (the memory variants of
    :mod:`~distgraph.passes.search.stages.run_variants`); the result's problem and peak count
    them once, as for one micro-batch; ``bucket_mb``: with ``Strategy(overlap=True)``,
    its buckets' size, the gradients' reductions into the update priced as the
    backward hides them (:func:`~distgraph.passes.search.layouts.buckets.overlapped`;
    the report's ``hidden``); ``copies``: count reshard copies (module docstring);
    ``limit``: a device's bytes, the budget (or ``memory_budget`` where less) where a
    choice could peak above it (:func:`largest_peak`)."""
    start = time.perf_counter()
    session = session or (costs.session if costs is not None else Session())
    boundary = boundary or Boundary()
    live = memory or memory_budget is not None
    if costs is None:
        axes = sample_axes(program, [v.name for v in program.inputs]) if balance else None
        costs = layout_prices(cluster, mesh, device_of, axes, session)
    problems = session.table("search problems")
    key = (program, costs, _marks(program, ops), None if ops is None else tuple(ops), mesh,
           boundary, None if weights is None else tuple(weights.items()), loss, world,
           tuple(blocks), live, zero, style, copies)

    def build() -> _Built:
        once = (weights or {}).get(Role.OPTIMIZE, 1) < (weights or {}).get(Role.BACKWARD, 1)
        space = SearchSpace(program, mesh, ops, received=dict(boundary.received),
                            session=session, style=style, once=once, zero=zero)
        share = _shared_blocks(space, blocks)
        return _Built(space, share, _problem(space, costs, weights or {}, loss, world, None,
                                             share, live, boundary, zero, copies))
    built = problems.memo(key, build)
    plain = built.problem
    if in_flight > 1:           # its own problem, and recursive descents, per count
        base = built
        key = (*key, in_flight)
        built = problems.memo(key, lambda: dataclasses.replace(
            base, problem=base.problem.with_held(held_nodes(base.space, base.problem,
                                                            weights or {})[1], in_flight),
            descents=None))
    if limit is not None and (memory_budget is None or limit < memory_budget) and \
            largest_peak(built.problem) > limit:
        memory_budget = limit
    space, share, problem = built.space, built.share, built.problem.with_budget(memory_budget)
    build_time = time.perf_counter() - start
    limit = max(time_limit - build_time, 0.1 * time_limit)
    if method not in METHODS:
        raise PlanError(f"search method {method!r}; use one of {', '.join(METHODS)}")
    note, first = "", None
    carried = _carried(refined, space, problem) if method == "auto" else None
    if method == "ilp":
        sol = solve(problem, time_limit=limit)
    elif carried is not None:
        first = evaluate(problem, carried)
        sol = solve(problem, time_limit=limit, starts=[carried], bounded=True)
    else:
        dims = bisection_levels(mesh, costs.ring_of)
        if built.descents is None:         # the first recursive search of the problem
            built = problems[key] = dataclasses.replace(
                built, descents=Descents(built.problem, space, dims, session))
        sol, note = solve_recursive(problem, space, dims, time_limit=limit,
                                    descents=built.descents, prove=prove)
        if method == "auto" and sol.status == "recursive":
            first = sol.objective
            sol = solve(problem, time_limit=limit, starts=[sol.choice], bounded=True)
    if first is not None and not sol.variables:     # no model: the bound proved it
        note = PROVEN
    hidden = 0.0
    if bucket_mb is not None:

        def again(other, start):    # another problem of the space: SCIP where asked
            if method == "ilp":
                return solve(other, time_limit=limit, starts=[start], bounded=True)
            dims = bisection_levels(mesh, costs.ring_of)
            return solve_recursive(other, space, dims, time_limit=limit, prove=False,
                                   descents=Descents(other, space, dims, session))[0]
        sol, hidden, resolved = overlapped(space, problem, costs, weights or {}, bucket_mb,
                                           sol, again, zero)
        note = RESOLVED if resolved else note
    if in_flight > 1:           # priced as one micro-batch, as every search's result is
        sol = dataclasses.replace(sol, peak_memory=peak_memory(plain, sol.choice))
    return _result(space, sol.choice, plain.with_budget(memory_budget), sol, build_time,
                   memory_budget, share, boundary, method, first, note, in_flight, hidden,
                   costs)


def held_peak(result: SearchResult, weights: dict | None, in_flight: int) -> float:
    """The peak of ``result``'s choice with the activations it saves for the backward
    counted ``in_flight`` times (what a search with that ``in_flight`` bounds)."""
    if in_flight == 1:
        return result.report.peak_memory
    saved = held_nodes(result.space, result.problem, weights or {})[1]
    return peak_memory(result.problem.with_held(saved, in_flight), result.choice)


def _marks(program, ops) -> tuple:
    """The annotations a search of ``ops`` of ``program`` reads (a space built before
    one of them changed is not reused)."""
    ops = range(len(program.ops)) if ops is None else ops
    return tuple(x.annotation for k in ops for x in
                 (program.ops[k], *program.ops[k].inputs, *program.ops[k].outputs))


def _carried(start, space, problem):
    """``start``'s choice as strategy indices of ``space`` (matched per node by layouts,
    ZeRO's slice included; nodes tied to one index, by follow or share, take the first
    index at which each of them has the layouts wanted), or None where a node cannot
    take it, it is forbidden or over the budget."""
    if start is None or len(start.space.nodes) != len(space.nodes):
        return None
    parent = list(range(len(space.nodes)))

    def root(v):
        while parent[v] != v:
            v = parent[v]
        return v
    ties = [(i, j) for i, j in enumerate(problem.follow) if j != -1]
    ties += [(v, group[0]) for group in problem.share for v in group[1:]]
    for i, j in ties:
        a, b = root(i), root(j)
        if a != b:
            parent[max(a, b)] = min(a, b)
    offered: dict = {}          # tie class -> the indices at which each member matches
    for node, old in zip(space.nodes, start.space.nodes):
        s, hint = old.strategies[start.choice[old.index]], old.hints[start.choice[old.index]]
        here = np.array([(t.in_specs, t.out_specs, t.zero, h) ==
                         (s.in_specs, s.out_specs, s.zero, hint)
                         for t, h in zip(node.strategies, node.hints)])
        r = root(node.index)
        offered[r] = here if r not in offered else offered[r] & here
        if node.label != old.label or not offered[r].any():
            return None
    choice = [int(np.argmax(offered[root(v)])) for v in range(len(space.nodes))]
    if not math.isfinite(evaluate(problem, choice)) or (
            problem.memory_budget is not None and
            peak_memory(problem, choice) > problem.memory_budget):
        return None
    return tuple(choice)


def price(moved: SearchSpace, cluster, device_of: dict, *, weights=None, loss=None,
          world=None, boundary: Boundary | None = None, status: str = "optimal",
          costs: LayoutPrices | None = None, zero: Zero | None = None,
          session: Session | None = None):
    """The cost, by the same model, of the one strategy each node of ``moved`` offers (a
    search's choice on another mesh: ``result.space.rebind(mesh, result.choice)``),
    without solving: a SearchResult with that choice. ``status``: the status of the
    search that made the choice. Priced directly (:func:`~distgraph.passes.search.
    charges.fixed_problem`: the chosen strategies' terms and the chosen pairs'
    reshards, by the code that builds the search's problem), equal to what the full
    problem of ``moved`` gives the choice. ``costs`` / ``session``: as :func:`search`'s."""
    start = time.perf_counter()
    costs = costs or layout_prices(cluster, moved.mesh, device_of,
                                   session=session or moved.session)
    boundary = boundary or Boundary()
    problem = fixed_problem(moved, costs, weights or {}, loss, world, dict(boundary.settle),
                            _tied_values(boundary), zero)
    fixed = tuple(0 for _ in moved.nodes)
    objective = evaluate(problem, fixed)
    if math.isinf(objective):
        raise PlanError(f"the choice is not allowed on {moved.mesh}")
    sol = Solution(fixed, objective, status, 0.0, 0.0, peak_memory(problem, fixed), 0, 0)
    return _result(moved, fixed, problem, sol, time.perf_counter() - start, None, (),
                   boundary, prices=costs)


def _result(space, choice, problem, sol, build_time, memory_budget, share,
            boundary, method="ilp", first=None, note="", in_flight=1,
            hidden=0.0, prices=None) -> SearchResult:
    layouts = _layouts(space, choice)
    report = SearchReport(space.mesh, sol.status, sol.objective, sol.gap, sol.solve_time,
                          build_time, len(space.nodes),
                          sum(1 for n in space.nodes if n.leader < 0),
                          len(share[0]) if share else 0, sol.variables, sol.constraints,
                          memory_budget, sol.peak_memory, layouts, method, first, note,
                          in_flight=in_flight,
                          reused=reused_reshards(space, problem, choice), hidden=hidden)
    return SearchResult(space, tuple(choice), report, problem, boundary, prices)


def _problem(space, costs, weights, loss, world, budget, share, live,
             boundary: Boundary, zero=None, copies: bool = False) -> ShardingProblem:
    """The ILP of the search (module docstring; :func:`~distgraph.passes.search.layouts.charges.
    build_problem`)."""
    return build_problem(space, costs, weights, loss, world, budget, share, live,
                         dict(boundary.settle), _tied_values(boundary), zero, copies)


def _tied_values(boundary: Boundary) -> dict:
    """{leaving Value: received Value} of ``boundary``'s periodic pairs."""
    return {leaving: received for received, leaving in boundary.periodic}


def _tied(blocks: int) -> str:
    """The report's words for ``blocks`` tied blocks (:func:`_shared_blocks`)."""
    if not blocks:
        return ("no blocks tied (identical blocks between the first and the last share "
                "one choice; there are fewer than 2 such)")
    return f"{blocks} interior blocks sharing one choice (the first and last choose their own)"


def _shared_blocks(space, blocks) -> list:
    """Classes of nodes at the same position of the interior ``blocks`` (empty unless
    they are identical op by op: same types, shapes, attributes and strategies)."""
    interior = list(blocks)[1:-1]
    if len(interior) < 2:
        return []
    members = []
    for path in interior:
        prefix = path + "."
        members.append([n for n in space.nodes if n.layer == path or n.layer.startswith(prefix)
                        or (n.is_source and n.value.startswith(prefix))])

    def signature(n, path):
        if n.is_source:
            v = space.program.values[n.value]
            what = (n.value[len(path):], v.shape, v.dtype)
        else:
            op = space.program.ops[n.op]
            what = (op.type, op.role, tuple(v.shape for v in op.inputs), repr(op.attrs))
        return what + (tuple(s.name for s in n.strategies), n.allowed, n.hints)

    first = [signature(n, interior[0]) for n in members[0]]
    for path, nodes in zip(interior[1:], members[1:]):
        if [signature(n, path) for n in nodes] != first:
            return []
    return [tuple(n.index for n in group) for group in zip(*members)]


def _layouts(space, choice) -> tuple:
    """(layer, what, strategy, role) of every parameter and every freely choosing op."""
    out = []
    for node in space.nodes:
        s = node.strategies[choice[node.index]]
        if node.is_source:
            v = space.program.values[node.value]
            if v.is_parameter:
                out.append((node.layer, node.value, str(s.out_specs[0]), "parameter"))
        elif node.leader < 0:
            out.append((node.layer, node.label, s.name, space.program.ops[node.op].role))
    order = {layer: n for n, layer in enumerate(dict.fromkeys(x[0] for x in out))}
    return tuple(sorted(out, key=lambda x: order[x[0]]))
