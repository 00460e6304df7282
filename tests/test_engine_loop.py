"""The training loop: callbacks in protocol order with the History's numbers, early
stopping, the progress bar (rank 0 only), CSV logs, metrics (distributed == serial),
new model values taking effect, a new batch size planning again, and the short last
batch (drop_last). Oracles: hand-written SGD on a linear model, numpy on predictions."""

import io
import sys
from pathlib import Path

import numpy as np
import pytest

import distgraph as dg
from distgraph.runtime.comm.simulated import SimulatedWorld

sys.path.insert(0, str(Path(__file__).parent))
from user_scripts import run_user, with_prelude  # noqa: E402

MESH = dg.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])


class Rows:
    def __init__(self, n=12, seed=0, d_in=3, d_out=2):
        rng = np.random.default_rng(seed)
        self.x, self.y = rng.normal(size=(n, d_in)), rng.normal(size=(n, d_out))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def sgd_by_hand(w, b, batches, rate):
    """Plain SGD on mean((x w + b - y)^2) over the given (x, y) batches."""
    losses = []
    for x, y in batches:
        d = x @ w + b - y
        losses.append(float(np.mean(d * d)))
        g = 2.0 * d / d.size
        w, b = w - rate * (x.T @ g), b - rate * g.sum(axis=0)
    return losses, w, b


def linear(seed=0):
    dg.seed(seed)
    model = dg.nn.Linear(3, 2)
    return model, model.weight.numpy(), model.bias.numpy()


class Recorder(dg.callbacks.Callback):
    def __init__(self):
        self.events = []

    def on_train_begin(self, logs=None):
        self.events.append(("train_begin", logs["epochs"], logs["steps_per_epoch"]))

    def on_epoch_begin(self, epoch, logs=None):
        self.events.append(("epoch_begin", epoch))

    def on_step_begin(self, step, logs=None):
        self.events.append(("step_begin", step, logs["epoch"], logs["batch"]))

    def on_step_end(self, step, logs=None):
        self.events.append(("step_end", step, logs["loss"]))

    def on_epoch_end(self, epoch, logs=None):
        self.events.append(("epoch_end", epoch, logs["loss"], "val_loss" in logs))

    def on_train_end(self, logs=None):
        self.events.append(("train_end", logs["steps"]))


def test_callbacks_run_in_protocol_order_with_the_histories_numbers(float64):
    model, _, _ = linear()
    rec = Recorder()
    engine = dg.Engine(model, dg.nn.MSELoss(), dg.optim.SGD(0.05))
    history = engine.fit(Rows(6), batch_size=2, epochs=2, valid_data=Rows(4, seed=1),
                         callbacks=[rec], verbose=0)
    want = [("train_begin", 2, 3)]
    for epoch in range(2):
        want.append(("epoch_begin", epoch))
        for b in range(3):
            step = 3 * epoch + b
            want += [("step_begin", step, epoch, b), ("step_end", step, history.losses[step])]
        want.append(("epoch_end", epoch, history.epochs[epoch]["loss"], True))
    want.append(("train_end", 6))
    assert rec.events == want
    assert history.steps == list(range(6)) and engine.global_step == 6


def test_stop_training_inside_an_epoch_and_early_stopping(float64):
    class StopAt(dg.callbacks.Callback):
        def on_step_end(self, step, logs=None):
            if step == 1:
                self.engine.stop_training = True

    model, _, _ = linear()
    engine = dg.Engine(model, dg.nn.MSELoss(), dg.optim.SGD(0.05))
    history = engine.fit(Rows(6), batch_size=2, epochs=3, callbacks=[StopAt()], verbose=0)
    assert len(history.losses) == 2 and len(history.epochs) == 1
    # the next fit finishes the epoch stopped inside first, as a loaded checkpoint does
    history = engine.fit(Rows(6), batch_size=2, epochs=1, verbose=0)
    assert history.steps == [2] and [e["epoch"] for e in history.epochs] == [0]
    assert engine.epoch == 1

    # SGD with a rate far too large diverges: the loss rises every epoch from the first.
    model, _, _ = linear()
    engine = dg.Engine(model, dg.nn.MSELoss(), dg.optim.SGD(5.0))
    stop = dg.callbacks.EarlyStopping("loss", patience=1)
    history = engine.fit(Rows(6), batch_size=2, epochs=10, callbacks=[stop], verbose=0)
    losses = [e["loss"] for e in history.epochs]
    assert losses == sorted(losses) and len(losses) == 3 and stop.stopped_epoch == 2
    assert engine.epoch == 3           # stopped after 3 of 10: fit(epochs=10) goes on
    history = engine.fit(Rows(6), batch_size=2, epochs=10, verbose=0)
    assert [e["epoch"] for e in history.epochs] == list(range(3, 10))

    with pytest.raises(dg.DistGraphError, match="val_loss.*valid_data"):
        engine.fit(Rows(6), batch_size=2, epochs=11, callbacks=[dg.callbacks.EarlyStopping()],
                   verbose=0)


