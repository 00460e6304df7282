"""The memory savers a strategy leaves unset are the search's to choose under
``auto_mode="full"`` (distgraph/strategy.py, passes/fitting.py): the micro-batch count with
``pipeline=True``; what the user sets is kept."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402
from distgraph.errors import DoesNotFit  # noqa: E402

from test_fitting import _gpt, cluster_of, fits  # noqa: E402


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
