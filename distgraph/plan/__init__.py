"""The plan contract: the values the planner produces and the runtime reads.

Everything a rank needs to run its part of a plan is here, made whole by the planner
(:func:`distgraph.passes.plan`) before any rank starts: the :class:`~.plan.Plan`, one
frozen :class:`~.program.ProcessProgram` per process (compiled instructions,
communicator groups, feed rows per micro-batch, batched weight-gradient groups, the
gather points of fetched values and of the state), reshard points and their steps
(:mod:`.reshard`), the task graph and the schedule (:mod:`.tasks`, :mod:`.schedule`), the
tag scheme (:mod:`.tags`) and the kinds everything is written in (:mod:`.kinds`). What
the plan reads of the values made above it (the cluster, the estimate, the search's
report, the checkpoint interval, the batch split) is typed by the Protocols of
:mod:`.protocols`.

The contract sits between the core (IR, ops, attributes) and the layers that use it:
the planner (``distgraph.passes``) makes its values, the runtime (``distgraph.runtime``)
executes them and imports nothing of the planner. This package imports no submodule
here, so that a communicator that needs only the kinds and tags loads only those.
"""
