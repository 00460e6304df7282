"""Typed access to parsed file content with errors that name file, key path and line.

Every check of a resource file goes through a :class:`Reader`, so every message has the
same shape::

    bad.yaml: machines[1].devices[3].memory (line 27): got -4; expected a number of GB > 0

Example::

    >>> r = Reader("c.yaml")
    >>> r.number({"memory": 40}, "memory", "machines[0].devices[0]", minimum=0, strict=True)
    40.0
"""

from __future__ import annotations

import math
import os
import re
from typing import NoReturn

from distgraph.errors import ResourceFileError

_MISSING = object()


def join(key: str, name) -> str:
    """Key path of a child: ``join("machines[1]", "devices") == "machines[1].devices"``."""
    if isinstance(name, int):
        return f"{key}[{name}]"
    return f"{key}.{name}" if key else str(name)


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class Reader:
    """Validating accessors over plain data; ``lines`` maps key paths to line numbers (or
    is a function that makes that map: called once, when an error first needs a line, as
    a valid file of 10,000 devices need not be parsed a second time for them).

    ``lenient_numbers`` also accepts numbers written as strings (Paddle's files do that).
    """

    def __init__(self, source: str, lines=None, lenient_numbers: bool = False):
        self.source = source
        self._lines = lines or {}
        self.lenient_numbers = lenient_numbers

    @property
    def lines(self) -> dict[str, int]:
        if callable(self._lines):
            self._lines = self._lines()
        return self._lines

    @property
    def default_name(self) -> str:
        """The file's stem ('gpu_2x8' for .../gpu_2x8.yaml): a cluster's name when unnamed."""
        if self.source.startswith("<"):
            return ""
        return os.path.splitext(os.path.basename(self.source))[0]

    def line_of(self, key: str) -> int | None:
        # A missing key has no line of its own: use the closest enclosing entry.
        while True:
            if key in self.lines:
                return self.lines[key]
            if not key:
                return None
            cut = max(key.rfind("."), key.rfind("["))
            key = key[:cut] if cut > 0 else ""

    def message(self, key: str, problem: str, expected: str | None = None) -> str:
        line = self.line_of(key)
        where = f"{self.source}: {key or '<top level>'}"
        if line is not None:
            where += f" (line {line})"
        text = f"{where}: {problem}"
        if expected:
            text += f"; expected {expected}"
        return text

    def fail(self, key: str, problem: str, expected: str | None = None) -> NoReturn:
        raise ResourceFileError(self.message(key, problem, expected))

    # ---- containers --------------------------------------------------------------------
    def mapping(self, value, key: str, allowed=None, what: str = "a mapping") -> dict:
        if not isinstance(value, dict):
            self.fail(key, f"got {type(value).__name__} {_show(value)}", what)
        if allowed is not None:
            for name in value:
                if name not in allowed:
                    self.fail(join(key, name), f"unknown key {name!r}",
                              f"one of {', '.join(sorted(allowed))}")
        return value

    def sequence(self, value, key: str, what: str = "a list", nonempty: bool = False) -> list:
        if not isinstance(value, list):
            self.fail(key, f"got {type(value).__name__} {_show(value)}", what)
        if nonempty and not value:
            self.fail(key, "got an empty list", f"{what} with at least one entry")
        return value

    def get(self, data: dict, name: str, key: str, default=_MISSING):
        if name in data:
            return data[name]
        if default is _MISSING:
            self.fail(join(key, name), f"missing key {name!r} in {key or 'the top level'}",
                      "it to be present")
        return default

    # ---- scalars -----------------------------------------------------------------------
    def integer(self, data: dict, name: str, key: str, default=_MISSING, minimum: int = 0):
        value = self.get(data, name, key, default)
        if value is default and default is not _MISSING:
            return value
        path = join(key, name)
        if self.lenient_numbers and isinstance(value, str) \
                and re.fullmatch(r"-?[0-9]+", value.strip()):
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(path, f"got {type(value).__name__} {_show(value)}",
                      f"an integer >= {minimum}")
        if value < minimum:
            self.fail(path, f"got {value}", f"an integer >= {minimum}")
        return value

    def number(self, data: dict, name: str, key: str, default=_MISSING, minimum: float = 0.0,
               strict: bool = False, unit: str = "") -> float:
        """A finite float >= minimum (> minimum when ``strict``); numeric strings accepted.

        Numeric strings are accepted everywhere because YAML 1.1 reads ``1e3`` as a string.
        """
        value = self.get(data, name, key, default)
        if value is default and default is not _MISSING:
            return value
        path = join(key, name)
        bound = f"{'>' if strict else '>='} {minimum:g}"
        expected = f"a number{' of ' + unit if unit else ''} {bound}"
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                self.fail(path, f"got text {_show(value)}", expected)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(path, f"got {type(value).__name__} {_show(value)}", expected)
        value = float(value)
        if not math.isfinite(value) or value < minimum or (strict and value == minimum):
            self.fail(path, f"got {value:g}", expected)
        return value

    def string(self, data: dict, name: str, key: str, default=_MISSING,
               choices=None, nonempty: bool = False) -> str:
        value = self.get(data, name, key, default)
        if value is default and default is not _MISSING:
            return value
        path = join(key, name)
        if not isinstance(value, str):
            self.fail(path, f"got {type(value).__name__} {_show(value)}", "a string")
        if choices is not None and value not in choices:
            self.fail(path, f"got {value!r}", f"one of {', '.join(choices)}")
        if nonempty and not value.strip():
            self.fail(path, "got an empty string", "a non-empty string")
        return value
