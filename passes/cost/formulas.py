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
Local steps (``slice``, ``make_partial``) cost nothing. ``p2p`` (a pipeline stage's
chain, in the rank mapper's traffic) is priced as ``send_recv``.

An op that pipelines its collectives with its compute in K identical slices (MeshSlice)
takes :func:`pipeline_time`: each slice passes stages that use different resources (the
links of one mesh dim, the processor, the links of the other), so slice k's compute
overlaps slice k+1's incoming collectives and slice k-1's outgoing ones; the first
slice's collectives (the prologue) and the last one's compute and collectives (the
epilogue) are not hidden.

Example::

    >>> collective_bytes("all_gather", 4, 4096)     # 4 x 1 KiB pieces -> 4 KiB output
    3072.0
    >>> round(collective_time("all_reduce", 2, 1e9, bandwidth_GBps=100, latency_us=5), 6)
    0.01001
    >>> pipeline_time(4, [2.0, 3.0, 1.0])      # 2 + 3 + 1 + 3 x max
    15.0
"""

from __future__ import annotations

from distgraph.errors import PlanError
from distgraph.plan.kinds import COLLECTIVES, StepKind  # noqa: F401  (the one list)
from distgraph.plan.kinds import collective_bytes as _bytes

P2P = "p2p"


def _kind(kind) -> StepKind:
    return StepKind.SEND_RECV if kind == P2P else StepKind.parse(kind)


def collective_bytes(kind, n: int, nbytes: float) -> float:
    """Bytes one process sends for ``kind`` over ``n`` processes with buffer ``nbytes``
    (the contract's formula; ``p2p`` counts as ``send_recv``)."""
    return _bytes(_kind(kind), n, nbytes)


def comm_bytes(collectives) -> float:
    """Bytes one process sends for ``((kind, n, nbytes), ...)``, e.g. an op strategy's
    ``comm``."""
    return float(sum(collective_bytes(kind, n, nbytes) for kind, n, nbytes in collectives))


def collective_time(kind, n: int, nbytes: float, bandwidth_GBps: float,
                    latency_us: float) -> float:
    """Seconds for ``kind`` over ``n`` processes: alpha-beta on a ring (module table).

    ``bandwidth_GBps`` is the per-link bandwidth in GB/s (1e9 bytes/s) and
    ``latency_us`` the per-message latency in microseconds.
    """
    kind = _kind(kind)
    beta_bytes = collective_bytes(kind, n, nbytes)
    if bandwidth_GBps <= 0:
        raise PlanError(f"{kind}: bandwidth must be positive, got {bandwidth_GBps} GB/s")
    if kind.is_local:
        return 0.0
    alpha = latency_us * 1e-6
    beta_bytes /= bandwidth_GBps * 1e9
    if kind is StepKind.SEND_RECV:
        return alpha + beta_bytes
    if n == 1:
        return 0.0
    rounds = 2 * (n - 1) if kind is StepKind.ALL_REDUCE else n - 1
    return alpha * rounds + beta_bytes


def links_time(step, bandwidth_GBps: float, latency_us: float) -> float:
    """Alpha-beta seconds of a reshard step on one uniform link class; for send_recv,
    the busiest sender's messages in sequence."""
    if step.kind is not StepKind.SEND_RECV:
        return collective_time(step.kind, step.group_size, step.buffer_bytes,
                               bandwidth_GBps, latency_us)
    return (step.messages_of_busiest() * latency_us * 1e-6
            + step.bytes / (bandwidth_GBps * 1e9))


def pipeline_time(slices: int, stages) -> float:
    """Seconds for ``slices`` identical items through a pipeline of ``stages`` (seconds
    per item in each stage, each stage its own resource): the first item passes every
    stage, then one item leaves every ``max(stages)`` seconds."""
    if slices < 1:
        raise PlanError(f"a pipeline of {slices} slices: it has at least one")
    stages = [float(t) for t in stages]
    return sum(stages) + (slices - 1) * max(stages, default=0.0)
