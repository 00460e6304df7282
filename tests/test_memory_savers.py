"""The memory savers a strategy leaves unset are the search's to choose under
``auto_mode="full"`` (distgraph/strategy.py, passes/fitting.py): the micro-batch count with
``pipeline=True``; what the user sets is kept. Selective recomputation
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
    return dg.Strategy(auto_mode="full", pipeline=True, **options)


def test_micro_batches_unset_are_searched_with_the_stages_and_one_elsewhere():
    assert dg.Strategy().micro_batches == 1
    assert dg.Strategy(auto_mode="full").micro_batches == 1
    assert pipelined().micro_batches is None
    assert pipelined(micro_batches=4).micro_batches == 4
    assert pipelined(micro_batches=1).micro_batches == 1


@pytest.fixture(scope="module")
def one_micro_batch_peak() -> float:
    """The 4-layer GPT pipeline's peak with one micro-batch, memory no limit."""
    return dg.passes.plan(_gpt(), pipelined(micro_batches=1), cluster_of(4, 1e12)) \
        .estimate.peak_memory


def test_unset_micro_batches_fit_where_the_one_a_user_gives_does_not(one_micro_batch_peak):
    cluster = cluster_of(4, 0.6 * one_micro_batch_peak)
    with pytest.raises(DoesNotFit, match="micro_batches=None"):
        dg.passes.plan(_gpt(), pipelined(micro_batches=1), cluster)     # kept, refused
    plan = dg.passes.plan(_gpt(), pipelined(), cluster)
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
