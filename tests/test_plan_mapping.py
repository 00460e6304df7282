"""Rank mapping of a real partitioned plan: the process graph comes from the reshard
points of a completed DP x TP program (TP degree 8 on the 2 x 8 GPU cluster)."""

import itertools
import pathlib

import distgraph as dg
from distgraph.passes.mapping.traffic import process_graph
from distgraph.passes.partition import Partitions
from distgraph.passes.mapping.rank_mapping import best_random_mapping, bfs_first_free_mapping, map_ranks
from distgraph.program_builder import build_program
from distgraph.resources.cluster import Cluster

CLUSTER = pathlib.Path(dg.__file__).parent.parent / "resources" / "clusters" / "gpu_2x8.yaml"
MESH = dg.ProcessMesh([list(range(8)), list(range(8, 16))], ["dp", "tp"])


class MLP(dg.nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = dg.nn.Linear(64, 256), dg.nn.Linear(256, 64)
        dg.shard_tensor(self.fc1.weight, MESH, [None, "tp"])
        dg.shard_tensor(self.fc2.weight, MESH, ["tp", None])

    def forward(self, x):
        dg.shard_tensor(x, MESH, ["dp", None])
        return self.fc2(dg.ops.relu(self.fc1(x)))


def test_tp_groups_of_a_real_plan_stay_inside_a_machine():
    # A large batch of activations against small weights, as in Megatron-sized layers:
    # the activation all-reduces inside TP groups outweigh the gradient all-reduces, and
    # by so much that bandwidth, not the per-message latency, decides (the mapping cost
    # is alpha per message + beta per byte).
    built = build_program(MLP(), [dg.InputSpec([65536, 64], name="x")],
                          [dg.InputSpec([65536, 64], name="y")], dg.nn.MSELoss(),
                          dg.optim.Adam(1e-3))
    graph = process_graph(dg.passes.complete(built.program), device_type="GPU")
    tp = sum(graph.traffic.get(tuple(sorted(p)), 0.0)
             for g in MESH.groups("tp") for p in itertools.combinations(g, 2))
    dp = sum(graph.traffic.get(tuple(sorted(g)), 0.0) for g in MESH.groups("dp"))
    assert tp > 4 * dp > 0
    cluster = Cluster.from_file(CLUSTER)
    mapping = map_ranks(graph, cluster)
    machine = {d.global_id: d.machine_id for d in cluster.devices}
    for group in MESH.groups("tp"):
        assert len({machine[mapping.process_to_device[p]] for p in group}) == 1
    assert mapping.cost <= bfs_first_free_mapping(graph, cluster).cost * (1 + 1e-12)
    assert mapping.cost <= best_random_mapping(graph, cluster, tries=100).cost * (1 + 1e-12)


def test_a_micro_batched_plan_maps_its_traffic_per_step():
    """With micro-batches the program is one micro-batch's: its activations' all-reduces
    run M times a step, the gradients' once. Counted once each, the gradients would
    outweigh the activations and the mapper would split the TP groups over machines."""
    built = build_program(MLP(), [dg.InputSpec([512, 64], name="x")],
                          [dg.InputSpec([512, 64], name="y")], dg.nn.MSELoss(),
                          dg.optim.Adam(1e-3))
    cluster = Cluster.from_file(CLUSTER)
    plan = dg.passes.plan(built, dg.Strategy(micro_batches=16), cluster)

    def tp_and_dp(graph):
        tp = sum(graph.traffic.get(tuple(sorted(p)), 0.0)
                 for g in MESH.groups("tp") for p in itertools.combinations(g, 2))
        return tp, sum(graph.traffic.get(tuple(sorted(g)), 0.0) for g in MESH.groups("dp"))

    parts = Partitions(plan.program, plan.process_ids)
    once = process_graph(plan.program, parts, "GPU")
    step = process_graph(plan.program, parts, "GPU", micro_batches=16)
    (tp1, dp1), (tp16, dp16) = tp_and_dp(once), tp_and_dp(step)
    assert tp1 < dp1 and tp16 == 16 * tp1 and dp16 < dp1 + tp1
    machine = {d.global_id: d.machine_id for d in cluster.devices}
    for group in MESH.groups("tp"):
        assert len({machine[cluster.devices[plan.ranks(p)].global_id] for p in group}) == 1
    split = map_ranks(once, cluster).process_to_device
    assert any(len({machine[split[p]] for p in g}) > 1 for g in MESH.groups("tp"))