def test_off_a_terminal_the_bar_is_plain_lines(float64, capsys, monkeypatch):
    monkeypatch.delenv(dg.callbacks.TERMINAL_VAR, raising=False)     # capsys: no tty
    model, _, _ = linear()
    engine = dg.Engine(model, dg.nn.MSELoss(), dg.optim.SGD(0.05))
    engine.fit(Rows(6), batch_size=2, epochs=2)
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    assert [ln.split(" loss=")[0] for ln in lines if " step " in ln] == \
        ["epoch 1/2 step 1/3", "epoch 1/2 step 2/3", "epoch 2/2 step 1/3", "epoch 2/2 step 2/3"]
    assert [ln.split(" mean_loss=")[0] for ln in lines if "mean_loss=" in ln] == \
        ["epoch 1/2", "epoch 2/2"]
    assert len(lines) == 6


@pytest.fixture
def terminal(monkeypatch):
    """Output counts as reaching a terminal (as distgraph run says for its ranks), so
    that the bar is drawn into capsys and StringIO streams."""
    monkeypatch.setenv(dg.callbacks.TERMINAL_VAR, "1")


def test_progress_bar_shows_loss_and_rates(float64, capsys, terminal):
    model, _, _ = linear()
    engine = dg.Engine(model, dg.nn.MSELoss(), dg.optim.SGD(0.05))
    engine.fit(Rows(6), batch_size=2, epochs=2)                 # verbose=1: the bar
    err = capsys.readouterr().err
    assert "epoch 2/2" in err and "loss=" in err and "mean_loss=" in err
    assert "steps/s" in err and "samples/s" in err
    engine.fit(Rows(6), batch_size=2, epochs=3, verbose=2)      # a line per epoch
    out, err = capsys.readouterr()
    assert out.startswith("epoch 3/3 mean_loss=") and "samples/s=" in out and err == ""
    engine.fit(Rows(6), batch_size=2, epochs=4, verbose=0)
    assert capsys.readouterr() == ("", "")


def test_a_fit_that_raises_closes_its_bar_and_evaluate_takes_verbose(float64, capsys,
                                                                    terminal):
    model, _, _ = linear()
    engine = dg.Engine(model, dg.nn.MSELoss(), dg.optim.SGD(0.05))

    class Boom(dg.callbacks.Callback):
        def on_step_end(self, step, logs=None):
            if step == 1:
                raise RuntimeError("boom")

    bar = dg.callbacks.ProgressBar()
    with pytest.raises(RuntimeError, match="boom"):
        engine.fit(Rows(6), batch_size=2, epochs=2, callbacks=[bar, Boom()])
    assert bar._tqdm is None                     # closed: nothing prints at exit
    assert capsys.readouterr().err.endswith("\n")
    expected = engine.evaluate(Rows(6), batch_size=2, verbose=0)
    assert capsys.readouterr() == ("", "")
    assert engine.evaluate(Rows(6), batch_size=2, verbose=2) == expected
    assert capsys.readouterr().out.startswith("evaluate mean_loss=")
    assert engine.evaluate(Rows(6), batch_size=2) == expected          # verbose=1: a bar
    assert "evaluate: 100%" in capsys.readouterr().err
    with pytest.raises(dg.DistGraphError, match="verbose=3: give 0"):
        engine.evaluate(Rows(6), batch_size=2, verbose=3)


def test_csv_logger_writes_a_row_per_epoch(float64, tmp_path):
    model, _, _ = linear()
    engine = dg.Engine(model, dg.nn.MSELoss(), dg.optim.SGD(0.05))
    path = tmp_path / "log.csv"
    history = engine.fit(Rows(6), batch_size=2, epochs=2, valid_data=Rows(4, seed=1),
                         callbacks=[dg.callbacks.CSVLogger(path)], verbose=0)
    lines = path.read_text().splitlines()
    assert lines[0] == "epoch,loss,lr,val_loss" and len(lines) == 3
    assert [float(v) for v in lines[2].split(",")] == pytest.approx(
        [1, history.epochs[1]["loss"], 0.05, history.epochs[1]["val_loss"]], rel=1e-12)


