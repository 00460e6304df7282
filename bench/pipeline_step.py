"""Pipelined training steps: distgraph's actor runtime against the same two-mesh plan
without micro-batches and against a hand-written mpi4py 1F1B; the measured bubble of
each schedule; the live activations each stage keeps.

Run::

    distgraph run -n 2 bench/pipeline_step.py     # step times and bubbles (one rank per core)
    distgraph run -n 4 bench/pipeline_step.py     # four stages: bubbles of the interleaved
                                                  # and V schedules, grouped weight
                                                  # gradients, memory

The model is an MLP (ReLU between layers), float32, MSE loss (mean over the global
batch), SGD: a narrow input layer (``--in-width`` -> ``--width``), then 2 S layers of
``--width``; stage 0 holds the input layer and two more, every other stage two (one
rank per stage). A stage's first layer needs no input gradient, so the narrow layer
makes the stages' work equal (but for the loss): each runs 2 large matmuls forward
and 4 backward per micro-batch.

On 2 ranks, the same global initial parameters and batch on every side:

- *sequential*: distgraph's two-mesh plan without micro-batches (stage 1 waits for stage
  0's forward, then stage 0 for stage 1's backward: one core is idle at a time);
- *distgraph 1F1B*: the same plan with ``Strategy(micro_batches=M, schedule="1F1B")``;
- *reference 1F1B*: hand-written numpy + mpi4py, Megatron's 1F1B order (stage s runs
  S - s - 1 warm-up forwards, then forward/backward pairs, then the last backwards),
  ``Isend`` for activations and gradients, a blocking ``Recv`` where one is needed,
  gradients accumulated over the micro-batches, one SGD update.

All three must give the same parameters after one step (checked), then they alternate
step by step; a step's time is the slowest rank's, each after a barrier. Rank 0 prints
the medians and the ratios against the targets (distgraph 1F1B <= 0.65 x sequential and
<= 1.10 x reference).

Bubble: with ``Strategy(profile=True)`` the timeline gives each rank's idle share of the
pipeline's span (first forward to last backward of a step, over all ranks), averaged
over ranks and the timed steps; compared with (S - 1) / (M + S - 1) for FThenB (GPipe)
and 1F1B (target: within 25%), and ZB against 1F1B (target: lower).

On 4 ranks (four stages, ``--micro-batches`` 8), each rank under a CPU quota of the
machine's cores shared evenly where it has fewer than four (as root; see
``bench_jobs.steady_cores``: time-sharing would speed a rank up while others wait): the
bubble of 1F1B, of interleaved
1F1B (``virtual_stages=2``: the 9 layers cut into 8 chunks, chunk c on stage c mod 4), of
ZB and of ZBV from the timeline, as idle time over busy time (the idle share s of the
span as s / (1 - s)): interleaved 1F1B against Megatron's (S - 1) / (v M) (target:
within 25%), ZBV against interleaved 1F1B (target: lower). Under ZB the weight-gradient
actions a stage runs back to back (most at the end of the step) run as one task on the
micro-batches' rows joined: the groups each rank ran, the timeline's W time per
micro-batch alone and in a group, and what the GEMMs cost: g weight-gradient GEMMs of one
micro-batch's rows against one of g micro-batches' rows, and all M against the full
batch's, timed on rank 0 while the others wait.

Then each rank's peak activations between tasks under 1F1B, FThenB
and ZB, in bytes and in micro-batches' worth (bytes of one micro-batch's stash on that
stage under 1F1B, measured when it holds exactly one); bound: S - s under 1F1B, M under
GPipe, S under ZB (the schedule lets up to S micro-batches be in flight from their
forward to their weight gradients, so that W can wait for a bubble; a micro-batch whose
weight gradients wait holds its output gradients as well, so its bytes may exceed S
worth).

Timings on a shared 2-core machine are noisy: compare the numbers of one run.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import distgraph as dg
from distgraph.program_builder import build_program
from distgraph.runtime.comm.mpi import MPICommunicator
from distgraph.runtime.execution.runner import PlanRunner

from bench_jobs import steady_cores, timed

LR = 1e-3
SPEEDUP_TARGET = 0.65      # distgraph 1F1B / sequential
REFERENCE_TARGET = 1.10    # distgraph 1F1B / hand-written 1F1B
BUBBLE_TOLERANCE = 0.25
FOUR_STAGES = {            # name: Strategy options (4 ranks)
    "1F1B": dict(schedule="1F1B"),
    "interleaved 1F1B v=2": dict(schedule="1F1B", virtual_stages=2),
    "ZB": dict(schedule="ZB"),
    "ZBV": dict(schedule="ZBV"),
}


def stage_of_layer(i: int) -> int:
    """Stage of layer i: layers 0-2 on stage 0, then two layers per stage."""
    return 0 if i < 3 else (i - 1) // 2


class StageMLP(dg.nn.Layer):
    """Linear(in_width, width), then ``2 S`` Linear(width, width), ReLU between; layer i
    on ``meshes[stage_of_layer(i)]``."""

    def __init__(self, in_width, width, meshes):
        super().__init__()
        self.meshes, self.n = meshes, 1 + 2 * len(meshes)
        for i in range(self.n):
            setattr(self, f"fc{i}", dg.nn.Linear(in_width if i == 0 else width, width))

    def forward(self, x):
        for i in range(self.n):
            fc = getattr(self, f"fc{i}")
            part = (lambda v, fc=fc: dg.ops.relu(fc(v))) if i < self.n - 1 else fc
            x = dg.shard_op(part, self.meshes[stage_of_layer(i)])(x)
        return x


class Distgraph:
    """One step of the plan under ``strategy`` through dg.passes.plan and the one runtime
    (PlanRunner), as the Engine runs it."""

    def __init__(self, args, comm, strategy, x, y):
        meshes = [dg.ProcessMesh([r], ["dp"]) for r in range(comm.size)]
        dg.seed(0)
        model = StageMLP(args.in_width, args.width, meshes)
        self.names = [n for n, _ in model.named_parameters()]
        self.init = {n: p.numpy() for n, p in model.named_parameters()}
        opt = dg.optim.SGD(LR)
        built = build_program(model, [dg.InputSpec(x.shape, "float32", "x")],
                              [dg.InputSpec(y.shape, "float32", "y")], dg.nn.MSELoss(), opt)
        self.plan = dg.passes.plan(built, strategy)
        self.runner = PlanRunner(self.plan, comm)
        values = dict(self.init)
        values.update(opt.initial_state(self.plan.program))
        self.scope = self.runner.shard_scope(values)
        self.feed, self.loss, self.t = {"x": x, "y": y}, built.loss_name, 0

    def step(self) -> float:
        out = self.runner.run(self.scope, self.feed, self.t)
        self.t += 1
        return float(out[self.loss])

    def params(self) -> dict:
        return self.runner.gather(self.scope, self.names)


class Reference:
    """Hand-written 1F1B of the same model and split: this rank's layers, its rows of
    each micro-batch's activations, Isend/Recv between neighbouring stages."""

    def __init__(self, args, comm, init, x, y):
        from mpi4py import MPI
        self.MPI, self.comm = MPI, comm
        self.s, self.S = comm.Get_rank(), comm.Get_size()
        n = 1 + 2 * self.S
        self.layers = [i for i in range(n) if stage_of_layer(i) == self.s]
        self.last = n - 1
        self.w = {i: np.array(init[f"fc{i}.weight"]) for i in self.layers}
        self.b = {i: np.array(init[f"fc{i}.bias"]) for i in self.layers}
        self.m = args.micro_batches
        rows = x.shape[0] // self.m
        self.x = [x[k * rows:(k + 1) * rows] for k in range(self.m)]
        self.y = [y[k * rows:(k + 1) * rows] for k in range(self.m)]
        self.scale = np.float32(2.0 / (x.shape[0] * y.shape[1]))
        self.shape = (rows, y.shape[1])

    def forward(self, k):
        if self.s == 0:
            h = self.x[k]
        else:
            h = np.empty(self.shape, np.float32)
            self.comm.Recv(h, source=self.s - 1, tag=k)
        saved = []
        for i in self.layers:
            saved.append(h)
            h = h @ self.w[i]
            h += self.b[i]
            if i != self.last:
                np.maximum(h, 0, out=h)
        if self.s < self.S - 1:
            self.pending.append(self.comm.Isend(h, dest=self.s + 1, tag=k))
            self.stash[k] = (saved, h)
        else:
            d = h - self.y[k]
            self.loss += float(np.vdot(d, d))
            d *= self.scale
            self.stash[k] = (saved, d)

    def backward(self, k):
        saved, out = self.stash.pop(k)
        if self.s < self.S - 1:
            g = np.empty(self.shape, np.float32)
            self.comm.Recv(g, source=self.s + 1, tag=self.m + k)
            g *= out > 0                         # this stage's last ReLU
        else:
            g = out
        for j in reversed(range(len(self.layers))):
            i, h = self.layers[j], saved[j]
            gw, gb = h.T @ g, g.sum(axis=0)
            if k == 0:
                self.gw[i], self.gb[i] = gw, gb
            else:
                self.gw[i] += gw
                self.gb[i] += gb
            if j > 0 or self.s > 0:
                g = g @ self.w[i].T
                if j > 0:
                    g *= h > 0
        if self.s > 0:
            self.pending.append(self.comm.Isend(g, dest=self.s - 1, tag=self.m + k))

    def step(self) -> float:
        self.stash, self.pending, self.gw, self.gb, self.loss = {}, [], {}, {}, 0.0
        warmup = min(self.S - self.s - 1, self.m)
        for k in range(warmup):
            self.forward(k)
        for k in range(self.m - warmup):
            self.forward(warmup + k)
            self.backward(k)
        for k in range(self.m - warmup, self.m):
            self.backward(k)
        self.MPI.Request.Waitall(self.pending)
        for i in self.layers:
            self.gw[i] *= np.float32(LR)
            self.w[i] -= self.gw[i]
            self.gb[i] *= np.float32(LR)
            self.b[i] -= self.gb[i]
        return self.loss

    def params(self) -> dict:
        mine = {f"fc{i}.weight": self.w[i] for i in self.layers}
        mine.update({f"fc{i}.bias": self.b[i] for i in self.layers})
        out = {}
        for part in self.comm.allgather(mine):
            out.update(part)
        return out


