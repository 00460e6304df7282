"""Device figures the cost model needs beyond GEMM GFLOP/s, measured on this process.

- ``memory_bandwidth_gbps``: GB/s of a large elementwise add (two arrays read, one
  written), the rate of memory-bound ops.

Every probe keeps the fastest of its runs (module :mod:`distgraph.tools.calibrate`).
- ``op_overhead_us``: µs per op that distgraph's executor spends on an op whose tensors
  are tiny, so that the arithmetic is negligible: the mean over every op of a one-layer
  GPT training step (forward, backward and Adam update), so that the mix of op types is
  the one models have.
- ``op_costs``: per op type, ``(µs per call, ns per unit of work)`` fitted (least
  squares, both >= 0) to every op of GPT, MLP, Llama and Mixtral training steps at
  three sizes, timed
  one by one in distgraph's bare runner, and scaled to the steps the training executor
  runs (see :func:`op_costs`); work is an op's FLOPs for a matmul and the
  elements it reads and writes otherwise (:func:`distgraph.registry.op_work`). It
  captures what FLOPs miss: transcendental functions (GELU's tanh, softmax's exp), views
  that move nothing, small matmuls far below the GEMM rate. On numpy it also holds
  the casts between float32 and each 16-bit dtype (:func:`cast_costs`), which the
  executor makes around every op on 16-bit operands.

``distgraph cluster calibrate`` writes all three into each device of the resource file.
Each takes the array backend ``xb`` it measures: numpy (this CPU, the default) or CuPy
(the rank's GPU; timings then end when the GPU is done).

Example::

    >>> memory_bandwidth_gbps() > 0 and op_overhead_us() > 0
    True
    >>> op_costs()["matmul"]     # doctest: +SKIP
    (4.1, 0.009)
"""

from __future__ import annotations

import time

import numpy as np

from distgraph.dtypes import HALF_DTYPES, numpy_dtype
from distgraph.nn.layers import GPT, MLP, CrossEntropyLoss, MSELoss
from distgraph.nn.llama import Llama, LlamaConfig
from distgraph.nn.mixtral import Mixtral, MixtralConfig
from distgraph.optim import Adam
from distgraph.passes.planner import plan
from distgraph.program_builder import build_program
from distgraph.registry import TensorType, cast_cost_key, op_work
from distgraph.runtime.backend import NUMPY
from distgraph.runtime.execution.executor import ProgramRunner
from distgraph.runtime.execution.runner import PlanRunner
from distgraph.trace import InputSpec

BANDWIDTH_BYTES = 32 * 2**20       # per array: well past the caches
PROBES = 5                         # runs per repeat of a probe whose fastest is kept
CHUNKS = 16                        # parts of the arrays the memory bandwidth is timed on
CALL_SHARE = 0.05                  # the most of a timed chunk its call may take
MOST_BANDWIDTH_BYTES = 2**30       # per array: where the probe stops growing them
CAST_SIZES = (2**10, 2**13, 2**15, 2**17, 2**19)    # elements: a weight's to a layer's


def memory_bandwidth_gbps(repeats: int = 3, xb=NUMPY, nbytes: int = BANDWIDTH_BYTES,
                          most: int = MOST_BANDWIDTH_BYTES) -> float:
    """GB/s of ``c = a + b`` on float64 (3 arrays moved) on backend ``xb`` (numpy: this
    CPU; CuPy: its GPU): arrays of ``nbytes`` each, well past the caches, added chunk
    by chunk (:data:`CHUNKS` of them, each timed alone) ``PROBES x repeats`` times, the
    fastest chunk kept (a chunk takes a fraction of a millisecond: the whole add, tens
    of milliseconds, is often cut by another process's turn).

    The call itself (a kernel's launch and the synchronisation after it: the fastest add
    of one element) is taken off each chunk's time, and a chunk must last at least
    1 / :data:`CALL_SHARE` calls: where it is shorter the arrays are cut into fewer
    chunks, then made larger (doubled, up to ``most`` bytes each). A GPU's 16 MB chunk
    (of 256 MB arrays) moves 48 MB in about 11 us at an H200's 4.3 TB/s, about what the
    launch and the synchronisation take: three fresh H200s read 1,374, 1,392 and
    1,731 GB/s so. On a CPU the chunks stay as they were (a 2 MB chunk's add takes
    hundreds of microseconds, its call one or two)."""
    def fastest(add, times: int) -> float:
        best = np.inf
        for _ in range(times):
            start = time.perf_counter()
            add()
            xb.synchronize()
            best = min(best, time.perf_counter() - start)
        return best

    def chunked(a, b, c, chunks: int, step: int, rounds: int) -> float:
        # the chunks in turn, none timed twice in a row: a chunk just added is in a
        # cache, which a chunk of a CPU's 32 MB arrays fits
        best = np.inf
        for _ in range(rounds):
            for k in range(chunks):
                part = slice(k * step, (k + 1) * step)
                best = min(best, fastest(lambda: xb.xp.add(a[part], b[part], out=c[part]), 1))
        return best

    while True:
        n = nbytes // 8
        a, b, c = xb.xp.ones(n), xb.xp.ones(n), xb.xp.empty(n)
        xb.xp.add(a, b, out=c)
        xb.synchronize()
        call = fastest(lambda: xb.xp.add(a[:1], b[:1], out=c[:1]), PROBES * 4)
        chunks = CHUNKS
        while True:
            step = n // chunks
            long_enough = chunked(a, b, c, chunks, step, 1) * CALL_SHARE >= call
            if long_enough or chunks == 1:
                break
            chunks //= 2
        if long_enough or 2 * nbytes > most:
            break
        nbytes *= 2
        del a, b, c
    best = chunked(a, b, c, chunks, step, PROBES * repeats)
    return 3 * step * 8 / max(best - call, best * CALL_SHARE) / 1e9


