"""Bad data and bad numbers fail the same way serially, on simulated ranks and on MPI
ranks: out-of-range labels and embedding ids name the dataset sample, the position and
the value; ``ignore_index`` labels count for nothing (serial == vocabulary-parallel, and
the gradient equals finite differences in test_op_grads); a NaN loss stops training at
its step on every rank; a ragged sample names the samples and shapes; the Engine takes
its cluster from ``distgraph run --cluster``."""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import distgraph as dg
from distgraph.errors import DistGraphError, ResourceFileError, RuntimeFault
from distgraph.runtime.comm.simulated import SimulatedWorld
from distgraph.runtime.execution.executor import ProgramRunner

sys.path.insert(0, str(Path(__file__).parent / "mpi_scripts"))
sys.path.insert(0, str(Path(__file__).parent))
import fault_jobs as J  # noqa: E402
from plans import BUILD_LOCK  # noqa: E402
from user_scripts import run_user  # noqa: E402

CLUSTERS = Path(__file__).parent.parent / "resources" / "clusters"


@pytest.fixture(autouse=True)
def _job_temp(tmp_path, monkeypatch):
    """Jobs that fail or are stopped keep their default log folder: keep it here."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))


@pytest.fixture(autouse=True)
def _float64(float64):
    """The jobs of fault_jobs.py train in float64; the default is restored after."""


def launch(n, *args):
    proc = subprocess.run([sys.executable, "-m", "distgraph.cli", "run", "-n", str(n),
                           str(J.__file__), *map(str, args)], check=False,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=90)
    return proc.returncode, proc.stdout + proc.stderr


def rank_errors(out: str) -> list[str]:
    """The RuntimeFault messages of the ranks the launcher reported as failed."""
    return re.findall(r"failed: RuntimeFault: (.*)", out)


def error_of(fn) -> str:
    with pytest.raises(RuntimeFault) as info:
        fn()
    return str(info.value)


def simulated(n, fn):
    """Each simulated rank's RuntimeFault message (None where it raised none)."""
    def rank(comm):
        try:
            fn(comm)
        except RuntimeFault as e:
            return str(e)
        return None
    return SimulatedWorld(n).run(rank)


def fit_gpt(data, comm=None, n=1):
    engine = J.gpt_engine(n, communicator=comm)
    with BUILD_LOCK:
        engine.prepare(*dg.app.data.DataLoader(data, 8).specs(1))
    return engine.fit(data, batch_size=8)


def bad_tokens(mode, value):
    data = J.Tokens()
    (data.y if mode == "labels" else data.x)[5, 2 if mode == "labels" else 1] = value
    return data


# ---- labels and ids ---------------------------------------------------------------------

@pytest.mark.parametrize("mode,value,expected", [
    ("labels", 16, ("label_0 at position [2] is 16, outside [0, 16) for the cross-entropy "
                    "over 16 classes (ignore_index=-100)")),
    ("labels", -1, "label_0 at position [2] is -1, outside [0, 16)"),
    ("ids", 16, ("input_0 at position [1] is 16, outside [0, 16) for the embedding 'wte' "
                 "with 16 rows")),
    ("ids", -3, "input_0 at position [1] is -3, outside [0, 16)"),
])
def test_a_bad_label_or_id_names_the_sample_serially_and_on_every_rank(mode, value, expected):
    serial = error_of(lambda: fit_gpt(bad_tokens(mode, value)))
    assert serial.startswith("epoch 0, batch 0: dataset sample 5: ") and expected in serial
    # vocabulary parallel on 2 ranks: both read the whole batch, both raise the same
    assert simulated(2, lambda comm: fit_gpt(bad_tokens(mode, value), comm, 2)) == [serial] * 2


@pytest.mark.mpi
def test_a_bad_label_on_mpi_ranks_raises_what_serial_raises():
    serial = error_of(lambda: fit_gpt(bad_tokens("labels", 16)))
    rc, out = launch(2, "labels", 16)
    assert rc != 0 and rank_errors(out) and set(rank_errors(out)) == {serial}, out


