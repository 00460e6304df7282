"""Tutorial 09: from text files to a Llama: a BPE tokenizer, a Hugging Face dataset, 4 ranks.

The tools a user arrives with, end to end, with nothing downloaded:

- text files: the ones named on the command line, else a small corpus of simple English
  sentences this tutorial writes itself (two files, 1,200 lines in all by default);
- a byte-level BPE tokenizer trained on them with Hugging Face ``tokenizers`` (GPT-2's
  scheme: any text encodes, decoding gives the text back);
- a ``datasets.Dataset``: the files read with ``load_dataset("text", ...)``, tokenized
  and packed into fixed-length rows of ``input_ids`` and ``labels`` (the next tokens)
  with two batched ``Dataset.map`` calls, as transformers' ``run_clm.py`` does, then
  ``with_format("numpy")``;
- a small ``dg.nn.Llama`` (grouped-query attention, RoPE) trained on 4 MPI ranks as a
  2 x 2 mesh: the batch split over ``dp`` by ``dg.shard_dataloader(dataset, mesh, "dp",
  input_keys=["input_ids", "labels"])``, which feeds each row's fields in that order
  (inputs, then the label), and every decoder layer split the Megatron way over ``mp``
  (``dg.nn.llama.megatron``, as in tutorial 08);
- ``engine.predict`` on held-out rows of the same dataset: the label is not fed (the
  model's ``forward(ids)`` takes one input), and ``out[b][0]`` holds batch ``b``'s logits,
  whose argmax the tokenizer decodes.

Rank 0 writes the corpus, trains the tokenizer and saves the packed dataset
(``save_to_disk``); the other ranks wait for it and read it back (``load_from_disk``),
so every rank trains on the same rows.

Run it with the launcher (4 MPI ranks, one BLAS thread each)::

    distgraph run -n 4 tutorials/09_text_to_llama.py                  # 16 s on 2 cores, 10 s once the data is made
    distgraph run -n 4 tutorials/09_text_to_llama.py --files a.txt b.txt     # your own text
    distgraph run -n 4 tutorials/09_text_to_llama.py --tensorboard runs/09   # then: tensorboard --logdir runs

It needs the ``hf`` extra (``pip install 'distgraph[hf]'``: ``datasets`` and
``tokenizers``); ``--tensorboard`` the ``tensorboard`` one. Rank 0 prints the loss every
quarter epoch, falling, and a held-out row with the model's guess of each next token; on
its own corpus the job fails unless the loss fell by at least half. The corpus,
tokenizer and dataset go to ``--out`` (default: a folder under the system's temporary
one, kept for the next run with the same settings).
"""

import argparse
import hashlib
import os
import shutil
import tempfile
import time

import numpy as np

import distgraph as dg

KEYS = ["input_ids", "labels"]
SUBJECTS = ["the cat", "a dog", "my sister", "the old man", "a small bird", "our teacher",
            "the farmer", "a child", "the baker", "her brother"]
VERBS = ["sees", "likes", "finds", "carries", "paints", "follows", "feeds", "watches"]
OBJECTS = ["a red ball", "the green door", "an apple", "the river", "a blue hat",
           "the tall tree", "some bread", "the moon", "a yellow kite"]
PLACES = ["in the garden", "at night", "near the house", "every morning", "by the sea",
          "after school", "in the rain"]


def write_corpus(folder, lines, seed=0):
    """Two text files of simple sentences (subject, verb, object, place), one to three
    per line; their paths."""
    rng = np.random.default_rng(seed)
    paths = []
    for f in range(2):
        text = []
        for _ in range(lines // 2):
            text.append(" ".join(f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} "
                                 f"{rng.choice(OBJECTS)} {rng.choice(PLACES)}."
                                 for _ in range(rng.integers(1, 4))))
        paths.append(os.path.join(folder, f"corpus-{f}.txt"))
        with open(paths[-1], "w") as out:
            out.write("\n".join(text) + "\n")
    return paths


