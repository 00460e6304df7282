"""A Hugging Face ``datasets.Dataset`` of dict rows trained data parallel, saved and
resumed: a GPT with dropout, shuffled rows and a warm-up learning rate, in float64, fed
through ``dg.shard_dataloader(..., input_keys=KEYS)``.

Usage (under ``distgraph run -n 2``, or serially with ``--serial``)::

    distgraph run -n 2 tests/mpi_scripts/hf_rows.py DIR
    python tests/mpi_scripts/hf_rows.py DIR --serial

The full run trains 3 epochs of 3 steps uninterrupted (global parameters to
``DIR/full.npz``); then a fresh engine trains until step
STOP_AFTER (inside the second epoch), saves ``DIR/ckpt`` and stops; an engine built from
another seed (other weights, other dropout seeds) loads it and calls the same ``fit``.
Each rank prints ``HF-ROWS {json}``: its rank, the losses and steps of the full run and
the resumed run's. The test imports :func:`rows` and :func:`engine` for its serial
oracle.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

import distgraph as dg

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from plans import StopAndSave  # noqa: E402

KEYS = ["input_ids", "labels"]
FIT = dict(batch_size=4, epochs=3, shuffle=True, verbose=0)
STOP_AFTER = 4


def rows(n=12, seq=8, vocab=32):
    """A ``datasets.Dataset`` of ``n`` rows: ``input_ids`` and ``labels`` (the next
    tokens), numpy-formatted, and a ``text`` column the model does not read."""
    import datasets

    t = np.random.default_rng(0).integers(0, vocab, size=(n, seq + 1))
    return datasets.Dataset.from_dict({"text": [f"row {i}" for i in range(n)],
                                       "input_ids": t[:, :-1].tolist(),
                                       "labels": t[:, 1:].tolist()}).with_format("numpy")


def engine(seed, comm=None):
    dg.seed(seed)
    model = dg.nn.GPT(vocab_size=32, d_model=16, n_layer=1, n_head=2, max_seq_len=8,
                      dropout=0.1)
    lr = dg.optim.lr.LinearWarmup(dg.optim.lr.CosineDecay(1e-2, decay_steps=9), 2)
    return dg.Engine(model, dg.nn.CrossEntropyLoss(), dg.optim.AdamW(lr), communicator=comm)


def main(directory, serial=False):
    dg.set_default_dtype("float64")
    data = rows()
    if not serial:
        data = dg.shard_dataloader(data, dg.ProcessMesh([0, 1], ["dp"]), "dp",
                                   input_keys=KEYS)
    keys = dict(input_keys=KEYS) if serial else {}
    full = engine(0)
    history = full.fit(data, **FIT, **keys)
    params = full.state_dict()
    if full.rank == 0:
        np.savez(os.path.join(directory, "full.npz"), **params)
    first = engine(0)
    ckpt = os.path.join(directory, "ckpt")
    first.fit(data, callbacks=[StopAndSave(ckpt, STOP_AFTER)], **FIT, **keys)
    resumed = engine(1)
    resumed.load(ckpt)
    again = resumed.fit(data, **FIT, **keys)
    print("HF-ROWS " + json.dumps({"rank": full.rank, "losses": history.losses,
                                   "steps": history.steps, "resumed": again.losses,
                                   "resumed_steps": again.steps}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], "--serial" in sys.argv)
