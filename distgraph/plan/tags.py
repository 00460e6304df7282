"""The tag scheme: which message tag every point-to-point message of a step carries.

Tags are ``[0, MAX_TAG)`` (the communicators' contract; MPI's tags above it are theirs).
Reshard point ``seq`` of micro-batch ``m`` has ``tag(seq, m)``; fetched value ``i``
``gather_tag(i)``; a point without transfers tags nothing (0). A tag only has to tell
apart the messages one sender sends one receiver, so points that no sender-receiver pair
shares share a *channel*, and tags grow with the points a pair exchanges, not with all.

Example::

    >>> tags = TagScheme(4, MappingProxyType({3: 0, 7: 1}))
    >>> tags.tag(7, 2), tags.gather_tag(0)
    (6, 8)
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from distgraph.errors import PlanError

MAX_TAG = 1 << 14
# The top tags belong to kernels that message inside one op (ring attention's k, v
# blocks and their gradients: distgraph.ops.ring_attention.TAGS); the plan's points
# never use them.
KERNEL_TAGS = 8


@dataclass(frozen=True)
class TagScheme:
    """``channels[seq]``: the channel of point ``seq`` (points with transfers only);
    ``micro_batches``: how many micro-batches a step has (tags per channel)."""

    micro_batches: int
    channels: MappingProxyType

    def tag(self, seq: int, micro_batch: int) -> int:
        channel = self.channels.get(seq)
        return 0 if channel is None else channel * self.micro_batches + micro_batch

    @property
    def channel_count(self) -> int:
        """How many channels the points use (tags below ``channel_count * M`` are theirs)."""
        return max(self.channels.values(), default=-1) + 1

    def gather_tag(self, index: int) -> int:
        return self.channel_count * self.micro_batches + index

    def check(self, fetched: int) -> None:
        """A PlanError when the points and ``fetched`` gathers need more than MAX_TAG."""
        needed = self.gather_tag(fetched)
        if needed > MAX_TAG - KERNEL_TAGS:
            raise PlanError(f"the task graph needs {needed} message tags "
                            f"({self.channel_count} point-to-point reshards between one pair "
                            f"of processes x {self.micro_batches} micro-batches), more than "
                            f"the {MAX_TAG - KERNEL_TAGS} available; use fewer micro-batches")