def op_overhead_us(repeats: int = 3, steps: int = 20, xb=NUMPY) -> float:
    """Mean µs per op of a tiny one-layer GPT training step run by distgraph's executor
    on backend ``xb`` (the fastest step of ``PROBES x repeats`` batches of ``steps``)."""
    model = GPT(vocab_size=16, d_model=8, n_layer=1, n_head=2, max_seq_len=4)
    built = build_program(model, [InputSpec([1, 4], "int64", "tokens")],
                          [InputSpec([1, 4], "int64", "labels")], CrossEntropyLoss(), Adam(1e-3))
    program = built.program
    scope = {n: p.numpy() for n, p in model.named_parameters()}
    scope.update(Adam(1e-3).initial_state(program))
    scope = {n: xb.from_host(a) for n, a in scope.items()}
    runner = ProgramRunner(program, xp=xb.xp)
    feed = {"tokens": xb.from_host(np.zeros((1, 4), np.int64)),
            "labels": xb.from_host(np.ones((1, 4), np.int64))}
    fetch = [built.loss_name]
    runner.run(scope, feed, fetch, 0)
    xb.synchronize()
    best = np.inf
    for _ in range(PROBES * repeats):
        for step in range(steps):
            start = time.perf_counter()
            runner.run(scope, feed, fetch, step)
            xb.synchronize()
            best = min(best, time.perf_counter() - start)
    return best / len(program.ops) * 1e6


# (GPT dims, batch) and (MLP dims, batch) of the programs op_costs times: small enough to
# run in seconds, far enough apart to separate the per-call cost from the per-unit one.
# Past the smallest, a Linear layer's GEMMs have a few hundred rows, as in training (the
# GPTs' batch x sequence): a batch of 64 rows left the MLPs' weight-gradient GEMMs a
# contracted dim of 64, at two thirds of the GEMM rate of larger ones.
GPT_SIZES = ((dict(vocab_size=64, d_model=16, n_layer=1, n_head=2, max_seq_len=8), 2),
             (dict(vocab_size=128, d_model=64, n_layer=1, n_head=4, max_seq_len=32), 8),
             (dict(vocab_size=256, d_model=128, n_layer=1, n_head=4, max_seq_len=64), 8))
MLP_SIZES = (((16, 32, 8), 8), ((256, 1024, 256), 256), ((512, 2048, 512), 256))
# (Llama's fields, batch, sequence) of the Llama (grouped-query attention: fewer kv heads)
# and Mixtral steps op_costs times too, so that their op types (RMS norm, rotary
# embedding, the fused attention, SiLU, the experts' moe_ffn) get measured costs and not
# the roofline's, which prices their transcendental and strided work far under its time.
LLAMA_SIZES = ((dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                     num_key_value_heads=1), 2, 8),
               (dict(vocab_size=128, hidden_size=64, intermediate_size=128,
                     num_attention_heads=4, num_key_value_heads=2), 8, 32),
               (dict(vocab_size=256, hidden_size=128, intermediate_size=256,
                     num_attention_heads=4, num_key_value_heads=2), 8, 64))
MOE_EXPERTS = dict(num_local_experts=4, num_experts_per_tok=2)


