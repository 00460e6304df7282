"""ZeRO over a data-parallel size that divides none of a model's dims, on real MPI ranks;
prints one JSON result line.

Usage (float64 throughout)::

    distgraph run -n 3 tests/mpi_scripts/zero_padded.py train CASE ...
    distgraph run -n 3 tests/mpi_scripts/zero_padded.py save DIR CASE
    distgraph run -n 2 tests/mpi_scripts/zero_padded.py resume DIR CASE

A CASE is ``LEVEL:OPTIMIZER[:mp]``: ``dg.parallelize`` with ``dp_config``
``sharding_level`` LEVEL (1-3; ``s`` for ``Strategy(sharding=True)`` on plain
annotations) over a ``dp`` mesh of every rank (``mp``: a (world/2, 2) ``dp`` x ``mp`` mesh,
fc1 column-wise and fc2 row-wise; ``mp12`` the same with a hidden size of 12; ``pp``: two
stages of world/2, fc1 on the first, two micro-batches), ``adam`` or ``sgd`` (momentum
0.9). The model is an MLP 7 -> 10 -> 5: no dim of it is divisible by 3 or 4, so every
tensor is padded (under ``mp`` fc1.bias, split over mp, is padded to 12 and split over
mp and dp); with ``mp12`` 7 -> 12 -> 5, whose hidden dim, split over mp, is split over
mp and dp unpadded.

``train`` fits two epochs of three steps (evaluating after each) and compares, on every
rank, the losses, the parameters, the optimizer states and the validation losses with
serial training of the same seed; it also
measures the bytes of the optimizer states this rank's runtime holds (its arrays) against
the plan's estimate for its process. ``save`` fits one epoch and saves a checkpoint to DIR;
``resume`` (any number of ranks) loads it, fits the second epoch and compares with the
serial run of both. Rank 0 prints ``ZERO-RESULT {json}``.
"""

from __future__ import annotations

import json
import sys

import numpy as np

import distgraph as dg
from distgraph.runtime.comm.mpi import MPICommunicator

DIMS = (7, 10, 5)
BATCH, ROWS = 12, 36


MP_DIMS = (7, 12, 5)


class Rows:
    def __init__(self, n):
        rng = np.random.default_rng(0)
        self.x, self.y = rng.normal(size=(n, DIMS[0])), rng.normal(size=(n, DIMS[2]))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Annotated(dg.nn.MLP):
    """The MLP whose batch is split over ``dp`` (``Strategy(sharding=True)`` on plain
    annotations: the parameters unannotated, replicated)."""

    def __init__(self, mesh):
        super().__init__(*DIMS)
        self.mesh = mesh

    def forward(self, x):
        dg.shard_tensor(x, self.mesh, ["dp", None])
        return super().forward(x)


def optimizer(name):
    return dg.optim.Adam(1e-2) if name == "adam" else dg.optim.SGD(0.1, momentum=0.9)


