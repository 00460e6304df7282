"""Serial GPT-tiny in float64 against the plain-numpy reference (and torch autograd).

The same parameters (``reference_gpt.init_params``) are loaded into distgraph's GPT with
``set_state_dict``; the loss and every parameter gradient must equal the reference to
1e-6 relative (the contract) and, as a stronger oracle, to 1e-9 (they agree to ~1e-15).
Then optimizer steps through ``dg.Engine.fit`` must equal the update computed by hand
in numpy from the reference gradients (PyTorch's SGD and Adam formulas).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import distgraph as dg
from distgraph.program_builder import build_program
from distgraph.runtime.execution.executor import ProgramRunner

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference_gpt import gpt_loss_and_grads, init_params  # noqa: E402

V, D, L, H, T, B = 128, 64, 2, 4, 32, 4
CONTRACT_RTOL = 1e-6
STRONG_RTOL = 1e-9


def reference_params(seed=1):
    return init_params(V, D, L, H, T, seed=seed)


def batch(seed, n=B):
    rng = np.random.default_rng(seed)
    return rng.integers(0, V, (n, T)), rng.integers(0, V, (n, T))


def gpt_with(params) -> dg.nn.GPT:
    model = dg.nn.GPT(V, D, L, H, T)
    model.set_state_dict(params)
    return model


def distgraph_loss_and_grads(params, tokens, labels):
    model = gpt_with(params)
    built = build_program(model, [dg.InputSpec([B, T], "int64", "tokens")],
                          [dg.InputSpec([B, T], "int64", "labels")],
                          dg.nn.CrossEntropyLoss(), dg.optim.SGD(0.1))
    scope = {n: p.numpy() for n, p in model.named_parameters()}
    scope.update(dg.optim.SGD(0.1).initial_state(built.program))
    fetch = [built.loss_name] + list(built.grad_names.values())
    out = ProgramRunner(built.program).run(scope, {"tokens": tokens, "labels": labels}, fetch)
    return float(out[built.loss_name]), {n: out[g] for n, g in built.grad_names.items()}


def max_rel_error(got, want) -> float:
    """Max abs difference relative to the reference tensor's scale."""
    scale = float(np.max(np.abs(want)))
    return float(np.max(np.abs(got - want))) / (scale if scale > 0 else 1.0)


def assert_grads_match(grads, ref_grads):
    assert set(grads) == set(ref_grads)
    worst = 0.0
    for name, want in ref_grads.items():
        got = grads[name]
        assert got.shape == want.shape and got.dtype == np.float64, name
        scale = float(np.max(np.abs(want)))
        np.testing.assert_allclose(got, want, rtol=CONTRACT_RTOL, atol=CONTRACT_RTOL * scale,
                                   err_msg=name)
        worst = max(worst, max_rel_error(got, want))
    assert worst < STRONG_RTOL, f"worst relative gradient error {worst:.3g}"


# -- forward and backward --------------------------------------------------------------------------
def test_loss_and_gradients_equal_numpy_reference(float64):
    params = reference_params()
    tokens, labels = batch(0)
    loss, grads = distgraph_loss_and_grads(params, tokens, labels)
    ref_loss, ref_grads = gpt_loss_and_grads(params, tokens, labels, H)
    np.testing.assert_allclose(loss, ref_loss, rtol=CONTRACT_RTOL)
    assert abs(loss - ref_loss) / abs(ref_loss) < STRONG_RTOL
    assert len(grads) == 4 * 1 + 12 * L + 1 and set(grads) == set(params)
    assert_grads_match(grads, ref_grads)
    # Rows of the token embedding that no token uses get exactly zero gradient.
    unused = np.setdiff1d(np.arange(V), tokens)
    assert unused.size and np.all(grads["wte.weight"][unused] == 0.0)


def test_predict_logits_equal_numpy_reference(float64):
    from reference_gpt import gpt_forward
    params = reference_params(seed=5)
    tokens, _ = batch(3)
    model = gpt_with(params)
    prog = dg.trace(model, dg.InputSpec([B, T], "int64", "tokens"))
    scope = {n: p.numpy() for n, p in model.named_parameters()}
    out = ProgramRunner(prog).run(scope, {"tokens": tokens}, [prog.outputs[0].name])
    logits = out[prog.outputs[0].name]
    want = gpt_forward(params, tokens, H)
    assert max_rel_error(logits, want) < STRONG_RTOL


