"""Sharding-ILP benchmark: a GPT training step's problem at the size of the real one.

Builds, without tracing a model, the ILP that Alpa's formulation gives for a GPT training
step (forward, backward, AdamW update) on the ``gpu`` device mesh of
``hetero_2gpu_2xpu.yaml`` (2 x 4 A100s: 12.5 GB/s between the machines, 300 GB/s NVLink
inside). Every op is an einsum over named axes (b batch, s/t sequence, d model, h heads,
e head dim, f FFN, v vocab); its strategies assign each mesh dim to one splittable letter
of the op (b, d, h, f, v) or to none, as Alpa enumerates them. Costs come from the same
formulas the planner uses: compute = FLOPs / (split factor x device FLOP/s); comm = the
all-reduce of the output over mesh dims that split a contracted letter
(``passes/cost/formulas.collective_time`` with the mesh dim's bandwidth and latency); edge
R[i][j] = resharding the producer's layout i into the layout consumer strategy j needs
(all-gather, all-to-all or a free slice per mesh dim); memory = local output bytes, and
parameter + gradient + two Adam moments for parameters. Light ops (layer norms, GELU,
softmax, residual adds, bias-gradient sums) follow their main operand; every parameter
aliases its update. Liveness: each output lives from its op to its last consumer.

Part 1 (a small model): solves the unshared problem, the problem whose identical blocks
all share one choice (``share``) and the one where only the interior blocks (all but the
first and last) share; prints the objectives and their ratios to the unshared one.
Part 2 (24 layers, d_model 1024): the same three, with sizes, times, status and gaps;
then the shared problem with liveness, and under memory budgets of 80% and 60% of its
unconstrained peak (the latter fits nothing: the PlanError names the smallest peak).

Timings on a shared 2-core machine are noisy: SCIP runs on one thread, so the CPU
seconds printed beside the wall seconds are the steadier figure.

Run: ``python bench/ilp_scale.py [--layers 24] [--small-layers 4] [--time-limit 60]``
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import time
from functools import cache

import numpy as np

from distgraph.errors import PlanError
from distgraph.passes.cost.formulas import collective_time
from distgraph.passes.search.layouts.ilp import ShardingProblem, solve
from distgraph.resources.cluster import Cluster

CLUSTER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "resources",
                       "clusters", "hetero_2gpu_2xpu.yaml")
SPLITTABLE = "bdhfv"
BYTES = 4                       # float32


class GPTProblem:
    """Builds the node/edge lists of one GPT training step (see the module docstring)."""

    def __init__(self, mesh, flops, layers, batch=8, seq=1024, d_model=1024, heads=16,
                 vocab=50304):
        self.mesh_shape = mesh.shape
        self.links = list(zip(mesh.dim_bandwidths, mesh.dim_latencies))
        self.flops = flops
        self.size = {"b": batch, "s": seq, "t": seq, "d": d_model, "h": heads,
                     "e": d_model // heads, "f": 4 * d_model, "v": vocab}
        self.counts, self.compute, self.comm, self.memory, self.names = [], [], [], [], []
        self.out = []           # per node: (output letters, layout per strategy)
        self.edges, self.aliases, self.follow = [], [], []
        self.params: list[int] = []
        self.blocks: list[list[int]] = []      # per block, its nodes in creation order
        self._block = None                     # the block being built, if any
        self._build(layers)

    # ---- strategies and costs ---------------------------------------------------------
    def _assignments(self, letters):
        """Mesh dim -> letter (or None) assignments whose splits divide the sizes."""
        opts = [None] + [c for c in dict.fromkeys(letters) if c in SPLITTABLE]
        out = []
        for combo in itertools.product(opts, repeat=len(self.mesh_shape)):
            factor = {}
            for c, n in zip(combo, self.mesh_shape):
                if c is not None:
                    factor[c] = factor.get(c, 1) * n
            if all(self.size[c] % f == 0 for c, f in factor.items()):
                out.append(combo)
        return out

    def _split(self, combo, letters):
        return math.prod(n for c, n in zip(combo, self.mesh_shape)
                         if c is not None and c in letters)

    def _bytes(self, letters, combo=None):
        total = BYTES * math.prod(self.size[c] for c in letters)
        return total / (self._split(combo, letters) if combo is not None else 1)

    def _reshard(self, letters, src, dst):
        return _reshard_cost(tuple(self.size[c] for c in letters), src, dst, self.mesh_shape,
                             tuple(self.links))

    def _add(self, name, combos, out_letters, compute, comm, memory, leader=-1):
        v = len(self.counts)
        self.counts.append(len(combos))
        self.compute.append(compute)
        self.comm.append(comm)
        self.memory.append(memory)
        self.names.append(name)
        self.out.append((out_letters, [_restrict(combo, out_letters) for combo in combos]))
        self.follow.append(leader)
        if self._block is not None:
            self.blocks[self._block].append(v)
        return v

    def _edge(self, u, v, letters, combos):
        """u's output feeds v, which reads it with ``letters`` under each of ``combos``."""
        src_letters, layouts = self.out[u]
        rename = dict(zip(src_letters, letters))
        need = [_restrict(combo, letters) for combo in combos]
        R = [[self._reshard(letters, tuple(rename.get(c) for c in lay), nd) for nd in need]
             for lay in layouts]
        self.edges.append((u, v, R))

    def einsum(self, name, spec, a, b, dense=True):
        """A contraction ``"xy,yz->xz"`` of node outputs ``a`` and ``b`` (None: no
        producer); ``dense=False`` for a gather/scatter (embedding) costing its output."""
        ins, out = spec.split("->")
        la, lb = ins.split(",")
        letters = "".join(dict.fromkeys(la + lb))
        combos = self._assignments(letters)
        flops = 2 * math.prod(self.size[c] for c in (letters if dense else out))
        compute, comm = [], []
        for combo in combos:
            compute.append(flops / self._split(combo, letters if dense else out) / self.flops)
            local = self._bytes(out, combo)
            comm.append(sum(collective_time("all_reduce", n, local, bw, lat)
                            for c, n, (bw, lat) in zip(combo, self.mesh_shape, self.links)
                            if c is not None and c not in out))
        v = self._add(name, combos, out, compute, comm, [self._bytes(out, c) for c in combos])
        for src, letters_in in ((a, la), (b, lb)):
            if src is not None:
                self._edge(src, v, letters_in, combos)
        return v

    def follower(self, name, leader, letters, others=(), reduce=""):
        """A light op taking ``leader``'s strategy; ``others`` are more operands (edges);
        ``reduce`` lists letters it sums away (an all-reduce where they are split)."""
        # Every follower here reads its leader's output with the leader's own letters.
        combos = self.out[leader][1]
        elems = math.prod(self.size[c] for c in letters + reduce)
        compute = [10 * elems / self._split(c, letters + reduce) / self.flops for c in combos]
        comm = [sum(collective_time("all_reduce", n, self._bytes(letters, c), bw, lat)
                    for x, n, (bw, lat) in zip(c, self.mesh_shape, self.links)
                    if x is not None and x in reduce) for c in combos]
        v = self._add(name, combos, letters, compute, comm,
                      [self._bytes(letters, c) for c in combos], leader)
        for src, lets in others:
            self._edge(src, v, lets, combos)
        return v

    def parameter(self, name, letters):
        """A parameter node (param, grad and two Adam moments) and its update's node."""
        combos = self._assignments(letters)
        zero = [0.0] * len(combos)
        p = self._add(name, combos, letters, zero, zero,
                      [4 * self._bytes(letters, c) for c in combos])
        self.params.append(p)
        return p, combos

    def update(self, param, combos, grad, letters):
        name = self.names[param] + "@update"
        u = self._add(name, combos, letters, [3 * self._bytes(letters, c) / BYTES / self.flops
                                              for c in combos], [0.0] * len(combos),
                      [0.0] * len(combos))
        self._edge(grad, u, letters, combos)
        self.aliases.append((param, u, 1 - np.eye(len(combos), dtype=int)))

    # ---- the model ----------------------------------------------------------------------
    def _build(self, layers):
        wte, wte_c = self.parameter("wte", "vd")
        x = self.einsum("embedding", "bsv,vd->bsd", None, wte, dense=False)
        saved = []
        for i in range(layers):
            self.blocks.append([])
            self._block = i
            saved.append(self._block_forward(f"blocks.{i}", x))
            x = saved[-1]["out"]
            self._block = None
        lnf = self.follower("ln_f", x, "bsd", reduce="")
        head, head_c = self.parameter("lm_head.weight", "dv")
        logits = self.einsum("lm_head", "bsd,dv->bsv", lnf, head)
        loss = self.follower("cross_entropy", logits, "bsv")
        g = self.einsum("lm_head@dx", "bsv,dv->bsd", loss, head)
        dhead = self.einsum("lm_head@dw", "bsd,bsv->dv", lnf, loss)
        g = self.follower("ln_f@grad", g, "bsd", others=[(x, "bsd")])
        updates = [(head, head_c, dhead, "dv")]
        for i in reversed(range(layers)):
            self._block = i
            g, ups = self._block_backward(f"blocks.{i}", saved[i], g)
            updates += ups
            self._block = None
        dwte = self.einsum("wte@dw", "bsv,bsd->vd", None, g, dense=False)
        updates.append((wte, wte_c, dwte, "vd"))
        for i in range(layers):
            self._block = i
            for p, combos, grad, letters in updates:
                if self.names[p].startswith(f"blocks.{i}."):
                    self.update(p, combos, grad, letters)
            self._block = None
        for p, combos, grad, letters in updates:
            if not self.names[p].startswith("blocks."):
                self.update(p, combos, grad, letters)

    def _block_forward(self, pre, x):
        s = {"in": x}
        for name, letters in (("ln1.weight", "d"), ("ln1.bias", "d"), ("ln2.weight", "d"),
                              ("ln2.bias", "d"), ("q.weight", "dhe"), ("k.weight", "dhe"),
                              ("v.weight", "dhe"), ("q.bias", "he"), ("k.bias", "he"),
                              ("v.bias", "he"), ("proj.weight", "hed"), ("proj.bias", "d"),
                              ("fc1.weight", "df"), ("fc1.bias", "f"), ("fc2.weight", "fd"),
                              ("fc2.bias", "d")):
            s[name] = self.parameter(f"{pre}.{name}", letters)
        s["ln1"] = self.follower(f"{pre}.ln1", x, "bsd", others=[(s["ln1.weight"][0], "d"),
                                                                 (s["ln1.bias"][0], "d")])
        for n in "qkv":
            s[n] = self.einsum(f"{pre}.{n}", "bsd,dhe->bshe", s["ln1"], s[f"{n}.weight"][0])
            s[n] = self.follower(f"{pre}.{n}+bias", s[n], "bshe",
                                 others=[(s[f"{n}.bias"][0], "he")])
        s["scores"] = self.einsum(f"{pre}.scores", "bshe,bthe->bhst", s["q"], s["k"])
        s["softmax"] = self.follower(f"{pre}.softmax", s["scores"], "bhst")
        s["ctx"] = self.einsum(f"{pre}.ctx", "bhst,bthe->bshe", s["softmax"], s["v"])
        s["proj"] = self.einsum(f"{pre}.proj", "bshe,hed->bsd", s["ctx"], s["proj.weight"][0])
        s["proj"] = self.follower(f"{pre}.proj+bias", s["proj"], "bsd",
                                  others=[(s["proj.bias"][0], "d")])
        s["add1"] = self.follower(f"{pre}.add1", s["proj"], "bsd", others=[(x, "bsd")])
        s["ln2"] = self.follower(f"{pre}.ln2", s["add1"], "bsd",
                                 others=[(s["ln2.weight"][0], "d"), (s["ln2.bias"][0], "d")])
        s["fc1"] = self.einsum(f"{pre}.fc1", "bsd,df->bsf", s["ln2"], s["fc1.weight"][0])
        s["gelu"] = self.follower(f"{pre}.gelu", s["fc1"], "bsf",
                                  others=[(s["fc1.bias"][0], "f")])
        s["fc2"] = self.einsum(f"{pre}.fc2", "bsf,fd->bsd", s["gelu"], s["fc2.weight"][0])
        s["fc2"] = self.follower(f"{pre}.fc2+bias", s["fc2"], "bsd",
                                 others=[(s["fc2.bias"][0], "d")])
        s["out"] = self.follower(f"{pre}.add2", s["fc2"], "bsd", others=[(s["add1"], "bsd")])
        return s

    def _block_backward(self, pre, s, g):
        E, F = self.einsum, self.follower
        ups = []

        def bias_grad(name, grad, letters):
            ups.append((*s[name], F(f"{pre}.{name}@grad", grad, letters, reduce="bs"), letters))

        def grads(name, spec, a, b, g_out, weight):
            """dA and dB of ``a, b -> out`` given the output's gradient."""
            ins, out = spec.split("->")
            la, lb = ins.split(",")
            da = E(f"{pre}.{name}@da", f"{out},{lb}->{la}", g_out, b)
            db = E(f"{pre}.{name}@db", f"{la},{out}->{lb}", a, g_out)
            if weight:
                p, combos = s[weight]
                ups.append((p, combos, db, lb))
            return da, db

        d_gelu, _ = grads("fc2", "bsf,fd->bsd", s["gelu"], s["fc2.weight"][0], g, "fc2.weight")
        d_fc1 = F(f"{pre}.gelu@grad", d_gelu, "bsf", others=[(s["fc1"], "bsf")])
        bias_grad("fc2.bias", g, "d")
        bias_grad("fc1.bias", d_fc1, "f")
        d_ln2, _ = grads("fc1", "bsd,df->bsf", s["ln2"], s["fc1.weight"][0], d_fc1, "fc1.weight")
        d_add1 = F(f"{pre}.ln2@grad", d_ln2, "bsd", others=[(s["add1"], "bsd")])
        bias_grad("ln2.weight", d_add1, "d")
        bias_grad("ln2.bias", d_add1, "d")
        g_mid = F(f"{pre}.add1@grad", d_add1, "bsd", others=[(g, "bsd")])
        bias_grad("proj.bias", g_mid, "d")
        d_ctx, _ = grads("proj", "bshe,hed->bsd", s["ctx"], s["proj.weight"][0], g_mid,
                         "proj.weight")
        d_sm, d_v = grads("ctx", "bhst,bthe->bshe", s["softmax"], s["v"], d_ctx, None)
        d_scores = F(f"{pre}.softmax@grad", d_sm, "bhst", others=[(s["softmax"], "bhst")])
        d_q, d_k = grads("scores", "bshe,bthe->bhst", s["q"], s["k"], d_scores, None)
        bias_grad("q.bias", d_q, "he")
        bias_grad("k.bias", d_k, "he")
        bias_grad("v.bias", d_v, "he")
        dx = []
        for n, d in (("q", d_q), ("k", d_k), ("v", d_v)):
            dx.append(grads(n, "bsd,dhe->bshe", s["ln1"], s[f"{n}.weight"][0], d,
                            f"{n}.weight")[0])
        d_ln1 = F(f"{pre}.dx_sum", dx[0], "bsd", others=[(dx[1], "bsd"), (dx[2], "bsd")])
        d_in = F(f"{pre}.ln1@grad", d_ln1, "bsd", others=[(s["in"], "bsd")])
        bias_grad("ln1.weight", d_in, "d")
        bias_grad("ln1.bias", d_in, "d")
        return F(f"{pre}.add2@grad", d_in, "bsd", others=[(g_mid, "bsd")]), ups

    # ---- the problem --------------------------------------------------------------------
    def liveness(self):
        last = list(range(len(self.counts)))
        for u, v, _ in self.edges:
            last[u] = max(last[u], v)
        for v, lead in enumerate(self.follow):
            if lead != -1:
                last[lead] = max(last[lead], v)
        for p in self.params:
            last[p] = len(self.counts) - 1
        live, sets = set(), []
        ends: dict[int, list[int]] = {}
        for v, end in enumerate(last):
            ends.setdefault(end, []).append(v)
        for t in range(len(self.counts)):
            live.add(t)
            sets.append(sorted(live))
            live.difference_update(ends.get(t, ()))
        return sets

    def problem(self, share=None, budget=None, liveness=None):
        """``share``: None, "all" blocks tied, or "interior" (all but the first and last)."""
        blocks = {None: [], "all": self.blocks, "interior": self.blocks[1:-1]}[share]
        return ShardingProblem(self.counts, self.compute, self.comm, self.memory,
                               edges=self.edges, aliases=self.aliases, follow=self.follow,
                               liveness=liveness or [], memory_budget=budget,
                               share=list(zip(*blocks)) if len(blocks) > 1 else (),
                               names=self.names)


