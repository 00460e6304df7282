"""The runtime's count of the bytes a rank holds (runtime/execution/memory.py), against
oracles: an array a kernel keeps shows in the peak byte for byte; a serial step's peak is
the program's parameters, states and the values live at its peak, counted by hand; the
count is the same on a backend that copies what it is given (as CuPy does); each rank
records its own; ``Strategy(memory_check=True)`` says once when a rank holds more than
its plan's estimate by over 10 %, and nothing on an ordinary plan."""

import dataclasses
import json
import os
import sys

import numpy as np
import pytest

import distgraph as dg
import distgraph.ops  # noqa: F401  (registers the ops keep_probe patches)
from distgraph import registry
from distgraph.registry import KernelContext
from distgraph.program_builder import build_program
from distgraph.runtime.backend import NUMPY, ArrayBackend
from distgraph.runtime.comm.simulated import SimulatedWorld
from distgraph.runtime.execution.memory import Counted, Kept, Ledger, Mirrored
from distgraph.runtime.execution.runner import PlanRunner
from distgraph.units import fmt_bytes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import plans as P  # noqa: E402
from user_scripts import run_user, with_prelude  # noqa: E402

BATCH = 8


class Net(dg.nn.Layer):
    """x [8, 4] -> fc1 (4 -> 8) -> relu -> fc2 (8 -> 1): every array below the size at
    which the executor donates buffers, so each value is an array of its own."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = dg.nn.Linear(4, 8), dg.nn.Linear(8, 1)

    def forward(self, x):
        return self.fc2(dg.ops.relu(self.fc1(x)))


class Rows:
    def __init__(self, n=32):
        rng = np.random.default_rng(0)
        self.x, self.y = rng.normal(size=(n, 4)), rng.normal(size=(n, 1))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def keep_probe(monkeypatch, nbytes: int, when=lambda ctx: True):
    """Make relu's kernel keep a buffer of ``nbytes`` in ``ctx.saved`` (where ``when(ctx)``)
    until relu_grad takes it back: memory the plan does not price."""
    relu, grad = registry.get_op("relu"), registry.get_op("relu_grad")

    def keeping(ctx, x, **attrs):
        if ctx.saved is not None and when(ctx):
            ctx.saved["probe"] = ctx.xp.ones(nbytes // 8)
        return relu.kernel(ctx, x, **attrs)

    def taking(ctx, *args, **attrs):
        if ctx.saved is not None:
            ctx.saved.pop("probe", None)
        return grad.kernel(ctx, *args, **attrs)

    monkeypatch.setitem(registry._REGISTRY, "relu", dataclasses.replace(relu, kernel=keeping))
    monkeypatch.setitem(registry._REGISTRY, "relu_grad", dataclasses.replace(grad, kernel=taking))


class Serial:
    """Net's training program planned for one process and run on ``backend``."""

    def __init__(self, backend=None):
        dg.seed(0)
        model, opt = Net(), dg.optim.Adam(0.01)
        self.built = build_program(model, [dg.InputSpec([BATCH, 4], name="x")],
                                   [dg.InputSpec([BATCH, 1], name="y")], dg.nn.MSELoss(), opt)
        self.plan = dg.passes.plan(self.built, dg.Strategy())
        self.runner = PlanRunner(self.plan, None, backend)
        values = {n: p.numpy() for n, p in model.named_parameters()}
        self.scope = self.runner.shard_scope({**values, **opt.initial_state(self.built.program)})
        self.data = Rows()

    def steps(self, n: int) -> list:
        for step in range(n):
            rows = slice(step * BATCH, (step + 1) * BATCH)
            self.runner.run(self.scope, {"x": self.data.x[rows], "y": self.data.y[rows]}, step)
        return self.runner.memory


