"""LLaMA-family models from and to Hugging Face checkpoints, against transformers (float64).

A tiny random model of each config (Llama with GQA 4:2 and rope_theta 500000, tied and
untied; Llama 3's scaled rope; Mistral with a sliding window shorter than the sequence;
Qwen2 with its attention biases) is made and saved by transformers;
``dg.from_pretrained`` of that folder gives logits equal to transformers' (1e-10) and
gradients of the mean next-token cross-entropy equal to torch's (1e-9 relative). What
distgraph writes back with ``save_pretrained`` (one file or shards with an index, float32
or bfloat16) transformers loads and computes the same logits with. Configs distgraph
cannot honour are one error naming the field. The oracle is described in llama_cases.py.
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
from distgraph.app.pretrained import (CheckpointTensor, PretrainedError, from_pretrained,  # noqa: E402
                                      hf_name, save_pretrained)
from distgraph.ops.transformer import rope_frequencies  # noqa: E402
from distgraph.runtime.execution.executor import ProgramRunner  # noqa: E402

import llama_cases as L  # noqa: E402

L.load_libraries()
torch = L.torch


class _WithLoss(dg.nn.Layer):
    """The model and its training loss: the mean cross-entropy of its logits against
    ``labels``, plus its auxiliary loss when it has one (as build_program adds it)."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.loss = dg.nn.CrossEntropyLoss()

    def forward(self, tokens, labels):
        loss = self.loss(self.model(tokens), labels)
        aux = getattr(self.model, "auxiliary_loss", lambda: None)()
        return loss if aux is None else dg.ops.add(loss, aux)


def run_with_grads(model, ids: np.ndarray) -> tuple:
    """(logits, loss, {distgraph parameter name: gradient}) of ``model`` on ``ids``, the
    loss over next tokens (the last position ignored), run serially."""
    labels = np.concatenate([ids[:, 1:], np.full((ids.shape[0], 1), -100)], axis=1)
    wrapped = _WithLoss(model)
    prog = dg.trace(wrapped, dg.InputSpec(ids.shape, "int64", "tokens"),
                    dg.InputSpec(ids.shape, "int64", "labels"))
    logits_name = next(op.inputs[0].name for op in prog.ops
                       if op.type == "softmax_cross_entropy")
    loss = prog.outputs[0]
    grads = dg.append_backward(prog, loss)
    scope = {n: p.numpy() for n, p in wrapped.named_parameters()}
    out = ProgramRunner(prog).run(scope, {"tokens": ids, "labels": labels},
                                  [logits_name, loss.name] + [g.name for g in grads.values()])
    return (out[logits_name], float(out[loss.name]),
            {name.removeprefix("model."): out[g.name] for name, g in grads.items()})


def dg_logits_and_grads(model, ids: np.ndarray) -> tuple:
    """(logits, loss, {transformers name: gradient in transformers' layout}) of a
    distgraph model on ``ids`` (:func:`run_with_grads`)."""
    logits, loss, grads = run_with_grads(model, ids)
    linear = _linear_weights(model)
    return logits, loss, {hf_name(name): g.T if name in linear else g
                          for name, g in grads.items()}


def _linear_weights(model) -> set:
    return {f"{path}.weight" for path, layer in model.named_sublayers()
            if isinstance(layer, dg.nn.Linear)}



@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{config name: (transformers model, its saved folder)}."""
    out = {}
    for name in L.CONFIGS:
        model = L.hf_model(name)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        out[name] = (model, folder)
    return out


@pytest.mark.parametrize("name", sorted(L.CONFIGS))
def test_logits_and_gradients_equal_transformers(float64, saved, name):
    hf, folder = saved[name]
    model = dg.from_pretrained(folder)
    ids = L.tokens(seq=12)
    ref_logits, ref_loss, ref_grads = L.logits_and_grads(hf, ids)
    logits, loss, grads = dg_logits_and_grads(model, ids)
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=1e-10)
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    hf_names = {n for n, _ in hf.named_parameters()}
    assert set(grads) == hf_names            # tied: one embedding, both uses summed
    for key, ref in ref_grads.items():
        scale = max(float(np.max(np.abs(ref))), 1e-300)
        assert np.max(np.abs(grads[key] - ref)) / scale < 1e-9, key


def test_the_configs_read_as_their_architecture(saved):
    configs = {name: from_pretrained(folder, lazy=True).config
               for name, (_, folder) in saved.items()}
    assert configs["llama"].num_key_value_heads == 2 and configs["llama"].rope_theta == 500000
    assert configs["llama-tied"].tie_word_embeddings and not configs["llama"].tie_word_embeddings
    assert configs["llama3-scaled"].rope_scaling["rope_type"] == "llama3"
    assert configs["mistral"].sliding_window == 5 and not configs["mistral"].attention_bias
    assert configs["qwen2"].attention_bias and not configs["qwen2"].o_proj_bias
    tied = dict(from_pretrained(saved["llama-tied"][1], lazy=True).named_parameters())
    assert "lm_head.weight" not in tied


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0},
                                     L.LLAMA3_SCALING], ids=["default", "linear", "llama3"])
def test_rope_frequencies_equal_transformers(scaling):
    """Ours in float64 against transformers' own rope init (float32)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = L.transformers.LlamaConfig(**L.TINY, rope_theta=500000.0, rope_scaling=scaling)
    head_dim = L.TINY["hidden_size"] // L.TINY["num_attention_heads"]
    if scaling is None:
        ref = L.transformers.models.llama.modeling_llama.LlamaRotaryEmbedding\
            .compute_default_rope_parameters(config)[0]
    else:
        ref = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")[0]
    mine = rope_frequencies(head_dim, 500000.0, tuple(sorted((scaling or {}).items())))
    np.testing.assert_allclose(mine, ref.double().numpy(), rtol=2e-6)


