"""``Engine.predict`` on the samples ``fit`` takes, before any fit: a trailing label the
model's forward does not take is dropped (Keras' predict of (x, y)), and ``out[b][0]``
is batch ``b``'s logits. Oracles: the plain-numpy GPT (``reference_gpt.gpt_forward``) on
the same parameters, float64 to 1e-10, serially and on 2 data-parallel ranks."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import distgraph as dg
from distgraph.runtime.comm.simulated import SimulatedWorld

sys.path.insert(0, str(Path(__file__).parent))
from plans import BUILD_LOCK  # noqa: E402
from reference_gpt import gpt_forward  # noqa: E402

SEQ, VOCAB, HEADS = 8, 32, 2


def tokens(n=10):
    t = np.random.default_rng(0).integers(0, VOCAB, size=(n, SEQ + 1))
    return [(t[i, :-1], t[i, 1:]) for i in range(n)]


def gpt():
    with BUILD_LOCK:          # simulated ranks share dg.seed's generator
        dg.seed(0)
        return dg.nn.GPT(vocab_size=VOCAB, d_model=16, n_layer=2, n_head=HEADS, max_seq_len=SEQ)


def reference(model, samples):
    params = {n: p.numpy() for n, p in model.named_parameters()}
    return gpt_forward(params, np.stack([x for x, _ in samples]), HEADS)


def test_predict_before_fit_drops_the_label_and_gives_each_batchs_logits(float64):
    model = gpt()
    engine = dg.Engine(model)                   # no loss, no optimizer: prediction only
    out = engine.predict(tokens(), batch_size=4)
    assert [len(batch) for batch in out] == [1, 1, 1]          # one output: the logits
    assert [batch[0].shape for batch in out] == [(4, SEQ, VOCAB), (4, SEQ, VOCAB),
                                                 (2, SEQ, VOCAB)]
    np.testing.assert_allclose(np.concatenate([b[0] for b in out]), reference(model, tokens()),
                               rtol=0, atol=1e-10)
    bare = engine.predict([x for x, _ in tokens()], batch_size=4)
    for a, b in zip(out, bare):
        np.testing.assert_array_equal(a[0], b[0])


def test_predict_of_dict_rows_drops_the_label_key_too(float64):
    model = gpt()
    rows = [{"input_ids": x, "labels": y} for x, y in tokens()]
    out = dg.Engine(model).predict(rows, batch_size=5, input_keys=["input_ids", "labels"])
    np.testing.assert_allclose(np.concatenate([b[0] for b in out]), reference(model, tokens()),
                               rtol=0, atol=1e-10)


def test_predict_on_two_data_parallel_ranks_before_fit_equals_the_reference(float64):
    mesh = dg.ProcessMesh([0, 1], dim_names=["dp"])
    model = gpt()
    expected = reference(model, tokens(8))

    def rank(comm):
        engine = dg.Engine(gpt(), communicator=comm)
        return engine.predict(dg.shard_dataloader(tokens(8), mesh, "dp"), batch_size=4)

    for out in SimulatedWorld(2, timeout=60).run(rank):
        np.testing.assert_allclose(np.concatenate([b[0] for b in out]), expected, rtol=0,
                                   atol=1e-10)


class TwoInputs(dg.nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc = dg.nn.Linear(3, 2)

    def forward(self, x, scale):
        return self.fc(x * scale)


def test_a_forward_of_two_inputs_keeps_two_fields_and_drops_the_third(float64):
    rng = np.random.default_rng(1)
    x, scale, y = rng.normal(size=(6, 3)), rng.normal(size=(6, 3)), rng.normal(size=(6, 2))
    dg.seed(0)
    model = TwoInputs()
    (out,) = dg.Engine(model).predict(list(zip(x, scale, y)), batch_size=6)[0]
    w, b = model.fc.weight.numpy(), model.fc.bias.numpy()
    np.testing.assert_allclose(out, (x * scale) @ w + b, rtol=0, atol=1e-12)
    with pytest.raises(dg.DistGraphError, match=r"so the model gets 3 input\(s\), but "
                       r"TwoInputs.forward\(x, scale\) takes 2"):
        dg.Engine(model).predict([(a, a, a, a) for a in x], batch_size=6)
