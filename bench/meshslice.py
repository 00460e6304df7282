"""MeshSlice measured: K sliced, overlapped collectives against the collective 2-D GeMM
(K = 1) and 1-D tensor parallelism, the autotuner's predictions against measured times,
and a GPT training step, on an emulated cluster and on plain shared memory.

Run as root for the emulated part (it makes network namespaces)::

    python bench/meshslice.py [--cluster resources/clusters/emulated_2x2.yaml]

The emulated cluster is FILE's 2 machines x 2 ranks, its machine link shaped to 1 Gbit/s;
mesh dim x (the rows) crosses the machines. Each environment is first calibrated
(``distgraph cluster calibrate [--emulate FILE] -n 4``; ``--emulated-calibration`` /
``--local-calibration`` reuse a file) and everything the autotuner predicts comes from
that file. Then, on 4 ranks in each environment:

1. **The GeMM**: fc1 of a transformer layer with hidden 1024 and 2048 tokens (batch 16 x
   sequence 128), fp32: x [2048, 1024] @ W [1024, 4096], sized so that on the emulated
   link the 2x2 mesh's compute and its K = 1 communication are alike (about 90 and 75
   ms here; with half the tokens the communication was 1.6 x the compute, so that no
   pipeline could hide half of it). Every GeMM the autotuner ranks
   for it — forward, backward-data and backward-weight, each in the dataflows of the three
   forward choices, on the meshes 1x4, 2x2 and 4x1, with K in {1, 2, 4, 8} where K divides
   the shard — runs through MeshSlice's kernel (``distgraph.ops.meshslice.run``, the op's
   distributed form), best of ``--repeats`` timings taken in turns. Its compute alone (the
   K = 1 GeMM on the gathered shapes, every rank at once) gives the exposed communication
   (time - compute). 1-D tensor parallelism of the forward GeMM on the same 4 ranks:
   all-gather x's rows then multiply by W's column shard, or multiply x's column shard by
   W's row shard then reduce-scatter the product.
2. **The autotuner** (``dg.passes.meshslice.autotune`` on the calibrated file) against
   those timings: per priced GeMM the prediction and the measurement, the median error,
   and its choice for the layer (mesh, dataflows, each GeMM's K) against the measured
   best.
3. **A GPT training step** (tests/plans.py's 2-D MeshSlice plan: weights [x, y], FC
   layers' activations [x, ..., y], every FC matmul through ``shard_op(...,
   meshslice=...)``) with K chosen by the cost model against the same plan with K = 1.

Timings on this shared 2-core machine are noisy: 4 ranks share 2 cores, and other jobs
may run; figures are as measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import distgraph as dg  # noqa: E402
from distgraph.errors import DistGraphError  # noqa: E402
from distgraph.ops.meshslice import local_form, overlap, run  # noqa: E402
from distgraph.passes.meshslice.autotune import BACKWARD, GEMMS, gemm_shapes  # noqa: E402
from distgraph.placement import DistAttr, ShardSpec  # noqa: E402
from distgraph.registry import KernelContext, TensorType  # noqa: E402
from distgraph.runtime.emulate.launch import launch_emulated  # noqa: E402
from distgraph.runtime.emulate.namespaces import check_prerequisites  # noqa: E402
from distgraph.runtime.launch.launcher import launch  # noqa: E402
from distgraph.spmd.meshslice import SliceLayout, MatmulAxes  # noqa: E402

MODEL = dict(layers=1, hidden=1024, heads=8, seq=128, batch=16)
LAYER = "fc1"
SLICES = (1, 2, 4, 8)
GPT = dict(vocab_size=512, d_model=512, n_layer=2, n_head=8, max_seq_len=64)
GPT_BATCH = 16
JOB_ENV = dict(os.environ, OMP_NUM_THREADS="1")


# ---- on the ranks ------------------------------------------------------------------------------

def mesh_of(shape) -> dg.ProcessMesh:
    return dg.ProcessMesh(np.arange(shape[0] * shape[1]).reshape(shape).tolist(), ["x", "y"])


def gemm_job(cand, comm, rng):
    """(run(), compute_only()) of the autotuner's candidate GemmCost on this rank."""
    tokens = MODEL["batch"] * MODEL["seq"]
    n_in, n_out = MODEL["hidden"], 4 * MODEL["hidden"]
    xs, ys, attrs = gemm_shapes(cand.gemm, tokens, n_in, n_out)
    mesh = mesh_of(cand.mesh)
    lay = SliceLayout(cand.dataflow, *cand.dims)
    axes = MatmulAxes.of([xs, ys], attrs)
    local = local_form(lay, axes, [xs, ys], dict(zip(mesh.dim_names, mesh.shape)), cand.slices)
    sx, sy, _ = lay.specs(axes, [xs, ys])
    x = rng.standard_normal(DistAttr(mesh, ShardSpec(sx.dims)).local_shape(xs)).astype(np.float32)
    y = rng.standard_normal(DistAttr(mesh, ShardSpec(sy.dims)).local_shape(ys)).astype(np.float32)
    ctx = KernelContext(np, comm=comm, groups=(mesh.group_of(comm.rank, lay.u),
                                               mesh.group_of(comm.rank, lay.v)))
    tx, ty = attrs.get("transpose_x", False), attrs.get("transpose_y", False)
    whole = overlap({**attrs, "meshslice": local_form(lay, axes, [xs, ys], dict(zip(
        mesh.dim_names, mesh.shape)), 1)}, [TensorType(x.shape, "float32"),
                                            TensorType(y.shape, "float32")])[0]
    a = rng.standard_normal(whole.ins[0].shape).astype(np.float32)
    b = rng.standard_normal(whole.ins[1].shape).astype(np.float32)
    return (lambda: run(ctx, x, y, tx, ty, local)), (lambda: a.reshape(-1, a.shape[-1]) @ b)