def ce_program(classes=6, ignore_index=-100, reduction="none"):
    return dg.trace(lambda x, y: dg.ops.cross_entropy(x, y, reduction, ignore_index),
                    dg.InputSpec([2, 3, classes], "float64", "logits"),
                    dg.InputSpec([2, 3], "int64", "labels"))


def test_the_kernels_check_labels_and_ids_outside_the_engine_too():
    prog = ce_program()
    labels = np.array([[0, 1, 2], [3, 6, 5]])
    message = error_of(lambda: ProgramRunner(prog).run(
        {}, {"logits": np.zeros((2, 3, 6)), "labels": labels}, [prog.outputs[0].name]))
    assert "label (ignore_index=-100) 6 at batch position (1, 1) is outside [0, 6)" in message
    emb = dg.trace(lambda i, t: dg.ops.embedding(i, t), dg.InputSpec([4], "int64", "ids"),
                   dg.InputSpec([5, 2], "float64", "table"))
    message = error_of(lambda: ProgramRunner(emb).run(
        {}, {"ids": np.array([0, 4, -1, 2]), "table": np.ones((5, 2))}, [emb.outputs[0].name]))
    assert "embedding id -1 at batch position (2,) is outside [0, 5)" in message


def test_the_split_forms_check_against_the_whole_vocabulary():
    from distgraph.runtime.execution.runner import PlanRunner
    from test_vocab_parallel import B, T, V, build

    built, init = build(dg.ProcessMesh([0, 1], ["mp"]))
    plan = dg.passes.plan(built)
    tokens = np.zeros((B, T), dtype=np.int64)
    for field, position, value in (("labels", (1, 3), V), ("tokens", (2, 0), V + 5)):
        feed = {"tokens": tokens.copy(), "labels": tokens.copy()}
        feed[field][position] = value

        def rank(comm, feed=feed):
            runner = PlanRunner(plan, comm)
            runner.run(runner.shard_scope(init), feed, 0)

        what = "label (ignore_index=-100)" if field == "labels" else "embedding id"
        for message in simulated(2, rank):
            assert f"{what} {value} at batch position {position} is outside [0, {V})" in message


# ---- ignore_index ----------------------------------------------------------------------

def ce_oracle(logits, labels, ignore_index=-100):
    """Mean over the labels that are not ignore_index of logsumexp - picked logit."""
    keep = labels != ignore_index
    m = logits.max(-1, keepdims=True)
    lse = np.log(np.exp(logits - m).sum(-1)) + m[..., 0]
    picked = np.take_along_axis(logits, np.where(keep, labels, 0)[..., None], -1)[..., 0]
    return float(((lse - picked) * keep).sum() / max(keep.sum(), 1))


@pytest.mark.parametrize("ignore_index", [-100, 2])
def test_ignored_labels_count_for_nothing(ignore_index):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 3, 6))
    labels = np.array([[0, ignore_index, 2], [ignore_index, 4, 5]])
    prog = ce_program(ignore_index=ignore_index, reduction="mean")
    out = ProgramRunner(prog).run({}, {"logits": logits, "labels": labels},
                                  [prog.outputs[0].name])[prog.outputs[0].name]
    assert float(out) == pytest.approx(ce_oracle(logits, labels, ignore_index), rel=1e-12)
    everything = np.full((2, 3), ignore_index)
    out = ProgramRunner(prog).run({}, {"logits": logits, "labels": everything},
                                  [prog.outputs[0].name])[prog.outputs[0].name]
    assert float(out) == 0.0          # as Paddle: no label to average over gives 0, not NaN