def engine(case, comm):
    level, opt, *rest = case.split(":")
    dims = MP_DIMS if rest == ["mp12"] else DIMS
    dg.seed(0)
    if comm is None:
        return dg.Engine(dg.nn.MLP(*dims), dg.nn.MSELoss(), optimizer(opt))
    n = comm.size
    if rest in (["mp"], ["mp12"]):
        mesh = dg.ProcessMesh(np.arange(n).reshape(n // 2, 2).tolist(), ["dp", "mp"])
    elif rest == ["pp"]:
        mesh = dg.ProcessMesh(np.arange(n).reshape(2, n // 2).tolist(), ["pp", "dp"])
    else:
        mesh = dg.ProcessMesh(list(range(n)), ["dp"])
    if level == "s":
        return dg.Engine(Annotated(mesh), dg.nn.MSELoss(), optimizer(opt), communicator=comm,
                         strategy=dg.Strategy(sharding=True))
    config = {"dp_config": {"sharding_level": int(level)}}
    if rest in (["mp"], ["mp12"]):
        config["mp_config"] = {"parallelize_plan": {"fc1": dg.ColWiseParallel(),
                                                    "fc2": dg.RowWiseParallel()}}
    if rest == ["pp"]:
        config["pp_config"] = {"split_spec": {"fc1": dg.SplitPoint.END}}
    model, opt = dg.parallelize(dg.nn.MLP(*dims), mesh, config, optimizer=optimizer(opt))
    return dg.Engine(model, dg.nn.MSELoss(), opt, communicator=comm,
                     strategy=dg.Strategy(micro_batches=2 if rest == ["pp"] else 1))


def errors(engine, reference) -> dict:
    """Largest differences of this engine's losses, parameters and states from
    ``reference`` (losses, parameters, states)."""
    losses, params, states, _ = reference
    mine = (engine.state_dict(), engine.optimizer_state_dict())
    out = {"param": max(float(np.max(np.abs(mine[0][k] - params[k]))) for k in params),
           "state": max(float(np.max(np.abs(mine[1][k] - states[k]))) for k in states),
           "shapes": sorted({str(list(a.shape)) for a in mine[1].values()})}
    if sorted(mine[1]) != sorted(states):
        out["state_names"] = sorted(mine[1])
    return out


def held_states(engine) -> tuple:
    """(bytes of the optimizer states this rank's runtime holds, the estimate's for its
    process)."""
    params = {n for n, _ in engine.model.named_parameters()}
    held = sum(int(a.nbytes) for n, a in engine._held.arrays.items() if n not in params)
    plan = engine.plan()
    est = plan.estimate or dg.passes.estimate(plan)
    return held, next(p.states for p in est.processes if p.process == engine.process)


def serial(case, epochs) -> tuple:
    """(losses, parameters, states, validation losses) of serial training."""
    e = engine(case, None)
    history = e.fit(Rows(ROWS), batch_size=BATCH, epochs=epochs, verbose=0,
                    valid_data=Rows(BATCH))
    return (history.losses, e.state_dict(), e.optimizer_state_dict(),
            [r["val_loss"] for r in history.epochs])


def train(case, comm) -> dict:
    reference = serial(case, 2)
    e = engine(case, comm)
    # evaluated after each epoch: the values move between the training plan's layout
    # (padded) and evaluation's (no states; ZeRO-3's parameters unpadded) and back
    history = e.fit(Rows(ROWS), batch_size=BATCH, epochs=2, verbose=0,
                    valid_data=Rows(BATCH))
    out = errors(e, reference)
    out["valid"] = max(abs(r["val_loss"] - w) for r, w in zip(history.epochs, reference[3]))
    out["loss"] = max(abs(a - b) for a, b in zip(history.losses, reference[0]))
    out["steps"] = len(history.losses)
    out["held_states"], out["estimated_states"] = held_states(e)
    out["pads"] = sum(op.type == "pad" for op in e.plan().program.ops)
    return out


def main(argv) -> None:
    dg.set_default_dtype("float64")
    comm = MPICommunicator()
    action, report = argv[0], {"world": comm.size}
    if action == "train":
        report["cases"] = {case: comm._comm.gather(train(case, comm), root=0)
                           for case in argv[1:]}
    elif action == "save":
        directory, case = argv[1:3]
        e = engine(case, comm)
        e.fit(Rows(ROWS), batch_size=BATCH, epochs=1, verbose=0)
        e.save(directory)
        report["saved"] = e.global_step
    else:
        directory, case = argv[1:3]
        reference = serial(case, 2)
        e = engine(case, comm)
        e.load(directory)
        history = e.fit(Rows(ROWS), batch_size=BATCH, epochs=2, verbose=0)
        mine = errors(e, reference)
        mine["loss"] = max(abs(a - b) for a, b in zip(history.losses, reference[0][-3:]))
        mine["steps"] = len(history.losses)
        report["ranks"] = comm._comm.gather(mine, root=0)
    comm.free()
    if comm.rank == 0:
        print("ZERO-RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
