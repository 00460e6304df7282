"""``fit``'s ``epochs`` is the total the Engine's training reaches over its life: epochs
split over several fits equal one fit (the same shuffle order per epoch, the schedule
going on), a reached total trains nothing and says so, and after ``load`` the total
counts from the checkpoint's position. Oracle: one fit on a fresh Engine, bit for bit
in float64; under ``distgraph run -n 2`` the user's own script."""

import sys
from pathlib import Path

import numpy as np
import pytest

import distgraph as dg

sys.path.insert(0, str(Path(__file__).parent))
from test_lr import Rows  # noqa: E402
from user_scripts import run_user, with_prelude  # noqa: E402




def engine():
    dg.seed(0)
    sched = dg.optim.lr.StepDecay(0.1, step_size=4, gamma=0.5)
    return dg.Engine(dg.nn.Linear(3, 2), dg.nn.MSELoss(), dg.optim.SGD(sched, momentum=0.9))


FIT = dict(batch_size=4, shuffle=True, verbose=0)


def test_epochs_over_several_fits_train_as_one_fit(float64):
    whole = engine()
    history = whole.fit(Rows(), epochs=3, **FIT)
    parts = engine()
    first, second = parts.fit(Rows(), epochs=1, **FIT), parts.fit(Rows(), epochs=3, **FIT)
    assert [e["epoch"] for e in second.epochs] == [1, 2] and second.steps == list(range(3, 9))
    assert first.losses + second.losses == history.losses           # the same order per epoch
    assert [e["lr"] for e in first.epochs + second.epochs] == [e["lr"] for e in history.epochs]
    got, want = parts.state_dict(), whole.state_dict()
    assert all(np.array_equal(got[k], want[k]) for k in want)
    got, want = parts.optimizer_state_dict(), whole.optimizer_state_dict()
    assert all(np.array_equal(got[k], want[k]) for k in want)
    assert parts.epoch == whole.epoch == 3 and parts.global_step == 9


def test_a_reached_total_trains_nothing_and_says_so(float64, capsys):
    e = engine()
    e.fit(Rows(), epochs=2, **FIT)
    before = e.state_dict()
    history = e.fit(Rows(), epochs=2, **FIT)
    assert history.losses == [] and history.epochs == [] and e.global_step == 6
    assert capsys.readouterr().err == (
        "distgraph: fit: the Engine has trained 2 epochs already; epochs=2 is the total to "
        "reach: pass epochs=3 or more to train more\n")
    assert all(np.array_equal(v, before[k]) for k, v in e.state_dict().items())
    assert e.fit(Rows(), epochs=1, **FIT).steps == []
    assert "epochs=1 is the total" in capsys.readouterr().err
    assert e.fit(Rows(), epochs=3, **FIT).steps == [6, 7, 8]


def test_a_fit_stopped_inside_an_epoch_finishes_it_with_the_same_batches(float64):
    class StopAt(dg.callbacks.Callback):
        def on_step_end(self, step, logs=None):
            self.engine.stop_training = step == 1

    e = engine()
    assert e.fit(Rows(), epochs=2, callbacks=[StopAt()], **FIT).steps == [0, 1]
    with pytest.raises(dg.DistGraphError, match=r"the last fit stopped inside epoch 0 after "
                       r"batch 2; .* batch_size=2 \(the last fit: 4\): give fit the last "
                       r"fit's settings to finish epoch 0"):
        e.fit(Rows(), epochs=2, **dict(FIT, batch_size=2))
    history = e.fit(Rows(), epochs=2, **FIT)
    assert history.steps == [2, 3, 4, 5] and [r["epoch"] for r in history.epochs] == [0, 1]
    whole = engine()
    whole.fit(Rows(), epochs=2, **FIT)
    assert all(np.array_equal(v, whole.state_dict()[k]) for k, v in e.state_dict().items())


def test_after_load_the_total_counts_from_the_checkpoint(float64, tmp_path, capsys):
    e = engine()
    e.fit(Rows(), epochs=3, **FIT)
    e.save(tmp_path / "ckpt")
    loaded = engine()
    loaded.load(tmp_path / "ckpt")
    assert loaded.epoch == 3 and loaded.fit(Rows(), epochs=3, **FIT).losses == []
    assert "has trained 3 epochs already" in capsys.readouterr().err
    assert loaded.fit(Rows(), epochs=4, **FIT).losses == e.fit(Rows(), epochs=4, **FIT).losses


