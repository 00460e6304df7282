"""Gradient checking: distgraph's backward against central finite differences.

``check_grads(fn, params, feeds)`` makes every array in ``params`` a float64 Parameter,
traces ``loss = sum_i sum(fn(...)[i] * R_i)`` with fixed random weights ``R_i`` (so every
output element matters), appends the backward pass, runs the program with
``ProgramRunner`` and compares each parameter's gradient with central differences of
the traced forward program.

Example::

    check_grads(lambda p, f: dg.ops.tanh(p["x"]), {"x": rng.standard_normal((3, 4))})
"""

from __future__ import annotations

import numpy as np

import distgraph as dg
from distgraph.nn.layer import Layer
from distgraph.parameter import Parameter
from distgraph.runtime.execution.executor import ProgramRunner


class _Holder(Layer):
    """Holds the parameters so that tracing names their Values after ``params``' keys."""

    def __init__(self, fn, params: dict, feed_names: list):
        super().__init__()
        self._fn, self._names, self._feed_names = fn, list(params), feed_names
        for name, arr in params.items():
            setattr(self, name, Parameter(arr, dtype=str(arr.dtype)))

    def forward(self, *inputs):
        feeds = dict(zip(self._feed_names, inputs))
        weights = [feeds.pop(n) for n in list(feeds) if n.startswith("R@")]
        outs = self._fn({n: getattr(self, n) for n in self._names}, feeds)
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        if len(outs) != len(weights):
            raise AssertionError(f"fn returned {len(outs)} outputs, expected {len(weights)}")
        loss = None
        for out, r in zip(outs, weights):
            term = dg.ops.sum(dg.ops.multiply(out, r))
            loss = term if loss is None else dg.ops.add(loss, term)
        return loss


def _output_types(fn, params: dict, feeds: dict) -> list:
    """Shapes and dtypes of ``fn``'s outputs (one throwaway trace)."""
    ps = {n: Parameter(a, dtype=str(a.dtype)) for n, a in params.items()}
    captured = []

    def probe(*inputs):
        outs = fn(ps, dict(zip(feeds, inputs)))
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        captured.extend((tuple(o.shape), o.dtype) for o in outs)
        return outs

    dg.trace(probe, *[dg.InputSpec(a.shape, str(a.dtype), n) for n, a in feeds.items()])
    return captured


class GradCheck:
    """The traced program of one case and what is needed to run it forward and backward."""

    def __init__(self, fn, params: dict, feeds: dict | None = None, seed: int = 0, step: int = 0):
        feeds = dict(feeds or {})
        params = {n: np.asarray(a) for n, a in params.items()}
        rng = np.random.default_rng(seed)
        for i, (shape, dtype) in enumerate(_output_types(fn, params, feeds)):
            feeds[f"R@{i}"] = rng.standard_normal(shape).astype(dtype)
        self.params, self.feeds, self.step = params, feeds, step
        model = _Holder(fn, params, list(feeds))
        self.program = dg.trace(model, *[dg.InputSpec(a.shape, str(a.dtype), n)
                                         for n, a in feeds.items()])
        self.forward_types = [op.type for op in self.program.ops]
        self.loss = self.program.outputs[0]
        # Compiled before the backward ops are appended: runs the forward only.
        self.forward = ProgramRunner(self.program)
        param_values = [self.program.values[n] for n in params]
        self.grads = dg.append_backward(self.program, self.loss, param_values)
        self.full = ProgramRunner(self.program)

    def loss_at(self, values: dict) -> float:
        out = self.forward.run(dict(values), self.feeds, [self.loss.name], step=self.step)
        return float(out[self.loss.name])

    def analytic(self) -> tuple[float, dict]:
        fetch = [self.loss.name] + [g.name for g in self.grads.values()]
        out = self.full.run({n: a.copy() for n, a in self.params.items()}, self.feeds, fetch,
                            step=self.step)
        return float(out[self.loss.name]), {n: out[g.name] for n, g in self.grads.items()}

    def numeric(self, name: str, h: float, max_entries: int, rng) -> tuple[np.ndarray, list]:
        """Central differences of the loss for up to ``max_entries`` entries of ``name``."""
        base = self.params[name]
        flat_idx = np.arange(base.size)
        if base.size > max_entries:
            flat_idx = np.sort(rng.choice(base.size, size=max_entries, replace=False))
        values = dict(self.params)
        out = []
        for k in flat_idx:
            pos = np.unravel_index(k, base.shape)
            plus, minus = base.copy(), base.copy()
            plus[pos] += h
            minus[pos] -= h
            values[name] = plus
            f_plus = self.loss_at(values)
            values[name] = minus
            f_minus = self.loss_at(values)
            out.append((f_plus - f_minus) / (2 * h))
        return np.array(out), [np.unravel_index(k, base.shape) for k in flat_idx]


def check_grads(fn, params: dict, feeds: dict | None = None, *, h: float = 1e-6,
                rtol: float = 1e-6, atol: float = 1e-8, max_entries: int = 48, seed: int = 0,
                step: int = 0) -> GradCheck:
    """Assert that every parameter's gradient equals central finite differences.

    ``fn(params, feeds)`` receives dicts of traced tensors (float arrays in ``params``
    become Parameters; ``feeds`` are fed inputs such as ids, labels, conditions) and
    returns one tensor or a list. ``atol`` is scaled by the gradient's magnitude.
    Returns the GradCheck (its program, forward op types, loss) for further checks.
    """
    case = GradCheck(fn, params, feeds, seed=seed, step=step)
    loss, grads = case.analytic()
    assert np.isclose(loss, case.loss_at(case.params), rtol=1e-12, atol=1e-12), \
        "forward and forward+backward programs disagree on the loss"
    missing = sorted(set(params) - set(grads))
    assert not missing, f"no gradient for parameters {missing}"
    rng = np.random.default_rng(seed + 1)
    for name, g in grads.items():
        assert g.shape == params[name].shape, f"{name}: grad shape {g.shape}"
        assert g.dtype == params[name].dtype, f"{name}: grad dtype {g.dtype}"
        num, positions = case.numeric(name, h, max_entries, rng)
        got = np.array([g[p] for p in positions])
        scale = max(1.0, float(np.max(np.abs(num))))
        np.testing.assert_allclose(got, num, rtol=rtol, atol=atol * scale,
                                   err_msg=f"gradient of {name} (ops {case.forward_types})")
    return case


def run_forward(fn, inputs: dict) -> list:
    """Trace ``fn(values)`` over fed inputs (any dtypes) and return its outputs' arrays."""
    def traced(*values):
        outs = fn(dict(zip(inputs, values)))
        return list(outs) if isinstance(outs, (list, tuple)) else [outs]

    prog = dg.trace(traced, *[dg.InputSpec(a.shape, str(a.dtype), n) for n, a in inputs.items()])
    out = ProgramRunner(prog).run({}, dict(inputs), [v.name for v in prog.outputs])
    return [out[v.name] for v in prog.outputs]
