"""Measured memory against the plan's estimate: each rank's peak bytes held in a step (the
runtime's count, :mod:`distgraph.runtime.execution.memory`) over its process's
``plan.estimate`` peak, for a few plans of one GPT on 4 ranks.

Run::

    python bench/memory_measured.py                  # 4 ranks as threads (SimulatedWorld)
    distgraph run -n 4 bench/memory_measured.py      # 4 MPI ranks

Plans (``dg.parallelize`` and the search; each priced on a cluster so that it has an
estimate, ``dg.Cluster.local(4)`` unless said): ``dp`` (4-way data parallel),
``dp_accum`` (the same, accumulating gradients over 4 micro-batches), ``mp``
(4-way Megatron tensor parallel), ``dp_mp`` (2 x 2), ``pp_1f1b`` (4 stages, 8
micro-batches, 1F1B), ``zero2`` (dp with sharded states), ``searched``
(``auto_mode="full"``, no annotations), ``searched_pp`` (the same with
``pipeline=True`` and the micro-batches searched, priced on
``resources/clusters/emulated_2x2.yaml``, two machines of two, where the search
chooses two stages) and ``searched_budget`` (``pipeline=True`` on ``local(4)`` under a
memory budget that makes it accumulate gradients). The step measured is the last of
``--steps`` (the first plans and lays out). Rank 0 prints one line per plan and rank:
measured / predicted, the bytes, and where the rank's peak was reached, and with
``--explain`` the estimate's split (parameters, states, gradients, activations).
It prints what it finds and asserts nothing.
"""

import argparse
import pathlib
import sys
import threading

import numpy as np

import distgraph as dg
from distgraph.units import fmt_bytes

SEQ, VOCAB = 32, 256
BUILD_LOCK = threading.Lock()
CLUSTERS = pathlib.Path(__file__).resolve().parent.parent / "resources" / "clusters"


class Tokens:
    def __init__(self, n, seed=0):
        rng = np.random.default_rng(seed)
        self.x = rng.integers(0, VOCAB, (n, SEQ + 1))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i, :-1].astype(np.int64), self.x[i, 1:].astype(np.int64)


def model():
    dg.seed(0)
    return dg.nn.GPT(vocab_size=VOCAB, d_model=128, n_layer=8, n_head=4, max_seq_len=SEQ)


def layout(name):
    """(model, optimizer, strategy, cluster) of plan ``name``."""
    m, opt, cluster = model(), dg.optim.AdamW(1e-3), dg.Cluster.local(4)
    mesh = {"dp": ([0, 1, 2, 3], ["dp"]), "zero2": ([0, 1, 2, 3], ["dp"]),
            "dp_accum": ([0, 1, 2, 3], ["dp"]),
            "mp": ([0, 1, 2, 3], ["mp"]), "dp_mp": ([[0, 1], [2, 3]], ["dp", "mp"]),
            "pp_1f1b": ([0, 1, 2, 3], ["pp"])}.get(name)
    strategy = dg.Strategy(micro_batches=4) if name == "dp_accum" else dg.Strategy()
    if name == "pp_1f1b":
        strategy = dg.Strategy(micro_batches=8, schedule="1F1B")
        m = dg.parallelize(m, dg.ProcessMesh(*mesh), {"pp_config": {"split_spec": "blocks"}})
    elif name == "searched":
        strategy = dg.Strategy(auto_mode="full", solver_time_limit=20)
    elif name == "searched_pp":
        strategy = dg.Strategy(auto_mode="full", pipeline=True, micro_batches=None,
                               solver_time_limit=20)
        cluster = dg.Cluster.from_file(CLUSTERS / "emulated_2x2.yaml")
    elif name == "searched_budget":
        strategy = dg.Strategy(auto_mode="full", pipeline=True, micro_batches=None,
                               solver_time_limit=20, memory_budget_gb=0.02)
    else:
        config = {}
        if "mp" in mesh[1]:
            config["mp_config"] = {"parallelize_plan": "megatron"}
        if name == "zero2":
            config["dp_config"] = {"sharding_level": 2}
        m, opt = dg.parallelize(m, dg.ProcessMesh(*mesh), config, optimizer=opt)
    return m, opt, strategy, cluster


def measure(name, comm, args):
    """This rank's (measured peak, where, predicted bytes, estimate's split, plan's
    shape) of plan ``name``."""
    m, opt, strategy, cluster = layout(name)
    engine = dg.Engine(m, dg.nn.CrossEntropyLoss(), opt, cluster=cluster,
                       strategy=strategy, communicator=comm)
    data = Tokens(args.batch * args.steps)
    with BUILD_LOCK:            # tracing is not thread-safe: the threads plan in turn
        engine.prepare(*dg.app.data.DataLoader(data, args.batch).specs(1))
    history = engine.fit(data, batch_size=args.batch, epochs=1, verbose=0)
    plan = engine.plan()
    pid = engine.process
    est = next(p for p in plan.estimate.processes if p.process == pid)
    shape = (f"{len(plan.stages)} stage(s), {plan.micro_batches} micro-batch(es), "
             f"{plan.strategy.schedule}: {' '.join(map(str, plan.schedule()[pid]))}")
    return (history.memory[-1], history.memory_at[-1], est.peak_memory,
            (est.parameters, est.states, est.gradients, est.activations), shape)


def report(name, rows, explain) -> None:
    print(f"{name}:")
    for rank, (peak, where, predicted, split, shape) in enumerate(rows):
        line = (f"  rank {rank}: {peak / predicted:6.3f}x  measured {fmt_bytes(peak):>9} "
                f"predicted {fmt_bytes(predicted):>9} ({peak - predicted:+d} B)  peak at "
                f"{where}")
        if explain:
            line += "\n      estimate: params {}, states {}, grads {}, acts {}; ".format(
                *map(fmt_bytes, split)) + shape
        print(line)
    sys.stdout.flush()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", default="dp,dp_accum,mp,dp_mp,pp_1f1b,zero2,searched,"
                        "searched_pp,searched_budget")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--explain", action="store_true")
    args = parser.parse_args(argv)
    dg.set_default_dtype("float32")
    names = args.plans.split(",")
    if dg.runtime.launch.status.get_world_size() > 1:
        from distgraph.runtime.comm.mpi import MPICommunicator
        comm = MPICommunicator()
        for name in names:
            mine = measure(name, comm, args)
            rows = comm._comm.gather(mine, root=0)
            if comm.rank == 0:
                report(name, rows, args.explain)
        return 0
    from distgraph.runtime.comm.simulated import SimulatedWorld
    for name in names:
        report(name, SimulatedWorld(4, timeout=300).run(
            lambda comm, name=name: measure(name, comm, args)), args.explain)
    return 0


if __name__ == "__main__":
    sys.exit(main())
