"""Tutorial 03: let the search choose the plan, for the machines a cluster file describes.

Tutorials 02 and 04 say how to split the model (``shard_tensor``, ``shard_op``). Here the
model carries no annotation: ``Strategy(auto_mode="full")`` plans it for a resource file.
The search gives every op of the training step (forward, backward and update) one
strategy on a ProcessMesh of the file's device mesh (by default, ``search="auto"``, the
double-recursive search chooses and Alpa's intra-op ILP on SCIP refines;
``Strategy(search="ilp")`` or ``"recursive"`` picks one), pricing each with the cost model: compute on the device's GFLOP/s and memory
bandwidth, collectives on the links of the mesh dim they run over, reshards between
ops. This script

1. prints the plan the search chose for the tiny GPT of tutorial 01: the solver's
   status, objective and time, the layouts it chose per layer, and the predicted step;
2. prices a few hand-written plans with the same cost model, for comparison;
3. trains a few steps with the chosen plan on as many ranks as the file has devices,
   and checks that the loss falls.

With ``--pipeline`` the search also cuts the model into pipeline stages (Alpa's stage
DP, ``Strategy(pipeline=True, micro_batches=4)``).

    python tutorials/03_auto_parallel.py                       # local4.yaml, ~6 s
    distgraph run -n 4 tutorials/03_auto_parallel.py           # the same, ranks started first
    distgraph cluster calibrate -n 4 -o my4.yaml               # measure this machine
    python tutorials/03_auto_parallel.py --cluster my4.yaml
    python tutorials/03_auto_parallel.py --cluster resources/clusters/emulated_2x2.yaml --no-train
    python tutorials/03_auto_parallel.py --pipeline
    python tutorials/03_auto_parallel.py --target megatron    # plans Megatron-LM can run
    distgraph plan tutorials/03_auto_parallel.py -n 4 --export megatron -- --target megatron

``distgraph plan tutorials/03_auto_parallel.py`` prints the plan without training.
"""

import argparse
import math
import os
import sys

import distgraph as dg
from distgraph.program_builder import build_program

from counting_data import CountingSequences  # tutorials/ is on the path

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CLUSTER = os.path.join(os.path.dirname(HERE), "resources", "clusters", "local4.yaml")
GPT = dict(vocab_size=64, d_model=64, n_layer=2, n_head=4, max_seq_len=32)
BATCH = 16


def strategy(args) -> dg.Strategy:
    if args.pipeline:
        return dg.Strategy(auto_mode="full", pipeline=True, micro_batches=4,
                           target=args.target)
    return dg.Strategy(auto_mode="full", target=args.target)


def program(model, data):
    return build_program(model, *dg.app.data.DataLoader(data, BATCH).specs(1),
                         dg.nn.CrossEntropyLoss(), dg.optim.AdamW(3e-3), "train")


class Annotated(dg.nn.GPT):
    """The GPT with its input batch split over ``dp`` and, given ``mp``, the Megatron
    split of each block (tutorial 02's plan)."""

    def __init__(self, mesh, megatron):
        super().__init__(**GPT)
        self.mesh = mesh
        if megatron:
            for block in self.blocks:
                for first, second in ((block.attn.qkv, block.attn.proj),
                                      (block.mlp.fc1, block.mlp.fc2)):
                    dg.shard_tensor(first.weight, mesh, [None, "mp"])
                    dg.shard_tensor(second.weight, mesh, ["mp", None])

    def forward(self, idx):
        if "dp" in self.mesh.dim_names:
            dg.shard_tensor(idx, self.mesh, ["dp", None])
        return super().forward(idx)