def check_same(a: dict, b: dict, what: str) -> None:
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=2e-4, atol=1e-6, err_msg=f"{what}: {k}")


def throughput(args, comm, world, x, y):
    seq = Distgraph(args, comm, dg.Strategy(), x, y)
    pipe = Distgraph(args, comm, dg.Strategy(micro_batches=args.micro_batches), x, y)
    ref = Reference(args, world, seq.init, x, y)
    seq.step(), pipe.step(), ref.step()
    a, b, c = seq.params(), pipe.params(), ref.params()
    check_same(b, a, "1F1B vs sequential")
    check_same(c, a, "reference vs sequential")
    times = timed([seq.step, pipe.step, ref.step], args.steps, args.warmup, world)
    return np.median(times, axis=1), times.min(axis=1)


def bubbles(args, comm, x, y):
    out = {}
    for schedule in ("FThenB", "1F1B", "ZB"):
        for m in (4, 8):
            run = Distgraph(args, comm, dg.Strategy(micro_batches=m, schedule=schedule,
                                                    profile=True), x, y)
            for _ in range(args.warmup + args.bubble_steps):
                comm.barrier()
                run.step()
            tl = run.runner.timeline()
            steps = tl.steps[args.warmup:]
            idle = [np.mean(list(tl.idle_fraction(s).values())) for s in steps]
            out[schedule, m] = (float(np.median(idle)), float(np.min(idle)))
    return out


