"""Which dim of each Value carries the batch's samples: the one analysis.

Pure. :func:`complete_on_samples` completes a copy of a program, without its
annotations, on a mesh whose one dim splits dim 0 of every feed: the sharding rules that
plan data parallelism then lay out every Value by how it depends on the samples -- its
sample dim split over that dim (one entry per sample, or per sample and position after a
reshape), Partial over it where it sums over the samples (gradients, a loss averaged over
the batch), replicated where it does not depend on them (parameters). :func:`axes_over`
reads the sample dims off that copy.

It is asked twice: :func:`sample_axes`, on a one-process mesh (every batch divides),
by the balanced split (:mod:`distgraph.passes.balance`) and by what prices it (the
estimate, the search); and gradient accumulation, on a mesh of M micro-batches whose
copy it then partitions
(:func:`distgraph.passes.pipeline.accumulate.split_micro_batches`, which derives
``Accumulation.split_axis`` from it).

Example::

    axes = sample_axes(plan.program, plan.built.feed_names)
    axes["x"], axes.get("fc1.weight")          # 0, None
"""

from __future__ import annotations

from distgraph.errors import PlanError, ShardingError
from distgraph.mesh import ProcessMesh
from distgraph.passes.completion.alike import complete_alike
from distgraph.passes.completion.complete import complete_run
from distgraph.passes.session import Table
from distgraph.placement import DistAttr, ShardSpec

SAMPLES_DIM = "samples"


class SampleAnalyses:
    """The analyses of one planning, shared across mesh sizes where provably exact: a
    :func:`complete_on_samples` of a program on ``processes`` processes replays the
    completion of the same (program, feeds, dim) on another count where every rule
    answers its queries alike on both meshes
    (:func:`~distgraph.passes.completion.alike.complete_alike`), else completes afresh.
    ``runs``: the table that keeps the first completion of each (program, feeds, dim)
    (the planning's session's "sample analyses"; a fresh one by default; the program
    keyed by identity: a planner does not modify the program it plans). ``replayed``
    counts the analyses replayed."""

    def __init__(self, runs: Table | None = None):
        self._runs = Table("sample analyses") if runs is None else runs
        self.replayed = 0

    def complete(self, program, copy, feed_names, dim: str, mesh):
        """Complete ``copy`` (of ``program``, annotated on ``mesh``) in place."""
        key = (program, tuple(feed_names), dim)
        known = self._runs.find(key)
        if known is None:
            self._runs[key] = complete_run(copy, default_mesh=mesh)
        elif complete_alike(known, copy, mesh):
            self.replayed += 1
        else:
            complete_run(copy, default_mesh=mesh)


def complete_on_samples(program, feed_names, processes: int = 1, dim: str = SAMPLES_DIM,
                        refusal: str = "cannot tell which dims carry the batch's samples",
                        analyses: SampleAnalyses | None = None):
    """A copy of ``program``, without annotations, completed on a mesh of ``processes``
    processes along ``dim`` with dim 0 of every feed of ``feed_names`` (that has one)
    split over it (see the module docstring). Where completion refuses, a PlanError
    ``"{refusal}: {why}"``. ``analyses``: where the analyses of other counts are shared
    (:class:`SampleAnalyses`; the copy is the same)."""
    mesh = ProcessMesh(list(range(processes)), dim_names=[dim])
    copy = program.clone()
    for v in copy.values.values():
        v.annotation = None
    for op in copy.ops:
        op.annotation = None
    for name in feed_names:
        v = copy.values[name]
        if v.shape:
            v.annotation = DistAttr(mesh, ShardSpec([dim] + [None] * (len(v.shape) - 1)))
    try:
        if analyses is None:
            complete_run(copy, default_mesh=mesh)
        else:
            analyses.complete(program, copy, feed_names, dim, mesh)
    except ShardingError as e:
        raise PlanError(f"{refusal}: {e}") from None
    return copy


def axes_over(completed, dim: str = SAMPLES_DIM) -> dict:
    """{Value name: the dim split over ``dim``} of a :func:`complete_on_samples` copy: the
    dims that carry the samples. A Value absent from it carries none."""
    axes = {}
    for v in completed.values.values():
        spec = v.dist_attr.spec
        for i in range(spec.ndim):
            if dim in spec.entry(i):
                axes[v.name] = i
    return axes


def sample_axes(program, feed_names) -> dict:
    """{Value name: the dim that carries the samples} for ``program`` whose feeds
    ``feed_names`` hold the samples along dim 0."""
    return axes_over(complete_on_samples(program, feed_names))


def axes_of(plan) -> dict:
    """The sample dims of ``plan``'s program: its accumulation's (``split_axis``, found
    when the batch was split into micro-batches), else the plan's own
    (``Plan.sample_axes``, found once where its batch split needed them), else found
    now."""
    if plan.accumulation is not None:
        return plan.accumulation.split_axis
    if plan.sample_axes is not None:
        return plan.sample_axes
    return sample_axes(plan.program, plan.built.feed_names)
