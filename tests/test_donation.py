"""Buffer donation: the executor lets a reshard point overwrite the array it reads only
when that value dies there and nothing else can see its memory; reshard steps reduce in
place only into arrays they own; in-place all-reduce gives the same sums."""

import numpy as np
import pytest

import distgraph as dg
from distgraph.mesh import ProcessMesh
from distgraph.passes.reshard import plan_reshard
from distgraph.placement import DistAttr, ShardSpec
from distgraph.runtime.comm.simulated import SimulatedWorld
from distgraph.runtime.execution.executor import DONATE_MIN_BYTES, ProgramRunner
from distgraph.runtime.execution.reshard import apply_reshard

N = 128   # float64 N x N = 128 KiB, above DONATE_MIN_BYTES
assert N * N * 8 >= DONATE_MIN_BYTES


# -- communicator ---------------------------------------------------------------------------------
@pytest.mark.parametrize("group", [(0, 1, 2), (1,)])
def test_inplace_all_reduce_sums_like_the_copying_one(group):
    def body(comm):
        if comm.rank not in group:
            return None
        x = np.full((3, 4), comm.rank + 1.0)
        copied = comm.all_reduce(x.copy(), group)
        donated = comm.all_reduce(x, group, inplace=True)
        return copied, donated, donated is x

    results = SimulatedWorld(3, timeout=20).run(body)
    total = sum(r + 1.0 for r in group)
    for rank in group:
        copied, donated, same = results[rank]
        assert np.array_equal(copied, np.full((3, 4), total))
        assert np.array_equal(donated, copied)
        if len(group) == 1:
            assert same          # nothing to reduce: the donated array is the result


def test_a_read_only_array_is_never_reduced_in_place():
    x = np.ones(4)
    x.flags.writeable = False
    out = SimulatedWorld(1).run(lambda comm: comm.all_reduce(x, (0,), inplace=True))[0]
    assert out is not x and np.array_equal(out, x)


# -- reshard steps: which all-reduce may run in place ----------------------------------------------
class RecordingComm:
    """Stands in for a communicator of one process: sums of one member, noting inplace."""

    def __init__(self):
        self.inplace = []

    def all_reduce(self, arr, group, op="sum", inplace=False):
        self.inplace.append(inplace)
        return arr if inplace else arr.copy()


def steps_of(src, dst, mesh, shape):
    return plan_reshard(DistAttr(mesh, ShardSpec(*src)), DistAttr(mesh, ShardSpec(*dst)),
                        shape, "float64")


@pytest.mark.parametrize("donate", [False, True])
def test_all_reduce_runs_in_place_only_on_a_donated_array(donate):
    mesh = ProcessMesh([0], dim_names=["x"])
    steps = steps_of(([None], ["x"]), ([None],), mesh, (4,))
    assert [s.kind for s in steps] == ["all_reduce"]
    comm, local = RecordingComm(), np.ones(4)
    out = apply_reshard(steps, local, comm, 0, donate=donate)
    assert comm.inplace == [donate]
    assert (out is local) == donate


@pytest.mark.parametrize("donate", [False, True])
def test_a_slice_of_an_array_not_donated_is_not_reduced_in_place(donate):
    mesh = ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    steps = steps_of(([None, None], ["x"]), ([None, "y"],), mesh, (4, 4))
    assert [s.kind for s in steps] == ["slice", "all_reduce"]
    local = np.arange(16.0).reshape(4, 4)
    keep = local.copy()
    # the all-reduce's group of process 0 over "x" is (0, 2); the stand-in ignores it
    comm = RecordingComm()
    apply_reshard(steps, local, comm, 0, donate=donate)
    assert comm.inplace == [donate]
    assert np.array_equal(local, keep)


# -- the executor's decision -----------------------------------------------------------------------
class Point:
    """A communication point that reads one value, records the donate flag, and (when
    donated) scribbles over the array, as an in-place collective would."""

    can_donate = True
    writes = ()

    def __init__(self, name):
        self.reads = (name,)
        self.flags = []

    def execute(self, env, donate=False):
        self.flags.append(donate)
        if donate:
            env[self.reads[0]][...] = -1.0


