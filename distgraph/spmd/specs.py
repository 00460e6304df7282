"""Specs during completion: entries may still be unknown (``UNKNOWN``, printed ``?``).

A :class:`DimsSpec` is the completion-time form of a ShardSpec: one entry per tensor
dim (``UNKNOWN``, None, a mesh dim name or a tuple of names, major first) and the
partial mesh dims. ``UNKNOWN`` says "no preference" for that dim.

Example::

    >>> str(DimsSpec(("x", UNKNOWN), frozenset({"y"})))
    '[x, ?] P(y)'
"""

from __future__ import annotations

from dataclasses import dataclass

from distgraph.errors import DistGraphError
from distgraph.placement import format_entry


class SpmdRuleError(DistGraphError, ValueError):
    """A sharding rule called with what it cannot take: wrong operand count or rank, an
    unknown mesh dim, an unknown attribute, an axis out of range."""


class _Unknown:
    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "?"

    def __reduce__(self):
        return (_Unknown, ())


UNKNOWN = _Unknown()


def entry_dims(entry) -> tuple:
    """The mesh dims an entry uses: None -> (), 'x' -> ('x',), ('x','y') -> ('x','y')."""
    if entry is None or entry is UNKNOWN:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def entry_of(dims: tuple):
    """The entry that splits over ``dims``: () -> None, ('x',) -> 'x', else the tuple."""
    if not dims:
        return None
    return dims[0] if len(dims) == 1 else tuple(dims)


def entry_str(entry) -> str:
    return "?" if entry is UNKNOWN else format_entry(entry)


@dataclass(frozen=True, slots=True)
class DimsSpec:
    """A shard spec during completion: entries may be UNKNOWN. ``str``: ``[x, ?] P(y)``."""

    dims: tuple
    partial: frozenset = frozenset()

    @staticmethod
    def unknown(ndim: int) -> DimsSpec:
        return DimsSpec((UNKNOWN,) * ndim)

    @staticmethod
    def of(spec) -> DimsSpec:
        """Accept a DimsSpec, a ShardSpec, or a plain list of entries (not a string)."""
        if isinstance(spec, DimsSpec):
            return spec
        if hasattr(spec, "dims") and hasattr(spec, "partial"):
            return DimsSpec(tuple(spec.dims), frozenset(spec.partial))
        if isinstance(spec, str) or not hasattr(spec, "__iter__"):
            raise SpmdRuleError(f"spec {spec!r}: give a list with one entry per tensor dim, "
                                f"e.g. ['x', None] (UNKNOWN for no preference)")
        return DimsSpec(tuple(_normalise(e) for e in spec))

    @property
    def is_complete(self) -> bool:
        return UNKNOWN not in self.dims

    def used(self) -> set:
        """The mesh dims its entries and ``partial`` take."""
        used = set(self.partial)
        for e in self.dims:
            used.update(entry_dims(e))
        return used

    def filled_from(self, other: DimsSpec) -> DimsSpec:
        """Unknown entries taken from ``other`` (in dim order) unless that would use a
        mesh dim twice; known entries and ``partial`` stay."""
        dims = self.dims
        if UNKNOWN not in dims:
            return self
        out = used = None
        for i, (a, b) in enumerate(zip(dims, other.dims)):
            if a is UNKNOWN and b is not UNKNOWN:
                if used is None:
                    used = self.used()
                new = entry_dims(b)
                if used.isdisjoint(new):
                    if out is None:
                        out = list(dims)
                    out[i] = b
                    used.update(new)
        return self if out is None else DimsSpec(tuple(out), self.partial)

    def known(self) -> DimsSpec:
        """Unknown entries become None (what completion does at the end)."""
        if UNKNOWN not in self.dims:
            return self
        return DimsSpec(tuple(None if e is UNKNOWN else e for e in self.dims), self.partial)

    def __str__(self) -> str:
        s = "[" + ", ".join(entry_str(e) for e in self.dims) + "]"
        if self.partial:
            s += " P(" + ",".join(sorted(self.partial)) + ")"
        return s


def _normalise(entry):
    if isinstance(entry, (list, tuple)):
        entry = tuple(entry)
        return entry_of(entry)
    return entry
