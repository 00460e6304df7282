"""Communication hidden behind compute, measured on an emulated 2 x 2 cluster.

Run as root (the emulation makes network namespaces)::

    python bench/overlap.py [--cluster resources/clusters/emulated_2x2.yaml] [--torch]

GPT-tiny (``dg.nn.GPT``, the sizes below) trains data parallel over the 4 ranks of two
emulated machines, whose link (the file's, 1 Gbit/s by default) makes the gradients'
all-reduce take about as long as the backward. The program times, in one job, round
robin (best of ``--repeats`` timings of ``--steps`` steps):

- ``dp``: ``Strategy(overlap=True, bucket_mb=B)`` against ``overlap=False`` (target: at
  least 1.3 x faster);
- ``zero3``: the same under ZeRO-3 (``dp_config: sharding_level 3``): the next layer's
  gathers prefetched and the reduce-scatters bucketed, against neither (target 1.2 x);
- with ``--torch``, PyTorch DDP (gloo, ``bucket_cap_mb=B``, the same model, batch and
  optimizer, started the same way: ``launch_emulated`` runs this file on the same ranks)
  against distgraph's dp step with overlap (target: no slower);

and prints for each distgraph step the estimate's step time (``dg.passes.estimate`` on
the resource file, ``--calibrate``: on a calibration of the emulated cluster) against the
measured one (target: within 10 %), and, from one profiled step without overlap, how the
backward's seconds compare with the update's (the reductions and the optimizer).

A calibration measures the share of an all-reduce's seconds these ranks hide behind
compute (``overlap_efficiency``, :func:`distgraph.tools.calibrate.measure_overlap`): the
ranks' cores move the bytes too. Priced with every wire second hidden, the runs with
overlap came out 24-29 % fast (2026-11-27, ``--calibrate``: dp 201.9 ms measured, 153.6
predicted); with the measured share (0.67-0.71) -4 % to -19 %, the runs without overlap
within 1-14 %.

Progress of the nonblocking collectives: the runtime tests the oldest pending request
a few times between instructions (:mod:`distgraph.runtime.execution.overlap`'s
``PASSES``; with one test the dp step with overlap was 148-152 ms, with four 127-139 ms,
and ``dp`` came out 1.32 x twice, 2026-11-28); ``--progress-thread``
runs the job with MPICH's asynchronous progress thread as well
(``MPIR_CVAR_ASYNC_PROGRESS=1``), to compare. Measured here (4 ranks on 2 cores, 1
Gbit/s): the progress thread made the dp step with overlap 305 ms against 246 ms with
testing alone, and without overlap 893 ms against 257 ms (each rank's thread spins on a
core the ranks need), so the runtime tests and does not start the thread. A thread of
the runtime's own that tests the oldest request every 0.5 ms and sleeps between tests
(while numpy's kernels release Python's lock) did no better: the dp step with overlap
219 ms against 182 ms without that thread, ZeRO-3's 356 ms against 254 ms (2026-11-26,
one run each, back to back).
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

import distgraph as dg
from distgraph.runtime.comm.mpi import MPICommunicator
from distgraph.runtime.emulate.launch import launch_emulated
from distgraph.runtime.emulate.namespaces import check_prerequisites
from distgraph.runtime.launch.status import LOG_DIR

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from bench_jobs import calibrated, time_fit  # noqa: E402

GPT = dict(vocab_size=512, d_model=256, n_layer=2, n_head=4, max_seq_len=32)
BATCH = 32
LR = 1e-3


class Tokens:
    """Random next-token pairs of GPT's sizes."""

    def __init__(self, n: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        tokens = rng.integers(0, GPT["vocab_size"], size=(n, GPT["max_seq_len"] + 1))
        self.x, self.y = tokens[:, :-1], tokens[:, 1:]

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def engine_for(level: int, overlap: bool, bucket_mb: float, comm, cluster, profile=False):
    dg.seed(0)
    model = dg.nn.GPT(**GPT)
    mesh = dg.ProcessMesh([0, 1, 2, 3], ["dp"])
    config = {"dp_config": {"sharding_level": level}} if level else {}
    model, optimizer = dg.parallelize(model, mesh, config, optimizer=dg.optim.AdamW(LR))
    return dg.Engine(model, dg.nn.CrossEntropyLoss(), optimizer, cluster=cluster,
                     communicator=comm, strategy=dg.Strategy(overlap=overlap,
                                                             bucket_mb=bucket_mb,
                                                             profile=profile))


def split_of_update(comm, cluster, bucket_mb) -> dict:
    """Seconds of the backward and of the update of one profiled dp step without overlap
    (the update then runs every reduction), and of the gradients' all-reduces alone (one
    per parameter, as the update runs them, best of 3): the slowest rank's."""
    engine = engine_for(0, False, bucket_mb, comm, cluster, profile=True)
    data = Tokens(BATCH * 4)
    time_fit(engine, data, comm, 3, BATCH)
    spent = {"backward": 0.0, "update": 0.0, "reductions": float("inf")}
    last = max(e.step for e in engine.timeline().events)
    for e in engine.timeline().events:
        if e.rank == comm.rank and e.step == last and e.kind in spent:
            spent[e.kind] += e.end - e.start
    grads = [np.ones(v.shape, np.float32) for v in engine.plan().program.persistables
             if v.is_parameter]
    group = tuple(range(comm.size))
    for _ in range(3):
        comm.barrier()
        start = time.perf_counter()
        for g in grads:
            comm.all_reduce(g, group, inplace=True)
        spent["reductions"] = min(spent["reductions"], time.perf_counter() - start)
    return spent


def rank_part(args) -> None:
    """On each of 4 ranks: time every configuration; rank 0 writes the rows."""
    from mpi4py import MPI

    cluster = dg.Cluster.from_file(os.environ["DISTGRAPH_CLUSTER"])
    priced = dg.Cluster.from_file(args.priced) if args.priced else cluster
    comm = MPICommunicator()
    rows, runs = [], []
    for name, level, overlap in (("dp", 0, True), ("dp", 0, False), ("zero3", 3, True),
                                 ("zero3", 3, False)):
        engine = engine_for(level, overlap, args.bucket_mb, comm, cluster)
        data = Tokens(BATCH * (args.steps + 2))
        time_fit(engine, data, comm, 2, BATCH)                       # warm up
        est = dg.passes.estimate(engine.plan(), priced)
        rows.append({"plan": name, "overlap": overlap, "measured": float("inf"),
                     "predicted": est.step_time, "compute": est.compute,
                     "comm": est.communication})
        runs.append((engine, data))
    torch_step = None
    if args.torch:
        torch_step = TorchDDP(comm, args.bucket_mb)
        rows.append({"plan": "torch DDP", "overlap": True, "measured": float("inf")})
        runs.append((None, None))
    for _ in range(args.repeats):
        for row, (engine, data) in zip(rows, runs):
            seconds = torch_step.time(args.steps) if engine is None else \
                time_fit(engine, data, comm, args.steps, BATCH)
            row["measured"] = min(row["measured"], seconds)
    spent = split_of_update(comm, cluster, args.bucket_mb)
    worst = {k: np.array([v]) for k, v in spent.items()}
    for k in worst:
        MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, worst[k], op=MPI.MAX)
    comm.free()
    if comm.rank == 0:
        with open(os.path.join(os.environ[LOG_DIR], "rows.json"), "w") as f:
            json.dump({"rows": rows, "spent": {k: float(v[0]) for k, v in worst.items()}}, f)


