"""Communication cost model: alpha-beta formulas for ring collectives and p2p.

All formulas are *per process* on a group of ``n`` processes connected as a ring, with
``B`` (``nbytes``) the size of one process's local buffer defined per kind as below.
The bytes are the plan contract's formula (:func:`distgraph.plan.kinds.collective_bytes`),
which the reshard planner and the communicators' byte counters both use, so a plan's
bytes equal what the runtime counts.

=============== ====================================== =============================== ============================
kind            B is                                   bytes sent per process          time
=============== ====================================== =============================== ============================
all_gather      the gathered (output) local buffer     (n-1)/n * B                     a(n-1) + (n-1)/n * B/bw
reduce_scatter  the input local buffer                 (n-1)/n * B                     a(n-1) + (n-1)/n * B/bw
all_reduce      the local buffer                       2 (n-1)/n * B                   2 a(n-1) + 2 (n-1)/n * B/bw
all_to_all      the local buffer (input = output size) (n-1)/n * B                     a(n-1) + (n-1)/n * B/bw
send_recv (p2p) the message                            B                               a + B/bw
=============== ====================================== =============================== ============================

all_to_all is modelled as n-1 rounds in which each process sends one of its n chunks
(B/n bytes) to a different peer: (n-1)/n * B bytes and n-1 latencies. The DESIGN's
"(n-1)/n^2" form is the same thing written with B the sum of all n local buffers.
Local steps (``slice``, ``make_partial``) cost nothing.

Every time above is ``alpha x messages + bytes / bw``: :func:`ring_load` gives the
messages and bytes one process sends in a step of a kind (the latency count and the
bytes column), :func:`link_rates` the seconds per message and per byte of a link. The
cost model prices a step with both on its group's ring
(:class:`~distgraph.passes.cost.prices.Rings`); the rank mapper spreads each process's
load over the peers it sends to and prices every pair on its own link with the same two
functions (:mod:`distgraph.passes.mapping.process_graph`).

The ring is what NCCL runs on GPUs. MPI (the CPU runtime) runs other algorithms, whose
bytes per process are the same but which send other shares of them across machines:
:func:`mpi_cut` counts the bytes on the busiest direction between two machines, as
MPICH sends them, and :class:`Cuts` scales the ring's slowest hop by them
(:meth:`~distgraph.passes.cost.prices.Ring.seconds`).

An op that pipelines its collectives with its compute in K identical slices (MeshSlice)
takes :func:`pipeline_time`: each slice passes stages that use different resources (the
links of one mesh dim, the processor, the links of the other), so slice k's compute
overlaps slice k+1's incoming collectives and slice k-1's outgoing ones; the first
slice's collectives (the prologue) and the last one's compute and collectives (the
epilogue) are not hidden.

Example::

    >>> collective_bytes("all_gather", 4, 4096)     # 4 x 1 KiB pieces -> 4 KiB output
    3072.0
    >>> ring_load("all_reduce", 4, 4096)             # 2(n-1) messages, 2 (n-1)/n * B bytes
    (6, 6144.0)
    >>> round(collective_time("all_reduce", 2, 1e9, bandwidth_GBps=100, latency_us=5), 6)
    0.01001
    >>> pipeline_time(4, [2.0, 3.0, 1.0])      # 2 + 3 + 1 + 3 x max
    15.0
"""

from __future__ import annotations

import math
from typing import NamedTuple

from distgraph.errors import PlanError
from distgraph.plan.kinds import COLLECTIVES, StepKind, collective_bytes  # noqa: F401


def comm_bytes(collectives) -> float:
    """Bytes one process sends for ``((kind, n, nbytes), ...)``, e.g. an op strategy's
    ``comm``."""
    return float(sum(collective_bytes(kind, n, nbytes) for kind, n, nbytes in collectives))


def ring_load(kind, n: int, nbytes: float) -> tuple[int, float]:
    """(messages, bytes) one process sends in a step of ``kind`` over ``n`` processes
    with buffer ``nbytes`` (module table): the ring's rounds, 2(n-1) for all_reduce and
    n-1 for the other collectives (all_to_all: one message to each peer), one message for
    send_recv, none for a local step or a group of one."""
    kind = StepKind.parse(kind)
    sent = collective_bytes(kind, n, nbytes)
    if kind is StepKind.SEND_RECV:
        return 1, sent
    if kind.is_local or n == 1:
        return 0, 0.0
    return (2 * (n - 1) if kind is StepKind.ALL_REDUCE else n - 1), sent


def link_rates(bandwidth_GBps, latency_us):
    """(seconds per message, seconds per byte) of a link of ``bandwidth_GBps`` GB/s
    (1e9 bytes/s) and ``latency_us`` µs: alpha and beta. Elementwise on numpy arrays
    (the rank mapper's device-pair matrices)."""
    return latency_us * 1e-6, 1.0 / (bandwidth_GBps * 1e9)


