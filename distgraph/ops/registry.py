"""The op registry lives in :mod:`distgraph.registry` (below tracing, which the ops here
build on); this path stays for code written against milestone 2."""

from distgraph.registry import *  # noqa: F401,F403
