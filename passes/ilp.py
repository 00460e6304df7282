"""The path of milestone 2's public ILP contract; the solver lives in
:mod:`distgraph.passes.search.layouts.ilp`."""

from distgraph.passes.search.layouts.ilp import *  # noqa: F401,F403
