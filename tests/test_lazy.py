"""dg.LazyGuard: shape-only parameters that plan like eager ones and train, block by block
on each rank, with eager initialisation's numbers; 16-bit default dtypes for planning
(mixed-precision Adam's 16 bytes per parameter, the device's 16-bit GFLOP/s), never for
running on numpy."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import distgraph as dg
from distgraph.initializer import Init
from distgraph.program_builder import build_program
from distgraph.trace import InputSpec

ROOT = Path(__file__).resolve().parent.parent
GPT = dict(vocab_size=64, d_model=32, n_layer=2, n_head=4, max_seq_len=16)


def gpt(lazy: bool, **dims):
    dg.seed(0)
    if not lazy:
        return dg.nn.GPT(**{**GPT, **dims})
    with dg.LazyGuard():
        return dg.nn.GPT(**{**GPT, **dims})


def random_block(rng, shape):
    index = []
    for n in shape:
        a = int(rng.integers(0, n))
        index.append(slice(a, int(rng.integers(a + 1, n + 1))))
    return tuple(index)


@pytest.mark.parametrize("kind", ["normal", "uniform", "constant"])
def test_every_block_equals_that_slice_of_the_whole(kind, monkeypatch):
    import distgraph.initializer as initializer
    monkeypatch.setattr(initializer, "CHUNK", 50)      # runs that span and split chunks
    init = Init(kind, 0.5, key=12345)
    shape = (13, 11, 7)
    whole = init.block(shape, None, "float64")
    rng = np.random.default_rng(0)
    for _ in range(200):
        index = random_block(rng, shape)
        assert np.array_equal(init.block(shape, index, "float64"), whole[index])
    assert np.array_equal(init.block(shape, None, "float32"), whole.astype("float32"))


def test_initialisers_have_their_moments():
    n = 200_000
    normal = Init("normal", 0.02, key=1).block((n,), None, "float64")
    uniform = Init("uniform", 0.5, key=2).block((n,), None, "float64")
    assert abs(normal.mean()) < 1e-3 * 0.02 * 5 and abs(normal.std() / 0.02 - 1) < 0.01
    assert uniform.min() >= -0.5 and uniform.max() < 0.5
    assert abs(uniform.std() - 0.5 / math.sqrt(3)) < 0.005
    other = Init("normal", 0.02, key=2).block((n,), None, "float64")
    assert abs(np.corrcoef(normal, other)[0, 1]) < 0.01        # keys are independent


def test_a_lazy_model_holds_no_values_and_makes_the_eager_numbers():
    eager, lazy = gpt(False), gpt(True)
    rng = np.random.default_rng(1)
    for (name, p), (lazy_name, q) in zip(eager.named_parameters(), lazy.named_parameters()):
        assert name == lazy_name and q.is_lazy and q.shape == p.shape and q.dtype == p.dtype
        assert np.array_equal(q.block(), p.numpy()), name
        index = random_block(rng, p.shape)
        assert np.array_equal(q.block(index), p.numpy()[index]), name
    # Dropout seeds come from the same generator, after the same draws
    assert [d.seed for _, d in eager.named_sublayers() if isinstance(d, dg.nn.Dropout)] == \
        [d.seed for _, d in lazy.named_sublayers() if isinstance(d, dg.nn.Dropout)]


def test_reading_a_lazy_value_says_so():
    model = gpt(True)
    with pytest.raises(dg.DistGraphError, match="is lazy .*LazyGuard.* no values yet"):
        model.lm_head.weight.numpy()
    with pytest.raises(dg.DistGraphError, match="is lazy"):
        model.state_dict()
    model.lm_head.weight.set_value(np.ones(model.lm_head.weight.shape))
    assert not model.lm_head.weight.is_lazy and model.lm_head.weight.numpy().sum() == 32 * 64


def program_of(model, batch=4, seq=16):
    return build_program(model, [InputSpec([batch, seq], "int64", "tokens")],
                         [InputSpec([batch, seq], "int64", "labels")],
                         dg.nn.CrossEntropyLoss(), dg.optim.AdamW(1e-3))


def test_a_lazy_model_traces_searches_and_estimates_as_the_eager_one():
    cluster = dg.Cluster.local(2)
    plans = [dg.passes.plan(program_of(gpt(lazy)), dg.Strategy(auto_mode="full"), cluster)
             for lazy in (False, True)]
    eager, lazy = (p.to_dict() for p in plans)
    for data in (eager, lazy):
        data["search"].pop("solve_time")
        data["search"].pop("build_time")
    assert eager == lazy


class Tokens:
    def __init__(self, n=16, seq=16):
        self.data = np.random.default_rng(1).integers(0, GPT["vocab_size"], size=(n, seq + 1))

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i, :-1].astype(np.int64), self.data[i, 1:].astype(np.int64)


def test_serial_training_of_a_lazy_model_equals_eager(float64):
    results = []
    for lazy in (False, True):
        engine = dg.Engine(gpt(lazy), dg.nn.CrossEntropyLoss(), dg.optim.AdamW(1e-2))
        losses = engine.fit(Tokens(), batch_size=4, epochs=1, verbose=0).losses
        results.append((losses, engine.state_dict()))
    (eager_losses, eager_params), (lazy_losses, lazy_params) = results
    assert lazy_losses == eager_losses
    assert all(np.array_equal(lazy_params[n], eager_params[n]) for n in eager_params)


@pytest.mark.mpi
def test_lazy_training_on_four_ranks_equals_eager_and_never_makes_a_whole_shard():
    """dp x mp = 2 x 2: losses and parameters equal eager training to 1e-10; each rank's
    traced peak stays below the whole of its largest sharded parameter (which an eager
    rank holds, and measures above)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "distgraph.cli", "run", "-n", "4",
                           str(ROOT / "tests" / "mpi_scripts" / "lazy_training.py")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("LAZY-RESULT ")]
    result = json.loads(line.split(" ", 1)[1])
    whole = result["whole_table_bytes"]
    assert len(result["ranks"]) == 4
    for rank in result["ranks"]:
        assert rank["losses"] == result["ranks"][0]["losses"]
        assert rank["loss_error"] <= 1e-10 and rank["param_error"] <= 1e-10, rank
        assert whole / 2 < rank["lazy_peak"] < whole, rank      # its half, never the whole
        assert rank["eager_peak"] > whole, rank


