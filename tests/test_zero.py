"""ZeRO for any data-parallel size (passes/transforms/zero.py): the split dim is the one
with the least padding (brute force), padded rows stay exactly zero through every update
kernel (each run padded against unpadded), a data-parallel size that divides no dim of
the model pads, splits the states evenly and prices them as the runtime holds them, and
training equals serial training: on SimulatedWorld threads here, on real MPI ranks (3
and 4, a model none of whose dims 3 or 4 divides, ZeRO levels 1-3, Adam and SGD) and
across a checkpoint saved at dp 3 and resumed at dp 2 and 4 in the mpi tests below."""

import itertools
import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import distgraph as dg
from distgraph.passes.transforms.zero import zero_split
from distgraph.placement import ShardSpec
from distgraph.program_builder import build_program
from distgraph.registry import KernelContext, get_op
from distgraph.runtime.comm.simulated import SimulatedWorld

SCRIPT = Path(__file__).parent / "mpi_scripts" / "zero_padded.py"
TOLERANCE = 1e-10
DIMS = (7, 10, 5)          # no dim divisible by 3 or 4


# -- the split ----------------------------------------------------------------------------

def least_padding(spec, shape, mesh, n):
    """Brute force over every dim: (padded elements, whether split already, dim) of each
    that ZeRO may split (a free dim, padded; a split one where dp and its mesh dims divide
    it); the least, free dims first on ties; where there is none, a split dim padded."""
    options, last_resort = [], []
    for d, size in enumerate(shape):
        rest = math.prod(shape) // size if size else 0
        ways = n * (mesh.dim_size(spec.dims[d]) if spec.dims[d] else 1)
        extra = (-(-size // ways) * ways - size) * rest
        if spec.dims[d] is None or extra == 0:
            options.append((extra, int(spec.dims[d] is not None), d))
        else:
            last_resort.append((extra, 1, d))
    return min(options or last_resort) if options or last_resort else None


@pytest.mark.parametrize("n", [2, 3, 4, 12])
def test_the_split_dim_is_the_one_with_the_least_padding(n):
    mesh = dg.ProcessMesh(np.arange(n * 2).reshape(n, 2).tolist(), ["dp", "mp"])
    sizes = (1, 2, 5, 7, 12, 20, 24)
    cases = [(shape, ShardSpec(dims)) for shape in itertools.product(sizes, repeat=2)
             for dims in ([None, None], ["mp", None], [None, "mp"])]
    cases += [((size,), ShardSpec(dims)) for size in sizes for dims in ([None], ["mp"])]
    for shape, spec in cases:
        if any(e is not None and s % 2 for e, s in zip(spec.dims, shape)):
            continue
        z, want = zero_split(spec, shape, mesh, "dp"), least_padding(spec, shape, mesh, n)
        extra, split, d = want
        assert (z.dim, math.prod(z.padded) - math.prod(shape)) == (d, extra), (shape, spec)
        assert z.padded[d] % (n * (2 if split else 1)) == 0
        assert z.padded[:d] + z.padded[d + 1:] == shape[:d] + shape[d + 1:]
        assert z.spec.dims[d] == (("mp", "dp") if split else "dp") and z.pads == (extra > 0)
        assert z.spec.dims[:d] + z.spec.dims[d + 1:] == spec.dims[:d] + spec.dims[d + 1:]
    assert zero_split(ShardSpec([]), (), mesh, "dp") is None


def test_a_dim_the_size_divides_is_split_unpadded_as_before():
    """Today's rule is the case of no padding: the first free dim dp divides."""
    mesh = dg.ProcessMesh([0, 1, 2], ["dp"])
    z = zero_split(ShardSpec([None, None, None]), (5, 12, 6), mesh, "dp")
    assert (z.dim, z.padded, z.pads) == (1, (5, 12, 6), False)
    assert zero_split(ShardSpec(["dp", None]), (6, 6), mesh, "dp") is None   # split there
    assert zero_split(ShardSpec([None]), (6,), dg.ProcessMesh([0], ["dp"]), "dp") is None


# -- the kernels keep padded rows zero ----------------------------------------------------

UPDATES = {     # op, attrs, states, dtype of the parameter
    "sgd": ("sgd_update", {"momentum": 0.0}, 1, "float64"),
    "sgd momentum": ("sgd_update", {"momentum": 0.9}, 1, "float64"),
    "adam": ("adam_update", dict(beta1=0.9, beta2=0.999, epsilon=1e-8, weight_decay=0.0), 2,
             "float64"),
    "adamw": ("adam_update", dict(beta1=0.9, beta2=0.999, epsilon=1e-8, weight_decay=0.1), 2,
              "float32"),
    "mixed adam": ("mixed_adam_update", dict(beta1=0.9, beta2=0.95, epsilon=1e-8,
                                             weight_decay=0.1), 3, "float16"),
}


@pytest.mark.parametrize("shape,axis,size", [((5, 7), 0, 6), ((5, 7), 1, 9),
                                             ((301, 230), 1, 232)])   # > one Adam block
@pytest.mark.parametrize("name", list(UPDATES))
def test_padded_rows_stay_exactly_zero_through_every_update(name, shape, axis, size):
    """Oracle: the same kernel on the unpadded arrays. Three steps on a zero-padded
    parameter, gradient and states: the logical part equals the unpadded run bit for bit,
    and every padded entry of the parameter and the states is exactly zero."""
    op, attrs, n_states, dtype = UPDATES[name]
    kernel, ctx = get_op(op).kernel, KernelContext(np)
    rng = np.random.default_rng(0)
    padded_shape = tuple(size if d == axis else s for d, s in enumerate(shape))
    inside = tuple(slice(0, s) for s in shape)

    def pad(a):
        out = np.zeros(padded_shape, a.dtype)
        out[inside] = a
        return out

    param = rng.normal(size=shape).astype(dtype)
    states = [np.zeros(shape, "float32" if op == "mixed_adam_update" else dtype)
              for _ in range(n_states)]
    if op == "mixed_adam_update":
        states[0][...] = param          # the float32 master starts as the parameter
    plain = [param, *states]
    padded = [pad(a) for a in plain]
    for step in range(1, 4):
        grad = rng.normal(size=shape).astype(dtype)
        lr = np.array(1e-2)
        extra = [np.array(step, "int64")] if op != "sgd_update" else []
        for arrays, g in ((plain, grad), (padded, pad(grad))):
            kernel(ctx, arrays[0], g, *arrays[1:], *extra, lr, **attrs)
    for a, b in zip(plain, padded):
        assert np.array_equal(b[inside], a), name
        rest = b.copy()
        rest[inside] = 0
        assert not rest.any(), f"{name}: a padded entry moved"


# -- planning: padded, split evenly, priced as held --------------------------------------

def mlp_built(n, level=2, optimizer=None):
    dg.seed(0)
    mesh = dg.ProcessMesh(list(range(n)), ["dp"])
    model, opt = dg.parallelize(dg.nn.MLP(*DIMS), mesh, {"dp_config": {"sharding_level": level}},
                                optimizer=optimizer or dg.optim.Adam(1e-2))
    return build_program(model, [dg.InputSpec([12, DIMS[0]], name="x")],
                         [dg.InputSpec([12, DIMS[2]], name="y")], loss=dg.nn.MSELoss(),
                         optimizer=opt)


def test_a_size_that_divides_no_dim_pads_every_tensor_and_splits_its_states_evenly():
    """On dp 3 every parameter of the MLP is padded on its least-padding dim (fc1.weight
    [7, 10]: 2 columns of 7, not 2 rows of 10), its gradient reduce-scattered and its new
    value all-gathered at the padded size, and each process holds a third of every padded
    state; the estimate's states are those bytes."""
    plan = dg.passes.plan(mlp_built(3), dg.Strategy(), dg.Cluster.local(3))
    padded = {"fc1.weight": (7, 12), "fc1.bias": (12,), "fc2.weight": (12, 10 // 2),
              "fc2.bias": (6,)}
    for name, shape in padded.items():
        for suffix in ("MOMENT1", "MOMENT2"):
            state = plan.program.values[f"{name}@{suffix}"]
            assert (state.shape, state.logical_shape) == (shape, plan.program.values[name].shape)
    for pid in range(3):
        local = plan.local(pid)
        states = [v for v in local.program.persistables if "@MOMENT" in v.name]
        assert sorted(v.shape for v in states) == sorted(
            tuple(s // 3 if d == (1 if n == "fc1.weight" else 0) else s
                  for d, s in enumerate(shape)) for n, shape in padded.items() for _ in "12")
        kinds = {(p.value, s.kind) for p in local.points() for s in p.steps}
        for name, shape in padded.items():
            assert (f"{name}@GRAD@PADDED", "reduce_scatter") in kinds
            assert (f"{name}@PADDED@OUT", "all_gather") in kinds
        expected = sum(v.nbytes for v in local.program.persistables if not v.is_parameter)
        assert plan.estimate.processes[pid].states == expected
    itemsize = 8 if dg.get_default_dtype() == "float64" else 4
    assert plan.estimate.processes[0].states >= 2 * itemsize * sum(
        math.prod(s) for s in padded.values()) // 3


def test_level_3_stores_the_padded_parameters_split_and_reads_them_gathered():
    plan = dg.passes.plan(mlp_built(3, level=3), dg.Strategy(), dg.Cluster.local(3))
    program = plan.program
    for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):
        v = program.values[name]
        assert v.padded_from is not None and "dp" in v.dist_attr.spec.mesh_dims()
        readers = [op for op in program.ops if v in op.inputs]
        assert {op.type for op in readers if op.role != "optimize"} == {"slice"}
    forward = [op for op in program.ops if op.type == "slice" and op.role == "forward"]
    assert len(forward) == 4
    local = plan.local(0).program.values
    for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):     # a third each
        v = program.values[name]
        assert 3 * math.prod(local[name].shape) == math.prod(v.shape) > math.prod(v.padded_from)


def test_level_3_stores_every_parameter_split_over_dp_whatever_the_shapes():
    """dp x mp of 2 x 2, fc1 column-wise and fc2 row-wise: the dims split over mp that 4
    divides are split over (mp, dp) unpadded, fc2.bias (5) is padded to 6; every
    parameter and state is held split over dp, gathered where it is read."""
    dg.seed(0)
    mesh = dg.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
    model, opt = dg.parallelize(
        dg.nn.MLP(7, 12, 5), mesh, {"dp_config": {"sharding_level": 3}, "mp_config": {
            "parallelize_plan": {"fc1": dg.ColWiseParallel(), "fc2": dg.RowWiseParallel()}}},
        optimizer=dg.optim.Adam(1e-2))
    built = build_program(model, [dg.InputSpec([4, 7], name="x")],
                          [dg.InputSpec([4, 5], name="y")], loss=dg.nn.MSELoss(), optimizer=opt)
    program = dg.passes.plan(built, dg.Strategy()).program
    specs = {v.name: (str(v.dist_attr.spec), v.padded_from) for v in program.persistables
             if v.shape}
    assert specs["fc1.weight"] == ("[None, (mp,dp)]", None)
    assert specs["fc1.bias"] == specs["fc1.bias@MOMENT2"] == ("[(mp,dp)]", None)
    assert specs["fc2.weight"] == ("[(mp,dp), None]", None)
    assert specs["fc2.bias"] == specs["fc2.bias@MOMENT1"] == ("[dp]", (5,))


def test_exports_read_logical_shapes():
    """A ZeRO-3 GPT on dp 3 (parameters stored padded) reads to the frameworks as the
    same plan at level 2 (parameters whole): the same weight kinds, the same torchtitan
    configuration; Megatron's refusal names the weight's own shape."""
    from distgraph.plan.styles import weight_kinds

    plans = {}
    for level in (2, 3):
        dg.seed(0)
        model, opt = dg.parallelize(
            dg.nn.GPT(vocab_size=64, d_model=32, n_layer=2, n_head=4, max_seq_len=8),
            dg.ProcessMesh([0, 1, 2], ["dp"]), {"dp_config": {"sharding_level": level}},
            optimizer=dg.optim.AdamW(1e-3))
        built = build_program(model, [dg.InputSpec([6, 8], "int64", "tokens")],
                              [dg.InputSpec([6, 8], "int64", "labels")],
                              loss=dg.nn.CrossEntropyLoss(), optimizer=opt)
        plans[level] = dg.passes.plan(built, dg.Strategy())
    assert plans[3].program.values["wpe.weight"].padded_from == (8, 32)
    assert weight_kinds(plans[3].program) == weight_kinds(plans[2].program)
    assert plans[3].export("torchtitan") == plans[2].export("torchtitan")
    with pytest.raises(dg.DistGraphError, match=r"wpe.weight \[8, 32\] is split over"):
        plans[3].export("megatron")


def test_where_the_size_divides_nothing_is_padded():
    """A model whose dims dp divides is planned as before: no pad, no slice."""
    dg.seed(0)
    mesh = dg.ProcessMesh([0, 1], ["dp"])
    model, opt = dg.parallelize(dg.nn.MLP(8, 16, 4), mesh, {"dp_config": {"sharding_level": 2}},
                                optimizer=dg.optim.Adam(1e-2))
    built = build_program(model, [dg.InputSpec([4, 8], name="x")], [dg.InputSpec([4, 4], name="y")],
                          loss=dg.nn.MSELoss(), optimizer=opt)
    program = dg.passes.plan(built, dg.Strategy()).program
    assert not {op.type for op in program.ops} & {"pad", "slice"}
    assert all(v.padded_from is None for v in program.values.values())


def test_the_search_prices_the_padded_split_as_the_estimate_does():
    """A GPT on 3 processes (most dims not divisible by 3) searched with ZeRO: the
    search's report and the estimate agree within 1%, as for every plan
    (tests/test_one_price.py)."""
    dg.seed(0)
    model = dg.nn.GPT(vocab_size=128, d_model=64, n_layer=2, n_head=4, max_seq_len=16)
    built = build_program(model, [dg.InputSpec([12, 16], "int64", "tokens")],
                          [dg.InputSpec([12, 16], "int64", "labels")],
                          loss=dg.nn.CrossEntropyLoss(), optimizer=dg.optim.AdamW(1e-3))
    plan = dg.passes.plan(built, dg.Strategy(auto_mode="full", recompute=False, sharding=True,
                                             sequence_parallel=False), dg.Cluster.local(3),
                          ranks=())
    assert any(op.type == "pad" for op in plan.program.ops)
    assert plan.search.step_time == pytest.approx(plan.estimate.step_time, rel=0.01)
    assert plan.search.peak_memory == pytest.approx(plan.estimate.peak_memory, rel=0.01)


# -- training, in threads ------------------------------------------------------------------

class Rows:
    def __init__(self, n):
        rng = np.random.default_rng(0)
        self.x, self.y = rng.normal(size=(n, DIMS[0])), rng.normal(size=(n, DIMS[2]))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


LOCK = threading.Lock()      # tracing keeps module state: threads build one at a time


def fitted(level, comm, n):
    with LOCK:
        dg.seed(0)
        model, opt = dg.nn.MLP(*DIMS), dg.optim.AdamW(1e-2)
        if comm is not None:
            model, opt = dg.parallelize(model, dg.ProcessMesh(list(range(n)), ["dp"]),
                                        {"dp_config": {"sharding_level": level}}, optimizer=opt)
        engine = dg.Engine(model, dg.nn.MSELoss(), opt, communicator=comm)
        engine.prepare(*dg.app.data.DataLoader(Rows(24), 12).specs(1))
    history = engine.fit(Rows(24), batch_size=12, epochs=2, verbose=0)
    return history.losses, engine.state_dict(), engine.optimizer_state_dict()


@pytest.mark.parametrize("level,n", [(1, 3), (3, 3), (2, 4)])
def test_training_equals_serial_with_every_tensor_padded(float64, level, n):
    """Threads of one process (SimulatedWorld); the states as the model sees them
    (``optimizer_state_dict``) have their logical shapes."""
    losses, params, states = fitted(level, None, n)
    for got in SimulatedWorld(n, timeout=60).run(lambda c: fitted(level, c, n)):
        assert max(abs(a - b) for a, b in zip(got[0], losses)) <= TOLERANCE
        assert max(float(np.max(np.abs(got[1][k] - params[k]))) for k in params) <= TOLERANCE
        assert sorted(got[2]) == sorted(states)
        for k in states:
            assert got[2][k].shape == states[k].shape
            assert float(np.max(np.abs(got[2][k] - states[k]))) <= TOLERANCE


# -- real MPI ranks --------------------------------------------------------------------------

def run_script(n, *args):
    proc = subprocess.run([sys.executable, "-m", "distgraph.cli", "run", "-n", str(n),
                           str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ZERO-RESULT ")]
    assert len(lines) == 1, proc.stdout[-3000:]
    return json.loads(lines[0].split(" ", 1)[1])


def check_ranks(ranks, n):
    assert len(ranks) == n
    for mine in ranks:
        assert max(mine["loss"], mine["param"], mine["state"], mine.get("valid", 0)) \
            <= TOLERANCE, mine
        assert "state_names" not in mine, mine


@pytest.mark.mpi
@pytest.mark.parametrize("n,cases", [
    (3, ["1:adam", "2:adam", "3:adam", "1:sgd", "3:sgd", "s:adam"]),
    (4, ["1:adam", "3:sgd", "2:adam:mp", "3:adam:mp", "2:sgd:mp12", "3:adam:mp12"]),
    (6, ["2:adam:pp", "3:adam:pp"])])
def test_training_equals_serial_on_mpi_ranks(n, cases):
    """On 3 ranks, 4 (dp alone; 2 x 2 dp x mp, fc1.bias padded over (mp, dp), or with a
    hidden size of 12 split over both unpadded) and 6 (two pipeline stages of dp 3, two
    micro-batches): every rank's losses, parameters, optimizer states and validation
    losses after each epoch (the values moved to evaluation's plan and back) equal
    serial training (float64, 1e-10), and the bytes of the states each rank's runtime
    holds equal the plan's estimate for its process."""
    report = run_script(n, "train", *cases)
    assert report["world"] == n and sorted(report["cases"]) == sorted(cases)
    for case, ranks in report["cases"].items():
        check_ranks(ranks, n)
        for mine in ranks:
            assert mine["steps"] == 6 and mine["pads"] > 0, case
            assert mine["held_states"] == mine["estimated_states"], (case, mine)


@pytest.mark.mpi
@pytest.mark.parametrize("case,saved,resumed", [("2:adam", 3, (2, 4)), ("3:adam", 3, (2, 4)),
                                                ("2:sgd", 4, (3,))])
def test_a_checkpoint_resumes_at_another_data_parallel_size(tmp_path, case, saved, resumed):
    """Saved padded at dp 3 (as logical shapes), loaded at dp 2 and 4 (padded otherwise),
    and saved at dp 4 (fc2.bias, 5 padded to 8: the last rank's block is all padding,
    written by none) loaded at dp 3: the second epoch's losses and the final parameters
    and states equal the serial run of both epochs."""
    assert run_script(saved, "save", tmp_path / "ckpt", case)["saved"] == 3
    meta = json.loads((tmp_path / "ckpt" / "metadata.json").read_text())
    moment = meta["tensors"]["fc2.bias@VELOCITY" if "sgd" in case else "fc1.weight@MOMENT1"]
    assert moment["shape"] == ([DIMS[2]] if "sgd" in case else [DIMS[0], DIMS[1]])
    covered = sum(math.prod(shard["shape"]) for shard in moment["shards"])
    assert covered == math.prod(moment["shape"])        # each element once, no padding
    for n in resumed:
        report = run_script(n, "resume", tmp_path / "ckpt", case)
        check_ranks(report["ranks"], n)
        assert all(mine["steps"] == 3 for mine in report["ranks"])
