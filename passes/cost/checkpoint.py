"""How often to checkpoint: Young's first-order optimum, from the step time, the time one
save takes and the job's mean time between failures.

A job that saves every tau seconds loses, per unit of time, the saves (``save / tau``) and,
at a failure, on average half an interval of work (``tau / 2 / mtbf``). Their sum is
least at ``tau = sqrt(2 x save x mtbf)`` (Young 1974; Daly 2006 adds higher-order terms,
negligible while ``save << mtbf``), the interval rounded to whole steps. The save time
is the busiest process's checkpoint bytes (its parameters and optimizer states) over the
write bandwidth; the step time is the plan's estimate, which the calibrated cost model
prices from measured figures, or a step time measured while training.

Example::

    >>> c = young_daly(step_s=0.5, save_s=2.0, mtbf_s=24 * 3600)
    >>> c.steps, round(c.seconds)
    (1176, 588)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from distgraph.errors import PlanError


@dataclass(frozen=True)
class CheckpointInterval:
    """Save every ``steps`` steps (``seconds`` of training): the Young/Daly interval for
    a step of ``step_s``, a save of ``save_s`` and a mean time between failures of
    ``mtbf_s``; ``overhead`` is the expected share of time lost to saves and re-runs."""

    steps: int
    seconds: float
    step_s: float
    save_s: float
    mtbf_s: float

    @property
    def overhead(self) -> float:
        tau = self.steps * self.step_s
        return self.save_s / tau + tau / (2 * self.mtbf_s)

    def to_dict(self) -> dict:
        return {**asdict(self), "overhead": self.overhead}

    def __str__(self) -> str:
        return (f"checkpoint every {self.steps} steps ({self.seconds:.3g} s; Young/Daly "
                f"sqrt(2 x save {self.save_s:.3g} s x MTBF {self.mtbf_s / 3600:.3g} h), step "
                f"{self.step_s * 1e3:.3g} ms; expected {self.overhead:.2%} of the time lost "
                f"to saves and re-runs)")


def young_daly(step_s: float, save_s: float, mtbf_s: float) -> CheckpointInterval:
    """The interval (module docstring); PlanError for a figure that is not positive."""
    for name, value in (("step time", step_s), ("save time", save_s), ("MTBF", mtbf_s)):
        if not value > 0:
            raise PlanError(f"the checkpoint interval needs a positive {name}, got {value!r}")
    seconds = math.sqrt(2 * save_s * mtbf_s)
    return CheckpointInterval(max(1, round(seconds / step_s)), seconds, step_s, save_s, mtbf_s)


def save_seconds(estimate, write_gbps: float) -> float:
    """Seconds the busiest process of ``estimate`` takes to write its checkpoint blocks
    (parameters and optimizer states) at ``write_gbps`` GB/s."""
    busiest = max(p.parameters + p.states for p in estimate.processes)
    return busiest / (write_gbps * 1e9)


def propose(estimate, mtbf_hours: float, write_gbps: float) -> CheckpointInterval:
    """The interval for a plan's ``estimate`` on a cluster of ``mtbf_hours`` MTBF."""
    return young_daly(estimate.step_time, save_seconds(estimate, write_gbps),
                      mtbf_hours * 3600.0)
