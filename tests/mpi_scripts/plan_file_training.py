"""Train tests/plans.py's GPT under a plan file, as a user's script does.

Usage::

    distgraph plan tests/mpi_scripts/plan_file_training.py -n 4 --save P.json -- semi OUT
    distgraph run -n 4 --plan P.json tests/mpi_scripts/plan_file_training.py semi OUT [LAYERS]

``semi``: the model annotated dp x mp (tests/plans.py's "dp_tp" plan on 4 processes);
``full``: the model unannotated, under ``Strategy(auto_mode="full", pipeline=True,
micro_batches=4)``. Either way the Engine is made as without a plan file: under
``distgraph run --plan`` it takes the file's plan from the launch context. float64,
tests/plans.py's data and AdamW (LAYERS: GPT blocks, default tests/plans.py's). Each rank
of a job marks that it started (OUT/rank-started.RANK);
rank 0 writes its global parameters to OUT/params.npz and prints ``PLANFILE-RESULT
{json}``: the losses, the plan's estimated step time, stages, micro-batches, a digest of
its completed program, and whether the search was imported.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import distgraph as dg  # noqa: E402

import plans as P  # noqa: E402

FULL = dg.Strategy(auto_mode="full", pipeline=True, micro_batches=4)


def engine_of(kind: str, cluster=None, layers: int | None = None):
    """The Engine of ``kind`` ("semi" or "full"), as the test builds it to save a plan;
    ``layers``: GPT blocks other than tests/plans.py's."""
    model = P.build_model("gpt", seed=0, dims=None if layers is None else
                          {**P.GPT_DIMS, "n_layer": layers})
    if kind == "semi":
        P.PLANS["gpt", "dp_tp", 4].annotate(model)
    strategy = FULL if kind == "full" else dg.Strategy()
    return dg.Engine(model, P.loss_fn("gpt"), P.make_optimizer("adamw"), cluster=cluster,
                     strategy=strategy)


def program_digest(plan) -> str:
    return hashlib.sha256(plan.program.pretty().encode()).hexdigest()


def main() -> None:
    kind, out = sys.argv[1], sys.argv[2]
    layers = int(sys.argv[3]) if len(sys.argv) > 3 else None
    if dg.get_world_size() > 1:                 # a rank of the job started
        open(os.path.join(out, f"rank-started.{dg.get_rank()}"), "w").close()
    dg.set_default_dtype("float64")
    engine = engine_of(kind, layers=layers)
    history = engine.fit(P.Dataset("gpt"), batch_size=P.BATCH, epochs=1, verbose=0)
    params = engine.state_dict()
    if engine.rank == 0:
        np.savez(os.path.join(out, "params.npz"), **params)
        plan = engine.plan()
        print("PLANFILE-RESULT " + json.dumps({
            "losses": history.losses, "step_time": plan.estimate.step_time,
            "stages": [str(m) for m in plan.stages], "micro_batches": plan.micro_batches,
            "program": program_digest(plan), "world": engine.world_size,
            "searched": plan.search is not None,
            "search_imported": "distgraph.passes.search" in sys.modules}), flush=True)


if __name__ == "__main__":
    main()
