"""The cost model: one package for its formulas, its unit prices and the plan estimate.

- :mod:`.formulas`: alpha-beta on a ring for every collective and p2p step, the pipeline
  of K slices (MeshSlice);
- :mod:`.prices`: what an op, a reshard step, an op's own collective and an overlapped op
  cost on a device and its links (the search, completion, the autotuner and the balanced
  split price with these);
- :mod:`.estimate`: a whole plan's step time (compute, communication, bubble) and peak
  memory per process (``dg.passes.estimate``);
- :mod:`.stage`: the accountant, the terms of a pipeline's price the estimate and the
  stage searches share (a schedule's step, micro-batches in flight, what a stage then
  holds, a stage's cost from its parts);
- :mod:`.exposed`: what a step pays of the gradient reductions it starts during the
  backward (the rule :mod:`.overlap` prices a plan's buckets by, and the searches a
  part's or a stage's);
- :mod:`.layout_prices`: the prices of layouts on one mesh (a strategy, a reshard, a
  tensor), which the intra-op search's problem is built from;
- :mod:`.boundary`: what a pipeline stage pays to pass its blocks' Values to its
  neighbours, as the estimate prices those reshards;
- :mod:`.fit`: each process's peak against what its device may hold (the check every
  plan on a cluster passes).
"""
