"""Mixtral from and to transformers checkpoints, against transformers (float64).

A tiny random ``MixtralForCausalLM`` (8 experts, top-2, grouped-query attention 4:2) is
made and saved by transformers; ``dg.from_pretrained`` of that folder, in the stacked
expert layout transformers writes now and in the earlier one with a tensor per expert,
gives logits equal to transformers' (1e-10) and gradients of the mean next-token
cross-entropy, with and without the router's load-balancing loss, equal to torch's
(1e-9 relative). What ``save_pretrained`` writes back transformers loads and computes
the same logits with. The oracle is described in mixtral_cases.py.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402
from distgraph.app.pretrained import (ExpertTensor, PretrainedError, hf_name,  # noqa: E402
                                      save_pretrained)
from distgraph.nn.mixtral import Mixtral  # noqa: E402

import llama_cases as L  # noqa: E402
import mixtral_cases as M  # noqa: E402
from test_llama import dg_logits_and_grads, run_with_grads  # noqa: E402

L.load_libraries()
torch = L.torch


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(transformers model, its folder, the same weights in the earlier layout)."""
    model = M.hf_mixtral()
    folder = tmp_path_factory.mktemp("mixtral")
    model.save_pretrained(folder)
    old = tmp_path_factory.mktemp("mixtral-legacy")
    M.legacy(folder, old)
    return model, folder, old


@pytest.mark.parametrize("aux", [False, True], ids=["ce", "ce+aux"])
@pytest.mark.parametrize("layout", ["stacked", "legacy"])
def test_logits_and_gradients_equal_transformers(float64, saved, layout, aux):
    hf, folder, old = saved
    model = dg.from_pretrained(folder if layout == "stacked" else old)
    assert isinstance(model, Mixtral)
    model.config = model.config.replace(output_router_logits=aux)
    for layer in model.layers:          # the config asks for the load-balancing loss
        layer.mlp.config = model.config
    ids = L.tokens(seq=12)
    ref_logits, ref_loss, ref_grads = M.logits_and_grads(hf, ids, aux)
    logits, loss, grads = _logits_and_grads(model, ids)
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=1e-10)
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    assert set(grads) == set(ref_grads)
    for key, ref in ref_grads.items():
        scale = max(float(np.max(np.abs(ref))), 1e-300)
        assert np.max(np.abs(grads[key] - ref)) / scale < 1e-9, key


def _logits_and_grads(model, ids):
    """(logits, loss, {transformers name: gradient in transformers' layout}); the
    experts' gate and up gradients joined in one gate_up_proj."""
    logits, loss, mine = run_with_grads(model, ids)
    linear = {f"{path}.weight" for path, layer in model.named_sublayers()
              if isinstance(layer, dg.nn.Linear)}
    theirs = {}
    for name, g in mine.items():
        if name.endswith("experts.up_proj"):
            continue
        if name.endswith("experts.gate_proj"):
            up = mine[name.removesuffix("gate_proj") + "up_proj"]
            g = np.concatenate([g.transpose(0, 2, 1), up.transpose(0, 2, 1)], axis=1)
        elif name.endswith("experts.down_proj"):
            g = g.transpose(0, 2, 1)
        elif name in linear:
            g = g.T
        theirs[hf_name(name)] = g
    return logits, loss, theirs


def test_the_config_reads_as_mixtral(saved):
    _, folder, _ = saved
    c = dg.from_pretrained(folder, lazy=True).config
    assert (c.num_local_experts, c.num_experts_per_tok, c.num_key_value_heads) == (8, 2, 2)
    assert c.router_aux_loss_coef == pytest.approx(0.001) and c.capacity_factor is None


def test_a_lazy_model_reads_only_the_expert_blocks_asked_for(float64, saved):
    _, folder, old = saved
    eager = dict(dg.from_pretrained(folder).named_parameters())
    for source in (folder, old):
        for name, p in dg.from_pretrained(source, lazy=True).named_parameters():
            index = tuple(slice(n // 2, n) for n in p.shape)
            if "experts" in name:
                assert isinstance(p.init, ExpertTensor)
                index = (slice(2, 6),) + index[1:]
            np.testing.assert_array_equal(p.block(index), eager[name].numpy()[index])


def test_save_pretrained_loads_in_transformers_with_the_same_logits(float64, saved, tmp_path):
    _, _, old = saved
    model = dg.from_pretrained(old)
    rng = np.random.default_rng(1)
    for _, p in model.named_parameters():           # weights that were "trained"
        p.set_value(p.numpy() + 0.01 * rng.standard_normal(p.shape))
    save_pretrained(model, tmp_path, dtype="float64")
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "mixtral" and raw["num_local_experts"] == 8
    back = L.transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float64, attn_implementation="eager",
        experts_implementation="eager").eval()
    L._float64_rotary(back)
    for layer in back.model.layers:
        layer.mlp.gate.forward = M._router_forward.__get__(layer.mlp.gate)
    ids = L.tokens(seq=10, seed=3)
    ref, _, _ = dg_logits_and_grads(model, ids)
    got = back(input_ids=torch.tensor(ids)).logits.detach().numpy()
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-10)


def test_balance_loss_is_transformers(saved):
    """The oracle's float64 load-balancing loss is transformers' formula."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    hf, _, _ = saved
    out = hf(input_ids=torch.tensor(L.tokens(seq=12)), output_router_logits=True)
    ours = M.balance_loss(out.router_logits, 8, 2)
    ref = load_balancing_loss_func(out.router_logits, 8, 2)
    assert float(ours.detach()) == pytest.approx(float(ref.detach()), rel=1e-6)


def test_router_jitter_is_one_error_naming_the_field(saved, tmp_path):
    _, folder, _ = saved
    raw = json.loads((folder / "config.json").read_text())
    raw["router_jitter_noise"] = 0.1
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(PretrainedError, match="router_jitter_noise"):
        dg.from_pretrained(tmp_path)