def test_counted_dicts_count_each_memory_once():
    led = Ledger(NUMPY)
    a, b = np.zeros(100), np.zeros((3, 4), np.float32)
    env, other = Counted(led, {"a": a}), Counted(led)
    other["view"] = a.reshape(10, 10)[2:]            # a view of a: no new memory
    other["both"] = (a, b, {"b": b})                 # a kept structure: b once
    assert led.bytes == a.nbytes + b.nbytes
    env.pop("a")
    assert led.bytes == a.nbytes + b.nbytes          # the view still holds a
    other.clear()
    assert led.bytes == 0 and led.peak == a.nbytes + b.nbytes
    env["s"] = np.float64(1.0)                       # a numpy scalar counts its 8 bytes
    env["x"], env["n"] = 3.0, None                   # what is no array counts nothing
    assert led.bytes == 8
    kept = Kept(led, {"k": b})
    kept.pop("k")
    assert led.bytes == 8 + b.nbytes                 # a kernel's taken value: until settle
    led.settle()
    assert led.bytes == 8
    mine = {"p": np.zeros(4)}
    scope = Mirrored(led, mine)
    scope["p"] = np.ones(4)                          # an update: the new array replaces
    assert mine["p"] is scope["p"] and led.bytes == 8 + 32

    class Exchange:                                  # as moe_ffn keeps its dispatch
        def __init__(self):
            self.routes = [np.zeros(6, np.int64)]
            self.xp, self.dtype = np, np.float32     # a module and a scalar type: no memory
            self.ctx = KernelContext(np, comm=Exchange.__new__(Exchange))
            self.ctx.comm.buffer = np.zeros(1000)    # a communicator's: not the kernel's

    kept["dispatch"] = Exchange()
    assert led.bytes == 8 + 32 + 48


def test_a_serial_step_holds_the_state_and_the_values_live_at_its_peak(float64):
    """By hand, from the program: the peak is at relu_grad, holding the parameters and
    Adam's states (with its step and learning rate), the fed x (y died after the loss's
    subtract), relu's output and the two gradients relu_grad reads and writes, fc2's
    gradients and the loss (both kept for the update)."""
    run = Serial()
    memory = run.steps(3)
    values = run.plan.program.values
    state = sum(v.nbytes for v in run.plan.program.persistables)
    live = ["x", "relu_0", "relu_0@GRAD", "add_0@GRAD", "fc2.weight@GRAD", "fc2.bias@GRAD",
            run.built.loss_name]
    for m in memory:
        assert m.peak == state + sum(values[n].nbytes for n in live)
        assert (m.action, m.instruction) == ("0B0", "op 'relu_grad'")
        assert m.start == state + values["x"].nbytes + values["y"].nbytes
        assert m.resident == state                    # the scope alone between steps


def test_a_kept_buffer_shows_in_the_peak_byte_for_byte(float64, monkeypatch):
    plain = Serial().steps(2)
    keep_probe(monkeypatch, 1 << 20)
    probed = Serial().steps(2)
    for without, with_ in zip(plain, probed):
        assert with_.peak - without.peak == 1 << 20
        assert with_.resident == without.resident     # taken back by the gradient


class Copying(ArrayBackend):
    """numpy arrays, but what comes from the host is copied (as CuPy copies it to the
    GPU) and what goes to the host is copied back."""

    name = "copying"

    def __init__(self):
        super().__init__(np)

    def from_host(self, a, dtype=None):
        return np.array(a, dtype=dtype, copy=True, order="C")

    def to_host(self, a):
        return np.array(a, copy=True)


def test_the_count_is_the_same_on_a_backend_that_copies_what_it_is_given(float64):
    """The fed rows are views of the caller's batch on numpy and copies on a device: both
    count the rows' own bytes."""
    assert Serial(Copying()).steps(3) == Serial(NUMPY).steps(3)


PIPELINES = [(("mlp4", "four_stage", 4), dict(micro_batches=8, schedule="1F1B")),
             (("gpt", "two_stage_tp", 4), dict(micro_batches=4, schedule="FThenB")),
             (("gpt6", "param4", 4), dict(micro_batches=8, schedule="ZB", virtual_stages=2))]


@pytest.mark.parametrize("key,strategy", PIPELINES, ids=lambda x: "-".join(map(str, x))
                         if isinstance(x, tuple) else x.get("schedule"))
