"""Completion settles conflicts by redistribution cost (issue #8, MindSpore's sharding
propagation).

Oracles: the bytes and the time of each step of a reshard are the cost model's ring
formulas (hand derived below); completion's own measure of a plan's traffic equals what
partition places for it; the layouts chosen are the cheaper of the candidates, the time
over the links of a cluster deciding (the Engine's, priced as the search prices it; else
Cluster.local's, as the estimate prices it); annotated results and shard_op in_specs
hold; why() says what was kept and what the alternative would have moved.
"""

import conflicts
import plans as P
import pytest
import search_cases as S
from distgraph.passes.completion.complete import CompletionSetup, _Completion
from distgraph.passes.partition import partition, process_ids
from distgraph.passes.completion.resolution import ReshardPricer
from distgraph.passes.cost.layout_prices import LayoutPrices
from distgraph.passes.transforms.zero import shard_updates

import distgraph as dg
from distgraph.program_builder import build_program

X4 = dg.ProcessMesh([0, 1, 2, 3], ["x"])
XY = dg.ProcessMesh([[0, 1, 2], [3, 4, 5]], ["x", "y"])


def step_bytes(program) -> float:
    """Bytes all processes send in one step, from partition (what the runtime counts)."""
    return sum(sum(partition(program, pid).bytes_sent().values())
               for pid in process_ids(program))


def specs(op):
    return [str(s) for s in op.dist_attr.input_specs], [str(s) for s in op.dist_attr.output_specs]


def op_of(program, op_type):
    return next(op for op in program.ops if op.type == op_type)


def test_cross_entropy_keeps_the_logits_and_gathers_the_labels():
    # On 1 GB/s links the bytes decide: gathering the labels and the op's own small
    # collectives (vocab-parallel) against an all-to-all of the logits.
    prog = conflicts.conflict_cross_entropy(S.line_cluster(4, bandwidth=1.0))
    sce = op_of(prog, "softmax_cross_entropy")
    assert specs(sce)[0] == ["[None, None, x]", "[None, None]"]
    # labels [8, 16] int64 gathered over 4: (n-1)/n of the 1 kB gathered buffer per
    # process; the op's own all-gather of 128 logsumexps x 4 and all-reduce of 128
    # picked logits (float32), per process; and the mean's count of labels that are not
    # ignore_index, counted where the labels are split: one float32 all-reduce
    labels = 3 / 4 * 8 * 16 * 8
    inside = 3 / 4 * 128 * 4 * 4 + 2 * 3 / 4 * 128 * 4
    count = 2 * 3 / 4 * 4
    assert step_bytes(prog) == pytest.approx(4 * (labels + inside + count))
    note = next(n for n in sce.dist_attr.notes if n.startswith("kept"))
    assert note.startswith("kept matmul_0 [None, None, x]: resharding labels (768 B) instead "
                           "of matmul_0 (24.6 kB)")
    # the time decides: per step, the labels' all_gather and the op's own all_gather and
    # all_reduce over its class-split group, against the logits' all-to-all
    assert "planned 12.3 kB taking 21.1 us per step against 98.4 kB taking 39.6 us" in note
    text = dg.passes.why(prog, "labels")
    assert "because on softmax_cross_entropy: kept matmul_0 [None, None, x]" in text


def test_where_latency_decides_the_cross_entropy_reshards_the_logits():
    """On this machine's links (Cluster.local: 10 GB/s, 1 us), what completion prices
    without a cluster as the estimate does, the logits' all-to-all (24.6 kB per process,
    3 rounds) takes less than the vocab-parallel form's own all_gather and all_reduce
    over the class-split group (9 rounds) with the labels' all_gather: the rule's order,
    logits split on the batch, stands."""
    prog = conflicts.conflict_cross_entropy()
    assert specs(op_of(prog, "softmax_cross_entropy"))[0] == ["[x, None, None]", "[x, None]"]
    alike = conflicts.conflict_cross_entropy(dg.Cluster.local(4))
    assert specs(op_of(alike, "softmax_cross_entropy")) == \
        specs(op_of(prog, "softmax_cross_entropy"))


def test_combined_split_kept_where_cheaper_than_the_rule_order():
    prog = conflicts.conflict_embedding()
    emb = op_of(prog, "embedding")
    # keeping the table's (x, y) split gathers the ids over x: 1.02 kB of int64 per process
    assert specs(emb) == (["[None, None]", "[None, (x,y)]"], ["[None, None, (x,y)]"])
    assert step_bytes(prog) == pytest.approx(6 * (1 / 2 * 8 * 16 * 8))
    prog = conflicts.conflict_matmul()
    mm = op_of(prog, "matmul")
    assert specs(mm) == (["[None, None]", "[None, (x,y)]"], ["[None, (x,y)]"])
    assert step_bytes(prog) == pytest.approx(6 * (1 / 2 * 32 * 16 * 4))