def collective_time(kind, n: int, nbytes: float, bandwidth_GBps: float,
                    latency_us: float) -> float:
    """Seconds for ``kind`` over ``n`` processes: alpha-beta on a ring (module table),
    ``alpha x messages + beta x bytes`` of :func:`ring_load` and :func:`link_rates`.

    ``bandwidth_GBps`` is the per-link bandwidth in GB/s (1e9 bytes/s) and
    ``latency_us`` the per-message latency in microseconds.
    """
    kind = StepKind.parse(kind)
    if bandwidth_GBps <= 0:
        raise PlanError(f"{kind}: bandwidth must be positive, got {bandwidth_GBps} GB/s")
    messages, sent = ring_load(kind, n, nbytes)
    alpha, beta = link_rates(bandwidth_GBps, latency_us)
    return alpha * messages + beta * sent


def tree_all_reduce_time(n: int, nbytes: float, bandwidth_GBps: float,
                         latency_us: float) -> float:
    """Seconds of an all-reduce over ``n`` processes on NCCL's double binary tree, which
    NCCL runs between machines where it is faster than the ring (its tuner compares
    both): the reduction up a tree of depth ``ceil(log2 n)`` and the broadcast down it,
    ``2 ceil(log2 n)`` latencies, each process sending and receiving the buffer about
    twice (``2 B / bw``, the ring's ``2 (n-1)/n B / bw`` without the discount). A ring of
    32 GPUs over 4 machines pays 62 latencies of its slowest hop; the tree 10, so a
    small gradient's all-reduce costs a sixth."""
    alpha, beta = link_rates(bandwidth_GBps, latency_us)
    return alpha * 2 * math.ceil(math.log2(n)) + beta * 2 * nbytes if n > 1 else 0.0


# MPICH's switch points for the nonblocking collectives the CPU runtime calls (bytes of
# the module table's B): an all-reduce of at most SHORT_ALL_REDUCE runs recursive
# doubling, a longer one Rabenseifner's; an all-gather below LONG_ALL_GATHER recursive
# doubling, a longer one the ring (:func:`mpi_cut`)
SHORT_ALL_REDUCE = 2048
LONG_ALL_GATHER = 512 * 1024


def mpi_cut(kind, machines, nbytes: float) -> float:
    """Bytes the busiest direction between two machines carries while MPICH (the
    ``mpich`` wheel the CPU runtime uses) runs a collective of ``kind`` on a buffer of
    ``nbytes`` (the module table's B) over a group whose members, in communicator order,
    run on ``machines`` (a machine id each), as the runtime calls it (nonblocking). Each
    step's pairs send at once, the steps one after another:

    - all-reduce: Rabenseifner's, a reduce-scatter by recursive halving then an
      all-gather by recursive doubling, nearest partner first: step j exchanges
      B / 2^(j+1) with the member 2^j away, so the steps that cross machines carry the
      smallest pieces (two machines of two: B per direction, the ring 1.5 B). At most
      ``SHORT_ALL_REDUCE`` bytes: recursive doubling, the whole B at every step.
    - reduce-scatter (``Ireduce_scatter_block``): pairwise exchange, n - 1 steps in
      which member q sends its B / n for member q + i (two of two: B, the ring 0.75 B).
    - all-gather: below ``LONG_ALL_GATHER``, recursive doubling, nearest first, the
      pieces doubling (the last, largest steps cross); else the ring.
    - a group whose size is not a power of two (MPICH folds the extra members in
      first), and any other kind: the ring (:func:`ring_cut`).

    Measured on the emulated 2 x 2 cluster (1 Gbit/s between the machines, 2026-11-28),
    seconds over the ring's wire seconds, 64 KiB to 8 MiB: all-reduce 0.66-0.78 (this
    count: 0.67), reduce-scatter 1.21-1.42 (1.33), all-gather 1.31 at 256 KiB (1.33),
    0.95-1.06 from 1 MiB (1); the bytes a machine sends are ``tests/test_mpi_cuts.py``'s.

    >>> two_by_two = (0, 0, 1, 1)
    >>> mpi_cut("all_reduce", two_by_two, 1e6), ring_cut("all_reduce", two_by_two, 1e6)
    (1000000.0, 1500000.0)
    """
    kind = StepKind.parse(kind)
    n = len(machines)
    if n & (n - 1) or kind not in (StepKind.ALL_REDUCE, StepKind.REDUCE_SCATTER,
                                   StepKind.ALL_GATHER):
        return ring_cut(kind, machines, nbytes)
    halving = [1 << j for j in range(n.bit_length() - 1)]      # partners' distances
    if kind is StepKind.ALL_REDUCE and nbytes <= SHORT_ALL_REDUCE:
        steps = [[(q, q ^ d, 1.0) for q in range(n)] for d in halving]
    elif kind is StepKind.ALL_REDUCE:      # the halving's steps, then the same mirrored
        steps = 2 * [[(q, q ^ d, 1 / (2 * d)) for q in range(n)] for d in halving]
    elif kind is StepKind.REDUCE_SCATTER:
        steps = [[(q, (q + i) % n, 1 / n) for q in range(n)] for i in range(1, n)]
    elif nbytes < LONG_ALL_GATHER:
        steps = [[(q, q ^ d, d / n) for q in range(n)] for d in halving]
    else:
        return ring_cut(kind, machines, nbytes)
    return _busiest(steps, machines) * nbytes