def test_new_model_values_take_effect_at_the_next_step(float64):
    model, _, _ = linear()
    engine = dg.Engine(model, dg.nn.MSELoss(), dg.optim.SGD(0.05))
    engine.fit(Rows(4), batch_size=2, verbose=0)
    _, w, b = linear(seed=7)
    model.set_state_dict({"weight": w, "bias": b})
    assert np.array_equal(engine.state_dict()["weight"], w)
    losses = engine.fit(Rows(4, seed=3), batch_size=2, epochs=2, verbose=0).losses
    data = Rows(4, seed=3)
    want, w2, _ = sgd_by_hand(w, b, [(data.x[:2], data.y[:2]), (data.x[2:], data.y[2:])], 0.05)
    np.testing.assert_allclose(losses, want, rtol=1e-13)
    np.testing.assert_allclose(engine.state_dict()["weight"], w2, rtol=1e-13)

    class SetMidway(dg.callbacks.Callback):     # inside a fit, too
        def on_step_end(self, step, logs=None):
            model.weight.set_value(np.zeros((3, 2)))

    before = engine.state_dict()
    after = engine.fit(Rows(4), batch_size=2, epochs=3, callbacks=[SetMidway()],
                       verbose=0).losses
    data = Rows(4)
    first, _, b1 = sgd_by_hand(before["weight"], before["bias"], [(data.x[:2], data.y[:2])],
                               0.05)
    second, w2, b2 = sgd_by_hand(np.zeros((3, 2)), b1, [(data.x[2:], data.y[2:])], 0.05)
    np.testing.assert_allclose(after, first + second, rtol=1e-13)
    np.testing.assert_array_equal(engine.state_dict()["weight"], np.zeros((3, 2)))  # set again


def test_a_new_batch_size_plans_again(float64):
    model, w, b = linear()
    engine = dg.Engine(model, dg.nn.MSELoss(), dg.optim.SGD(0.05))
    data = Rows(8)
    first = engine.fit(data, batch_size=4, verbose=0).losses
    second = engine.fit(data, batch_size=2, epochs=2, verbose=0).losses
    batches = [(data.x[i:i + 4], data.y[i:i + 4]) for i in (0, 4)] + \
              [(data.x[i:i + 2], data.y[i:i + 2]) for i in range(0, 8, 2)]
    want, w, b = sgd_by_hand(w, b, batches, 0.05)
    np.testing.assert_allclose(first + second, want, rtol=1e-13)
    assert engine.plan().program.values["input_0"].shape == (2, 3)


def test_short_last_batch_trains_on_its_own_plan_unless_dropped(float64):
    model, w, b = linear()
    engine = dg.Engine(model, dg.nn.MSELoss(), dg.optim.SGD(0.05))
    data = Rows(10)
    losses = engine.fit(data, batch_size=4, epochs=2, verbose=0).losses
    batches = [(data.x[i:i + 4], data.y[i:i + 4]) for i in (0, 4, 8)] * 2
    want, w, b = sgd_by_hand(w, b, batches, 0.05)
    np.testing.assert_allclose(losses, want, rtol=1e-13)
    dropped = engine.fit(data, batch_size=4, epochs=3, drop_last=True, verbose=0).losses
    assert len(dropped) == 2

    preds = engine.predict(data, batch_size=4)
    assert [p[0].shape for p in preds] == [(4, 2), (4, 2), (2, 2)]
    out = np.concatenate([p[0] for p in preds])
    assert engine.evaluate(data, batch_size=4)["loss"] == pytest.approx(
        float(np.mean((out - data.y) ** 2)), rel=1e-13)


def test_a_short_batch_that_cannot_be_split_says_drop_last():
    class DataParallel(dg.nn.Layer):
        def __init__(self):
            super().__init__()
            self.fc = dg.nn.Linear(3, 2)

        def forward(self, x):
            return self.fc(dg.shard_tensor(x, MESH, ["dp", None]))

    engine = dg.Engine(DataParallel(), dg.nn.MSELoss(), dg.optim.SGD(0.05))
    with pytest.raises(dg.DistGraphError, match="last batch of each epoch has 3 samples.*"
                       r"drop_last=True.* a dataset of 10 or 12 samples"):
        engine.fit(Rows(11), batch_size=4, verbose=0)