def op_costs(repeats: int = 3, steps: int = 5, sync=None, xb=NUMPY,
             window: float = 0.0) -> dict:
    """{op type: (µs per call, ns per unit of work)} on this process's backend ``xb``
    (numpy, or CuPy: the GPU's, each op timed to the end of its kernels; module docstring),
    and on numpy the casts' (:func:`cast_costs`).

    The fit takes each op's fastest time of the runs (the bare runner's own work for
    the op included: the ops' times add up to its step). The fastest of each op, not of
    whole steps: an op of microseconds to a millisecond often runs undisturbed on a
    machine that other processes load, a step of milliseconds rarely, and the fastest is
    what the device does when they leave it alone, the same run after run; how ranks
    that outnumber the cores share them is the calibration's
    (:func:`distgraph.tools.calibrate.core_share`). ``sync`` (e.g. an MPI barrier) lines
    the ranks up before each timed step, so that all of them compute at once, as in
    training. With ``window`` > 0 the costs are instead scaled so that they add up to
    the mean of as many steps as fit in ``window`` seconds run back to back after one
    ``sync``: the sustained rate of ranks that share cores or a CPU quota (the emulated
    clusters), all computing.

    The ops are timed one by one in the bare runner
    (:class:`~distgraph.runtime.execution.executor.ProgramRunner`); training runs them
    through the executor that also keeps the plan's bookkeeping per instruction (the
    carrier's liveness, the memory ledger: a serial plan's
    :class:`~distgraph.runtime.execution.runner.PlanRunner`), so the measured total of
    a program is its fastest step through that executor (its sustained mean with
    ``window``). Measured on this 2-core machine (one process, 2026-11-28): the twelve
    probe programs' fastest steps through it took 0.97-1.41 x the bare runner's (median
    1.11; the small ones most: 1.26-1.41 for the fewest ops of microseconds)."""
    from scipy.optimize import nnls

    samples: dict = {}
    totals = []
    programs = list(_probe_programs(xb))
    fastest = [np.full(len(program.ops), np.inf) for program, _, _ in programs]
    trained = np.full(len(programs), np.inf)     # whole steps, the training executor's
    for _, run, train in programs:
        run([])                                        # warm-up
        train()
    # the programs in turn, round after round: each op's runs spread over the whole
    # probe, so that a spell of load on the machine slows few of them
    for _ in range(repeats * steps):
        for k, (_, run, train) in enumerate(programs):
            timings: list = []
            if sync is not None:
                sync()
            run(timings)
            fastest[k] = np.minimum(fastest[k], timings)
            if window <= 0:
                if sync is not None:
                    sync()
                start = time.perf_counter()
                train()
                trained[k] = min(trained[k], time.perf_counter() - start)
    for (program, _, train), seconds, step in zip(programs, fastest, trained):
        works = [_work(op) for op in program.ops]
        totals.append((program, works, step if window <= 0 else
                       _sustained_step(train, window, sync)))
        for op, w, t in zip(program.ops, works, seconds):
            samples.setdefault(op.type, []).append((w, float(t)))
    fitted = {}
    for op_type, pairs in samples.items():
        work = np.array([w for w, _ in pairs])
        t = np.array([s for _, s in pairs])
        if work.max() == work.min():         # one size only: all of it is the call's
            fitted[op_type] = (float(np.median(t)), 0.0)
        else:
            (alpha, beta), _ = nnls(np.stack([np.ones_like(work), work], axis=1), t)
            fitted[op_type] = (float(alpha), float(beta))
    scale = float(np.median([measured / sum(fitted[op.type][0] + fitted[op.type][1] * w
                                           for op, w in zip(program.ops, works))
                             for program, works, measured in totals]))
    costs = {op_type: (round(a * scale * 1e6, 4), round(b * scale * 1e9, 6))
             for op_type, (a, b) in fitted.items()}
    if xb.xp is np:
        costs.update(cast_costs(repeats * steps, sync))
    return costs


