"""Mixed precision (``Strategy(amp=...)``): the forward and backward in 16 bit, float32
master weights, gradients and moments; float16 with a dynamic loss scale.

- bfloat16: 50 steps of a tiny Llama stay within 2% of the float32 run's losses; the
  parameters and optimizer states stay float32, the activations are 16-bit.
- float16: an injected overflow (a loss scale far too large) skips its step — parameters
  and moments untouched, the scale halved — and training goes on; good steps in a row
  grow the scale again.
- The options only mean something together; a program built otherwise than the Strategy
  says is refused; the estimate sees half-size activations.
"""

from __future__ import annotations

import numpy as np
import pytest

import distgraph as dg
from distgraph.errors import DistGraphError, PlanError
from distgraph.optim.amp import GOOD, SCALE_EXP
from distgraph.program_builder import build_program
from distgraph.runtime.execution.runner import PlanRunner

STEPS = 50


def tiny_llama():
    dg.seed(0)
    return dg.nn.Llama(vocab_size=64, hidden_size=32, intermediate_size=48,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def batch(step: int, rows=8, seq=16) -> dict:
    """Counting sequences from random starts: a pattern the model can learn."""
    rng = np.random.default_rng(step)
    ids = (np.arange(seq + 1)[None, :] + rng.integers(0, 64, (rows, 1))) % 64
    return {"tokens": ids[:, :-1], "labels": ids[:, 1:]}


class Run:
    """A tiny Llama's training program under ``strategy``, run on one process."""

    def __init__(self, strategy: dg.Strategy):
        self.model = tiny_llama()
        opt = dg.optim.AdamW(3e-3)
        self.built = build_program(
            self.model, [dg.InputSpec([8, 16], "int64", "tokens")],
            [dg.InputSpec([8, 16], "int64", "labels")], dg.nn.CrossEntropyLoss(), opt,
            amp=strategy.amp, loss_scale=strategy.loss_scale,
            loss_scale_window=strategy.loss_scale_window)
        self.plan = dg.passes.plan(self.built, strategy)
        self.runner = PlanRunner(self.plan)
        values = {n: p.numpy() for n, p in self.model.named_parameters()}
        self.scope = self.runner.shard_scope({**values, **opt.initial_state(self.built.program)})
        self.step = 0

    def train(self, steps: int) -> list:
        out = []
        for _ in range(steps):
            out.append(float(self.runner.run(self.scope, batch(self.step),
                                             self.step)[self.built.loss_name]))
            self.step += 1
        return out


def test_bfloat16_trains_within_two_percent_of_float32_with_float32_masters():
    full = Run(dg.Strategy()).train(STEPS)
    amp = Run(dg.Strategy(amp="bfloat16"))
    losses = amp.train(STEPS)
    assert full[-1] < 0.6 * full[0]                       # it learns the pattern
    worst = max(abs(a - b) / a for a, b in zip(full, losses))
    assert worst < 0.02, worst
    program = amp.built.program
    assert {v.dtype for v in program.persistables} <= {"float32", "float64", "int64"}
    assert all(amp.scope[v.name].dtype == np.float32 for v in program.parameters)
    acts = [v for v in program.values.values() if v.name.startswith("matmul")]
    assert acts and all(v.dtype == "bfloat16" for v in acts)
    assert program.values[amp.built.loss_name].dtype == "float32"


def test_float16_skips_an_overflowing_step_halves_the_scale_and_trains_on():
    run = Run(dg.Strategy(amp="float16", loss_scale=2.0 ** 40, loss_scale_window=10))
    names = [v.name for v in run.built.program.parameters]
    before = {n: run.scope[n].copy() for n in names}
    first = run.train(1)
    assert np.isfinite(first[0]) and run.scope[SCALE_EXP] == -1
    for n in names:                                       # the step was not applied
        np.testing.assert_array_equal(run.scope[n], before[n])
        assert not run.scope[f"{n}@MOMENT1"].any()
    assert int(run.scope[dg.optim.STEP]) == 0
    losses = first + run.train(STEPS)
    exponent = float(run.scope[SCALE_EXP])
    applied = int(run.scope[dg.optim.STEP])
    assert exponent < -10 and applied > STEPS // 2        # it came down to a usable scale
    assert all(np.isfinite(losses)) and losses[-1] < 0.7 * losses[0]
    assert 0 <= float(run.scope[GOOD]) < 10


def test_a_good_run_grows_the_scale_after_the_window():
    run = Run(dg.Strategy(amp="float16", loss_scale=256.0, loss_scale_window=4))
    run.train(4)
    assert run.scope[SCALE_EXP] == 1 and run.scope[GOOD] == 0
    run.train(3)
    assert run.scope[SCALE_EXP] == 1 and run.scope[GOOD] == 3


def test_options_that_only_mean_something_together_are_refused_apart():
    with pytest.raises(DistGraphError, match="amp must be None, 'bfloat16' or 'float16'"):
        dg.Strategy(amp="fp8")
    with pytest.raises(DistGraphError, match="use them with amp='float16'"):
        dg.Strategy(amp="bfloat16", loss_scale=1024.0)
    built = build_program(tiny_llama(), [dg.InputSpec([8, 16], "int64", "tokens")],
                          [dg.InputSpec([8, 16], "int64", "labels")],
                          dg.nn.CrossEntropyLoss(), dg.optim.AdamW(1e-3))
    with pytest.raises(PlanError, match="plans a program built in full precision"):
        dg.passes.plan(built, dg.Strategy(amp="bfloat16"))


def test_the_estimate_sees_half_size_activations_and_float32_masters():
    full, amp = Run(dg.Strategy()), Run(dg.Strategy(amp="bfloat16"))
    (f,), (a,) = (dg.passes.estimate(r.plan).processes for r in (full, amp))
    assert a.parameters == f.parameters and a.states == f.states     # float32 masters
    assert a.activations < 0.75 * f.activations


@pytest.mark.parametrize("amp", ["bfloat16", "float16"])
def test_micro_batches_accumulate_the_float32_gradients(amp):
    """Under amp each parameter's 16-bit gradient is cast to float32: a widening cast,
    linear in the micro-batches' shares, so gradient accumulation (and so every pipeline)
    sums the float32 gradients; the losses follow the whole-batch run's to 16-bit
    rounding (it was a PlanError: 'cast mixes samples across the batch')."""
    whole = Run(dg.Strategy(amp=amp)).train(10)
    split = Run(dg.Strategy(amp=amp, micro_batches=2))
    acc = split.plan.accumulation
    masters = {v.name for v in split.built.program.parameters}
    grads = [n for n in acc.boundary if n.endswith("@GRAD")]
    assert sorted(grads) == sorted(f"{p}@GRAD" for p in masters)
    assert all(split.built.program.values[n].dtype == "float32" for n in grads)
    losses = split.train(10)
    assert losses[0] == pytest.approx(whole[0], rel=1e-6)
    np.testing.assert_allclose(losses, whole, rtol=2e-3)
    assert losses[-1] < losses[0] - 0.1


def test_a_weights_gradient_gemm_writes_its_float32_product_unrounded():
    """Under amp a weight's gradient GEMM writes float32 (no cast after it): on the
    host, its 16-bit operands' product in float32, not rounded to bfloat16 first (the
    bits differ), as Megatron-LM's gradient accumulation fusion keeps it."""
    from distgraph.runtime.execution.executor import ProgramRunner

    run = Run(dg.Strategy(amp="bfloat16"))
    program = run.built.program
    made = program.producers()
    folded = [made[f"{n}@GRAD"] for n in (v.name for v in program.parameters)
              if made[f"{n}@GRAD"].type == "matmul"]
    assert folded and all(op.attrs["out_dtype"] == "float32" and op.attrs.get("rows")
                          for op in folded)
    assert not any(op.type == "cast" and op.inputs[0] is f.outputs[0]
                   for op in program.ops for f in folded)
    op = folded[0]
    x, dz = op.inputs
    scope = {n: p.numpy() for n, p in run.model.named_parameters()}
    scope.update(dg.optim.AdamW(3e-3).initial_state(program))
    got = ProgramRunner(program).run(scope, batch(0), [x.name, dz.name, op.outputs[0].name])
    assert got[x.name].dtype.name == got[dz.name].dtype.name == "bfloat16"
    want = (got[x.name].astype(np.float32).reshape(-1, x.shape[-1]).T
            @ got[dz.name].astype(np.float32).reshape(-1, dz.shape[-1]))
    grad = got[op.outputs[0].name]
    assert grad.dtype == np.float32
    np.testing.assert_array_equal(grad, want)
    rounded = want.astype(run.built.program.values[x.name].dtype).astype(np.float32)
    assert not np.array_equal(grad, rounded)


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_mixtral_with_its_load_balancing_loss_trains_in_bfloat16(micro_batches):
    """The router's statistics are counted in float32 (bfloat16 counts stop at 256) and
    the load-balancing term joins the float32 loss; it was a DTypeError ('add': bfloat16,
    float32). The losses follow float32 training's."""
    def losses(amp):
        dg.seed(0)
        model = dg.nn.Mixtral(vocab_size=64, hidden_size=32, intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, num_local_experts=4,
                              num_experts_per_tok=2, output_router_logits=True,
                              router_aux_loss_coef=0.01)
        engine = dg.Engine(model, loss=dg.nn.CrossEntropyLoss(), optimizer=dg.optim.AdamW(3e-3),
                           strategy=dg.Strategy(amp=amp, micro_batches=micro_batches))
        data = [(b["tokens"][i], b["labels"][i]) for b in map(batch, range(4)) for i in range(8)]
        history = engine.fit(data, batch_size=8, verbose=0)
        return engine, history.losses

    engine, low = losses("bfloat16")
    program = engine.plan().program
    stats = [op.outputs[0] for op in program.ops if op.type == "one_hot"]
    assert stats and all(v.dtype == "float32" for v in stats)
    np.testing.assert_allclose(low, losses(None)[1], rtol=2e-3)


def test_a_gpu_multiplies_16_bit_operands_as_they_are_only_in_gemms_it_runs_whole():
    """The executor's choice (runtime/execution/executor.gpu_16bit): a GPU runs a Linear
    layer's GEMM, two matrices' or stacks of one batch shape (attention's), on bfloat16
    operands on its matrix units; a stack against a broadcast one, MeshSlice's sliced
    form (partial products accumulated) and operands of two dtypes are widened to
    float32 first."""
    from types import SimpleNamespace

    from distgraph.dtypes import numpy_dtype
    from distgraph.runtime.execution.executor import gpu_16bit

    bf16 = numpy_dtype("bfloat16")

    def takes(shapes, attrs=(), dtypes=(bf16, bf16), op="matmul"):
        args = [np.zeros(s, dtype=d) for s, d in zip(shapes, dtypes)]
        return gpu_16bit(SimpleNamespace(op_type=op, out_dtypes=(bf16,)), args, dict(attrs))

    assert takes([(4, 8, 16), (16, 32)])                              # a Linear layer
    assert takes([(8, 16), (32, 16)], {"transpose_y": True})
    assert takes([(16, 8), (16, 32)], {"transpose_x": True})
    assert takes([(4, 8, 16), (4, 8, 32)], {"rows": True})            # its weight's gradient
    assert takes([(2, 4, 8, 16), (2, 4, 16, 8)])                      # attention's, stacked
    assert takes([(2, 4, 16, 8), (2, 4, 16, 8)], {"transpose_x": True})
    assert not takes([(2, 4, 8, 16), (4, 16, 8)])                     # broadcast
    assert not takes([(4, 8, 16), (16, 32)], {"transpose_x": True})
    assert not takes([(8, 16), (16, 32)], {"meshslice": object()})
    assert not takes([(8, 16), (16, 32)], dtypes=(bf16, np.float32))
    assert not takes([(8, 16), (8, 16)], op="add")
    # the row softmax and its gradient on bfloat16 rows (fused_gpu.rows_bf16)
    assert takes([(4, 8, 16)], dtypes=(bf16,), op="softmax")
    assert takes([(4, 8, 16), (4, 8, 16)], op="softmax_grad")
    assert not takes([(4, 8, 16)], {"axis": 1}, dtypes=(bf16,), op="softmax")
    assert not takes([(4, 8, 16), (4, 8, 16)], dtypes=(bf16, np.float32), op="softmax_grad")
    assert not takes([(8, 16)], dtypes=(np.float16,), op="softmax")

