"""One training step of a Mixtral-style MoE block on 4 MPI ranks, expert parallel (ep 4):
distgraph's plan and runtime against a hand-written mpi4py + numpy expert-parallel step,
and the all-to-alls' measured time against the cost model's price for them.

Run: ``python bench/moe_step.py [--calibration FILE] [--steps N]``

The parent calibrates this machine for 4 ranks (``distgraph cluster calibrate -n 4``;
``--calibration`` reuses a file), then starts the job on 4 ranks (``distgraph run -n 4``)
and prints what its rank 0 measured.

The block: ``x + moe(rms_norm(x))``, Mixtral's post-attention norm and sparse MoE block
(:class:`distgraph.nn.mixtral.MixtralSparseMoeBlock`): router (Linear d -> 8, softmax,
top-2, weights renormalised) and 8 SwiGLU experts (d 512, intermediate ``--intermediate``,
default 1024), batch 8 x seq 256, float32, dropless, MSE loss against a random target,
SGD. distgraph: the experts' stacked weights ``[ep, None, None]`` and the input
``[ep, None, None]`` on mesh ``ep`` = [0, 1, 2, 3], planned by ``dg.passes.plan`` on the
calibrated file and run by a ``PlanRunner`` over an ``MPICommunicator``; the rest is
completion's. The reference, per rank, on the same data: its 2 sequences and its 2
experts; router, top-2, ``Alltoall`` of the counts, ``Alltoallv`` of the tokens, the
experts' SwiGLU, ``Alltoallv`` back, the weighted combine; the backward sends each
assignment's output gradient to its expert (``Alltoallv``), runs the SwiGLU backward on
the activations its forward kept (as distgraph's kernels keep theirs,
``KernelContext.saved``), and sends the input gradients back (``Alltoallv``);
each assignment's weight gradient is its expert output (kept from the forward) dotted with
the output gradient; the router's and the norm's weight gradients are all-reduced.

Before timing, one step of each from the same start must give the same global parameters
(float32, rtol 1e-4) and loss. Then the two alternate step by step; a step's time is the
slowest rank's; rank 0 prints the medians and the ratio (target <= 1.15).

The all-to-alls: distgraph's step runs again on a communicator that times each of its
all-to-alls (the collective only: the group first meets at a barrier, not timed), the
slowest rank's sum per step, against the plan's price for the same collectives (the
``moe_ffn`` and ``moe_ffn_grad`` ops' ``comm`` at the balanced load: the counts'
exchange, and the rows' ``all_to_allv`` there and back in the forward and in the
gradient, priced by ``distgraph.passes.cost.prices.op_comm_time`` on the calibrated file,
whose ``all_to_allv`` software cost the calibration measured as the dispatch meets it:
the counts' exchange among its sizes, each batch of calls at its slowest rank): within
25%.

Timings on a shared 2-core machine are noisy (4 ranks share 2 cores): compare the numbers
of one run.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

from bench_jobs import calibrated, rows_from_ranks, timed, write_rows  # bench/ on the path

WORLD, BATCH, SEQ, D, EXPERTS, TOP_K = 4, 8, 256, 512, 8, 2
LR, EPS = 1e-2, 1e-6
TIME_TARGET, PRICE_TARGET = 1.15, 0.25


# -- distgraph -----------------------------------------------------------------------------------
def build_block(inner: int):
    import distgraph as dg
    from distgraph.nn.llama import RMSNorm
    from distgraph.nn.mixtral import MixtralConfig, MixtralSparseMoeBlock

    mesh = dg.ProcessMesh(list(range(WORLD)), dim_names=["ep"])
    config = MixtralConfig(vocab_size=8, hidden_size=D, intermediate_size=inner,
                           num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=8,
                           num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                           initializer_range=0.05, rms_norm_eps=EPS)

    class Block(dg.nn.Layer):
        def __init__(self):
            super().__init__()
            self.norm = RMSNorm(D, EPS)
            self.moe = MixtralSparseMoeBlock(config)
            for w in (self.moe.experts.gate_proj, self.moe.experts.up_proj,
                      self.moe.experts.down_proj):
                dg.shard_tensor(w, mesh, ["ep", None, None])

        def forward(self, x):
            dg.shard_tensor(x, mesh, ["ep", None, None])
            y, _ = self.moe(self.norm(x))
            return x + y

    dg.seed(0)
    return Block()


class Timed:
    """Wraps an MPICommunicator: each all-to-all first meets its group at a barrier (not
    timed), then is timed; ``spent`` sums the seconds."""

    def __init__(self, comm):
        self.inner, self.spent, self.calls = comm, 0.0, []
        for name in ("_all_to_all", "_all_to_allv"):
            setattr(comm, name, self._wrap(getattr(comm, name)))

    def _wrap(self, fn):
        def call(arr, *args):
            group = args[-1] if fn.__name__ == "_all_to_allv" else args[0]
            self.inner._sub(group).Barrier()
            start = time.perf_counter()
            out = fn(arr, *args)
            self.calls.append(time.perf_counter() - start)
            self.spent += self.calls[-1]
            return out
        call.__name__ = fn.__name__
        return call


class Distgraph:
    def __init__(self, comm, cluster, inner, x, y):
        import distgraph as dg
        from distgraph.program_builder import build_program
        from distgraph.runtime.execution.runner import PlanRunner

        model = build_block(inner)
        spec, opt = [BATCH, SEQ, D], dg.optim.SGD(LR)
        self.built = build_program(model, [dg.InputSpec(spec, "float32", "x")],
                                   [dg.InputSpec(spec, "float32", "y")],
                                   dg.nn.MSELoss(), opt)
        self.plan = dg.passes.plan(self.built, cluster=cluster)
        self.runner = PlanRunner(self.plan, comm)
        self.params = {n: p.numpy() for n, p in model.named_parameters()}
        self.scope = self.runner.shard_scope({**self.params,
                                              **opt.initial_state(self.plan.program)})
        x_attr = self.plan.program.values["x"].dist_attr
        self.rows = x_attr.local_slices(tuple(spec), comm.rank)[0]
        self.feed = {"x": np.ascontiguousarray(x[self.rows]),
                     "y": np.ascontiguousarray(y[self.rows])}
        self.t = 0

    def step(self) -> float:
        out = self.runner.run(self.scope, self.feed, self.t, local=True)
        self.t += 1
        return float(out[self.built.loss_name])

    def gathered(self) -> dict:
        return self.runner.gather(self.scope, list(self.params))

    def priced_all_to_alls(self, cluster) -> tuple[float, list]:
        """(seconds, [(op, kind, n, buffer bytes, seconds)]): the plan's price of the
        all-to-alls its MoE ops run on process 0, on ``cluster``."""
        from distgraph.passes.cost.prices import Rings, op_comm_time

        plan, pid = self.plan, 0
        local = plan.local_alike(pid)
        devices = cluster.devices
        rings = Rings(cluster, lambda q: devices[plan.ranks(q)].global_id)
        device = rings.device(pid)
        seconds, listed = 0.0, []
        for index, collectives in local.op_comm.items():
            op = local.program.ops[index]
            ring = rings.of_op(op.dist_attr.mesh, pid, local.op_context.get(index))
            seconds += op_comm_time(collectives, ring, device)
            listed += [(op.type, kind, n, nbytes, op_comm_time([(kind, n, nbytes)], ring, device))
                       for kind, n, nbytes in collectives]
        return seconds, listed


# -- the hand-written reference --------------------------------------------------------------------
class Reference:
    """This rank's sequences and experts; the step written with numpy and mpi4py."""

    def __init__(self, comm, params, x, y):
        from mpi4py import MPI
        self.MPI, self.comm = MPI, comm
        r, n = comm.Get_rank(), comm.Get_size()
        self.local = EXPERTS // n
        rows = slice(r * BATCH // n, (r + 1) * BATCH // n)
        self.x = np.ascontiguousarray(x[rows]).reshape(-1, D)
        self.y = np.ascontiguousarray(y[rows]).reshape(-1, D)
        ex = slice(r * self.local, (r + 1) * self.local)
        self.p = {"norm": params["norm.weight"].copy(),
                  "router": params["moe.gate.weight"].copy(),
                  "gate": params["moe.experts.gate_proj"][ex].copy(),
                  "up": params["moe.experts.up_proj"][ex].copy(),
                  "down": params["moe.experts.down_proj"][ex].copy()}
        self.scale = np.float32(2.0 / (BATCH * SEQ * D))

    def _alltoallv(self, buf, send, recv):
        out = np.empty((int(recv.sum()), buf.shape[1]), buf.dtype)
        w = buf.shape[1]
        self.comm.Alltoallv((buf, (send * w, np.concatenate([[0], np.cumsum(send)[:-1]]) * w)),
                            (out, (recv * w, np.concatenate([[0], np.cumsum(recv)[:-1]]) * w)))
        return out

    def step(self) -> float:
        p, x, f32 = self.p, self.x, np.float32
        t = len(x)
        # forward: norm, router, top-2
        rstd = 1.0 / np.sqrt(np.mean(x * x, axis=1) + f32(EPS))
        xhat = x * rstd[:, None]
        xn = xhat * p["norm"]
        logits = xn @ p["router"]
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs = e / e.sum(axis=1, keepdims=True)
        ids = np.argsort(-probs, axis=1, kind="stable")[:, :TOP_K]
        top = np.take_along_axis(probs, ids, axis=1)
        tsum = top.sum(axis=1, keepdims=True)
        w = top / tsum
        # dispatch: the counts, then each assignment's token row, in expert order
        flat = ids.ravel()
        order = np.argsort(flat, kind="stable")
        tok, slot = order // TOP_K, order % TOP_K
        counts = np.bincount(flat, minlength=EXPERTS).astype(np.int64).reshape(-1, self.local)
        got = np.empty_like(counts)
        self.comm.Alltoall(counts, got)
        send, recv = counts.sum(axis=1), got.sum(axis=1)
        xs_all = self._alltoallv(xn[tok], send, recv)
        starts = np.concatenate([[0], np.cumsum(got.ravel())])
        index = [np.concatenate([np.arange(starts[q * self.local + j],
                                           starts[q * self.local + j + 1])
                                 for q in range(len(got))]) for j in range(self.local)]
        results = np.empty_like(xs_all)
        kept = []
        for j, idx in enumerate(index):
            xs = xs_all[idx]
            g, u = xs @ p["gate"][j], xs @ p["up"][j]
            sig = f32(0.5) + f32(0.5) * np.tanh(f32(0.5) * g)
            act = g * sig
            h = act * u
            results[idx] = h @ p["down"][j]
            kept.append((xs, g, u, sig, act, h))
        out = self._alltoallv(results, recv, send)              # [assignments, D], order
        wa = w[tok, slot]
        yk = np.empty((t, TOP_K, D), f32)
        yk[tok, slot] = out * wa[:, None]
        diff = x + yk.sum(axis=1) - self.y
        loss = np.array(np.vdot(diff, diff), dtype=f32)
        self.comm.Allreduce(self.MPI.IN_PLACE, loss, op=self.MPI.SUM)
        # backward
        dy = diff * self.scale
        dya = dy[tok]
        dw = np.empty((t, TOP_K), f32)
        dw[tok, slot] = np.einsum("ad,ad->a", out, dya)
        d_out = self._alltoallv(dya * wa[:, None], send, recv)
        dxs_all = np.empty_like(d_out)
        grads = {k: np.empty_like(p[k]) for k in ("gate", "up", "down")}
        for j, idx in enumerate(index):
            xs, g, u, sig, act, h = kept[j]
            do = d_out[idx]
            grads["down"][j] = h.T @ do
            dh = do @ p["down"][j].T
            du = dh * act
            dg = dh * u * sig * (1 + g * (1 - sig))
            grads["gate"][j], grads["up"][j] = xs.T @ dg, xs.T @ du
            dxs_all[idx] = dg @ p["gate"][j].T + du @ p["up"][j].T
        dxa = self._alltoallv(dxs_all, recv, send)
        dxk = np.empty((t, TOP_K, D), f32)
        dxk[tok, slot] = dxa
        dxn = dxk.sum(axis=1)
        # router: renormalisation, top-2 scatter, softmax
        dtop = (dw - (dw * w).sum(axis=1, keepdims=True)) / tsum
        dprobs = np.zeros_like(probs)
        np.put_along_axis(dprobs, ids, dtop, axis=1)
        dlogits = probs * (dprobs - (dprobs * probs).sum(axis=1, keepdims=True))
        grads["router"] = xn.T @ dlogits
        dxn += dlogits @ p["router"].T
        grads["norm"] = (dxn * xhat).sum(axis=0)
        for k in ("router", "norm"):
            self.comm.Allreduce(self.MPI.IN_PLACE, grads[k], op=self.MPI.SUM)
        for k, g in grads.items():
            g *= f32(LR)
            p[k] -= g
        return float(loss) / (BATCH * SEQ * D)

    def gathered(self) -> dict:
        out = {"norm.weight": self.p["norm"], "moe.gate.weight": self.p["router"]}
        for k, name in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            out[f"moe.experts.{name}"] = np.concatenate(self.comm.allgather(self.p[k]))
        return out


# -- the job --------------------------------------------------------------------------------------
def measure_rank(cluster_file: str, inner: int, steps: int, warmup: int) -> list:
    from mpi4py import MPI

    import distgraph as dg
    from distgraph.runtime.comm.mpi import MPICommunicator

    world = MPI.COMM_WORLD
    comm = MPICommunicator()
    cluster = dg.Cluster.from_file(cluster_file)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, SEQ, D)).astype(np.float32)
    y = rng.standard_normal((BATCH, SEQ, D)).astype(np.float32)
    dgs = Distgraph(comm, cluster, inner, x, y)
    ref = Reference(world, dgs.params, x, y)
    dg_loss, ref_loss = dgs.step(), ref.step()
    got, want = dgs.gathered(), ref.gathered()
    if world.Get_rank() == 0:
        np.testing.assert_allclose(dg_loss, ref_loss, rtol=1e-5, err_msg="loss")
        for k, v in want.items():
            np.testing.assert_allclose(got[k], v, rtol=1e-4, atol=1e-6,
                                       err_msg=f"{k} after one step")
    times = timed([dgs.step, ref.step], steps, warmup, world)
    probe = Timed(comm)
    spent, calls = [], []
    for _ in range(steps):
        probe.spent, probe.calls = 0.0, []
        dgs.step()
        spent.append(world.allreduce(probe.spent, op=MPI.MAX))
        calls.append(np.max(world.allgather(probe.calls), axis=0).tolist())
    priced, listed = dgs.priced_all_to_alls(cluster)
    if world.Get_rank() != 0:
        return []
    return [{"distgraph": times[0].tolist(), "reference": times[1].tolist(),
             "all_to_all_measured": spent, "all_to_all_priced": priced,
             "each_measured": np.median(calls, axis=0).tolist(),
             "collectives": listed, "inner": inner,
             "summary": dgs.runner.local.pretty().splitlines()[0]}]