def test_pipeline_steps_end_holding_their_state_alone(float64, key, strategy):
    """Whatever a pipelined step held (receives posted ahead, sends in flight, kept
    activations, gradient buffers, weight-gradient groups), every hold is dropped by the
    step's end: each rank holds its scope alone."""
    kind, _, n = key
    model = P.build_model(kind)
    P.PIPELINE_PLANS[key].annotate(model)
    batch = 16
    data = P.Dataset(kind, batch=batch)
    ins, labels = dg.app.data.DataLoader(data, batch).specs(1)
    opt = P.make_optimizer("adamw")
    built = build_program(model, ins, labels, P.loss_fn(kind), opt)
    plan = dg.passes.plan(built, dg.Strategy(**strategy))
    if strategy.get("virtual_stages"):
        assert any(plan.program_of(p).batched for p in plan.process_ids)  # groups run
    init = {**{k: p.numpy() for k, p in model.named_parameters()},
            **opt.initial_state(built.program)}
    feed = {name: np.stack([data[i][k] for i in range(batch)])
            for k, name in enumerate(built.feed_names)}

    def rank(comm):
        runner = PlanRunner(plan, comm)
        scope = runner.shard_scope(init)
        for step in range(2):
            runner.run(scope, feed, step)
        return runner.memory, sum(a.nbytes for a in scope.values())

    for memory, state in SimulatedWorld(n, timeout=60).run(rank):
        for m in memory:
            assert m.resident == state and state <= m.start < m.peak


def engine(cluster=None, **strategy):
    dg.seed(0)
    return dg.Engine(Net(), dg.nn.MSELoss(), dg.optim.Adam(0.01), cluster=cluster,
                     strategy=dg.Strategy(**strategy))


def test_history_and_the_progress_line_show_the_peak(float64, capsys, monkeypatch):
    monkeypatch.setenv("DISTGRAPH_TERMINAL", "0")              # plain lines, not a bar
    history = engine().fit(Rows(), batch_size=BATCH, epochs=1)
    expected = Serial().steps(4)
    assert history.memory == [m.peak for m in expected]
    assert history.memory_at == ["action 0B0, op 'relu_grad'"] * 4
    err = capsys.readouterr().err
    assert f"peak_mem={fmt_bytes(expected[0].peak).replace(' ', '')}" in err


def test_the_check_says_once_where_an_unpriced_buffer_is_held(float64, capsys, monkeypatch):
    plan_peak = engine(dg.Cluster.local(1)).prepare(
        *dg.app.data.DataLoader(Rows(), BATCH).specs(1)).estimate.processes[0].peak_memory
    quiet = engine(dg.Cluster.local(1), memory_check=True)
    quiet.fit(Rows(), batch_size=BATCH, epochs=1, verbose=0)     # an ordinary plan
    assert "warning" not in capsys.readouterr().err
    keep_probe(monkeypatch, 1 << 16)
    history = engine(dg.Cluster.local(1), memory_check=True).fit(
        Rows(), batch_size=BATCH, epochs=1, verbose=0)
    lines = [x for x in capsys.readouterr().err.splitlines() if "warning" in x]
    assert len(lines) == 1, lines                                # once, not per step
    peak = history.memory[0]
    assert peak > 1.1 * plan_peak
    assert (f"rank 0 held {fmt_bytes(peak)} ({peak} bytes) at its peak in step 0, "
            f"action 0B0, op 'relu_grad': {peak / plan_peak:.2f}x the plan's estimate of "
            f"{fmt_bytes(plan_peak)} ({plan_peak} bytes)") in lines[0]


def test_the_check_without_an_estimate_says_so_once(float64, capsys):
    engine(memory_check=True).fit(Rows(), batch_size=BATCH, epochs=1, verbose=0)
    lines = [x for x in capsys.readouterr().err.splitlines() if "warning" in x]
    assert len(lines) == 1 and "this plan has none" in lines[0]
    with pytest.raises(dg.DistGraphError, match="Strategy.memory_check must be True or False"):
        dg.Strategy(memory_check="yes")