def test_equal_costs_keep_the_rule_order():
    prog = conflicts.conflict_add()
    add = op_of(prog, "add")
    assert specs(add) == (["[None, None, x]", "[None, None, x]"], ["[None, None, x]"])
    assert any(n.startswith("kept a [None, None, x]") for n in add.dist_attr.notes)


def test_shard_op_in_specs_and_annotated_results_hold():
    prog = conflicts.conflict_bias()
    mm = op_of(prog, "matmul")
    assert specs(mm)[0][0] == "[x, None]"            # shard_op in_shard_specs
    mesh = dg.ProcessMesh([0, 1], ["x"])

    def f(a, b):
        dg.shard_tensor(a, mesh, [None, "x"])
        dg.shard_tensor(b, mesh, ["x", None])
        return dg.shard_tensor(dg.ops.add(a, b), mesh, ["x", None])

    prog = dg.passes.complete(dg.trace(f, dg.InputSpec([4, 4], name="a"),
                                       dg.InputSpec([4, 4], name="b")))
    assert specs(prog.ops[0])[1] == ["[x, None]"]
    assert str(prog.values["add_0"].dist_attr.spec) == "[x, None]"


def conflict_matmul_2d(cluster=None):
    def f(a, b):
        dg.shard_tensor(a, XY, [None, "x"])
        dg.shard_tensor(b, XY, ["y", None])
        return dg.ops.relu(dg.ops.matmul(a, b))

    prog = dg.trace(f, dg.InputSpec([64, 48], name="a"), dg.InputSpec([48, 36], name="b"))
    return dg.passes.complete(prog, cluster=cluster)


def test_the_links_decide_by_time():
    # k split over x (a) or y (b). Keeping a: b is gathered over y (4.61 kB per process)
    # and the output all-reduced over x (9.22 kB); keeping b: a gathered over x (6.14 kB),
    # the output all-reduced over y (12.3 kB). On like links (Cluster.local, the default)
    # fewer bytes and messages keep a; a slow network under x keeps b.
    mm = conflict_matmul_2d().ops[0]
    assert specs(mm) == (["[None, x]", "[x, None]"], ["[None, None] P(x)"])
    mm = conflict_matmul_2d(two_machines(0.1)).ops[0]
    assert specs(mm) == (["[None, y]", "[y, None]"], ["[None, None] P(y)"])
    note = next(n for n in mm.dist_attr.notes if n.startswith("kept"))
    assert note.startswith("kept b [y, None]: resharding a (6.14 kB), matmul_0 (12.3 kB) "
                           "instead of b (4.61 kB), matmul_0 (9.22 kB)")
    assert " us" in note


def test_without_a_cluster_completion_prices_on_the_local_one():
    """No cluster: the reshards are priced on Cluster.local of the program's processes,
    as the estimate prices a plan without one: the same choices and notes."""
    alone = conflict_matmul_2d().ops[0]
    local = conflict_matmul_2d(dg.Cluster.local(6)).ops[0]
    assert specs(alone) == specs(local) and alone.dist_attr.notes == local.dist_attr.notes


def two_machines(network_GBps: float) -> dg.Cluster:
    """XY's processes on two machines of three devices (100 GB/s inside a machine):
    mesh dim y inside the machines, x across them over ``network_GBps``."""
    def device(i):
        return {"global_id": i, "type": "CPU", "memory": 1, "gflops": {"float32": 10.0}}
    machines = [{"hostname": f"m{m}", "devices": [device(i) for i in range(3 * m, 3 * m + 3)],
                 "links": [{"group": list(range(3 * m, 3 * m + 3)), "bandwidth": 100.0,
                            "latency": 1.0}]} for m in range(2)]
    links = [{"source": i, "target": i + 3, "bandwidth": network_GBps, "latency": 1.0}
             for i in range(3)]
    return dg.Cluster.from_dict({"machines": machines, "links": links})


class KSplitLinear(dg.nn.Layer):
    """conflict_matmul_2d from the user's side: the input split over x, the weight over y."""

    def __init__(self):
        super().__init__()
        self.fc = dg.nn.Linear(48, 36)
        dg.shard_tensor(self.fc.weight, XY, ["y", None])

    def forward(self, a):
        return dg.ops.relu(self.fc(dg.shard_tensor(a, XY, [None, "x"])))


def test_the_engines_cluster_settles_conflicts():
    """The planner hands the Engine's cluster to completion: a slow network between the
    machines keeps the weight's split (inside the machines) where bytes alone keep the
    input's (across them)."""
    def matmul_inputs(cluster):
        dg.seed(0)
        engine = dg.Engine(KSplitLinear(), dg.nn.MSELoss(), dg.optim.SGD(0.1), cluster=cluster)
        plan = engine.prepare([dg.InputSpec([64, 48], name="a")],
                              [dg.InputSpec([64, 36], name="label")])
        return specs(op_of(plan.program, "matmul"))[0]

    assert matmul_inputs(None) == ["[None, x]", "[x, None]"]
    assert matmul_inputs(two_machines(100.0)) == ["[None, x]", "[x, None]"]
    assert matmul_inputs(two_machines(0.1)) == ["[None, y]", "[y, None]"]
    mm = conflict_matmul_2d(two_machines(0.1)).ops[0]       # complete(cluster=) too
    assert specs(mm)[0] == ["[None, y]", "[y, None]"]


