"""Tutorial 01: train a tiny GPT on one process.

The data (tutorials/counting_data.py) is a synthetic next-token task that a GPT which
learns the pattern solves far below ln(vocab).

    python tutorials/01_serial_gpt.py            # default size, about 2 s on 2 cores
    python tutorials/01_serial_gpt.py --steps 50 # quicker
"""

import argparse
import math
import time

import numpy as np

import distgraph as dg

from counting_data import CountingSequences  # tutorials/ is on the path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=32)
    args = parser.parse_args()

    dg.seed(0)
    model = dg.nn.GPT(vocab_size=args.vocab, d_model=64, n_layer=2, n_head=4,
                      max_seq_len=args.seq_len)
    data = CountingSequences(args.steps * args.batch_size, args.seq_len, args.vocab)
    engine = dg.Engine(model, loss=dg.nn.CrossEntropyLoss(), optimizer=dg.optim.AdamW(3e-3))

    start = time.perf_counter()
    history = engine.fit(data, batch_size=args.batch_size, epochs=1)
    seconds = time.perf_counter() - start

    first, last = history.losses[0], float(np.mean(history.losses[-10:]))
    print(f"steps {len(history.losses)}  loss {first:.3f} -> {last:.3f} "
          f"(ln vocab = {math.log(args.vocab):.3f})  {seconds:.1f} s")
    print("loss halved" if last <= first / 2 else "loss NOT halved")


if __name__ == "__main__":
    main()
