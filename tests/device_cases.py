"""Plans of tests/plans.py on GPU clusters, run through the runner on any backend.

``gpu_cluster(n, gpus)`` describes one machine running ``n`` ranks on ``gpus`` GPUs (rank r
on GPU r mod gpus: ranks share a GPU when n > gpus), as ``Cluster.local(n, device="GPU")``
does from detected GPUs; ``planned(...)`` plans a model of tests/plans.py on it;
``train(...)`` runs STEPS optimizer steps of a plan with PlanRunner on a communicator and
an array backend (None: the plan's own: CuPy on a GPU plan) and returns the losses and
the global parameters, as host arrays. ``serial(kind, backend)`` is the oracle: the same
model, unannotated, on one process.

On a CPU machine the runner computes with numpy standing in for CuPy (``backend=NUMPY``)
while the plan, the routes (NCCL or MPI with host staging) and the communicator wrapping
are those of the GPU plan: what tests check there is the routing, which is the same on
either backend. The tests of tests/test_gpu.py run the same cases on CuPy.
"""

from __future__ import annotations

import numpy as np

import distgraph as dg
from distgraph.program_builder import build_program
from distgraph.resources.cluster import local_gpus
from distgraph.resources.gpus import GPUInfo
from distgraph.runtime.execution.runner import PlanRunner

import plans as P

# (kind, plan name, processes, Strategy options): the data-parallel, tensor-parallel,
# both, and two-stage 1F1B plans the GPU acceptance asks for
CASES = [(kind, name, n, opts) for kind in ("mlp", "gpt")
         for name, n, opts in (("dp", 2, {}), ("tp", 2, {}), ("dp", 4, {}), ("dp_tp", 4, {}),
                               ("two_stage", 2, {"micro_batches": 2, "schedule": "1F1B"}),
                               ("two_stage", 4, {"micro_batches": 2, "schedule": "1F1B"}))]


def case_id(case) -> str:
    kind, name, n, opts = case
    return f"{kind}-{name}-n{n}" + ("-1F1B" if opts else "")


def gpu_cluster(nprocs: int, gpus: int = 1, name: str = "H100", memory: float = 80.0):
    """One machine, ``nprocs`` ranks on ``gpus`` GPUs described as detection would."""
    return local_gpus(nprocs, [GPUInfo(i, name, memory, (9, 0)) for i in range(gpus)])


def planned(kind, name, n, cluster, **strategy):
    """(plan, built, initial values) of plan ``name`` of tests/plans.py on ``cluster``."""
    model = P.build_model(kind)
    P.PLANS[kind, name, n].annotate(model)
    return _plan(model, kind, cluster, strategy)


def _plan(model, kind, cluster, strategy):
    optimizer = dg.optim.AdamW(P.LEARNING_RATE)
    ins, labels = dg.app.data.DataLoader(P.Dataset(kind), P.BATCH).specs(1)
    with P.BUILD_LOCK:
        built = build_program(model, ins, labels, P.loss_fn(kind), optimizer)
        plan = dg.passes.plan(built, dg.Strategy(**strategy), cluster)
    init = {n: p.numpy() for n, p in model.named_parameters()}
    init.update(optimizer.initial_state(plan.program))
    return plan, built, init


def batches(kind, built) -> list:
    """The STEPS global batches the plans train on, as feeds."""
    data = P.Dataset(kind)
    out = []
    for step in range(P.STEPS):
        rows = range(step * P.BATCH, (step + 1) * P.BATCH)
        out.append({name: np.stack([data[i][k] for i in rows])
                    for k, name in enumerate(built.feed_names)})
    return out


def train(kind, plan, built, init, comm=None, backend=None):
    """(losses, {parameter: global host array}, runner) after STEPS steps of ``plan``."""
    runner = PlanRunner(plan, comm, backend)
    scope = runner.shard_scope(init)
    losses = [float(runner.run(scope, feed, step)[built.loss_name])
              for step, feed in enumerate(batches(kind, built))]
    names = sorted(v.name for v in plan.program.parameters)
    return losses, runner.gather(scope, names), runner


def serial(kind, cluster=None, backend=None):
    """(losses, parameters) of the unannotated model on one process."""
    plan, built, init = _plan(P.build_model(kind), kind, cluster, {})
    losses, params, _ = train(kind, plan, built, init, None, backend)
    return losses, params


def largest_errors(result, reference) -> tuple:
    """(largest loss error, largest parameter error) of ``result`` against ``reference``."""
    (losses, params), (ref_losses, ref_params) = result, reference
    assert sorted(params) == sorted(ref_params)
    loss = max(abs(a - b) for a, b in zip(losses, ref_losses))
    param = max(float(np.max(np.abs(np.asarray(params[k]) - np.asarray(ref_params[k]))))
                for k in params)
    return loss, param
