"""What the plan contract reads of the values that the layers above it make.

A :class:`~distgraph.plan.plan.Plan` carries values whose classes live above the
contract: the cluster (``distgraph.resources``), the estimate, the search's report, the
checkpoint interval and the balanced batch split (``distgraph.passes``). The contract
may not import them (tests/test_layering.py), so each such field is typed with a
Protocol here that lists exactly what is read of it: by the plan's printing
(:mod:`.explain`, :mod:`.listing`, :meth:`Plan.to_dict`), by the runtime and by the
application (``distgraph.app``, ``distgraph.callbacks``). Every value is printed with
``str`` too, which every object has. The real classes satisfy them
(tests/test_plan_protocols.py checks a planned plan's values with ``isinstance``).

Example::

    plan = dg.passes.plan(built, dg.Strategy(), cluster)
    isinstance(plan.estimate, EstimateLike)       # passes.cost.estimate.Estimate: True
    isinstance(plan.cluster, ClusterLike)         # resources.cluster.Cluster: True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class DeviceLike(Protocol):
    """A compute device of a cluster (``distgraph.resources.elements.Device``):
    ``memory`` in GB, ``flops(dtype)`` its peak FLOP/s (0.0: not given)."""

    @property
    def global_id(self) -> int: ...

    @property
    def type(self) -> str: ...

    @property
    def model(self) -> str: ...

    @property
    def memory(self) -> float: ...

    def flops(self, dtype: str = "float32") -> float: ...


@runtime_checkable
class ClusterLike(Protocol):
    """The cluster a plan was made for (``distgraph.resources.cluster.Cluster``): rank r
    runs on ``devices[r]``."""

    @property
    def devices(self) -> Sequence[DeviceLike]: ...


@runtime_checkable
class ProcessEstimateLike(Protocol):
    """One process's figures in an estimate (``distgraph.passes.cost.estimate.
    ProcessEstimate``): seconds per step, bytes at its memory peak."""

    @property
    def process(self) -> int: ...

    @property
    def compute(self) -> float: ...

    @property
    def communication(self) -> float: ...

    @property
    def peak_memory(self) -> int: ...


@runtime_checkable
class EstimateLike(Protocol):
    """A plan's predicted step (``distgraph.passes.cost.estimate.Estimate``): seconds of
    the bottleneck process, every process's figures, a line per process."""

    @property
    def step_time(self) -> float: ...

    @property
    def compute(self) -> float: ...

    @property
    def communication(self) -> float: ...

    @property
    def bubble(self) -> float: ...

    @property
    def processes(self) -> Sequence[ProcessEstimateLike]: ...

    def per_process(self) -> str: ...

    def to_dict(self) -> dict: ...


@runtime_checkable
class CheckpointIntervalLike(Protocol):
    """The proposed checkpoint interval (``distgraph.passes.cost.checkpoint.
    CheckpointInterval``), printed with ``str``."""

    def to_dict(self) -> dict: ...


@runtime_checkable
class SearchReportLike(Protocol):
    """What the automatic search did (``distgraph.passes.search.layouts.intra_op.
    SearchReport``, or the stage search's ``PipelineReport``): the solver's status and
    gap, the chosen layouts (every rank checks that all chose the same), a summary of a
    few lines; ``str`` lists it all."""

    @property
    def status(self) -> str: ...

    @property
    def gap(self) -> float: ...

    @property
    def layouts(self) -> tuple: ...

    def summary(self) -> str: ...

    def to_dict(self) -> dict: ...


@runtime_checkable
class BatchSplitLike(Protocol):
    """The balanced split of a batch over the data-parallel groups
    (``distgraph.passes.balance.batch_split.BatchSplit``): a summary of a few lines;
    ``str`` lists every group. The rows each process reads are compiled into its
    program (``ProcessProgram.feeds``), so the runtime reads nothing else of it."""

    def summary(self) -> str: ...

    def to_dict(self) -> dict: ...
