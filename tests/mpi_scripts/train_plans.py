"""Train several plans of tests/plans.py on real MPI ranks and print one JSON result line.

Usage (the job size must equal every listed plan's process count)::

    distgraph run -n 4 tests/mpi_scripts/train_plans.py float64 gpt:dp mlp:zero_dp_tp gpt:auto

Every rank trains each plan through ``Engine.fit`` and trains the serial oracle itself;
rank 0 prints ``PLANS-RESULT {json}`` with, per plan, every rank's ``History.losses``, its
largest errors against serial, whether its plan was searched on it and the digest of
the plan's decisions (its plan file's text), the serial losses, the kinds of the reshard
steps that touch gradients and parameters in rank 0's partitioned program, and the
matmuls that run as MeshSlice. A plan the search chooses is left to ``fit`` (no
``prepare`` first), which searches on rank 0 only; then ``evaluate`` plans and runs the
evaluation program alike (its loss and whether this rank searched it are reported).
With ``refused`` first among the plans, every rank first fits an MLP whose search cannot
fit a 1 KB budget and reports the error it raised (``"refused"``: [type, message] per
rank).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import distgraph as dg  # noqa: E402
from distgraph.plan.file import as_text  # noqa: E402
from distgraph.runtime.comm.mpi import MPICommunicator  # noqa: E402

import plans as P  # noqa: E402


def reshard_kinds(engine, pid) -> dict:
    """{"grad": kinds of steps on gradients, "param": kinds written back to parameters}."""
    local = engine.plan().local(pid)
    grad, param = set(), set()
    for point in local.points():
        kinds = {s.kind for s in point.steps}
        if point.value.endswith("@GRAD"):
            grad |= kinds
        if point.stores:
            param |= kinds
    return {"grad": sorted(grad), "param": sorted(param)}


def refused(comm) -> list:
    """[type, message] of the error each rank's fit raised where the search finds no plan
    in a 1 KB budget (gathered on rank 0)."""
    strategy = dg.Strategy(auto_mode="full", memory_budget_gb=1e-6)
    engine = dg.Engine(P.build_model("mlp"), P.loss_fn("mlp"), P.make_optimizer("adamw"),
                       strategy=strategy, communicator=comm)
    try:
        engine.fit(P.Dataset("mlp"), batch_size=P.BATCH, epochs=1)
        mine = ["none", ""]
    except dg.DistGraphError as e:
        mine = [type(e).__name__, str(e)]
    return comm._comm.gather(mine, root=0)


def main(argv) -> None:
    dtype = argv[0]
    refuse = argv[1:2] == ["refused"]
    keys = [tuple(k.split(":")) for k in argv[1 + refuse:]]
    dg.set_default_dtype(dtype)
    comm = MPICommunicator()
    refs = {}
    report = {"dtype": dtype, "world": comm.size, "plans": {}}
    if refuse:
        report["refused"] = refused(comm)
    for kind, name in keys:
        plan = {**P.PLANS, **P.AUTO_PLANS, **P.SP_PLANS, **P.RECOMPUTE_PLANS}[
            kind, name, comm.size]
        if kind not in refs:
            refs[kind] = P.serial_reference(kind)
        model = P.build_model(kind)
        plan.annotate(model)
        engine = P.make_engine(model, kind, comm, plan.sharding, auto=plan.auto,
                               sequence_parallel=plan.sequence_parallel,
                               recompute=plan.recompute)
        if not plan.auto:
            P.prepare(engine, kind)
        history = engine.fit(P.Dataset(kind), batch_size=P.BATCH, epochs=1)
        errors = P.compare((history.losses, engine.state_dict()), refs[kind], dtype)
        mine = {"losses": history.losses, "errors": errors,
                "searched": engine.plan().search is not None,
                "decisions": hashlib.sha256(as_text(engine.plan()).encode()).hexdigest()}
        if plan.auto:           # evaluation's plan is searched in evaluate() alike
            mine["eval loss"] = engine.evaluate(P.Dataset(kind), batch_size=P.BATCH,
                                              verbose=0)["loss"]
            mine["eval searched"] = engine.plan("eval").search is not None
        everyone = comm._comm.gather(mine, root=0)
        if comm.rank == 0:
            report["plans"][str(plan)] = {
                "ranks": everyone, "serial": refs[kind][0],
                "reshards": reshard_kinds(engine, 0),
                "meshslice": [str(u) for u in dg.passes.meshslice.uses(engine.plan().program)]}
    comm.free()
    if comm.rank == 0:
        print("PLANS-RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
