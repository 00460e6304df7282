"""What ``distgraph cluster calibrate`` measures of communication steps through distgraph's
runtime: one reshard step of each kind (:func:`measure_reshard_steps`) and an op's
all-to-all with variable counts per pair, MoE's dropless dispatch
(:func:`measure_all_to_allv`), each run between ops as in training and measured as what
it adds to a loop of those ops, the cases in turn, the fastest loops kept
(:func:`steps_cost`). The calibration fits what they cost
beyond their messages' alpha-beta (:func:`distgraph.tools.software_fit.
reshard_overheads`)."""

from __future__ import annotations

import time

import numpy as np

from distgraph.mesh import ProcessMesh
from distgraph.passes.reshard import plan_reshard
from distgraph.placement import DistAttr, ShardSpec
from distgraph.plan.kinds import COLLECTIVES, StepKind
from distgraph.runtime.execution.reshard import apply_reshard

RESHARD_KINDS = (StepKind.SLICE,) + COLLECTIVES     # the kinds one group's step is timed in
# (layout before, partial dims before, layout after) of each kind's step on a mesh dim "x"
STEP_LAYOUTS = {StepKind.SLICE: ([None, None], (), ["x", None]),
                StepKind.ALL_GATHER: (["x", None], (), [None, None]),
                StepKind.ALL_REDUCE: ([None, None], ("x",), [None, None]),
                StepKind.REDUCE_SCATTER: ([None, None], ("x",), ["x", None]),
                StepKind.ALL_TO_ALL: (["x", None], (), [None, "x"])}
# (and send_recv, between two halves of the ranks: measure_reshard_steps)
# global bytes of the tensors each reshard step kind is timed on: the per-step cost shows
# on the smallest, the per-byte cost (the runtime's copies) on the others
RESHARD_BYTES = (4 * 2**10, 64 * 2**10, 1 * 2**20)
RESHARD_ITERS = 20
BETWEEN_BYTES = 2**18      # per array of the work run between two timed steps
BETWEEN_GEMM = 256          # the side of the GEMM run between two timed steps: an op


def between_steps(arrays) -> None:
    """What a rank does between two communication steps of a training step, the same on
    every rank: an op or two, here an elementwise add over ``BETWEEN_BYTES`` arrays and a
    GEMM of side ``BETWEEN_GEMM`` (a fraction of a millisecond, as an op of a small
    model's layer). They take the caches from the runtime's code and data."""
    a, b, c, m = arrays
    np.add(a, b, out=c)
    m @ m


