"""The held state (``distgraph/app/state.py``) lays values out through the runner's one
``lay_out`` (``runtime/execution/runner.py``), as ``PlanRunner.shard_scope`` does for
tests and benches. Oracle: on every rank, the blocks the Engine's path lays out, fresh
and after moving to another plan's layouts, equal the blocks ``shard_scope`` cuts from
the global arrays, in value, dtype and backend."""

import numpy as np

import distgraph as dg
from distgraph.app.state import HeldState
from distgraph.program_builder import build_program
from distgraph.runtime.comm.simulated import SimulatedWorld
from distgraph.runtime.execution.runner import PlanRunner

MESH = dg.ProcessMesh([0, 1], ["mp"])


class MLP(dg.nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = dg.nn.Linear(6, 8), dg.nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(dg.ops.relu(self.fc1(x)))


def planned(model, optimizer, spec1, spec2):
    """A plan of ``model`` with its weights annotated on MESH as given."""
    dg.shard_tensor(model.fc1.weight, MESH, spec1)
    dg.shard_tensor(model.fc2.weight, MESH, spec2)
    built = build_program(model, [dg.InputSpec([4, 6], name="x")],
                          [dg.InputSpec([4, 2], name="y")], dg.nn.MSELoss(), optimizer)
    return dg.passes.plan(built), built


def same(scope, want) -> None:
    assert sorted(scope) == sorted(want)
    for name, block in scope.items():
        assert block.dtype == want[name].dtype and block.flags.c_contiguous, name
        np.testing.assert_array_equal(block, want[name], err_msg=name)


def test_the_held_state_lays_out_as_shard_scope_does_fresh_and_moved():
    dg.seed(0)
    model, optimizer = MLP(), dg.optim.Adam(0.01)
    column, built = planned(model, optimizer, [None, "mp"], ["mp", None])
    row, _ = planned(model, optimizer, ["mp", None], [None, "mp"])
    assert str(column.program.values["fc1.weight"].dist_attr.spec) == "[None, mp]"
    assert str(row.program.values["fc1.weight"].dist_attr.spec) == "[mp, None]"
    values = {n: p.numpy() for n, p in model.named_parameters()}
    values.update(optimizer.initial_state(built.program))

    def rank(comm):
        held = HeldState(model, optimizer)
        first = PlanRunner(column, comm)
        same(held.bind(column, first, comm), first.shard_scope(values))
        second = PlanRunner(row, comm)      # fc1's and fc2's values move
        same(dict(held.bind(row, second, comm)), second.shard_scope(values))
        return sorted(held.layouts)

    for names in SimulatedWorld(2, timeout=30).run(rank):
        assert names == sorted(values)
