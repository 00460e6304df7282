"""Peak memory of a rank loading a Llama checkpoint sharded 4 ways, against loading it whole.

The checkpoint: a Llama of about 490 M parameters (hidden 2048, 8 layers, 16 heads, 4
key/value heads, intermediate 5632, vocabulary 32,000, untied embeddings) written once by
``dg.save_pretrained`` in bfloat16 (about 1 GB) into ``--cache`` (default: a folder under
the system's temporary one), as published checkpoints are.

Both runs load it the same way, ``dg.from_pretrained(path, lazy=True)`` and an Engine that
lays the parameters out for a one-token prediction (float32 parameters, no optimizer
state, a batch of one sequence of 8 tokens):

- **whole**: one process (``distgraph run -n 1``), no annotation: it reads every tensor
  whole;
- **sharded**: ``distgraph run -n 4``, every weight split 4 ways over mesh dim ``mp``
  (``dg.nn.llama.megatron`` for the decoder layers, the embedding and the head split over
  hidden and vocabulary): each rank reads only its blocks (safetensors' ``get_slice``).

Each process reports its peak resident set (``getrusage``'s ``ru_maxrss``, which counts the
interpreter and its libraries too). Prints both and the ratio of the largest rank's
against the whole load; the target is <= 0.35.

Run: ``python bench/llama_load_rss.py [--cache DIR]``.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile

TARGET = 0.35
CONFIG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
              num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
              max_position_embeddings=256, tie_word_embeddings=False)
WAYS = 4
TAG = "peak-rss-kib"


def make_checkpoint(cache: str) -> str:
    """The checkpoint folder in ``cache``, written once (atomically: a whole folder)."""
    import distgraph as dg

    path = os.path.join(cache, "llama-490m-bf16")
    if not os.path.exists(os.path.join(path, "config.json")):
        os.makedirs(cache, exist_ok=True)
        writing = tempfile.mkdtemp(dir=cache)
        dg.seed(0)
        dg.save_pretrained(dg.nn.Llama(**CONFIG), writing, dtype="bfloat16")
        os.replace(writing, path)
    return path


def load(path: str, sharded: bool) -> None:
    """Load ``path`` lazily and lay it out for one prediction (the module docstring), then
    print this process's peak resident set."""
    import numpy as np

    import distgraph as dg

    model = dg.from_pretrained(path, lazy=True)
    if sharded:
        mesh = dg.ProcessMesh(list(range(WAYS)), dim_names=["mp"])
        dg.nn.llama.megatron(model, mesh)
        dg.shard_tensor(model.embed_tokens.weight, mesh, [None, "mp"])
        dg.shard_tensor(model.lm_head.weight, mesh, [None, "mp"])
        dg.shard_tensor(model.norm.weight, mesh, [None])
    engine = dg.Engine(model)
    tokens = np.zeros((1, 8), dtype=np.int64)
    engine.predict([(tokens[0],)], batch_size=1)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"{TAG} {engine.rank} {peak}", flush=True)


def peaks(cmd) -> dict:
    """{rank: peak KiB} that the processes of ``cmd`` printed."""
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}")
    found = {}
    for line in out.stdout.splitlines():
        if line.startswith(TAG):
            _, rank, kib = line.split()
            found[int(rank)] = int(kib)
    return found


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(),
                                                        f"distgraph-bench-{os.getuid()}"))
    parser.add_argument("--load", choices=["whole", "sharded"], help=argparse.SUPPRESS)
    parser.add_argument("path", nargs="?", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.load:
        load(args.path, args.load == "sharded")
        return
    path = make_checkpoint(args.cache)
    me = os.path.abspath(__file__)
    run = [sys.executable, "-m", "distgraph.cli", "run", "-n"]
    whole = peaks([*run, "1", me, "--load", "whole", path])[0]
    sharded = peaks([*run, str(WAYS), me, "--load", "sharded", path])
    if len(sharded) != WAYS:
        raise SystemExit(f"expected {WAYS} ranks to report, got {sorted(sharded)}")
    worst = max(sharded.values())
    mib = 1024
    print(f"checkpoint {path}")
    print(f"whole: one process, peak RSS {whole / mib:.0f} MiB")
    print(f"sharded {WAYS} ways: peak RSS per rank "
          + ", ".join(f"{sharded[r] / mib:.0f}" for r in sorted(sharded)) + " MiB")
    print(f"ratio (largest rank / whole): {worst / whole:.3f}  (target <= {TARGET})")


if __name__ == "__main__":
    main()
