"""The runtime's count of the bytes a rank holds (runtime/execution/memory.py), against
oracles: an array a kernel keeps shows in the peak byte for byte; a serial step's peak is
the program's parameters, states and the values live at its peak, counted by hand; the
count is the same on a backend that copies what it is given (as CuPy does); pipelined
steps release everything they held."""

import dataclasses
import os
import sys

import numpy as np
import pytest

import distgraph as dg
import distgraph.ops  # noqa: F401  (registers the ops keep_probe patches)
from distgraph import registry
from distgraph.program_builder import build_program
from distgraph.runtime.backend import NUMPY, ArrayBackend
from distgraph.runtime.comm.simulated import SimulatedWorld
from distgraph.runtime.execution.memory import Held, Kept, Ledger, Mirrored
from distgraph.runtime.execution.runner import PlanRunner

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import plans as P  # noqa: E402

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


def test_held_dicts_count_each_memory_once():
    led = Ledger(NUMPY)
    a, b = np.zeros(100), np.zeros((3, 4), np.float32)
    env, other = Held(led, {"a": a}), Held(led)
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
