"""The error hierarchy: every error distgraph raises on purpose is a DistGraphError."""


class DistGraphError(Exception):
    """Base of all distgraph errors."""


class ShardingError(DistGraphError):
    """An invalid mesh, shard spec or annotation (names tensor, shape, spec and mesh)."""


class ResourceFileError(DistGraphError):
    """A resource file that cannot be read or does not follow the schema."""


class PlanError(DistGraphError):
    """A program that cannot be planned, partitioned or launched as asked."""


class BatchSplitError(ShardingError, PlanError):
    """A batch of ``rows`` samples that its split does not divide: ``parts`` parts, made
    as ``split`` says (data-parallel mesh dims, or micro-batches). Both a ShardingError and
    a PlanError, as each of the checks that raise it raised before; the Engine reads
    ``rows`` and ``parts`` to say which dataset lengths a short last batch needs."""

    def __init__(self, message: str, rows: int, parts: int, split: str):
        super().__init__(message)
        self.rows, self.parts, self.split = rows, parts, split


class TooFewDevicesError(PlanError):
    """A plan whose processes (``process_ids``) a cluster of ``devices`` devices cannot
    hold; ``distgraph plan -n N`` reads the ids to say which ``-n`` the plan needs."""

    def __init__(self, process_ids, devices: int):
        self.process_ids, self.devices = list(process_ids), devices
        super().__init__(f"this plan has {len(self.process_ids)} processes but the cluster "
                         f"has only {devices} devices")


class DoesNotFit(PlanError):
    """No plan found fits the devices' memory. ``peak``: the smallest per-device peak
    (bytes) of the plans tried, ``where`` says on which process, stage and device, and
    ``limit`` what that device may hold (bytes); None where no plan got that far."""

    def __init__(self, message: str, peak: float | None = None, where: str = "",
                 limit: float | None = None):
        super().__init__(message)
        self.peak, self.where, self.limit = peak, where, limit


class RuntimeFault(DistGraphError):
    """A failure while running: a rank raised, died, or a message never arrived.
    ``timed_out``: raised because a wait ran past the ranks' timeout, so every peer
    has had that long to fail on its own (a rank aborting the job for it does not wait
    for them to say so)."""

    def __init__(self, message: str = "", timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


class PlanFileError(PlanError):
    """A plan file (``plan.save``, ``Engine(plan=PATH)``, ``distgraph run --plan``) that
    cannot be used: cut short or edited into nonsense, from a newer format version, or
    made for another program, cluster or world size. ``path``: the file. Raised before
    any rank runs the plan and before any search, naming the first difference."""

    def __init__(self, message: str, path: str | None = None):
        super().__init__(message)
        self.path = path


class CheckpointError(DistGraphError):
    """A checkpoint that cannot be written (an unwritable directory, one another job
    holds), read (damaged: a file cut short, a flipped bit) or does not fit the model."""