class TorchDDP:
    """The same GPT in PyTorch under DistributedDataParallel (gloo over the machines'
    interface), ranks and rendezvous from the MPI job."""

    def __init__(self, comm, bucket_mb: float):
        import torch
        import torch.distributed as dist
        from mpi4py import MPI

        from torch_gpt import TorchGPT

        torch.set_num_threads(1)
        torch.manual_seed(0)
        address = MPI.COMM_WORLD.bcast(_interface_address("dg0") if comm.rank == 0 else None)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "dg0")
        dist.init_process_group("gloo", init_method=f"tcp://{address}:29511",
                                rank=comm.rank, world_size=comm.size)
        self.torch, self.dist, self.comm = torch, dist, comm
        model = TorchGPT(**GPT)
        self.model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=0.01)
        data = Tokens(BATCH * 2)
        share = BATCH // comm.size
        rows = slice(comm.rank * share, (comm.rank + 1) * share)
        self.x = torch.as_tensor(data.x[rows])
        self.y = torch.as_tensor(data.y[rows])
        self.time(2)

    def step(self) -> None:
        torch = self.torch
        self.opt.zero_grad(set_to_none=True)
        logits = self.model(self.x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 self.y.reshape(-1))
        loss.backward()
        self.opt.step()

    def time(self, steps: int) -> float:
        import time

        self.comm.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            self.step()
        self.comm.barrier()
        return (time.perf_counter() - start) / steps


def _interface_address(name: str) -> str:
    out = subprocess.run(["ip", "-o", "-4", "addr", "show", name], capture_output=True,
                         text=True, check=True).stdout.split()
    return out[out.index("inet") + 1].split("/")[0]


