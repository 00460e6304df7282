"""A data-parallel GPT on 2 ranks fitting with ``ModelCheckpoint(PATH, every_n_steps=1)``.

Usage (under ``distgraph run -n 2``)::

    python tests/mpi_scripts/checkpoint_dirs.py PATH [WAIT_FOR]

Rank 0 prints ``FITTING`` when training begins and ``STEP <n>`` after each step. With
``WAIT_FOR`` (a file), every rank waits after the second step until that file exists, so
a test can start a second job while this one holds PATH. Rank 0 prints ``DONE <step>``
at the end.
"""

from __future__ import annotations

import os
import sys
import time

import distgraph as dg

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from plans import Tokens  # noqa: E402
from resume_run import GPT  # noqa: E402


class Report(dg.callbacks.Callback):
    def __init__(self, wait_for):
        self.wait_for = wait_for

    def on_train_begin(self, logs=None):
        if self.engine.rank == 0:
            print("FITTING", flush=True)

    def on_step_end(self, step, logs=None):
        if self.engine.rank == 0:
            print(f"STEP {step}", flush=True)
        while step == 1 and self.wait_for and not os.path.exists(self.wait_for):
            time.sleep(0.1)


def main(path, wait_for=None) -> None:
    dg.seed(0)
    mesh = dg.ProcessMesh([[0], [1]], ["dp", "mp"])
    engine = dg.Engine(GPT(mesh), dg.nn.CrossEntropyLoss(), dg.optim.AdamW(1e-2))
    engine.fit(Tokens(16), batch_size=4, epochs=1, verbose=0,
               callbacks=[Report(wait_for), dg.callbacks.ModelCheckpoint(path, every_n_steps=1)])
    if engine.rank == 0:
        print(f"DONE {engine.global_step}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
