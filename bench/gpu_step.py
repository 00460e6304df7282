"""A GPT training step on one GPU: distgraph on CuPy against PyTorch eager on the same GPU
(in the same run) and against distgraph on numpy.

    python bench/gpu_step.py [--steps 10] [--numpy-steps 1] [--amp] [--cluster FILE]
                             [--layers 12 --d-model 768 ...]

The model is GPT-2 small's shape: 12 layers, d_model 768, 12 heads, sequence 1024, batch
8, vocabulary 50257, fp32 (``--amp``: bf16 mixed precision, ``Strategy(amp="bfloat16")``
against ``torch.autocast``, float32 weights in both), AdamW; dropout 0. distgraph trains
it with ``Engine.fit`` on ``Cluster.local(1, device="GPU")`` (CuPy on GPU 0; ``--cluster``:
planned on a resource file's GPU instead, one ``distgraph cluster calibrate`` wrote);
PyTorch trains the same architecture
(nanoGPT's, its attention composed of matmul, mask and softmax as distgraph's is: eager,
no fused attention; ``--sdpa`` adds a run with ``scaled_dot_product_attention``) with
``torch.optim.AdamW``. Each framework warms up for one step, then ``--steps`` steps are
timed one by one (each ends with its loss on the host, which waits for the GPU); the
median counts. Peak GPU memory: the most bytes CuPy's pool had in use (an allocator that
records it) against ``torch.cuda.max_memory_allocated``. distgraph on numpy runs
``--numpy-steps`` steps on this machine's CPU (0 skips it; one step of the full model
takes minutes there).

Prints the step times, tokens/s, the ratio distgraph-CuPy / PyTorch throughput (target
>= 0.7), the speed-up over numpy and both peaks; for distgraph also the plan's predicted
step and peak beside the measured step, the runtime's count of the bytes it held at
its peak and CuPy's pool's. Without a GPU or CuPy it says so and
exits 0 (nothing to measure); without PyTorch it measures distgraph alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

import distgraph as dg
from distgraph.callbacks import Callback
from distgraph.resources.gpus import NoGPU, detect_gpus


class Tokens:
    """``n`` random sequences of ``seq`` tokens and their next tokens."""

    def __init__(self, n, seq, vocab, seed=0):
        self.t = np.random.default_rng(seed).integers(0, vocab, size=(n, seq + 1))

    def __len__(self):
        return len(self.t)

    def __getitem__(self, i):
        return self.t[i, :-1].astype(np.int64), self.t[i, 1:].astype(np.int64)


class StepClock(Callback):
    """Seconds of every step (its loss is on the host at its end: the GPU is done)."""

    def __init__(self):
        self.times, self._start = [], None

    def on_step_begin(self, step, logs=None):
        self._start = time.perf_counter()

    def on_step_end(self, step, logs=None):
        self.times.append(time.perf_counter() - self._start)


class PeakPool:
    """CuPy's default pool behind an allocator that records the most bytes in use."""

    def __init__(self, cupy):
        self.cupy, self.pool, self.peak = cupy, cupy.get_default_memory_pool(), 0

    def malloc(self, size):
        memory = self.pool.malloc(size)
        self.peak = max(self.peak, self.pool.used_bytes())
        return memory

    def __enter__(self):
        self.cupy.cuda.set_allocator(self.malloc)
        return self

    def __exit__(self, *exc):
        self.cupy.cuda.set_allocator(self.pool.malloc)
        self.pool.free_all_blocks()


def distgraph_steps(args, cluster, steps):
    """(seconds per timed step, engine) of distgraph on ``cluster`` (None: numpy)."""
    dg.seed(0)
    model = dg.nn.GPT(vocab_size=args.vocab, d_model=args.d_model, n_layer=args.layers,
                      n_head=args.heads, max_seq_len=args.seq)
    strategy = dg.Strategy(amp="bfloat16") if args.amp else dg.Strategy()
    engine = dg.Engine(model, dg.nn.CrossEntropyLoss(), dg.optim.AdamW(1e-4), cluster=cluster,
                       strategy=strategy)
    clock = StepClock()
    data = Tokens(args.batch * (steps + 1), args.seq, args.vocab)
    history = engine.fit(data, batch_size=args.batch, epochs=1, verbose=0, callbacks=[clock])
    return clock.times[1:], engine, history