def one_d_jobs(comm, rng):
    """The forward GeMM as 1-D tensor parallelism on all ranks: {name: run()}."""
    tokens, n_in, n_out = MODEL["batch"] * MODEL["seq"], MODEL["hidden"], 4 * MODEL["hidden"]
    n, everyone = comm.size, tuple(range(comm.size))
    x_rows = rng.standard_normal((tokens // n, n_in)).astype(np.float32)
    w_cols = rng.standard_normal((n_in, n_out // n)).astype(np.float32)
    x_cols = rng.standard_normal((tokens, n_in // n)).astype(np.float32)
    w_rows = rng.standard_normal((n_in // n, n_out)).astype(np.float32)
    return {"1-D, all-gather x": lambda: comm.all_gather(x_rows, everyone, 0) @ w_cols,
            "1-D, reduce-scatter y": lambda: comm.reduce_scatter(x_cols @ w_rows, everyone, 1)}


def timed(comm, fn) -> float:
    comm.barrier()
    start = time.perf_counter()
    fn()
    comm.barrier()
    return time.perf_counter() - start


def gemm_part(comm, cluster, repeats: int) -> dict:
    report = dg.passes.meshslice.autotune(**MODEL, cluster=cluster, slices=SLICES,
                                          verbose=False)
    rng = np.random.default_rng(comm.rank)
    cands = [c for c in report.candidates if c.layer == LAYER]
    jobs = [gemm_job(c, comm, rng) for c in cands]
    computes = {}
    for c, (_, compute) in zip(cands, jobs):
        computes.setdefault((c.gemm, c.dataflow, c.dims, c.mesh), compute)
    one_d = one_d_jobs(comm, rng)
    runs = [fn for fn, _ in jobs] + list(computes.values()) + list(one_d.values())
    best = [float("inf")] * len(runs)
    for fn in runs:                       # warm up (and set up the groups)
        timed(comm, fn)
    for _ in range(repeats):              # in turns: a change of load hits all alike
        for i, fn in enumerate(runs):
            best[i] = min(best[i], timed(comm, fn))
    measured = best[:len(cands)]
    compute = dict(zip(computes, best[len(cands):len(cands) + len(computes)]))
    rows = [{"gemm": c.gemm, "dataflow": c.dataflow, "dims": list(c.dims), "mesh": list(c.mesh),
             "slices": c.slices, "predicted": c.total, "predicted_compute": c.compute,
             "predicted_communication": c.communication, "measured": t,
             "compute": compute[(c.gemm, c.dataflow, c.dims, c.mesh)]}
            for c, t in zip(cands, measured)]
    layer = next(lay for lay in report.best.layers if lay[0] == LAYER)
    chosen = {"mesh": list(report.best.mesh), "dataflow": layer[1],
              "gemms": [{"gemm": g.gemm, "dataflow": g.dataflow, "dims": list(g.dims),
                         "slices": g.slices} for g in layer[2]]}
    one_d_times = dict(zip(one_d, best[len(cands) + len(computes):]))
    return {"rows": rows, "chosen": chosen, "one_d": one_d_times, "ranking": str(report)}


def gpt_part(comm, cluster, repeats: int, steps: int) -> dict:
    import plans as P

    out = {}
    engines = {}
    for name, slices in (("meshslice", True), ("K=1", 1)):
        with P.BUILD_LOCK:
            model = P.build_model("gpt", 0, GPT)
            P.meshslice_plan("gpt", 4, slices)(model)
        engine = dg.Engine(model, dg.nn.CrossEntropyLoss(), dg.optim.AdamW(1e-3),
                           cluster=cluster, communicator=comm)
        data = P.Dataset("gpt", n=GPT_BATCH * (steps + 2), dims=GPT, batch=GPT_BATCH)
        engine.fit(data, batch_size=GPT_BATCH, epochs=1, steps_per_epoch=2, verbose=0)
        engines[name] = (engine, data)
        uses = dg.passes.meshslice.uses(engine.plan().program)
        out[name] = {"matmuls": len(uses), "slices": sorted({u.local.slices for u in uses}),
                     "measured": float("inf")}
    for _ in range(repeats):
        for name, (engine, data) in engines.items():
            comm.barrier()
            start = time.perf_counter()
            engine.fit(data, batch_size=GPT_BATCH, epochs=engine.epoch + 1,   # one more
                       steps_per_epoch=steps, verbose=0)
            comm.barrier()
            out[name]["measured"] = min(out[name]["measured"],
                                        (time.perf_counter() - start) / steps)
    return out


def rank_part(args) -> None:
    from distgraph.runtime.comm.mpi import MPICommunicator

    comm = MPICommunicator()
    if comm.size != 4:
        raise dg.PlanError(f"this benchmark runs on 4 ranks, not {comm.size}")
    cluster = dg.Cluster.from_file(args.calibration)
    parts = args.parts.split(",")
    result = {}
    if "gemm" in parts:
        result["gemm"] = gemm_part(comm, cluster, args.repeats)
    if "gpt" in parts:
        result["gpt"] = gpt_part(comm, cluster, args.repeats, args.steps)
    comm.free()
    if comm.rank == 0:
        with open(args.rank_part, "w") as f:
            json.dump(result, f)


# ---- the parent --------------------------------------------------------------------------------

def calibrate(emulate: str | None, out: str) -> None:
    cmd = [sys.executable, "-m", "distgraph.cli", "cluster", "calibrate", "-n", "4", "-o", out]
    if emulate:
        cmd += ["--emulate", emulate]
    subprocess.run(cmd, check=True, env=JOB_ENV, stdout=subprocess.DEVNULL)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default=os.path.join(ROOT, "resources", "clusters",
                                                          "emulated_2x2.yaml"),
                        help="the emulated cluster: 2 machines of 2 devices")
    parser.add_argument("--emulated-calibration", help="a calibration of --cluster to reuse")
    parser.add_argument("--local-calibration", help="a calibration of 4 local ranks to reuse")
    parser.add_argument("--repeats", type=int, default=3, help="timings per config (best kept)")
    parser.add_argument("--steps", type=int, default=2, help="GPT steps per timing")
    parser.add_argument("--parts", default="gemm,gpt",
                        help="what to measure: gemm, gpt or both (default gemm,gpt)")
    parser.add_argument("--only", choices=("emulated", "shared memory"),
                        help="measure in one environment only")
    parser.add_argument("--rank-part", help=argparse.SUPPRESS)
    parser.add_argument("--calibration", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_part:
        rank_part(args)
        return 0
    try:
        check_prerequisites()
        environments = ("emulated", "shared memory")
    except DistGraphError as err:
        print(f"no emulated cluster here ({err}); shared memory only", file=sys.stderr)
        environments = ("shared memory",)
    if args.only:
        environments = tuple(e for e in environments if e == args.only)
    results = {}
    with tempfile.TemporaryDirectory(prefix="distgraph-meshslice-") as tmp:
        for env in environments:
            emulated = env == "emulated"
            given = args.emulated_calibration if emulated else args.local_calibration
            calibration = given or os.path.join(tmp, f"{env[0]}-calibrated.yaml")
            if not given:
                print(f"calibrating {env} ...", flush=True)
                calibrate(args.cluster if emulated else None, calibration)
            out = os.path.join(tmp, f"{env[0]}.json")
            argv = [os.path.abspath(__file__), "--rank-part", out, "--calibration", calibration,
                    "--repeats", str(args.repeats), "--steps", str(args.steps),
                    "--parts", args.parts]
            print(f"measuring on {env} ...", flush=True)
            rc = launch_emulated(args.cluster, 4, argv) if emulated else \
                launch(4, argv, cluster=calibration)
            if rc != 0:
                print(f"the {env} run failed (exit code {rc})", file=sys.stderr)
                return rc
            with open(out) as f:
                results[env] = json.load(f)
    for env, result in results.items():
        report(env, result)
    return 0


def report(env: str, result: dict) -> None:
    if "gemm" in result:
        report_gemm(env, result["gemm"])
    if "gpt" in result:
        g = result["gpt"]
        m, k1 = g["meshslice"], g["K=1"]
        print(f"\n=== {env}: GPT {GPT} batch {GPT_BATCH}, the 2-D MeshSlice plan on 2x2: "
              f"{m['matmuls']} matmuls run as MeshSlice, K chosen {m['slices']}: "
              f"{m['measured'] * 1e3:.1f} ms per step; the same plan with K=1: "
              f"{k1['measured'] * 1e3:.1f} ms; ratio {m['measured'] / k1['measured']:.2f}")


def report_gemm(env: str, gemm: dict) -> None:
    rows = gemm["rows"]
    tokens, n_in = MODEL["batch"] * MODEL["seq"], MODEL["hidden"]
    print(f"\n=== {env}: GeMM x [{tokens}, {n_in}] @ W [{n_in}, {4 * n_in}] (fc1), fp32, "
          "4 ranks; times in ms (best of the repeats)")
    print("2-D GeMM on the 2x2 mesh (x across machines), forward, per dataflow:")
    print("  dataflow  compute  " + "  ".join(f"K={k:<5}" for k in SLICES)
          + "  hidden by best K")
    for dataflow in ("OS", "LS", "RS"):
        mine = {r["slices"]: r for r in rows if r["gemm"] == "forward" and r["mesh"] == [2, 2]
                and r["dataflow"] == dataflow and r["dims"] == ["x", "y"]}
        if not mine:
            continue
        compute = next(iter(mine.values()))["compute"]
        cells = "  ".join(f"{mine[k]['measured'] * 1e3:7.1f}" if k in mine else "      -"
                          for k in SLICES)
        best_k = min(mine, key=lambda k: mine[k]["measured"])
        exposed_1 = mine[1]["measured"] - compute
        exposed_best = mine[best_k]["measured"] - compute
        hidden = 1 - exposed_best / exposed_1 if exposed_1 > 0 else 0.0
        print(f"  {dataflow:<8}  {compute * 1e3:7.1f}  {cells}  {hidden:5.0%} (K={best_k}; "
              f"exposed {exposed_1 * 1e3:.1f} -> {exposed_best * 1e3:.1f})")
    for name, t in gemm["one_d"].items():
        print(f"  {name}: {t * 1e3:.1f}")
    errors = [abs(r["predicted"] - r["measured"]) / r["measured"] for r in rows]
    print(f"autotuner: {len(rows)} GeMMs priced; median |predicted - measured| / measured "
          f"{np.median(errors):.0%} (target <= 20%); per GeMM (ms):")
    print("  gemm             dataflow dims   mesh  K  predicted (compute+comm)  measured "
          "(compute)")
    for r in sorted(rows, key=lambda r: (r["gemm"], r["mesh"], r["dataflow"], r["slices"])):
        print(f"  {r['gemm']:<16} {r['dataflow']:<8} ({','.join(r['dims'])})  "
              f"{r['mesh'][0]}x{r['mesh'][1]}  {r['slices']}  {r['predicted'] * 1e3:8.1f} "
              f"({r['predicted_compute'] * 1e3:.1f}+{r['predicted_communication'] * 1e3:.1f})"
              f"  {r['measured'] * 1e3:8.1f} ({r['compute'] * 1e3:.1f})")
    chosen = gemm["chosen"]
    picked = 0.0
    for g in chosen["gemms"]:
        picked += next(r["measured"] for r in rows if r["gemm"] == g["gemm"] and
                       r["dataflow"] == g["dataflow"] and r["dims"] == g["dims"] and
                       r["mesh"] == chosen["mesh"] and r["slices"] == g["slices"])
    best_key, best = None, float("inf")
    families = {}
    for r in rows:
        key = (tuple(r["mesh"]), r["gemm"], r["dataflow"], tuple(r["dims"]))
        families[key] = min(families.get(key, float("inf")), r["measured"])
    for mesh in {k[0] for k in families}:
        for forward in ("OS", "LS", "RS"):
            total, ok = 0.0, True
            for g, (dataflow, orient) in zip(GEMMS, BACKWARD[forward]):
                dims = ("x", "y") if orient == "uv" else ("y", "x")
                t = families.get((mesh, g, dataflow, dims))
                ok = ok and t is not None
                total += t or 0.0
            if ok and total < best:
                best_key, best = (mesh, forward), total
    print(f"autotuner's choice for {LAYER}: mesh {chosen['mesh'][0]}x{chosen['mesh'][1]}, "
          f"forward {chosen['dataflow']}, K "
          + ", ".join(f"{g['gemm']} {g['slices']}" for g in chosen["gemms"])
          + f": measured {picked * 1e3:.1f} ms for its three GeMMs; the measured best is "
          f"mesh {best_key[0][0]}x{best_key[0][1]}, forward {best_key[1]} with each GeMM's "
          f"best K: {best * 1e3:.1f} ms; ratio {picked / best:.2f} (target <= 1.10)")


if __name__ == "__main__":
    sys.exit(main())
