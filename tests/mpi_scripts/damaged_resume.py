"""Resume past a damaged checkpoint, on 4 ranks under dp x mp (a GPT with dropout, shuffled
data, a warm-up + cosine learning rate; float64).

Usage (under ``distgraph run -n 4``)::

    python tests/mpi_scripts/damaged_resume.py train DIR
    python tests/mpi_scripts/damaged_resume.py check DIR CLEAN DAMAGED [DAMAGED ...]

``train`` trains 12 steps with ``ModelCheckpoint(DIR/ck/step-{step}, every_n_steps=3)``.
``check`` first loads ``CLEAN`` (a checkpoint folder) and trains on to 18 steps, then for
each ``DAMAGED`` series (``.../step-{step}``) calls ``engine.resume`` on a fresh engine of
other weights and trains on to 18 steps, then tries ``engine.load`` of its newest folder.
The global parameters and optimizer states at the end go to ``<series folder>/final.npz``
(``CLEAN``'s to ``DIR/clean.npz``). Rank 0 prints ``DAMAGED-RESULT {json}``: per series
the path resume returned, the steps trained and the error ``load`` raised.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

import distgraph as dg

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from plans import Tokens  # noqa: E402
from resume_run import GPT  # noqa: E402

FIT = dict(batch_size=4, shuffle=True, verbose=0)


def engine(seed):
    dg.seed(seed)
    mesh = dg.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
    lr = dg.optim.lr.LinearWarmup(dg.optim.lr.CosineDecay(1e-2, decay_steps=15), 3)
    return dg.Engine(GPT(mesh), dg.nn.CrossEntropyLoss(), dg.optim.AdamW(lr))


def finish(e, out) -> list:
    steps = e.fit(Tokens(24), epochs=3, **FIT).steps
    values = {**e.state_dict(), **e.optimizer_state_dict()}
    if e.rank == 0:
        np.savez(out, **values)
    return steps


def main(phase, directory, *series) -> None:
    dg.set_default_dtype("float64")
    result = {}
    if phase == "train":
        e = engine(0)
        save = dg.callbacks.ModelCheckpoint(os.path.join(directory, "ck", "step-{step}"),
                                            every_n_steps=3)
        e.fit(Tokens(24), epochs=2, callbacks=[save], **FIT)
        result["saved"] = save.saved
    else:
        clean, *damaged = series
        e = engine(1)
        e.load(clean)
        result["clean"] = finish(e, os.path.join(directory, "clean.npz"))
        for pattern in damaged:
            e = engine(2)
            found = e.resume(pattern)
            steps = finish(e, os.path.join(os.path.dirname(pattern), "final.npz"))
            try:
                engine(3).load(pattern.format(step=12))
                error = None
            except dg.CheckpointError as err:
                error = str(err)
            result[pattern] = {"resumed": found, "steps": steps, "load_error": error}
    if dg.get_rank() == 0:
        print("DAMAGED-RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