def test_on_a_cluster_a_reshard_costs_what_the_search_charges():
    """One price: completion's edge on a cluster is the search's reshard price, the ring
    formula over the slowest hop (all-gather over x: one hop across the machines, whose
    network the three groups along x cross at once: a third of it each)."""
    cluster = two_machines(0.5)
    src, dst = dg.spmd.DimsSpec(("x", None)), dg.spmd.DimsSpec((None, None))
    edge = ReshardPricer(cluster).edge("input", "t", XY, src, dst, (8, 16), "float32")
    search = LayoutPrices(cluster, XY, {p: p for p in range(6)})
    assert edge.time == search.reshard(dg.ShardSpec(["x", None]), dg.ShardSpec([None, None]),
                                       (8, 16), "float32")
    assert edge.time == pytest.approx(1e-6 + 1 / 2 * 8 * 16 * 4 / (0.5e9 / 3))


def test_reshard_prices_are_the_ring_formulas():
    pricer = ReshardPricer(S.line_cluster(4, bandwidth=2.0, latency=5.0))
    edge = pricer.edge("input", "t", X4, dg.spmd.DimsSpec(("x", None)),
                       dg.spmd.DimsSpec((None, None)), (8, 16), "float32")
    gathered = 8 * 16 * 4
    assert edge.bytes == 3 / 4 * gathered
    assert edge.time == pytest.approx(3 * 5e-6 + 3 / 4 * gathered / 2e9)
    same = pricer.edge("input", "t", X4, dg.spmd.DimsSpec(("x", dg.spmd.UNKNOWN)),
                       dg.spmd.DimsSpec((dg.spmd.UNKNOWN, None)), (8, 16), "float32")
    assert same is None                         # unknown entries match the other side


PLANS = [P.PLANS[k] for k in [("mlp", "zero", 4), ("mlp", "two_stage", 4), ("gpt", "dp_tp", 4),
                              ("gpt", "sp", 2), ("gpt", "zero_dp_tp", 4)]]


@pytest.mark.parametrize("plan", PLANS, ids=str)
def test_completion_measures_traffic_as_partition_places_it(plan):
    """The measure that decides between candidates: a run of completion on the plan's
    program, written, then partitioned."""
    model = P.build_model(plan.kind)
    plan.annotate(model)
    ins, labels = dg.app.data.DataLoader(P.Dataset(plan.kind), P.BATCH).specs(1)
    program = build_program(model, ins, labels, P.loss_fn(plan.kind),
                            dg.optim.AdamW(0.01)).program
    if plan.sharding:
        dg.passes.complete(program)
        shard_updates(program, "dp")
    run = _Completion(CompletionSetup(program, None)).run()
    traffic = run.traffic()
    run.write()
    assert traffic.bytes == pytest.approx(step_bytes(program), rel=1e-12)
    assert traffic.bytes > 0


def test_settled_plans_are_deterministic():
    assert conflicts.random_gpt_program(0).pretty() == conflicts.random_gpt_program(0).pretty()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reshard_prices_are_made_when_a_conflict_is_first_priced(seed):
    """Without a cluster, completion prices conflicts on Cluster.local of the program's
    processes, built when the first conflict is priced (a program without conflicts never
    builds it): the layouts equal those of a completion given that cluster up front."""
    program = conflicts.random_gpt_program(seed)
    for v in program.values.values():
        v.dist_attr = None
    for op in program.ops:
        op.dist_attr = None
    lazy = _Completion(CompletionSetup(program, None)).run()
    assert ("pricer" in vars(lazy.static)) == bool(lazy.conflicts)
    given = dg.Cluster.local(len(process_ids(conflicts.random_gpt_program(seed))))
    eager = _Completion(CompletionSetup(program, None, given)).run()
    assert lazy.vspec == eager.vspec and lazy.ispec == eager.ispec
    assert lazy.ospec == eager.ospec and lazy.conflicts.keys() == eager.conflicts.keys()
    plain = program.clone()
    dg.passes.complete(program)
    dg.passes.complete(plain, cluster=given)
    assert program.pretty() == plain.pretty()


def test_a_program_without_conflicts_builds_no_reshard_prices():
    model = P.build_model("mlp")
    ins, labels = dg.app.data.DataLoader(P.Dataset("mlp"), P.BATCH).specs(1)
    program = build_program(model, ins, labels, P.loss_fn("mlp"), dg.optim.SGD(0.1)).program
    run = _Completion(CompletionSetup(program, dg.ProcessMesh([0, 1], ["x"]))).run()
    assert not run.conflicts and "pricer" not in vars(run.static)