SHORT_LAST_BATCH = with_prelude("""
    call = sys.argv[1]
    mesh = dg.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    engine = mlp_engine()

    class Steps(dg.callbacks.Callback):
        def on_step_end(self, step, logs):
            print("ran step", step, flush=True)

    whole = dg.shard_dataloader(Rows(64), mesh, shard_dims="dp")
    if call == "fit":
        engine.fit(dg.shard_dataloader(Rows(66), mesh, shard_dims="dp"), batch_size=8,
                   verbose=0, callbacks=[Steps()])
    elif call == "validate":            # a plain dataset is split as fit's data is
        engine.fit(whole, batch_size=8, verbose=0, valid_data=Rows(66), callbacks=[Steps()])
    elif call == "evaluate":
        engine.fit(whole, batch_size=8, verbose=0)
        print("evaluated", engine.evaluate(Rows(66), batch_size=8, verbose=0))
    elif call == "drop_last":
        engine.fit(dg.shard_dataloader(Rows(66), mesh, shard_dims="dp"), batch_size=8,
                   verbose=0, drop_last=True, callbacks=[Steps()])
        print("evaluated", engine.evaluate(Rows(66), batch_size=8, verbose=0,
                                           drop_last=True))
""")


@pytest.mark.mpi
@pytest.mark.parametrize("call", ["fit", "validate", "evaluate"])
def test_a_short_last_batch_four_ranks_cannot_split_fails_before_the_first_step(tmp_path,
                                                                             call):
    """66 samples, batch_size 8, dp=4: the last batch of 2 cannot be split over 4
    processes. The run stops before any step (not after an epoch's work), and the error
    names the real ways out: drop_last=True, or a dataset length whose last batch 4
    divides (batch_size 8 already divides by 4)."""
    rc, out = run_user(tmp_path, SHORT_LAST_BATCH, 4, call)
    assert rc != 0, out
    assert "ran step" not in out and "evaluated" not in out, out
    epoch = " of each epoch" if call == "fit" else ""
    assert (f"the last batch{epoch} has 2 samples (dataset of 66, batch_size 8), which its "
            "split over mesh dims ['dp'] into 4 parts does not divide: pass drop_last=True "
            "to skip those 2 samples, or use a dataset of 64 or 68 samples") in out, out
    assert "use a batch size divisible by 4" not in out, out


@pytest.mark.mpi
def test_with_drop_last_the_short_batch_is_skipped_on_four_ranks(tmp_path):
    rc, out = run_user(tmp_path, SHORT_LAST_BATCH, 4, "drop_last")
    assert rc == 0, out
    assert out.count("ran step 7") == 4 and "ran step 8" not in out, out
    assert out.count("evaluated {'loss'") == 4, out


PROGRESS = with_prelude("""
    n = int(sys.argv[1])            # processes of the plan: 2 runs, 4 is the wrong -n
    mesh = dg.ProcessMesh(list(range(n)), dim_names=["dp"])
    mlp_engine().fit(dg.shard_dataloader(Rows(64), mesh, shard_dims="dp"), batch_size=8,
                     epochs=2)
""")


@pytest.mark.mpi
def test_a_logged_run_gets_plain_lines_and_a_wrong_n_no_bar(tmp_path):
    """distgraph run into a pipe (a log, tee): plain progress lines, no carriage returns;
    a plan of 4 processes on 2 ranks says so before any progress is drawn."""
    rc, out = run_user(tmp_path, PROGRESS, 2, 2)
    assert rc == 0, out
    assert "\r" not in out and out.count("mean_loss=") == 2, out
    assert "epoch 1/2 step 7/8 loss=" in out and "epoch 2/2 mean_loss=" in out, out
    rc, out = run_user(tmp_path, PROGRESS, 2, 4)
    assert rc != 0
    assert out.splitlines()[0].startswith(
        "distgraph: ranks 0, 1 failed: PlanError: this plan needs 4 processes"), out
    assert "epoch" not in out, out


