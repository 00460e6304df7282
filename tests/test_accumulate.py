"""Gradient accumulation as program structure: the micro-batch program, what the update
accumulates and how, and the programs that cannot be split (PlanErrors naming why)."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402
from distgraph.ir import Role  # noqa: E402
from distgraph.passes.pipeline.accumulate import split_micro_batches  # noqa: E402
from distgraph.passes.samples import sample_axes  # noqa: E402
from distgraph.runtime.execution.tasks import micro_batch_context  # noqa: E402
from distgraph.plan.kinds import AccumulationMode  # noqa: E402
from distgraph.program_builder import build_program  # noqa: E402

import plans as P  # noqa: E402


def built_of(kind, batch=8, model=None):
    model = model or P.build_model(kind)
    ins, labels = dg.app.data.DataLoader(P.Dataset(kind, batch=batch), batch).specs(1)
    return build_program(model, ins, labels, P.loss_fn(kind), P.make_optimizer("adamw"))


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_micro_batch_program_and_what_it_accumulates(kind):
    built = built_of(kind)
    mb, acc = split_micro_batches(built, 4)
    assert acc.micro_batches == 4 and acc.batch == 8 and acc.micro_batch_rows == 2
    for name in built.feed_names:
        assert mb.program.values[name].shape[0] == 2
        assert built.program.values[name].shape[0] == 8      # the built program is untouched
        assert acc.split_axis[name] == 0
    params = {v.name for v in built.program.parameters}
    grads = [n for n in acc.boundary if n != built.loss_name]
    assert sorted(grads) == sorted(f"{p}@GRAD" for p in params)
    # gradients and the loss
    assert all(acc.mode(n) is AccumulationMode.SUM for n in acc.boundary)
    assert acc.boundary[-1] == built.loss_name
    for p in params:                                             # parameters keep their shape
        assert mb.program.values[p].shape == built.program.values[p].shape
        assert acc.mode(p) is AccumulationMode.KEEP
    assert "sum" in acc.pretty() and "4 micro-batches of 2 rows" in acc.pretty()


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_micro_batch_shapes_are_the_sample_analysis_local_shapes(kind):
    """The micro-batch program takes the shapes micro-batch 0's partition found: each
    Value's layout in the analysis on M processes, cut to one process's block."""
    from distgraph.passes.pipeline.accumulate import MB_DIM
    from distgraph.passes.samples import complete_on_samples

    built = built_of(kind)
    mb, _ = split_micro_batches(built, 4)
    analysed = complete_on_samples(built.program, built.feed_names, 4, MB_DIM)
    for v in built.program.values.values():
        local = analysed.values[v.name].dist_attr.local_shape(v.shape)
        assert tuple(mb.program.values[v.name].shape) == local
    assert any(tuple(mb.program.values[v.name].shape) != tuple(v.shape)
               for v in built.program.values.values())


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_the_split_axes_are_the_sample_axes(kind):
    """One analysis: the dims the micro-batches split are the dims that carry the
    samples, as the balanced split finds them, on the built and the micro-batch program."""
    built = built_of(kind)
    mb, acc = split_micro_batches(built, 4)
    axes = sample_axes(built.program, built.feed_names)
    assert dict(acc.split_axis) == axes == sample_axes(mb.program, mb.feed_names)
    assert axes and all(axes[name] == 0 for name in built.feed_names)


def test_a_mean_loss_keeps_the_full_batch_scale():
    """Each micro-batch's loss is its share of the full batch's mean: the mean's 1/N is
    the full batch's N, and the micro-batch losses sum to the full-batch loss."""
    built = built_of("mlp")
    mb, _ = split_micro_batches(built, 4)
    full = [op.attrs["scale"] for op in built.program.ops if op.type == "scale"
            and op.role is Role.LOSS]
    micro = [op.attrs["scale"] for op in mb.program.ops if op.type == "scale"
             and op.role is Role.LOSS]
    assert full == micro and full[0] == pytest.approx(1 / (8 * 4 * 4))


def test_reshapes_take_micro_batch_shapes():
    built = built_of("gpt")
    mb, _ = split_micro_batches(built, 2)
    reshapes = [(a, b) for a, b in zip(built.program.ops, mb.program.ops) if a.type == "reshape"]
    assert reshapes
    for full, micro in reshapes:
        if full.attrs["shape"][0] == 8:
            assert micro.attrs["shape"][0] == 4
        assert tuple(micro.attrs["shape"]) == tuple(micro.outputs[0].shape)


