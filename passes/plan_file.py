"""Plans from files: the planner's record of its decisions, and the plan made from a file.

The planner keeps the decisions of every plan it makes (``Plan.decisions``,
:class:`~distgraph.plan.file.Decisions`: the layouts completion starts from, on the
program they annotate); ``plan.save(path)`` writes them (:mod:`distgraph.plan.file`,
whose docstring holds the design and the format).

:func:`load` makes the plan of a file (:func:`~distgraph.plan.file.read`) for a built
program without any search:

1. the prints first: the program (``built``, before planning), the cluster, the world
   size; the first difference is a :class:`~distgraph.errors.PlanFileError` before
   anything is planned;
2. the program the plan runs, made as the planner makes it (a searched plan's: split
   into the file's micro-batch count and rewritten for its recomputation,
   :func:`~distgraph.passes.prepare.prepared`; a plan made without search: the model's
   own), its annotations replaced by the file's (an op number or a value name the
   program lacks is a PlanFileError);
3. the planner's path for a choice made elsewhere (``dg.passes.plan(..., choice=)``):
   completion, which must keep every layout of the file (one the op rules refuse is a
   PlanFileError naming the op), ZeRO over the file's mesh dims, the file's stage chunks
   and rank mapping, partition, schedule, estimate; or, for a plan made without search,
   the planner as for the annotated model;
4. the result checked against the file's: the same stages and micro-batch count, and
   (a file this version wrote) the same estimated step time and peak memory: an edit of
   those figures, or of a strategy field that changes the plan (``sharding``), is said.

Nothing here imports the search (:mod:`distgraph.passes.search`): loading never runs it.

Example::

    saved = read("gpt.plan.json")
    plan = load(saved, built, cluster, world_size=4)     # no search
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

from distgraph.errors import DoesNotFit, PlanError, PlanFileError, ShardingError
from distgraph.passes.choice import Choice
from distgraph.passes.planner import cyclic_collector_paused, plan
from distgraph.passes.prepare import prepare
from distgraph.plan.file import PlanFile
from distgraph.version import __version__


def _check(saved: PlanFile, program) -> None:
    """Raise PlanFileError unless completion gave ``program`` every layout the file
    holds (a layout the op rules refuse is changed by completion)."""
    d, values = saved.decisions, program.values
    for name, attr in d.values:
        got = values[name].dist_attr
        if got != attr:
            raise saved.fault(
                f"value {name!r} is laid out as {attr.spec} on {attr.mesh} in the file, "
                f"but completion under the op rules makes it {got.spec} on {got.mesh}",
                "the file was edited into a layout the rules refuse: save the plan again")
    for index, ann in d.ops:
        op = program.ops[index]
        da = op.dist_attr
        specs = {v.name: s for v, s in zip(op.inputs, da.input_specs)}
        for key, spec in ann.in_specs:
            if spec is not None and specs.get(key) != spec:
                raise saved.fault(
                    f"op #{index} {op.type} ({op.layer or 'top level'}) consumes "
                    f"{key!r} as {spec} in the file, but its rules make it "
                    f"{specs.get(key)}", "the file was edited into a layout the rules "
                    "refuse: save the plan again")


def load(saved: PlanFile, built, cluster, ranks=None, world_size: int | None = None):
    """The plan of ``saved`` for ``built`` (a BuiltProgram of the user's model) on
    ``cluster`` (module docstring); ``ranks``: the ranks whose programs to compile (as
    :func:`~distgraph.passes.planner.plan`); ``world_size``: the job's, checked where
    given."""
    saved.check_program(built)
    saved.check_cluster(cluster)
    if world_size is not None:
        saved.check_world(world_size)
    strategy, d = saved.strategy, saved.decisions
    # as the planner plans: the split and the plan make millions of short-lived objects
    with _refused(saved), cyclic_collector_paused():
        if d.on == "built":
            annotated = dataclasses.replace(built, program=built.program.clone())
            _annotate(annotated.program, saved)
            planned = plan(annotated, strategy, cluster, rank_mapping=saved.rank_mapping,
                           ranks=ranks)
        else:
            prepared, accumulation = prepare(built, strategy, strategy.micro_batches)
            _annotate(prepared.program, saved)
            planned = plan(built, cluster=cluster, ranks=ranks, choice=Choice(
                prepared, strategy, accumulation, saved.rank_mapping, d.chunks, d.zero_dim,
                None, functools.partial(_check, saved),
                zero_params=None if d.zero_params is None else frozenset(d.zero_params)))
    _check_result(planned, saved)
    return planned


@contextlib.contextmanager
def _refused(saved: PlanFile):
    """A planning error of the file's decisions as one PlanFileError naming the file."""
    try:
        yield
    except PlanFileError:
        raise
    except DoesNotFit as e:
        raise saved.fault(f"its plan does not fit the devices: {e}") from None
    except (ShardingError, PlanError) as e:
        raise saved.fault(f"its decisions cannot be planned on this program: {e}",
                          "the file was edited into layouts the rules refuse, or made by "
                          "another distgraph: save the plan again") from None


def _annotate(program, saved: PlanFile) -> None:
    """Replace ``program``'s annotations by the file's, each checked to name a value or
    an op (and its operands) the program has."""
    d, values, ops = saved.decisions, program.values, program.ops
    for k, (name, _) in enumerate(d.values):
        if name not in values:
            raise saved.fault(f"decisions.values[{k}]: the program has no value {name!r}")
    for k, (index, ann) in enumerate(d.ops):
        if index >= len(ops):
            raise saved.fault(f"decisions.ops[{k}]: op #{index} is out of range: the "
                              f"program has {len(ops)} ops")
        names = {v.name for v in ops[index].inputs}
        for key, _ in ann.in_specs:
            if key not in names:
                raise saved.fault(f"decisions.ops[{k}]: op #{index} {ops[index].type} has "
                                  f"no operand {key!r} (its operands: {sorted(names)})")
    for v in values.values():
        v.annotation = None
    for op in ops:
        op.annotation = None
    for name, attr in d.values:
        values[name].annotation = attr
    for index, ann in d.ops:
        ops[index].annotation = ann


def _check_result(planned, saved: PlanFile) -> None:
    """The plan made must be the one saved: its stages and micro-batch count, and, when
    this distgraph wrote the file (another version may price the same decisions
    otherwise), its estimate's step time and peak memory."""
    result = saved.result
    if tuple(planned.stages) != result["stages"]:
        raise saved.fault(f"its decisions make stages {[str(m) for m in planned.stages]}, "
                          f"the saved plan had {[str(m) for m in result['stages']]}",
                          "save the plan again with this distgraph")
    if planned.micro_batches != result["micro_batches"]:
        raise saved.fault(f"its decisions make {planned.micro_batches} micro-batches, the "
                          f"saved plan had {result['micro_batches']}")
    if planned.world_size != saved.world_size:
        raise saved.fault(f"its decisions make a plan of {planned.world_size} processes, "
                          f"the file says {saved.world_size}")
    est = planned.estimate
    if est is None or saved.written_by != __version__:
        return
    for key, got in (("step_time", est.step_time),
                     ("peak_memory", max(p.peak_memory for p in est.processes))):
        said = result.get(key)
        if said is not None and not math.isclose(said, got, rel_tol=1e-9):
            raise saved.fault(f"result.{key} is {said}, but its decisions make a plan of "
                              f"{key} {got}: the file was edited (its strategy, decisions or "
                              f"result)", "save the plan again")