def run_with_point(fn, at, read_index=0, fetch=(), n=N):
    prog = dg.trace(fn, dg.InputSpec([n, n], "float64", "x"))
    name = prog.ops[read_index].outputs[0].name
    point = Point(name)
    runner = ProgramRunner(prog, comm_points={at: [point]})
    x = np.ones((n, n))
    outs = [v.name for v in prog.outputs] + list(fetch)
    result = runner.run({}, {"x": x}, fetch=outs)
    return point.flags, result, prog, x


def test_a_value_that_dies_at_the_point_is_donated():
    def fn(x):
        return dg.ops.scale(dg.ops.scale(x, 2.0), 5.0), dg.ops.scale(x, 3.0)
    # ops: a = 2x, b = 5a, c = 3x; the point reads a after its last op use
    flags, result, prog, x = run_with_point(fn, at=2)
    assert flags == [True]
    assert np.all(result[prog.outputs[0].name] == 10.0)
    assert np.all(x == 1.0)


def test_a_fetched_value_is_not_donated():
    def fn(x):
        return dg.ops.scale(dg.ops.scale(x, 2.0), 5.0), dg.ops.scale(x, 3.0)
    prog = dg.trace(fn, dg.InputSpec([N, N], "float64", "x"))
    flags, result, prog, _ = run_with_point(fn, at=2, fetch=[prog.ops[0].outputs[0].name])
    assert flags == [False]
    assert np.all(result[prog.ops[0].outputs[0].name] == 2.0)


def test_a_fed_value_is_not_donated():
    def fn(x):
        return dg.ops.scale(x, 3.0)
    prog = dg.trace(fn, dg.InputSpec([N, N], "float64", "x"))
    point = Point("x")
    x = np.ones((N, N))
    ProgramRunner(prog, comm_points={1: [point]}).run({}, {"x": x})
    assert point.flags == [False] and np.all(x == 1.0)


def test_a_value_with_a_live_view_is_not_donated():
    def fn(x):
        a = dg.ops.scale(x, 2.0)
        return dg.ops.scale(dg.ops.reshape(a, [N * N]), 5.0)
    # ops: a = 2x, v = reshape(a) (a numpy view of a), out = 5v; the point reads a
    # before the last op, while v is alive
    flags, result, prog, _ = run_with_point(fn, at=2)
    assert flags == [False]
    assert np.all(result[prog.outputs[0].name] == 10.0)


def test_a_small_value_is_not_donated():
    def fn(x):
        return dg.ops.scale(dg.ops.scale(x, 2.0), 5.0), dg.ops.scale(x, 3.0)
    flags, _, _, _ = run_with_point(fn, at=2, n=8)
    assert flags == [False]


# -- ops registered with donate ---------------------------------------------------------------------
class BiasRelu(dg.nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc = dg.nn.Linear(N, N)

    def forward(self, x):
        h = self.fc(x)                          # matmul, then the bias add
        return dg.ops.relu(h), dg.ops.tanh(h)   # h is read twice: never donated to relu


def test_dying_inputs_become_results_and_live_ones_never_do(float64):
    model = BiasRelu()
    prog = dg.trace(model, dg.InputSpec([N, N], name="x"))
    runner = ProgramRunner(prog)
    ops = [op.type for op in prog.ops]
    donors = {item.op_type: item.donors for item, _ in runner.items}
    assert donors["add"] == (prog.ops[ops.index("matmul")].outputs[0].name,)
    assert donors["relu"] == ()                 # h is still needed by tanh
    x = np.random.default_rng(0).normal(size=(N, N))
    scope = {n: p.numpy() for n, p in model.named_parameters()}
    relu_out, tanh_out = (prog.outputs[0].name, prog.outputs[1].name)
    out = runner.run(scope, {"x": x}, [relu_out, tanh_out])
    h = x @ scope["fc.weight"] + scope["fc.bias"]
    assert np.array_equal(out[relu_out], np.maximum(h, 0))
    assert np.array_equal(out[tanh_out], np.tanh(h))
    assert not np.shares_memory(out[relu_out], out[tanh_out])


def test_a_fetched_value_is_never_overwritten(float64):
    model = BiasRelu()
    prog = dg.trace(model, dg.InputSpec([N, N], name="x"))
    matmul_out = prog.ops[0].outputs[0].name
    x = np.random.default_rng(1).normal(size=(N, N))
    scope = {n: p.numpy() for n, p in model.named_parameters()}
    out = ProgramRunner(prog).run(scope, {"x": x}, [matmul_out])
    assert np.array_equal(out[matmul_out], x @ scope["fc.weight"])
