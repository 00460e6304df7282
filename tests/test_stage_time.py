"""The stage search's step time equals the estimate's (passes/search/stages/run_dp.py and
block_plans.py against passes/cost/estimate.py): for the plan the search yields, the
stage DP's objective (``Plan.search.stage_plan.objective``: its stages' times per
micro-batch, each with the transfers to and from its neighbouring stages, in
``sum t / v + (M - 1) max t``) equals the estimate's predicted step within
``TOLERANCE``. Cases: those of tests/test_stage_memory.py: a pipeline of GPT blocks
with and without recomputation, one interleaved (virtual stages), and one on slow links
whose devices' memory makes the search take memory variants (stages of two devices:
their gradient reductions priced; there the transfers between stages are most of a
stage's time, which the DP once left out: its objective was half the estimate's); and
one with ``Strategy(sharding=True)`` on eight devices, whose stages of two devices have
their optimizer states sharded over the data-parallel dim after the search (ZeRO-1:
the gradients reduce-scattered, the updated slices all-gathered, priced by the search).

What the tolerance covers: the DP counts each stage's update as ``1 / M`` of it per
micro-batch, so the fill adds ``(S - 1) / M`` of an update the estimate counts once; and
the stages' reshard buffers' software costs on these CPU devices. On these cases the two
differ by at most 2.2%."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402

import search_cases as S  # noqa: E402
import test_stage_memory as M  # noqa: E402

TOLERANCE = 0.03
CASES = dict(M.CASES, sharding=(4, dict(recompute=False, sharding=True, sharding_mesh_dim="x"),
                                lambda: S.line_cluster(8)))


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_stage_dp_objective_equals_the_estimated_step(case):
    layers, options, cluster = CASES[case]
    plan = dg.passes.plan(M.gpt_program(layers), dg.Strategy(
        auto_mode="full", pipeline=True, micro_batches=4, **options), cluster(), ranks=())
    stages = plan.search.stage_plan
    assert len(stages.stages) > 1
    assert stages.objective == pytest.approx(plan.estimate.step_time, rel=TOLERANCE)
    if case == "sharding":          # the premise: some stage's states are sharded
        assert any(mesh.shape[0] > 1 for mesh in plan.stages)
