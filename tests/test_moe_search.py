"""The search chooses expert parallelism where replicated experts do not fit.

A one-layer Mixtral (8 experts, top-2, float64, AdamW) on 2 machines x 2 devices whose
links are all slow, the two inside a machine 100 x faster than across: unconstrained,
``Strategy(auto_mode="full")`` keeps everything whole (any split costs more in
communication than it saves in compute). Under a memory budget below what replicated
experts need, it splits the experts and the tokens over the mesh dim inside the machines
(all-to-all dispatch where links are fast), the memory model counts each rank's share of
the expert weights and their AdamW moments, and the plan trains on 4 ranks
(SimulatedWorld) as the serial program does (1e-10)."""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402
from distgraph.nn.mixtral import Mixtral, MixtralConfig  # noqa: E402
from distgraph.program_builder import build_program  # noqa: E402
from distgraph.runtime.comm.simulated import SimulatedWorld  # noqa: E402
from distgraph.runtime.execution.runner import PlanRunner  # noqa: E402

import search_cases as S  # noqa: E402

BATCH, SEQ, VOCAB, STEPS = 8, 6, 32, 2
CONFIG = MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=64,
                       num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                       num_local_experts=8, num_experts_per_tok=2, initializer_range=0.2)
EXPERTS = ("gate_proj", "up_proj", "down_proj")
BUDGET = 0.4e-3         # GB: the unconstrained (replicated) plan's peak is 0.92 MB



def _built():
    dg.seed(7)
    model = Mixtral(CONFIG)
    optimizer = dg.optim.AdamW(1e-2)
    built = build_program(model, [dg.InputSpec([BATCH, SEQ], "int64", "ids")],
                          [dg.InputSpec([BATCH, SEQ], "int64", "labels")],
                          dg.nn.CrossEntropyLoss(), optimizer)
    values = {n: p.numpy() for n, p in model.named_parameters()}
    values.update(optimizer.initial_state(built.program))
    return built, values


def _search(budget_gb):
    built, values = _built()
    strategy = dg.Strategy(auto_mode="full", search="recursive", memory_budget_gb=budget_gb)
    return dg.passes.plan(built, strategy, S.grid_cluster(fast=1e-3, slow=1e-5)), built, values


def _train(plan, built, values, comm):
    runner = PlanRunner(plan, comm)
    scope = runner.shard_scope(dict(values))
    rng = np.random.default_rng(0)
    losses = []
    for t in range(STEPS):
        ids = rng.integers(0, VOCAB, (BATCH, SEQ + 1))
        out = runner.run(scope, {"ids": ids[:, :-1], "labels": ids[:, 1:]}, t)
        losses.append(float(out[built.loss_name]))
    names = [n for n, v in plan.program.values.items() if v.is_parameter]
    return losses, runner.gather(scope, names)


def _experts_split(plan) -> list:
    return [plan.program.values[f"layers.0.mlp.experts.{w}"].dist_attr.spec.dims[0]
            for w in EXPERTS]


def test_replicated_experts_over_budget_make_the_search_choose_expert_parallelism(float64):
    free, _, _ = _search(None)
    assert free.estimate.peak_memory > BUDGET * 1e9
    assert _experts_split(free) == [None] * 3

    plan, built, values = _search(BUDGET)
    assert plan.estimate.peak_memory <= BUDGET * 1e9
    # the experts and the tokens over one mesh dim, the one inside the machines
    dims = set(_experts_split(plan))
    assert len(dims) == 1
    (ep,) = dims
    assert ep == "y"
    moe = [op for op in plan.program.ops if op.type == "moe_ffn"]
    assert moe and all(ep in op.dist_attr.input_specs[0].dims[:2] for op in moe)
    assert all(line.startswith("moe_ffn") and (" over (0, 1)" in line or " over (2, 3)" in line)
               for line in plan.op_collectives())
    assert any("all_to_allv" in line for line in plan.op_collectives())
    # each rank holds its share of the experts and of their AdamW moments
    held = sum(8 * int(np.prod(v.dist_attr.local_shape(v.shape)))
               for v in plan.program.values.values() if v.is_parameter)
    experts = 3 * 8 * 16 * 64 * 8                       # bytes of the stacked weights
    assert held < free.estimate.processes[0].parameters - experts / 2
    for process in plan.estimate.processes:
        assert process.parameters == held
        assert process.states >= 2 * held               # AdamW's two moments

    serial_plan = dg.passes.plan(built, dg.Strategy())
    serial = SimulatedWorld(1).run(lambda comm: _train(serial_plan, built, values, comm))[0]
    for losses, params in SimulatedWorld(4, timeout=120).run(
            lambda comm: _train(plan, built, values, comm)):
        np.testing.assert_allclose(losses, serial[0], rtol=0, atol=1e-10)
        for name, value in serial[1].items():
            np.testing.assert_allclose(params[name], value, rtol=0, atol=1e-10, err_msg=name)