def cast_costs(runs: int = 15, sync=None) -> dict:
    """{:func:`~distgraph.registry.cast_cost_key`: (µs per call, ns per element)} of
    numpy's casts between float32 and each 16-bit dtype, both ways: what the executor
    adds around an op on 16-bit operands on a CPU (``call_kernel``: widened to float32,
    the results rounded back). Each size's fastest of ``runs`` (``sync`` before each
    round, as :func:`op_costs`), fitted as :func:`op_costs` fits an op type. Not scaled
    to the training executor's steps: a cast inside an op is one numpy call, not an
    instruction."""
    from scipy.optimize import nnls

    rng = np.random.default_rng(0)
    arrays = {n: rng.normal(size=n).astype(np.float32) for n in CAST_SIZES}
    pairs = [(src, dst) for h in HALF_DTYPES for src, dst in ((h, "float32"), ("float32", h))]
    sources = {(src, dst, n): (arrays[n] if src == "float32" else
                               arrays[n].astype(numpy_dtype(src)))
               for src, dst in pairs for n in CAST_SIZES}
    fastest = dict.fromkeys(sources, np.inf)
    for _ in range(runs):
        if sync is not None:
            sync()
        for (src, dst, n), a in sources.items():
            target = numpy_dtype(dst)
            start = time.perf_counter()
            a.astype(target)
            fastest[src, dst, n] = min(fastest[src, dst, n], time.perf_counter() - start)
    out = {}
    sizes = np.array(CAST_SIZES, dtype=float)
    for src, dst in pairs:
        t = np.array([fastest[src, dst, n] for n in CAST_SIZES])
        (alpha, beta), _ = nnls(np.stack([np.ones_like(sizes), sizes], axis=1), t)
        out[cast_cost_key(src, dst)] = (round(float(alpha) * 1e6, 4),
                                        round(float(beta) * 1e9, 6))
    return out


def _sustained_step(run, window: float, sync=None) -> float:
    """Mean seconds of a step ``run()`` over as many steps as fit in ``window`` seconds,
    back to back after one ``sync`` (see :func:`op_costs`)."""
    if sync is not None:
        sync()
    count, start = 0, time.perf_counter()
    while True:
        run()
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= window:
            return elapsed / count


def _work(op) -> float:
    return op_work(op.type, [TensorType(v.shape, v.dtype) for v in op.inputs],
                   [TensorType(v.shape, v.dtype) for v in op.outputs], op.attrs)


def _probe_programs(xb=NUMPY):
    """(program, run(timings), train()) of the training steps op_costs times, on backend
    ``xb``: ``run`` times each op in the bare runner, ``train`` runs one step of the same
    program, from the same state, through the training executor (a serial plan's
    :class:`~distgraph.runtime.execution.runner.PlanRunner`, planned at its first step:
    a caller that reads only the programs plans nothing)."""

    rng = np.random.default_rng(0)
    cases = []
    for dims, batch in GPT_SIZES:
        t = dims["max_seq_len"]
        tokens = rng.integers(0, dims["vocab_size"], size=(batch, t))
        cases.append((GPT(**dims), CrossEntropyLoss(),
                      [("tokens", tokens), ("labels", np.roll(tokens, -1, axis=1))]))
    for (d_in, hidden, d_out), batch in MLP_SIZES:
        model = MLP(d_in, hidden, d_out, activation="relu")
        cases.append((model, MSELoss(),
                      [("x", rng.normal(size=(batch, d_in)).astype(np.float32)),
                       ("y", rng.normal(size=(batch, d_out)).astype(np.float32))]))
    for fields, batch, t in LLAMA_SIZES:
        tokens = rng.integers(0, fields["vocab_size"], size=(batch, t))
        for model in (Llama(LlamaConfig(num_hidden_layers=1, max_position_embeddings=t,
                                        **fields)),
                      Mixtral(MixtralConfig(num_hidden_layers=1, max_position_embeddings=t,
                                            **fields, **MOE_EXPERTS))):
            cases.append((model, CrossEntropyLoss(),
                          [("tokens", tokens), ("labels", np.roll(tokens, -1, axis=1))]))
    for model, loss, fields in cases:
        (x_name, x), (y_name, y) = fields
        optimizer = Adam(1e-3)
        built = build_program(model, [InputSpec(x.shape, str(x.dtype), x_name)],
                              [InputSpec(y.shape, str(y.dtype), y_name)], loss, optimizer)
        initial = {n: p.numpy() for n, p in model.named_parameters()}
        initial.update(optimizer.initial_state(built.program))
        scope = {n: xb.from_host(a) for n, a in initial.items()}
        runner = ProgramRunner(built.program, xp=xb.xp)
        feed = {x_name: xb.from_host(x), y_name: xb.from_host(y)}

        def run(timings, runner=runner, scope=scope, feed=feed, fetch=[built.loss_name]):
            runner.run(scope, feed, fetch, 0, timings=timings, device_sync=xb.synchronize)

        made: dict = {}     # the serial plan's runner and state, at the first step

        def train(built=built, initial=initial, feed={x_name: x, y_name: y}, made=made):
            if not made:
                made["runner"] = PlanRunner(plan(built), None, backend=xb)
                made["state"] = made["runner"].shard_scope(initial)
            made["runner"].run(made["state"], feed, 0)
            xb.synchronize()

        yield built.program, run, train
