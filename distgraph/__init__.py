"""distgraph: a Paddle-style auto-parallel training framework."""

from distgraph.errors import DistGraphError, PlanError, ResourceFileError, RuntimeFault, ShardingError
