"""Optimizers append update ops (role ``optimize``) to a training Program.

Each keeps its state as persistable Values named after the parameter
(``fc1.weight@MOMENT1``); the step counter is ``optimizer@STEP``.

Example::

    grads = append_backward(prog, loss)
    dg.optim.AdamW(1e-3).append_update(prog, grads)
"""

from __future__ import annotations

from distgraph.errors import DistGraphError
from distgraph.ir import Program, Value
from distgraph.trace import Builder

STEP = "optimizer@STEP"


class Optimizer:
    state_suffixes: tuple = ()

    def __init__(self, learning_rate: float):
        if learning_rate <= 0:
            raise DistGraphError(f"learning_rate must be positive, got {learning_rate}")
        self.learning_rate = float(learning_rate)

    def append_update(self, program: Program, grads: dict[str, Value]) -> None:
        """Append one update op per parameter that has a gradient."""
        if not grads:
            raise DistGraphError("no parameter gradients to update")
        builder = Builder(program)
        with builder.active(), builder.scope(role="optimize"):
            step = self._step_value(builder)
            for name, grad in grads.items():
                param = program.values[name]
                states = [builder.program.add_value(
                    Value(f"{name}@{suffix}", param.shape, param.dtype, persistable=True,
                          role="optimize")) for suffix in self.state_suffixes]
                with builder.scope(layer=name):
                    self._emit_update(builder, param, grad, states, step)

    def _step_value(self, builder):
        return None

    def _emit_update(self, builder, param, grad, states, step):
        raise NotImplementedError

    def initial_state(self, program: Program) -> dict:
        """Zero arrays for every optimizer state Value of ``program``."""
        import numpy as np
        out = {}
        for v in program.persistables:
            if not v.is_parameter:
                out[v.name] = np.zeros(v.shape, dtype=v.dtype)
        return out


def _outputs_alias(outs, targets):
    for out, target in zip(outs, targets):
        out.alias_of = target.name


class SGD(Optimizer):
    """SGD with optional momentum (PyTorch form: v = mu v + g; p -= lr v)."""

    state_suffixes = ("VELOCITY",)

    def __init__(self, learning_rate, momentum=0.0):
        super().__init__(learning_rate)
        self.momentum = float(momentum)

    def _emit_update(self, builder, param, grad, states, step):
        (vel,) = states
        outs = builder.emit("sgd_update", [param, grad, vel],
                            {"lr": self.learning_rate, "momentum": self.momentum},
                            names=[f"{param.name}@OUT", f"{vel.name}@OUT"])
        _outputs_alias(outs, [param, vel])


class Adam(Optimizer):
    state_suffixes = ("MOMENT1", "MOMENT2")
    weight_decay = 0.0

    def __init__(self, learning_rate, beta1=0.9, beta2=0.999, epsilon=1e-8):
        super().__init__(learning_rate)
        self.beta1, self.beta2, self.epsilon = float(beta1), float(beta2), float(epsilon)

    def _step_value(self, builder):
        step = builder.program.values.get(STEP)
        if step is None:
            step = builder.program.add_value(Value(STEP, (), "int64", persistable=True,
                                                   role="optimize"))
        (out,) = builder.emit("increment", [step], names=[f"{STEP}@OUT"])
        out.alias_of = STEP
        return out

    def _emit_update(self, builder, param, grad, states, step):
        m, v = states
        outs = builder.emit("adam_update", [param, grad, m, v, step],
                            {"lr": self.learning_rate, "beta1": self.beta1, "beta2": self.beta2,
                             "epsilon": self.epsilon, "weight_decay": self.weight_decay},
                            names=[f"{param.name}@OUT", f"{m.name}@OUT", f"{v.name}@OUT"])
        _outputs_alias(outs, [param, m, v])


class AdamW(Adam):
    """Adam with decoupled weight decay (p *= 1 - lr * weight_decay before the step)."""

    def __init__(self, learning_rate, beta1=0.9, beta2=0.999, epsilon=1e-8, weight_decay=0.01):
        super().__init__(learning_rate, beta1, beta2, epsilon)
        self.weight_decay = float(weight_decay)
