"""Datasets whose samples are dicts (a Hugging Face ``datasets.Dataset``, numpy-formatted
or not, a list of dicts): ``input_keys`` names the fields to feed, in order, given to
``fit`` / ``evaluate`` / ``predict`` or to ``dg.shard_dataloader`` (Paddle's place).
Oracles: the same samples as tuples (training, evaluation and prediction equal), serial
training (2 MPI ranks through shard_dataloader, float64 to 1e-10), and the uninterrupted
run (a run resumed from a checkpoint inside an epoch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import distgraph as dg

SCRIPTS = Path(__file__).parent / "mpi_scripts"
sys.path.insert(0, str(SCRIPTS))
sys.path.insert(0, str(Path(__file__).parent))
import hf_rows  # noqa: E402
from plans import StopAndSave  # noqa: E402

KEYS = ["input_ids", "labels"]
FIT = dict(batch_size=4, epochs=2, shuffle=True, verbose=0)


def token_rows(n=12, seq=8, vocab=32):
    """``n`` rows {"input_ids", "labels" (the next tokens), "text"} as numpy arrays."""
    t = np.random.default_rng(0).integers(0, vocab, size=(n, seq + 1))
    return [{"text": f"row {i}", "input_ids": t[i, :-1], "labels": t[i, 1:]} for i in range(n)]


def as_tuples(rows):
    return [(r["input_ids"], r["labels"]) for r in rows]


def hf(rows, numpy_format: bool):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list([{k: v.tolist() if isinstance(v, np.ndarray) else v
                                      for k, v in r.items()} for r in rows])
    return ds.with_format("numpy") if numpy_format else ds


DICT_DATASETS = {
    "list of dicts": lambda rows: rows,
    "datasets.Dataset": lambda rows: hf(rows, False),          # lists come back
    "datasets.Dataset numpy": lambda rows: hf(rows, True),
}


def engine(seed=0):
    dg.seed(seed)
    model = dg.nn.GPT(vocab_size=32, d_model=16, n_layer=1, n_head=2, max_seq_len=8,
                      dropout=0.1)
    return dg.Engine(model, dg.nn.CrossEntropyLoss(), dg.optim.AdamW(1e-2))


def session(data, valid, **keys) -> tuple:
    e = engine()
    history = e.fit(data, valid_data=valid, **FIT, **keys)
    return (history.losses, [r["val_loss"] for r in history.epochs], e.state_dict(),
            e.evaluate(valid, batch_size=4, verbose=0, **keys),
            [out[0] for out in e.predict(valid, batch_size=4, **keys)])


@pytest.mark.parametrize("kind", DICT_DATASETS)
def test_dict_rows_train_evaluate_and_predict_as_the_same_samples_as_tuples(kind, float64):
    make = DICT_DATASETS[kind]
    losses, val, params, evaluated, predicted = session(as_tuples(token_rows()),
                                                        as_tuples(token_rows(8)))
    got = session(make(token_rows()), make(token_rows(8)), input_keys=KEYS)
    assert got[0] == losses and got[1] == val and got[3] == evaluated
    for name, value in params.items():
        np.testing.assert_array_equal(got[2][name], value, err_msg=name)
    for a, b in zip(got[4], predicted):
        np.testing.assert_array_equal(a, b)


def test_shard_dataloader_keeps_the_input_keys_and_fit_reads_valid_data_with_them(float64):
    """Plain dict rows as valid_data of a fit on a shard_dataloader of input_keys."""
    mesh = dg.ProcessMesh([0], dim_names=["dp"])
    rows = dg.shard_dataloader(token_rows(), mesh, "dp", input_keys=KEYS)
    assert "input_keys=['input_ids', 'labels']" in repr(rows)
    x, y = rows[3]
    np.testing.assert_array_equal(x, token_rows()[3]["input_ids"])
    np.testing.assert_array_equal(y, token_rows()[3]["labels"])
    got = engine().fit(rows, valid_data=token_rows(8), **FIT)
    want = engine().fit(as_tuples(token_rows()), valid_data=as_tuples(token_rows(8)), **FIT)
    assert got.losses == want.losses and got.epochs == want.epochs


@pytest.mark.parametrize("kind", ["list of dicts", "datasets.Dataset"])
def test_a_dict_row_without_input_keys_names_its_keys_and_the_fix(kind):
    data = DICT_DATASETS[kind](token_rows())
    with pytest.raises(dg.DistGraphError) as info:
        engine().fit(data, batch_size=4, verbose=0)
    assert str(info.value) == (
        "dataset sample 0 is a dict (keys 'text', 'input_ids', 'labels'); say which keys to "
        "feed, in order: the model's inputs as its forward takes them, then the label: "
        "dg.shard_dataloader(data, mesh, \"dp\", input_keys=[...]) or engine.fit(data, "
        "input_keys=[...]) (evaluate and predict take input_keys too)")


MESH = dg.ProcessMesh([0], dim_names=["dp"])


@pytest.mark.parametrize("data, keys, words", [
    (token_rows(), ["input_ids", "label"], "input_keys ['input_ids', 'label']: dataset "
     "sample 0 has no 'label' (its keys: 'text', 'input_ids', 'labels')"),
    (as_tuples(token_rows()), KEYS, "input_keys ['input_ids', 'labels'] name the fields of "
     "dict samples, but dataset sample 0 is a tuple: its fields are fed in their order; "
     "leave input_keys out"),
    (token_rows(), "input_ids labels", "Engine.fit: input_keys='input_ids labels'; give a "
     "list of the dict keys"),
    (token_rows(), ["labels", "labels"], "Engine.fit: input_keys=['labels', 'labels']"),
    (dg.shard_dataloader(token_rows(), MESH, "dp", input_keys=KEYS), ["labels", "input_ids"],
     "input_keys ['labels', 'input_ids'] given, but the shard_dataloader names ['input_ids', "
     "'labels']: give them once"),
    (token_rows(), ["input_ids", "labels", "text"], "dataset samples have 3 field(s) (the "
     "last is the label), so the model gets 2 input(s), but GPT.forward(idx) takes 1"),
])
def test_input_keys_mistakes_say_what_to_give(data, keys, words):
    with pytest.raises(dg.DistGraphError) as info:
        engine().fit(data, batch_size=4, verbose=0, input_keys=keys)
    assert words in str(info.value)


def test_shard_dataloader_refuses_input_keys_that_are_not_names():
    with pytest.raises(dg.DistGraphError, match=r"shard_dataloader: input_keys=\[0, 1\]; "
                       r"give a list of the dict keys"):
        dg.shard_dataloader(token_rows(), MESH, "dp", input_keys=[0, 1])


@pytest.mark.parametrize("kind", ["list of dicts", "datasets.Dataset numpy"])
def test_a_fit_stopped_inside_an_epoch_resumes_exactly_from_its_checkpoint(kind, tmp_path,
                                                                          float64):
    data = DICT_DATASETS[kind](token_rows())
    full = engine().fit(data, input_keys=KEYS, **FIT).losses
    engine().fit(data, input_keys=KEYS, callbacks=[StopAndSave(tmp_path / "ckpt", 4)], **FIT)
    resumed = engine(seed=1)             # other weights and dropout seeds, replaced by load
    resumed.load(tmp_path / "ckpt")
    history = resumed.fit(data, input_keys=KEYS, **FIT)
    assert history.steps == [4, 5] and history.losses == full[4:]
    other = engine(seed=1)
    other.load(tmp_path / "ckpt")
    with pytest.raises(dg.DistGraphError, match=r"input_keys=\['labels', 'input_ids'\] \(the "
                       r"checkpoint: \['input_ids', 'labels'\]\)"):
        other.fit(data, input_keys=["labels", "input_ids"], **FIT)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """hf_rows.py on 2 MPI ranks: {rank: its printed results}, and its folder."""
    pytest.importorskip("datasets")
    folder = tmp_path_factory.mktemp("hf_rows")
    proc = subprocess.run([sys.executable, "-m", "distgraph.cli", "run", "-n", "2",
                           str(SCRIPTS / "hf_rows.py"), str(folder)], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines()
               if line.startswith("HF-ROWS ")]
    return {r["rank"]: r for r in results}, folder


@pytest.mark.mpi
def test_a_hugging_face_dataset_trains_on_two_ranks_as_serially(two_ranks, float64):
    ranks, folder = two_ranks
    serial = hf_rows.engine(0)
    losses = serial.fit(hf_rows.rows(), input_keys=hf_rows.KEYS, **hf_rows.FIT).losses
    params = serial.state_dict()
    assert sorted(ranks) == [0, 1]
    for r in ranks.values():
        np.testing.assert_allclose(r["losses"], losses, rtol=0, atol=1e-10)
    with np.load(folder / "full.npz") as saved:
        assert sorted(saved.files) == sorted(params)
        for name, value in params.items():
            np.testing.assert_allclose(saved[name], value, rtol=0, atol=1e-10, err_msg=name)


@pytest.mark.mpi
def test_a_hugging_face_dataset_on_two_ranks_resumes_exactly_after_load(two_ranks):
    ranks, _ = two_ranks
    for r in ranks.values():
        stop = hf_rows.STOP_AFTER
        assert r["resumed_steps"] == r["steps"][stop:] and len(r["resumed"]) > 0
        np.testing.assert_allclose(r["resumed"], r["losses"][stop:], rtol=0, atol=1e-10)
