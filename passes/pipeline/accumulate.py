"""Gradient accumulation as program structure: one step's batch in M micro-batches.

:func:`split_micro_batches` is pure. It finds how every Value depends on the batch with
the sample-axis analysis (:func:`distgraph.passes.samples.complete_on_samples`) on a
virtual mesh of M "processes" along a dim ``mb``, every feed split along its dim 0
(micro-batch m is rows [m B/M, (m+1) B/M) of the batch): the same sharding rules that
plan data parallelism say which dim of each Value carries the samples (split over
``mb``: ``Accumulation.split_axis``), which Values sum over them (Partial over ``mb``:
gradients, and a loss that averages over the batch, whose ``1/B`` scale is the full
batch's, so that each micro-batch contributes its share), and which do not depend on
them (replicated). That copy's layouts on micro-batch 0 give the *micro-batch
program*: the same ops and names on micro-batch shapes, shape attributes made local (as
a partition of the copy for micro-batch 0 makes them, without its reshard points).

The step then runs as Alpa's compute-grad / accumulate-grad / apply-grad split:

- forward and backward ops run once per micro-batch (on the micro-batch program, which
  the planner completes and partitions like any program);
- every Value that crosses from them into the update (the *boundary*: gradients, and
  the fetched loss) is accumulated over the micro-batches: summed where it is Partial
  over ``mb``, kept once where it does not depend on the batch;
- the update ops run once, on the accumulated values.

A sum over the samples that only the feeds make, and that an op needs whole (the count
of labels that are not ``ignore_index``, which a mean cross-entropy divides by) is the
*prologue*: its ops run on every micro-batch before the step's first forward, their
results are summed, and the micro-batches read the whole batch's value, so that each
contributes its share of the full batch's mean. Any other program that needs samples
of other micro-batches before the update (an op that mixes rows of the batch, such as a
batch-wide normalisation) cannot be split: that is a PlanError naming the op. Random
ops (dropout) draw for the full batch's tensor and take their micro-batch's slice (the
runtime's ``micro_batch_context``), so their masks equal the full-batch step's.

Example::

    built_mb, acc = split_micro_batches(built, 4)
    print(acc.pretty())     # boundary values and how each is accumulated
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

from distgraph import dtypes
from distgraph.errors import BatchSplitError, PlanError
from distgraph.ir import Role
from distgraph.placement import DistAttr
from distgraph.registry import LocalSite, TensorType, get_op
from distgraph.passes.samples import axes_over, complete_on_samples
from distgraph.plan.accumulation import Accumulation

MB_DIM = "mb"


def split_micro_batches(built, micro_batches: int, analyses=None):
    """``(micro-batch BuiltProgram, Accumulation)`` for ``built`` split into
    ``micro_batches`` micro-batches (see the module docstring). Pure. ``analyses``: a
    :class:`~distgraph.passes.samples.SampleAnalyses` shared by the counts a planner
    tries (the same result, the sample analysis replayed where provably alike)."""
    m = int(micro_batches)
    program = built.program
    feeds = [program.values[n] for n in built.feed_names]
    if not feeds:
        raise PlanError("micro-batching splits the batch of the program's inputs, but this "
                        "program has none")
    batch = feeds[0].shape[0] if feeds[0].shape else None
    for v in feeds:
        if not v.shape or v.shape[0] != batch or batch % m:
            raise BatchSplitError(f"Strategy(micro_batches={m}) splits dim 0 of every input "
                                  f"into {m} micro-batches, but input {v.name} has shape "
                                  f"{list(v.shape)} (inputs: "
                                  f"{', '.join(f'{f.name}{list(f.shape)}' for f in feeds)}); "
                                  f"use a batch size divisible by {m}",
                                  v.shape[0] if v.shape else 0, m,
                                  f"Strategy(micro_batches={m})")
    _check_split_feeds(feeds, batch, m)
    analysed = complete_on_samples(program, built.feed_names, m, MB_DIM,
                                   f"cannot split the batch into {m} micro-batches",
                                   analyses)
    split_axis = axes_over(analysed, MB_DIM)
    partial, prologue = _sums_over_samples(analysed, split_axis, _feed_only(analysed))
    boundary = _boundary(analysed, built)
    for name in boundary:
        if name in split_axis and name not in built.output_names:
            raise PlanError(f"the update reads {name} {list(program.values[name].shape)}, "
                            f"which holds one row per sample (dim {split_axis[name]}); "
                            f"gradient accumulation can only carry sums over the batch "
                            f"into the update; use micro_batches=1")
    mb_program = _micro_batch_program(program, analysed)
    made, skipped = _prologue_ops(analysed, prologue, boundary)
    accumulation = Accumulation(m, batch, MappingProxyType(split_axis), frozenset(partial),
                                tuple(boundary), frozenset(prologue), made, skipped,
                                gathered_once=getattr(built, "sharding_level", 0) < 3)
    return dataclasses.replace(built, program=mb_program), accumulation


def _check_split_feeds(feeds, batch: int, m: int) -> None:
    """A feed split over mesh dims on its batch dim (data parallelism) must have
    micro-batches those dims divide: else a BatchSplitError naming the batch size that
    works, in the user's terms (not the reshard that would fail later)."""
    rows = batch // m
    for v in feeds:
        attr = v.annotation
        if attr is None or not attr.spec.dims:
            continue
        dims = [d for d in attr.spec.entry(0) if d in attr.mesh.dim_names]
        parts = 1
        for d in dims:
            parts *= attr.mesh.dim_size(d)
        if rows % parts:
            raise BatchSplitError(f"Strategy(micro_batches={m}) splits the batch of {batch} "
                                  f"into micro-batches of {rows} rows, and input {v.name} is "
                                  f"split over mesh dims {dims} into {parts} parts, which "
                                  f"{rows} rows do not divide; use a batch size divisible by "
                                  f"{m * parts}", batch, m * parts,
                                  f"Strategy(micro_batches={m}) with the split over mesh "
                                  f"dims {dims} into {parts} parts")


