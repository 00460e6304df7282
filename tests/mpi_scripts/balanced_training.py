"""Train plans of tests/plans.py with ``Strategy(balance=...)`` on a cluster file of mixed
speeds, on real MPI ranks, and print one JSON line.

Usage (the job size must equal every listed plan's process count)::

    distgraph run -n 2 tests/mpi_scripts/balanced_training.py CLUSTER mlp:dp:1:on ...
    distgraph run -n 2 tests/mpi_scripts/balanced_training.py CLUSTER resume:DIR

Each item is ``kind:plan:micro_batches:on|off[:devices]`` (``devices``: the device of
each process, comma-separated, for a rank mapping given by hand). Every rank trains the
plan through ``Engine.fit`` (then evaluates, with accuracy, and predicts on other data) in
float64 on batches of 8 and the serial oracle (whole batches, one process) itself; rank 0
prints ``BALANCE-RESULT {json}`` with, per item, the split (rows or micro-batches per
process, or None), every rank's largest errors against serial and its losses.

``resume:DIR`` trains a GPT with dropout and shuffled data under the balanced
uneven split of the MLP items' cluster for 2 epochs of 4 steps without stopping, then a
fresh engine trains until step 5, saves ``DIR/ckpt`` and stops, and a third engine
(another model seed) loads it and fits again; it reports the losses of all three and
the largest difference between the uninterrupted and the resumed final state.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import distgraph as dg  # noqa: E402
from distgraph.runtime.comm.mpi import MPICommunicator  # noqa: E402

import plans as P  # noqa: E402

BATCH = 8
STOP_AFTER = 5


def engine_for(kind, model, strategy=None, comm=None, cluster=None, mapping=None):
    return dg.Engine(model, P.loss_fn(kind), P.make_optimizer("adamw"),
                     strategy=strategy or dg.Strategy(), communicator=comm, cluster=cluster,
                     rank_mapping=mapping)


def run(engine, kind):
    """(losses, parameters, evaluation, predictions) of fit, evaluate and predict."""
    history = engine.fit(P.Dataset(kind, batch=BATCH), batch_size=BATCH, verbose=0)
    params = engine.state_dict()
    other = P.Dataset(kind, seed=3, batch=BATCH)
    evaluated = engine.evaluate(other, batch_size=BATCH, verbose=0,
                                metrics=[dg.metrics.Accuracy()])
    return history.losses, params, evaluated, engine.predict(other, batch_size=BATCH)


def split_of(plan):
    split = plan.batch_split
    if split is None:
        return None
    return {"even": split.is_even, "micro_batched": split.micro_batched,
            "units": list(split.units), "members": [list(m) for m in split.members]}


def train_item(item, comm, cluster, refs) -> dict:
    kind, name, m, balance, *devices = item.split(":")
    if kind not in refs:
        refs[kind] = run(engine_for(kind, P.build_model(kind)), kind)
    model = P.build_model(kind)
    P.PLANS[kind, name, comm.size].annotate(model)
    mapping = ({p: int(d) for p, d in enumerate(devices[0].split(","))} if devices else None)
    strategy = dg.Strategy(micro_batches=int(m), balance=balance == "on")
    engine = engine_for(kind, model, strategy, comm, cluster, mapping)
    losses, params, evaluated, predicted = run(engine, kind)
    ref_losses, ref_params, ref_eval, ref_pred = refs[kind]
    errors = P.compare((losses, params), (ref_losses, ref_params), "float64")
    errors["eval"] = abs(evaluated["loss"] - ref_eval["loss"])
    errors["accuracy"] = abs(evaluated["accuracy"] - ref_eval["accuracy"])
    errors["predict"] = max(float(np.max(np.abs(a - b))) for got, want in
                            zip(predicted, ref_pred) for a, b in zip(got, want))
    train, evaluate = engine.plan("train"), engine.plan("eval")
    return {"losses": losses, "errors": errors, "split": split_of(train),
            "eval_split": split_of(evaluate),
            "micro_batches": [train.micro_batches_of(p) for p in train.process_ids]}


def resume_item(directory, comm, cluster) -> dict:
    fit = dict(batch_size=BATCH, epochs=2, shuffle=True, verbose=0)
    data = P.Dataset("gpt", batch=BATCH, n=4 * BATCH)

    def engine(seed):
        model = P.build_model("gpt", seed=seed, dropout=0.1)
        P.PLANS["gpt", "dp", comm.size].annotate(model)
        return engine_for("gpt", model, dg.Strategy(balance=True), comm, cluster)

    def state(e):
        return {**e.state_dict(), **e.optimizer_state_dict()}

    full = engine(0)
    full_losses = full.fit(data, **fit).losses
    first = engine(0)
    stop = P.StopAndSave(os.path.join(directory, "ckpt"), STOP_AFTER)
    first_losses = first.fit(data, callbacks=[stop], **fit).losses
    resumed = engine(1)
    resumed.load(os.path.join(directory, "ckpt"))
    history = resumed.fit(data, **fit)
    want, got = state(full), state(resumed)
    return {"full": full_losses, "first": first_losses, "resumed": history.losses,
            "steps": history.steps, "split": split_of(resumed.plan()),
            "state_error": max(float(np.max(np.abs(np.asarray(got[k]) - np.asarray(want[k]))))
                               for k in want),
            "same_names": sorted(want) == sorted(got)}


def main(cluster_file, *items) -> None:
    dg.set_default_dtype("float64")
    comm = MPICommunicator()
    cluster = dg.Cluster.from_file(cluster_file)
    refs: dict = {}
    report = {"world": comm.size, "runs": {}}
    for item in items:
        if item.startswith("resume:"):
            mine = resume_item(item.split(":", 1)[1], comm, cluster)
        else:
            mine = train_item(item, comm, cluster, refs)
        everyone = comm._comm.gather(mine, root=0)
        if comm.rank == 0:
            report["runs"][item] = everyone
    comm.free()
    if comm.rank == 0:
        print("BALANCE-RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
