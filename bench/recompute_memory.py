"""Peak activation memory of a training step with and without Strategy(recompute=True).

For GPT-tiny (the tutorials' model) and a 12-layer GPT, prints per configuration:
the planned peak (bytes of activations, gradients and temporaries alive at once,
freed after their last reader as the executor does: ``peak_activation_bytes``), the
peak measured by tracemalloc over one training step (after a warm-up step), the step
time (median of a few steps; noisy on a shared machine), and the ratios
recompute / plain measured in the same run.

    python bench/recompute_memory.py            # both models
    python bench/recompute_memory.py --quick    # GPT-tiny only
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc

import numpy as np

import distgraph as dg
from distgraph.passes.transforms.recompute import peak_activation_bytes

MODELS = {
    "GPT-tiny": dict(vocab_size=64, d_model=64, n_layer=2, n_head=4, max_seq_len=32, batch=16),
    "GPT-12L": dict(vocab_size=256, d_model=128, n_layer=12, n_head=4, max_seq_len=128,
                    batch=8),
}
MIB = float(1 << 20)


class Tokens:
    def __init__(self, n, seq, vocab):
        self.t = np.random.default_rng(0).integers(0, vocab, size=(n, seq + 1))

    def __len__(self):
        return len(self.t)

    def __getitem__(self, i):
        return self.t[i, :-1].astype(np.int64), self.t[i, 1:].astype(np.int64)


def measure(config: dict, recompute: bool, steps: int) -> dict:
    cfg = dict(config)
    batch = cfg.pop("batch")
    dg.seed(0)
    model = dg.nn.GPT(**cfg, dropout=0.1)
    engine = dg.Engine(model, dg.nn.CrossEntropyLoss(), dg.optim.AdamW(1e-3),
                       strategy=dg.Strategy(recompute=recompute))
    data = Tokens(batch, cfg["max_seq_len"], cfg["vocab_size"])
    engine.fit(data, batch_size=batch, verbose=0)                  # plan and warm up
    tracemalloc.start()
    tracemalloc.reset_peak()
    base, _ = tracemalloc.get_traced_memory()
    loss = engine.fit(data, batch_size=batch, epochs=2, verbose=0).losses[0]
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.fit(data, batch_size=batch, epochs=engine.epoch + 1, verbose=0)  # one more
        times.append(time.perf_counter() - start)
    return {"planned": peak_activation_bytes(engine.plan().program) / MIB,
            "measured": (peak - base) / MIB, "seconds": statistics.median(times),
            "loss": loss}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="GPT-tiny only")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    args = parser.parse_args(argv)
    names = ["GPT-tiny"] if args.quick else list(MODELS)
    print(f"{'model':<9} {'recompute':<9} {'planned MiB':>11} {'measured MiB':>12} "
          f"{'step s':>8}")
    for name in names:
        rows = {rc: measure(MODELS[name], rc, args.steps) for rc in (False, True)}
        if rows[False]["loss"] != rows[True]["loss"]:
            raise RuntimeError(f"{name}: recompute changed the loss: {rows[False]['loss']} vs "
                               f"{rows[True]['loss']}")
        for rc, r in rows.items():
            print(f"{name:<9} {str(rc):<9} {r['planned']:>11.2f} {r['measured']:>12.2f} "
                  f"{r['seconds']:>8.3f}")
        ratio = {k: rows[True][k] / rows[False][k] for k in ("planned", "measured", "seconds")}
        print(f"{name:<9} {'ratio':<9} {ratio['planned']:>11.2f} {ratio['measured']:>12.2f} "
              f"{ratio['seconds']:>8.2f}")


if __name__ == "__main__":
    main()
