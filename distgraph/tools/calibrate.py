"""Measure this machine's MPI ranks and write a resource file.

Every probe runs many times and keeps its fastest run: on a machine that other
processes load (several people's jobs on a few cores), the fastest run is the one they
left alone, the same run after run, where a mean or a median moves with the load.
How the job's own ranks share the cores is not left to chance either: where a host has
more ranks than cores (``os.sched_getaffinity``; ranks on one host are those of one
kernel boot, network namespaces included), each rank's compute figures are its fastest
ones times its share of a core (:func:`core_share`), which is what the ranks of a
training job get while all compute.

Per rank: the GEMM curve (:mod:`distgraph.tools.gemm_probe`: a sweep of GEMM shapes,
the rate of full tiles per dtype, the tile, its fill in steps of k and the reuse below
which a tile slows), memory bandwidth and distgraph's per-op overhead and per-op-type
costs (:mod:`distgraph.tools.device_probe`). On a machine whose GPUs CuPy finds
(``--device auto``, the default; ``--device GPU`` insists, ``CPU`` measures the cores),
each rank measures its GPU instead (the rank's place on its host modulo the GPUs there:
the sweep on its SMs, the memory bandwidth and the per-op overhead on CuPy, each timed
to the end of its kernels; no per-op-type costs, whose probe steps are launch-bound on
a GPU: its ops are priced by the roofline) and becomes a GPU device of that
``local_id``; the links
between ranks are still MPI's through host memory. Per pair of ranks, one pair at a
time: point-to-point latency (half the fastest round trip of an 8-byte ping-pong) and
bandwidth (the fastest multi-megabyte ping-pong): a round trip that waited for a peer
another process had descheduled is not the link's. For the whole group: all-reduce
latency (8 bytes) and bus bandwidth (2(n-1)/n * bytes / time). Ranks on the same host
form one machine; pairs on one host get ``SHM`` links, pairs across hosts ``NET`` links
between machines. Then one reshard step of each kind through distgraph's runtime (a
collective over all ranks and, with an even 4 or more, over pairs of them too),
between ops as in training, on three tensor sizes, timed as what it adds to a loop of
those ops (the ranks' own turns at cores they share, which the compute rates already
hold, cancel): what a step costs beyond its messages' alpha-beta (the wire: the links'
fastest figures), calls, copies and the wait for the group to meet, per step, per
further round of a collective's ring and per byte of its buffer
(``reshard_overhead``; with it ``all_to_allv``, the all-to-all with uneven counts per
pair that MoE's dispatch runs, on megabyte buffers, and the exchange of its counts:
:mod:`distgraph.tools.step_probe`); and what one collective of MeshSlice's sliced
pipeline costs per step (its kernel on a tiny GeMM at K = 1 and 8) and what a byte a
partial GeMM reads again costs (8 partial GeMMs of 1024^3 against one): the ``sliced``
entry. On CPUs, the share of an all-reduce's seconds the ranks hide behind GEMMs when it
is started nonblocking and tested between them, as the runtime overlaps a gradient
bucket's (:func:`measure_overlap`: ``overlap_efficiency``). Rank r becomes device r.
Rank 0 prints each result as it comes. The file says ``figures: measured``.

While a pair measures, the other ranks wait in a barrier that sleeps between polls
(:func:`idle_barrier`), not in MPI's own, which spins: with more ranks than cores a
spinning rank would take the core from a measuring one.

Run it through the CLI (``distgraph cluster calibrate -n 2 -o mine.yaml``) or by hand::

    mpiexec -n 2 python -m distgraph.tools.calibrate -o mine.yaml

Only rank 0 writes the file; with ``--in-log-dir`` it writes it under the output's name
into its log folder (``$DISTGRAPH_LOG_DIR``), which ``distgraph run`` on several hosts
brings back to the launching host. ``--gemm-window SECONDS`` times the GEMMs and the
steps that scale the per-op costs as sustained rates of all ranks at once instead (the
emulated clusters, whose CPU quotas let a rank run at full speed for a moment at a
time); the core share is then in the rates already.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import time

import numpy as np

from distgraph.plan.kinds import ALL_TO_ALLV
from distgraph.resources.cluster import Cluster, Device, Link, Machine
from distgraph.resources.gpus import NoGPU, detect_gpus
from distgraph.runtime.backend import NUMPY, CupyBackend
from distgraph.runtime.execution.overlap import PASSES
from distgraph.runtime.launch.status import LOG_DIR
from distgraph.tools.device_probe import (BANDWIDTH_BYTES, memory_bandwidth_gbps, op_costs,
                                          op_overhead_us)
from distgraph.tools.gemm_probe import gemm_curve
from distgraph.units import fmt_bytes
from distgraph.tools.software_fit import SLICED_SLICES, reshard_overheads, sliced_problem
from distgraph.tools.step_probe import (RESHARD_BYTES, idle_barrier, measure_all_to_allv,
                                        measure_reshard_steps)

SCRIPT = os.path.abspath(__file__)   # what `distgraph cluster calibrate` starts on each rank
GPU_BANDWIDTH_BYTES = 256 * 2**20
DTYPES = {"CPU": ("float32", "float64"),
          "GPU": ("float16", "bfloat16", "float32", "float64")}
SMALL_BYTES = 8
LARGE_BYTES = 4 * 2**20
ALLREDUCE_BYTES = 4 * 2**20
OVERLAP_BYTES = 8 * 2**20      # an all-reduce of a few gradient buckets (DDP's are 25 MB)
OVERLAP_GEMM = 256


def say(comm, text: str) -> None:
    """Progress, printed by rank 0."""
    if comm.Get_rank() == 0:
        print(f"calibrate: {text}", flush=True)


def ping_pong(comm, peer: int, first: bool, nbytes: int, iters: int, batches: int) -> float:
    """One-way seconds per message between this rank and ``peer`` (only the two call
    it): half the fastest of ``iters x batches`` round trips, each timed alone. A round
    trip in which a peer waited for the other to be scheduled again (another process's
    turn at the core) is the machine's load, not the link's; the fastest one is the
    link's. The exchanges keep the two in step, so batches need no barrier."""
    buf = np.zeros(max(nbytes, 1), dtype=np.uint8)
    best = np.inf
    for batch in range(batches + 1):  # batch 0 warms up the connection, and is not counted
        for _ in range(iters):
            start = time.perf_counter()
            if first:
                comm.Send(buf, dest=peer)
                comm.Recv(buf, source=peer)
            else:
                comm.Recv(buf, source=peer)
                comm.Send(buf, dest=peer)
            if batch:
                best = min(best, (time.perf_counter() - start) / 2.0)
    return best


