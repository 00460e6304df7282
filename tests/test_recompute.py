"""Recompute: the transformed program gives the plain program's losses and parameters
(fp64, with dropout; serial and distributed over dp x mp and two stages), keeps fewer
activation bytes alive (the executor's liveness and tracemalloc agree), and bad options
are clear errors."""

import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import distgraph as dg
from distgraph.passes.transforms.recompute import SUFFIX, peak_activation_bytes
from distgraph.runtime.comm.simulated import SimulatedWorld

sys.path.insert(0, str(Path(__file__).parent))
import plans as P  # noqa: E402




def gpt_run(recompute, epochs=2, attention=None):
    """(engine, losses, parameters) of a small GPT trained under ``recompute``; its
    blocks' attention of class ``attention`` where given."""
    dg.seed(0)
    model = dg.nn.GPT(32, 16, 2, 2, 8, dropout=0.1)
    for block in model.blocks if attention is not None else ():
        block.attn.__class__ = attention
    engine = dg.Engine(model, dg.nn.CrossEntropyLoss(), dg.optim.AdamW(1e-2),
                       strategy=dg.Strategy(recompute=recompute))
    history = engine.fit(P.Tokens(), batch_size=4, epochs=epochs, shuffle=True, verbose=0)
    return engine, history.losses, engine.state_dict()