def _restrict(combo, letters):
    """The layout a tensor with ``letters`` gets from a mesh-dim -> letter assignment."""
    return tuple(c if c is not None and c in letters else None for c in combo)


@cache
def _reshard_cost(shape, src, dst, mesh_shape, links):
    """Seconds to turn layout ``src`` into ``dst`` (per mesh dim: the letter it splits,
    or None), one mesh dim at a time: same -> free, split -> replicated all-gather,
    replicated -> split a local slice, split -> other split all-to-all."""
    local = BYTES * math.prod(shape)
    for c, n in zip(src, mesh_shape):
        if c is not None:
            local /= n
    total = 0.0
    for a, b, n, (bw, lat) in zip(src, dst, mesh_shape, links):
        if a == b or a is None:
            continue
        if b is None:
            total += collective_time("all_gather", n, local * n, bw, lat)
            local *= n
        else:
            total += collective_time("all_to_all", n, local, bw, lat)
    return total


def run(label, problem, time_limit):
    cpu = time.process_time()
    try:
        sol = solve(problem, time_limit=time_limit)
    except PlanError as err:
        print(f"  {label:<30} PlanError after {time.process_time() - cpu:.1f} s CPU: {err}")
        return None
    cpu = time.process_time() - cpu
    peak = f"{sol.peak_memory / 1e9:5.2f} GB" if problem.liveness else "   -    "
    print(f"  {label:<30} {sol.status:<10} objective {sol.objective * 1e3:8.3f} ms  "
          f"gap {sol.gap:.2g}  peak {peak}  {sol.solve_time:6.2f} s wall {cpu:6.2f} s CPU  "
          f"({sol.variables} vars, {sol.constraints} cons)")
    return sol


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--small-layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--time-limit", type=float, default=60.0)
    args = ap.parse_args()
    mesh = Cluster.from_file(CLUSTER).device_mesh("gpu")
    flops = 19500e9
    print(f"mesh {mesh}")

    print(f"\nPart 1: {args.small_layers}-layer GPT (d_model {args.d_model}): shared vs unshared")
    small = GPTProblem(mesh, flops, args.small_layers, d_model=args.d_model)
    print(f"  {len(small.counts)} nodes, {len(small.edges)} edges, {len(small.aliases)} aliases, "
          f"{sum(f == -1 for f in small.follow)} free nodes")
    free = run("unshared", small.problem(), args.time_limit)
    shared = run("all blocks shared", small.problem(share="all"), args.time_limit)
    inner = run("interior blocks shared", small.problem(share="interior"), args.time_limit)
    print(f"  objective / unshared: all blocks shared {shared.objective / free.objective:.4f}, "
          f"interior blocks shared {inner.objective / free.objective:.4f}")

    print(f"\nPart 2: {args.layers}-layer GPT (d_model {args.d_model})")
    t0 = time.perf_counter()
    big = GPTProblem(mesh, flops, args.layers, d_model=args.d_model)
    live = big.liveness()
    built = time.perf_counter() - t0
    print(f"  {len(big.counts)} nodes ({sum(f == -1 for f in big.follow)} free), strategies "
          f"{min(big.counts)}-{max(big.counts)}, {len(big.edges)} edges, {len(big.aliases)} "
          f"aliases, {len(live)} liveness sets; generated in {built:.1f} s")
    t0 = time.perf_counter()
    shared = run("all blocks shared", big.problem(share="all"), args.time_limit)
    print(f"  (ShardingProblem construction + solve {time.perf_counter() - t0:.2f} s)")
    inner = run("interior blocks shared", big.problem(share="interior"), args.time_limit)
    free = run("unshared", big.problem(), args.time_limit)
    print(f"  objective / unshared: all blocks shared {shared.objective / free.objective:.4f}, "
          f"interior blocks shared {inner.objective / free.objective:.4f}")
    with_live = run("shared + liveness", big.problem(share="all", liveness=live),
                    args.time_limit)
    for fraction in (0.8, 0.6):
        budget = fraction * with_live.peak_memory
        tight = run(f"shared, budget {fraction:.0%} of peak", big.problem(
            share="all", budget=budget, liveness=live), args.time_limit)
        if tight is not None:
            print(f"    objective / without budget {tight.objective / with_live.objective:.4f}")


if __name__ == "__main__":
    main()
