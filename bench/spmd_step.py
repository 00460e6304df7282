"""One training step of an MLP on 2 MPI ranks: distgraph's SPMD plan versus hand-written
mpi4py + numpy, for data parallelism (DP) and Megatron tensor parallelism (TP).

Run: ``distgraph run -n 2 bench/spmd_step.py [--steps N] [--optimizer adam|sgd] [--plans dp tp]``

The model is fc1 (1024 -> 4096) -> ReLU -> fc2 (4096 -> 1024), batch 64, float32, MSE
loss (mean over the global batch), Adam by default. Both sides build the same global
initial parameters on every rank and read the same global batch.

- DP: distgraph annotates the input batch ``[dp, None]`` on mesh ``[0, 1]`` ("dp") and
  completes; the reference holds full parameters and its half of the batch rows,
  scales the output gradient by 2 / (global element count), and all-reduces every
  gradient in place with ``Allreduce`` on its contiguous buffer, plus the 4-byte local
  loss sum, so that it reports the global loss as distgraph does.
- TP (Megatron): distgraph annotates ``fc1.weight [None, mp]`` and ``fc2.weight
  [mp, None]``; the reference holds the column shard of fc1 (weight and bias), the row
  shard of fc2's weight and all of fc2's bias, and makes exactly one all-reduce per step:
  fc2's partial output in the forward. The backward needs none: the input needs no
  gradient, and fc2's bias gradient is computed alike on both ranks from the replicated
  output gradient.

distgraph runs through its lower-level API: ``build_program``, ``complete``, then a
``PlanRunner`` (the one runtime) bound to an ``MPICommunicator`` on the world. Before timing, one step of
each side from the same start must give the same global parameters (gathered, compared
on rank 0). Then the two sides alternate step by step; each timed step starts after a
barrier, and a step's time is the slowest rank's. Rank 0 prints the medians, the ratio
distgraph/reference against the target (<= 1.10), and the bytes each side sends per
step per rank: distgraph's from its communicator's counters, the reference's from the
buffers it all-reduced, by the same ring formula
(:func:`distgraph.passes.cost.formulas.collective_bytes`).

The launcher gives every rank one BLAS thread and glibc settings that keep freed memory
for reuse (see runtime/launcher.py); both sides run in the same ranks, so both get them.
Timings on a shared 2-core machine are noisy: compare the two numbers of one run.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import distgraph as dg
from distgraph.passes.cost.formulas import collective_bytes
from distgraph.program_builder import build_program
from distgraph.runtime.comm.mpi import MPICommunicator
from distgraph.runtime.execution.runner import PlanRunner

from bench_jobs import timed

from reference_adam import adam_ as adam_inplace  # bench/ is on the path

BATCH, D_IN, D_HIDDEN, D_OUT = 64, 1024, 4096, 1024
LR, BETA1, BETA2, EPS = 1e-3, 0.9, 0.999, 1e-8
PARAMS = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
TIME_TARGET = 1.10
WORLD = 2


# -- the model, annotated per plan --------------------------------------------------------------
class MLP(dg.nn.Layer):
    def __init__(self, plan: str, mesh: dg.ProcessMesh):
        super().__init__()
        self.plan, self.mesh = plan, mesh
        self.fc1 = dg.nn.Linear(D_IN, D_HIDDEN)
        self.fc2 = dg.nn.Linear(D_HIDDEN, D_OUT)
        if plan == "tp":
            dg.shard_tensor(self.fc1.weight, mesh, [None, "mp"])
            dg.shard_tensor(self.fc2.weight, mesh, ["mp", None])

    def forward(self, x):
        if self.plan == "dp":
            dg.shard_tensor(x, self.mesh, ["dp", None])
        return self.fc2(dg.ops.relu(self.fc1(x)))


def make_optimizer(name: str):
    return dg.optim.Adam(LR, BETA1, BETA2, EPS) if name == "adam" else dg.optim.SGD(LR)


# -- the hand-written reference ------------------------------------------------------------------
def adam_(p, g, m, v, t):
    adam_inplace(p, g, m, v, t, LR, BETA1, BETA2, EPS)


def sgd_(p, g):
    g *= np.float32(LR)
    p -= g


class Reference:
    """The hand-written step for one plan on this rank. ``state`` holds this rank's
    parameter shards (and Adam moments); ``reduced`` the sizes in bytes of the buffers
    one step all-reduces."""

    def __init__(self, plan, optimizer, comm, global_params, x, y):
        from mpi4py import MPI
        self.MPI, self.plan, self.optimizer, self.comm = MPI, plan, optimizer, comm
        r, n = comm.Get_rank(), comm.Get_size()
        if plan == "dp":
            rows = slice(r * BATCH // n, (r + 1) * BATCH // n)
            self.x, self.y = np.ascontiguousarray(x[rows]), np.ascontiguousarray(y[rows])
            shards = {k: global_params[k] for k in PARAMS}
        else:
            cols = slice(r * D_HIDDEN // n, (r + 1) * D_HIDDEN // n)
            self.x, self.y = x, y
            shards = {"fc1.weight": global_params["fc1.weight"][:, cols],
                      "fc1.bias": global_params["fc1.bias"][cols],
                      "fc2.weight": global_params["fc2.weight"][cols],
                      "fc2.bias": global_params["fc2.bias"]}
        self.state = {k: np.array(a, dtype=np.float32, order="C") for k, a in shards.items()}
        if optimizer == "adam":
            for k in PARAMS:
                self.state[k + "@MOMENT1"] = np.zeros_like(self.state[k])
                self.state[k + "@MOMENT2"] = np.zeros_like(self.state[k])
        self.t = 0
        self.reduced: list[int] = []
        self.scale = np.float32(2.0 / (BATCH * D_OUT))     # d mean((o - y)^2) / d o

    def _allreduce(self, buf) -> None:
        self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
        self.reduced.append(buf.nbytes)

    def step(self) -> float:
        """Forward, backward and update; returns the global loss."""
        self.reduced = []
        s, x, y = self.state, self.x, self.y
        h = x @ s["fc1.weight"]
        h += s["fc1.bias"]
        a = np.maximum(h, 0)
        del h
        out = a @ s["fc2.weight"]
        if self.plan == "tp":
            self._allreduce(out)                    # fc2's partial sums over the mp shards
        out += s["fc2.bias"]
        d = np.subtract(out, y, out=out)
        loss = np.array(np.vdot(d, d), dtype=np.float32)
        if self.plan == "dp":
            self._allreduce(loss)                   # the global loss, to report it
        dout = d
        dout *= self.scale
        grads = {"fc2.bias": dout.sum(axis=0), "fc2.weight": a.T @ dout}
        da = dout @ s["fc2.weight"].T
        da *= a > 0
        del a, dout, d
        grads["fc1.bias"] = da.sum(axis=0)
        grads["fc1.weight"] = x.T @ da
        del da
        self.t += 1
        for k in PARAMS:
            if self.plan == "dp":
                self._allreduce(grads[k])           # sum of the per-rank partial gradients
            if self.optimizer == "adam":
                adam_(s[k], grads[k], s[k + "@MOMENT1"], s[k + "@MOMENT2"], self.t)
            else:
                sgd_(s[k], grads[k])
        return float(loss) / (BATCH * D_OUT)

    def gathered(self) -> dict:
        """Global parameters on every rank."""
        if self.plan == "dp":
            return {k: self.state[k] for k in PARAMS}
        out = {}
        for k, axis in (("fc1.weight", 1), ("fc1.bias", 0), ("fc2.weight", 0)):
            parts = self.comm.allgather(self.state[k])
            out[k] = np.concatenate(parts, axis=axis)
        out["fc2.bias"] = self.state["fc2.bias"]
        return out

    def bytes_per_step(self) -> float:
        n = self.comm.Get_size()
        return sum(collective_bytes("all_reduce", n, b) for b in self.reduced)


# -- distgraph ------------------------------------------------------------------------------------
class Distgraph:
    """The same step through build_program + dg.passes.plan + PlanRunner over MPI."""

    def __init__(self, plan, optimizer, comm: MPICommunicator, x, y):
        mesh = dg.ProcessMesh(list(range(WORLD)), dim_names=["dp" if plan == "dp" else "mp"])
        dg.seed(0)
        model = MLP(plan, mesh)
        opt = make_optimizer(optimizer)
        self.built = build_program(model, [dg.InputSpec([BATCH, D_IN], "float32", "x")],
                                   [dg.InputSpec([BATCH, D_OUT], "float32", "y")],
                                   dg.nn.MSELoss(), opt)
        plan = dg.passes.plan(self.built)
        program = plan.program
        self.comm = comm
        self.runner = PlanRunner(plan, comm)
        self.global_params = {n: p.numpy() for n, p in model.named_parameters()}
        values = dict(self.global_params)
        values.update(opt.initial_state(program))
        self.scope = self.runner.shard_scope(values)
        # What this rank reads of the batch, as the Engine's data loader would give it.
        self.rows = None
        x_attr = program.values["x"].dist_attr
        index = x_attr.local_slices((BATCH, D_IN), comm.rank)
        if plan == "dp":
            self.rows = index[0]
            x, y = x[self.rows], y[self.rows]
        self.feed = {"x": np.ascontiguousarray(x), "y": np.ascontiguousarray(y)}
        self.t = 0

    def step(self) -> float:
        out = self.runner.run(self.scope, self.feed, self.t, local=self.rows is not None)
        self.t += 1
        return float(out[self.built.loss_name])

    def gathered(self) -> dict:
        return self.runner.gather(self.scope, list(PARAMS))

    def bytes_per_step(self) -> float:
        self.comm.reset_counters()
        self.step()
        return self.comm.total_bytes_sent


# -- the benchmark ---------------------------------------------------------------------------------
def check_same(plan, dgs: Distgraph, ref: Reference, comm) -> None:
    dg_loss, ref_loss = dgs.step(), ref.step()
    got, want = dgs.gathered(), ref.gathered()
    if comm.Get_rank() == 0:
        np.testing.assert_allclose(dg_loss, ref_loss, rtol=1e-5, err_msg=f"{plan} loss")
        for k in PARAMS:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7,
                                       err_msg=f"{plan} {k} after one step")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps of each")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    parser.add_argument("--plans", nargs="+", choices=("dp", "tp"), default=["dp", "tp"])
    args = parser.parse_args(argv)

    from mpi4py import MPI
    comm, world = MPICommunicator(), MPI.COMM_WORLD   # distgraph's, and the reference's
    if comm.size != WORLD:
        if comm.rank == 0:
            print(f"run this benchmark on {WORLD} ranks: distgraph run -n {WORLD} "
                  f"bench/spmd_step.py", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, D_IN)).astype(np.float32)
    y = rng.standard_normal((BATCH, D_OUT)).astype(np.float32)

    report = []
    for plan in args.plans:
        dgs = Distgraph(plan, args.optimizer, comm, x, y)
        ref = Reference(plan, args.optimizer, world, dgs.global_params, x, y)
        check_same(plan, dgs, ref, world)
        dg_bytes = dgs.bytes_per_step()
        ref.step()
        ref_bytes = ref.bytes_per_step()
        times = timed([dgs.step, ref.step], args.steps, args.warmup, world)
        report.append((plan, times, dg_bytes, ref_bytes,
                       dgs.runner.local.pretty().splitlines()[0]))
        del dgs, ref

    if comm.rank == 0:
        print(f"MLP {D_IN}->{D_HIDDEN}->{D_OUT}, batch {BATCH} (global), float32, ReLU, MSE, "
              f"{args.optimizer}; {WORLD} ranks; {args.steps} timed steps each, interleaved; "
              "same parameters after one step: OK")
        for plan, times, dg_bytes, ref_bytes, summary in report:
            dg_t, ref_t = np.median(times[0]), np.median(times[1])
            ratio = dg_t / ref_t
            name = {"dp": "DP (x [dp, None])",
                    "tp": "TP (fc1.weight [None, mp], fc2.weight [mp, None])"}[plan]
            print(f"{name}; distgraph {summary}")
            print(f"  distgraph  median {dg_t * 1e3:7.2f} ms/step   min "
                  f"{times[0].min() * 1e3:7.2f} ms/step   {dg_bytes:12,.0f} B/step/rank")
            print(f"  reference  median {ref_t * 1e3:7.2f} ms/step   min "
                  f"{times[1].min() * 1e3:7.2f} ms/step   {ref_bytes:12,.0f} B/step/rank")
            print(f"  time ratio distgraph/reference: {ratio:.3f} (min: "
                  f"{times[0].min() / times[1].min():.3f}) target <= {TIME_TARGET:.2f} "
                  f"{'OK' if ratio <= TIME_TARGET else 'MISSED'}; bytes "
                  f"{'equal' if dg_bytes == ref_bytes else 'DIFFER'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
