"""What a communication step costs beyond its messages, fitted from what
:mod:`distgraph.tools.step_probe` timed (``distgraph cluster calibrate``): each step kind's
µs per step and ns per byte, the µs of each further ring round (``ring_round``) and the
``sliced`` entry of MeshSlice's pipeline (:func:`reshard_overheads`), a device's
``reshard_overhead``.

Example::

    overheads = reshard_overheads(cluster, measure_reshard_steps(comm, 3))
"""

from __future__ import annotations

import dataclasses

import numpy as np

from distgraph.mesh import ProcessMesh
from distgraph.placement import DistAttr, ShardSpec
from distgraph.plan.kinds import ALL_TO_ALLV, RING_ROUND, StepKind

TINY_BYTES = 1024        # a step on fewer bytes measures its per-step cost alone
SLICED_SLICES = 8        # the sliced GeMM of measure_sliced_gemm runs at K = 1 and K = 8


def sliced_problem(n: int, slices: int) -> tuple:
    """(LocalMeshSlice, [local x shape, local y shape], mesh) of the tiny GeMM
    :func:`~distgraph.tools.calibrate.measure_sliced_gemm` times: output stationary on a
    1 x ``n`` mesh, x gathered over all ``n`` ranks."""
    from distgraph.ops.meshslice import local_form
    from distgraph.spmd.meshslice import SliceLayout, MatmulAxes

    shapes = [(8 * n, 8 * SLICED_SLICES * n), (8 * SLICED_SLICES * n, 8 * n)]
    lay, axes = SliceLayout("OS", "x", "y"), MatmulAxes.of(shapes, {})
    local = local_form(lay, axes, shapes, {"x": 1, "y": n}, slices)
    mesh = ProcessMesh([list(range(n))], ["x", "y"])
    return local, [DistAttr(mesh, ShardSpec(spec.dims)).local_shape(shape)
                   for spec, shape in zip(lay.specs(axes, shapes)[:2], shapes)], mesh


