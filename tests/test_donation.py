"""Buffer donation: the runtime lets a reshard point or an op overwrite the array it reads
only when that value dies there and nothing else can see its memory; reshard steps reduce
in place only into arrays they own; in-place all-reduce gives the same sums."""

import numpy as np
import pytest

import distgraph as dg
from distgraph.mesh import ProcessMesh
from distgraph.passes.reshard import plan_reshard
from distgraph.placement import DistAttr, ShardSpec
from distgraph.runtime.backend import NUMPY
from distgraph.runtime.comm.simulated import SimulatedWorld
from distgraph.runtime.execution.executor import DONATE_MIN_BYTES, ProgramRunner, may_donate
from distgraph.runtime.execution.memory import Counted, Kept, Ledger
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


# -- the runtime's decision -------------------------------------------------------------------------
def big(value=1.0):
    return np.full((N, N), value)


def test_a_value_that_dies_here_and_owns_its_memory_may_be_donated():
    env = {"a": big(), "b": big()}
    assert may_donate("a", ("a",), env, ())
    assert not may_donate("a", (), env, ())                   # read again later
    assert not may_donate("x", ("x",), {"x": big()}, ("x",))  # fed: the caller's array
    assert not may_donate("a", ("a",), {"a": np.ones((8, 8))}, ())   # too small to matter


def test_a_value_seen_elsewhere_is_not_donated():
    a = big()
    assert not may_donate("a", ("a",), {"a": a, "v": a.reshape(N * N)}, ())   # a live view
    assert not may_donate("a", ("a",), {"a": a}, (), {"grad": a})   # accumulated or stored
    assert not may_donate("v", ("v",), {"v": a[1:]}, ())            # a view itself


def test_the_training_executors_ledger_answers_as_the_scan_does_and_sees_what_kernels_keep():
    """The carrier reads a value's holds from its step's ledger (every container it keeps
    is counted): the same answers as the scan of the holders, and also no to an array a
    kernel keeps for its gradient (which the carrier does not hand the scan)."""
    led = Ledger(NUMPY)
    env, scope, kept = Counted(led), Counted(led), Kept(led)
    a, b = big(), big()
    env["a"], env["b"] = a, b
    assert may_donate("a", ("a",), env, (), ledger=led)
    env["v"] = a.reshape(N * N)                               # a live view
    assert not may_donate("a", ("a",), env, (), ledger=led)
    env.pop("v")
    assert may_donate("a", ("a",), env, (), ledger=led)
    scope["w"] = a                                            # stored under another name
    assert not may_donate("a", ("a",), env, (), ledger=led)
    scope.pop("w")
    kept["x"] = b                                             # kept for the backward
    assert not may_donate("b", ("b",), env, (), ledger=led)
    kept.pop("x")
    led.settle()
    assert may_donate("b", ("b",), env, (), ledger=led)
    env["s"] = np.ones((8, 8))
    assert not may_donate("s", ("s",), env, (), ledger=led)   # too small to matter
    assert not may_donate("x", ("x",), env, (), ledger=led)   # not there


@pytest.mark.parametrize("overlap", [False, True])
def test_a_dying_gradient_is_all_reduced_in_place(monkeypatch, float64, overlap):
    """Data parallel on two processes: every gradient dies at its all-reduce in the
    update, so the runtime hands it over (one buffer and pass less per gradient): at the
    update's reshard point without overlap, or to the bucket's nonblocking all-reduce
    started during the backward with it."""
    from distgraph.runtime.comm.base import Communicator
    from distgraph.runtime.execution import tasks

    flags = []
    original_point, original_iall = tasks.run_point, Communicator.iall_reduce

    def recording(point, local, comm, pid, ranks=None, tag=0, donate=False):
        if any(s.kind == "all_reduce" for s in point.steps) and local is not None \
                and local.nbytes >= DONATE_MIN_BYTES:
            flags.append((point.value, donate))
        return original_point(point, local, comm, pid, ranks, tag, donate)

    def recording_iall(self, arr, group, op="sum", inplace=False):
        if arr.nbytes >= DONATE_MIN_BYTES:
            flags.append((arr.shape, inplace))
        return original_iall(self, arr, group, op, inplace)

    monkeypatch.setattr(tasks, "run_point", recording)
    monkeypatch.setattr(Communicator, "iall_reduce", recording_iall)
    mesh = ProcessMesh([0, 1], ["dp"])

    class Wide(dg.nn.Layer):
        def __init__(self):
            super().__init__()
            self.fc = dg.nn.Linear(N, N)

        def forward(self, x):
            return self.fc(dg.shard_tensor(x, mesh, ["dp", None]))

    rng = np.random.default_rng(0)
    data = [(rng.normal(size=N), rng.normal(size=N)) for _ in range(8)]
    world = SimulatedWorld(2, timeout=20)
    engines = []
    for r in range(2):
        dg.seed(0)
        engines.append(dg.Engine(Wide(), dg.nn.MSELoss(), dg.optim.SGD(0.1),
                                 strategy=dg.Strategy(overlap=overlap),
                                 communicator=world.communicator(r)))
    world.run(lambda comm: engines[comm.rank].fit(data, batch_size=8, verbose=0))
    assert flags and all(donate for _, donate in flags), flags
    # the weight's gradient, once a step on each process (the bias is below the size)
    expected = "fc.weight@GRAD" if not overlap else (N, N)
    assert {name for name, _ in flags} == {expected}


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
