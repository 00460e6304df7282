"""Completion benchmark: how the pass scales with program size.

Builds GPT training programs (forward + loss + backward + AdamW update) with 12, 24, 48
and 96 layers, annotated as in the semi-auto examples: the token input ``[dp, None]`` and,
in every block, ``qkv``/``fc1`` weights ``[None, mp]`` and ``proj``/``fc2`` weights
``[mp, None]`` on a 2x2 ``dp x mp`` mesh. d_model is small (64): only the op count matters.

Prints, per size, the op count and the wall and CPU seconds ``dg.passes.complete`` took
(best of ``--repeat`` runs, each on a freshly built program) with the garbage collector's
share of them, then the growth ratio of CPU seconds per op against the smallest size
(1.0 = linear), with and without that share. CPU time, because a shared machine's wall
time varies with its load; the collector's full collections scan the whole heap (the
program included), so their share grows with the program. Target: under 5 s for 96 layers on a 2-core
machine, near-linear growth.

Run: ``python bench/completion_scale.py [--layers 12 24 48 96] [--repeat 2]``
"""

from __future__ import annotations

import argparse
import gc
import time

import distgraph as dg
from distgraph.program_builder import build_program

MESH = dg.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])


class _Annotated(dg.nn.Layer):
    """The GPT with its input annotated ``[dp, None]``."""

    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt

    def forward(self, idx):
        dg.shard_tensor(idx, MESH, ["dp", None])
        return self.gpt(idx)


def gpt_program(n_layer: int, d_model: int = 64, seq: int = 32, batch: int = 4):
    """A freshly built, annotated GPT training program with ``n_layer`` blocks."""
    gpt = dg.nn.GPT(vocab_size=128, d_model=d_model, n_layer=n_layer, n_head=4,
                    max_seq_len=seq)
    for blk in gpt.blocks:
        dg.shard_tensor(blk.attn.qkv.weight, MESH, [None, "mp"])
        dg.shard_tensor(blk.attn.proj.weight, MESH, ["mp", None])
        dg.shard_tensor(blk.mlp.fc1.weight, MESH, [None, "mp"])
        dg.shard_tensor(blk.mlp.fc2.weight, MESH, ["mp", None])
    built = build_program(_Annotated(gpt), [dg.InputSpec([batch, seq], "int64", "tokens")],
                          [dg.InputSpec([batch, seq], "int64", "labels")],
                          dg.nn.CrossEntropyLoss(), dg.optim.AdamW(1e-3))
    return built.program


class _GcClock:
    """CPU seconds spent in the cyclic garbage collector while active."""

    def __init__(self):
        self.seconds, self._t0 = 0.0, 0.0

    def __call__(self, phase, info):
        if phase == "start":
            self._t0 = time.process_time()
        else:
            self.seconds += time.process_time() - self._t0

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


def time_completion(n_layer: int, repeat: int) -> tuple[int, float, float, float]:
    """(op count, wall s, CPU s, of which GC s) of completing a fresh program, best CPU
    time of ``repeat`` runs."""
    best, n_ops = (float("inf"),) * 3, 0
    for _ in range(repeat):
        prog = gpt_program(n_layer)
        n_ops = len(prog.ops)
        gc.collect()
        with _GcClock() as gc_clock:
            t0, c0 = time.perf_counter(), time.process_time()
            dg.passes.complete(prog)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if cpu < best[1]:
            best = (wall, cpu, gc_clock.seconds)
    return (n_ops,) + best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # 96 layers of this GPT are ~8,000 ops; 128 layers take the program past 10,000.
    ap.add_argument("--layers", type=int, nargs="+", default=[12, 24, 48, 96, 128])
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    rows = []
    print(f"{'layers':>6} {'ops':>7} {'seconds':>8} {'cpu_s':>7} {'gc_s':>6} {'us/op':>7} "
          f"{'growth':>7} {'no-gc':>6}")
    for n_layer in args.layers:
        n_ops, wall, cpu, gcs = time_completion(n_layer, args.repeat)
        rows.append((n_layer, n_ops, wall, cpu, gcs))
        _, n0, _, c0, g0 = rows[0]
        growth = (cpu / n_ops) / (c0 / n0)
        growth_nogc = ((cpu - gcs) / n_ops) / ((c0 - g0) / n0)
        print(f"{n_layer:>6} {n_ops:>7} {wall:>8.3f} {cpu:>7.3f} {gcs:>6.3f} "
              f"{1e6 * cpu / n_ops:>7.1f} {growth:>7.2f} {growth_nogc:>6.2f}", flush=True)
    (l0, n0, w0, c0, _), (l1, n1, w1, c1, _) = rows[0], rows[-1]
    print(f"{l1} vs {l0} layers: {n1 / n0:.1f}x ops, {w1 / w0:.1f}x seconds, {c1 / c0:.1f}x CPU "
          f"seconds (growth = CPU seconds per op against {l0} layers, 1.00 = linear; no-gc: "
          f"the same without the garbage collector's share)")
    print(f"{l1} layers: {w1:.2f} s wall, {c1:.2f} s CPU (target < 5 s)")


if __name__ == "__main__":
    main()
