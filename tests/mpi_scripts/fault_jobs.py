"""Jobs that go wrong on purpose, for tests/test_launcher_faults.py and test_bad_input.py.

Usage: ``distgraph run -n N tests/mpi_scripts/fault_jobs.py MODE [ARG]`` (or plain
``python`` for the serial modes), MODE one of

- ``long``:    data-parallel MLP training until killed; prints ``STARTED <rank>`` after
  the first step (N any);
- ``hang``:    rank 2 stops making progress inside the relu of step 1 (N = 4);
- ``cluster``: prints the Engine's cluster name and device count, or None (N = 2);
- ``labels``:  vocabulary-parallel GPT (N = 2; serial when N = 1) whose sample 5 has label
  ARG at position 2; prints the losses;
- ``ids``:     the same with token id ARG at position 1 of sample 5;
- ``nan``:     data-parallel MLP (N = 2; serial when N = 1) whose sample 20 holds NaN;
- ``subset``:  tensor-parallel MLP; after training only rank 0 calls ``state_dict``
  (ARG ``evaluate``: rank 1 calls ``evaluate`` meanwhile);
- ``fail``:    the relu kernel raises on rank 1 in step 1 (N = 4);
- ``two``:     a data-parallel MLP planned for 2 processes, whatever N is;
- ``lines``:   every rank raises a RuntimeFault of three lines.

Every mode first writes ``started.<rank>`` into $FAULT_JOB_MARKS when that is set, so a
test can tell whether any rank started at all.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import numpy as np

import distgraph as dg
from distgraph import registry

V, T = 16, 4       # GPT vocabulary and sequence length


def world() -> tuple[int, int]:
    if "PMI_RANK" not in os.environ:
        return 0, 1
    from mpi4py import MPI
    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


class MLP(dg.nn.Layer):
    def __init__(self, mesh=None, plan="dp"):
        super().__init__()
        self.mesh, self.plan = mesh, plan
        self.fc1 = dg.nn.Linear(8, 16)
        self.fc2 = dg.nn.Linear(16, 4)
        if mesh is not None and plan == "tp":
            dg.shard_tensor(self.fc1.weight, mesh, [None, "mp"])

    def forward(self, x):
        if self.mesh is not None and self.plan == "dp":
            dg.shard_tensor(x, self.mesh, ["dp", None])
        return self.fc2(dg.ops.relu(self.fc1(x)))


class Regression:
    """64 samples (x [8], y [4]); ``nan_at`` puts NaN into one sample's x."""

    def __init__(self, n=64, nan_at=None):
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(n, 8))
        self.y = rng.normal(size=(n, 4))
        if nan_at is not None:
            self.x[nan_at] = np.nan

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Tokens:
    """32 samples (tokens [T], next tokens [T]) over a vocabulary of V."""

    def __init__(self, n=32):
        rng = np.random.default_rng(0)
        self.x = rng.integers(0, V, (n, T))
        self.y = rng.integers(0, V, (n, T))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def on_rank_in_step(op_name: str, rank: int, step: int, action) -> None:
    """Make ``op_name``'s kernel call ``action()`` on ``rank`` in ``step``."""
    if world()[0] != rank:
        return
    op = registry.get_op(op_name)

    def kernel(ctx, *args, **attrs):
        if ctx.step == step:
            action()
        return op.kernel(ctx, *args, **attrs)

    registry._REGISTRY[op_name] = dataclasses.replace(op, kernel=kernel)


def mlp_engine(n: int, plan: str = "dp", **kwargs) -> dg.Engine:
    dg.set_default_dtype("float64")
    dg.seed(0)
    mesh = dg.ProcessMesh(list(range(n)), ["dp" if plan == "dp" else "mp"]) if n > 1 else None
    return dg.Engine(MLP(mesh, plan), dg.nn.MSELoss(), dg.optim.SGD(0.01), **kwargs)


def gpt_engine(n: int, **kwargs) -> dg.Engine:
    dg.set_default_dtype("float64")
    dg.seed(0)
    model = dg.nn.GPT(V, 8, 1, 2, T)
    if n > 1:
        mesh = dg.ProcessMesh(list(range(n)), ["mp"])
        dg.shard_tensor(model.lm_head.weight, mesh, [None, "mp"])
        dg.shard_tensor(model.wte.weight, mesh, ["mp", None])
    return dg.Engine(model, dg.nn.CrossEntropyLoss(), dg.optim.SGD(0.1), **kwargs)


def main(mode: str, arg: str | None) -> None:
    rank, n = world()
    marks = os.environ.get("FAULT_JOB_MARKS")
    if marks:
        open(os.path.join(marks, f"started.{rank}"), "w").close()
    if mode == "long":
        engine = mlp_engine(n)
        engine.fit(Regression(), batch_size=8, verbose=0)
        print(f"STARTED {rank}", flush=True)
        while True:          # epochs is a total: one more each time
            engine.fit(Regression(), batch_size=8, epochs=engine.epoch + 1, verbose=0)
    elif mode == "hang":
        on_rank_in_step("relu", 2, 1, lambda: time.sleep(3600))
        mlp_engine(n).fit(Regression(), batch_size=8, verbose=0)
    elif mode == "cluster":
        engine = mlp_engine(n)
        engine.fit(Regression(), batch_size=8, verbose=0)
        cluster = engine.cluster
        print(f"CLUSTER {rank} {cluster.name} {len(cluster.devices)}" if cluster is not None
              else f"CLUSTER {rank} None", flush=True)
    elif mode in ("labels", "ids"):
        data = Tokens()
        (data.y if mode == "labels" else data.x)[5, 2 if mode == "labels" else 1] = int(arg)
        history = gpt_engine(n).fit(data, batch_size=8, verbose=0)
        print(f"LOSSES {rank} {history.losses}", flush=True)
    elif mode == "nan":
        history = mlp_engine(n).fit(Regression(nan_at=20), batch_size=8, verbose=0)
        print(f"LOSSES {rank} {history.losses}", flush=True)
    elif mode == "subset":
        engine = mlp_engine(n, plan="tp")
        engine.fit(Regression(), batch_size=8, verbose=0)
        if rank == 0:
            engine.state_dict()
        elif arg == "evaluate":
            engine.evaluate(Regression(), batch_size=8)
        print(f"SUBSET-DONE {rank}", flush=True)
    elif mode == "fail":
        def fail():
            raise ValueError("injected failure")
        on_rank_in_step("relu", 1, 1, fail)
        mlp_engine(n).fit(Regression(), batch_size=8, verbose=0)
    elif mode == "alike":        # the job's first call, with a batch size per rank
        mlp_engine(n).fit(Regression(), batch_size=8 if rank == 0 else 4, verbose=0)
    elif mode == "two":
        mlp_engine(2).fit(Regression(), batch_size=8, verbose=0)
    elif mode == "lines":
        raise dg.RuntimeFault("the first line\n  then a second\n  and a third")
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
