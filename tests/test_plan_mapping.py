"""Rank mapping of a real partitioned plan: the traffic graph comes from the reshard
points of a completed DP x TP program (TP degree 8 on the 2 x 8 GPU cluster) and from the
collectives ops run themselves (the vocab-parallel cross-entropy's)."""

import itertools
import pathlib

import distgraph as dg
from distgraph.passes.mapping.traffic import traffic_graph
from distgraph.plan.kinds import collective_bytes
from distgraph.passes.partition import Partitions
from distgraph.passes.mapping.rank_mapping import best_random_mapping, bfs_first_free_mapping, map_ranks
from distgraph.program_builder import build_program
from distgraph.resources.cluster import Cluster

import plans  # tests/ is on the path

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
    graph = traffic_graph(dg.passes.complete(built.program), device_type="GPU")
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
    once = traffic_graph(plan.program, parts, "GPU")
    step = traffic_graph(plan.program, parts, "GPU", micro_batches=16)
    (tp1, dp1), (tp16, dp16) = tp_and_dp(once), tp_and_dp(step)
    assert tp1 < dp1 and tp16 == 16 * tp1 and dp16 < dp1 + tp1
    machine = {d.global_id: d.machine_id for d in cluster.devices}
    for group in MESH.groups("tp"):
        assert len({machine[cluster.devices[plan.ranks(p)].global_id] for p in group}) == 1
    split = map_ranks(once, cluster).process_to_device
    assert any(len({machine[split[p]] for p in g}) > 1 for g in MESH.groups("tp"))


def test_the_collectives_an_op_runs_itself_are_traffic_of_the_group_its_kernel_names():
    """The vocab-parallel cross-entropy all-gathers and all-reduces over its class-split
    group (mp): those pairs carry its bytes, as the cost model's load of the two steps."""
    built = plans.vocab_parallel_head()
    plan = dg.passes.plan(built)
    (collectives,) = plan.local(0).op_comm.values()
    graph = traffic_graph(plan.program, Partitions(plan.program, plan.process_ids))
    # a ring of two: each process sends its part to the other
    own = 2 * sum(collective_bytes(kind, n, nbytes) for kind, n, nbytes in collectives)
    assert own > 0
    assert graph.traffic[(0, 1)] == graph.traffic[(2, 3)] == own
    assert graph.messages[(0, 1)] == 2 * (1 + 2)          # all_gather 1, all_reduce 2 rounds