# -- 16-bit planning -------------------------------------------------------------------------

@pytest.fixture(params=["bfloat16", "float16"])
def half(request):
    previous = dg.get_default_dtype()
    dg.set_default_dtype(request.param)
    yield request.param
    dg.set_default_dtype(previous)


def test_sixteen_bit_models_are_planned_not_run(half):
    assert dg.nn.Linear(4, 4).weight.numpy().dtype == half      # values may be 16-bit
    engine = dg.Engine(gpt(True), dg.nn.CrossEntropyLoss(), dg.optim.AdamW(1e-3))
    plan = engine.prepare(*dg.app.data.DataLoader(Tokens(), 4).specs(1))
    assert plan.program.values["lm_head.weight"].dtype == half
    with pytest.raises(dg.DistGraphError, match="16-bit parameters are for planning.*amp="):
        engine.fit(Tokens(), batch_size=4, verbose=0)
    with pytest.raises(dg.DistGraphError, match="no mixed-precision update"):
        build_program(gpt(True), [InputSpec([4, 16], "int64", "tokens")],
                      [InputSpec([4, 16], "int64", "labels")], dg.nn.CrossEntropyLoss(),
                      dg.optim.SGD(0.1))


def test_mixed_precision_adam_keeps_sixteen_bytes_per_parameter(half):
    built = program_of(gpt(True))
    prog = built.program
    psi = sum(math.prod(v.shape) for v in prog.parameters)
    params = sum(v.nbytes for v in prog.persistables if v.is_parameter)
    states = sum(v.nbytes for v in prog.persistables if not v.is_parameter
                 and v.name.rsplit("@", 1)[-1] in ("MASTER", "MOMENT1", "MOMENT2"))
    grads = sum(prog.values[g].nbytes for g in built.grad_names.values())
    assert (params, grads, states) == (2 * psi, 2 * psi, 12 * psi)
    est = dg.passes.estimate(dg.passes.plan(built), dg.Cluster.local(1))
    assert est.processes[0].parameters + est.processes[0].states >= 14 * psi


def test_sixteen_bit_ops_are_priced_at_the_devices_sixteen_bit_rate(half):
    def cluster(gflops):
        return dg.Cluster.from_dict({"machines": [{"hostname": "h", "devices": [
            {"global_id": 0, "type": "GPU", "memory": 80, "memory_bandwidth": 1e9,
             "op_overhead": 0, "gflops": gflops}]}]})
    plan = dg.passes.plan(program_of(gpt(True), batch=64))
    slow = dg.passes.estimate(plan, cluster({"float32": 1000.0, half: 1000.0})).step_time
    fast = dg.passes.estimate(plan, cluster({"float32": 1000.0, half: 4000.0})).step_time
    assert fast < slow / 2           # the matmuls, most of the FLOPs, run 4x faster