def test_ignore_index_trains_the_same_serially_and_vocabulary_parallel():
    from distgraph.runtime.execution.runner import PlanRunner
    from test_vocab_parallel import batches, build

    data = [(x, np.where(np.arange(y.size).reshape(y.shape) % 3 == 0, -100, y))
            for x, y in batches()]
    built, scope = build()
    runner = ProgramRunner(built.program)
    ref = [float(runner.run(scope, {"tokens": x, "labels": y}, [built.loss_name], s)
                 [built.loss_name]) for s, (x, y) in enumerate(data)]
    built, init = build(dg.ProcessMesh([0, 1], ["mp"]))
    plan = dg.passes.plan(built)
    names = [v.name for v in plan.program.persistables]

    def rank(comm):
        runner = PlanRunner(plan, comm)
        local = runner.shard_scope(init)
        losses = [float(runner.run(local, {"tokens": x, "labels": y}, s)[built.loss_name])
                  for s, (x, y) in enumerate(data)]
        return losses, runner.gather(local, names)

    for losses, params in SimulatedWorld(2).run(rank):
        assert np.allclose(losses, ref, rtol=1e-12, atol=0)
        for name, value in scope.items():
            if "@STEP" not in name:
                assert np.max(np.abs(params[name] - value)) < 1e-10, name


# ---- NaN ----------------------------------------------------------------------------------

NAN_ERROR = ("step 2 (epoch 0, batch 2): the loss is nan; training stopped after this "
             "step's update")


def test_a_nan_loss_stops_training_at_its_step_on_every_rank():
    serial = error_of(lambda: J.mlp_engine(1).fit(J.Regression(nan_at=20), batch_size=8))
    assert serial.startswith(NAN_ERROR) and "Strategy(check_finite=False)" in serial

    def rank(comm):
        engine = J.mlp_engine(2, communicator=comm)
        with BUILD_LOCK:
            engine.prepare(*dg.app.data.DataLoader(J.Regression(), 8).specs(1))
        engine.fit(J.Regression(nan_at=20), batch_size=8)

    assert simulated(2, rank) == [serial] * 2


def test_check_finite_false_trains_on():
    engine = J.mlp_engine(1, strategy=dg.Strategy(check_finite=False))
    losses = engine.fit(J.Regression(nan_at=20), batch_size=8).losses
    assert len(losses) == 8 and np.isfinite(losses[:2]).all() and np.isnan(losses[2:]).all()


@pytest.mark.mpi
def test_a_nan_loss_on_mpi_ranks_raises_what_serial_raises(job_trace):
    serial = error_of(lambda: J.mlp_engine(1).fit(J.Regression(nan_at=20), batch_size=8))
    rc, out = launch(2, "nan")
    assert rc != 0 and rank_errors(out) and set(rank_errors(out)) == {serial}, out
    job_trace.assert_nothing_left(ran_mpi=True)


# ---- ragged samples, the launcher's cluster --------------------------------------------------

class Ragged(J.Regression):
    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return (x[:5] if i == 11 else x), y


def test_a_ragged_sample_names_the_samples_and_shapes():
    with pytest.raises(DistGraphError, match=re.escape(
            "dataset sample 11 field 0 has shape [5] but sample 8 has [8]; samples of a "
            "batch must have equal shapes")):
        J.mlp_engine(1).fit(Ragged(), batch_size=8)


def test_the_engine_takes_the_cluster_of_distgraph_run(monkeypatch):
    monkeypatch.setenv("DISTGRAPH_CLUSTER", str(CLUSTERS / "local4.yaml"))
    assert J.mlp_engine(1).cluster.name == dg.Cluster.from_file(CLUSTERS / "local4.yaml").name
    mine = dg.Cluster.local(2)
    assert J.mlp_engine(1, cluster=mine).cluster is mine          # the script's wins
    monkeypatch.setenv("DISTGRAPH_CLUSTER", str(CLUSTERS / "no-such-file.yaml"))
    with pytest.raises(ResourceFileError, match="no-such-file.yaml"):
        J.mlp_engine(1)


# ---- samples that do not fit the model or the loss ----------------------------------------

