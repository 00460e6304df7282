"""distgraph.passes: completion, reshard planning, planning into a Plan, cost model, rank
mapping, and MeshSlice's autotuner (``dg.passes.meshslice.autotune``)."""

from distgraph.passes import meshslice
from distgraph.passes.completion.complete import complete, why
from distgraph.passes.cost.checkpoint import CheckpointInterval, young_daly
from distgraph.passes.cost.estimate import Estimate, estimate
from distgraph.passes.planner import plan
from distgraph.plan.plan import Plan
from distgraph.passes.reshard import plan_reshard
