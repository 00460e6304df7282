"""A LLaMA checkpoint made by transformers, loaded lazily and fine-tuned on several ranks,
trains as it does on one process (float64, 1e-10): 4 ranks data x tensor parallel
(Megatron's split of grouped-query attention, key/value heads split and copied), and 2
pipeline stages with micro-batches. Ranks are SimulatedWorld threads; every rank reads
only its blocks of the checkpoint."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402
from distgraph.runtime.comm.simulated import SimulatedWorld  # noqa: E402

import llama_cases as L  # noqa: E402
import plans as P  # noqa: E402

BATCH, SEQ, STEPS = 8, 8, 3


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    L.load_libraries()
    out = {}
    for name, kv in (("kv2", 2), ("kv1", 1)):
        model = L.hf_model("llama")
        if kv == 1:            # one key/value head: it does not divide over mp = 2
            config = model.config
            config.num_key_value_heads = 1
            model = L.transformers.LlamaForCausalLM(config).to(L.torch.float64)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        out[name] = folder
    return out


def _train(comm, folder, annotate, strategy):
    with P.BUILD_LOCK:
        model = dg.from_pretrained(folder, lazy=True)
        mesh = annotate(model)
    engine = dg.Engine(model, loss=dg.nn.CrossEntropyLoss(), optimizer=dg.optim.AdamW(1e-2),
                       strategy=strategy, communicator=comm)
    data = L.NextTokens(BATCH * STEPS, SEQ)
    if mesh is not None:
        data = dg.shard_dataloader(data, mesh, shard_dims="dp")
    with P.BUILD_LOCK:
        ins, labels = dg.app.data.DataLoader(data, BATCH).specs(1)
        engine.prepare(ins, labels)
    history = engine.fit(data, batch_size=BATCH, epochs=1, verbose=0)
    return history.losses, engine.state_dict()


def _dp_mp(model):
    mesh = dg.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    dg.nn.llama.megatron(model, mesh)
    return mesh


def _pipeline(model):
    first, second = dg.ProcessMesh([0], ["dp"]), dg.ProcessMesh([1], ["dp"])
    L.two_stages(model, first, second)
    return [first, second]          # the tokens on the first stage, the labels on the last


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["kv2", "kv1"])
@pytest.mark.parametrize("layout", ["dp_mp", "pipeline"])
def test_finetuning_on_several_ranks_equals_serial(float64, checkpoints, kv, layout):
    folder = checkpoints[kv]
    serial = _train(None, folder, lambda m: None, dg.Strategy())
    annotate, ranks, strategy = {
        "dp_mp": (_dp_mp, 4, dg.Strategy()),
        "pipeline": (_pipeline, 2, dg.Strategy(micro_batches=2, schedule="1F1B")),
    }[layout]
    results = SimulatedWorld(ranks, timeout=120).run(_train, folder, annotate, strategy)
    for losses, params in results:
        np.testing.assert_allclose(losses, serial[0], rtol=0, atol=1e-10)
        for name, value in serial[1].items():
            np.testing.assert_allclose(params[name], value, rtol=0, atol=1e-10, err_msg=name)


@pytest.mark.mpi
@pytest.mark.slow
def test_tutorial_08_finetunes_in_bfloat16_on_four_mpi_ranks_and_saves_back(tmp_path):
    """The tutorial on real ranks: a transformers checkpoint loaded lazily, dp x mp in
    bfloat16, saved back and read by transformers."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "distgraph.cli", "run", "-n", "4",
                           os.path.join(root, "tutorials", "08_llama_finetune.py"),
                           "--steps", "40", "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "made a tiny Llama checkpoint with transformers" in proc.stdout
    assert "fine-tuned in bfloat16 on 4 ranks" in proc.stdout
    assert "transformers loads it" in proc.stdout
    config = (tmp_path / "finetuned" / "config.json").read_text()
    assert '"model_type": "llama"' in config