def test_loss_and_gradients_equal_torch(float64):
    torch = pytest.importorskip("torch")
    from test_reference_gpt import _torch_loss_and_grads
    params = reference_params(seed=2)
    tokens, labels = batch(7)
    loss, grads = distgraph_loss_and_grads(params, tokens, labels)
    t_loss, t_grads = _torch_loss_and_grads(torch, params, tokens, labels, H)
    np.testing.assert_allclose(loss, t_loss, rtol=CONTRACT_RTOL)
    assert abs(loss - t_loss) / abs(t_loss) < STRONG_RTOL
    assert_grads_match(grads, t_grads)


# -- optimizer steps through the Engine ------------------------------------------------------------
def sgd_by_hand(params, grads, state, lr, momentum):
    out = {}
    for n, p in params.items():
        v = momentum * state.get(n, np.zeros_like(p)) + grads[n]
        state[n] = v
        out[n] = p - lr * v
    return out


def adam_by_hand(params, grads, state, lr, weight_decay=0.0, b1=0.9, b2=0.999, eps=1e-8):
    """PyTorch's Adam / AdamW for one step; ``state`` holds m, v and the step count."""
    t = state["t"] = state.get("t", 0) + 1
    out = {}
    for n, p in params.items():
        g = grads[n]
        m = state[("m", n)] = b1 * state.get(("m", n), 0.0) + (1 - b1) * g
        v = state[("v", n)] = b2 * state.get(("v", n), 0.0) + (1 - b2) * g * g
        p = p * (1 - lr * weight_decay)
        out[n] = p - lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
    return out


OPTIMIZERS = {
    "sgd": (lambda: dg.optim.SGD(0.1), lambda p, g, s: sgd_by_hand(p, g, s, 0.1, 0.0)),
    "sgd-momentum": (lambda: dg.optim.SGD(0.1, momentum=0.9),
                     lambda p, g, s: sgd_by_hand(p, g, s, 0.1, 0.9)),
    "adam": (lambda: dg.optim.Adam(1e-2), lambda p, g, s: adam_by_hand(p, g, s, 1e-2)),
    "adamw": (lambda: dg.optim.AdamW(1e-2, weight_decay=0.1),
              lambda p, g, s: adam_by_hand(p, g, s, 1e-2, weight_decay=0.1)),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_engine_fit_steps_equal_hand_updates(float64, name):
    make_opt, by_hand = OPTIMIZERS[name]
    params = reference_params(seed=3)
    steps = 2
    tokens, labels = batch(11, n=steps * B)
    dataset = [(tokens[i], labels[i]) for i in range(steps * B)]

    engine = dg.Engine(gpt_with(params), loss=dg.nn.CrossEntropyLoss(), optimizer=make_opt())
    history = engine.fit(dataset, batch_size=B, epochs=1)

    want, state, ref_losses = dict(params), {}, []
    for s in range(steps):
        sl = slice(s * B, (s + 1) * B)
        loss, grads = gpt_loss_and_grads(want, tokens[sl], labels[sl], H)
        ref_losses.append(loss)
        want = by_hand(want, grads, state)

    assert len(history.losses) == steps
    np.testing.assert_allclose(history.losses, ref_losses, rtol=1e-12)
    got = engine.state_dict()
    assert set(got) == set(params)
    for n in params:
        assert got[n].dtype == np.float64 and got[n].shape == params[n].shape
        moved = np.max(np.abs(want[n] - params[n]))
        assert moved > 0, f"{n} did not change"
        # Differences relative to how far the step moved the parameter.
        np.testing.assert_allclose(got[n], want[n], rtol=0, atol=1e-9 * moved + 1e-15,
                                   err_msg=n)


def test_engine_state_dict_returns_copies_of_trained_arrays(float64):
    params = reference_params(seed=4)
    tokens, labels = batch(12)
    model = gpt_with(params)
    engine = dg.Engine(model, loss=dg.nn.CrossEntropyLoss(), optimizer=dg.optim.SGD(0.1))
    engine.fit([(tokens[i], labels[i]) for i in range(B)], batch_size=B)
    trained = engine.state_dict()
    assert not np.array_equal(trained["lm_head.weight"], params["lm_head.weight"])
    # The model's parameters are the trained ones too.
    for n, p in model.named_parameters():
        np.testing.assert_array_equal(p.numpy(), trained[n])
    trained["lm_head.weight"][...] = 0.0
    assert np.any(engine.state_dict()["lm_head.weight"] != 0.0)
    # The arrays the test passed in were not trained in place.
    np.testing.assert_array_equal(params["wte.weight"], reference_params(seed=4)["wte.weight"])
