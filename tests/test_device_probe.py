"""distgraph/tools/device_probe.py: the per-op-type costs cover the op types of every model
family the probe trains (GPT, MLP, Llama with grouped-query attention, Mixtral) and the
casts between float32 and the 16-bit dtypes, and a sustained step runs its steps back to
back after one line-up."""

from __future__ import annotations

import pytest

from distgraph.registry import CAST_COSTS
from distgraph.tools.device_probe import _sustained_step, op_costs

LLAMA_AND_MIXTRAL = {"rms_norm", "rms_norm_grad", "rotary", "attention", "attention_grad",
                     "silu", "silu_grad", "moe_ffn", "moe_ffn_grad", "top_k"}


@pytest.mark.parametrize("window", [0.0, 0.01])
def test_op_costs_price_llama_and_mixtral_op_types(window):
    costs = op_costs(repeats=1, steps=1, window=window)
    assert LLAMA_AND_MIXTRAL | {"matmul", "layer_norm", "gelu", "relu"} <= set(costs)
    assert all(per_call >= 0 and per_unit >= 0 for per_call, per_unit in costs.values())
    assert costs["matmul"][1] > 0
    # the executor's casts around 16-bit operands, each way: a cost per element
    assert all(costs[key][1] > 0 for key in CAST_COSTS)


def test_a_sustained_step_lines_up_once_and_runs_at_least_one_step():
    calls = {"sync": 0, "steps": 0}

    def run():
        calls["steps"] += 1

    seconds = _sustained_step(run, 0.0, sync=lambda: calls.__setitem__("sync", calls["sync"] + 1))
    assert calls["sync"] == 1 and calls["steps"] == 1 and seconds >= 0
