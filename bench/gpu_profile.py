"""Where a GPT training step's time goes on one GPU, op type by op type.

    python bench/gpu_profile.py [--amp] [--layers 12 --d-model 768 ...] [--top 25]
                                [--cluster FILE] [--detail OP_TYPE]

The model and batch are bench/gpu_step.py's (GPT-2 small, seq 1024, batch 8). The step's
local program (its plan on ``Cluster.local(1, device="GPU")``, or on ``--cluster``'s GPU:
a file ``distgraph cluster calibrate`` wrote) is run by the executor on
CuPy three ways after two warm-up steps: plain (the step's wall time, the GPU synchronised
at its end); with the host's seconds per op (no synchronisation: what Python and the
launches cost); and with each op synchronised (the GPU's seconds per op, launches
included). Prints the three step times and, per op type, calls and the milliseconds of
each way, the most costly first, beside the cost model's (its ``op_time`` of each call on
the plan's device: where a prediction of the step goes wrong); ``--detail OP_TYPE`` lists
one type's calls by operands. On numpy (``--numpy``) it profiles the CPU instead.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict

import numpy as np

import distgraph as dg
from distgraph.passes.cost.prices import op_time
from distgraph.program_builder import build_program
from distgraph.registry import TensorType
from distgraph.runtime.backend import NUMPY, get_backend
from distgraph.runtime.execution.executor import ProgramRunner
from distgraph.runtime.execution.runner import PlanRunner
from gpu_step import model_arguments


def local_step(args, backend):
    """(runner of the step's local program, its scope, its feed, the plan's device)."""
    dg.set_default_dtype("float32")
    dg.seed(0)
    model = dg.nn.GPT(vocab_size=args.vocab, d_model=args.d_model, n_layer=args.layers,
                      n_head=args.heads, max_seq_len=args.seq)
    opt = dg.optim.AdamW(1e-4)
    ids = [dg.InputSpec([args.batch, args.seq], "int64", name="x")]
    labels = [dg.InputSpec([args.batch, args.seq], "int64", name="y")]
    amp = "bfloat16" if args.amp else None
    built = build_program(model, ids, labels, dg.nn.CrossEntropyLoss(), opt, amp=amp)
    device = "GPU" if backend is not NUMPY else "CPU"
    strategy = dg.Strategy(amp=amp) if amp else dg.Strategy()
    cluster = (dg.Cluster.from_file(args.cluster) if args.cluster
               else dg.Cluster.local(1, device=device))
    plan = dg.passes.plan(built, strategy, cluster)
    values = {n: p.numpy() for n, p in model.named_parameters()}
    scope = PlanRunner(plan, None, backend).shard_scope(
        {**values, **opt.initial_state(built.program)})
    local = plan.local(0)
    program = local.program
    rng = np.random.default_rng(0)
    feed = {name: backend.from_host(rng.integers(0, args.vocab, (args.batch, args.seq)))
            for name in ("x", "y")}
    return (ProgramRunner(program, backend.xp, op_context=local.op_context), scope, feed,
            cluster.devices[0])


def predicted_seconds(program, device) -> list:
    """The cost model's seconds of each op of a one-process ``program`` on ``device``."""
    def types(vs):
        return [TensorType(v.shape, v.dtype) for v in vs]

    return [op_time(op.type, types(op.inputs), types(op.outputs), op.attrs, device)
            for op in program.ops]


def gemm_rates(xp, sync, n=8192) -> str:
    """TFLOP/s of an n^3 matmul of random operands per dtype on ``xp`` (or why not)."""
    import ml_dtypes

    out = []
    for name, dtype in (("float32", np.float32), ("float16", np.float16),
                        ("bfloat16", ml_dtypes.bfloat16)):
        try:
            a = xp.asarray(np.random.default_rng(0).standard_normal((n, n)).astype(dtype))
            a @ a
            sync()
            start = time.perf_counter()
            for _ in range(5):
                a @ a
            sync()
            out.append(f"{name} {2 * n ** 3 * 5 / (time.perf_counter() - start) / 1e12:.0f}")
        except Exception as e:        # noqa: BLE001  (what the backend cannot do is said)
            out.append(f"{name}: {type(e).__name__}: {str(e)[:80]}")
    return "; ".join(out)