def median_idle(args, comm, run):
    """(median idle share of the timed steps, the timeline) of ``run``."""
    for _ in range(args.warmup + args.bubble_steps):
        comm.barrier()
        run.step()
    tl = run.runner.timeline()
    return float(np.median([np.mean(list(tl.idle_fraction(s).values()))
                            for s in tl.steps[args.warmup:]])), tl


def four_stage_bubbles(args, comm, world, x, y):
    """{name: median idle share} of FOUR_STAGES, and what ZB's grouped weight gradients
    did: (groups per rank, W seconds per micro-batch alone and grouped)."""
    idle, groups = {}, None
    for name, options in FOUR_STAGES.items():
        run = Distgraph(args, comm, dg.Strategy(micro_batches=args.micro_batches, profile=True,
                                                **options), x, y)
        idle[name], tl = median_idle(args, comm, run)
        if name == "ZB":
            program = run.runner.program
            mine = [[(program.actions[i].chunk, program.actions[i].micro_batch) for i in g]
                    for g in program.batched]
            groups = world.allgather(mine)
            grouped = {(r, st, m) for r, gs in enumerate(groups) for g in gs for st, m in g}
            times: dict = {True: [], False: []}
            for e in tl.events:
                if e.kind == "backward_weight" and e.step >= args.warmup:
                    times[(e.rank, e.stage, e.micro_batch) in grouped].append(e.duration)
            w_time = (float(np.median(times[False])) if times[False] else float("nan"),
                      float(np.median(times[True])) if times[True] else float("nan"))
    return idle, groups, w_time