def reshard_overheads(cluster, steps: dict, sliced: dict | None = None,
                      partial: list | None = None) -> dict:
    """{step kind: (µs per step, ns per byte of its buffer)}: what a step costs beyond
    the alpha-beta of the links its messages take (what :func:`measure_reshard_steps`
    measured, less the cost model's charge), fitted by least squares (both >= 0) over
    the buffer sizes measured; one size alone gives the µs per step, and a size under
    :data:`TINY_BYTES` (the counts' exchange of MoE's dispatch, measured with the
    ``all_to_allv`` sizes) gives it beside larger ones, which then give the ns per byte.

    The µs are a 2-process step's; a collective over n processes has n - 1 rounds
    (:func:`~distgraph.passes.cost.prices.software_rounds`). Where collectives were
    measured over groups of 2 and of all ranks (an entry's third figure is its group
    size; none: every rank), one least-squares fit of all of them gives each kind's µs
    and ns and, shared by the kinds, the µs each further round adds (the ``ring_round``
    entry, :data:`~distgraph.plan.kinds.RING_ROUND`); the other steps' timings are then
    taken less those rounds. Otherwise a collective over all n ranks paid the µs at
    each of its rounds (:func:`~distgraph.passes.cost.prices.software_time` without the
    entry). With ``sliced`` (the times of
    :func:`~distgraph.tools.calibrate.measure_sliced_gemm`), also ``sliced``: what one
    collective of a sliced pipeline costs per step beyond the model's charge
    (:func:`sliced_overhead`), and with ``partial``
    (:func:`~distgraph.tools.calibrate.measure_partial_gemms`) what a byte a partial GeMM
    reads again costs: the least-squares slope of the seconds over the bytes (0 where
    not positive: the model then prices such bytes at the memory bandwidth)."""
    from scipy.optimize import nnls

    from distgraph.passes.cost.prices import Rings, software_rounds

    ids = [d.global_id for d in cluster.devices]
    n = len(ids)
    rings = Rings(cluster, ids.__getitem__)
    whole = rings.along(ProcessMesh(list(range(n)), ["x"]), 0, "x")
    rows = {}      # name: [(rounds, bytes, seconds beyond the wire)]
    for name, measured in steps.items():
        kind = StepKind.parse(name)            # all_to_allv: all_to_all's formula
        for entry in measured:
            b, t, g = entry if len(entry) > 2 else (*entry, n)
            ring = whole if g == n else rings.along(
                ProcessMesh(np.arange(n).reshape(n // g, g).tolist(), ["x", "y"]), 0, "y")
            rows.setdefault(name, []).append(
                (software_rounds(kind, g), float(b), max(t - _wire(kind, g, b, ring), 0.0)))
    joint = [name for name, r in rows.items() if len({k for k, _, _ in r}) > 1]
    out, per_round = {}, None
    if joint:
        # unknowns: each joint kind's seconds per step and per MiB, then the seconds of
        # a further round (columns of like scale for the solver)
        width = 2 * len(joint) + 1
        matrix, beyond = [], []
        for j, name in enumerate(joint):
            for k, b, t in rows.pop(name):
                row = np.zeros(width)
                row[2 * j], row[2 * j + 1], row[-1] = 1.0, b / 2**20, k - 1
                matrix.append(row)
                beyond.append(t)
        solution, _ = nnls(np.array(matrix), np.array(beyond))
        per_round = float(solution[-1])
        for j, name in enumerate(joint):
            out[name] = (round(float(solution[2 * j]) * 1e6, 3),
                         round(float(solution[2 * j + 1]) / 2**20 * 1e9, 6))
        out[RING_ROUND] = (round(per_round * 1e6, 3), 0.0)
    for name, measured in rows.items():
        rounds = {k for k, _, _ in measured}
        sizes = np.array([b for _, b, _ in measured])
        if per_round is None:
            # every round paid the per-step cost: the figure is a 2-process step's
            beyond = np.array([t for _, _, t in measured])
            per_step, per_byte = _line(sizes, beyond)
            out[name] = (round(per_step / max(rounds) * 1e6, 3), round(per_byte * 1e9, 6))
        else:
            beyond = np.array([max(t - per_round * (k - 1), 0.0) for k, _, t in measured])
            per_step, per_byte = _line(sizes, beyond)
            out[name] = (round(per_step * 1e6, 3), round(per_byte * 1e9, 6))
    out = {(ALL_TO_ALLV if name == ALL_TO_ALLV else StepKind.parse(name).value)
           if name != RING_ROUND else name: v for name, v in out.items()}
    if sliced:
        per_byte = 0.0
        if partial:
            again, seconds = np.array(partial, dtype=float).T
            per_byte = max(float(again @ seconds / (again @ again)), 0.0)
        per_byte = round(per_byte * 1e9, 6)
        out["sliced"] = (round(sliced_overhead(cluster, sliced, out, per_byte) * 1e6, 3),
                         per_byte)
    return out


def _line(sizes, beyond) -> tuple:
    """(seconds per step, seconds per byte) of timings ``beyond`` at buffer ``sizes``
    (:func:`reshard_overheads`): one size gives the seconds per step alone; a size under
    :data:`TINY_BYTES` fixes the per-step cost beside larger ones, which give the slope
    (a line through all of them would lift the intercept where the software's cost per
    byte is not linear: MoE's counts); else a least-squares line, both >= 0."""
    from scipy.optimize import nnls

    if sizes.max() == sizes.min():
        return float(np.median(beyond)), 0.0
    if sizes.min() < TINY_BYTES and (sizes >= TINY_BYTES).any():
        tiny = sizes < TINY_BYTES
        per_step = float(np.median(beyond[tiny]))
        extra = sizes[~tiny] - sizes[tiny].mean()
        return per_step, max(float(extra @ (beyond[~tiny] - per_step) / (extra @ extra)), 0.0)
    mib = sizes / 2**20            # columns of like scale for the solver
    (per_step, per_mib), _ = nnls(np.stack([np.ones_like(mib), mib], axis=1), beyond)
    return float(per_step), float(per_mib) / 2**20


def _wire(kind: StepKind, n: int, nbytes: float, ring) -> float:
    """Seconds the cost model charges a step's messages on ``ring``: a collective's
    alpha-beta, a send_recv's one message (alpha + bytes / bandwidth), a local step
    none."""
    if kind.is_collective:
        return ring.seconds(kind, n, nbytes)
    if kind is StepKind.SEND_RECV:
        return ring.latency * 1e-6 + nbytes / (ring.bandwidth * 1e9)
    return 0.0


def sliced_overhead(cluster, sliced: dict, software: dict, per_byte: float = 0.0) -> float:
    """Seconds per collective of a sliced pipeline beyond the model's charge: the value
    with which :func:`~distgraph.passes.cost.prices.overlap_time` (with the steps' fitted
    ``software`` costs and ``per_byte`` ns a byte read again) prices the tiny GeMM's each
    more slice (K = 1 against ``SLICED_SLICES``) as measured (0 where the model's charge
    alone reaches it), found by bisection (the price grows with it)."""
    from distgraph.ops.meshslice import overlap
    from distgraph.passes.cost.prices import Rings, overlap_time
    from distgraph.registry import TensorType

    ids = [d.global_id for d in cluster.devices]
    device = cluster.device(ids[0])
    rings = Rings(cluster, ids.__getitem__)
    priced = []
    for slices in (1, SLICED_SLICES):
        local, ins, mesh = sliced_problem(len(ids), slices)
        ov = overlap({"meshslice": local}, [TensorType(s, "float32") for s in ins])[0]
        priced.append((ov, lambda dim, mesh=mesh: rings.along(mesh, 0, dim)))

    def gap(seconds):
        dev = dataclasses.replace(device, reshard_overhead={
            **software, "sliced": (seconds * 1e6, per_byte)})
        (one, ring1), (many, ring) = priced
        return (sum(overlap_time(many, dev, ring)) - sum(overlap_time(one, dev, ring1))
                - (sliced[SLICED_SLICES] - sliced[1]))

    low, high = 0.0, max(sliced[SLICED_SLICES] - sliced[1], 0.0)
    if gap(low) >= 0:
        return 0.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if gap(mid) < 0 else (low, mid)
    return (low + high) / 2
