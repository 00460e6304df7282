"""What one planning remembers: every memo of one ``dg.passes.plan`` call, as named tables.

The planner makes a :class:`Session` per call and hands it to the search's front door
(:func:`distgraph.passes.search.choose`); every part of the search that keeps what it
worked out for later (a stage option's searches, a mesh's reshard prices, the program
split for a micro-batch count) keeps it in a table of the session, named for what it
holds, and the session goes when the call returns: nothing is remembered from one plan
to the next, and nothing is kept in module state. A function called outside a planning
makes a fresh session where it is given none. A table counts its hits and misses, so
the search's report can say what each table held and how often it served
(:meth:`Session.stats`); the tables a planning makes are listed in
:mod:`distgraph.passes.search`'s docstring.

Example::

    session = Session()
    prices = session.table("reshard prices")
    seconds = prices.memo(key, lambda: price(step))
    print(session)        # memo tables: reshard prices 1 (hits 0, misses 1)
"""

from __future__ import annotations


class Table(dict):
    """A memo table: a dict that counts its hits and misses through :meth:`memo` and
    :meth:`find` (a loop that reads it directly adds what it served to ``hits`` and
    ``misses`` itself)."""

    def __init__(self, name: str):
        super().__init__()
        self.name, self.hits, self.misses = name, 0, 0

    def memo(self, key, make):
        """The value kept under ``key``, made by ``make()`` and kept the first time."""
        try:
            value = self[key]
        except KeyError:
            self.misses += 1
            value = self[key] = make()
            return value
        self.hits += 1
        return value

    def find(self, key):
        """The value kept under ``key`` (a hit), or None (a miss: the caller makes it)."""
        value = self.get(key)
        if value is None:
            self.misses += 1
        else:
            self.hits += 1
        return value


class Session:
    """The tables of one planning (module docstring)."""

    def __init__(self):
        self._tables: dict = {}

    def table(self, name: str) -> Table:
        """The table called ``name``, made empty the first time it is asked for."""
        table = self._tables.get(name)
        if table is None:
            table = self._tables[name] = Table(name)
        return table

    def stats(self) -> list:
        """(name, entries, hits, misses) of every table, in the order they were made."""
        return [(t.name, len(t), t.hits, t.misses) for t in self._tables.values()]

    def close(self) -> None:
        """Empty every table (what the planning made is freed at once: what a table keeps
        refers to the session, a cycle only the cyclic collector would free)."""
        for table in self._tables.values():
            table.clear()

    def __str__(self) -> str:
        return describe(self.stats())


def describe(stats) -> str:
    """One line of :meth:`Session.stats` rows: ``memo tables: name entries (hits h,
    misses m); ...``."""
    if not stats:
        return "memo tables: none"
    return "memo tables: " + "; ".join(f"{name} {n} (hits {hits}, misses {misses})"
                                       for name, n, hits, misses in stats)


def memo_tables(stats) -> list:
    """:meth:`Session.stats` rows as plain data (a report's ``to_dict``)."""
    return [{"name": name, "entries": n, "hits": hits, "misses": misses}
            for name, n, hits, misses in stats]
