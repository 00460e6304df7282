"""Which dim of each Value carries the batch's samples.

Pure. :func:`sample_axes` completes a copy of a program, without its annotations, on a
one-process mesh whose dim ``samples`` splits dim 0 of every feed: the sharding rules
that plan data parallelism then say, for every Value, which dim holds one entry per
sample (or per sample and position, after a reshape) -- the dims whose local size an
uneven data-parallel split changes. A Value absent from the result does not carry the
samples (parameters, their gradients, a mean loss).

Example::

    axes = sample_axes(plan.program, plan.built.feed_names)
    axes["x"], axes.get("fc1.weight")          # 0, None
"""

from __future__ import annotations

from distgraph.errors import PlanError, ShardingError
from distgraph.mesh import ProcessMesh
from distgraph.passes.completion.complete import complete
from distgraph.placement import DistAttr, ShardSpec

SAMPLES_DIM = "samples"


def sample_axes(program, feed_names) -> dict:
    """{Value name: the dim that carries the samples} for ``program`` whose feeds
    ``feed_names`` hold the samples along dim 0."""
    mesh = ProcessMesh([0], dim_names=[SAMPLES_DIM])   # one process: every batch divides
    copy = program.clone()
    for v in copy.values.values():
        v.annotation = None
    for op in copy.ops:
        op.annotation = None
    for name in feed_names:
        v = copy.values[name]
        if v.shape:
            v.annotation = DistAttr(mesh, ShardSpec([SAMPLES_DIM] + [None] * (len(v.shape) - 1)))
    try:
        complete(copy, default_mesh=mesh)
    except ShardingError as e:
        raise PlanError(f"cannot tell which dims carry the batch's samples: {e}") from None
    axes = {}
    for v in copy.values.values():
        spec = v.dist_attr.spec
        for i in range(spec.ndim):
            if SAMPLES_DIM in spec.entry(i):
                axes[v.name] = i
    return axes


def axes_of(plan) -> dict:
    """The sample dims of ``plan``'s program: the plan's own (``Plan.sample_axes``, found
    once where its batch split needed them), else found now."""
    if plan.sample_axes is not None:
        return plan.sample_axes
    return sample_axes(plan.program, plan.built.feed_names)