class Fields:
    """Samples of ``n_x`` inputs x [8] and a label y (default [4]) of ``label`` dtype (or
    dicts)."""

    def __init__(self, n_x=1, label="float64", as_dict=False, n=16, label_shape=(4,)):
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(n, 8))
        self.y = rng.normal(size=(n, *label_shape)).astype(label)
        self.n_x, self.as_dict = n_x, as_dict

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.as_dict:
            return {"x": self.x[i], "y": self.y[i]}
        return (self.x[i],) * self.n_x + (self.y[i],)


def mlp_fit(data, loss=None):
    dg.seed(0)
    engine = dg.Engine(dg.nn.MLP(8, 16, 4), loss or dg.nn.MSELoss(), dg.optim.SGD(0.01))
    return engine.fit(data, batch_size=8, verbose=0)


@pytest.mark.parametrize("data, loss, error, words", [
    (Fields(n_x=2), None, DistGraphError,
     "dataset samples have 3 field(s) (the last is the label), so the model gets 2 input(s), "
     "but MLP.forward(x) takes 1: return samples of 1 input, then the label"),
    (Fields(as_dict=True), None, DistGraphError,
     "dataset sample 0 is a dict (keys 'x', 'y'); say which keys to feed, in order: the "
     "model's inputs as its forward takes them, then the label: dg.shard_dataloader(data, "
     "mesh, \"dp\", input_keys=[...]) or engine.fit(data, input_keys=[...])"),
    (Fields(label="int64"), None, dg.DTypeError,
     "MSELoss: the label 'label_0' is integer (int64) but the model's output is float64"),
    (Fields(), dg.nn.CrossEntropyLoss(), dg.DTypeError,
     "CrossEntropyLoss: the label 'label_0' is float64, but cross-entropy takes integer "
     "class ids"),
    (Fields(label="int64"), dg.nn.CrossEntropyLoss(), dg.ShapeError,
     "CrossEntropyLoss: each sample's label 'label_0' has shape [4], but its logits have "
     "shape [4] (4 classes), so the label needs shape [], one class id per sample: give "
     "class ids, not one-hot rows or scores (y.argmax(-1))"),
    (Fields(label_shape=(1,)), None, dg.ShapeError,
     "MSELoss: each sample's label 'label_0' has shape [1], but the model's output has "
     "shape [4]; the label needs the output's shape (it is not broadcast): give one target "
     "per output (y of shape [4]), or make the model's last layer output 1 feature"),
    (Fields(label_shape=(4, 1)), None, dg.ShapeError,
     "MSELoss: each sample's label 'label_0' has shape [4, 1], but the model's output has "
     "shape [4]; the label needs the output's shape (it is not broadcast): drop the last "
     "dim (y[..., 0])"),
    (Fields(label_shape=()), None, dg.ShapeError,
     "label 'label_0' has shape [], but the model's output has shape [4]; the label needs "
     "the output's shape (it is not broadcast): give each sample a target of shape [4]"),
])
def test_samples_that_do_not_fit_the_model_or_the_loss_say_how(data, loss, error, words):
    with pytest.raises(error) as info:
        mlp_fit(data, loss)
    assert words in str(info.value)