def step_peak(engine, data) -> int:
    """Bytes newly allocated at the peak of one more training step (tracemalloc), after
    a first step on ``data`` planned its batch shape."""
    engine.fit(data, batch_size=len(data), epochs=engine.epoch + 1, verbose=0)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        engine.fit(data, batch_size=len(data), epochs=engine.epoch + 1, verbose=0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak - base


def test_recompute_equals_the_plain_run_and_keeps_fewer_bytes(float64):
    plain, losses, params = gpt_run(False)
    again, rc_losses, rc_params = gpt_run(True)
    assert max(abs(a - b) for a, b in zip(losses, rc_losses)) <= 1e-12
    assert all(np.max(np.abs(params[k] - rc_params[k])) <= 1e-12 for k in params)

    program = again.plan().program
    copies = [op for op in program.ops if op.outputs[0].name.endswith(SUFFIX)]
    assert copies and all(op.role == "backward" and op.forward_op is not None for op in copies)
    drops = [op for op in copies if op.type == "dropout"]
    assert len(drops) == 6 and all(op.attrs == op.forward_op.attrs for op in drops)
    assert {op.layer.split(".")[1] for op in copies} == {"0", "1"}
    assert peak_activation_bytes(program) < 0.8 * peak_activation_bytes(plain.plan().program)

    batch = P.Tokens(8, seed=5)
    assert step_peak(again, batch) < step_peak(plain, batch)


def test_recompute_chosen_layers_only(float64):
    _, losses, params = gpt_run(False, epochs=1)
    engine, rc_losses, rc_params = gpt_run(["blocks.1.mlp"], epochs=1)
    assert max(abs(a - b) for a, b in zip(losses, rc_losses)) <= 1e-12
    assert all(np.max(np.abs(params[k] - rc_params[k])) <= 1e-12 for k in params)
    layers = {op.layer for op in engine.plan().program.ops if op.outputs[0].name.endswith(SUFFIX)}
    assert layers and all(layer.startswith("blocks.1.mlp") for layer in layers)


def test_bad_recompute_options_raise():
    with pytest.raises(dg.DistGraphError, match="layer paths"):
        dg.Strategy(recompute="blocks.0")
    dg.seed(0)
    engine = dg.Engine(dg.nn.GPT(32, 16, 2, 2, 8), dg.nn.CrossEntropyLoss(),
                       dg.optim.SGD(0.1), strategy=dg.Strategy(recompute=["blocks.7"]))
    with pytest.raises(dg.PlanError, match="no forward op of the model comes from layer "
                                           "'blocks.7'"):
        engine.fit(P.Tokens(), batch_size=4, verbose=0)
    engine = dg.Engine(dg.nn.Linear(8, 2), dg.nn.MSELoss(), dg.optim.SGD(0.1),
                       strategy=dg.Strategy(recompute=True))
    with pytest.raises(dg.PlanError, match="has no(ne)?.*TransformerBlock|TransformerBlock.*none"):
        engine.prepare([dg.InputSpec([4, 8], name="x")], [dg.InputSpec([4, 2], name="y")])


@pytest.mark.parametrize("plan", ["dp_tp", "two_stage"])
def test_distributed_recompute_equals_plain_and_serial(float64, plan):
    def engines(recompute, world):
        out = []
        for r in range(4):
            model = P.build_model("gpt")
            P.PLANS["gpt", plan, 4].annotate(model)
            out.append(P.prepare(dg.Engine(model, P.loss_fn("gpt"), P.make_optimizer("adamw"),
                                           strategy=dg.Strategy(recompute=recompute),
                                           communicator=world.communicator(r)), "gpt"))
        return out

    def train(engine):
        history = engine.fit(P.Dataset("gpt"), batch_size=P.BATCH, verbose=0)
        return history.losses, engine.state_dict()

    serial_losses, serial_params = P.serial_reference("gpt")
    results = {}
    for recompute in (False, True):
        world = SimulatedWorld(4, timeout=60)
        built = engines(recompute, world)
        results[recompute] = world.run(lambda comm: train(built[comm.rank]))
    for (losses, params), (rc_losses, rc_params) in zip(results[False], results[True]):
        assert max(abs(a - b) for a, b in zip(losses, rc_losses)) <= 1e-12
        assert all(np.max(np.abs(params[k] - rc_params[k])) <= 1e-12 for k in params)
        assert max(abs(a - b) for a, b in zip(rc_losses, serial_losses)) <= 1e-10
        assert all(np.max(np.abs(rc_params[k] - serial_params[k])) <= 1e-10 for k in params)


def selective_against_plain(attention=None) -> tuple:
    """(the plain run's engine, the selective run's program, its recomputed copies):
    both runs trained to the same losses and parameters (1e-12)."""
    plain, losses, params = gpt_run(False, attention=attention)
    engine, sel_losses, sel_params = gpt_run("selective", attention=attention)
    assert max(abs(a - b) for a, b in zip(losses, sel_losses)) <= 1e-12
    assert all(np.max(np.abs(params[k] - sel_params[k])) <= 1e-12 for k in params)
    program = engine.plan().program
    return plain, program, [op for op in program.ops if op.outputs[0].name.endswith(SUFFIX)]


def test_selective_recompute_copies_the_attention_scores_only(float64):
    """Strategy(recompute="selective"): each block's attention core, from q k^T through
    the mask, softmax and dropout, is recomputed (Korthikanti et al.); the losses and
    parameters are the plain run's, and it keeps fewer bytes than no recomputation and
    more than recomputing whole blocks."""
    plain, program, copies = selective_against_plain()
    assert sorted(op.type for op in copies if op.layer.startswith("blocks.0.")) == sorted(
        ["matmul", "scale", "causal_mask", "full", "where", "softmax", "dropout"])
    assert {op.layer.split(".")[1] for op in copies} == {"0", "1"}
    assert all(".attn" in op.layer for op in copies)
    whole = gpt_run(True, epochs=1)[0].plan().program
    assert peak_activation_bytes(whole) < peak_activation_bytes(program) < \
        peak_activation_bytes(plain.plan().program)


class FusedAttention(dg.nn.MultiHeadAttention):
    """The same attention with its scale, mask and softmax as Megatron's one fused
    kernel (``ops.scaled_masked_softmax``)."""

    def forward(self, x):
        b, t, d = x.shape
        h, hd = self.n_head, d // self.n_head
        q, k, v = (dg.ops.transpose(dg.ops.reshape(z, [b, t, h, hd]), [0, 2, 1, 3])
                   for z in dg.ops.split(self.qkv(x), 3, axis=-1))
        att = dg.ops.scaled_masked_softmax(dg.ops.matmul(q, k, transpose_y=True),
                                           1.0 / np.sqrt(hd))
        att = self.attn_drop(att)
        y = dg.ops.reshape(dg.ops.transpose(dg.ops.matmul(att, v), [0, 2, 1, 3]), [b, t, d])
        return self.resid_drop(self.proj(y))


def test_selective_recompute_finds_the_fused_softmax_kernel(float64):
    """An attention whose scale, mask and softmax are one fused kernel (as Megatron-LM
    runs it) has its core recomputed by Strategy(recompute="selective") too: from q k^T
    through the kernel and dropout; training equals the plain run."""
    plain, program, copies = selective_against_plain(FusedAttention)
    assert sorted(op.type for op in copies if op.layer.startswith("blocks.0.")) == sorted(
        ["matmul", "scaled_masked_softmax", "dropout"])
    assert peak_activation_bytes(program) < peak_activation_bytes(plain.plan().program)


def test_selective_recompute_needs_attention_scores():
    engine = dg.Engine(dg.nn.Linear(8, 2), dg.nn.MSELoss(), dg.optim.SGD(0.1),
                       strategy=dg.Strategy(recompute="selective"))
    with pytest.raises(dg.PlanError, match="recompute='selective'.*compute none"):
        engine.prepare([dg.InputSpec([4, 8], name="x")], [dg.InputSpec([4, 2], name="y")])
