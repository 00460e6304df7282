"""What checksums cost a checkpoint save: ``engine.save`` of a GPT (parameters and AdamW
states, a few MB, one process) with the crc32 of every file and of the metadata, against
the same save with the checksum function replaced by one that returns 0 at once (the
reference, measured in the same run, saves alternating); then ``verify`` (reads and checks
every file) against the save.

Usage::

    python bench/checkpoint_save.py [--rounds 9] [--d-model 96]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import types
import zlib

import numpy as np

import distgraph as dg
from distgraph.app import checkpoint
from distgraph.app.checkpoint_verify import verify


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--d-model", type=int, default=96)
    args = ap.parse_args()
    dg.seed(0)
    engine = dg.Engine(dg.nn.GPT(1000, args.d_model, 4, 4, 16), dg.nn.CrossEntropyLoss(),
                       dg.optim.AdamW(1e-3))
    data = np.random.default_rng(0).integers(0, 1000, size=(8, 17))
    engine.fit([(r[:-1], r[1:]) for r in data], batch_size=4, verbose=0)
    no_crc = types.SimpleNamespace(crc32=lambda data, value=0: 0)
    times = {"crc32": [], "none": [], "verify": []}
    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/ckpt"
        for _ in range(args.rounds):
            for kind in ("none", "crc32"):
                checkpoint.zlib = no_crc if kind == "none" else zlib
                start = time.perf_counter()
                engine.save(path)
                times[kind].append(time.perf_counter() - start)
            start = time.perf_counter()
            assert verify(path).ok
            times["verify"].append(time.perf_counter() - start)
        checkpoint.zlib = zlib
        size = sum(f["bytes"] for f in checkpoint.read_metadata(path)["files"].values())
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"checkpoint of {size / 2**20:.2f} MiB, median of {args.rounds} saves each")
    print(f"save with crc32:    {med['crc32'] * 1e3:8.2f} ms")
    print(f"save without:       {med['none'] * 1e3:8.2f} ms")
    print(f"ratio with/without: {med['crc32'] / med['none']:8.3f}")
    print(f"verify (read+crc):  {med['verify'] * 1e3:8.2f} ms "
          f"({med['verify'] / med['crc32']:.3f} of a save)")


if __name__ == "__main__":
    main()