def torch_steps(args, steps, sdpa=False):
    """(seconds per timed step, peak bytes) of the same GPT in PyTorch eager on cuda:0."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            d = args.d_model
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def attend(self, x):
            b, t, d = x.shape
            h = args.heads
            q, k, v = (y.view(b, t, h, d // h).transpose(1, 2)
                       for y in self.qkv(x).split(d, dim=2))
            if sdpa:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                att = (q @ k.transpose(-2, -1)) * (1.0 / (d // h) ** 0.5)
                mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
                y = att.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v
            return self.proj(y.transpose(1, 2).reshape(b, t, d))

        def forward(self, x):
            x = x + self.attend(self.ln1(x))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(args.vocab, args.d_model)
            self.wpe = nn.Embedding(args.seq, args.d_model)
            self.blocks = nn.ModuleList(Block() for _ in range(args.layers))
            self.ln_f = nn.LayerNorm(args.d_model)
            self.lm_head = nn.Linear(args.d_model, args.vocab, bias=False)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            return self.lm_head(self.ln_f(x))

    torch.manual_seed(0)
    device = torch.device("cuda:0")
    model = GPT().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    data = Tokens(args.batch * (steps + 1), args.seq, args.vocab)
    torch.cuda.reset_peak_memory_stats(device)
    times = []
    for s in range(steps + 1):
        start = time.perf_counter()
        rows = [data[i] for i in range(s * args.batch, (s + 1) * args.batch)]
        x = torch.from_numpy(np.stack([r[0] for r in rows])).to(device)
        y = torch.from_numpy(np.stack([r[1] for r in rows])).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.amp):
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, args.vocab).float(), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss.item()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device)
    del model, opt
    torch.cuda.empty_cache()
    return times[1:], peak


def model_arguments(parser) -> None:
    """The GPT's shape and batch (GPT-2 small's, batch 8, by default); bench/gpu_profile.py
    takes them too."""
    for flag, default in (("--layers", 12), ("--d-model", 768), ("--heads", 12),
                          ("--seq", 1024), ("--batch", 8), ("--vocab", 50257)):
        parser.add_argument(flag, type=int, default=default)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed GPU steps (default 10)")
    parser.add_argument("--numpy-steps", type=int, default=1,
                        help="timed steps of distgraph on numpy (0 skips it)")
    model_arguments(parser)
    parser.add_argument("--cluster", metavar="FILE",
                        help="plan on this resource file's GPU (one from `distgraph cluster "
                             "calibrate`) instead of Cluster.local(1, device='GPU')")
    parser.add_argument("--amp", action="store_true",
                        help="bf16 mixed precision: Strategy(amp='bfloat16') against "
                             "torch.autocast(bfloat16), float32 weights in both")
    parser.add_argument("--sdpa", action="store_true",
                        help="also time PyTorch with its fused attention")
    args = parser.parse_args(argv)
    try:
        gpus = detect_gpus("bench/gpu_step.py")
    except NoGPU as e:
        print(f"gpu_step: nothing to measure: {e}")
        return 0
    import cupy

    dg.set_default_dtype("float32")
    tokens = args.batch * args.seq
    print(f"gpu_step: GPT {args.layers} layers, d_model {args.d_model}, {args.heads} heads, "
          f"seq {args.seq}, batch {args.batch}, vocab {args.vocab}, "
          f"{'amp bf16' if args.amp else 'fp32'}, AdamW on {gpus[0].name}"
          f"{', planned on ' + args.cluster if args.cluster else ''}")
    with PeakPool(cupy) as pool:
        cluster = (dg.Cluster.from_file(args.cluster) if args.cluster
                   else dg.Cluster.local(1, device="GPU"))
        if any(d.type != "GPU" for d in cluster.devices):
            parser.error(f"--cluster {args.cluster}: its devices must be GPUs (this bench "
                         "times CuPy); give a file `distgraph cluster calibrate` wrote on a GPU")
        times, engine, history = distgraph_steps(args, cluster, args.steps)
    ours = statistics.median(times)
    estimate = engine.plan().estimate
    print(f"  distgraph, CuPy:   {ours * 1e3:9.1f} ms/step  {tokens / ours:10.0f} tokens/s  "
          f"peak {pool.peak / 2**30:6.2f} GiB")
    if estimate is None:
        print("    (no estimate: the plan was not priced)")
    else:
        print(f"    predicted step {estimate.step_time * 1e3:.1f} ms ({estimate.step_time / ours:.2f} x "
              f"measured); peak: predicted {estimate.peak_memory / 2**30:.2f} GiB, the "
              f"runtime's count {max(history.memory) / 2**30:.2f} GiB, CuPy's pool "
              f"{pool.peak / 2**30:.2f} GiB")
    rows = []
    try:
        import torch  # noqa: F401
        rows.append(("PyTorch eager", False))
        if args.sdpa:
            rows.append(("PyTorch eager, SDPA", True))
    except ImportError:
        print("  PyTorch: not installed (pip install torch): no comparison")
    for name, sdpa in rows:
        theirs, peak = torch_steps(args, args.steps, sdpa)
        t = statistics.median(theirs)
        print(f"  {name + ':':<19}{t * 1e3:9.1f} ms/step  {tokens / t:10.0f} tokens/s  "
              f"peak {peak / 2**30:6.2f} GiB")
        print(f"    distgraph / {name} throughput: {t / ours:.2f} (target >= 0.7 against "
              f"eager); peak memory {pool.peak / max(peak, 1):.2f} x theirs")
    if args.numpy_steps > 0:
        cpu, _, _ = distgraph_steps(args, None, args.numpy_steps)
        c = statistics.median(cpu)
        print(f"  distgraph, numpy:  {c * 1e3:9.1f} ms/step  {tokens / c:10.0f} tokens/s  "
              f"(CuPy is {c / ours:.1f} x faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