def report(rows, spent, cluster_file, hides) -> None:
    print(f"cluster {cluster_file}: GPT {GPT}, batch {BATCH}, 4 ranks data parallel; "
          f"overlap_efficiency {'not given (1)' if hides is None else hides}")
    print(f"one dp step without overlap: backward {spent['backward'] * 1e3:.1f} ms, update "
          f"(the reductions and AdamW) {spent['update'] * 1e3:.1f} ms; the gradients' "
          f"all-reduces alone {spent['reductions'] * 1e3:.1f} ms (slowest rank)")
    print(f"{'plan':10} {'overlap':8} {'measured ms':>11} {'predicted ms':>12} {'error':>7} "
          f"(predicted compute + communication)")
    for r in rows:
        pred = r.get("predicted")
        err = f"{pred / r['measured'] - 1:+.1%}" if pred else "-"
        split = f"({r['compute'] * 1e3:.1f} + {r['comm'] * 1e3:.1f})" if pred else ""
        print(f"{r['plan']:10} {str(r['overlap']):8} {r['measured'] * 1e3:11.1f} "
              f"{(pred or 0) * 1e3:12.1f} {err:>7} {split}")
    by = {(r["plan"], r["overlap"]): r["measured"] for r in rows}
    dp = by["dp", False] / by["dp", True]
    z3 = by["zero3", False] / by["zero3", True]
    print(f"dp: overlap on is {dp:.2f} x faster than off (target >= 1.3)")
    print(f"zero3: prefetch and buckets {z3:.2f} x faster than neither (target >= 1.2)")
    if ("torch DDP", True) in by:
        ratio = by["torch DDP", True] / by["dp", True]
        print(f"torch DDP step / distgraph dp step with overlap: {ratio:.2f} (target >= 1.0)")
    worst = max(abs(r["predicted"] / r["measured"] - 1) for r in rows if r.get("predicted"))
    print(f"time model: largest |error| {worst:.1%} (target <= 10%)")


def shaped(path: str, bandwidth: float, folder: str) -> str:
    """A copy of resource file ``path`` in ``folder`` whose links between machines carry
    ``bandwidth`` GB/s."""
    import yaml

    with open(path) as f:
        spec = yaml.safe_load(f)
    for link in spec.get("links", ()):
        link["bandwidth"] = bandwidth
    out = os.path.join(folder, f"shaped_{bandwidth:g}.yaml")
    with open(out, "w") as f:
        yaml.safe_dump(spec, f)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default=os.path.join(ROOT, "resources", "clusters",
                                                          "emulated_2x2.yaml"))
    parser.add_argument("--steps", type=int, default=4, help="steps per timing")
    parser.add_argument("--repeats", type=int, default=3, help="timings per plan (best kept)")
    parser.add_argument("--bucket-mb", type=float, default=1.0,
                        help="bucket size of both distgraph and DDP (MB)")
    parser.add_argument("--torch", action="store_true", help="also time PyTorch DDP")
    parser.add_argument("--bandwidth", type=float,
                        help="GB/s of the link between the machines (default: the file's)")
    parser.add_argument("--calibrate", action="store_true",
                        help="price on a calibration of the emulated cluster")
    parser.add_argument("--progress-thread", action="store_true",
                        help="run with MPICH's asynchronous progress thread")
    parser.add_argument("--rank-part", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--priced", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_part:
        rank_part(args)
        return 0
    check_prerequisites()
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "bench"),
                                           os.environ.get("PYTHONPATH", "")]))
    if args.progress_thread:
        env["MPIR_CVAR_ASYNC_PROGRESS"] = "1"
    with tempfile.TemporaryDirectory(prefix="distgraph-overlap-") as tmp:
        if args.bandwidth:
            args.cluster = shaped(args.cluster, args.bandwidth, tmp)
        cluster = calibrated(4, None, tmp, emulate=args.cluster) if args.calibrate \
            else args.cluster
        logs = os.path.join(tmp, "logs")
        argv = [os.path.abspath(__file__), "--rank-part", "--steps", str(args.steps),
                "--repeats", str(args.repeats), "--bucket-mb", str(args.bucket_mb)]
        argv += ["--torch"] if args.torch else []
        argv += ["--priced", os.path.abspath(cluster)] if args.calibrate else []
        rc = launch_emulated(args.cluster, 4, argv, env=env, log_dir=logs)
        if rc != 0:
            print(f"the job failed (exit code {rc})", file=sys.stderr)
            return rc
        with open(os.path.join(logs, "rows.json")) as f:
            got = json.load(f)
        hides = dg.Cluster.from_file(cluster).devices[0].overlap_efficiency
    report(got["rows"], got["spent"], cluster, hides)
    return 0


if __name__ == "__main__":
    sys.exit(main())