def measure_pairs(comm, repeats: int) -> dict[tuple[int, int], tuple[float, float]]:
    """(bandwidth GB/s, latency µs) for every pair, measured one pair at a time while
    the other ranks sleep; rank 0 prints each pair's figures."""
    rank, size = comm.Get_rank(), comm.Get_size()
    pairs = [(a, b) for a in range(size) for b in range(a + 1, size)]
    out = {}
    for k, (a, b) in enumerate(pairs):
        idle_barrier(comm)
        if rank in (a, b):
            peer, first = (b, True) if rank == a else (a, False)
            lat = ping_pong(comm, peer, first, SMALL_BYTES, 200, repeats)
            t = ping_pong(comm, peer, first, LARGE_BYTES, 20, repeats)
            if rank == a:
                out[(a, b)] = (LARGE_BYTES / t / 1e9, lat * 1e6)
                if a != 0:
                    comm.send(out[(a, b)], dest=0, tag=k)
        if rank == 0:
            bw, lat = out[(a, b)] if a == 0 else comm.recv(source=a, tag=k)
            say(comm, f"pair {k + 1}/{len(pairs)} ranks {a}-{b}: {bw:.2f} GB/s, {lat:.1f} us")
    idle_barrier(comm)
    return out


def measure_allreduce(comm, repeats: int) -> tuple[float, float]:
    """(bus bandwidth GB/s, latency µs) of MPI all-reduce (sum, float64): the fastest
    of its runs on each rank, lined up, then the slowest rank's."""
    from mpi4py import MPI

    n = comm.Get_size()
    small_in, small_out = np.ones(1), np.empty(1)
    big_in = np.ones(ALLREDUCE_BYTES // 8)
    big_out = np.empty_like(big_in)
    timings = []
    for send, recv, iters in ((small_in, small_out, 200), (big_in, big_out, 20)):
        best = np.inf
        for batch in range(repeats + 1):  # batch 0 warms up, and is not counted
            idle_barrier(comm)
            for _ in range(iters):
                comm.Barrier()
                start = time.perf_counter()
                comm.Allreduce(send, recv, op=MPI.SUM)
                if batch:
                    best = min(best, time.perf_counter() - start)
        # Ranks time the same collective; the slowest rank's view is the collective's.
        timings.append(comm.allreduce(best, op=MPI.MAX))
    bus = 2.0 * (n - 1) / n * ALLREDUCE_BYTES / timings[1] / 1e9
    return bus, timings[0] * 1e6


def measure_overlap(comm, repeats: int) -> float:
    """The share of an all-reduce's seconds the ranks hide behind compute when it runs
    as the runtime overlaps a bucket's reduction (``Strategy(overlap=True)``): started
    nonblocking, tested between ops as the runtime tests (``PASSES`` times; GEMMs of
    :data:`OVERLAP_GEMM`, as many as last as long as the reduction alone), waited for
    after the last. Each trial times the
    reduction alone, the GEMMs alone and both, back to back (all ranks at once, as in
    training; each the slowest rank's), and gives ``(T_compute + T_reduce - T_both) /
    min(T_compute, T_reduce)`` in [0, 1]; the median trial's is kept (a load that comes
    and goes moves the three alike within a trial). On CPUs the cores that compute also
    move the bytes, so the share is below 1 (``overlap_efficiency``)."""
    from mpi4py import MPI

    send = np.ones(OVERLAP_BYTES // 4, dtype=np.float32)
    recv = np.empty_like(send)
    a = np.random.default_rng(0).standard_normal((OVERLAP_GEMM, OVERLAP_GEMM),
                                                 dtype=np.float32)
    chunks = 1

    def timed(run) -> float:
        idle_barrier(comm)
        start = time.perf_counter()
        run()
        return comm.allreduce(time.perf_counter() - start, op=MPI.MAX)

    def reduce():
        comm.Iallreduce(send, recv, op=MPI.SUM).Wait()

    def compute(request=None):
        for _ in range(chunks):
            np.matmul(a, a)
            for _ in range(PASSES if request is not None else 0):
                if request.Test():
                    break

    def both():
        request = comm.Iallreduce(send, recv, op=MPI.SUM)
        compute(request)
        request.Wait()

    timed(reduce)                       # warm up: connections, buffers
    alone = min(timed(reduce) for _ in range(repeats + 1))
    gemm = min(timed(compute) for _ in range(repeats + 1))
    chunks = comm.allreduce(max(1, round(alone / gemm)), op=MPI.MAX)
    shares = []
    for _ in range(4 * repeats + 1):
        t_reduce, t_compute, t_both = timed(reduce), timed(compute), timed(both)
        shares.append((t_compute + t_reduce - t_both) / min(t_compute, t_reduce))
    return float(np.clip(np.median(shares), 0.0, 1.0))


def rank_device(comm, device: str) -> tuple:
    """(this rank's device record, the array backend that measures it). ``device``:
    ``CPU``, ``GPU`` (NoGPU without one) or ``auto`` (the GPUs when CuPy finds one). A
    rank's GPU is its place among the ranks of its host, modulo the GPUs there; ranks
    beyond the GPU count share one (and its memory)."""
    from mpi4py import MPI

    host = MPI.Get_processor_name()
    hosts = comm.allgather(host)
    local = hosts[:comm.Get_rank()].count(host)
    gpus = []
    if device != "CPU":
        try:
            gpus = detect_gpus("distgraph cluster calibrate --device GPU")
        except NoGPU:
            if device == "GPU":
                raise
    if not gpus:
        return {"rank": comm.Get_rank(), "host": host, "type": "CPU", "local_id": local,
                "model": cpu_model(), "memory": host_memory_gb()}, NUMPY
    gpu = gpus[local % len(gpus)]
    sharing = sum(1 for k in range(hosts.count(host)) if k % len(gpus) == gpu.local_id)
    return ({"rank": comm.Get_rank(), "host": host, "type": "GPU", "local_id": gpu.local_id,
             "model": gpu.name, "memory": gpu.memory_gb, "sharing": sharing,
             "units": max(gpu.sms, 1)},
            CupyBackend(gpu.local_id, f"rank {comm.Get_rank()}'s GPU {gpu.local_id}"))


def core_share(comm) -> tuple:
    """(this rank's share of a core while every rank of its host computes: cores over
    ranks, at most 1; the cores) where the ranks of one kernel (its boot id: network
    namespaces share it) outnumber the cores this process may run on."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="utf-8") as f:
            kernel = f.read().strip()
    except OSError:
        from mpi4py import MPI
        kernel = MPI.Get_processor_name()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)
    ranks = comm.allgather(kernel).count(kernel)
    return min(1.0, cores / ranks), cores


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def host_memory_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):
        return 4.0


def measure_sliced_gemm(comm, repeats: int) -> dict:
    """{K: seconds} of MeshSlice's kernel (:func:`distgraph.ops.meshslice.run`) on the
    tiny GeMM of :func:`sliced_problem` at K = 1 and ``SLICED_SLICES`` (the slowest
    rank's view): what each more slice costs the sliced pipeline, whose collectives start
    and finish between partial GeMMs rather than in lockstep (an oversubscribed host pays
    for peers that are not running there)."""
    from distgraph.ops.meshslice import run
    from distgraph.registry import KernelContext
    from distgraph.runtime.comm.mpi import MPICommunicator

    n = comm.Get_size()
    runtime = MPICommunicator(comm)
    ctx = KernelContext(np, comm=runtime, groups=((runtime.rank,), tuple(range(n))))
    out = {}
    for slices in (1, SLICED_SLICES):
        local, (xs, ys), _ = sliced_problem(n, slices)
        x, y = np.ones(xs, dtype=np.float32), np.ones(ys, dtype=np.float32)
        best = np.inf
        for batch in range(repeats + 1):       # batch 0 warms up
            runtime.barrier()
            start = time.perf_counter()
            for _ in range(20):
                run(ctx, x, y, False, False, local)
            if batch:
                best = min(best, (time.perf_counter() - start) / 20)
        out[slices] = comm.allreduce(best, op=_mpi_max())
    return out


PARTIAL_SIZE = 1024       # measure_partial_gemms cuts 1024^3 GeMMs into SLICED_SLICES


def partial_pieces(slices: int, cut: str, rng) -> tuple:
    """(pieces of A, pieces of B, result, bytes moved again) of the GeMM
    :func:`measure_partial_gemms` times, cut in ``slices`` as MeshSlice's kernel receives
    them (contiguous): ``rows``: A's rows, B read whole by every slice (RS; LS is its
    transpose); ``inner``: A's columns with B's rows, accumulated into the result (OS)."""
    n = PARTIAL_SIZE
    a, b = (rng.standard_normal((n, n)).astype(np.float32) for _ in range(2))
    step = n // slices
    if cut == "rows":
        return ([a[k * step:(k + 1) * step].copy() for k in range(slices)], [b] * slices,
                np.empty((n, n), np.float32), (slices - 1) * b.nbytes)
    return ([a[:, k * step:(k + 1) * step].copy() for k in range(slices)],
            [b[k * step:(k + 1) * step].copy() for k in range(slices)],
            np.empty((n, n), np.float32), 2 * (slices - 1) * n * n * 4)


def measure_partial_gemms(comm, repeats: int) -> list:
    """[(bytes moved again, seconds)] per cut of :func:`partial_pieces`: what running a
    GeMM as ``SLICED_SLICES`` partial GeMMs (:func:`distgraph.ops.meshslice.
    partial_gemm`, each but the last in blocks as when requests are in flight) costs
    beyond running it whole, every rank at once (the slowest rank's view): the memory
    traffic of what each slice reads again."""
    from distgraph.ops.meshslice import partial_gemm

    rng = np.random.default_rng(comm.Get_rank())
    out = []
    for cut in ("rows", "inner"):
        times = {}
        for slices in (1, SLICED_SLICES):
            a, b, c, again = partial_pieces(slices, cut, rng)
            rows = PARTIAL_SIZE // slices

            def run():
                for k in range(slices):
                    poll = (lambda: None) if k + 1 < slices else None
                    if cut == "rows":
                        partial_gemm(np, a[k], b[k], c[k * rows:(k + 1) * rows], poll)
                    else:
                        partial_gemm(np, a[k], b[k], c, poll, accumulate=k > 0)

            best = np.inf
            for batch in range(repeats + 1):       # batch 0 warms up
                idle_barrier(comm)
                start = time.perf_counter()
                run()
                if batch:
                    best = min(best, time.perf_counter() - start)
            times[slices] = comm.allreduce(best, op=_mpi_max())
        out.append((again, times[SLICED_SLICES] - times[1]))
    return out


def _mpi_max():
    from mpi4py import MPI
    return MPI.MAX


def build_cluster(ranks: list[dict], pairs: dict, allreduce, name: str, steps=None,
                  sliced=None, partial=None, overlap=None):
    """The Cluster for gathered per-rank records and pair measurements (and the measured
    reshard steps, whose software cost every device then carries, and the share of a
    collective the ranks hide behind compute, ``overlap``: every device's
    ``overlap_efficiency``)."""

    hosts = list(dict.fromkeys(r["host"] for r in ranks))
    machine_of = {r["rank"]: hosts.index(r["host"]) for r in ranks}
    per_host = {h: sum(1 for r in ranks if r["host"] == h) for h in hosts}
    machines = []
    for m, host in enumerate(hosts):
        mine = [r for r in ranks if r["host"] == host]
        devices = [Device(r["rank"], r.get("local_id", k), m, r.get("type", "CPU"), r["model"],
                          r["gflops"], round(r["memory"] / r.get("sharing", per_host[host]), 3),
                          r.get("memory_bandwidth"), r.get("op_overhead"), r.get("op_costs"),
                          gemm=r.get("gemm"),
                          overlap_efficiency=None if overlap is None else round(overlap, 3))
                   for k, r in enumerate(mine)]
        links = [Link(a, b, bw, lat, "SHM") for (a, b), (bw, lat) in pairs.items()
                 if machine_of[a] == m and machine_of[b] == m]
        machines.append(Machine(m, host, devices, links))
    inter = [Link(a, b, bw, lat, "NET") for (a, b), (bw, lat) in pairs.items()
             if machine_of[a] != machine_of[b]]
    calibration = {"ranks": len(ranks), "p2p_bytes": LARGE_BYTES}
    for key in ("cores", "core_share"):
        if key in ranks[0]:
            calibration[key] = round(min(r[key] for r in ranks), 4)
    if steps:
        measured = Cluster(machines, inter, name=name)
        overheads = reshard_overheads(measured, steps, sliced, partial)
        machines = [dataclasses.replace(m, devices=tuple(
            dataclasses.replace(d, reshard_overhead=overheads) for d in m.devices))
            for m in machines]
    if allreduce is not None:
        calibration.update(allreduce_bus_bandwidth=round(allreduce[0], 4),
                           allreduce_latency=round(allreduce[1], 3),
                           allreduce_bytes=ALLREDUCE_BYTES)
    return Cluster(machines, inter, name=name, calibration=calibration, figures="measured")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="measure MPI ranks, write a resource file")
    parser.add_argument("-o", "--output", required=True, help="file to write (.yaml or .json)")
    parser.add_argument("--repeats", type=int, default=3, help="scale the measurement counts")
    parser.add_argument("--in-log-dir", action="store_true",
                        help="write the file, under the output's name, into the rank's log "
                             "folder ($DISTGRAPH_LOG_DIR)")
    parser.add_argument("--device", choices=("auto", "CPU", "GPU"), default="auto",
                        help="measure the CPU, or each rank's GPU (auto: the GPUs when CuPy "
                             "finds one)")
    parser.add_argument("--gemm-window", type=float, default=0.0, metavar="SECONDS",
                        help="time GEMMs, and the whole steps that scale the per-op costs, "
                             "over windows of SECONDS (sustained rates of all ranks at once) "
                             "instead of keeping their fastest runs")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.gemm_window < 0:
        parser.error(f"--gemm-window must be >= 0 seconds, got {args.gemm_window}")
    output = args.output
    if args.in_log_dir:
        if not os.environ.get(LOG_DIR):
            parser.error(f"--in-log-dir needs ${LOG_DIR} (set by distgraph run)")
        output = os.path.join(os.environ[LOG_DIR], os.path.basename(output))
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    record, xb = rank_device(comm, args.device)
    share, cores = core_share(comm)
    if args.gemm_window or record["type"] == "GPU":
        share = 1.0      # sustained rates hold the ranks' turns; a GPU is not a core
    say(comm, f"{size} ranks on {record['type']}"
              + (f" ({cores} cores: a share of {share:.2g} of a core each)"
                 if record["type"] == "CPU" else "")
              + (f", GEMMs sustained over {args.gemm_window:g} s" if args.gemm_window else ""))
    nbytes = GPU_BANDWIDTH_BYTES if record["type"] == "GPU" else BANDWIDTH_BYTES
    bandwidth = memory_bandwidth_gbps(args.repeats, xb, nbytes)
    idle_barrier(comm)
    rates, curve, error = gemm_curve(xb, DTYPES[record["type"]], 2 * args.repeats + 1,
                                     record.get("units", 1), bandwidth * 1e9,
                                     args.gemm_window, lambda: idle_barrier(comm))
    # A GPU's op costs are not fitted: the probe steps' ops are launch-bound there, and
    # the per-unit cost fitted to them overshoots at training sizes (on an H200, GPT-2
    # small's step predicted 2.4 x its 262 ms with them, 1.05 x with the roofline of the
    # measured bandwidth and launch cost instead)
    costs = op_costs(args.repeats, sync=lambda: idle_barrier(comm), xb=xb,
                     window=args.gemm_window) if record["type"] == "CPU" else None
    record.update(
        gflops={k: round(v * share, 3) for k, v in rates.items()}, gemm=curve,
        memory_bandwidth=round(bandwidth * share, 3),
        op_overhead=round(op_overhead_us(args.repeats, xb=xb) / share, 3),
        # a GEMM's work is priced by the curve; its per-call cost here is its launch
        op_costs=None if costs is None else
        {k: (round(a / share, 4), round(b / share, 6)) for k, (a, b) in costs.items()},
        cores=cores, core_share=share)
    records = comm.gather(record, root=0)
    if rank == 0:
        names = "/".join(records[0]["gflops"])
        say(comm, f"GEMM GFLOP/s per rank ({names}): " + ", ".join(
            "/".join(f"{v:.1f}" for v in r["gflops"].values()) for r in records)
            + f"; curve {curve.units} unit(s), tile {curve.tile[0]} x {curve.tile[1]}, "
              f"k_fill {curve.k_fill:g}, reuse {curve.reuse:g} (the sweep's median error "
              f"{error:.1%})")
    pairs = measure_pairs(comm, args.repeats)
    allreduce = None
    if size > 1:
        allreduce = measure_allreduce(comm, args.repeats)
        say(comm, f"all-reduce of {size} ranks: bus {allreduce[0]:.2f} GB/s, latency "
                  f"{allreduce[1]:.1f} us")
    steps = measure_reshard_steps(comm, args.repeats)
    say(comm, "reshard steps through distgraph, between ops: " + ", ".join(
        f"{k}{' in pairs' if g else ''} " + "/".join(
            f"{e[1] * 1e6:.0f}" for e in v if e[2:] == g) + " us"
        for k, v in steps.items() for g in dict.fromkeys(e[2:] for e in v))
        + f" (global {'/'.join(f'{b // 1024} KiB' for b in RESHARD_BYTES)})")
    if size > 1:
        steps[ALL_TO_ALLV] = measure_all_to_allv(comm, args.repeats)
        say(comm, "MoE's dispatch exchanges (the counts, then all_to_allv of uneven counts) "
                  "between ops: " + "/".join(f"{t * 1e6:.0f}" for _, t in steps[ALL_TO_ALLV])
            + " us (local " + "/".join(fmt_bytes(b) for b, _ in steps[ALL_TO_ALLV]) + ")")
    overlap = None
    if size > 1 and record["type"] == "CPU":
        overlap = measure_overlap(comm, args.repeats)
        say(comm, f"an all-reduce of {fmt_bytes(OVERLAP_BYTES)} tested between GEMMs: "
                  f"{overlap:.0%} of its time hidden behind them (overlap_efficiency)")
    sliced = measure_sliced_gemm(comm, args.repeats) if size > 1 else None
    partial = measure_partial_gemms(comm, args.repeats) if size > 1 else None
    if sliced:
        say(comm, "MeshSlice's tiny GeMM: " + ", ".join(
            f"K={k} {v * 1e6:.1f} us" for k, v in sliced.items())
            + f"; {SLICED_SLICES} partial GeMMs of {PARTIAL_SIZE}^3 against one: "
            + ", ".join(f"+{t * 1e3:.1f} ms for {b / 2**20:.0f} MiB read again"
                        for b, t in partial))
    all_pairs = comm.gather(pairs, root=0)
    if rank == 0:
        merged = {k: (round(bw, 4), round(lat, 3)) for part in all_pairs for k, (bw, lat)
                  in part.items()}
        cluster = build_cluster(records, merged, allreduce, f"calibrated{size}", steps,
                                sliced, partial, overlap)
        cluster.save(output)
    idle_barrier(comm)


if __name__ == "__main__":
    main()