def hand_plans(n):
    """name -> (mesh, megatron?) of the hand-written plans for n processes."""
    plans = {"data parallel": (dg.ProcessMesh(list(range(n)), ["dp"]), False),
             "Megatron": (dg.ProcessMesh(list(range(n)), ["mp"]), True)}
    if n == 4:
        plans["dp x Megatron"] = (dg.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"]), True)
    return plans


def show(args, cluster) -> None:
    data = CountingSequences(BATCH, GPT["max_seq_len"], GPT["vocab_size"])
    dg.seed(0)
    plan = dg.passes.plan(program(dg.nn.GPT(**GPT), data), strategy(args), cluster)
    print(f"cluster {cluster.name}: {len(cluster.devices)} devices, device meshes "
          f"{[f'{m.name}{list(m.shape)}' for m in cluster.device_meshes]}")
    print(plan.search)
    print("predicted: " + str(plan.estimate).splitlines()[0])
    n = len(cluster.devices)
    if n > 1 and not args.pipeline:
        print("\nthe same cost model on hand-written plans:")
        for name, (mesh, megatron) in hand_plans(n).items():
            dg.seed(0)
            # process p on the cluster's p-th device, as the search placed them
            hand = dg.passes.plan(program(Annotated(mesh, megatron), data), dg.Strategy(),
                                  cluster, rank_mapping={p: d.global_id for p, d in
                                                         enumerate(cluster.devices)})
            step = dg.passes.estimate(hand, cluster).step_time
            print(f"  {name:<14} {step * 1e3:8.3f} ms  ({step / plan.estimate.step_time:.2f} "
                  "x the searched plan)")


def make_engine(args) -> dg.Engine:
    """The Engine of every rank: the searched plan (or, under ``distgraph run --plan
    FILE``, the file's, with no search)."""
    cluster = dg.Cluster.from_file(os.environ["DISTGRAPH_CLUSTER"])
    dg.seed(0)
    return dg.Engine(dg.nn.GPT(**GPT), loss=dg.nn.CrossEntropyLoss(),
                     optimizer=dg.optim.AdamW(3e-3), cluster=cluster, strategy=strategy(args))


def train(args, engine) -> None:
    """On every rank: train a few steps with the searched plan."""
    data = CountingSequences(BATCH * args.steps, GPT["max_seq_len"], GPT["vocab_size"])
    history = engine.fit(data, batch_size=BATCH, epochs=1, verbose=0)
    first, last = history.losses[0], sum(history.losses[-5:]) / 5
    if engine.rank == 0:
        which = f"the plan in {engine.plan_file}" if engine.plan_file else "the searched plan"
        print(f"trained {len(history.losses)} steps on {engine.world_size} ranks with "
              f"{which}: loss {first:.3f} -> {last:.3f} (ln vocab = "
              f"{math.log(GPT['vocab_size']):.3f})")
    if not last < first:
        raise RuntimeError(f"the loss did not fall ({first:.3f} -> {last:.3f})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default=DEFAULT_CLUSTER, help="resource file")
    parser.add_argument("--pipeline", action="store_true", help="search stages too")
    parser.add_argument("--steps", type=int, default=30, help="training steps")
    parser.add_argument("--no-train", action="store_true", help="only print the plan")
    parser.add_argument("--target", choices=("torchtitan", "megatron"),
                        help="search only plans that framework runs (plan.export)")
    parser.add_argument("--rank-part", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_part:
        return train(args, make_engine(args))
    cluster = dg.Cluster.from_file(args.cluster)
    if dg.get_world_size() > 1:         # started by `distgraph run -n N` already: train here
        os.environ.setdefault("DISTGRAPH_CLUSTER", os.path.abspath(args.cluster))
        engine = make_engine(args)
        # under `distgraph run --plan FILE` the file's plan runs: nothing is searched, and
        # the Engine says which file it runs
        if dg.get_rank() == 0 and engine.plan_file is None:
            show(args, cluster)
        return None if args.no_train else train(args, engine)
    show(args, cluster)
    if args.no_train:
        return
    from distgraph.runtime.launch.launcher import launch
    print(f"\ntraining on {len(cluster.devices)} ranks ...", flush=True)
    argv = [os.path.abspath(__file__), "--rank-part", "--steps", str(args.steps)]
    argv += ["--target", args.target] if args.target else []
    rc = launch(len(cluster.devices), argv + (["--pipeline"] if args.pipeline else []),
                cluster=args.cluster)
    if rc != 0:
        sys.exit(rc)


if __name__ == "__main__":
    main()
