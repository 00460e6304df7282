"""``dg.callbacks.TensorBoard``: rank 0 writes TensorBoard's event files, read back here
with TensorBoard's own ``EventAccumulator``. Oracles: ``History`` (every step's loss and
the epochs' means, as float32, which TensorBoard's scalars are), the plan
(``explain()``, ``estimate.step_time``, under a tag that says "uncalibrated" where the
plan's cluster gives default figures), each rank's ``History.memory``, the batch's shape (tokens per second over
samples per second is the sequence length), and the files in the folder (one writer:
rank 0's)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import distgraph as dg

SCRIPTS = Path(__file__).parent / "mpi_scripts"


@pytest.fixture
def tensorboard():
    """Skips a test that writes event files where the package is not installed."""
    return pytest.importorskip("tensorboard")


def read_events(folder) -> dict:
    """{tag: [(step, value)]} of every event file in ``folder`` (every point kept): the
    scalars as the accumulator's ``Scalars()`` reads them (as every reader of scalars
    does), the text as its ``Tensors()``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(folder), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        out[tag] = [(e.step, e.value) for e in acc.Scalars(tag)]
    for tag in acc.Tags()["tensors"]:
        values = [(e.step, tensor_util.make_ndarray(e.tensor_proto).item())
                  for e in acc.Tensors(tag)]
        # only text is a tensor: a number written as one is unreadable as a scalar
        assert all(isinstance(v, bytes) for _, v in values), (tag, values[:3])
        out[tag] = values
    return out


def as_float32(values) -> list:
    return [float(np.float32(v)) for v in values]


def tokens(n=12, seq=8, vocab=32):
    t = np.random.default_rng(0).integers(0, vocab, size=(n, seq + 1))
    return [(t[i, :-1], t[i, 1:]) for i in range(n)]


def gpt_engine(**kw):
    dg.seed(0)
    model = dg.nn.GPT(vocab_size=32, d_model=16, n_layer=1, n_head=2, max_seq_len=8)
    lr = dg.optim.lr.LinearWarmup(dg.optim.lr.CosineDecay(1e-2, decay_steps=6), 2)
    return dg.Engine(model, dg.nn.CrossEntropyLoss(), dg.optim.AdamW(lr), **kw)


def test_one_process_logs_every_step_of_history_and_the_plan(tmp_path, float64, tensorboard):
    engine = gpt_engine(cluster=dg.Cluster.local(1))
    history = engine.fit(tokens(), batch_size=4, epochs=2, valid_data=tokens(8), verbose=0,
                         callbacks=[dg.callbacks.TensorBoard(tmp_path / "tb")])
    events = read_events(tmp_path / "tb")
    assert len(history.losses) == 6
    assert events["train/loss"] == list(zip(history.steps, as_float32(history.losses)))
    lrs = [engine.optimizer.lr_at(s) for s in history.steps]
    assert events["train/lr"] == list(zip(history.steps, as_float32(lrs)))
    assert [v for _, v in events["epoch/loss"]] == as_float32(e["loss"] for e in history.epochs)
    assert [v for _, v in events["epoch/val_loss"]] == \
        as_float32(e["val_loss"] for e in history.epochs)
    predicted = engine.plan().estimate.step_time
    # Cluster.local(1)'s default figures: the predicted step says it is uncalibrated
    assert events["step_time/predicted_uncalibrated"] == [(s, float(np.float32(predicted)))
                                                          for s in history.steps]
    assert "step_time/predicted" not in events
    measured = [v for _, v in events["step_time/measured"]]
    assert len(measured) == 6 and all(v > 0 for v in measured)
    # the same measured step: tokens/s over samples/s is a sample's tokens (its sequence)
    ratios = [t / s for (_, t), (_, s) in zip(events["throughput/tokens_per_second"],
                                              events["throughput/samples_per_second"])]
    np.testing.assert_allclose(ratios, 8, rtol=1e-6)
    ((step, text),) = events["plan/explain"]
    assert step == 0 and engine.plan().explain() in text.decode()
    assert events["memory/rank0"] == list(zip(history.steps, as_float32(history.memory)))
    assert events["memory/max"] == events["memory/rank0"] and "memory/rank1" not in events


