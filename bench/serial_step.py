"""One Adam training step of an MLP through distgraph versus hand-written numpy.

The model is fc1 (1024 -> 4096) -> ReLU -> fc2 (4096 -> 1024), batch 64, float32, MSE
loss, Adam. distgraph plans the built training program (one process) and runs it on its
one runtime, as the Engine does (``PlanRunner``: parameters and Adam moments in the scope,
updated in place); the reference is the same forward,
backward and Adam update (PyTorch's form) written by hand in numpy, updating its arrays
in place. Both run in this process, interleaved, on the same inputs.

Prints the median (and min) time per step of each and the peak memory of one step of each
(tracemalloc; numpy reports its allocations to it), both counting the persistent
state (parameters and moments), and their ratios against the targets
(time <= 1.10, peak memory <= 1.25). Before timing, it checks that one step of each
from the same start gives the same parameters.

Run: ``python bench/serial_step.py [--steps N]``. Timings on a shared machine are noisy:
compare the two numbers of one run, not numbers across runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc

import numpy as np

import distgraph as dg
from distgraph.program_builder import build_program
from distgraph.runtime.execution.runner import PlanRunner

from reference_adam import adam_ as adam_inplace  # bench/ is on the path

BATCH, D_IN, D_HIDDEN, D_OUT = 64, 1024, 4096, 1024
LR, BETA1, BETA2, EPS = 1e-3, 0.9, 0.999, 1e-8
PARAMS = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
TIME_TARGET, MEMORY_TARGET = 1.10, 1.25


# -- the numpy reference ------------------------------------------------------------------------
def adam_(p, g, m, v, t):
    adam_inplace(p, g, m, v, t, LR, BETA1, BETA2, EPS)


def numpy_step(state: dict, x: np.ndarray, y: np.ndarray) -> float:
    """Forward, backward and Adam for the MLP; updates ``state`` in place; returns the loss."""
    w1, b1, w2, b2 = (state[n] for n in PARAMS)
    h = x @ w1
    h += b1
    a = np.maximum(h, 0)
    del h
    out = a @ w2
    out += b2
    d = np.subtract(out, y, out=out)
    loss = float(np.vdot(d, d)) / d.size
    dout = d
    dout *= np.float32(2.0 / d.size)
    grads = {"fc2.bias": dout.sum(axis=0), "fc2.weight": a.T @ dout}
    da = dout @ w2.T
    da *= a > 0
    del a, dout, d
    grads["fc1.bias"] = da.sum(axis=0)
    grads["fc1.weight"] = x.T @ da
    del da
    state["step"] += 1
    t = state["step"]
    for n in PARAMS:
        adam_(state[n], grads[n], state[n + "@MOMENT1"], state[n + "@MOMENT2"], t)
    return loss


# -- distgraph ----------------------------------------------------------------------------------
def build_distgraph():
    model = dg.nn.MLP(D_IN, D_HIDDEN, D_OUT, activation="relu")
    built = build_program(model, [dg.InputSpec([BATCH, D_IN], "float32", "x")],
                          [dg.InputSpec([BATCH, D_OUT], "float32", "y")],
                          dg.nn.MSELoss(), dg.optim.Adam(LR, BETA1, BETA2, EPS))
    return model, built


def initial_state(model, built) -> dict:
    """Parameters (copies of the model's) and zero Adam moments, step counter 0."""
    state = {n: p.numpy() for n, p in model.named_parameters()}
    state.update(dg.optim.Adam(LR).initial_state(built.program))
    return state


def numpy_state(dg_state: dict) -> dict:
    state = {n: a.copy() for n, a in dg_state.items() if n != dg.optim.STEP}
    state["step"] = 0
    return state


def state_bytes(state: dict) -> int:
    return sum(a.nbytes for a in state.values() if isinstance(a, np.ndarray))


def peak_bytes(step_fn) -> int:
    """Peak bytes newly allocated while running ``step_fn`` once (tracemalloc)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        step_fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak - base


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each")
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)

    dg.seed(0)
    model, built = build_distgraph()
    runner = PlanRunner(dg.passes.plan(built))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, D_IN)).astype(np.float32)
    y = rng.standard_normal((BATCH, D_OUT)).astype(np.float32)
    feed = {"x": x, "y": y}
    dg_state = runner.shard_scope(initial_state(model, built))
    np_state = numpy_state(dg_state)
    step = iter(range(1 << 30))

    def dg_step():
        return float(runner.run(dg_state, feed, next(step))[built.loss_name])

    def np_step():
        return numpy_step(np_state, x, y)

    # Same parameters after one step from the same start.
    dg_loss, np_loss = dg_step(), np_step()
    np.testing.assert_allclose(dg_loss, np_loss, rtol=1e-5)
    for n in PARAMS:
        np.testing.assert_allclose(dg_state[n], np_state[n], rtol=1e-5, atol=1e-7, err_msg=n)
        for s in ("@MOMENT1", "@MOMENT2"):
            np.testing.assert_allclose(dg_state[n + s], np_state[n + s], rtol=1e-4, atol=1e-12,
                                       err_msg=n + s)
    assert int(dg_state[dg.optim.STEP]) == np_state["step"] == 1

    for _ in range(args.warmup):
        dg_step()
        np_step()
    dg_times, np_times = [], []
    for _ in range(args.steps):
        for fn, times in ((dg_step, dg_times), (np_step, np_times)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    dg_t, np_t = statistics.median(dg_times), statistics.median(np_times)

    dg_peak = state_bytes(dg_state) + peak_bytes(dg_step)
    np_peak = state_bytes(np_state) + peak_bytes(np_step)

    mib = 2.0 ** 20
    print(f"MLP {D_IN}->{D_HIDDEN}->{D_OUT}, batch {BATCH}, float32, ReLU, MSE, Adam; "
          f"{args.steps} timed steps each, interleaved")
    for name, times, peak in (("distgraph", dg_times, dg_peak), ("numpy", np_times, np_peak)):
        print(f"  {name:<10} median {statistics.median(times) * 1e3:7.2f} ms/step   "
              f"min {min(times) * 1e3:7.2f} ms/step   peak {peak / mib:7.1f} MiB")
    print(f"  persistent state (params + Adam moments): {state_bytes(np_state) / mib:.1f} MiB "
          "in each peak")
    t_ratio, m_ratio = dg_t / np_t, dg_peak / np_peak
    print(f"time ratio distgraph/numpy: {t_ratio:.3f} (median; min: "
          f"{min(dg_times) / min(np_times):.3f}) target <= {TIME_TARGET:.2f} "
          f"{'OK' if t_ratio <= TIME_TARGET else 'MISSED'}")
    print(f"peak-memory ratio distgraph/numpy: {m_ratio:.3f} target <= {MEMORY_TARGET:.2f} "
          f"{'OK' if m_ratio <= MEMORY_TARGET else 'MISSED'}")

if __name__ == "__main__":
    main()
