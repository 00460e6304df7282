"""Strategy: how the Engine parallelises and plans, as one frozen record."""

from __future__ import annotations

from dataclasses import dataclass

from distgraph.errors import DistGraphError


@dataclass(frozen=True)
class Strategy:
    """``auto_mode``: "semi" completes from annotations; "full" searches (later).
    ``micro_batches`` > 1 enables gradient accumulation / pipelining; ``sharding`` splits
    optimizer states and updates over ``sharding_mesh_dim`` (ZeRO-style);
    ``check_finite`` stops training with a RuntimeFault at a NaN or infinite loss
    (False: train on); ``seed`` seeds shuffling."""

    auto_mode: str = "semi"
    pipeline: bool = False
    schedule: str = "1F1B"
    micro_batches: int = 1
    recompute: bool = False
    sharding: bool = False
    sharding_mesh_dim: str = "dp"
    solver_time_limit: float = 60.0
    memory_budget_gb: float | None = None
    check_finite: bool = True
    seed: int = 0

    def __post_init__(self):
        if self.auto_mode not in ("semi", "full"):
            raise DistGraphError(f"Strategy.auto_mode must be 'semi' or 'full', got {self.auto_mode!r}")
        if self.micro_batches < 1:
            raise DistGraphError(f"Strategy.micro_batches must be >= 1, got {self.micro_batches}")
        if self.schedule != "1F1B":
            raise DistGraphError(f"Strategy.schedule: only '1F1B' is supported, got {self.schedule!r}")