def test_two_ranks_record_their_own_peaks(float64, capsys, monkeypatch):
    """Data parallel on 2 ranks; rank 1's relu keeps a buffer: its History, its timeline
    samples and its warning show it, rank 0's do not."""
    keep_probe(monkeypatch, 1 << 16, when=lambda ctx: ctx.comm is not None and ctx.comm.rank == 1)
    mesh = dg.ProcessMesh([0, 1], ["dp"])

    def rank(comm):
        dg.seed(0)
        model = dg.parallelize(Net(), mesh)
        e = dg.Engine(model, dg.nn.MSELoss(), dg.optim.Adam(0.01), communicator=comm,
                      cluster=dg.Cluster.local(2),
                      strategy=dg.Strategy(memory_check=True, profile=True))
        history = e.fit(Rows(), batch_size=BATCH, epochs=1, verbose=0)
        return history.memory, e.timeline()

    (mem0, tl), (mem1, _) = SimulatedWorld(2, timeout=60).run(rank)
    assert [b - a for a, b in zip(mem0, mem1)] == [1 << 16] * 4
    peaks = tl.peak_memory()
    assert {r: s.peak for r, s in peaks.items()} == {0: max(mem0), 1: max(mem1)}
    assert peaks[1].action == "0B0"
    for step in range(4):
        assert [tl.peak_memory(step)[r].peak for r in (0, 1)] == [mem0[step], mem1[step]]
    counters = [e for e in tl.to_chrome()["traceEvents"] if e["name"] == "memory"]
    assert {e["pid"] for e in counters} == {0, 1}
    lines = [x for x in capsys.readouterr().err.splitlines() if "warning" in x]
    assert len(lines) == 1 and "rank 1 held" in lines[0]


@pytest.mark.mpi
def test_each_mpi_rank_counts_its_own(tmp_path):
    """Two MPI ranks, data parallel (a batch large enough for the peak to lie in the
    backward); rank 1 keeps an extra 64 KiB from relu to its gradient: each rank's
    History shows its own peak and only rank 1 warns."""
    rc, out = run_user(tmp_path, with_prelude("""
        import dataclasses, json
        import distgraph.ops  # registers the ops
        from distgraph import registry
        if dg.runtime.launch.status.get_rank() == 1:
            relu, grad = registry.get_op("relu"), registry.get_op("relu_grad")
            def keeping(ctx, x, **attrs):
                if ctx.saved is not None:
                    ctx.saved["probe"] = np.ones(8192)
                return relu.kernel(ctx, x, **attrs)
            def taking(ctx, *args, **attrs):
                ctx.saved.pop("probe", None)
                return grad.kernel(ctx, *args, **attrs)
            registry._REGISTRY["relu"] = dataclasses.replace(relu, kernel=keeping)
            registry._REGISTRY["relu_grad"] = dataclasses.replace(grad, kernel=taking)
        dg.seed(0)
        model = dg.parallelize(dg.nn.MLP(16, 32, 4, activation="relu"),
                               dg.ProcessMesh([0, 1], ["dp"]))
        engine = dg.Engine(model, loss=dg.nn.MSELoss(), optimizer=dg.optim.SGD(0.1),
                           cluster=dg.Cluster.local(2),
                           strategy=dg.Strategy(memory_check=True, profile=True))
        history = engine.fit(Rows(128), batch_size=32, verbose=0)   # peak at relu_grad
        peaks = {r: s.peak for r, s in engine.timeline().peak_memory().items()}
        print("MEMORY", engine.rank, json.dumps([history.memory, peaks]), flush=True)
    """), 2)
    assert rc == 0, out
    rows = {int(line.split()[1]): json.loads(line.split(None, 2)[2])
            for line in out.splitlines() if line.startswith("MEMORY")}
    (mem0, peaks), (mem1, _) = rows[0], rows[1]
    assert [b - a for a, b in zip(mem0, mem1)] == [8192 * 8] * 4
    assert peaks == {"0": max(mem0), "1": max(mem1)}
    warnings = [line for line in out.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "rank 1 held" in warnings[0], out
