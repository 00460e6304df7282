"""One AdamW training step of a Llama block stack through distgraph versus PyTorch eager.

The model: transformers' ``LlamaForCausalLM`` with hidden 1024, 8 heads, 2 key/value
heads, intermediate 2816, ``--layers`` decoder layers (default 4), a vocabulary of 512
(the stack dominates), sequence 256, batch ``--batch`` (default 2), float32, mean
next-token cross-entropy, AdamW. transformers makes it and saves it; distgraph loads the
same folder (``dg.from_pretrained``) and runs its planned training step on one process
(``PlanRunner``, as the Engine does); PyTorch runs the model with eager attention
(``attn_implementation="eager"``: the same ops) and ``torch.optim.AdamW``. Both in this
process, interleaved, on the same batch, both with ``--threads`` BLAS threads (default
1: set before numpy and torch load). Before timing it checks one step of each gives the
same loss.

Prints the median time per step of each and the ratio against the target (distgraph
<= 1.10 x torch). ``--amp`` also times distgraph's bfloat16 step (``Strategy(amp=
"bfloat16")``) against its float32 step.

Run: ``python bench/llama_step.py [--steps N] [--layers L] [--threads T] [--amp]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

TARGET = 1.10
HIDDEN, HEADS, KV_HEADS, FF, SEQ, VOCAB = 1024, 8, 2, 2816, 256, 512
LR = 1e-4


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps of each")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--amp", action="store_true", help="also time the bfloat16 step")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse(argv)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    import numpy as np
    import torch
    import transformers

    import distgraph as dg
    from distgraph.program_builder import build_program
    from distgraph.runtime.execution.runner import PlanRunner

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN,
                                      intermediate_size=FF, num_hidden_layers=args.layers,
                                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                      max_position_embeddings=SEQ, rope_theta=500000.0)
    config._attn_implementation = "eager"
    reference = transformers.LlamaForCausalLM(config).float().train()
    folder = tempfile.mkdtemp(prefix="llama-step-")
    reference.save_pretrained(folder)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01)
    ids = np.random.default_rng(0).integers(0, VOCAB, (args.batch, SEQ + 1))
    x, y = torch.tensor(ids[:, :-1]), torch.tensor(ids[:, 1:])

    def torch_step():
        optimizer.zero_grad(set_to_none=True)
        logits = reference(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    def distgraph_runner(strategy):
        model = dg.from_pretrained(folder)
        adamw = dg.optim.AdamW(LR, weight_decay=0.01)
        built = build_program(model, [dg.InputSpec(x.shape, "int64", "tokens")],
                              [dg.InputSpec(y.shape, "int64", "labels")],
                              dg.nn.CrossEntropyLoss(), adamw, amp=strategy.amp)
        runner = PlanRunner(dg.passes.plan(built, strategy))
        values = {n: p.numpy() for n, p in model.named_parameters()}
        state = runner.shard_scope({**values, **adamw.initial_state(built.program)})
        feed = {"tokens": ids[:, :-1], "labels": ids[:, 1:]}
        steps = iter(range(1 << 30))
        return lambda: float(runner.run(state, feed, next(steps))[built.loss_name])

    dg_step = distgraph_runner(dg.Strategy())
    first_dg, first_torch = dg_step(), torch_step()
    if abs(first_dg - first_torch) > 1e-4 * abs(first_torch):
        sys.exit(f"the first steps differ: distgraph loss {first_dg}, torch {first_torch}")
    timed = {"distgraph": dg_step, "torch": torch_step}
    if args.amp:
        timed["distgraph bf16"] = distgraph_runner(dg.Strategy(amp="bfloat16"))
    times = {name: [] for name in timed}
    for _ in range(args.warmup):
        for fn in timed.values():
            fn()
    for _ in range(args.steps):
        for name, fn in timed.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"Llama stack: {args.layers} layers, hidden {HIDDEN}, {HEADS} heads ({KV_HEADS} kv), "
          f"ff {FF}, seq {SEQ}, batch {args.batch}, vocab {VOCAB}, float32, AdamW; "
          f"{args.threads} thread(s); {args.steps} timed steps each, interleaved")
    for name, t in med.items():
        print(f"  {name:<15} median {t * 1e3:9.1f} ms/step   min {min(times[name]) * 1e3:9.1f}")
    ratio = med["distgraph"] / med["torch"]
    print(f"time ratio distgraph/torch: {ratio:.3f} target <= {TARGET:.2f} "
          f"{'OK' if ratio <= TARGET else 'MISSED'}")
    if args.amp:
        print(f"bf16 amp step / float32 step (distgraph): "
              f"{med['distgraph bf16'] / med['distgraph']:.3f}")


if __name__ == "__main__":
    main()