def gemm_costs(rows: int, width: int, sizes, repeats: int = 20) -> dict:
    """{g: seconds of g weight-gradient GEMMs (h^T g) of ``rows`` rows / seconds of one of
    g * rows rows}, float32, medians over ``repeats``."""
    rng = np.random.default_rng(1)
    out = {}
    for g in sizes:
        h = rng.standard_normal((g * rows, width)).astype(np.float32)
        d = rng.standard_normal((g * rows, width)).astype(np.float32)
        parts = [(h[k * rows:(k + 1) * rows].copy(), d[k * rows:(k + 1) * rows].copy())
                 for k in range(g)]
        apart, joined = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for a, b in parts:
                a.T @ b
            t1 = time.perf_counter()
            h.T @ d
            t2 = time.perf_counter()
            apart.append(t1 - t0)
            joined.append(t2 - t1)
        out[g] = float(np.median(apart) / np.median(joined))
    return out


def memory(args, comm, x, y):
    """{schedule: {rank: (peak bytes, peak live micro-batches)}} of step 2, and {rank:
    bytes of one micro-batch's stash} (under 1F1B, when the rank holds exactly one)."""
    peaks, unit = {}, {}
    for schedule in ("1F1B", "FThenB", "ZB"):
        run = Distgraph(args, comm, dg.Strategy(micro_batches=args.micro_batches,
                                                schedule=schedule, profile=True), x, y)
        run.step()
        run.step()
        tl = run.runner.timeline()
        peaks[schedule] = tl.peak_activations(step=1)
        if schedule == "1F1B":
            for rank in tl.ranks:
                unit[rank] = max(s.bytes for s in tl.memory
                                 if s.rank == rank and s.step == 1 and s.micro_batches == 1)
    return peaks, unit


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in-width", type=int, default=16)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=512, help="global batch rows")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=15, help="timed steps of each")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--bubble-steps", type=int, default=8)
    parser.add_argument("--cores-per-rank", type=float, default=None,
                        help="CPU quota of each rank on 4 ranks (default: the machine's "
                             "cores shared evenly where there are fewer than 4; as root)")
    args = parser.parse_args(argv)

    from mpi4py import MPI
    comm, world = MPICommunicator(), MPI.COMM_WORLD
    if comm.size not in (2, 4):
        if comm.rank == 0:
            print("run on 2 ranks (times, bubbles) or 4 ranks (four-stage schedules, "
                  "memory): distgraph run -n 2 bench/pipeline_step.py", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch, args.in_width)).astype(np.float32)
    y = rng.standard_normal((args.batch, args.width)).astype(np.float32)
    head = (f"MLP Linear({args.in_width}, {args.width}) + {2 * comm.size} x Linear({args.width}),"
            f" ReLU, batch {args.batch}, float32, MSE, SGD; {comm.size} stages, one rank each")
    if comm.size == 4:
        cores = steady_cores(comm.rank, comm.size, args.cores_per_rank)
        if comm.rank == 0:
            print(cores)
        idle, groups, w_time = four_stage_bubbles(args, comm, world, x, y)
        sizes = sorted({len(g) for gs in groups for g in gs} | {args.micro_batches})
        comm.barrier()          # the others wait without spinning while rank 0 times
        costs = gemm_costs(args.batch // args.micro_batches, args.width, sizes) \
            if comm.rank == 0 else None
        comm.barrier()
        peaks, unit = memory(args, comm, x, y)
        if comm.rank == 0:
            s, m = comm.size, args.micro_batches
            print(f"{head}; {m} micro-batches; bubble = idle / busy time from the timeline "
                  f"(median of {args.bubble_steps} steps; idle share of the span in brackets)")
            bubble = {name: share / (1 - share) for name, share in idle.items()}
            ideal = {"1F1B": (s - 1) / m, "interleaved 1F1B v=2": (s - 1) / (2 * m)}
            for name, share in idle.items():
                line = f"  {name:<21} {bubble[name]:.3f} ({share:.3f})"
                if name in ideal:
                    off = abs(bubble[name] - ideal[name]) / ideal[name]
                    v = 2 if "v=2" in name else 1
                    line += (f"  {off:.0%} off (S-1)/(v M) = {ideal[name]:.3f} (v={v})"
                             f"{'' if v == 1 else ' OK' if off <= BUBBLE_TOLERANCE else ' MISSED'}")
                if name == "ZBV":
                    lower = bubble[name] < bubble["interleaved 1F1B v=2"]
                    line += f"  {'lower' if lower else 'NOT lower'} than interleaved 1F1B " \
                            f"{'OK' if lower else 'MISSED'}"
                print(line)
            print("  ZB: weight-gradient actions run as one task per rank: " + "; ".join(
                f"rank {r}: " + (", ".join(" ".join(f"{st}W{mb}" for st, mb in g) for g in gs)
                                 or "none") for r, gs in enumerate(groups)))
            print(f"    W time per micro-batch from the timeline: alone {w_time[0] * 1e3:.2f} ms,"
                  f" in a group {w_time[1] * 1e3:.2f} ms (ratio {w_time[0] / w_time[1]:.2f})")
            rows = args.batch // m
            print("    weight-gradient GEMMs (rank 0, others waiting): " + ", ".join(
                f"{g} x {rows} rows / 1 x {g * rows} rows = {costs[g]:.2f}" for g in sizes))
            print(f"{head}; {args.micro_batches} micro-batches; peak activations per rank "
                  f"between tasks (step 2), in micro-batches' worth = bytes / one micro-batch's "
                  f"stash under 1F1B")
            for schedule, rows in peaks.items():
                for rank, (peak, live) in sorted(rows.items()):
                    bound = {"FThenB": args.micro_batches, "ZB": comm.size}.get(
                        schedule, comm.size - rank)
                    worth = peak / unit[rank]
                    ok = live <= bound and (schedule == "ZB" or worth <= bound + 1e-9)
                    print(f"  {schedule:<6} stage {rank}: {peak / 2**20:6.2f} MiB = {worth:4.2f} "
                          f"x {unit[rank] / 2**20:.2f} MiB, {live} micro-batches live; bound "
                          f"{bound} micro-batches {'OK' if ok else 'EXCEEDED'}")
        return 0
    medians, mins = throughput(args, comm, world, x, y)
    bub = bubbles(args, comm, x, y)
    if comm.rank == 0:
        seq, pipe, ref = medians
        print(f"{head}; {args.micro_batches} micro-batches; {args.steps} timed steps each, "
              f"interleaved; same parameters after one step: OK")
        print(f"  sequential (no micro-batches) median {seq * 1e3:8.2f} ms  min "
              f"{mins[0] * 1e3:8.2f} ms")
        print(f"  distgraph 1F1B               median {pipe * 1e3:8.2f} ms  min "
              f"{mins[1] * 1e3:8.2f} ms")
        print(f"  reference 1F1B (mpi4py)      median {ref * 1e3:8.2f} ms  min "
              f"{mins[2] * 1e3:8.2f} ms")
        r1, r2 = pipe / seq, pipe / ref
        print(f"  distgraph 1F1B / sequential: {r1:.3f} (min {mins[1] / mins[0]:.3f}) target <= "
              f"{SPEEDUP_TARGET} {'OK' if r1 <= SPEEDUP_TARGET else 'MISSED'}")
        print(f"  distgraph 1F1B / reference:  {r2:.3f} (min {mins[1] / mins[2]:.3f}) target <= "
              f"{REFERENCE_TARGET} {'OK' if r2 <= REFERENCE_TARGET else 'MISSED'}")
        s = comm.size
        print(f"  bubble (idle share of the pipeline span, median of {args.bubble_steps} steps):")
        for (schedule, m), (idle, best) in bub.items():
            ideal = (s - 1) / (m + s - 1)
            if schedule == "ZB":
                verdict = ("lower than 1F1B OK" if idle < bub["1F1B", m][0]
                           else "NOT lower than 1F1B")
            else:
                off = abs(idle - ideal) / ideal
                verdict = (f"{off:.0%} off (S-1)/(M+S-1) = {ideal:.3f} "
                           f"{'OK' if off <= BUBBLE_TOLERANCE else 'MISSED'}")
            print(f"    {schedule:<6} M={m}: {idle:.3f} (least of a step {best:.3f})  {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
