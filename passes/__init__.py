"""distgraph.passes: completion, reshard planning, cost model, rank mapping."""

from distgraph.passes.completion import complete, explain
from distgraph.passes.reshard import plan_reshard
