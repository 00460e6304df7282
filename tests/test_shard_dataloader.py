"""Data parallelism without touching the model: ``dg.shard_dataloader`` (Paddle's name and
meaning) splits each batch's feeds and labels over a mesh dim, ``dg.shard_op(layer, ...)``
gives a Layer the Engine trains, and an unannotated model on several ranks says once that
every rank trains on the whole batch. Oracles: training equals serial training (float64,
1e-10), on simulated ranks and on MPI ranks under ``distgraph run``."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import distgraph as dg
from distgraph.app.data import DataLoader
from distgraph.runtime.comm.simulated import SimulatedWorld

sys.path.insert(0, str(Path(__file__).parent))
from plans import BUILD_LOCK, Dataset, Tokens  # noqa: E402

SCRIPTS = Path(__file__).parent / "mpi_scripts"
DP = dg.ProcessMesh([0, 1], dim_names=["dp"])


@pytest.fixture(autouse=True)
def _float64(float64):
    """Distributed equals serial to 1e-10 in float64."""


def mlp(seed=0):
    with BUILD_LOCK:        # simulated ranks share dg.seed's generator
        dg.seed(seed)
        return dg.nn.MLP(8, 16, 4, activation="relu")


def engine_of(model, comm=None, loss=None, **kw):
    return dg.Engine(model, loss=loss or dg.nn.MSELoss(), optimizer=dg.optim.AdamW(0.01),
                     communicator=comm, **kw)


def fit(engine, data, batch=8):
    with BUILD_LOCK:        # simulated ranks share the tracer's builder stack
        engine.prepare(*DataLoader(data, batch).specs(1))
    history = engine.fit(data, batch_size=batch, verbose=0)
    return history.losses, engine.state_dict()


def assert_same(result, reference):
    (losses, params), (ref_losses, ref_params) = result, reference
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-10)
    assert sorted(params) == sorted(ref_params)
    for name in params:
        np.testing.assert_allclose(params[name], ref_params[name], rtol=0, atol=1e-10)


def test_shard_dataloader_trains_an_unmodified_model_data_parallel_like_serial():
    data = Dataset("mlp", dims=dict(seq=4, d_in=8, d_out=4), n=24)
    serial = fit(engine_of(mlp()), data)

    def rank(comm):
        engine = engine_of(mlp(), comm)
        result = fit(engine, dg.shard_dataloader(data, DP, shard_dims="dp"))
        plan = engine.plan()
        local = plan.local(engine.process).program.values
        return result, (engine.rank, engine.world_size, engine.process), \
            local["input_0"].shape, local["label_0"].shape, str(plan.program.values["input_0"]
                                                                .dist_attr.spec)

    for r, (result, where, x_shape, y_shape, spec) in enumerate(SimulatedWorld(2).run(rank)):
        assert_same(result, serial)
        assert where == (r, 2, r)
        assert x_shape == (4, 4, 8) and y_shape == (4, 4, 4)     # each rank reads half
        assert spec == "[dp, None, None]"


def test_two_meshes_put_the_inputs_on_the_first_stage_and_the_labels_on_the_last():
    first, second = dg.ProcessMesh([0, 1], ["dp"]), dg.ProcessMesh([2, 3], ["dp"])
    dims = dict(vocab_size=32, d_model=16, n_layer=2, n_head=2, max_seq_len=8)
    data = Tokens(n=16, seq=8, vocab=32)

    def gpt(stages=None):
        with BUILD_LOCK:
            dg.seed(0)
            model = dg.nn.GPT(**dims)
        if stages:      # no subclass: the model's own parts put on the stages
            model.embed = dg.shard_op(model.embed, first)
            model.blocks[0] = dg.shard_op(model.blocks[0], first)
            model.blocks[1] = dg.shard_op(model.blocks[1], second)
            model.head = dg.shard_op(model.head, second)
        return model

    strategy = dg.Strategy(micro_batches=2)
    serial = fit(engine_of(gpt(), loss=dg.nn.CrossEntropyLoss(), strategy=strategy), data)

    def rank(comm):
        engine = engine_of(gpt(True), comm, loss=dg.nn.CrossEntropyLoss(), strategy=strategy)
        result = fit(engine, dg.shard_dataloader(data, [first, second], shard_dims="dp"))
        values = engine.plan().program.values
        return result, values["input_0"].dist_attr, values["label_0"].dist_attr

    for result, x_attr, y_attr in SimulatedWorld(4).run(rank):
        assert_same(result, serial)
        assert (x_attr.mesh, str(x_attr.spec)) == (first, "[dp, None]")
        assert (y_attr.mesh, str(y_attr.spec)) == (second, "[dp, None]")


def test_shard_op_of_a_layer_gives_a_layer_the_engine_trains_like_serial():
    data = Dataset("mlp", dims=dict(seq=4, d_in=8, d_out=4), n=16)
    serial = fit(engine_of(mlp()), data)

    def rank(comm):
        model = mlp()
        wrapped = dg.shard_op(model, DP, in_shard_specs=[["dp", None, None]])
        assert isinstance(wrapped, dg.nn.Layer) and wrapped is not model
        assert [n for n, _ in wrapped.named_parameters()] == \
            [n for n, _ in model.named_parameters()]
        result = fit(engine_of(wrapped, comm), data)
        return result, model.state_dict()      # the same parameters, trained

    for result, bare in SimulatedWorld(2).run(rank):
        assert_same(result, serial)
        assert_same(([], bare), ([], serial[1]))


def test_evaluate_and_predict_split_plain_data_as_the_last_fit_did():
    data = Dataset("mlp", dims=dict(seq=4, d_in=8, d_out=4), n=16)
    serial = engine_of(mlp())
    fit(serial, data)
    expected = serial.evaluate(data, batch_size=8, verbose=0)

    def rank(comm):
        engine = engine_of(mlp(), comm)
        fit(engine, dg.shard_dataloader(data, DP, "dp"))
        with BUILD_LOCK:
            engine.prepare(*DataLoader(dg.shard_dataloader(data, DP, "dp"), 8).specs(1),
                           mode="eval")
        got = engine.evaluate(data, batch_size=8, verbose=0)
        return got, engine.plan("eval").distributed

    for got, distributed in SimulatedWorld(2).run(rank):
        assert distributed and got["loss"] == pytest.approx(expected["loss"], abs=1e-10)


@pytest.mark.parametrize("meshes, dims, fields, labels, expected", [
    (DP, "dp", [(8, 3), (8,)], 1, [(DP, "[dp, None]"), (DP, "[dp]")]),
    (DP, 0, [(8, 3), (8,)], 1, [(DP, "[dp, None]"), (DP, "[dp]")]),
    (DP, None, [(8, 3), (8,)], 1, [(DP, "[None, None]"), (DP, "[None]")]),
    ([DP, dg.ProcessMesh([2, 3], ["x"])], ["dp", "x"], [(8, 3), (8, 3), (8,)], 1,
     [(DP, "[dp, None]"), (DP, "[dp, None]"), (dg.ProcessMesh([2, 3], ["x"]), "[x]")]),
    (dg.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"]), "dp", [(8,)], 0,
     [(dg.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"]), "[dp]")]),
])
def test_feed_attrs_place_each_field_as_paddle_does(meshes, dims, fields, labels, expected):
    attrs = dg.shard_dataloader(Tokens(), meshes, dims).feed_attrs(fields, labels)
    assert [(a.mesh, str(a.spec)) for a in attrs] == expected


@pytest.mark.parametrize("call, words", [
    (lambda: dg.shard_dataloader(Tokens(), DP, "x"), "shard_dims 'x' is not a dim of"),
    (lambda: dg.shard_dataloader(Tokens(), DP, 1), "shard_dims 1 is out of range"),
    (lambda: dg.shard_dataloader(Tokens(), [DP, DP], ["dp"]), "1 shard_dims for 2 meshes"),
    (lambda: dg.shard_dataloader(Tokens(), "dp"), "meshes must be a ProcessMesh"),
    (lambda: dg.shard_dataloader([1, 2], DP, "dp").feed_attrs([(3,), (3,)], 1),
     "dataset field 0 (input, split by shard_dataloader) of shape [3] with spec [dp] on "
     "ProcessMesh([0, 1], dims=[dp]): the batch dim 0 of size 3 is not divisible by 2 (the "
     "size of mesh dims ['dp']); use a batch size divisible by 2"),
    (lambda: dg.shard_dataloader([1], [DP, DP, DP], "dp").feed_attrs([(2,), (2,)], 1),
     "3 meshes for samples of 2 fields"),
])
def test_shard_dataloader_mistakes_say_what_to_give(call, words):
    with pytest.raises(dg.ShardingError) as info:
        call()
    assert words in str(info.value)


def test_a_batch_not_divisible_by_the_dp_degree_asks_for_another_batch_size():
    class DataParallel(dg.nn.Layer):        # the annotation inside a forward, as before
        def __init__(self):
            super().__init__()
            self.inner = mlp()

        def forward(self, x):
            return self.inner(dg.shard_tensor(x, DP, ["dp", None, None]))

    data = Dataset("mlp", dims=dict(seq=4, d_in=8, d_out=4), n=16)
    with pytest.raises(dg.ShardingError, match=r"input 'input_0' of shape \[5, 4, 8\] .*: the "
                       r"batch dim 0 of size 5 is not divisible by 2 .*; use a batch size "
                       r"divisible by 2"):
        engine_of(DataParallel()).fit(data, batch_size=5, verbose=0)


def test_an_unannotated_model_on_two_ranks_says_so_once_on_rank_0(capsys):
    data = Dataset("mlp", dims=dict(seq=4, d_in=8, d_out=4), n=16)

    def rank(comm):
        engine = engine_of(mlp(), comm)
        fit(engine, data)
        engine.fit(data, batch_size=8, epochs=2, verbose=0)
        engine.evaluate(data, batch_size=8, verbose=0)

    SimulatedWorld(2).run(rank)
    lines = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(lines) == 2, lines        # training once, evaluation once; rank 0 only
    assert lines[0] == ("distgraph: warning: the model has no annotation, so each of the 2 "
                        "ranks trains on the whole batch (the same work 2 times); split the "
                        "batch with dg.shard_dataloader(dataset, mesh, shard_dims=\"dp\") or "
                        "annotate the model with dg.shard_tensor")
    assert "evaluates the whole batch" in lines[1]


@pytest.mark.mpi
def test_the_readme_script_trains_data_parallel_under_distgraph_run(tmp_path):
    """What a newcomer writes from the README: an unmodified model, shard_dataloader,
    engine.rank; two MPI ranks give the serial losses."""
    proc = subprocess.run([sys.executable, "-m", "distgraph.cli", "run", "-n", "2",
                           str(SCRIPTS / "newcomer_dp.py")], capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    serial = subprocess.run([sys.executable, str(SCRIPTS / "newcomer_dp.py"), "--serial"],
                            capture_output=True, text=True, timeout=120, check=True)
    losses = serial.stdout.split("losses ")[1].strip()
    assert lines == [f"rank 0 of 2 runs process 0: losses {losses}",
                     f"rank 1 of 2 runs process 1: losses {losses}"]
    assert "warning" not in proc.stderr
