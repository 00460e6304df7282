"""Learning-rate schedules equal their closed forms, compose, round-trip through plain
data, and the Engine applies them (and a new optimizer.learning_rate) step by step, as
hand-written SGD on a linear model does."""

import math

import numpy as np
import pytest

import distgraph as dg
from distgraph.optim import lr as L


def test_constant_and_step_decay():
    assert [L.Constant(0.1)(s) for s in (0, 7, 10**6)] == [0.1] * 3
    sched = L.StepDecay(1.0, step_size=3, gamma=0.5)
    assert [sched(s) for s in range(8)] == [1, 1, 1, .5, .5, .5, .25, .25]


def test_cosine_decay_closed_form():
    sched = L.CosineDecay(2.0, decay_steps=10, min_lr=0.5)
    for s in range(10):
        want = 0.5 + 1.5 * 0.5 * (1 + math.cos(math.pi * s / 10))
        assert sched(s) == pytest.approx(want, rel=1e-15)
    assert sched(10) == sched(99) == 0.5
    assert sched(5) == pytest.approx(1.25)


def test_linear_warmup_then_the_wrapped_schedule():
    sched = L.LinearWarmup(L.CosineDecay(1.0, 8), warmup_steps=4, start_lr=0.2)
    assert [sched(s) for s in range(4)] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    for s in range(4, 14):
        assert sched(s) == L.CosineDecay(1.0, 8)(s - 4)
    assert L.LinearWarmup(0.5, 2)(1) == 0.25 and L.LinearWarmup(0.5, 2)(5) == 0.5


def test_sequential_counts_from_each_milestone():
    sched = L.Sequential([L.Constant(1.0), L.StepDecay(0.5, 2, 0.1), 0.01], milestones=[3, 7])
    want = [1, 1, 1, .5, .5, .05, .05, .01, .01]
    assert [sched(s) for s in range(9)] == pytest.approx(want)


def test_schedules_round_trip_through_plain_data():
    sched = L.Sequential([L.LinearWarmup(L.CosineDecay(3e-3, 100, 1e-5), 10),
                          L.StepDecay(1e-5, 5)], milestones=[110])
    again = L.from_dict(sched.to_dict())
    assert again == sched and [again(s) for s in range(200)] == [sched(s) for s in range(200)]


@pytest.mark.parametrize("bad, match", [
    (lambda: L.Constant(0), "positive"), (lambda: L.CosineDecay(1.0, 0), "decay_steps"),
    (lambda: L.Sequential([0.1, 0.2], []), "one milestone fewer"),
    (lambda: L.Sequential([0.1, 0.2, 0.3], [5, 2]), "increase"),
    (lambda: dg.optim.SGD("fast"), "learning rate"), (lambda: dg.optim.SGD(-1.0), "positive"),
    (lambda: L.from_dict({"type": "Exponential"}), "unknown"),
])
def test_bad_schedules_raise(bad, match):
    with pytest.raises(dg.DistGraphError, match=match):
        bad()


class Rows:
    def __init__(self, n=12, seed=0):
        rng = np.random.default_rng(seed)
        self.x, self.y = rng.normal(size=(n, 3)), rng.normal(size=(n, 2))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def sgd_by_hand(w, b, data, batch, rates):
    """Plain SGD on mean((x w + b - y)^2) with the given rate per step."""
    losses = []
    for s, rate in enumerate(rates):
        x, y = data.x[s * batch:(s + 1) * batch], data.y[s * batch:(s + 1) * batch]
        d = x @ w + b - y
        losses.append(float(np.mean(d * d)))
        g = 2.0 * d / d.size
        w, b = w - rate * (x.T @ g), b - rate * g.sum(axis=0)
    return losses, w, b


def test_engine_applies_the_schedule_each_step(float64):
    dg.seed(1)
    model = dg.nn.Linear(3, 2)
    w0, b0 = model.weight.numpy(), model.bias.numpy()
    sched = L.LinearWarmup(L.StepDecay(0.3, step_size=2, gamma=0.5), warmup_steps=2, start_lr=0.1)
    engine = dg.Engine(model, dg.nn.MSELoss(), dg.optim.SGD(sched))
    history = engine.fit(Rows(), batch_size=2, epochs=1, verbose=0)
    want, w, b = sgd_by_hand(w0, b0, Rows(), 2, [sched(s) for s in range(6)])
    np.testing.assert_allclose(history.losses, want, rtol=1e-13)
    params = engine.state_dict()
    np.testing.assert_allclose(params["weight"], w, rtol=1e-13)
    np.testing.assert_allclose(params["bias"], b, rtol=1e-13)
    assert [e["lr"] for e in history.epochs] == [sched(5)]


def test_a_new_learning_rate_between_fits_takes_effect(float64):
    dg.seed(2)
    model = dg.nn.Linear(3, 2)
    w0, b0 = model.weight.numpy(), model.bias.numpy()
    opt = dg.optim.SGD(0.1)
    engine = dg.Engine(model, dg.nn.MSELoss(), opt)
    first = engine.fit(Rows(4), batch_size=2, verbose=0).losses
    opt.learning_rate = 0.05
    second = engine.fit(Rows(4), batch_size=2, epochs=2, verbose=0).losses
    data = Rows(4)
    both = type("Twice", (), {"x": np.concatenate([data.x, data.x]),
                              "y": np.concatenate([data.y, data.y])})
    want, w, b = sgd_by_hand(w0, b0, both, 2, [0.1, 0.1, 0.05, 0.05])
    np.testing.assert_allclose(first + second, want, rtol=1e-13)
    np.testing.assert_allclose(engine.state_dict()["weight"], w, rtol=1e-13)


def test_new_optimizer_settings_plan_the_program_again(float64):
    dg.seed(3)
    opt = dg.optim.SGD(0.1, momentum=0.0)
    engine = dg.Engine(dg.nn.Linear(3, 2), dg.nn.MSELoss(), opt)
    engine.fit(Rows(4), batch_size=2, verbose=0)
    first = engine.plan()
    opt.momentum = 0.9
    engine.fit(Rows(4), batch_size=2, epochs=2, verbose=0)
    updates = [op for op in engine.plan().program.ops if op.type == "sgd_update"]
    assert engine.plan() is not first and all(op.attrs["momentum"] == 0.9 for op in updates)