def between_arrays() -> tuple:
    """The arrays :func:`between_steps` works on."""
    return (np.ones(BETWEEN_BYTES // 8), np.ones(BETWEEN_BYTES // 8),
            np.empty(BETWEEN_BYTES // 8), np.ones((BETWEEN_GEMM,) * 2, np.float32))


def steps_cost(comm, cases, repeats: int, iters: int = RESHARD_ITERS) -> list:
    """[seconds] each case's step adds to a loop of its work, as a training step pays it.
    ``cases``: (``work``, ``step``) pairs. A round times, for each case in turn, a loop
    of ``iters`` x ``work()`` and one of ``iters`` x (``work()``, then ``step`` on what
    it returned), each whole on every rank from a common start and taken at its slowest
    rank; ``repeats`` rounds after one that warms up. The fastest loop of each kind, their
    difference per iteration.

    The difference, not the step timed on its own: with more ranks than cores the ranks
    take turns on the cores, and a step timed alone counts the wait for a descheduled
    peer, most of it the peer's turn at its own ``work``, which the cost model already
    prices at the rate the ranks compute at while sharing the cores. What the turns cost
    both loops cancels; what the step adds stays: its calls, copies and messages, and
    the wait for the group to meet that the work alone would not have had. The fastest
    loops, and the cases in turn: a spell of other processes' load on the machine slows
    few rounds of any one case."""
    best = [[np.inf, np.inf] for _ in cases]
    for batch in range(repeats + 1):           # batch 0 warms up
        for k, (work, step) in enumerate(cases):
            for stepping in (False, True):
                idle_barrier(comm)
                start = time.perf_counter()
                for _ in range(iters):
                    made = work()
                    if stepping:
                        step(made)
                    del made
                seconds = comm.allreduce(time.perf_counter() - start, op=_mpi_max())
                if batch:
                    best[k][stepping] = min(best[k][stepping], seconds)
    return [max(stepped - alone, 0.0) / iters for alone, stepped in best]


def idle_barrier(comm, poll: float = 1e-3) -> None:
    """A barrier of all ranks that sleeps between polls instead of spinning (a spinning
    rank would take the core from one that has not arrived yet)."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(poll)


def measure_reshard_steps(comm, repeats: int) -> dict:
    """{step kind: ((buffer bytes, seconds[, group size]), ...)}: what one reshard step
    of each kind through distgraph's runtime, on tensors of :data:`RESHARD_BYTES`,
    adds to a loop of the work of :func:`between_steps` (:func:`steps_cost`; a step in a
    tight loop finds its code and data cached and its peers waiting: in training neither
    holds), the slowest rank's view. A collective runs over all ranks (no group size
    given) and, with 4 ranks or more, an even number, also over groups of 2 (the ranks
    in pairs, every pair at once, as the groups of a mesh dim of size 2 run it: group
    size 2): how its cost grows with its ring's rounds. What a step costs beyond the
    alpha-beta of its messages is
    :func:`~distgraph.tools.software_fit.reshard_overheads`'s fit."""

    # the runtime is what the figure describes; imported at measurement time only
    from distgraph.runtime.comm.mpi import MPICommunicator

    n = comm.Get_size()
    runtime = MPICommunicator(comm)
    work = between_arrays()
    cases, keys = [], []

    def add(kind, mesh, dim, group, nbytes):
        before, partial, after = STEP_LAYOUTS[kind]
        cols = 8 * n
        rows = n * max(8, -(-nbytes // (4 * cols * n)))
        shape = (rows, cols)
        placed = [[dim if d == "x" else None for d in spec] for spec in (before, after)]
        src = DistAttr(mesh, ShardSpec(placed[0], partial=(dim,) if partial else ()))
        steps = plan_reshard(src, DistAttr(mesh, ShardSpec(placed[1])), shape, "float32")
        local = np.ones(src.local_shape(shape), dtype=np.float32)
        cases.append((lambda: between_steps(work),
                      lambda _, steps=steps, local=local:
                      apply_reshard(steps, local, runtime, runtime.rank)))
        keys.append((kind, steps[0].buffer_bytes, group))

    everyone = ProcessMesh(list(range(n)), ["x"])
    for kind in RESHARD_KINDS if n > 1 else (StepKind.SLICE,):
        for nbytes in RESHARD_BYTES:
            add(kind, everyone, "x", None, nbytes)
    if n >= 4 and n % 2 == 0:
        pairs = ProcessMesh(np.arange(n).reshape(n // 2, 2).tolist(), ["x", "y"])
        for kind in COLLECTIVES:
            for nbytes in RESHARD_BYTES:
                add(kind, pairs, "y", 2, nbytes)
    if n > 1:
        # a pipeline's hand-over: the first half of the ranks send a tensor each to the
        # second half (a send_recv between two meshes), the others wait for it
        half = n // 2
        sources = ProcessMesh(list(range(half)), ["x"])
        targets = ProcessMesh(list(range(half, 2 * half)), ["x"])
        for nbytes in RESHARD_BYTES:
            shape = (half * max(8, -(-nbytes // (4 * 8 * half))), 8)
            src = DistAttr(sources, ShardSpec(["x", None]))
            steps = plan_reshard(src, DistAttr(targets, ShardSpec(["x", None])), shape,
                                 "float32")
            local = np.ones(src.local_shape(shape), dtype=np.float32) \
                if runtime.rank < half else None
            cases.append((lambda: between_steps(work),
                          lambda _, steps=steps, local=local:
                          apply_reshard(steps, local, runtime, runtime.rank)))
            keys.append((StepKind.SEND_RECV, steps[0].buffer_bytes, None))
    out: dict = {}
    for (kind, nbytes, group), seconds in zip(keys, steps_cost(comm, cases, repeats)):
        out.setdefault(kind, []).append((nbytes, seconds) + ((group,) if group else ()))
    return out


# the local buffers (the declared expected load) of the variable all-to-all: MoE's
# dispatch sends megabytes (tokens x k rows of the hidden size), where the per-byte cost
# shows
ALL_TO_ALLV_BYTES = (256 * 2**10, 1 * 2**20, 4 * 2**20)
ALL_TO_ALLV_ROW = 2048             # bytes per row: a hidden size of 512 in float32


def uneven_counts(n: int, rows: int) -> np.ndarray:
    """[sender, receiver] rows of an uneven routing in which each sender sends ``rows``
    in all: receiver q of sender r gets a share growing with ``(r + q) % n``."""
    share = 1 + (np.arange(n)[:, None] + np.arange(n)[None, :]) % n
    counts = rows * share // share.sum(axis=1, keepdims=True)
    counts[:, 0] += rows - counts.sum(axis=1)
    return counts.astype(np.int64)


COUNTS_LOCAL_EXPERTS = 2    # the counts exchange's [members, local experts] int64 buffer


def measure_all_to_allv(comm, repeats: int) -> list:
    """[(buffer bytes, seconds)]: the exchanges of MoE's dropless dispatch through the
    runtime over all ranks, as the dispatch runs them: first its counts (a fixed
    all_to_all of a ``[members, COUNTS_LOCAL_EXPERTS]`` int64 buffer, the smallest
    size: the per-step cost of an exchange there, which the dispatch pays once more per
    forward), then ``all_to_allv`` of :func:`uneven_counts` rows of
    :data:`ALL_TO_ALLV_ROW` bytes, a local buffer of each of :data:`ALL_TO_ALLV_BYTES`
    gathered afresh from its rows before each call. What each adds to a loop of the
    work every other step kind is timed after (:func:`between_steps`) and the gathering
    of its buffer (:func:`steps_cost`: the slowest rank's view; the group waits for it
    at every exchange, as the step does).

    The same work as the other kinds', so that their figures are alike: what a step
    adds after a longer stretch of compute is mostly the wait for a peer the cores
    descheduled, which grows with that stretch, and which a step after little work does
    not pay. Measured on the emulated 2 x 2 (4 ranks, 2 cores; 2026-11-29): after an
    expert's GEMM (512 x 512 x 1,024, 16 x this work) the per-step cost came out
    448-1,303 µs in three calibrations, and moe_ep's step was priced 55.8 ms against
    43.1 measured (+29.5%; its 131 kB all_to_allv took 1.3-1.6 ms, median by rank, with
    its wire's 1 ms, where the figures priced 3.0 ms); after this work 30-77 µs in
    three, and ``bench/cost_model_check.py --matrix`` gave moe_ep -6.1% to +0.1%."""
    from distgraph.runtime.comm.mpi import MPICommunicator

    n, rank = comm.Get_size(), comm.Get_rank()
    runtime = MPICommunicator(comm)
    group = tuple(range(n))
    between = between_arrays()
    width = ALL_TO_ALLV_ROW // 4
    rng = np.random.default_rng(rank)
    counts = np.ones((n, COUNTS_LOCAL_EXPERTS), np.int64)
    cases = [(counts.nbytes, lambda: counts.copy(),
              lambda buf: runtime.all_to_all(buf, group, 0, 0))]
    for nbytes in ALL_TO_ALLV_BYTES:
        rows = uneven_counts(n, nbytes // ALL_TO_ALLV_ROW)
        send, recv = rows[rank], rows[:, rank]
        source = np.ones((int(send.sum()), width), np.float32)
        order = rng.permutation(len(source))
        cases.append((nbytes, lambda source=source, order=order: source[order],
                      lambda buf, send=send, recv=recv: runtime.all_to_allv(buf, send, recv,
                                                                            group)))

    def work(make):
        between_steps(between)
        return make()                         # made afresh, as the dispatch sends

    timed = steps_cost(comm, [(lambda make=make: work(make), exchange)
                              for _, make, exchange in cases], repeats)
    return [(nbytes, seconds) for (nbytes, _, _), seconds in zip(cases, timed)]


def _mpi_max():
    from mpi4py import MPI
    return MPI.MAX