SCRIPT = with_prelude("""
    mesh = dg.ProcessMesh([0, 1], dim_names=["dp"])
    data = dg.shard_dataloader(Rows(32), mesh, shard_dims="dp")
    fit = dict(batch_size=8, shuffle=True, verbose=0)

    def report(what, engine, history):
        if engine.rank == 0:
            print(what, [e["epoch"] for e in history.epochs], history.steps, flush=True)

    engine = mlp_engine()
    report("first", engine, engine.fit(data, epochs=1, **fit))
    report("second", engine, engine.fit(data, epochs=2, **fit))
    report("again", engine, engine.fit(data, epochs=2, **fit))
    engine.save(sys.argv[1])
    loaded = mlp_engine()
    loaded.load(sys.argv[1])
    report("loaded", loaded, loaded.fit(data, epochs=3, **fit))
""")


@pytest.mark.mpi
def test_the_total_under_distgraph_run(tmp_path):
    """fit(1) then fit(2) trains one more epoch; fit(2) again says so on rank 0 and trains
    nothing; a new Engine that loads the checkpoint trains exactly one more with fit(3)."""
    rc, out = run_user(tmp_path, SCRIPT, 2, tmp_path / "ckpt")
    assert rc == 0, out
    lines = [ln for ln in out.splitlines() if ln.split(" ")[0] in
             ("first", "second", "again", "loaded")]
    assert lines == ["first [0] [0, 1, 2, 3]", "second [1] [4, 5, 6, 7]", "again [] []",
                     "loaded [2] [8, 9, 10, 11]"], out
    assert out.count("the Engine has trained 2 epochs already; epochs=2 is the total to "
                     "reach: pass epochs=3 or more to train more") == 1, out


CHANGING = with_prelude("""
    import json

    class Changing(Rows):
        '''Rows whose length is ``lengths[e]`` from epoch e on (the last one after).'''
        def __init__(self, lengths):
            super().__init__(max(lengths))
            self.lengths, self.epoch = lengths, 0
        def __len__(self):
            return self.lengths[min(self.epoch, len(self.lengths) - 1)]

    class Epochs(dg.callbacks.Callback):
        '''Tells the dataset the epoch that comes next; counts the steps of each.'''
        def __init__(self, data):
            self.data, self.steps = data, []
        def on_epoch_begin(self, epoch, logs=None):
            self.steps.append(0)
        def on_epoch_end(self, epoch, logs=None):
            self.data.epoch = epoch + 1
        def on_step_end(self, step, logs=None):
            self.steps[-1] += 1

    def changing_fit(lengths, data_of=lambda d: d):
        data = Changing(lengths)
        epochs = Epochs(data)
        engine = mlp_engine()
        history = engine.fit(data_of(data), batch_size=4, epochs=3, shuffle=True, verbose=0,
                             callbacks=[epochs])
        return epochs.steps, history.losses

    if __name__ == "__main__":
        mesh = dg.ProcessMesh([0, 1], ["dp"])
        steps, losses = changing_fit(json.loads(sys.argv[1]),
                                     lambda d: dg.shard_dataloader(d, mesh, shard_dims="dp"))
        if dg.get_rank() == 0:
            print("CHANGING " + json.dumps({"steps": steps, "losses": losses}), flush=True)
""")


@pytest.mark.mpi
def test_a_dataset_whose_length_changes_between_epochs_is_followed(tmp_path, job_trace):
    """Data parallel on 2 ranks, a dataset of 16 samples, then 32, then 24: each epoch
    reads all it has (4, 8 and 6 steps), with the losses of a serial run of the same
    data, and rank 0 says so; shrunk to 13, whose last batch of 1 the split cannot
    divide, the job stops at the start of that epoch saying the length changed."""
    import json
    import types

    rc, out = run_user(tmp_path, CHANGING, 2, "[16, 32, 24]")
    assert rc == 0, out
    got = json.loads(next(ln for ln in out.splitlines() if ln.startswith("CHANGING "))[9:])
    assert got["steps"] == [4, 8, 6]
    serial = types.ModuleType("changing")
    exec(compile(CHANGING, "changing", "exec"), serial.__dict__)
    steps, losses = serial.changing_fit([16, 32, 24])
    assert steps == [4, 8, 6]
    np.testing.assert_allclose(got["losses"], losses, rtol=1e-5)
    assert out.count("the training dataset has 32 samples at the start of epoch 1, 16 at "
                     "the start of the last: epoch 1 reads 8 batches of it") == 1, out
    assert "has 24 samples at the start of epoch 2, 32 at the start of the last" in out

    rc, out = run_user(tmp_path, CHANGING, 2, "[16, 13]")
    assert rc != 0
    assert ("the training dataset has 13 samples at the start of epoch 1, 16 at the start "
            "of the last: the last batch of each epoch has 1 samples (dataset of 13, "
            "batch_size 4), which") in out, out
    assert "use a dataset of 12 or 14 samples" in out, out
    job_trace.assert_nothing_left(ran_mpi=True)