def train_tokenizer(files, vocab_size):
    """A byte-level BPE tokenizer (GPT-2's scheme) trained on ``files``, with an
    end-of-text token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train(files, trainer)
    return tokenizer


def packed_dataset(files, tokenizer, seq_len, cache):
    """The lines of ``files`` tokenized (each followed by the end-of-text token) and cut
    into rows of ``seq_len + 1`` tokens: {"input_ids": the first seq_len, "labels": the
    last seq_len}, a trailing remainder of each batch of lines dropped."""
    import datasets

    eos = tokenizer.token_to_id("<|endoftext|>")
    text = datasets.load_dataset("text", data_files=files, split="train", cache_dir=cache)

    def tokenize(batch):
        return {"ids": [e.ids + [eos] for e in tokenizer.encode_batch(batch["text"])]}

    def pack(batch):
        stream = [t for ids in batch["ids"] for t in ids]
        rows = [stream[i:i + seq_len + 1]
                for i in range(0, len(stream) - seq_len, seq_len + 1)]
        return {"input_ids": [r[:-1] for r in rows], "labels": [r[1:] for r in rows]}

    ids = text.map(tokenize, batched=True, remove_columns=["text"])
    return ids.map(pack, batched=True, remove_columns=["ids"])


def data_name(args) -> str:
    """The folder name of the data these settings make (a new one when they change)."""
    if not args.files:
        return f"data-seq{args.seq_len}-vocab{args.vocab}-lines{args.lines}"
    key = "|".join(f"{os.path.abspath(f)}:{os.path.getmtime(f)}" for f in args.files)
    return f"data-seq{args.seq_len}-vocab{args.vocab}-{hashlib.sha1(key.encode()).hexdigest()[:8]}"


def prepare(args, out, ready):
    """Rank 0: the corpus (unless files were given), the tokenizer and the packed
    dataset, saved as ``ready``; made in a temporary folder and renamed, so the other
    ranks see all of it or nothing."""
    import datasets

    datasets.disable_progress_bars()
    work = tempfile.mkdtemp(dir=out)
    files = args.files or write_corpus(work, args.lines)
    tokenizer = train_tokenizer(files, args.vocab)
    tokenizer.save(os.path.join(work, "tokenizer.json"))
    rows = packed_dataset(files, tokenizer, args.seq_len, os.path.join(work, "cache"))
    rows.train_test_split(test_size=0.05, seed=0).save_to_disk(os.path.join(work, "rows"))
    try:
        os.replace(work, ready)
    except OSError:               # another run made it meanwhile: theirs is the same
        shutil.rmtree(work)
    print(f"tokenizer: byte-level BPE of {tokenizer.get_vocab_size()} tokens trained on "
          f"{', '.join(os.path.basename(f) for f in files)}; dataset: {len(rows)} rows of "
          f"{args.seq_len} tokens", flush=True)


class LossLog(dg.callbacks.Callback):
    """Rank 0 prints the mean loss of every ``every`` steps."""

    def __init__(self, every):
        self.every, self.losses = every, []

    def on_step_end(self, step, logs=None):
        self.losses.append(logs["loss"])
        if self.engine.rank == 0 and (step + 1) % self.every == 0:
            print(f"step {step + 1:4d}  loss {np.mean(self.losses[-self.every:]):.3f}",
                  flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", nargs="+", help="text files to train on (default: a "
                        "corpus the tutorial writes)")
    parser.add_argument("--lines", type=int, default=1200, help="lines of the corpus the "
                        "tutorial writes")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=16, help="global batch")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=320, help="BPE vocabulary size "
                        "(the 256 bytes and the merges learnt)")
    parser.add_argument("--tensorboard", help="log to this folder with "
                        "dg.callbacks.TensorBoard")
    parser.add_argument("--out", help="folder for the corpus, tokenizer and dataset "
                        "(default: a temporary one)")
    args = parser.parse_args()

    import datasets
    from tokenizers import Tokenizer

    mesh = dg.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    rank = dg.get_rank()          # before the Engine: rank 0 prepares the data
    out = args.out or os.path.join(tempfile.gettempdir(), f"distgraph-tutorial-09-{os.getuid()}")
    ready = os.path.join(out, data_name(args))
    if rank == 0 and not os.path.exists(ready):
        os.makedirs(out, exist_ok=True)
        prepare(args, out, ready)
    while not os.path.exists(ready):
        time.sleep(0.1)
    tokenizer = Tokenizer.from_file(os.path.join(ready, "tokenizer.json"))
    split = datasets.load_from_disk(os.path.join(ready, "rows")).with_format("numpy")
    train, held_out = split["train"], split["test"]

    dg.seed(0)
    model = dg.nn.Llama(vocab_size=tokenizer.get_vocab_size(), hidden_size=64,
                        intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=args.seq_len)
    dg.nn.llama.megatron(model, mesh)
    engine = dg.Engine(model, loss=dg.nn.CrossEntropyLoss(), optimizer=dg.optim.AdamW(3e-3))
    callbacks = [LossLog(every=max(1, len(train) // args.batch_size // 4))]
    if args.tensorboard:
        callbacks.append(dg.callbacks.TensorBoard(args.tensorboard))
    start = time.perf_counter()
    history = engine.fit(dg.shard_dataloader(train, mesh, shard_dims="dp", input_keys=KEYS),
                         batch_size=args.batch_size, epochs=args.epochs, verbose=0,
                         drop_last=True, callbacks=callbacks)
    seconds = time.perf_counter() - start

    # held-out rows as they are: (input_ids, labels); predict feeds input_ids only
    n = min(args.batch_size, len(held_out) // 2 * 2)         # split over dp as fit's
    rows = held_out.select(range(n))
    logits = engine.predict(rows, batch_size=n, input_keys=KEYS)[0][0]
    guess = logits.argmax(-1)
    accuracy = float(np.mean(guess == rows["labels"]))
    first, last = history.losses[0], float(np.mean(history.losses[-10:]))
    if engine.rank == 0:
        print(f"trained on {engine.world_size} ranks ({mesh.shape[0]} dp x {mesh.shape[1]} "
              f"mp): loss {first:.3f} -> {last:.3f} in {len(history.losses)} steps, "
              f"{seconds:.1f} s")
        print(f"held out: {tokenizer.decode(rows['labels'][0].tolist())!r}")
        print(f"guessed:  {tokenizer.decode(guess[0].tolist())!r} (each token the "
              f"model's guess of the next one: {accuracy:.0%} right)")
    if not args.files and last > first / 2:
        raise SystemExit("the loss did not fall by half")


if __name__ == "__main__":
    main()
