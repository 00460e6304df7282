"""The search's context-parallel cases (tests/test_cp_search.py and its MPI script):
Llama-tiny of four layers with one key/value head (AdamW, float64) whose stages the
search lays out on one machine of 4 devices, ``Strategy(auto_mode="full",
pipeline=True)``, 4 micro-batches. LONG: micro-batches of 2 sequences of 512 (the rows
cannot spread over 4 devices); SHORT: the same tokens as 8 sequences of 128.

Example::

    plan, built, values = search_plan(*LONG, budget_gb=BUDGET_GB)
    losses, params = train(plan, built, values, comm)
"""

from __future__ import annotations

import numpy as np

import distgraph as dg
from distgraph.nn.llama import Llama, LlamaConfig
from distgraph.program_builder import build_program
from distgraph.runtime.execution.runner import PlanRunner

import llama_cases as L
import search_cases as S

LONG = (8, 512)         # (rows, sequence): micro-batches of 2 sequences for 4 devices
SHORT = (32, 128)       # the same tokens: micro-batches of 8 sequences
MICRO = 4
KV_HEADS = 1           # one key/value head: a tp split of attention has little to cut
BUDGET_GB = 6e-3        # below every stage plan that keeps the sequence whole (the test shows it)
STEPS = 2


def built_program(rows: int, seq: int):
    """(BuiltProgram, initial values) of Llama-tiny on ``rows`` sequences of ``seq``."""
    config = LlamaConfig(**{**L.TINY, "num_hidden_layers": 4, "max_position_embeddings": seq,
                            "num_key_value_heads": KV_HEADS},
                         rope_theta=500000.0, initializer_range=0.2)
    dg.seed(3)
    model = Llama(config)
    optimizer = dg.optim.AdamW(1e-2)
    built = build_program(model, [dg.InputSpec([rows, seq], "int64", "tokens")],
                          [dg.InputSpec([rows, seq], "int64", "labels")],
                          dg.nn.CrossEntropyLoss(), optimizer)
    values = {n: p.numpy() for n, p in model.named_parameters()}
    values.update(optimizer.initial_state(built.program))
    return built, values


def cluster() -> dg.Cluster:
    """One machine of 4 CPU devices (tests/search_cases.py's figures)."""
    return S.line_cluster(4)


def strategy(budget_gb=None) -> dg.Strategy:
    return dg.Strategy(auto_mode="full", pipeline=True, micro_batches=MICRO, search="recursive",
                       memory_budget_gb=budget_gb)


def search_plan(rows: int, seq: int, budget_gb=None):
    """(the searched Plan, its BuiltProgram, the initial values)."""
    built, values = built_program(rows, seq)
    return dg.passes.plan(built, strategy(budget_gb), cluster()), built, values


def train(plan, built, values, comm) -> tuple:
    """(losses, {parameter: value}) of ``STEPS`` steps of ``plan`` on ``comm``."""
    runner = PlanRunner(plan, comm)
    scope = runner.shard_scope(dict(values))
    rows, seq = built.program.inputs[0].shape
    rng = np.random.default_rng(0)
    losses = []
    for t in range(STEPS):
        ids = rng.integers(0, L.TINY["vocab_size"], (rows, seq + 1))
        out = runner.run(scope, {"tokens": ids[:, :-1], "labels": ids[:, 1:]}, t)
        losses.append(float(out[built.loss_name]))
    names = [n for n, v in plan.program.values.items() if v.is_parameter]
    return losses, runner.gather(scope, names)


def splits_sequence(result, seq: int) -> bool:
    """Whether a search's choice splits any op's result along a dim of ``seq`` (the
    sequence: no other dim of the cases is that long)."""
    for node in result.space.nodes:
        if node.is_source:
            continue
        op = result.space.program.ops[node.op]
        strategy = result.strategy(node.index)
        for o, spec in zip(op.outputs, strategy.out_specs):
            if any(n == seq and spec.entry(d) for d, n in enumerate(o.shape)):
                return True
    return False


def unsplit_stage_plan(rows: int, seq: int, budget_gb: float):
    """The stage DP of the search (:func:`~distgraph.passes.search.stages.run_dp.plan_runs`) on
    the options it builds for the program, less every option whose choice splits the
    sequence, on devices of ``budget_gb``: a PlanError where none of them fits."""
    import dataclasses

    from distgraph.passes.pipeline.accumulate import split_micro_batches
    from distgraph.passes.search.stages.layers import block_layers
    from distgraph.passes.search.stages.run_dp import plan_runs
    from distgraph.passes.search.stages.runs import RunCosts
    from distgraph.passes.search.stages.pipeline import _capped

    built, _ = built_program(rows, seq)
    built, _ = split_micro_batches(built, MICRO)
    prepared = dataclasses.replace(built, program=built.program.clone())
    layering = block_layers(prepared.program, prepared.block_paths)
    machine = cluster()
    costs = RunCosts(prepared, strategy(), machine, layering, MICRO)
    options = [o for o in costs.options(variants=True)
               if not any(splits_sequence(r, seq) for _, r in o.parts.values())]
    return plan_runs(layering.count, layering.blocks, options, _capped(machine, budget_gb),
                     MICRO)
