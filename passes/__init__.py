"""distgraph.passes: completion, reshard planning, planning into a Plan, cost model, rank
mapping, and MeshSlice's autotuner (``dg.passes.meshslice.autotune``)."""

from distgraph.passes import meshslice
from distgraph.passes.completion.complete import complete, explain
from distgraph.passes.estimate import Estimate, estimate
from distgraph.passes.planner import Plan, plan
from distgraph.passes.reshard import plan_reshard