# Ops that are linear in their one tensor operand: applied to one micro-batch's share
# of a sum over the samples they give its share of the result (the mean's scale after
# the sum of a loss; slice_grad on the gradient of a sliced parameter). A widening cast
# is one too: under amp each micro-batch's 16-bit gradient is cast to float32 and the
# shares are summed in float32, as Megatron accumulates its main gradients.
LINEAR_UNARY = ("scale", "neg", "reshape", "transpose", "sum", "slice", "slice_grad",
                 "broadcast_to")


def linear_in_sums(op, sum_inputs, sample_free) -> bool:
    """Whether ``op`` maps shares of sums to shares of its results: linear in the
    operands at ``sum_inputs``, its other operands (``sample_free(name)``) the same for
    every share."""
    others = [v for i, v in enumerate(op.inputs) if i not in sum_inputs]
    if op.type in LINEAR_UNARY:
        return len(op.inputs) == 1 and not (op.type == "scale" and op.attrs.get("bias", 0.0))
    if op.type == "cast":     # a widening cast (a 16-bit gradient to its float32 master's)
        return dtypes.is_float(op.inputs[0].dtype) and dtypes.is_float(op.outputs[0].dtype) \
            and dtypes.itemsize(op.outputs[0].dtype) >= dtypes.itemsize(op.inputs[0].dtype)
    if op.type in ("add", "subtract"):
        return not others
    if op.type in ("multiply", "matmul") or (op.type == "divide" and sum_inputs == [0]):
        return len(sum_inputs) == 1 and all(sample_free(v.name) for v in others)
    return False


def _sums_over_samples(analysed, split_axis, feed_only) -> tuple[set, set]:
    """(sums, prologue). Sums over the samples: Values Partial over ``mb``, and the
    results of linear ops on them (completion reduces a Partial operand before any op
    consumes it; within one micro-batch that is impossible, and for a linear op
    needless). A sum that an op needs whole and that only the feeds make (in
    ``feed_only``) goes to the prologue. Any other op that consumes a Value in another
    layout over the micro-batches than it is made in would move samples between
    micro-batches: a PlanError naming it."""
    sums = {v.name for v in analysed.values.values() if MB_DIM in v.dist_attr.spec.partial}
    prologue: set = set()
    shared: set = set()        # sums a linear op passed on as shares

    def sample_free(name):
        return name not in sums and name not in split_axis

    for k, op in enumerate(analysed.ops):
        if op.role is Role.OPTIMIZE:
            continue
        summed = [i for i, v in enumerate(op.inputs) if v.name in sums]
        if summed and linear_in_sums(op, summed, sample_free):
            sums.update(o.name for o in op.outputs)
            shared.update(op.inputs[i].name for i in summed)
            continue
        whole = [i for i in summed if op.inputs[i].name in feed_only]
        for i in whole:
            name = op.inputs[i].name
            if name in shared:
                raise PlanError(f"op #{k} '{op.type}' ({op.layer or 'top level'}) needs the "
                                f"whole batch's {name}, which other ops take per "
                                f"micro-batch; the batch cannot be split into micro-batches; "
                                f"use micro_batches=1")
            sums.discard(name)
            prologue.add(name)
        for i, v in enumerate(op.inputs):
            if i in whole:
                continue
            want = op.dist_attr.input_specs[i]
            if i in summed or want != v.dist_attr.spec:
                made = "a sum over the samples" if i in summed else str(v.dist_attr.spec)
                raise PlanError(f"op #{k} '{op.type}' ({op.layer or 'top level'}) needs "
                                f"{v.name} {list(v.shape)} laid out as {want} over the "
                                f"micro-batches but it is made as {made}: the op mixes "
                                f"samples across the batch, so the batch cannot be split "
                                f"into micro-batches; use micro_batches=1")
    return sums, prologue


