"""Train pipelined plans of tests/plans.py on real MPI ranks and print one JSON line.

Usage (the job size must equal every listed plan's process count)::

    distgraph run -n 4 tests/mpi_scripts/train_pipeline.py gpt:four_stage:4:1F1B ...

Each item is ``kind:plan:micro_batches:schedule[:virtual_stages]``. Every rank trains the
plan through ``Engine.fit`` with ``Strategy(micro_batches=M, schedule=S, profile=True,
virtual_stages=v)`` on batches of
16 and trains the serial oracle (whole batches, one process) itself; rank 0 prints
``PIPELINE-RESULT {json}`` with, per item, every rank's losses and largest errors
against serial, the merged timeline's tasks per rank in the order they ran (stage, kind,
micro-batch), and the plan's schedule per rank.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import distgraph as dg  # noqa: E402
from distgraph.runtime.comm.mpi import MPICommunicator  # noqa: E402

import plans as P  # noqa: E402

BATCH = 16


def train(kind, model, strategy, comm=None):
    engine = dg.Engine(model, P.loss_fn(kind), P.make_optimizer("adamw"), strategy=strategy,
                       communicator=comm)
    data = P.Dataset(kind, batch=BATCH)
    history = engine.fit(data, batch_size=BATCH, epochs=1)
    return engine, (history.losses, engine.state_dict())


def main(argv) -> None:
    dg.set_default_dtype("float64")
    comm = MPICommunicator()
    plans = {**P.PLANS, **P.PIPELINE_PLANS}
    refs: dict = {}
    report = {"world": comm.size, "runs": {}}
    for item in argv:
        kind, name, m, schedule, *virtual = item.split(":")
        if kind not in refs:
            refs[kind] = train(kind, P.build_model(kind), dg.Strategy())[1]
        model = P.build_model(kind)
        plans[kind, name, comm.size].annotate(model)
        strategy = dg.Strategy(micro_batches=int(m), schedule=schedule, profile=True,
                               virtual_stages=int(virtual[0]) if virtual else 1)
        engine, result = train(kind, model, strategy, comm)
        timeline = engine.timeline()
        mine = {"losses": result[0], "errors": P.compare(result, refs[kind], "float64")}
        everyone = comm._comm.gather(mine, root=0)
        if comm.rank == 0:
            order = {r: [(e.stage, e.kind, e.micro_batch) for e in timeline.events
                         if e.rank == r and e.step == 0 and e.kind not in ("send", "recv")]
                     for r in timeline.ranks}
            plan = engine.plan()
            schedule = {plan.ranks(pid): [[a.chunk, a.task, a.micro_batch] for a in acts]
                        for pid, acts in plan.schedule().items()}
            report["runs"][item] = {"ranks": everyone, "serial": refs[kind][0],
                                    "order": order, "schedule": schedule,
                                    "peak": timeline.peak_activations(step=0)}
    comm.free()
    if comm.rank == 0:
        print("PIPELINE-RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
