"""Keywords checked by name: a mistyped one is an error naming the nearest that exists.

``@keywords_checked`` on a class (its ``__init__``) or a function turns Python's bare
``TypeError: ... got an unexpected keyword argument 'auto_mod'`` into a
:class:`KeywordError` (a DistGraphError and still a TypeError) that names the call, the
keyword and the nearest keywords it takes. ``suggest(name, names)`` is the
"(did you mean ...?)" part, for any name looked up among known ones (config keys,
layer paths).

Example::

    dg.Strategy(auto_mod="full")
    # KeywordError: Strategy(auto_mod=...): no such keyword (did you mean 'auto_mode'?)
    dg.Strategy(colour="red")
    # KeywordError: Strategy(colour=...): no such keyword; it takes auto_mode, pipeline, ...
"""

from __future__ import annotations

import difflib
import functools
import inspect

from distgraph.errors import DistGraphError


class KeywordError(DistGraphError, TypeError):
    """A keyword argument the called class or function does not take."""


def suggest(name, names, n: int = 3) -> str:
    """`` (did you mean 'x'?)`` with the (at most ``n``) names of ``names`` closest to
    ``name``, or ""."""
    close = difflib.get_close_matches(str(name), [str(n) for n in names], n=n)
    return f" (did you mean {', '.join(map(repr, close))}?)" if close else ""


def _takes(fn) -> tuple:
    """(keyword names, whether it takes **kwargs) of ``fn``."""
    params = list(inspect.signature(fn).parameters.values())
    if params and params[0].name in ("self", "cls"):       # a method's own first
        params = params[1:]
    names = tuple(p.name for p in params
                  if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    return names, any(p.kind is p.VAR_KEYWORD for p in params)


def keywords_checked(obj):
    """Check the keywords of calls to ``obj`` (a class: its ``__init__``; or a function)
    before the call, as the module docstring says; returns ``obj``."""
    fn = obj.__init__ if inspect.isclass(obj) else obj
    names, anything = _takes(fn)
    if anything:
        return obj
    label = obj.__qualname__

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        for key in kwargs:
            if key not in names:
                near = suggest(key, names, 1)
                raise KeywordError(f"{label}({key}=...): no such keyword" + (
                    near or f"; it takes {', '.join(names)}"))
        return fn(*args, **kwargs)

    if inspect.isclass(obj):
        obj.__init__ = checked
        return obj
    return checked