def tally(keys, host, synced, predicted) -> dict:
    """{key: [calls, host s, synchronised s, the model's s]} of the ops, each under its key."""
    rows = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for key, *seconds in zip(keys, host, synced, predicted):
        row = rows[key]
        row[0] += 1
        for i, t in enumerate(seconds, 1):
            row[i] += t
    return rows


def signature(op) -> str:
    """An op's operands (shape and dtype) and its attributes other than arrays, in one
    line."""
    ins = " x ".join(f"{v.dtype}{list(v.shape)}" for v in op.inputs)
    attrs = {k: v for k, v in op.attrs.items() if isinstance(v, (bool, int, float, str))}
    return f"{ins} -> {op.outputs[0].dtype} {attrs}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(parser)
    parser.add_argument("--amp", action="store_true", help="Strategy(amp='bfloat16')")
    parser.add_argument("--numpy", action="store_true", help="profile on the CPU")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--detail", metavar="OP_TYPE", action="append", default=[],
                        help="also list this op type's calls by operand shapes, dtypes and "
                             "attributes (repeatable)")
    parser.add_argument("--cluster", metavar="FILE",
                        help="plan on this resource file's device (bench/gpu_step.py's)")
    args = parser.parse_args(argv)
    if args.cluster:
        kinds = {d.type for d in dg.Cluster.from_file(args.cluster).devices}
        if kinds != {"CPU" if args.numpy else "GPU"}:
            parser.error(f"--cluster {args.cluster}: its devices are {sorted(kinds)}; this "
                         f"profile runs on {'the CPU' if args.numpy else 'a GPU'}")
    backend = NUMPY if args.numpy else get_backend("cupy")
    if not args.numpy:
        print(f"gpu_profile: matmul TFLOP/s: {gemm_rates(backend.xp, backend.synchronize)}")
    runner, scope, feed, device = local_step(args, backend)
    types = [op.type for op in runner.program.ops]
    predicted = predicted_seconds(runner.program, device)
    for step in range(2):
        runner.run(scope, feed, (), step=step)
    backend.synchronize()
    start = time.perf_counter()
    runner.run(scope, feed, (), step=2)
    backend.synchronize()
    wall = time.perf_counter() - start
    host, synced = [], []
    runner.run(scope, feed, (), step=3, timings=host)
    backend.synchronize()
    runner.run(scope, feed, (), step=4, timings=synced, device_sync=backend.synchronize)
    rows = tally(types, host, synced, predicted)
    print(f"gpu_profile: GPT {args.layers} layers, d_model {args.d_model}, seq {args.seq}, "
          f"batch {args.batch}, {'amp bf16' if args.amp else 'fp32'} on {backend!r}: "
          f"{len(types)} ops")
    print(f"  step {wall * 1e3:.1f} ms; host's seconds per op summed {sum(host) * 1e3:.1f} ms; "
          f"each op synchronised {sum(synced) * 1e3:.1f} ms; the cost model's ops "
          f"{sum(predicted) * 1e3:.1f} ms on {device.model or device.type}")
    print(f"  {'op type':28} {'calls':>6} {'host ms':>9} {'synced ms':>10} {'model ms':>9}")
    for t, (n, h, d, p) in sorted(rows.items(), key=lambda r: -r[1][2])[:args.top]:
        print(f"  {t:28} {n:6d} {h * 1e3:9.2f} {d * 1e3:10.2f} {p * 1e3:9.2f}")
    for kind in args.detail:
        rows = tally([signature(op) if op.type == kind else None for op in runner.program.ops],
                     host, synced, predicted)
        rows.pop(None, None)
        print(f"  {kind}, by operands and attributes:" if rows else
              f"  {kind}: no calls in this step")
        for sig, (n, h, d, p) in sorted(rows.items(), key=lambda r: -r[1][2]):
            print(f"    {n:4d} calls {h * 1e3:8.2f} {d * 1e3:9.2f} {p * 1e3:8.2f} ms  {sig}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
