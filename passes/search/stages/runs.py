"""Stage costs of a model of identical blocks: a run of k blocks on a submesh costs k
times one block, searched once per logical mesh shape (Alpa's inter-op search made
tractable for transformers of a hundred layers on a thousand devices).

The layers (:func:`~distgraph.passes.search.stages.layers.block_layers`) are the part before
the blocks (``E``: the embedding), the blocks, and the part after them (``H``: the head
and the loss). A stage is ``[E] + k blocks + [H]`` on a submesh and costs

- **time**: ``t_E + k t_B + t_H`` per micro-batch. ``t_B`` is one block's intra-op search
  with its input and output tied (:class:`~distgraph.passes.search.layouts.intra_op.Boundary`
  ``periodic``): the block receives its input in the layout it sends its output in, as
  every block of a run does, so the reshards between two blocks are inside ``t_B`` and
  k blocks cost k times it. ``E`` and ``H`` are searched with the Values they exchange
  with the blocks fixed to the blocks' layouts.
- **memory** (per part, on a device): parameters and states (``persistent``; with
  micro-batches also the gradients being accumulated), the activations one micro-batch
  keeps from its forward to its backward (``saved``: what the search's liveness holds
  at the first backward op) and the working memory beyond both at the part's peak
  (``transient``). A stage holds the sums of the first two, ``saved`` again for each
  further micro-batch in flight, and its largest ``transient``. Where a stage holds
  every micro-batch (each forward runs before the first backward: FThenB, or 1F1B with
  ``M <= S - s``) its peak is in the first backward or before it, when the runtime has
  made only the gradient buffers of the backward so far: a part also keeps its buffers'
  bytes and its working memory in the forward, in the backward, and in the backward
  with its own buffers as it makes them (:class:`PartCost`; the stage's sum:
  :func:`~distgraph.passes.cost.stage.stage_cost`'s fourth term).

**Submeshes and logical meshes.** Stages take ``n`` whole machines of a device mesh of
``rows`` machines for every ``n`` dividing ``rows`` (so that equal stages can tile it),
or, on a one-machine mesh, Alpa's row pieces. A submesh of ``(n, cols)`` devices runs as
a logical mesh ``(n cols / t, t)`` for each ``t`` dividing ``cols``: dim ``y`` (size
``t``, tensor parallel) inside a machine, dim ``x`` across. Per ``t`` the parts are
searched once, on the largest such mesh whose ``x`` divides the micro-batch's rows;
every other mesh of that ``t`` prices that choice (:func:`~distgraph.passes.search.
intra_op.price`) where its layouts divide there, and is searched itself where they do
not (and then prices the meshes after it).

**Context parallelism: (dp, cp, tp) meshes.** Where the micro-batch's rows cannot fill
``x`` (Llama 3 405B at 131,072 tokens: 8 sequences a micro-batch, x = 128 on a stage of
1,024 GPUs at t = 8), the submesh is also offered as ``(dp, cp, t)`` with dp = gcd(x,
rows) and cp = x / dp (dims ``x``, ``cp``, ``y``: cp between the machines' tp and dp, as
Meta orders them), if cp divides the sequence. Its ``cp`` dim splits only the sequence
(:data:`~distgraph.passes.search.layouts.space.SEQUENCE_DIM`) and its ``x`` only the
samples: every activation of the blocks and attention itself (ring or Ulysses, by
:mod:`distgraph.passes.context`'s prices), the weights' gradients summed over it. No
other cp is offered: rows split instead divide the activations alike without
attention's collectives (and at dp 1 the (x, t) search may split the sequence over x).
They are searched per ``t`` apart from the (x, t) ones, their variants only where memory
holds the fastest options back (:mod:`~distgraph.passes.search.stages.block_plans`).

**Memory variants** (:mod:`~distgraph.passes.search.stages.run_variants`): where memory
holds a mesh's fastest options back, the fastest blocks within smaller budgets, offered
as options of their own. A mesh whose fastest parts are priced from another's search
prices that search's variants too (:meth:`RunCosts._smaller_parts`).

**Seeds.** The micro-batch counts :mod:`distgraph.passes.search.stages.micro` compares have the
same ops and Value names. The first is searched; the later ones (``donor=`` its RunCosts)
price its searches on their own programs, searching only where a layout does not divide
their micro-batch. A count priced so is searched afresh once chosen, and its priced plan
kept where the fresh search's is slower (:func:`~distgraph.passes.search.stages.
pipeline.plan_pipeline`).

**The session.** What a RunCosts works out is kept in its planning's session (its donor's
by default; :mod:`distgraph.passes.session`): "stage options" per RunCosts and logical
mesh (the fastest parts and the memory variants), "mesh searches" per RunCosts and kind
of mesh (the searches others are priced from: a RunCosts with a donor reads its donor's
there), "boundary prices" (:func:`~distgraph.passes.cost.boundary.boundary_seconds`),
the chunks of the forward in "program facts"; the searches' problems and prices in the
tables of :func:`~distgraph.passes.search.layouts.intra_op.search`.

The stage DP on them: :func:`~distgraph.passes.search.stages.block_plans.plan_blocks`.

**Blocks that differ.** The interior blocks are identical op by op; the first and the
last differ from them in where a few gradient sums fall. They are costed as interior
blocks and take the interior block's layouts op by op, matched by place (n-th forward
op, its m-th backward op, the update of a parameter by name); their unmatched ops are
left to completion.

Example::

    costs = RunCosts(prepared, strategy, cluster, layering, micro=8)
    for option in costs.options():        # per (device mesh, submesh, logical shape)
        option.cost(True, 4, False)       # E + 4 blocks: (seconds, GB, GB per micro-batch,
        #                                   GB with every forward first)
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from distgraph.errors import PlanError
from distgraph.ir import Role
from distgraph.passes.cost.boundary import boundary_seconds
from distgraph.passes.cost.layout_prices import process_kinds
from distgraph.passes.search.layouts.buckets import bucketed
from distgraph.passes.search.layouts.intra_op import (Boundary, held_peak, price,
                                                 search)
from distgraph.passes.search.stages.block_plans import undominated
from distgraph.passes.search.stages.part_cost import measure
from distgraph.passes.search.stages.run_variants import MemoryVariants
from distgraph.passes.search.stages.run_options import (MeshKind, MeshOptions, RunOption,
                                                        Searched, kind_of, with_origin)
from distgraph.passes.search.stages.layers import op_keys, ops_by_layer, same_op
from distgraph.passes.cost.stage import grid
from distgraph.passes.pipeline.chunks import forward_chunks
from distgraph.passes.search.layouts.sharded_states import zero_asked
from distgraph.registry import op_flops
from distgraph.passes.search.stages.stage_dp import Submesh, logical_mesh
from distgraph.passes.session import Session


class RunCosts(MemoryVariants):
    """The stage options of a block layering of ``prepared`` (a BuiltProgram) on ``cluster``
    with ``micro`` micro-batches (module docstring)."""

    def __init__(self, prepared, strategy, cluster, layering, micro: int, donor=None,
                 session: Session | None = None):
        self.prepared, self.program, self.strategy = prepared, prepared.program, strategy
        self.donor = donor            # RunCosts at another micro-batch count (docstring)
        # the planning's: its layouts' prices, problems and descents are shared by every
        # search and pricing there (a donor's by default)
        self.session = session or (donor.session if donor is not None else Session())
        self.cluster, self.layering, self.micro = cluster, layering, micro
        self.blocks = layering.blocks
        self.has_first = self.blocks.start > 0
        self.has_last = self.blocks.stop < layering.count
        self.rep = self.blocks.start + 1                # an interior block
        paths = prepared.block_paths
        members = ops_by_layer(layering.layer_of)
        self.keys = {layer: op_keys(self.program, layering.layer_of, layer,
                                     paths[layer - self.blocks.start], members.get(layer, []))
                     for layer in self.blocks}
        self.weights = {Role.FORWARD: 1, Role.LOSS: 1, Role.BACKWARD: 1, Role.OPTIMIZE: 1 / micro}
        self.searches = 0
        self.seconds = 0.0
        self._options = self.session.table("stage options")     # (self, mesh) -> MeshOptions
        self._kinds = self.session.table("mesh searches")       # (self, kind) -> MeshKind
        # the representative block's ops and how it meets the blocks beside it, and what
        # E and H meet of it (the first and the last block's Values by its own names):
        # read by every search, found once
        self.block_ops = self.layering.ops(range(self.rep, self.rep + 1))
        self.periodic = self._periodic(self.block_ops)
        self._to_rep = {layer: {v: k for k, v in self.value_map(layer).items()}
                        for layer in {self.blocks.start, self.blocks.stop - 1}}

    # -- the options --------------------------------------------------------------------
    def options(self, variants: bool = True, wanted=None, sequence: bool = True) -> list:
        """Every (device mesh, submesh, logical shape) with its parts costed: the fastest
        parts; with ``variants`` the memory variants (``wanted(option)``, on a mesh's
        fastest: whether to search its variants; those searched before are kept) and, with
        ``sequence`` too, the (dp, cp, tp) meshes (module docstring)."""
        out = []
        for axis, device_mesh in enumerate(self.cluster.device_meshes):
            rows, cols = grid(device_mesh.shape)
            device = self.cluster.device(device_mesh.ids[0])
            shapes = [(n, cols) for n in range(1, rows + 1) if rows % n == 0]
            if rows == 1:
                shapes = [(1, m) for m in range(1, cols) if cols % m == 0 and
                          m & (m - 1) == 0] + shapes
            for shape in shapes:
                sub = Submesh(device_mesh, shape, device)
                for t in [t for t in range(1, shape[1] + 1) if shape[1] % t == 0]:
                    logical = (shape[0] * shape[1] // t, t)
                    out.append((axis, sub, logical))
                    cp = self._sequence_split(logical[0]) if variants and sequence else 1
                    if cp > 1:
                        out.append((axis, sub, (logical[0] // cp, cp, t)))
        # search the largest mesh of each kind and t whose x divides the rows first
        rows_mb = self.batch_rows()
        order = sorted(out, key=lambda o: (kind_of(o[2]), rows_mb % o[2][0] != 0,
                                           -int(np.prod(o[2]))))
        entries = {}
        for axis, sub, logical in order:
            key = (axis, sub.shape, logical)
            entry = entries[key] = self._options.memo(
                (self, key), lambda: self._fastest_parts(key, sub, logical))
            if variants and entry.variants is None and (wanted is None or
                                                        wanted(entry.fastest)):
                entry.variants = [self._option(key, sub, found) for found in
                                  self._smaller_parts(key, sub, logical, entry)]
        options = []
        for axis, sub, logical in out:
            entry = entries[axis, sub.shape, logical]
            options += undominated([entry.fastest] + (entry.variants or [] if variants
                                                      else []))
        return options

    def _option(self, key, sub, found: tuple) -> RunOption:
        """The option of ``found`` ((parts, origin): :func:`with_origin`) on the mesh of
        ``key``, priced by block count up to the run's blocks."""
        return RunOption(key[0], sub, key[2], *found, blocks=len(self.blocks))

    def batch_rows(self) -> int:
        feeds = self.program.inputs
        return int(feeds[0].shape[0]) if feeds and feeds[0].shape else 1

    def _sequence_split(self, x: int) -> int:
        """The cp of the (dp, cp, tp) shape offered beside ``(x, t)``: x over dp =
        ``gcd(x, rows)`` (the micro-batch's), the rest splitting the sequence (module
        docstring); 1 where dp takes all of x, where that dp is 1, or where the feeds
        have no sequence the cp divides."""
        feeds = self.program.inputs
        if not feeds or len(feeds[0].shape) < 2:
            return 1
        dp = math.gcd(x, self.batch_rows())
        cp = x // dp
        return cp if dp > 1 and cp > 1 and int(feeds[0].shape[1]) % cp == 0 else 1

    def _searched(self, costs, kind) -> MeshKind:
        """The searches of ``kind`` of ``costs`` (this RunCosts or its donor)."""
        return self._kinds.memo((costs, kind), MeshKind)

    def _fastest_parts(self, key, sub, logical) -> MeshOptions:
        """The fastest parts of this mesh: priced from the latest search of its ``t``
        whose fastest choice divides here (here or in the donor), else searched."""
        mesh, device_of = logical_mesh(sub.mesh, sub.shape, logical)
        kind = kind_of(logical)
        mine = self._searched(self, kind).found
        donors = self._searched(self.donor, kind).found if self.donor is not None else []
        for searched in [*mine[::-1], *donors[::-1]]:
            try:
                return MeshOptions(searched, self._option(key, sub, with_origin(
                    searched, searched.fastest, self._price(searched.fastest, mesh, device_of))))
            except PlanError:
                continue
        searched = Searched(key, mesh, device_of, self._search(mesh, device_of))
        mine.append(searched)
        return MeshOptions(searched, self._option(key, sub, with_origin(
            searched, searched.fastest, self._costed(searched.fastest))))

    def _smaller_parts(self, key, sub, logical, entry: MeshOptions) -> list:
        """The (parts, origin) of the memory variants after the fastest on this mesh:
        those of the search its fastest parts came from, else of those searched since
        for its kind (here or in the donor), priced here where all divide; else searched
        here."""
        searched, fastest = entry.searched, entry.fastest.parts
        kind = self._searched(self, kind_of(logical))
        mine = any(searched is s for s in kind.found)
        if searched.smaller is None and mine:
            searched.smaller, searched.leaner = self._variants(
                searched.mesh, searched.device_of, searched.fastest)
        if searched.key == key and mine:
            return [with_origin(searched, found, self._costed(found))
                    for found in searched.variants()]
        mesh, device_of = logical_mesh(sub.mesh, sub.shape, logical)
        donors = self._searched(self.donor, kind_of(logical)).spare \
            if self.donor is not None else []
        for source in [searched, *kind.spare[::-1], *donors[::-1]]:
            if source.smaller is None:              # a donor's search may have none
                continue
            try:
                priced = [with_origin(source, found, self._price(found, mesh, device_of))
                          for found in source.variants()]
            except PlanError:
                continue
            if source is searched and mine:         # with k and the share of this mesh's
                priced += self._held_here(source, mesh, device_of, fastest)
            return priced
        here = {part: result for part, (_, result) in fastest.items()}
        spare = Searched(key, mesh, device_of, here, *self._variants(mesh, device_of, here))
        kind.spare.append(spare)
        return [with_origin(spare, found, self._costed(found)) for found in spare.variants()]

    # -- searches -----------------------------------------------------------------------
    def refine(self, option: RunOption, room: float = 0.0) -> RunOption:
        """``option`` searched again by ``Strategy(search="auto")``: the recursive choice
        refined by the ILP, the block within the peak it had plus ``room`` bytes (what
        its stages may still take: :mod:`~distgraph.passes.search.stages.pipeline` checks that
        they fit; an in-flight variant's peak with its saved activations counted as its
        search counted them), E and H meeting the refined block (a lean variant's within
        the peaks they had). Refined on the mesh whose search the option's parts were costed or
        priced from, whose space and problems that search built, and priced here as the
        pricing did (where the refined choice does not divide here: refined here)."""
        mesh, device_of = logical_mesh(option.sub.mesh, option.sub.shape, option.logical)
        here = {part: result for part, (_, result) in option.parts.items()}
        at, devices, found = option.origin or (mesh, device_of, here)

        def refined(at, devices, found) -> dict:
            held = found["block"].report.in_flight
            peak = held_peak(found["block"], self.weights, held)
            # E and H of a memory variant within the peaks they had (module docstring)
            ends = {part: (r.report.peak_memory * (1 + 1e-9),) for part, r in found.items()
                    if part != "block" and r.report.memory_budget is not None}
            return self._search(at, devices, (peak + room) * (1 + 1e-9), method="auto",
                                starts=found, ends=ends, in_flight=held)

        if (at, devices) != (mesh, device_of) and found["block"].space.program is self.program:
            searched = refined(at, devices, found)
            try:
                priced = self._price(searched, mesh, device_of)
            except PlanError:       # the refined choice does not divide here
                pass
            else:   # reported as refined here: from the recursive choice priced here
                return RunOption(option.axis, option.sub, option.logical, {
                    part: (cost, dataclasses.replace(result, report=dataclasses.replace(
                        result.report, method="auto", note=searched[part].report.note,
                        recursive_objective=here[part].report.objective)))
                    for part, (cost, result) in priced.items()})
        return RunOption(option.axis, option.sub, option.logical,
                         self._costed(refined(mesh, device_of, here)))

    def _search(self, mesh, device_of, budget=None, fastest=None, method=None,
                starts=None, prove=True, ends=None, in_flight=1) -> dict:
        """The parts on ``mesh``, the block within ``budget`` bytes per device, E and H
        meeting it (:meth:`_ends`: within ``ends``, from ``fastest`` where they can be);
        ``method``: the search's (default: the one that prices options,
        :func:`pricing_method`); ``starts``: part -> the SearchResult "auto" refines (``search``'s ``refined``).
        The block's searches on one mesh share their problem and recursive descents (the
        session's: only the budget differs), and E's or H's searches on one mesh meeting
        the block alike theirs (the refinement of a searched option builds no problem
        again); ``prove=False`` (the memory variants): a budget below the block's peak
        bound raises PlanError without SCIP naming the smallest peak; ``in_flight``: the
        micro-batches whose saved activations ``budget`` counts (:func:`~distgraph.passes.
        search.layouts.intra_op.search`)."""
        starts = starts or {}
        method = method or pricing_method(self.strategy)
        start = time.perf_counter()
        boundary = Boundary(received=tuple((r, None) for r, _ in self.periodic),
                            periodic=self.periodic)
        found = {"block": self._run_search(self.block_ops, mesh, device_of, boundary, budget,
                                           method, starts.get("block"), prove, in_flight)}
        self.seconds += time.perf_counter() - start
        found.update(self._ends(found["block"], mesh, device_of, method, starts, fastest,
                                ends))
        return found

    def _ends(self, block, mesh, device_of, method, starts, fastest=None, ends=None) -> dict:
        """E and H meeting ``block`` (a SearchResult of the block), each within the first
        of its ``ends`` budgets ({"first" / "last": bytes, tried in order}) a layout of
        it peaks within, else the fastest; taken from ``fastest`` (parts) where they
        meet the block alike and fit the first budget."""
        start = time.perf_counter()
        method = method or pricing_method(self.strategy)
        parts = []
        if self.has_first:
            parts.append(("first", range(0, 1), self.blocks.start))
        if self.has_last:
            parts.append(("last", range(self.layering.count - 1, self.layering.count),
                          self.blocks.stop - 1))
        found = {}
        for part, layers, layer in parts:
            ops = self.layering.ops(layers)
            meets = self._neighbour(block, ops, layer)
            budgets = (ends or {}).get(part, ())
            if fastest is not None and fastest[part].boundary == meets and all(
                    fastest[part].report.peak_memory <= b for b in budgets[:1]):
                found[part] = fastest[part]
                continue
            for within in (*budgets, None):
                try:
                    found[part] = self._run_search(ops, mesh, device_of, meets, within,
                                                   method, starts.get(part),
                                                   prove=within is None)
                    break
                except PlanError:
                    if within is None:
                        raise
        self.seconds += time.perf_counter() - start
        return found

    def _run_search(self, ops, mesh, device_of, boundary, budget, method, start=None,
                    prove=True, in_flight=1):
        self.searches += 1
        return search(self.program, mesh, self.cluster, device_of, ops=ops,
                      weights=self.weights, loss=self._loss(ops), memory_budget=budget,
                      time_limit=self.strategy.solver_time_limit, memory=True,
                      boundary=boundary, method=method, refined=start, prove=prove,
                      zero=zero_asked(self.strategy), session=self.session,
                      style=self.strategy.target, in_flight=in_flight,
                      # the fastest parts choose by what their buckets hide; a memory
                      # variant (a budget) is priced so (measure) but not searched again
                      bucket_mb=None if budget is not None else
                      bucketed(self.prepared, self.strategy))

    def placed(self, option: RunOption, device_ids) -> RunOption:
        """``option`` priced on the devices a stage of it is placed on (``device_ids``,
        row-major over its submesh) where they pay otherwise than the first devices of
        its submesh shape, which priced it for the DP (Alpa's meshes of alike devices;
        each device of a calibrated machine has figures of its own:
        :func:`~distgraph.passes.cost.layout_prices.process_kinds`); else ``option``."""
        mesh, device_of = logical_mesh(option.sub.mesh, option.sub.shape, option.logical)
        here = dict(enumerate(int(d) for d in device_ids))
        if process_kinds(self.cluster, mesh, device_of) == \
                process_kinds(self.cluster, mesh, here):
            return option
        found = {part: result for part, (_, result) in option.parts.items()}
        return RunOption(option.axis, option.sub, option.logical,
                         self._price(found, mesh, here), option.origin)

    def _price(self, found, mesh, device_of) -> dict:
        out = {}
        for part, result in found.items():
            moved = result.space.rebind(mesh, result.choice, self.program)
            priced = price(moved, self.cluster, device_of, weights=self.weights,
                           loss=self._loss(result.space.ops), boundary=result.boundary,
                           status=result.report.status, zero=zero_asked(self.strategy),
                           session=self.session)
            out[part] = (measure(priced, self.program, self.weights, self.strategy,
                                 bucketed(self.prepared, self.strategy)), priced)
        return out

    def _loss(self, ops):
        made = {o.name for k in ops for o in self.program.ops[k].outputs}
        return self.prepared.loss_name if self.prepared.loss_name in made else None

    def _periodic(self, block_ops) -> tuple:
        """(received, leaving) pairs of the representative block: what it receives
        is, in the next block (forward) or the one before (backward), what it sends."""
        inside = set(block_ops)
        producer = {o.name: k for k, op in enumerate(self.program.ops) for o in op.outputs}
        made = {o.name for k in block_ops for o in self.program.ops[k].outputs}
        received = [v.name for k in block_ops for v in self.program.ops[k].inputs
                    if v.name not in made and producer.get(v.name, k) not in inside]
        maps = [self.value_map(neighbour) for neighbour in (self.rep + 1, self.rep - 1)]
        pairs = {}
        for name in dict.fromkeys(received):
            for names in maps:
                other = names.get(name)
                if other in made:
                    pairs[name] = other
                    break
        return tuple(pairs.items())

    def _neighbour(self, block, ops, layer) -> Boundary:
        """What E (H) exchanges with block ``layer``, fixed to the representative block's
        choice: Values it sends are brought to the layout the block receives them in,
        Values it receives arrive as the block sends them."""
        to_rep = self._to_rep[layer]
        space, choice = block.space, block.choice
        part_made = {o.name for k in ops for o in self.program.ops[k].outputs}
        part_reads = {v.name for k in ops for v in self.program.ops[k].inputs}
        settle, received = [], []
        for name in sorted(part_made | part_reads):
            rep_name = to_rep.get(name)
            if rep_name is None:
                continue
            if name in part_made and rep_name in space.source_node:
                node = space.source_node[rep_name]
                settle.append((name, space.nodes[node].strategies[choice[node]].out_specs[0]))
            elif name in part_reads and name not in part_made and rep_name in space.leaving:
                u, j = space.producer[rep_name]
                received.append((name, space.nodes[u].hints[choice[u]][j]))
        return Boundary(received=tuple(received), settle=tuple(settle))

    def _costed(self, found: dict) -> dict:
        return {part: (measure(result, self.program, self.weights, self.strategy,
                                bucketed(self.prepared, self.strategy)), result)
                for part, result in found.items()}

    def p2p_seconds(self, option) -> float:
        """Seconds per micro-batch a stage of ``option`` between two others spends passing
        its blocks' Values on and back (:func:`~distgraph.passes.cost.boundary.
        boundary_seconds`, kept in the session per boundary_key)."""
        return boundary_seconds(option, self.cluster, self.session)

    def chunk_layers(self, n: int) -> list:
        """{layer: the share of its forward FLOPs} of each of the ``n`` chunks the planner
        cuts the forward into under virtual stages (:func:`~distgraph.passes.pipeline.
        chunks.forward_chunks`), found once per program (the session's program facts)."""
        return self.session.table("program facts").memo((self.program, "chunks", n),
                                                        lambda: self._chunk_layers(n))

    def _chunk_layers(self, n: int) -> list:
        cut = forward_chunks(self.program, n, f"{n} chunks")
        layer_of = self.layering.layer_of
        flops = {k: op_flops(self.program.ops[k]) or 0.0 for k in cut}
        total: dict = {}
        for k in cut:
            total[layer_of[k]] = total.get(layer_of[k], 0.0) + flops[k]
        out: list = [{} for _ in range(n)]
        for k, c in cut.items():
            layer = layer_of[k]
            if layer is not None:
                share = flops[k] / total[layer] if total[layer] else 1.0
                out[c][layer] = out[c].get(layer, 0.0) + share
        return out

    # -- the chosen stages -------------------------------------------------------------
    def annotate(self, program, layers: range, option: RunOption, mesh) -> tuple:
        """Write ``option``'s choices for ``layers`` onto ``program`` on ``mesh``; returns
        the parts' reports ((part name, count, SearchReport), ...) and the (result, ops
        map, values map) checks."""
        parts, checks = [], []
        blocks = [layer for layer in layers if layer in self.blocks]
        if self.has_first and 0 in layers:
            parts.append(("embedding", 1, option.parts["first"][1]))
            checks.append((option.parts["first"][1], None, None))
        block = option.parts["block"][1]
        if blocks:
            parts.append(("blocks" if len(blocks) > 1 else "block", len(blocks), block))
        for layer in blocks:
            ops = None if layer == self.rep else self.op_map(layer, matched_only=True)
            values = None if layer == self.rep else self.value_map(layer)
            checks.append((block, ops, values))
        if self.has_last and self.layering.count - 1 in layers:
            parts.append(("head", 1, option.parts["last"][1]))
            checks.append((option.parts["last"][1], None, None))
        for result, ops, values in checks:
            result.annotate(program, mesh, ops=ops, values=values)
        return tuple((n, c, r.report) for n, c, r in parts), checks

    # -- blocks ------------------------------------------------------------------------
    def value_map(self, layer) -> dict:
        """{Value of the representative block: the same Value of block ``layer``}."""
        names = {}
        for k, other in self.op_map(layer).items():
            a, b = self.program.ops[k], self.program.ops[other]
            for v, w in zip(a.inputs + a.outputs, b.inputs + b.outputs):
                names.setdefault(v.name, w.name)
        return names

    def op_map(self, layer, matched_only: bool = False) -> dict:
        """{op of the representative block: the op at its place in block ``layer``}
        (``matched_only``: without the unkeyed ops, unless the blocks are identical)."""
        mine, theirs = self.keys[self.rep], self.keys[layer]
        same = [k[0] for k in mine] == [k[0] for k in theirs] and len(mine) == len(theirs)
        out = {}
        for key, k in mine.items():
            if key in theirs and (not matched_only or same or key[0] != "other") and \
                    same_op(self.program.ops[k], self.program.ops[theirs[key]]):
                out[k] = theirs[key]
        return out


def pricing_method(strategy) -> str:
    """The search method that prices the options the stage DP compares: the recursive
    one under ``Strategy(search="auto")`` (the ILP refines the chosen stages only)."""
    return "recursive" if strategy.search_method == "auto" else strategy.search_method
