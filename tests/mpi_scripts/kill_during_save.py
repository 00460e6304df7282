"""Train, save a checkpoint, train on and start a second save that stops at ``POINT``
(announcing ``PAUSED``) until the test kills this process.

Usage::

    python tests/mpi_scripts/kill_during_save.py POINT DIR

POINT is one of ``shards`` (the new shard file is written into the temporary folder),
``metadata`` (the new data folder is renamed into place, metadata.json not yet
replaced), ``cleanup`` (metadata.json replaced, the old data folder not yet removed).
Before each save the global parameters and optimizer states are written to
``DIR/step<N>.npz``, so the test can check what a load after the kill gives.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import distgraph as dg
from distgraph.app import checkpoint

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from plans import Tokens  # noqa: E402




def pause_before(name):
    """Make ``checkpoint.<name>`` announce itself and wait to be killed."""
    def paused(*args, **kwargs):
        print("PAUSED", flush=True)
        while True:
            time.sleep(1)
    setattr(checkpoint, name, paused)


def pause_after(name):
    original = getattr(checkpoint, name)

    def paused(*args, **kwargs):
        original(*args, **kwargs)
        print("PAUSED", flush=True)
        while True:
            time.sleep(1)
    setattr(checkpoint, name, paused)


def main(point, directory) -> None:
    dg.set_default_dtype("float64")
    dg.seed(0)
    model = dg.nn.GPT(32, 16, 2, 2, 8)
    engine = dg.Engine(model, dg.nn.CrossEntropyLoss(), dg.optim.AdamW(1e-2))
    ckpt = os.path.join(directory, "ckpt")
    for round_ in range(2):
        engine.fit(Tokens(), batch_size=4, epochs=round_ + 1, verbose=0)
        np.savez(os.path.join(directory, f"step{engine.global_step}.npz"),
                 **engine.state_dict(), **engine.optimizer_state_dict())
        if round_ == 1:
            {"shards": lambda: pause_after("_write_files"),
             "metadata": lambda: pause_before("_write_metadata"),
             "cleanup": lambda: pause_before("_cleanup")}[point]()
        engine.save(ckpt)
        print(f"SAVED {engine.global_step}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
