"""The records of :class:`~distgraph.passes.search.stages.runs.RunCosts`: a stage option
(:class:`RunOption`: a submesh in a logical shape, its parts' costs and the searches they
came from) and what a RunCosts keeps of its searches per logical mesh, kind of mesh and
option (:class:`Searched`, :class:`MeshKind`, :class:`MeshOptions`), in its planning's
session.

Example::

    option = RunOption(axis, sub, (1, 8), parts)
    price = option.cost(True, 3, False)      # seconds, one, further, before, update
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from distgraph.mesh import ProcessMesh
from distgraph.passes.cost.stage import StagePrice, stage_cost, stage_costs
from distgraph.passes.search.stages.stage_dp import Submesh


@dataclass(frozen=True)
class RunOption:
    """A submesh in a logical shape and its parts' costs and searches (``first`` /
    ``last`` None when the program has no E / H part). ``blocks``: the most blocks a
    stage of it may hold (the run's), where its prices by block count are made once,
    with it (``tables``: (E?, H?) -> :meth:`costs`' rows, read by :meth:`cost` too, which
    they equal term by term); 0: priced on each call."""

    axis: int
    sub: Submesh
    logical: tuple
    parts: dict           # "first" / "block" / "last" -> (PartCost, SearchResult)
    # (mesh, devices, parts (part -> SearchResult)) of the search the parts were costed
    # or priced from: where RunCosts.refine refines (None: here)
    origin: tuple | None = field(default=None, compare=False, repr=False)
    blocks: int = field(default=0, compare=False, repr=False)
    tables: dict = field(init=False, compare=False, repr=False)

    def __post_init__(self):
        tables = {}
        if self.blocks:
            for first in (False, True) if "first" in self.parts else (False,):
                for last in (False, True) if "last" in self.parts else (False,):
                    table = stage_costs(self.parts, first, self.blocks, last)
                    table.flags.writeable = False
                    tables[first, last] = table
        object.__setattr__(self, "tables", tables)

    def cost(self, with_first: bool, blocks: int, with_last: bool) -> StagePrice:
        """The :class:`~distgraph.passes.cost.stage.StagePrice` of ``[E] + blocks + [H]``
        here (:func:`~distgraph.passes.cost.stage.stage_cost`: E or H may be a share
        under virtual stages)."""
        table = self._table(with_first, with_last)
        if table is not None and blocks == int(blocks) and 0 <= blocks <= self.blocks:
            return StagePrice(*(float(x) for x in table[int(blocks)]))
        return stage_cost(self.parts, with_first, blocks, with_last)

    def costs(self, with_first: bool, n: int, with_last: bool) -> np.ndarray:
        """(n + 1, 5): row m is :meth:`cost` ``(with_first, m, with_last)``, m = 0 .. n
        (read-only where made with the option)."""
        table = self._table(with_first, with_last) if n == self.blocks else None
        return table if table is not None else stage_costs(self.parts, with_first, n,
                                                           with_last)

    def _table(self, with_first, with_last):
        """The table made with the option for whole E and H (not shares), or None."""
        if float(with_first) not in (0.0, 1.0) or float(with_last) not in (0.0, 1.0):
            return None
        return self.tables.get((bool(with_first), bool(with_last)))

    def __str__(self):
        return f"{self.sub} as {list(self.logical)}"


@dataclass
class Searched:
    """A mesh searched for its fastest parts (``key``: (axis, submesh shape, logical
    shape)), and for its memory variants once they are asked for (``smaller``, and
    ``leaner``: those of them with E and H halved too; ``held``: those for the micro-
    batches in flight on meshes priced from it); parts as dicts part -> SearchResult."""

    key: tuple
    mesh: ProcessMesh
    device_of: dict
    fastest: dict
    smaller: list | None = None
    leaner: list = field(default_factory=list)
    held: dict = field(default_factory=dict)    # (k, scale) -> RunCosts._held_here's

    def variants(self) -> list:
        return self.smaller + self.leaner


@dataclass
class MeshKind:
    """The searches of one kind of logical mesh (:func:`kind_of`) others are priced from, in
    the order searched: for their fastest parts (``found``), for variants only
    (``spare``). A RunCosts' "mesh searches" entry per kind."""

    found: list = field(default_factory=list)
    spare: list = field(default_factory=list)


@dataclass
class MeshOptions:
    """A logical mesh's options: the search its fastest parts came from, the option of
    those parts (``fastest``, its :attr:`RunOption.origin` where they were costed or
    priced from) and of the memory variants once asked (``variants``). A RunCosts'
    "stage options" entry per mesh: its options are made once, with their prices by
    block count."""

    searched: Searched
    fastest: RunOption
    variants: list | None = None


def with_origin(searched: Searched, found: dict, parts: dict) -> tuple:
    """(``parts``, their origin): costed or priced from ``found`` (parts of ``searched``'s
    search, on its mesh), where :meth:`~distgraph.passes.search.stages.runs.RunCosts.refine`
    refines."""
    return parts, (searched.mesh, searched.device_of, found)


def kind_of(logical) -> tuple:
    """Logical meshes whose searches price each other: the same dims and the same t."""
    return (len(logical), logical[-1])
