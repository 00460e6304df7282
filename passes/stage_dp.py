"""The path of milestone 2's public stage DP; it lives in
:mod:`distgraph.passes.search.stage_dp`."""

from distgraph.passes.search.stage_dp import *  # noqa: F401,F403
