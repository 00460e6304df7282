"""What the plan contract reads of the values that the layers above it make.

A :class:`~distgraph.plan.plan.Plan` carries values whose classes live above the
contract: the cluster (``distgraph.resources``), the estimate, the search's report, the
checkpoint interval and the balanced batch split (``distgraph.passes``), and a run's
timeline (``distgraph.runtime``) that a plan's report shows. The contract may not import
them (tests/test_layering.py), so each such field is typed with a Protocol here that
lists exactly what is read of it: by the plan's printing (:mod:`.explain`,
:mod:`.listing`, :mod:`.report`, :meth:`Plan.to_dict`), by the runtime and by the
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
    ``memory`` in GB, ``reserve`` the GB of it its process cannot fill,
    ``usable_memory(budget_gb)`` the GB a plan may fill (memory less the reserve, at
    most the budget), ``flops(dtype)`` its peak FLOP/s (0.0: not given)."""

    @property
    def global_id(self) -> int: ...

    @property
    def type(self) -> str: ...

    @property
    def model(self) -> str: ...

    @property
    def memory(self) -> float: ...

    @property
    def reserve(self) -> float: ...

    def usable_memory(self, budget_gb: float | None = None) -> float: ...

    def flops(self, dtype: str = "float32") -> float: ...


@runtime_checkable
class LinkLike(Protocol):
    """A link of the resource graph (``distgraph.resources.elements.Link``): its two
    endpoints' global ids, GB/s, µs and a label such as ``NVL``."""

    @property
    def source(self) -> int: ...

    @property
    def target(self) -> int: ...

    @property
    def bandwidth(self) -> float: ...

    @property
    def latency(self) -> float: ...

    @property
    def type(self) -> str: ...


@runtime_checkable
class MachineLike(Protocol):
    """A machine of a cluster (``distgraph.resources.elements.Machine``): its compute
    devices, network interfaces and the links inside it."""

    @property
    def id(self) -> int: ...

    @property
    def hostname(self) -> str: ...

    @property
    def devices(self) -> Sequence[DeviceLike]: ...

    @property
    def nics(self) -> Sequence[DeviceLike]: ...

    @property
    def links(self) -> Sequence[LinkLike]: ...


@runtime_checkable
class ClusterLike(Protocol):
    """The cluster a plan was made for (``distgraph.resources.cluster.Cluster``): rank r
    runs on ``devices[r]``; the report draws its machines, the links inside and between
    them and its switches (each with a ``global_id``), and prints ``describe()``."""

    @property
    def name(self) -> str: ...

    @property
    def devices(self) -> Sequence[DeviceLike]: ...

    @property
    def machines(self) -> Sequence[MachineLike]: ...

    @property
    def links(self) -> Sequence[LinkLike]: ...

    @property
    def switches(self) -> Sequence: ...

    def describe(self) -> str: ...


@runtime_checkable
class TaskSecondsLike(Protocol):
    """Seconds a step spends in one task of a process (``distgraph.passes.cost.by_task.
    TaskSeconds``): its chunk (None: the update, the prologue) and kind (a
    :class:`~distgraph.plan.kinds.TaskKind` value)."""

    @property
    def chunk(self) -> int | None: ...

    @property
    def kind(self) -> str: ...

    @property
    def compute(self) -> float: ...

    @property
    def communication(self) -> float: ...


@runtime_checkable
class ProcessEstimateLike(Protocol):
    """One process's figures in an estimate (``distgraph.passes.cost.estimate.
    ProcessEstimate``): seconds per step (and by task), its stage, bytes at its memory
    peak and what they hold."""

    @property
    def process(self) -> int: ...

    @property
    def stage(self) -> int: ...

    @property
    def compute(self) -> float: ...

    @property
    def communication(self) -> float: ...

    @property
    def parameters(self) -> int: ...

    @property
    def states(self) -> int: ...

    @property
    def gradients(self) -> int: ...

    @property
    def activations(self) -> int: ...

    @property
    def peak_memory(self) -> int: ...

    @property
    def tasks(self) -> Sequence[TaskSecondsLike]: ...


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


@runtime_checkable
class TimelineLike(Protocol):
    """What a plan's report (:mod:`.report_lanes`) reads of a run's timeline
    (``distgraph.runtime.execution.timeline.Timeline``): its events, each with ``rank``,
    ``stage`` (the chunk), ``kind``, ``micro_batch``, ``step``, ``start`` and ``end``."""

    @property
    def events(self) -> Sequence: ...