LABEL_SHAPE = """
    import sys
    import numpy as np
    import distgraph as dg

    class Tokens:
        def __init__(self, label_shape, n=32):
            rng = np.random.default_rng(0)
            self.x = rng.integers(0, 32, size=(n, 16))
            self.y = rng.integers(0, 32, size=(n, *label_shape))
        def __len__(self):
            return len(self.x)
        def __getitem__(self, i):
            return self.x[i], self.y[i]

    label_shape = [int(d) for d in sys.argv[1].split(",")]
    mesh = dg.ProcessMesh([0, 1], dim_names=["dp"])
    model = dg.nn.GPT(vocab_size=32, d_model=16, n_layer=1, n_head=2, max_seq_len=16)
    engine = dg.Engine(model, loss=dg.nn.CrossEntropyLoss(), optimizer=dg.optim.SGD(0.1))
    engine.fit(dg.shard_dataloader(Tokens(label_shape), mesh, shard_dims="dp"), batch_size=8)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("label_shape, fix", [
    ("16,1", "drop the last dim (y[..., 0] or y.reshape(16))"),
    ("16,32", "give class ids, not one-hot rows or scores (y.argmax(-1))"),
    ("15", "give each sample a label of shape [16]"),
])
def test_a_label_of_the_wrong_shape_is_one_line_with_the_fix(tmp_path, label_shape, fix):
    """Logits [16, 32] per sample: a label of shape [16, 1] (or one-hot, or of another
    length) is one line in the user's terms, not the op's internal names."""
    rc, out = run_user(tmp_path, LABEL_SHAPE, 2, label_shape)
    assert rc != 0
    failed = [ln for ln in out.splitlines() if " failed: " in ln]
    shape = "[" + label_shape.replace(",", ", ") + "]"
    assert failed == [
        f"distgraph: ranks 0, 1 failed: ShapeError: CrossEntropyLoss: each sample's label "
        f"'label_0' has shape {shape}, but its logits have shape [16, 32] (32 classes), so "
        f"the label needs shape [16], one class id per position: {fix}"], out
    assert "softmax_cross_entropy" not in out and "matmul" not in out, out


def test_float64_samples_for_a_float32_model_are_cast_and_said_once(capsys):
    dg.set_default_dtype("float32")           # the module's fixture restores it
    casted = mlp_fit(Fields()).losses
    err = capsys.readouterr().err
    assert err == ("distgraph: warning: dataset field 0 (an input) is float64 and is cast to "
                   "float32, the model's dtype; dg.set_default_dtype('float64') computes in "
                   "float64, or give float32 samples\n"
                   "distgraph: warning: dataset field 1 (the label) is float64 and is cast "
                   "to float32, the model's dtype; dg.set_default_dtype('float64') computes "
                   "in float64, or give float32 samples\n")
    data32 = Fields()
    data32.x, data32.y = data32.x.astype(np.float32), data32.y.astype(np.float32)
    assert mlp_fit(data32).losses == casted            # the same numbers as float32 data
    assert capsys.readouterr().err == ""


NAN_TOKEN = """
import numpy as np
import distgraph as dg

class Tokens:
    '''Token ids and next-token labels; sample 5's ids come as floats with a NaN.'''
    def __init__(self, n=32):
        self.x = np.random.default_rng(0).integers(0, 32, size=(n, 17))
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        ids, labels = self.x[i, :-1], self.x[i, 1:]
        if i == 5:
            ids = ids.astype("float32")
            ids[3] = np.nan
        return ids, labels

mesh = dg.ProcessMesh([0, 1], dim_names=["dp"])
dg.seed(0)
model = dg.nn.GPT(vocab_size=32, d_model=16, n_layer=1, n_head=2, max_seq_len=16)
engine = dg.Engine(model, loss=dg.nn.CrossEntropyLoss(), optimizer=dg.optim.SGD(0.1))
engine.fit(dg.shard_dataloader(Tokens(), mesh, shard_dims="dp"), batch_size=8, verbose=0)
"""


@pytest.mark.mpi
def test_a_nan_among_token_ids_names_the_sample_and_field(tmp_path, job_trace):
    """Data parallel on 2 ranks: rank 1 reads sample 5 (rows 4..7 of batch 0), whose ids
    hold a NaN; the job ends naming the sample, the field and the position (not the
    embedding's IndexError), serially alike."""
    said = ("dataset sample 5 field 0 at position [3] is nan, but field 0 holds integers "
            "(ids or labels, as in dataset sample 0): fix or drop that sample")
    rc, out = run_user(tmp_path, NAN_TOKEN, 2)
    assert rc != 0 and said in out and "IndexError" not in out, out
    rc, out = run_user(tmp_path, NAN_TOKEN.replace("dg.shard_dataloader(Tokens(), mesh, "
                                                   "shard_dims=\"dp\")", "Tokens()"), 1)
    assert rc != 0 and said in out, out
    job_trace.assert_nothing_left(ran_mpi=True)
