"""Device figures the cost model needs beyond GEMM GFLOP/s, measured on this process.

- ``memory_bandwidth_gbps``: GB/s of a large elementwise add (two arrays read, one
  written), the rate of memory-bound ops.
- ``op_overhead_us``: µs per op that distgraph's executor spends on an op whose tensors
  are tiny, so that the arithmetic is negligible: the mean over every op of a one-layer
  GPT training step (forward, backward and Adam update), so that the mix of op types is
  the one models have.

``distgraph cluster calibrate`` writes both into each device of the resource file.

Example::

    >>> memory_bandwidth_gbps() > 0 and op_overhead_us() > 0
    True
"""

from __future__ import annotations

import time

import numpy as np

BANDWIDTH_BYTES = 32 * 2**20       # per array: well past the caches


def memory_bandwidth_gbps(repeats: int = 3) -> float:
    """Best-of-``repeats`` GB/s of ``c = a + b`` on float64 arrays (3 arrays moved)."""
    n = BANDWIDTH_BYTES // 8
    a, b, c = np.ones(n), np.ones(n), np.empty(n)
    np.add(a, b, out=c)
    best = np.inf
    for _ in range(repeats):
        start = time.perf_counter()
        np.add(a, b, out=c)
        best = min(best, time.perf_counter() - start)
    return 3 * BANDWIDTH_BYTES / best / 1e9


def op_overhead_us(repeats: int = 3, steps: int = 20) -> float:
    """Mean µs per op of a tiny one-layer GPT training step run by distgraph's executor
    (best of ``repeats`` batches of ``steps`` steps)."""
    # The executor lives above this package; it is what the figure describes, so it is
    # imported here, at measurement time only.
    import distgraph as dg
    from distgraph.program_builder import build_program
    from distgraph.runtime.executor import ProgramRunner

    model = dg.nn.GPT(vocab_size=16, d_model=8, n_layer=1, n_head=2, max_seq_len=4)
    built = build_program(model, [dg.InputSpec([1, 4], "int64", "tokens")],
                          [dg.InputSpec([1, 4], "int64", "labels")],
                          dg.nn.CrossEntropyLoss(), dg.optim.Adam(1e-3))
    program = built.program
    scope = {n: p.numpy() for n, p in model.named_parameters()}
    scope.update(dg.optim.Adam(1e-3).initial_state(program))
    runner = ProgramRunner(program)
    feed = {"tokens": np.zeros((1, 4), np.int64), "labels": np.ones((1, 4), np.int64)}
    fetch = [built.loss_name]
    runner.run(scope, feed, fetch, 0)
    best = np.inf
    for _ in range(repeats):
        start = time.perf_counter()
        for step in range(steps):
            runner.run(scope, feed, fetch, step)
        best = min(best, (time.perf_counter() - start) / steps)
    return best / len(program.ops) * 1e6
