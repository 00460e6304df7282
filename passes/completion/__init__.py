"""Completion: ProcessMesh propagation, ShardSpec propagation to a fixpoint, and the
cost-aware resolution of conflicts (see :mod:`distgraph.passes.completion.complete`)."""

from distgraph.passes.completion.complete import complete
from distgraph.passes.completion.why import why
