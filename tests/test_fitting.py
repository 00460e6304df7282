"""Plans fit their devices by construction (passes/fitting.py): on a cluster, no plan is
returned whose estimate needs more memory than a device may hold, with or without
``memory_budget_gb``, for every search and for annotated plans; what does not fit is one
DoesNotFit naming the smallest peak, where, and a memory saver that was tried and fits."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402
from distgraph.errors import DoesNotFit  # noqa: E402
from distgraph.passes.cost.fit import limit_of, overflows  # noqa: E402
from distgraph.program_builder import build_program  # noqa: E402
from distgraph.units import GB  # noqa: E402

import plans as P  # noqa: E402
import search_cases as S  # noqa: E402


def cluster_of(n: int, memory_bytes: float) -> dg.Cluster:
    """``n`` alike devices of ``memory_bytes`` each, on links so slow (0.1 GB/s) that the
    fastest plan of the MLP keeps its weights whole: a limit then costs time."""
    return S.line_cluster(n, bandwidth=0.1, device=dict(S.DEVICE, memory=memory_bytes / GB))


def searched(cluster, program=None, **strategy):
    built = program or S.mlp_program(batch=256, hidden=512)
    return dg.passes.plan(built, dg.Strategy(auto_mode="full", **strategy), cluster)


def fits(plan, cluster, budget_gb=None) -> bool:
    return not overflows(plan.estimate, cluster, budget_gb)


@pytest.fixture(scope="module")
def free_peak() -> float:
    """The MLP's searched peak where memory is no limit."""
    return searched(cluster_of(4, 1e12)).estimate.peak_memory


def test_the_devices_memory_is_a_limit_without_a_budget(free_peak):
    free = searched(cluster_of(4, 1e12))
    tight = cluster_of(4, 0.8 * free_peak)
    plan = searched(tight)
    assert plan.estimate.peak_memory <= 0.8 * free_peak
    assert fits(plan, tight)
    assert plan.search.objective >= free.search.objective * (1 - 1e-12)


def test_a_budget_lowers_the_devices_memory_and_never_raises_it(free_peak):
    devices = cluster_of(4, 0.8 * free_peak)
    above = searched(devices, memory_budget_gb=10 * free_peak / GB)
    assert above.estimate.peak_memory <= 0.8 * free_peak
    below = searched(cluster_of(4, 1e12), memory_budget_gb=0.8 * free_peak / GB)
    assert below.estimate.peak_memory <= 0.8 * free_peak
    assert limit_of(devices, 0, 10 * free_peak / GB) == 0.8 * free_peak
    assert limit_of(devices, 0, 0.5 * free_peak / GB) == 0.5 * free_peak


def test_memory_below_every_layout_is_refused_naming_the_smallest_peak(free_peak):
    small = cluster_of(4, 0.3 * free_peak)
    with pytest.raises(DoesNotFit) as refused:
        searched(small)
    e = refused.value
    assert e.limit == 0.3 * free_peak and e.peak > e.limit
    # the search holds every layout to the devices' memory from the start: no plan over
    # it is made, and the refusal names the least peak a layout reaches
    assert str(e).startswith(f"no plan found fits the devices' memory, which may hold "
                             f"{e.limit / GB:.4g} GB: no layout peaks below "
                             f"{e.peak / GB:.4g} GB per device")
    # ... which a plan on devices of that much memory reaches, as the estimate counts it
    least = searched(cluster_of(4, e.peak))
    assert least.estimate.peak_memory == pytest.approx(e.peak, rel=1e-9)
    # the memory savers the strategy leaves off were tried, and none fits
    assert "do not fit either; use more devices or devices with more memory" in str(e)


@pytest.mark.parametrize("search", ["ilp", "recursive", "auto"])
@pytest.mark.parametrize("share", [1.0, 0.6, 0.35])
def test_no_search_returns_a_plan_over_the_devices_memory(search, share, free_peak):
    """Whatever the search and however tight the devices, the plan fits or none is
    returned."""
    cluster = cluster_of(4, share * free_peak)
    try:
        plan = searched(cluster, search=search)
    except DoesNotFit as e:
        assert e.peak > e.limit
        return
    assert fits(plan, cluster)
    # the search held its layouts to the devices' memory as the estimate counts them,
    # the copies its reshards make included (at 0.6 the least peak has a reshard's copy
    # at its reader: 2.23 MB, where the search once counted 2.26 MB for a plan of 2.88)
    assert plan.search.peak_memory == pytest.approx(plan.estimate.peak_memory, rel=1e-9)


