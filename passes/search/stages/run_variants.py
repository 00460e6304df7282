"""The memory variants of a mesh's stage options (:mod:`~distgraph.passes.search.stages.
runs`): the fastest parts within smaller budgets, searched only where memory holds the
mesh's fastest options back (:mod:`~distgraph.passes.search.stages.block_plans`).

A block's search minimises its time alone, so it may keep weights and their optimizer
states whole where splitting them costs about as much time: cheap for one block, too
much for the many blocks a stage of few devices must hold. Each mesh also offers the
fastest block whose peak memory is within half the fastest one's, then within half of
that, and so on (up to :data:`VARIANTS` in all, while the search finds a smaller one),
as options of their own: the DP takes the fastest that lets its stages fit (on GPT-3
310B, Megatron's split of every weight over t instead of whole attention weights: six
blocks a stage instead of one). Those halve the peak of one micro-batch, where the
weights weigh most; a stage keeps the activations its blocks save for the backward once
per micro-batch in flight (k, the first of the mesh's stages tiling the devices: up to
64 on Korthikanti's 1T). Where the fastest block with its saved activations counted k
times exceeds its share of that stage's memory (what a device may hold over the blocks
the stage holds), the mesh also offers the fastest block within that share so counted,
then within 7/8 and 3/4 of it (the share leaves E and the other blocks' working memory
out): on 1T, tensor-parallel weights with activations saved at 0.25 GB a block instead
of 0.43, Megatron's two blocks a stage (a 1.02 plan where the halving ladder gave 0.89).
Each variant is offered twice where E and H can shrink: with the fastest E and H meeting
its block, and with each within half the peak of the one before it where the search
finds one (else within that peak). The first (last) stage holds them beside its blocks
and the most micro-batches in flight (Korthikanti's 530B: the embedding whole, 16.9 GB a
device, where split over t it is 2.1 GB, kept three blocks off the first stage); where
there is room, the fastest E is kept (175B: 188.6 ms on the first stage with it, 192.4
ms without). A mesh whose fastest parts are priced from another's search prices that
search's variants too
(:meth:`~distgraph.passes.search.stages.runs.RunCosts._smaller_parts`), and its own
in-flight ones: searched on that mesh with this one's k, their share scaled by the
fastest block's peaks so counted there and here (:meth:`MemoryVariants._held_here`).

:class:`MemoryVariants` is mixed into :class:`~distgraph.passes.search.stages.runs.RunCosts`,
whose searches (``_search``, ``_ends``, ``_price``) and figures (``weights``, ``cluster``,
``micro``, ``strategy``, ``blocks``) it reads.
"""

from __future__ import annotations

import math

from distgraph.errors import PlanError
from distgraph.passes.cost.fit import limit_of
from distgraph.passes.cost.stage import in_flight
from distgraph.passes.search.layouts.intra_op import held_peak
from distgraph.passes.search.stages.run_options import with_origin

VARIANTS = 4        # the fastest block and up to three of smaller peaks (module docstring)


class MemoryVariants:
    """The variants' searches of :class:`~distgraph.passes.search.stages.runs.RunCosts`."""

    def _variants(self, mesh, device_of, fastest) -> tuple:
        """(the fastest parts whose block peaks within half, a quarter, an eighth ... of
        ``fastest``'s block peak, while a smaller one exists (``VARIANTS - 1`` at most),
        then the fastest whose block fits its share of a stage's memory with the
        micro-batches in flight (:meth:`_share`) where ``fastest``'s does not, and within
        7/8 and 3/4 of it (the share leaves E and the other blocks' working memory out);
        each of them whose E and H peak within half those of the one before, where
        theirs do (module docstring))."""
        variants, peak = [], fastest["block"].report.peak_memory
        for _ in range(VARIANTS - 1):
            smaller = self._within(mesh, device_of, fastest, peak / 2)
            if smaller is None or not smaller["block"].report.peak_memory < peak:
                break
            variants.append(smaller)
            peak = smaller["block"].report.peak_memory
        held, share = self._in_flight(mesh), self._share(mesh, device_of)
        if held > 1 and held_peak(fastest["block"], self.weights, held) > share:
            variants += self._held_ladder(mesh, device_of, fastest, share, held)
        leaner = []
        ends = {part: found.report.peak_memory for part, found in fastest.items()
                if part != "block"}
        for smaller in variants:
            lean = self._ends(smaller["block"], mesh, device_of, None, {}, smaller,
                              {part: (b / 2, b) for part, b in ends.items()})
            if any(lean[part] is not smaller[part] for part in lean):
                leaner.append({**smaller, **lean})
            ends = {part: found.report.peak_memory for part, found in lean.items()}
        return variants, leaner

    def _held_ladder(self, mesh, device_of, fastest, share: float, held: int) -> list:
        """The fastest parts whose block, its saved activations counted ``held`` times,
        peaks within ``share``, 7/8 and 3/4 of it, each smaller than the one before."""
        found, peak = [], held_peak(fastest["block"], self.weights, held)
        for step in range(VARIANTS - 1):
            smaller = self._within(mesh, device_of, fastest, share * (1 - step / 8), held)
            if smaller is None:
                break
            if held_peak(smaller["block"], self.weights, held) < peak:
                found.append(smaller)
                peak = held_peak(smaller["block"], self.weights, held)
        return found

    def _held_here(self, searched, mesh, device_of, fastest) -> list:
        """The in-flight variants (:meth:`_held_ladder`) of a mesh whose options are
        priced from ``searched`` (another mesh of its kind): with this mesh's micro-
        batches in flight and share, scaled to ``searched``'s mesh by the fastest block's
        peaks so counted there and here (``fastest``: the parts priced here), searched
        there once per scale and priced here (those that do not divide here left out)."""
        held, share = self._in_flight(mesh), self._share(mesh, device_of)
        top = held_peak(fastest["block"][1], self.weights, held)
        if held == 1 or top <= share:
            return []
        scale = (held, round(share / top, 6))
        if scale not in searched.held:
            there = held_peak(searched.fastest["block"], self.weights, held)
            searched.held[scale] = self._held_ladder(searched.mesh, searched.device_of,
                                                     searched.fastest, there * scale[1], held)
        out = []
        for found in searched.held[scale]:
            try:
                out.append(with_origin(searched, found, self._price(found, mesh, device_of)))
            except PlanError:
                continue
        return out

    def _within(self, mesh, device_of, fastest, budget, in_flight=1) -> dict | None:
        """The parts with the fastest block within ``budget`` (its saved activations
        counted ``in_flight`` times), None where no layout of the block peaks that low."""
        try:
            return self._search(mesh, device_of, budget, fastest, prove=False,
                                in_flight=in_flight)
        except PlanError:
            return None

    def _in_flight(self, mesh) -> int:
        """The micro-batches the first of the stages of ``mesh``'s size tiling the
        devices keeps in flight (:func:`~distgraph.passes.cost.stage.in_flight`), whose
        saved activations its blocks hold."""
        return max(1, in_flight(self.strategy.schedule, self.micro,
                                len(self.cluster.devices) // mesh.size, 0))

    def _share(self, mesh, device_of) -> float:
        """Bytes a block of the first of the stages of ``mesh``'s size tiling the devices
        may take where they split the blocks evenly: what its devices may hold over the
        blocks it holds."""
        stages = max(1, len(self.cluster.devices) // mesh.size)
        limit = min(limit_of(self.cluster, d, self.strategy.memory_budget_gb)
                    for d in set(device_of.values()))
        return limit / math.ceil(len(self.blocks) / stages)