def test_plan_with_micro_batches():
    model = P.build_model("mlp")
    P.PLANS["mlp", "two_stage", 2].annotate(model)
    p = dg.passes.plan(built_of("mlp", model=model),
                       dg.Strategy(micro_batches=4, schedule="ZB"))
    assert p.micro_batches == 4
    assert p.program.inputs[0].shape[0] == 2
    assert "gradient accumulation: 4 micro-batches of 2 rows" in p.explain()
    text = p.explain(full=True)
    assert "gradient accumulation: 4 micro-batches of 2 rows" in text
    assert "schedule ZB, 4 micro-batch(es):\n    process 0: 0F0 0F1 0I0" in text
    d = p.to_dict()
    assert d["micro_batches"] == 4 and d["accumulation"]["fc1.weight@GRAD"] == "sum"
    assert d["schedule"]["1"][:3] == ["1F0", "1I0", "1F1"]
    one = dg.passes.plan(built_of("mlp", model=model), dg.Strategy())
    assert one.micro_batches == 1 and one.accumulation is None


def test_micro_batch_context_moves_the_slice():
    ctx = {"out_global_shape": (4, 6), "out_slices": (slice(2, 4), slice(0, 3))}
    moved = micro_batch_context(ctx, 0, 3, 2)
    assert moved["out_global_shape"] == (12, 6)
    assert moved["out_slices"] == (slice(10, 12), slice(0, 3))
    assert micro_batch_context(ctx, None, 3, 2) is ctx
    # the slice of micro-batch m of a full tensor is the full tensor's rows of m
    full = np.arange(72).reshape(12, 6)
    assert np.array_equal(full[moved["out_slices"]], full[10:12, :3])


# ---- what cannot be split ------------------------------------------------------------------

class BatchCentred(dg.nn.Layer):
    """Subtracts the batch mean: every sample depends on the whole batch."""

    def __init__(self):
        super().__init__()
        self.fc = dg.nn.Linear(8, 4)

    def forward(self, x):
        y = self.fc(x)
        return y - dg.ops.mean(y, axis=0, keepdim=True)


def test_an_op_that_mixes_samples_cannot_be_split():
    built = build_program(BatchCentred(), [dg.InputSpec([8, 8], name="x")],
                          [dg.InputSpec([8, 4], name="y")], dg.nn.MSELoss(),
                          dg.optim.SGD(0.1))
    with pytest.raises(dg.PlanError, match="mixes samples across the batch"):
        split_micro_batches(built, 2)


def test_a_batch_that_does_not_divide_is_refused():
    with pytest.raises(dg.PlanError, match="use a batch size divisible by 3"):
        dg.passes.plan(built_of("mlp"), dg.Strategy(micro_batches=3))


def test_a_micro_batch_too_small_for_data_parallelism_says_so():
    model = P.build_model("mlp")
    P.PLANS["mlp", "dp", 4].annotate(model)
    with pytest.raises(dg.ShardingError, match="micro-batches of 1 rows"):
        dg.passes.plan(built_of("mlp", model=model), dg.Strategy(micro_batches=8))


def _layout(program) -> tuple:
    """Every Value's and op's completed layout, notes and origins, as text."""
    return ([(v.name, str(v.dist_attr), tuple(v.shape)) for v in program.values.values()],
            [(op.type, str(op.dist_attr.mesh), [str(s) for s in op.dist_attr.input_specs],
              [str(s) for s in op.dist_attr.output_specs], list(op.dist_attr.notes))
             for op in program.ops],
            {n: (program.ops.index(op), srcs)
             for n, (op, srcs) in program.completion_origin.items()})


def _analysed(built, m, analyses):
    from distgraph.passes.pipeline.accumulate import MB_DIM
    from distgraph.passes.samples import complete_on_samples

    try:
        return _layout(complete_on_samples(built.program, built.feed_names, m, MB_DIM,
                                           analyses=analyses))
    except dg.PlanError as e:
        return str(e)


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_sample_analyses_shared_across_counts_equal_the_plain_ones(kind):
    """A count's sample analysis replayed from another count's (where every rule answers
    alike on both meshes) is the analysis completed afresh: layouts, notes and origins,
    or the same refusal; on a batch of 6, 4 and 12 micro-batches do not divide it (the
    rules answer otherwise: not replayed, refused as a plain run refuses)."""
    from distgraph.passes.samples import SampleAnalyses

    built = built_of(kind, batch=6)
    analyses = SampleAnalyses()
    replayed = []
    for m in (2, 4, 3, 6, 12, 1):
        before = analyses.replayed
        assert _analysed(built, m, analyses) == _analysed(built, m, None), m
        replayed.append(analyses.replayed - before)
    assert replayed == [0, 0, 1, 1, 0, 1]
    split, acc = split_micro_batches(built, 3, analyses)
    plain, plain_acc = split_micro_batches(built, 3)
    assert analyses.replayed == 4
    assert acc == plain_acc
    assert [(v.name, v.shape) for v in split.program.values.values()] == \
        [(v.name, v.shape) for v in plain.program.values.values()]
    assert [(op.type, op.attrs) for op in split.program.ops] == \
        [(op.type, op.attrs) for op in plain.program.ops]
