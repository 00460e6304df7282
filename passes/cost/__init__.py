"""The cost model: one package for its formulas, its unit prices and the plan estimate.

- :mod:`.formulas`: alpha-beta on a ring for every collective and p2p step, the pipeline
  of K slices (MeshSlice);
- :mod:`.prices`: what an op, a reshard step, an op's own collective and an overlapped op
  cost on a device and its links (the search, completion, the autotuner and the balanced
  split price with these);
- :mod:`.estimate`: a whole plan's step time (compute, communication, bubble) and peak
  memory per process (``dg.passes.estimate``);
- :mod:`.fit`: each process's peak against what its device may hold (the check every
  plan on a cluster passes).
"""
