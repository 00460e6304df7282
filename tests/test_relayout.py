"""Moving held values between two plans: the planner (``passes/relayout.py``) plans only
the values whose layout over ranks changed, and the runtime's ``relayout`` gives every
rank exactly its block of the new layout (oracle: the global array sliced as the new plan
lays it out), sending what the points' steps say and less than gathering the values
whole would."""

import numpy as np
import pytest

import distgraph as dg
from distgraph.errors import PlanError
from distgraph.passes.relayout import on_ranks, plan_relayout
from distgraph.plan.kinds import StepKind
from distgraph.program_builder import build_program
from distgraph.runtime.comm.simulated import SimulatedWorld
from distgraph.runtime.execution.runner import local_slice, relayout

MESH = dg.ProcessMesh([0, 1], ["mp"])
INPUTS = [dg.InputSpec([4, 6], name="x")]
LABELS = [dg.InputSpec([4, 2], name="y")]


class MLP(dg.nn.Layer):
    """Two Linear layers, their weights annotated with ``spec1`` / ``spec2`` on MESH
    (None: no annotation, a plan of one process)."""

    def __init__(self, spec1, spec2):
        super().__init__()
        self.fc1, self.fc2 = dg.nn.Linear(6, 8), dg.nn.Linear(8, 2)
        if spec1 is not None:
            dg.shard_tensor(self.fc1.weight, MESH, spec1)
            dg.shard_tensor(self.fc2.weight, MESH, spec2)

    def forward(self, x):
        return self.fc2(dg.ops.relu(self.fc1(x)))


def make_plan(spec1, spec2=(None, None), mode="train", rank_mapping=None):
    dg.seed(0)
    optimizer = dg.optim.Adam(0.01) if mode == "train" else None
    built = build_program(MLP(spec1, spec2), INPUTS, LABELS, dg.nn.MSELoss(), optimizer, mode)
    cluster = dg.Cluster.local(2) if rank_mapping is not None else None
    return dg.passes.plan(built, dg.Strategy(), cluster, rank_mapping)


def persistables(plan):
    return sorted(v.name for v in plan.program.persistables)


def test_only_values_whose_layout_over_ranks_changed_move():
    column = make_plan([None, "mp"])
    assert plan_relayout(column, make_plan([None, "mp"]), persistables(column), 0) == ()
    row = make_plan(["mp", None])
    moved = {p.value for p in plan_relayout(column, row, persistables(column), 0)}
    # fc1's weight and its bias (split with the weight's columns, then whole) move
    assert moved == {f"fc1.{n}{s}" for n in ("weight", "bias")
                     for s in ("", "@MOMENT1", "@MOMENT2")}
    # evaluation's plan keeps the layouts and has no optimizer states: nothing moves
    evaluation = make_plan([None, "mp"], mode="eval")
    assert plan_relayout(column, evaluation, persistables(evaluation), 0) == ()


def test_layouts_are_compared_over_ranks_not_process_ids():
    column = make_plan([None, "mp"])
    swapped = make_plan([None, "mp"], rank_mapping={0: 1, 1: 0})
    assert swapped.ranks(0) == 1 and swapped.ranks(1) == 0
    weight = swapped.program.values["fc1.weight"]
    assert on_ranks(swapped, weight.dist_attr).mesh.process_ids == [1, 0]
    # the split weight (and its moments) swap blocks; replicated values stay where they are
    points = plan_relayout(column, swapped, persistables(column), rank=0)
    assert {p.value for p in points} == {"fc1.weight", "fc1.weight@MOMENT1",
                                         "fc1.weight@MOMENT2", "fc1.bias",
                                         "fc1.bias@MOMENT1", "fc1.bias@MOMENT2"}
    assert all(p.reads == (p.value,) and p.writes == (p.value,) for p in points)
    assert all(st.kind is StepKind.SEND_RECV for p in points for st in p.steps)


def test_a_plan_that_is_not_distributed_holds_values_whole_on_every_rank():
    split, whole = make_plan([None, "mp"], mode="eval"), make_plan(None, mode="eval")
    assert split.distributed and not whole.distributed
    assert plan_relayout(whole, make_plan(None, mode="eval"), ["fc1.weight"], 0) == ()
    # whole -> split: a local slice on each rank; split -> whole: a gather to every rank
    (point,) = plan_relayout(whole, split, ["fc1.weight"], rank=1)
    assert [st.kind for st in point.steps] == [StepKind.SLICE] and point.bytes == 0
    (point,) = plan_relayout(split, whole, ["fc1.weight"], rank=1)
    assert [st.kind for st in point.steps] == [StepKind.ALL_GATHER]
    assert point.dst.mesh.process_ids == [0, 1] and point.writes == ("fc1.weight",)


def test_a_value_the_new_plan_does_not_keep_is_an_error():
    with pytest.raises(PlanError, match="fc1.weight@MOMENT1 is no persistable Value"):
        plan_relayout(make_plan([None, "mp"]), make_plan([None, "mp"], mode="eval"),
                      ["fc1.weight@MOMENT1"], 0)


@pytest.mark.parametrize("old_specs, new_specs, mapping", [
    (([None, "mp"], [None, None]), (["mp", None], ["mp", None]), None),
    (([None, "mp"], ["mp", None]), ([None, "mp"], ["mp", None]), {0: 1, 1: 0}),
], ids=["other-specs", "other-ranks"])
def test_relayout_gives_each_rank_its_block_of_the_new_layout(old_specs, new_specs, mapping):
    """Other specs move less than a gather (an all_to_all, local slices); swapped ranks
    exchange their blocks, as much as a gather sends, and no rank holds more."""
    old, new = make_plan(*old_specs), make_plan(*new_specs, rank_mapping=mapping)
    names = persistables(old)
    rng = np.random.default_rng(0)
    values = {n: rng.normal(size=old.program.values[n].shape).astype(
        old.program.values[n].dtype) for n in names}

    def rank(comm):
        mine = {n: local_slice(old.program.values[n].dist_attr, old.ranks.process(comm.rank),
                               n, values[n]) for n in names}
        points = plan_relayout(old, new, names, comm.rank)
        comm.reset_counters()
        moved = relayout(points, {p.value: mine[p.value] for p in points if p.reads}, comm,
                         comm.rank)
        pid = new.ranks.process(comm.rank)
        for n in names:
            block = moved[n] if n in moved else mine[n]
            want = local_slice(new.program.values[n].dist_attr, pid, n, values[n])
            np.testing.assert_array_equal(block, want, err_msg=n)
        planned = sum(st.bytes_sent_by(comm.rank) for p in points for st in p.steps)
        gathered = sum(values[n].nbytes / 2 for n in moved)     # each rank sends half
        return comm.total_bytes_sent, planned, gathered

    for sent, planned, gathered in SimulatedWorld(2, timeout=30).run(rank):
        assert sent == planned and 0 < sent <= gathered
        assert sent < gathered or mapping is not None