@pytest.mark.mpi
def test_on_a_terminal_distgraph_run_draws_the_bar(tmp_path):
    """The launcher's terminal decides, though its ranks write into pipes."""
    import os
    import pty
    import subprocess
    script = tmp_path / "progress.py"
    script.write_text(PROGRESS)
    main, side = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "distgraph.cli", "run", "-n", "2",
                             str(script), "2"], stdout=subprocess.DEVNULL, stderr=side,
                            env=dict({k: v for k, v in os.environ.items()
                                      if k != dg.callbacks.TERMINAL_VAR}, OMP_NUM_THREADS="1"))
    os.close(side)
    seen = b""
    while True:
        try:
            chunk = os.read(main, 1 << 16)
        except OSError:          # the terminal closed: the job is over
            break
        if not chunk:
            break
        seen += chunk
    os.close(main)
    assert proc.wait(timeout=120) == 0, seen
    assert b"\r" in seen and b"epoch 2/2: 100%" in seen, seen


class Classifier(dg.nn.Layer):
    def __init__(self, annotate):
        super().__init__()
        self.fc1, self.fc2, self.annotate = dg.nn.Linear(6, 16), dg.nn.Linear(16, 5), annotate
        if annotate:
            dg.shard_tensor(self.fc1.weight, MESH, [None, "mp"])
            dg.shard_tensor(self.fc2.weight, MESH, ["mp", None])

    def forward(self, x):
        if self.annotate:
            dg.shard_tensor(x, MESH, ["dp", None])
        return self.fc2(dg.ops.relu(self.fc1(x)))


class Labelled:
    def __init__(self, n=16, seed=0):
        rng = np.random.default_rng(seed)
        self.x = rng.normal(size=(n, 6))
        self.y = rng.integers(0, 5, size=n).astype(np.int64)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def classify(comm=None, annotate=False, init=None):
    model = Classifier(annotate)
    model.set_state_dict(init)
    engine = dg.Engine(model, dg.nn.CrossEntropyLoss(), dg.optim.Adam(0.01),
                       metrics=[dg.metrics.Accuracy(), dg.metrics.Accuracy(topk=2)],
                       communicator=comm)
    return engine


def test_accuracy_matches_numpy_and_distributed_equals_serial(float64):
    dg.seed(0)
    init = Classifier(False).state_dict()
    serial = classify(init=init)
    history = serial.fit(Labelled(), batch_size=8, epochs=2, valid_data=Labelled(8, 1),
                         verbose=0)
    assert {"val_loss", "val_accuracy", "val_top2_accuracy"} <= set(history.epochs[-1])
    result = serial.evaluate(Labelled(8, 1), batch_size=4)
    logits = np.concatenate([p[0] for p in serial.predict(Labelled(8, 1), batch_size=4)])
    labels = Labelled(8, 1).y
    assert result["accuracy"] == np.mean(np.argmax(logits, -1) == labels)
    top2 = np.argsort(-logits, axis=-1)[:, :2]
    assert result["top2_accuracy"] == np.mean(np.any(top2 == labels[:, None], axis=-1))

    world = SimulatedWorld(4, timeout=60)
    engines = [classify(world.communicator(r), True, init) for r in range(4)]
    ins, labels_spec = dg.app.data.DataLoader(Labelled(), 8).specs(1)
    for e in engines:         # tracing is not thread-safe: plan before the threads start
        e.prepare(ins, labels_spec)
        e.prepare(*dg.app.data.DataLoader(Labelled(8, 1), 4).specs(1), mode="eval")
    ranks = world.run(lambda comm: (
        engines[comm.rank].fit(Labelled(), batch_size=8, epochs=2, verbose=0).losses,
        engines[comm.rank].evaluate(Labelled(8, 1), batch_size=4)))
    for losses, evaluated in ranks:
        np.testing.assert_allclose(losses, history.losses, rtol=1e-12)
        assert evaluated["accuracy"] == result["accuracy"]
        assert evaluated["loss"] == pytest.approx(result["loss"], rel=1e-12)


def test_bad_metrics_and_callbacks_raise():
    with pytest.raises(dg.DistGraphError, match="Metric"):
        dg.Engine(dg.nn.Linear(2, 2), dg.nn.MSELoss(), dg.optim.SGD(0.1), metrics=["acc"])
    with pytest.raises(dg.DistGraphError, match="needs a loss"):
        dg.Engine(dg.nn.Linear(2, 2), metrics=[dg.metrics.Accuracy()])
    engine = dg.Engine(dg.nn.Linear(3, 2), dg.nn.MSELoss(), dg.optim.SGD(0.1))
    with pytest.raises(dg.DistGraphError, match="Callback"):
        engine.fit(Rows(4), batch_size=2, callbacks=[print], verbose=0)


