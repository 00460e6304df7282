"""Tutorial 08: fine-tune a Llama checkpoint on 4 ranks in bfloat16, and save it back.

A LLaMA-family checkpoint is a folder as Hugging Face ``transformers`` writes it
(``config.json`` and safetensors). This tutorial makes a tiny one — with ``transformers``
when it is installed (a random ``LlamaForCausalLM``: grouped-query attention with 4 query
and 2 key/value heads, RoPE theta 500,000), else with ``dg.save_pretrained`` of a fresh
``dg.nn.Llama`` — and then, on 4 MPI ranks as a 2 x 2 mesh (``dp`` x ``mp``):

- loads it lazily: ``dg.from_pretrained(path, lazy=True)`` builds the model with no
  values; each rank reads only its blocks of each tensor when the Engine lays the model
  out (``get_slice``, never a whole tensor it does not own);
- lays it out in one call, ``dg.parallelize`` (Paddle's intermediate API): Llama's
  built-in ``"megatron"`` plan splits every decoder layer the Megatron way over ``mp`` (q,
  k, v, gate and up by columns, o and down by rows; the 2 key/value heads split one per
  rank) and the vocabulary of the embedding and the head; the batch goes over ``dp``;
  ``sharding_level`` 2 (ZeRO) splits AdamW's moments and master weights over ``dp``, the
  gradients reduce-scattered onto them. ``--by-hand`` lays out the same with
  ``dg.nn.llama.megatron``, ``shard_tensor`` and ``Strategy(sharding=True)``;
- fine-tunes on the counting task of tutorial 01 with ``Strategy(amp="bfloat16")``:
  forward and backward in bfloat16, float32 master weights and AdamW moments;
- writes the result with ``engine.save_pretrained`` (the checkpoint's dtype, a
  ``config.json`` transformers reads), and when ``transformers`` is installed loads it
  there and checks that its logits agree with distgraph's.

``transformers`` is optional. To have it, install torch's CPU wheel first: a plain ``pip
install torch`` pulls the CUDA build and its libraries (6.2 GB), which nothing here uses::

    pip install torch --index-url https://download.pytorch.org/whl/cpu
    pip install transformers

Run it with the launcher (4 MPI ranks, one BLAS thread each)::

    distgraph run -n 4 tutorials/08_llama_finetune.py             # 7 s on 2 cores, 11-15 s with transformers
    distgraph run -n 4 tutorials/08_llama_finetune.py --steps 20  # quicker
    distgraph run -n 4 tutorials/08_llama_finetune.py --by-hand   # shard_tensor, same layout

Rank 0 prints the loss curve's start and end; the job fails unless the loss fell by at
least half. The checkpoints go to ``--out`` (default: a temporary folder).
"""

import argparse
import os
import tempfile
import time

import numpy as np

import distgraph as dg

from counting_data import CountingSequences  # tutorials/ is on the path

CONFIG = dict(vocab_size=64, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              rope_theta=500000.0)


def make_checkpoint(path):
    """A tiny random Llama checkpoint in ``path``: transformers' if it is installed."""
    try:
        import torch
        import transformers
    except ImportError:
        dg.seed(0)
        dg.save_pretrained(dg.nn.Llama(**CONFIG), path)
        return "distgraph"
    torch.manual_seed(0)
    transformers.utils.logging.disable_progress_bar()
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    model.save_pretrained(path)
    return "transformers"


def check_in_transformers(path, engine, samples):
    """transformers' float32 logits of the saved checkpoint against distgraph's (its
    bfloat16 forward), as the largest difference relative to the largest logit."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        theirs = model(input_ids=torch.tensor(np.stack([t for t, _ in samples]))).logits.numpy()
    (ours,) = engine.predict(samples, batch_size=len(samples))[0]
    return float(np.max(np.abs(theirs - ours)) / np.max(np.abs(theirs)))


def by_hand(model, mesh):
    """The layout of the "megatron" plan, tensor by tensor: every decoder layer split by
    dg.nn.llama.megatron, the vocabulary of the embedding and the head over mp, the
    final norm whole (ZeRO's sharding is Strategy(sharding=True))."""
    dg.nn.llama.megatron(model, mesh)
    dg.shard_tensor(model.embed_tokens.weight, mesh, ["mp", None])
    dg.shard_tensor(model.lm_head.weight, mesh, [None, "mp"])
    dg.shard_tensor(model.norm.weight, mesh, [None])
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=16, help="global batch")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--out", help="folder for the checkpoints (default: a temporary one)")
    parser.add_argument("--by-hand", action="store_true",
                        help="lay the model out with shard_tensor instead of dg.parallelize")
    args = parser.parse_args()

    mesh = dg.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    rank = dg.get_rank()      # before the Engine: rank 0 writes
    out = args.out or os.path.join(tempfile.gettempdir(), f"distgraph-tutorial-08-{os.getuid()}")
    source, tuned = os.path.join(out, "source"), os.path.join(out, "finetuned")
    if rank == 0 and not os.path.exists(source):
        os.makedirs(out, exist_ok=True)
        writing = tempfile.mkdtemp(dir=out)
        made = make_checkpoint(writing)
        os.replace(writing, source)               # the others see it whole or not at all
        print(f"made a tiny Llama checkpoint with {made} in {source}")
    while not os.path.exists(source):
        time.sleep(0.1)
    model = dg.from_pretrained(source, lazy=True)
    if args.by_hand:
        model, optimizer, sharding = by_hand(model, mesh), dg.optim.AdamW(3e-3), True
    else:
        model, optimizer = dg.parallelize(model, mesh, {
            "dp_config": {"sharding_level": 2},             # ZeRO: states and gradients
            "mp_config": {"parallelize_plan": "megatron"},  # Llama's built-in plan
        }, optimizer=dg.optim.AdamW(3e-3))                  # carries the level
        sharding = False                                    # (the optimizer says it)
    engine = dg.Engine(model, loss=dg.nn.CrossEntropyLoss(), optimizer=optimizer,
                       strategy=dg.Strategy(amp="bfloat16", sharding=sharding))
    data = CountingSequences(args.steps * args.batch_size, args.seq_len, CONFIG["vocab_size"])
    start = time.perf_counter()
    history = engine.fit(dg.shard_dataloader(data, mesh, shard_dims="dp"),
                         batch_size=args.batch_size, epochs=1, verbose=0)
    seconds = time.perf_counter() - start
    engine.save_pretrained(tuned)
    first, last = history.losses[0], float(np.mean(history.losses[-5:]))
    error = check_in_transformers(tuned, engine, [data[0], data[1]])
    if engine.rank == 0:
        print(f"fine-tuned in bfloat16 on {engine.world_size} ranks: loss {first:.3f} -> "
              f"{last:.3f} in {len(history.losses)} steps, {seconds:.1f} s")
        print(f"saved to {tuned}: " + ", ".join(sorted(os.listdir(tuned))))
        if error is not None:
            print(f"transformers loads it; its float32 logits and distgraph's bfloat16 ones "
                  f"differ by {error:.1%} of the largest")
    if last > first / 2:
        raise SystemExit("the loss did not fall by half")


if __name__ == "__main__":
    main()
