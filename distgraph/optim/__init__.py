"""Optimizers append update ops (role ``optimize``) to a training Program.

Each keeps its state as persistable Values named after the parameter
(``fc1.weight@MOMENT1``); the step counter is ``optimizer@STEP``. The learning rate is
the 0-d persistable ``optimizer@LR``, which the Engine sets before every step from
``optimizer.learning_rate`` (a number or a :mod:`distgraph.optim.lr` schedule), so a
schedule or a new learning rate needs no new plan.

Example::

    grads = append_backward(prog, loss)
    dg.optim.AdamW(1e-3).append_update(prog, grads)
"""

from __future__ import annotations

import numpy as np

from distgraph import dtypes
from distgraph.errors import DistGraphError
from distgraph.ir import Program, Role, Value
from distgraph.optim import lr
from distgraph.trace import Builder

STEP = "optimizer@STEP"
LR = "optimizer@LR"
MASTER = "MASTER"        # the float32 copy of a 16-bit parameter (mixed precision)


class Optimizer:
    """Base: ``learning_rate`` is a positive number or a schedule; it may be reassigned
    between fits. ``hyperparameters()`` are the other settings, baked into the update
    ops (changing one makes the Engine plan again)."""

    state_suffixes: tuple = ()
    mixed_precision = False   # whether it can update a 16-bit parameter (see Adam)

    def __init__(self, learning_rate):
        self.learning_rate = learning_rate

    @property
    def sharding_level(self) -> int:
        """ZeRO's level for this optimizer's updates, as ``dg.parallelize`` sets it from
        ``dp_config``'s ``sharding_level`` (Paddle wraps the optimizer for it): 0 none;
        1, 2 and 3 plan the program built with it with ``Strategy(sharding=True)`` (its
        states and updates split over ``dp``; level 3's parameters too: by
        ``parallelize`` where ``dp`` divides a dim, by the planner otherwise)."""
        return self.__dict__.get("_sharding_level", 0)

    @sharding_level.setter
    def sharding_level(self, level: int) -> None:
        if isinstance(level, bool) or level not in (0, 1, 2, 3):
            raise DistGraphError(f"{type(self).__name__}.sharding_level = {level!r}; give 0, "
                                 f"1, 2 or 3 (ZeRO's levels)")
        self._sharding_level = level

    def _sharding(self) -> dict:
        """The sharding level among the hyperparameters where it is set (a new level
        plans again)."""
        return {"sharding_level": self.sharding_level} if self.sharding_level else {}

    @property
    def learning_rate(self):
        return self._learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        lr.as_schedule(value)                  # validates numbers and schedules alike
        self._learning_rate = value

    def lr_at(self, step: int) -> float:
        """The learning rate of the optimizer step after ``step`` steps."""
        value = float(lr.as_schedule(self._learning_rate)(step))
        if not value >= 0.0:
            raise DistGraphError(f"the learning-rate schedule {self._learning_rate!r} gave "
                                 f"{value} at step {step}; a learning rate must be >= 0")
        return value

    def hyperparameters(self) -> dict:
        """Type and settings other than the learning rate, as plain data."""
        return {"type": type(self).__name__, **self._sharding()}

    def state_names(self, parameter_names) -> list:
        """Names of the state Values this optimizer keeps for ``parameter_names``."""
        names = [f"{p}@{s}" for p in parameter_names for s in self.state_suffixes]
        return names + ([STEP] if self._uses_step else [])

    _uses_step = False

    def append_update(self, program: Program, grads: dict[str, Value], scaling=None) -> None:
        """Append one update op per parameter that has a gradient, in the order the
        backward makes the gradients. ``scaling`` (float16 training's
        :class:`~distgraph.optim.amp.LossScaling`): the gradients are of the scaled loss;
        they are unscaled first, and a step whose gradients overflowed is not applied."""
        if not grads:
            raise DistGraphError("no parameter gradients to update")
        # in the order the backward makes the gradients (the last layer's first): with
        # overlap (Strategy(overlap=True)) a bucket's reduction starts once its
        # gradients are made, so the first update reads the first bucket reduced and
        # the update computes while the later buckets are on the wire
        made = {o.name: i for i, op in enumerate(program.ops) for o in op.outputs}
        order = sorted(grads, key=lambda name: made.get(grads[name].name, -1))
        grads = {name: grads[name] for name in order}
        builder = Builder(program)
        with builder.active(), builder.scope(role=Role.OPTIMIZE):
            apply = None
            if scaling is not None:
                grads, apply = scaling.unscale(builder, grads)
            flag = () if apply is None else (apply,)
            step = self._step_value(builder, flag)
            rate = self._lr_value(builder)
            for name, grad in grads.items():
                param = program.values[name]
                mixed = param.dtype in dtypes.HALF_DTYPES
                if mixed and not self.mixed_precision:
                    raise DistGraphError(f"{type(self).__name__} has no mixed-precision "
                                         f"update for the {param.dtype} parameter {name}; "
                                         f"plan 16-bit models with Adam or AdamW")
                # mixed precision keeps a float32 master copy and float32 states
                suffixes = (MASTER,) + self.state_suffixes if mixed else self.state_suffixes
                states = [builder.program.add_value(
                    Value(f"{name}@{suffix}", param.shape, "float32" if mixed else param.dtype,
                          persistable=True, role=Role.OPTIMIZE)) for suffix in suffixes]
                with builder.scope(layer=name):
                    self._emit_update(builder, param, grad, states, step, rate, flag)

    def _lr_value(self, builder):
        value = builder.program.add_value(Value(LR, (), "float64", persistable=True,
                                                role=Role.OPTIMIZE))
        # Read once through an op of its own: like the step counter, it then lives on
        # the union of the update meshes, and every update reads it without a message.
        (read,) = builder.emit("scale", [value], {"scale": 1.0, "bias": 0.0},
                               names=[f"{LR}@READ"])
        return read

    def _step_value(self, builder, flag):
        return None

    def _emit_update(self, builder, param, grad, states, step, rate, flag):
        """Append the update of ``param``; ``flag``: () or (the 0-d bool apply,)."""
        raise NotImplementedError

    def initial_state(self, program: Program) -> dict:
        """Zero arrays for every optimizer state Value of ``program``, and the learning
        rate of the first step."""
        out = {}
        for v in program.persistables:
            if not v.is_parameter:
                out[v.name] = np.zeros(v.shape, dtype=v.dtype)
        if LR in out:
            out[LR] = np.array(self.lr_at(0), dtype=np.float64)
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

    def hyperparameters(self):
        return {"type": type(self).__name__, "momentum": self.momentum, **self._sharding()}

    def _emit_update(self, builder, param, grad, states, step, rate, flag):
        (vel,) = states
        outs = builder.emit("sgd_update", [param, grad, vel, rate, *flag],
                            {"momentum": self.momentum},
                            names=[f"{param.name}@OUT", f"{vel.name}@OUT"])
        _outputs_alias(outs, [param, vel])


