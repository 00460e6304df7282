"""MeshSlice (Nam et al.): 2-D tensor parallelism whose collectives are cut into K
partial collectives overlapped with K partial GeMMs.

- the algorithm is matmul's distributed form (:mod:`distgraph.ops.meshslice`), its
  layouts matmul's rule (:mod:`distgraph.spmd.meshslice`);
- :mod:`.slices`: the planner's part (``Strategy(meshslice=...)``, each matmul's K,
  what ``Plan.explain(full=True)`` lists);
- :func:`autotune`: the LLM autotuner (dataflow per FC layer, mesh shape and K from the
  cost model of a resource file).
"""

from distgraph.passes.meshslice.autotune import AutotuneReport, GemmCost, MeshShapeCost, autotune
from distgraph.passes.meshslice.slices import assign_slices, enable, uses

__all__ = ["AutotuneReport", "GemmCost", "MeshShapeCost", "assign_slices", "autotune", "enable",
           "uses"]
