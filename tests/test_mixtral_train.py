"""A tiny Mixtral trains on several ranks as on one process (float64, 1e-10): experts
split over 2 and 4 ranks (each rank runs its experts on the tokens routed to them, the
outputs summed over the expert ranks), experts split over the data-parallel dim, experts
x Megatron's tensor parallelism inside each expert, with the load-balancing loss and with
a GShard capacity (against a serial run with the same capacity); and routings where one
rank's experts get no token and all tokens go to one rank. Ranks are SimulatedWorld
threads.

With the experts split over the dp dim the rule of ``moe_ffn`` cannot split both the
tokens and the experts over one mesh dim: the plan all-gathers the tokens and
all-reduces the experts' Partial outputs (correct, not yet the all-to-all dispatch)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402
from distgraph.nn.mixtral import Mixtral, MixtralConfig, expert_parallel, megatron  # noqa: E402
from distgraph.runtime.comm.simulated import SimulatedWorld  # noqa: E402

import plans as P  # noqa: E402

BATCH, SEQ, STEPS, VOCAB = 4, 6, 2, 32
CONFIG = MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=8,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       num_local_experts=4, num_experts_per_tok=2, initializer_range=0.2,
                       output_router_logits=True, router_aux_loss_coef=0.01)


class NextTokens:
    def __init__(self, n: int, seq: int, seed: int = 0):
        self.ids = np.random.default_rng(seed).integers(0, VOCAB, (n, seq + 1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return self.ids[i, :-1], self.ids[i, 1:]


def _model(config, skew):
    dg.seed(7)
    model = Mixtral(config)
    if skew:        # a zero router: equal probabilities, every token picks experts 0 and 1
        for layer in model.layers:
            layer.mlp.gate.weight.set_value(np.zeros(layer.mlp.gate.weight.shape))
    return model


def _train(comm, config, annotate, skew=False):
    with P.BUILD_LOCK:
        model = _model(config, skew)
        mesh = annotate(model)
    engine = dg.Engine(model, loss=dg.nn.CrossEntropyLoss(), optimizer=dg.optim.AdamW(1e-2),
                       communicator=comm)
    data = NextTokens(BATCH * STEPS, SEQ)
    if mesh is not None and "dp" in mesh.dim_names:
        data = dg.shard_dataloader(data, mesh, shard_dims="dp")
    with P.BUILD_LOCK:
        ins, labels = dg.app.data.DataLoader(data, BATCH).specs(1)
        engine.prepare(ins, labels)
    history = engine.fit(data, batch_size=BATCH, epochs=1, verbose=0)
    return history.losses, engine.state_dict()


def _ep(n):
    def annotate(model):
        mesh = dg.ProcessMesh(list(range(n)), ["ep"])
        expert_parallel(model, mesh)
        return mesh
    return annotate


def _ep_dp(model):
    mesh = dg.ProcessMesh([0, 1], ["dp"])
    expert_parallel(model, mesh, "dp")
    return mesh


def _ep_mp(model):
    mesh = dg.ProcessMesh([[0, 1], [2, 3]], ["ep", "mp"])
    expert_parallel(model, mesh)
    megatron(model, mesh)
    return mesh


LAYOUTS = {"ep2": (_ep(2), 2), "ep4": (_ep(4), 4), "ep_dp": (_ep_dp, 2), "ep_mp": (_ep_mp, 4)}


def _equal(results, serial):
    for losses, params in results:
        np.testing.assert_allclose(losses, serial[0], rtol=0, atol=1e-10)
        for name, value in serial[1].items():
            np.testing.assert_allclose(params[name], value, rtol=0, atol=1e-10, err_msg=name)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_expert_parallel_training_equals_serial(float64, layout):
    annotate, ranks = LAYOUTS[layout]
    serial = _train(None, CONFIG, lambda m: None)
    _equal(SimulatedWorld(ranks, timeout=120).run(_train, CONFIG, annotate), serial)


def test_a_capacity_drops_the_same_tokens_as_serial(float64):
    config = CONFIG.replace(capacity_factor=0.5)
    serial = _train(None, config, lambda m: None)
    dropless = _train(None, CONFIG, lambda m: None)
    assert not np.allclose(serial[0], dropless[0])            # some assignments dropped
    _equal(SimulatedWorld(2, timeout=120).run(_train, config, _ep_dp), serial)


@pytest.mark.parametrize("layout", ["ep2", "ep_dp"])
def test_all_tokens_on_one_ranks_experts_runs(float64, layout):
    """A zero router sends every token to experts 0 and 1: rank 0 holds them, rank 1's
    experts get no token."""
    annotate, ranks = LAYOUTS[layout]
    serial = _train(None, CONFIG, lambda m: None, True)
    _equal(SimulatedWorld(ranks, timeout=120).run(_train, CONFIG, annotate, True), serial)
