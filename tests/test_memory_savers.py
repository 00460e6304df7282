"""The memory savers a strategy leaves unset are the search's to choose under
``auto_mode="full"`` (distgraph/strategy.py, passes/fitting.py): the micro-batch count with
``pipeline=True``, recomputation (none, the attention scores or whole blocks: the plan of
least estimated step time that fits); what the user sets is kept; the plan says what was
chosen (``Plan.savers``, ``explain()``). Selective recomputation
(``Strategy(recompute="selective")``) trains as serial training on real MPI ranks."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402
from distgraph.errors import DoesNotFit  # noqa: E402

import plans as P  # noqa: E402
from distgraph.passes.transforms.recompute import SUFFIX  # noqa: E402
from test_fitting import _gpt, cluster_of, fits  # noqa: E402
from test_spmd_mpi import check_report, run_plans  # noqa: E402


def pipelined(**options) -> dg.Strategy:
    """The stage search's strategy; ZeRO and sequence parallelism off, as in
    :func:`searched`."""
    return dg.Strategy(auto_mode="full", pipeline=True, sharding=False,
                       sequence_parallel=False, **options)


def searched(memory_bytes, **options):
    """The 4-layer GPT searched on 4 devices of ``memory_bytes``; ZeRO and sequence
    parallelism off unless given, so that recomputation alone is weighed here
    (tests/test_searched_savers.py weighs them)."""
    options = {"sharding": False, "sequence_parallel": False, **options}
    return dg.passes.plan(_gpt(), dg.Strategy(auto_mode="full", **options),
                          cluster_of(4, memory_bytes))


@pytest.fixture(scope="module")
def peaks() -> dict:
    """The 4-layer GPT's searched peak and step time per recomputation, memory no limit."""
    return {kind: (p.estimate.peak_memory, p.estimate.step_time)
            for kind in (False, "selective", True)
            for p in [searched(1e12, recompute=kind)]}


def test_recompute_unset_is_searched_under_full_and_off_elsewhere():
    assert dg.Strategy().recompute is False
    assert dg.Strategy(auto_mode="full").recompute is None
    assert dg.Strategy(auto_mode="full", recompute=False).recompute is False
    with pytest.raises(dg.PlanError, match="recompute=None"):
        dg.passes.plan(_gpt(), dg.Strategy(recompute=None), cluster_of(4, 1e12))


def test_with_room_the_search_does_not_recompute(peaks):
    plan = searched(1e12)
    assert plan.strategy.recompute is False
    assert (plan.estimate.peak_memory, plan.estimate.step_time) == peaks[False]
    assert peaks[False][1] < peaks["selective"][1] < peaks[True][1]     # priced faster
    note = next(c for c in plan.savers if c.option == "recompute")
    assert note.value is False and note.seconds == peaks[False][1]
    # memory held nothing back (no budget limits the search): no recomputation is priced
    assert note.others == () and "memory held no faster plan back" in note.why
    assert plan.search.memory_binds is False
    assert "recompute=False chosen by the search" in plan.explain()
    assert "memory held no faster plan back" in plan.explain()


def test_where_memory_forces_it_the_search_recomputes_and_fits(peaks):
    """Half the unlimited plan's peak: no layout fits without recomputation, nor with the
    scores recomputed; 60%: the scores recomputed fit."""
    limit = 0.5 * peaks[False][0]
    with pytest.raises(DoesNotFit, match="makes it fit"):      # the user's False is kept
        searched(limit, recompute=False)
    plan = searched(limit)
    cluster = cluster_of(4, limit)
    assert plan.strategy.recompute is True and fits(plan, cluster)
    note = next(c for c in plan.savers if c.option == "recompute")
    assert [(v, s) for v, _, s in note.others] == [(False, None), ("selective", None)]
    assert "recompute=True chosen by the search" in plan.explain()
    assert "without recomputation: does not fit" in plan.explain()
    # with less pressure, recomputing the attention scores fits: the least that does
    limit = 0.6 * peaks[False][0]
    plan = searched(limit)
    assert plan.strategy.recompute == "selective" and fits(plan, cluster_of(4, limit))


def test_micro_batches_unset_are_searched_with_the_stages_and_one_elsewhere():
    assert dg.Strategy().micro_batches == 1
    assert dg.Strategy(auto_mode="full").micro_batches == 1
    assert dg.Strategy(auto_mode="full", pipeline=True).micro_batches is None
    assert pipelined(micro_batches=4).micro_batches == 4
    assert pipelined(micro_batches=1).micro_batches == 1


@pytest.fixture(scope="module")
def one_micro_batch_peak() -> float:
    """The 4-layer GPT pipeline's peak with one micro-batch, memory no limit."""
    return dg.passes.plan(_gpt(), pipelined(micro_batches=1, recompute=False),
                          cluster_of(4, 1e12)) \
        .estimate.peak_memory


def test_unset_micro_batches_fit_where_the_one_a_user_gives_does_not(one_micro_batch_peak):
    cluster = cluster_of(4, 0.6 * one_micro_batch_peak)
    with pytest.raises(DoesNotFit, match="micro_batches=None"):
        dg.passes.plan(_gpt(), pipelined(micro_batches=1, recompute=False), cluster)
    plan = dg.passes.plan(_gpt(), pipelined(recompute=False), cluster)
    assert plan.micro_batches > 1 and fits(plan, cluster)


SELECTIVE = ["gpt:tp_sp_selective", "gpt:dp_tp_selective"]


@pytest.mark.mpi
def test_selective_recomputation_trains_as_serial_on_four_mpi_ranks():
    """Tensor parallelism with sequence parallelism, and dp x tp, each with every block's
    attention scores recomputed: losses and parameters equal serial training (fp64,
    1e-10) on every rank."""
    for key in SELECTIVE:               # the plans do recompute the scores
        plan = P.RECOMPUTE_PLANS[(*key.split(":"), 4)]
        model = P.build_model("gpt")
        plan.annotate(model)
        engine = P.prepare(P.make_engine(model, "gpt", sequence_parallel=plan.sequence_parallel,
                                         recompute=plan.recompute), "gpt")
        copied = {op.type for op in engine.plan().program.ops
                  if op.outputs[0].name.endswith(SUFFIX)}
        assert copied == {"matmul", "scale", "causal_mask", "full", "where", "softmax"}, key
    check_report(run_plans(4, SELECTIVE), 4, SELECTIVE)


def test_selective_recomputation_holds_what_the_estimate_says(float64):
    """The bytes a rank's allocator hands out at its peak with the attention scores
    recomputed are the plan's estimate (tracemalloc, the step's StepMemory.allocation_peak;
    the kernels' workspace included), and fewer than without recomputation."""
    data = P.Dataset("gpt", n=32, dims=dict(P.GPT_DIMS, max_seq_len=32), batch=16)
    allocated = {}
    for kind in (False, "selective"):
        dg.seed(0)
        model = dg.nn.GPT(vocab_size=64, d_model=32, n_layer=2, n_head=4, max_seq_len=32)
        engine = dg.Engine(model, dg.nn.CrossEntropyLoss(), dg.optim.AdamW(1e-3),
                           cluster=dg.Cluster.local(1), strategy=dg.Strategy(recompute=kind))
        history = P.traced_fit(engine, data, batch_size=16, epochs=1, verbose=0)
        allocated[kind] = history.allocated[-1]
        est = engine.plan().estimate.processes[0]
        assert allocated[kind] == pytest.approx(est.peak_memory, rel=0.05), kind
    assert allocated["selective"] < allocated[False]