def test_a_refusal_no_saver_causes_plans_each_strategy_once(monkeypatch, free_peak):
    """Where memory binds the MLP, the search asks for its attention scores recomputed
    ("selective"), which the planner refuses whatever the other savers: an MLP has
    none. The savers left to the search are then tried off before the refusal stands,
    but each strategy is planned once: sequence parallelism is asked off already (two
    plannings of the two, six before)."""
    from distgraph.passes import planner

    asked = []
    real = planner._fitted

    def recording(built, strategy, *args, **kwargs):
        asked.append(strategy)
        return real(built, strategy, *args, **kwargs)

    monkeypatch.setattr(planner, "_fitted", recording)
    tight = cluster_of(4, 0.6 * free_peak)
    assert fits(searched(tight), tight)
    refused = [s for s in asked if s.recompute == "selective"]
    assert len(refused) == 2        # as the search leaves it, and with ZeRO's sharding off
    assert all(a != b for i, a in enumerate(asked) for b in asked[i + 1:])


def _gpt(n_layer=4):
    dg.seed(0)
    model = dg.nn.GPT(vocab_size=64, d_model=64, n_layer=n_layer, n_head=4, max_seq_len=32)
    return build_program(model, [dg.InputSpec([16, 32], "int64", "tokens")],
                         [dg.InputSpec([16, 32], "int64", "labels")],
                         dg.nn.CrossEntropyLoss(), dg.optim.AdamW(1e-3))


@pytest.fixture(scope="module")
def pipeline_peak() -> float:
    """The 4-layer GPT pipeline's peak, memory no limit, 4 micro-batches given."""
    plan = dg.passes.plan(_gpt(), dg.Strategy(auto_mode="full", pipeline=True,
                                               micro_batches=4), cluster_of(4, 1e12))
    return plan.estimate.peak_memory


@pytest.mark.parametrize("micro", [4, None])
@pytest.mark.parametrize("share", [1.0, 0.7, 0.4])
def test_no_stage_search_returns_a_plan_over_the_devices_memory(micro, share, pipeline_peak):
    cluster = cluster_of(4, share * pipeline_peak)
    # ZeRO and sequence parallelism given: the fitting is weighed here, the savers in
    # test_searched_savers.py
    strategy = dg.Strategy(auto_mode="full", pipeline=True, micro_batches=micro,
                           sharding=False, sequence_parallel=False)
    try:
        plan = dg.passes.plan(_gpt(), strategy, cluster)
    except DoesNotFit as e:
        assert e.peak is None or e.peak > e.limit
        return
    assert fits(plan, cluster)


def _annotated(recompute: bool):
    model = P.build_model("gpt", dims=dict(P.GPT_DIMS, d_model=64, max_seq_len=32))
    P.PLANS["gpt", "dp", 2].annotate(model)
    data = P.Dataset("gpt", n=16, dims=dict(P.GPT_DIMS, d_model=64, max_seq_len=32), batch=16)
    ins, labels = dg.app.data.DataLoader(data, 16).specs(1)
    built = build_program(model, ins, labels, P.loss_fn("gpt"), P.make_optimizer("adamw"))
    return built, dg.Strategy(recompute=recompute)


def test_an_annotated_plan_over_memory_names_a_fix_that_works():
    roomy = cluster_of(2, 1e12)
    plain = dg.passes.plan(*_annotated(False), roomy).estimate
    lean = dg.passes.plan(*_annotated(True), roomy).estimate
    assert lean.peak_memory < plain.peak_memory
    limit = (lean.peak_memory + plain.peak_memory) / 2
    cluster = cluster_of(2, limit)
    with pytest.raises(DoesNotFit) as refused:
        dg.passes.plan(*_annotated(False), cluster)
    e = refused.value
    worst = max(plain.processes, key=lambda p: p.peak_memory)
    assert e.peak == worst.peak_memory and e.limit == limit
    assert str(e).startswith(f"the plan does not fit its devices' memory: it needs "
                             f"{worst.peak_memory / GB:.4g} GB on process {worst.process} "
                             f"(stage 0, device {worst.device}), which may hold "
                             f"{limit / GB:.4g} GB")
    assert f"Strategy(recompute=True) makes it fit: peak {lean.peak_memory / GB:.4g} GB" \
        in str(e)
    fixed = dg.passes.plan(*_annotated(True), cluster)          # the named fix works
    assert fits(fixed, cluster)


def test_a_plan_without_a_cluster_is_not_checked():
    plan = dg.passes.plan(*_annotated(False), None)
    assert plan.estimate is None