def _feed_only(analysed) -> set:
    """Values that only the feeds (and constants) make, by forward ops that draw no
    random numbers and whose distributed form does not communicate."""
    made = {v.name for v in analysed.inputs}
    for op in analysed.ops:
        opdef = get_op(op.type)
        if (op.role in (Role.FORWARD, Role.LOSS) and op.type != "dropout" and opdef.comm is None
                and all(v.name in made for v in op.inputs)):
            made.update(o.name for o in op.outputs)
    return made


def _prologue_ops(analysed, prologue, boundary) -> tuple[frozenset, frozenset]:
    """(Values the prologue's ops make, Values whose ops the micro-batches skip): the
    prologue runs every op the prologue's sums come from; the micro-batches skip the ops
    that make those sums, and ops whose results only skipped ops read."""
    if not prologue:
        return frozenset(), frozenset()
    producer = {o.name: op for op in analysed.ops for o in op.outputs}
    made: set = set()
    todo = list(prologue)
    while todo:
        op = producer.get(todo.pop())
        if op is None or op.outputs[0].name in made:
            continue
        made.update(o.name for o in op.outputs)
        todo.extend(v.name for v in op.inputs)
    consumers = analysed.consumers()
    skipped = set(prologue)
    for op in reversed(analysed.ops):
        outs = [o.name for o in op.outputs]
        if not outs or not set(outs) <= made or set(outs) & set(boundary):
            continue
        if all(c.outputs and {o.name for o in c.outputs} <= skipped
               for n in outs for c in consumers.get(n, ())):
            skipped.update(outs)
    return frozenset(made), frozenset(skipped)


def _boundary(analysed, built) -> list:
    """Values made before the update and read by it, then the fetched ones, in order."""
    made_by = {o.name: op.role for op in analysed.ops for o in op.outputs}
    names: list = []
    for op in analysed.ops:
        if op.role is not Role.OPTIMIZE:
            continue
        for v in op.inputs:
            if made_by.get(v.name, Role.OPTIMIZE) is not Role.OPTIMIZE and v.name not in names:
                names.append(v.name)
    for name in built.fetch_names:
        if name not in names:
            names.append(name)
    return names


def _micro_batch_program(program, analysed):
    """A copy of ``program`` (annotations kept) on micro-batch shapes, with the shape
    attributes its ops take on micro-batch 0 (the same for every micro-batch): each
    Value's shape its block's on process 0 of ``analysed``'s mesh, each op's attributes
    as its kernel localizes them there (:attr:`~distgraph.registry.OpDef.localize`, as a
    partition of ``analysed`` for process 0 makes them)."""
    out = program.clone()
    for v in out.values.values():
        v.shape = analysed.values[v.name].dist_attr.local_shape(v.shape)
    for k, (op, seen) in enumerate(zip(out.ops, analysed.ops)):
        localize = get_op(op.type).localize
        if localize is not None:
            da = seen.dist_attr
            site = LocalSite(0, tuple(v.shape for v in seen.inputs),
                             tuple(DistAttr(da.mesh, s) for s in da.input_specs),
                             tuple(o.shape for o in seen.outputs),
                             tuple(DistAttr(da.mesh, s) for s in da.output_specs),
                             tuple(v.dtype for v in seen.inputs),
                             tuple(sorted(seen.attrs.items())))
            op.attrs = dict(localize(dict(seen.attrs), site)[0])
        check_shapes(k, op, "run on a micro-batch", "use micro_batches=1")
    return out


def check_shapes(k, op, what: str, fix: str) -> None:
    """The op's own shape inference on its operands' shapes must give its results'
    shapes (an attribute that hard-codes the batch would not): else a PlanError saying
    the op cannot ``what`` and ``fix``."""
    opdef = get_op(op.type)
    ins = [TensorType(tuple(v.shape), v.dtype) for v in op.inputs]
    try:
        got = opdef.infer(*ins, **op.attrs)
    except Exception as e:   # noqa: BLE001 - any inference failure is reported as a plan error
        got = e
    if isinstance(got, TensorType):
        got = (got,)
    want = tuple(tuple(o.shape) for o in op.outputs)
    if isinstance(got, Exception) or tuple(tuple(t.shape) for t in got) != want:
        raise PlanError(f"op #{k} '{op.type}' ({op.layer or 'top level'}) cannot {what}: "
                        f"on operands "
                        f"{[list(v.shape) for v in op.inputs]} it gives "
                        f"{got if isinstance(got, Exception) else [list(t.shape) for t in got]}"
                        f", not {[list(s) for s in want]} (an attribute fixes the batch "
                        f"size); {fix}")
