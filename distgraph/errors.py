"""The error hierarchy: every error distgraph raises on purpose is a DistGraphError."""


class DistGraphError(Exception):
    """Base of all distgraph errors."""


class ShardingError(DistGraphError):
    """An invalid mesh, shard spec or annotation (names tensor, shape, spec and mesh)."""


class ResourceFileError(DistGraphError):
    """A resource file that cannot be read or does not follow the schema."""


class PlanError(DistGraphError):
    """A program that cannot be planned, partitioned or launched as asked."""


class RuntimeFault(DistGraphError):
    """A failure while running: a rank raised, died, or a message never arrived."""
