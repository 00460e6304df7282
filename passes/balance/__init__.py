"""``Strategy(balance=True)``: the batch split unevenly over data-parallel groups that
compute at different speeds, so that they finish together.

- :mod:`.batch`: :func:`balance_batch`, the split of a planned program's batch from the
  cost model (the groups, a linear time model per process, each device's memory);
- :mod:`.batch_split`: the :class:`~.batch_split.BatchSplit` value, and the small integer
  program (cvxpy on SCIP) that chooses it;
- :mod:`.uneven`: what the processes of an uneven split run (:func:`~.uneven.run_split`),
  and its schedule when the groups run different numbers of micro-batches; by rows in
  :mod:`.uneven_rows`, by micro-batches in :mod:`.uneven_micro`.

The planner calls them in that order (:mod:`distgraph.passes.planner`).
"""

from distgraph.passes.balance.batch import balance_batch, batch_mesh_dims