def test_a_plan_on_measured_figures_logs_its_predicted_step_under_the_plain_tag(
        tmp_path, float64, tensorboard):
    measured = dataclasses.replace(dg.Cluster.local(1), figures="measured")
    engine = gpt_engine(cluster=measured)
    history = engine.fit(tokens(), batch_size=4, epochs=1, verbose=0,
                         callbacks=[dg.callbacks.TensorBoard(tmp_path)])
    events = read_events(tmp_path)
    predicted = float(np.float32(engine.plan().estimate.step_time))
    assert events["step_time/predicted"] == [(s, predicted) for s in history.steps]
    assert "step_time/predicted_uncalibrated" not in events


def test_a_second_fit_goes_on_from_the_global_step_in_a_file_of_its_own(tmp_path, tensorboard):
    engine = gpt_engine()
    board = dg.callbacks.TensorBoard(tmp_path)
    first = engine.fit(tokens(), batch_size=4, epochs=1, verbose=0, callbacks=[board])
    second = engine.fit(tokens(), batch_size=4, epochs=2, verbose=0, callbacks=[board])
    events = read_events(tmp_path)
    assert second.steps == [3, 4, 5]
    assert events["train/loss"] == list(zip(first.steps + second.steps,
                                            as_float32(first.losses + second.losses)))
    # no cluster: the plan has no estimate
    assert not any(tag.startswith("step_time/predicted") for tag in events)
    assert len(events["plan/explain"]) == 1
    assert len(os.listdir(tmp_path)) == 2


def test_without_tensorboard_the_callback_says_which_extra_to_install(monkeypatch):
    for name in [m for m in sys.modules if m == "tensorboard" or m.startswith("tensorboard.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(dg.DistGraphError, match=r"dg.callbacks.TensorBoard\('runs'\) writes "
                       r"with the tensorboard package, which is not installed .*: pip install "
                       r"'distgraph\[tensorboard\]'"):
        dg.callbacks.TensorBoard("runs")


@pytest.mark.mpi
def test_two_ranks_log_once_what_rank_0s_history_holds(tmp_path, tensorboard):
    proc = subprocess.run([sys.executable, "-m", "distgraph.cli", "run", "-n", "2",
                           str(SCRIPTS / "tensorboard_dp.py"), str(tmp_path / "tb")],
                          capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    ranks = {r["rank"]: r for r in (json.loads(line.split(" ", 1)[1])
                                    for line in proc.stdout.splitlines()
                                    if line.startswith("TB-RANK "))}
    assert sorted(ranks) == [0, 1]
    assert ranks[0]["losses"] == ranks[1]["losses"] and len(ranks[0]["losses"]) == 8
    assert len(os.listdir(tmp_path / "tb")) == 1              # rank 1 wrote nothing
    events = read_events(tmp_path / "tb")
    zero = ranks[0]
    assert events["train/loss"] == list(zip(zero["steps"], as_float32(zero["losses"])))
    assert [v for _, v in events["epoch/loss"]] == as_float32(zero["epoch_losses"])
    # Cluster.local(2)'s default figures (the suite runs with DISTGRAPH_CALIBRATE=never)
    assert {v for _, v in events["step_time/predicted_uncalibrated"]} == \
        {float(np.float32(zero["predicted"]))}
    assert "Plan: 2 process(es), distributed, 1 stage" in events["plan/explain"][0][1].decode()
    # each rank's measured peak, gathered to rank 0's file, and the plan's predicted one
    for rank in (0, 1):
        assert events[f"memory/rank{rank}"] == list(zip(zero["steps"],
                                                        as_float32(ranks[rank]["memory"])))
    assert [v for _, v in events["memory/max"]] == \
        as_float32(map(max, ranks[0]["memory"], ranks[1]["memory"]))
    assert {v for _, v in events["memory/predicted"]} == \
        {float(np.float32(zero["predicted_peak"]))}
