"""Learning-rate schedules: pure functions of the optimizer step, composable.

A schedule maps the number of optimizer steps already taken (0 for the first step) to
the learning rate of the next one. The Engine asks for it before every step and feeds it
to the update ops, so a schedule (or a new ``optimizer.learning_rate``) takes effect
without planning again, and resuming from a checkpoint needs only the step count.

- ``Constant(lr)``
- ``LinearWarmup(schedule_or_lr, warmup_steps, start_lr=0.0)``: from ``start_lr`` up to
  the wrapped schedule's first value over ``warmup_steps``, then the wrapped schedule
  (which starts counting after the warm-up, as Paddle's LinearWarmup).
- ``CosineDecay(lr, decay_steps, min_lr=0.0)``: half a cosine from ``lr`` to ``min_lr``,
  then ``min_lr``.
- ``StepDecay(lr, step_size, gamma=0.1)``: ``lr * gamma ** (step // step_size)``.
- ``Sequential(schedules, milestones)``: schedule i from milestone i-1 on, counting from
  there (PyTorch's SequentialLR).

Example::

    lr = dg.optim.lr.LinearWarmup(dg.optim.lr.CosineDecay(3e-3, decay_steps=900), 100)
    opt = dg.optim.AdamW(lr)
    [round(lr(s), 6) for s in (0, 50, 100, 1000)]     # [0.0, 0.0015, 0.003, 0.0]
"""

from __future__ import annotations

import math
import numbers

from distgraph.errors import DistGraphError


class LRSchedule:
    """Base class: ``schedule(step) -> float``; ``to_dict()`` describes it as plain data
    (what checkpoints record) and :func:`from_dict` rebuilds it."""

    def __call__(self, step: int) -> float:
        raise NotImplementedError

    def to_dict(self) -> dict:
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items() if k != "type")
        return f"{type(self).__name__}({args})"

    def __eq__(self, other) -> bool:
        return isinstance(other, LRSchedule) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(repr(self))


def _positive(name: str, value, allow_zero=False) -> float:
    if not isinstance(value, numbers.Real) or value < 0 or (value == 0 and not allow_zero):
        raise DistGraphError(f"{name} must be a {'non-negative' if allow_zero else 'positive'} "
                             f"number, got {value!r}")
    return float(value)


def _steps(name: str, value) -> int:
    if not isinstance(value, numbers.Integral) or value < 1:
        raise DistGraphError(f"{name} must be a positive integer number of steps, got {value!r}")
    return int(value)


def as_schedule(lr) -> LRSchedule:
    """A schedule from a number (``Constant``) or a schedule."""
    if isinstance(lr, LRSchedule):
        return lr
    if isinstance(lr, numbers.Real) and not isinstance(lr, bool):
        return Constant(lr)
    raise DistGraphError(f"a learning rate is a positive number or a dg.optim.lr schedule, "
                         f"got {lr!r}")


class Constant(LRSchedule):
    def __init__(self, lr):
        self.lr = _positive("Constant lr", lr)

    def __call__(self, step):
        return self.lr

    def to_dict(self):
        return {"type": "Constant", "lr": self.lr}


class LinearWarmup(LRSchedule):
    def __init__(self, schedule, warmup_steps, start_lr=0.0):
        self.schedule = as_schedule(schedule)
        self.warmup_steps = _steps("LinearWarmup warmup_steps", warmup_steps)
        self.start_lr = _positive("LinearWarmup start_lr", start_lr, allow_zero=True)

    def __call__(self, step):
        if step < self.warmup_steps:
            end = self.schedule(0)
            return self.start_lr + (end - self.start_lr) * step / self.warmup_steps
        return self.schedule(step - self.warmup_steps)

    def to_dict(self):
        return {"type": "LinearWarmup", "schedule": self.schedule.to_dict(),
                "warmup_steps": self.warmup_steps, "start_lr": self.start_lr}


class CosineDecay(LRSchedule):
    def __init__(self, lr, decay_steps, min_lr=0.0):
        self.lr = _positive("CosineDecay lr", lr)
        self.decay_steps = _steps("CosineDecay decay_steps", decay_steps)
        self.min_lr = _positive("CosineDecay min_lr", min_lr, allow_zero=True)

    def __call__(self, step):
        if step >= self.decay_steps:
            return self.min_lr
        cos = 0.5 * (1.0 + math.cos(math.pi * step / self.decay_steps))
        return self.min_lr + (self.lr - self.min_lr) * cos

    def to_dict(self):
        return {"type": "CosineDecay", "lr": self.lr, "decay_steps": self.decay_steps,
                "min_lr": self.min_lr}


class StepDecay(LRSchedule):
    def __init__(self, lr, step_size, gamma=0.1):
        self.lr = _positive("StepDecay lr", lr)
        self.step_size = _steps("StepDecay step_size", step_size)
        self.gamma = _positive("StepDecay gamma", gamma)

    def __call__(self, step):
        return self.lr * self.gamma ** (step // self.step_size)

    def to_dict(self):
        return {"type": "StepDecay", "lr": self.lr, "step_size": self.step_size,
                "gamma": self.gamma}


class Sequential(LRSchedule):
    def __init__(self, schedules, milestones):
        self.schedules = [as_schedule(s) for s in schedules]
        self.milestones = [_steps("Sequential milestone", m) for m in milestones]
        if len(self.milestones) != len(self.schedules) - 1:
            raise DistGraphError(f"Sequential needs one milestone fewer than schedules: "
                                 f"{len(self.schedules)} schedules, {len(self.milestones)} "
                                 f"milestones")
        if self.milestones != sorted(set(self.milestones)):
            raise DistGraphError(f"Sequential milestones must increase, got {self.milestones}")

    def __call__(self, step):
        start = 0
        for schedule, milestone in zip(self.schedules, self.milestones):
            if step < milestone:
                return schedule(step - start)
            start = milestone
        return self.schedules[-1](step - start)

    def to_dict(self):
        return {"type": "Sequential", "schedules": [s.to_dict() for s in self.schedules],
                "milestones": list(self.milestones)}


_TYPES = {cls.__name__: cls for cls in (Constant, LinearWarmup, CosineDecay, StepDecay,
                                        Sequential)}


def from_dict(d: dict) -> LRSchedule:
    """Rebuild a schedule from :meth:`LRSchedule.to_dict`."""
    d = dict(d)
    kind = d.pop("type", None)
    if kind not in _TYPES:
        raise DistGraphError(f"unknown learning-rate schedule {kind!r}; known: "
                             f"{', '.join(_TYPES)}")
    if "schedule" in d:
        d["schedule"] = from_dict(d["schedule"])
    if "schedules" in d:
        d["schedules"] = [from_dict(s) for s in d["schedules"]]
    return _TYPES[kind](**d)
