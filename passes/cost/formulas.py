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


def pipeline_time(slices: int, stages) -> float:
    """Seconds for ``slices`` identical items through a pipeline of ``stages`` (seconds
    per item in each stage, each stage its own resource): the first item passes every
    stage, then one item leaves every ``max(stages)`` seconds."""
    if slices < 1:
        raise PlanError(f"a pipeline of {slices} slices: it has at least one")
    stages = [float(t) for t in stages]
    return sum(stages) + (slices - 1) * max(stages, default=0.0)
