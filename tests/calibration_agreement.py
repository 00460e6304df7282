"""Two calibrations of one machine compared figure by figure, as the cost model prices
with each figure: what tests/test_calibrate_agreement.py asserts of two runs in a row.

A figure that is a rate or a time (GFLOP/s, memory bandwidth, launch cost, a link's
bandwidth and latency, the all-reduce's) is compared as it is. A figure that the cost
model prices together with another (an op type's µs per call and ns per unit of work, a
reshard step kind's µs per step and ns per byte, the GEMM curve's tile, fill and reuse)
is compared by the seconds the model gives with it at the sizes the calibration
measured it on: two fits of one set of timings can trade a µs per call for ns per unit
and price every measured size alike, and it is the price that a plan reads."""

from __future__ import annotations

from distgraph.passes.cost.compute import gemm_seconds
from distgraph.passes.cost.prices import software_time
from distgraph.registry import CAST_COSTS, TensorType, op_work
from distgraph.tools.device_probe import CAST_SIZES, _probe_programs
from distgraph.tools.gemm_probe import CPU_SHAPES
from distgraph.tools.step_probe import RESHARD_BYTES


def _differs(a: float, b: float, within: float) -> bool:
    return abs(a - b) > within * max(abs(a), abs(b))


def op_works() -> dict:
    """{op type: [units of work of each op of that type in the probe programs]}, and
    for each cast the probe times, the elements it casts."""
    out: dict = {}
    for program, _, _ in _probe_programs():
        for op in program.ops:
            out.setdefault(op.type, []).append(op_work(
                op.type, [TensorType(v.shape, v.dtype) for v in op.inputs],
                [TensorType(v.shape, v.dtype) for v in op.outputs], op.attrs))
    out.update({key: list(CAST_SIZES) for key in CAST_COSTS})    # elements cast
    return out


def disagreements(first, second, within: float) -> tuple:
    """([what differs by more than ``within``, in words], how many figures were
    compared) between clusters ``first`` and ``second`` (module docstring)."""
    bad, count = [], 0

    def check(name, a, b):
        nonlocal count
        count += 1
        if _differs(a, b, within):
            bad.append(f"{name}: {a:.4g} vs {b:.4g} ({abs(a - b) / max(abs(a), abs(b)):.0%})")

    works = op_works()
    for d, e in zip(first.devices, second.devices):
        where = f"device {d.global_id}"
        for dtype in d.gflops:
            check(f"{where} gflops {dtype}", d.gflops[dtype], e.gflops[dtype])
        check(f"{where} memory_bandwidth", d.memory_bandwidth, e.memory_bandwidth)
        check(f"{where} op_overhead", d.op_overhead, e.op_overhead)
        if d.overlap_efficiency is not None:
            check(f"{where} overlap_efficiency", d.overlap_efficiency, e.hides)
        if d.gemm is not None:
            for m, n, k in CPU_SHAPES:
                check(f"{where} gemm {m}x{n}x{k}", *(
                    gemm_seconds(1, m, n, k, 4, x.flops("float32"), x.gemm,
                                 x.memory_bandwidth * 1e9) for x in (d, e)))
        for op_type, (a, b) in sorted((d.op_costs or {}).items()):
            other = (e.op_costs or {}).get(op_type, (0.0, 0.0))
            for w in sorted(set(works.get(op_type, ()))):
                check(f"{where} op_costs {op_type} at {w:.3g}", a + b * w * 1e-3,
                      other[0] + other[1] * w * 1e-3)
        for kind in sorted(d.reshard_overhead or {}):
            if kind == "sliced":            # (µs per collective, ns per byte read again)
                for nbytes in (0, 2**20):
                    check(f"{where} sliced at {nbytes} B", *(
                        x.reshard_overhead[kind][0] * 1e-6
                        + x.reshard_overhead[kind][1] * 1e-9 * nbytes for x in (d, e)))
                continue
            for nbytes in RESHARD_BYTES:
                check(f"{where} reshard_overhead {kind} at {nbytes} B", *(
                    software_time(x, kind, nbytes, len(first.devices)) for x in (d, e)))
    for ln, other in zip(first.all_links, second.all_links):
        check(f"link {ln.source}-{ln.target} bandwidth", ln.bandwidth, other.bandwidth)
        check(f"link {ln.source}-{ln.target} latency", ln.latency, other.latency)
    for key in ("allreduce_bus_bandwidth", "allreduce_latency"):
        if key in first.calibration:
            check(key, first.calibration[key], second.calibration[key])
    return bad, count