def ring_cut(kind, machines, nbytes: float) -> float:
    """Bytes the busiest direction between two machines carries while the ring of the
    cost model runs a collective of ``kind`` (:func:`ring_load`'s bytes, sent by every
    member to the next; an all-reduce in its two passes) over members on ``machines``."""
    kind = StepKind.parse(kind)
    n = len(machines)
    _, sent = ring_load(kind, n, nbytes)
    return _busiest([[(q, (q + 1) % n, sent / nbytes if nbytes else 0.0)
                      for q in range(n)]], machines) * nbytes


def _busiest(steps, machines) -> float:
    """The share of B the busiest direction between two machines carries over ``steps``
    (each a list of (sender, receiver, share of B) sent at once), step after step."""
    total = 0.0
    for step in steps:
        load: dict = {}
        for src, dst, share in step:
            a, b = machines[src], machines[dst]
            if a != b:
                load[a, b] = load.get((a, b), 0.0) + share
        total += max(load.values(), default=0.0)
    return total


class Cuts(NamedTuple):
    """:func:`mpi_cut` over :func:`ring_cut` of one group, by kind and size: what scales
    the ring's bytes on its slowest hop into MPI's (:func:`mpi_cuts`)."""

    all_reduce: float
    all_reduce_short: float
    reduce_scatter: float
    all_gather_short: float

    def ratio(self, kind, nbytes: float) -> float:
        """The ratio for a step of ``kind`` on a buffer of ``nbytes``; 1 for the kinds
        MPI sends as the ring does."""
        kind = StepKind.parse(kind)
        if kind is StepKind.ALL_REDUCE:
            return self.all_reduce_short if nbytes <= SHORT_ALL_REDUCE else self.all_reduce
        if kind is StepKind.REDUCE_SCATTER:
            return self.reduce_scatter
        if kind is StepKind.ALL_GATHER and nbytes < LONG_ALL_GATHER:
            return self.all_gather_short
        return 1.0


def mpi_cuts(machines) -> Cuts | None:
    """:class:`Cuts` of a group of CPU processes on ``machines`` (:func:`mpi_cut`); None
    where MPI sends the ring's bytes: a group on one machine (every pair one speed, and
    every algorithm sends the ring's bytes per process), of a size not a power of two,
    or whose every algorithm sends what the ring does (a pair).

    >>> mpi_cuts((0, 0, 1, 1))
    Cuts(all_reduce=0.6666666666666666, all_reduce_short=1.3333333333333333, \
reduce_scatter=1.3333333333333333, all_gather_short=1.3333333333333333)
    >>> mpi_cuts((0, 0, 0, 0)) is None, mpi_cuts((0, 1, 2)) is None, mpi_cuts((0, 1)) is None
    (True, True, True)
    """
    n = len(machines)
    if len(set(machines)) < 2 or n & (n - 1):
        return None

    def ratio(kind, nbytes):
        return mpi_cut(kind, machines, nbytes) / ring_cut(kind, machines, nbytes)

    cuts = Cuts(ratio(StepKind.ALL_REDUCE, SHORT_ALL_REDUCE + 1.0),
                ratio(StepKind.ALL_REDUCE, SHORT_ALL_REDUCE),
                ratio(StepKind.REDUCE_SCATTER, 1.0),
                ratio(StepKind.ALL_GATHER, 1.0))
    return None if set(cuts) == {1.0} else cuts


def pipeline_time(slices: int, stages) -> float:
    """Seconds for ``slices`` identical items through a pipeline of ``stages`` (seconds
    per item in each stage, each stage its own resource): the first item passes every
    stage, then one item leaves every ``max(stages)`` seconds."""
    if slices < 1:
        raise PlanError(f"a pipeline of {slices} slices: it has at least one")
    stages = [float(t) for t in stages]
    return sum(stages) + (slices - 1) * max(stages, default=0.0)