def test_distributed_engines_take_new_model_values_too(float64):
    dg.seed(0)
    init, other = Classifier(False).state_dict(), Classifier(False).state_dict()

    def session(engine):
        first = engine.fit(Labelled(), batch_size=8, verbose=0).losses
        engine.model.set_state_dict(other)
        return first + engine.fit(Labelled(), batch_size=8, epochs=2, verbose=0).losses, \
            engine.state_dict()

    want, params = session(classify(init=init))
    world = SimulatedWorld(4, timeout=60)
    engines = [classify(world.communicator(r), True, init) for r in range(4)]
    for e in engines:
        e.prepare(*dg.app.data.DataLoader(Labelled(), 8).specs(1))
    for losses, got in world.run(lambda comm: session(engines[comm.rank])):
        np.testing.assert_allclose(losses, want, rtol=1e-12)
        assert all(np.max(np.abs(got[k] - params[k])) < 1e-12 for k in params)


def test_only_rank_zero_shows_progress(float64, terminal):
    class DataParallel(dg.nn.Layer):
        def __init__(self):
            super().__init__()
            self.fc = dg.nn.Linear(3, 2)

        def forward(self, x):
            return self.fc(dg.shard_tensor(x, dg.ProcessMesh([0, 1], ["dp"]), ["dp", None]))

    world = SimulatedWorld(2, timeout=60)
    files = [io.StringIO(), io.StringIO()]
    engines = []
    for r in range(2):
        dg.seed(0)
        engines.append(dg.Engine(DataParallel(), dg.nn.MSELoss(), dg.optim.SGD(0.05),
                                 communicator=world.communicator(r)))
        engines[-1].prepare(*dg.app.data.DataLoader(Rows(8), 4).specs(1))
    world.run(lambda comm: engines[comm.rank].fit(
        Rows(8), batch_size=4, epochs=2,
        callbacks=[dg.callbacks.ProgressBar(file=files[comm.rank])]))
    assert "epoch 2/2" in files[0].getvalue() and "samples/s" in files[0].getvalue()
    assert files[1].getvalue() == ""


def test_a_new_strategy_plans_again_and_moves_the_states(float64):
    """ZeRO shards the Adam moments over dp: switching it on between fits gathers them
    from the plain layout and lays them out anew (and back), as serial training goes on."""
    dg.seed(0)
    init = Classifier(False).state_dict()

    def session(engine, switch):
        losses = engine.fit(Labelled(), batch_size=8, verbose=0).losses
        for total, sharding in ((2, True), (3, False)):
            if switch:
                engine.strategy = dg.Strategy(sharding=sharding)
            losses += engine.fit(Labelled(), batch_size=8, epochs=total, verbose=0).losses
        return losses, engine.state_dict(), engine.optimizer_state_dict()

    want, params, states = session(classify(init=init), switch=False)
    world = SimulatedWorld(4, timeout=60)
    engines = [classify(world.communicator(r), True, init) for r in range(4)]
    specs = dg.app.data.DataLoader(Labelled(), 8).specs(1)
    for e in engines:
        for sharding in (True, False):
            e.strategy = dg.Strategy(sharding=sharding)
            e.prepare(*specs)
    ranks = world.run(lambda comm: session(engines[comm.rank], switch=True))
    for losses, got, got_states in ranks:
        np.testing.assert_allclose(losses, want, rtol=1e-12)
        assert all(np.max(np.abs(got[k] - params[k])) < 1e-12 for k in params)
        assert all(np.max(np.abs(got_states[k] - states[k])) < 1e-12 for k in states)


def test_the_loops_read_no_private_attribute_of_the_engine():
    """``app/loops.py`` reads the Engine through its public names and is given the plan
    cache and the held state (read from the source, as tests/test_layering.py reads
    imports): no ``engine._x``, ``self.engine._x`` or other object's ``_x``, only its own."""
    import ast

    import distgraph.app.loops as loops

    tree = ast.parse(Path(loops.__file__).read_text())
    private = [f"line {node.lineno}: {ast.unparse(node)}" for node in ast.walk(tree)
               if isinstance(node, ast.Attribute) and node.attr.startswith("_")
               and not node.attr.startswith("__")
               and not (isinstance(node.value, ast.Name) and node.value.id == "self")]
    assert not private, private
    engine = dg.Engine(dg.nn.Linear(3, 2), dg.nn.MSELoss(), dg.optim.SGD(0.1))
    assert engine._loops.plans is engine._plans and engine._loops.held is engine._held