class Adam(Optimizer):
    """Adam; a 16-bit parameter (planning) is updated as mixed-precision training does,
    on a float32 master copy (``p@MASTER``) with float32 moments."""

    state_suffixes = ("MOMENT1", "MOMENT2")
    mixed_precision = True
    weight_decay = 0.0
    _uses_step = True

    def __init__(self, learning_rate, beta1=0.9, beta2=0.999, epsilon=1e-8):
        super().__init__(learning_rate)
        self.beta1, self.beta2, self.epsilon = float(beta1), float(beta2), float(epsilon)

    def hyperparameters(self):
        return {"type": type(self).__name__, "beta1": self.beta1, "beta2": self.beta2,
                "epsilon": self.epsilon, "weight_decay": self.weight_decay, **self._sharding()}

    def _step_value(self, builder, flag):
        step = builder.program.values.get(STEP)
        if step is None:
            step = builder.program.add_value(Value(STEP, (), "int64", persistable=True,
                                                   role=Role.OPTIMIZE))
        (out,) = builder.emit("increment", [step, *flag], names=[f"{STEP}@OUT"])
        out.alias_of = STEP
        return out

    def _emit_update(self, builder, param, grad, states, step, rate, flag):
        attrs = {"beta1": self.beta1, "beta2": self.beta2, "epsilon": self.epsilon,
                 "weight_decay": self.weight_decay}
        op = "mixed_adam_update" if len(states) == 3 else "adam_update"
        outs = builder.emit(op, [param, grad, *states, step, rate, *flag], attrs,
                            names=[f"{param.name}@OUT"] + [f"{s.name}@OUT" for s in states])
        _outputs_alias(outs, [param, *states])


class AdamW(Adam):
    """Adam with decoupled weight decay (p *= 1 - lr * weight_decay before the step)."""

    def __init__(self, learning_rate, beta1=0.9, beta2=0.999, epsilon=1e-8, weight_decay=0.01):
        super().__init__(learning_rate, beta1, beta2, epsilon)
        self.weight_decay = float(weight_decay)