def test_a_lazy_model_reads_only_the_blocks_asked_for(float64, saved):
    _, folder = saved["llama"]
    lazy = from_pretrained(folder, lazy=True)
    eager = dict(from_pretrained(folder).named_parameters())
    for name, p in lazy.named_parameters():
        assert p.is_lazy and isinstance(p.init, CheckpointTensor)
        index = tuple(slice(n // 2, n) for n in p.shape)
        np.testing.assert_array_equal(p.block(index), eager[name].numpy()[index])


@pytest.mark.parametrize("shard, dtype", [("5GB", "float32"), ("8KB", "float32"),
                                          ("5GB", "bfloat16")])
def test_save_pretrained_loads_in_transformers_with_the_same_logits(float64, saved, tmp_path,
                                                                     shard, dtype):
    _, folder = saved["llama"]
    model = dg.from_pretrained(folder)
    rng = np.random.default_rng(1)
    for _, p in model.named_parameters():           # weights that were "trained"
        p.set_value(p.numpy() + 0.01 * rng.standard_normal(p.shape))
    save_pretrained(model, tmp_path, dtype=dtype, max_shard_size=shard)
    files = sorted(os.listdir(tmp_path))
    if shard == "8KB":
        assert "model.safetensors.index.json" in files and len(
            [f for f in files if f.startswith("model-")]) > 1
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == {hf_name(n) for n, _ in model.named_parameters()}
    else:
        assert "model.safetensors" in files
    assert not [f for f in files if f.startswith(".")]       # no temporary left
    back = L.transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float64, attn_implementation="eager").eval()
    L._float64_rotary(back)
    # what was written is the trained weights, rounded to the checkpoint's dtype ...
    again = dg.from_pretrained(tmp_path)
    for name, p in again.named_parameters():
        want = dict(model.named_parameters())[name].numpy().astype(
            "float32" if dtype == "float32" else L.np_bfloat16()).astype("float64")
        np.testing.assert_array_equal(p.numpy(), want)
    # ... and transformers computes with them what distgraph computes
    ids = L.tokens(seq=10, seed=3)
    ref, _, _ = dg_logits_and_grads(again, ids)
    got = back(input_ids=torch.tensor(ids)).logits.detach().numpy()
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-10)
    if dtype == "bfloat16":
        assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize("change, field", [
    (dict(model_type="gpt2"), "model_type"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_parameters={"rope_theta": 1e4, "rope_type": "yarn", "factor": 4.0}), "yarn"),
    (dict(model_type="qwen2", use_sliding_window=True), "use_sliding_window"),
])
def test_a_config_it_cannot_honour_is_one_error_naming_the_field(saved, tmp_path, change,
                                                                 field):
    _, folder = saved["llama"]
    raw = json.loads((folder / "config.json").read_text())
    raw.update(change)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(PretrainedError, match=field):
        from_pretrained(tmp_path)


def test_a_folder_without_weights_or_with_other_shapes_says_so(saved, tmp_path):
    _, folder = saved["llama"]
    raw = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(PretrainedError, match="neither model.safetensors"):
        from_pretrained(tmp_path)
    raw["intermediate_size"] = 40
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(raw))
    os.link(folder / "model.safetensors", other / "model.safetensors")
    with pytest.raises(PretrainedError, match="mlp.gate_proj.weight has shape"):
        from_pretrained(other)