def report(row: dict) -> None:
    dg_t, ref_t = np.median(row["distgraph"]), np.median(row["reference"])
    ratio = dg_t / ref_t
    print(f"Mixtral-style block x + moe(rms_norm(x)): d {D}, {EXPERTS} experts (intermediate "
          f"{row['inner']}), top-{TOP_K}, batch {BATCH} x seq {SEQ}, float32, dropless, SGD; "
          f"{WORLD} ranks, ep {WORLD}; same parameters after one step: OK")
    print(f"  distgraph {row['summary']}")
    print(f"  distgraph  median {dg_t * 1e3:8.1f} ms/step   min {min(row['distgraph']) * 1e3:8.1f}")
    print(f"  reference  median {ref_t * 1e3:8.1f} ms/step   min {min(row['reference']) * 1e3:8.1f}")
    print(f"  time ratio distgraph/reference: {ratio:.3f} (min: "
          f"{min(row['distgraph']) / min(row['reference']):.3f}) target <= {TIME_TARGET:.2f} "
          f"{'OK' if ratio <= TIME_TARGET else 'MISSED'}")
    measured, priced = np.median(row["all_to_all_measured"]), row["all_to_all_priced"]
    err = abs(priced - measured) / measured
    print("  all-to-alls per step, process 0's (kind, buffer: priced / measured ms):")
    for (op, kind, n, nbytes, price), got in zip(row["collectives"], row["each_measured"]):
        print(f"    {op:<13} {kind:<12} n={n} {nbytes / 2**10:6.0f} KiB: {price * 1e3:7.2f} / "
              f"{got * 1e3:7.2f}")
    print(f"  measured (median, slowest rank) {measured * 1e3:.2f} ms, priced {priced * 1e3:.2f}"
          f" ms: |priced - measured| / measured = {err:.3f}, target <= {PRICE_TARGET:.2f} "
          f"{'OK' if err <= PRICE_TARGET else 'MISSED'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", help="a resource file calibrated for 4 ranks")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--rank-output", help=argparse.SUPPRESS)
    parser.add_argument("--cluster", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_output:                       # inside the 4-rank job
        write_rows(args.rank_output, measure_rank(args.cluster, args.intermediate,
                                                  args.steps, args.warmup))
        return
    with tempfile.TemporaryDirectory() as tmp:
        cluster = os.path.abspath(calibrated(WORLD, args.calibration, tmp))
        rows = rows_from_ranks(WORLD, __file__, [
            "--cluster", cluster, "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--intermediate", str(args.intermediate)], tmp)
        report(rows[0])


if __name__ == "__main__":
    sys.exit(main())
