"""The automatic search (``Strategy(auto_mode="full")``): the intra-op sharding ILP
(Alpa, on SCIP) and the inter-op stage DP."""

from distgraph.passes.search.layouts.intra_op import search
