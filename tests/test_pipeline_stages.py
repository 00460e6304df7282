"""Pipeline stages along the data flow: annotating only the parameters of each stage (what
a newcomer writes first) gives contiguous stages whose forward data only moves to later
stages, and trains exactly as serial does (fp64, 1e-10) under every schedule, with fewer
micro-batches than stages too; a plan whose stages form a cycle is a PlanError when it is
planned (prepare, passes.plan, ``distgraph plan``, fit), naming the ops and the stages.

The plans are ``tests/plans.py``'s ``param*`` pipelines: GPT and MLP on 2 and 4 stages,
one process per stage, or two (data or tensor parallel inside the stage)."""

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402
from distgraph.passes.completion import stage_order  # noqa: E402
from distgraph.program_builder import build_program  # noqa: E402
from distgraph.runtime.comm.simulated import SimulatedWorld  # noqa: E402

import plans as P  # noqa: E402
from test_pipeline import BATCH, SCHEDULES, check_equal, run_pipeline, serial  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PARAM_PLANS = [key for key in P.PIPELINE_PLANS if key[1].startswith("param")]
FORWARD = ("forward", "loss")


def ident(key):
    return "-".join(map(str, key))


def prepare(key, micro_batches=4, schedule="1F1B", model=None):
    """The Plan of ``key`` under the strategy, made in this one process."""
    kind = key[0]
    if model is None:
        model = P.build_model(kind)
        P.PIPELINE_PLANS[key].annotate(model)
    engine = dg.Engine(model, P.loss_fn(kind), P.make_optimizer("adamw"),
                       strategy=dg.Strategy(micro_batches=micro_batches, schedule=schedule))
    ins, labels = dg.app.data.DataLoader(P.Dataset(kind, batch=BATCH), BATCH).specs(1)
    return engine.prepare(ins, labels), engine


def stage_count(key) -> int:
    return int(key[1][len("param")])


def expected_stage(key, layer):
    """The stage whose parameters ``layer`` (or a layer above it) holds, None for ops of
    the model itself (the embeddings' sum, the loss)."""
    for s, paths in enumerate(P.PARAM_STAGES[key[0], stage_count(key)]):
        if any(layer == p or layer.startswith(p + ".") for p in paths):
            return s
    return None


# ---- the plan's structure -------------------------------------------------------------

@pytest.mark.parametrize("key", PARAM_PLANS, ids=ident)
def test_parameter_annotations_give_contiguous_stages(key):
    plan, _ = prepare(key)
    n_stages, per_stage = stage_count(key), key[2] // stage_count(key)
    assert [m.process_ids for m in plan.stages] == \
        [list(range(s * per_stage, (s + 1) * per_stage)) for s in range(n_stages)]
    stage = {m: s for s, m in enumerate(plan.stages)}
    ops = plan.program.ops
    made_by = {o.name: op for op in ops if op.role in FORWARD for o in op.outputs}
    for op in ops:
        if op.role not in FORWARD:
            continue
        mine = stage[op.dist_attr.mesh]
        want = expected_stage(key, op.layer)
        assert want is None or mine == want, (op.type, op.layer, mine, want)
        for v in op.inputs:             # no forward edge from a later stage to an earlier one
            if v.name in made_by:
                theirs = stage[made_by[v.name].dist_attr.mesh]
                assert theirs <= mine, (f"{made_by[v.name].type} ({made_by[v.name].layer}) "
                                        f"on stage {theirs} feeds {op.type} ({op.layer}) on "
                                        f"stage {mine}")
    loss = next(op for op in reversed(ops) if op.role == "loss")
    assert stage[loss.dist_attr.mesh] == n_stages - 1
    if key[1].endswith("_dp"):          # every stage splits the batch, not only the first
        products = [op for op in ops if op.role == "forward" and op.type == "matmul"
                    and op.inputs[1].is_parameter]
        assert {stage[op.dist_attr.mesh] for op in products} >= set(range(1, n_stages))
        for op in products:
            assert op.dist_attr.input_specs[0].dims[0] == "dp", (op.layer, op.dist_attr)
    for op in ops:                      # backward ops with their forward op, updates with
        if op.role == "backward" and op.forward_op is not None:      # their parameter
            assert op.dist_attr.mesh == op.forward_op.dist_attr.mesh
        if op.role == "optimize" and op.inputs[0].is_parameter:
            assert op.dist_attr.mesh == op.inputs[0].dist_attr.mesh


def test_the_residual_adds_of_a_block_without_parameters_run_on_its_stage():
    """The issue's plan: wte, wpe and blocks.0 on [0], the rest on [1]. The adds of
    blocks.1 read stage 0's activation and stage 1's; they run on stage 1."""
    plan, _ = prepare(("gpt", "param2", 2))
    adds = [op for op in plan.program.ops if op.role == "forward" and op.type == "add"
            and op.layer == "blocks.1"]
    assert len(adds) == 2
    assert all(op.dist_attr.mesh.process_ids == [1] for op in adds)
    crossing = [p.value for p in plan.reshards() if p.steps and p.steps[0].kind == "send_recv"]
    assert len(crossing) == 3, crossing   # the activation forward, its gradient's two parts back


def test_a_mesh_and_its_sub_mesh_meet_on_the_containing_mesh():
    """dp x mp with fc2 on a row of the mesh: the residual add that reads both runs on
    the whole mesh (no pipeline, so no cycle), and trains as serial does."""
    mesh = dg.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])

    class Residual(dg.nn.Layer):
        def __init__(self, placed):
            super().__init__()
            self.fc1, self.fc2, self.placed = dg.nn.Linear(8, 8), dg.nn.Linear(8, 8), placed
            if placed:
                dg.shard_tensor(self.fc1.weight, mesh, [None, "mp"])
                dg.shard_tensor(self.fc2.weight, mesh.get_mesh_with_dim("dp", 0), [None, None])

        def forward(self, x):
            if self.placed:
                x = dg.shard_tensor(x, mesh, ["dp", None, None])
            h = dg.ops.relu(self.fc1(x))
            return h + self.fc2(h)

    class Data:
        def __init__(self):
            rng = np.random.default_rng(0)
            self.x, self.y = rng.normal(size=(16, 4, 8)), rng.normal(size=(16, 4, 8))

        def __len__(self):
            return 16

        def __getitem__(self, i):
            return self.x[i], self.y[i]

    def model(placed):
        dg.seed(0)
        return Residual(placed)

    def fit(model, comm=None):
        engine = dg.Engine(model, dg.nn.MSELoss(), dg.optim.AdamW(0.01), communicator=comm)
        with P.BUILD_LOCK:
            plan = engine.prepare(*dg.app.data.DataLoader(Data(), 8).specs(1))
        return engine.fit(Data(), batch_size=8).losses, engine.state_dict(), plan

    dg.set_default_dtype("float64")
    try:
        reference = fit(model(False))
        models = [model(True) for _ in range(4)]
        results = SimulatedWorld(4, timeout=60).run(lambda comm: fit(models[comm.rank], comm))
    finally:
        dg.set_default_dtype("float32")
    last_add = [op for op in results[0][2].program.ops if op.role == "forward"][-1]
    assert last_add.type == "add" and last_add.dist_attr.mesh == mesh
    for losses, params, _ in results:
        assert np.max(np.abs(np.array(losses) - reference[0])) <= 1e-10
        assert all(np.max(np.abs(params[k] - reference[1][k])) <= 1e-10 for k in params)


# ---- training: equal to serial under every schedule ---------------------------------------

UP_TO_4 = [key for key in PARAM_PLANS if key[2] <= 4 and key[0] not in P.VIRTUAL_KINDS]
TRAIN = [(key, 4, s) for key in UP_TO_4 for s in SCHEDULES]
# fewer micro-batches than stages: 2 on 4 stages, and one micro-batch through the pipeline
TRAIN += [(key, 2, s) for key in UP_TO_4 if stage_count(key) == 4 for s in SCHEDULES]
TRAIN += [(("gpt", "param4", 4), 1, "1F1B"), (("gpt", "param2", 2), 1, "ZB")]
# 4 stages of 2 processes (8 threads; GPT tensor parallel on 8 threads is left to the
# structure test above: it takes half a minute here)
TRAIN += [(("mlp4", name, 8), m, s) for name in ("param4_dp", "param4_mp")
          for m, s in [(4, "1F1B"), (2, "ZB"), (8, "FThenB")]]
TRAIN += [(("gpt", "param4_dp", 8), 4, "ZB")]


@pytest.mark.slow
@pytest.mark.parametrize("key,micro_batches,schedule", TRAIN,
                         ids=lambda v: ident(v) if isinstance(v, tuple) else str(v))
def test_parameter_annotated_pipelines_train_like_serial(float64, key, micro_batches,
                                                         schedule):
    results = run_pipeline(key, micro_batches, schedule)
    check_equal(results, serial(key[0]))
    plan = results[0][2].plan()
    assert plan.micro_batches == micro_batches and len(plan.stages) == stage_count(key)


# ---- a cycle is refused when planned --------------------------------------------------------

def head_back_on_stage_0(model):
    """GPT on two stages by shard_op, the head put back on stage 0 by mistake."""
    first, second = dg.ProcessMesh([0]), dg.ProcessMesh([1])
    P.PIPELINE_PLANS["gpt", "param2", 2].annotate(model)
    model.hooks.wraps["head"] = lambda fn: dg.shard_op(fn, first)
    model.hooks.wraps["block1"] = lambda fn: dg.shard_op(fn, second)
    return model


def check_cycle_message(text):
    assert "the pipeline stages form a cycle" in text, text
    assert "stage 0 -> 1: add (blocks.0) feeds layer_norm (blocks.1.ln1)" in text, text
    assert "stage 1 -> 0: add (blocks.1) feeds layer_norm (ln_f)" in text, text
    assert "0: ProcessMesh([0]" in text and "1: ProcessMesh([1]" in text, text
    assert "place layer_norm (ln_f) on stage 1 or later" in text, text


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_a_cycle_of_stages_is_a_plan_error_when_prepared(micro_batches):
    with pytest.raises(dg.PlanError) as e:
        prepare(("gpt", "param2", 2), micro_batches,
                model=head_back_on_stage_0(P.build_model("gpt")))
    check_cycle_message(str(e.value))


def test_a_cycle_of_stages_is_a_plan_error_of_passes_plan():
    model = head_back_on_stage_0(P.build_model("gpt"))
    ins, labels = dg.app.data.DataLoader(P.Dataset("gpt"), P.BATCH).specs(1)
    built = build_program(model, ins, labels, dg.nn.CrossEntropyLoss(), dg.optim.SGD(0.1))
    with pytest.raises(dg.PlanError) as e:
        dg.passes.plan(built, dg.Strategy(micro_batches=2, schedule="ZB"))
    check_cycle_message(str(e.value))


def test_fit_on_a_cycle_is_a_plan_error_and_leaves_no_plan():
    engine = dg.Engine(head_back_on_stage_0(P.build_model("gpt")), dg.nn.CrossEntropyLoss(),
                       dg.optim.SGD(0.1), strategy=dg.Strategy(micro_batches=4))
    with pytest.raises(dg.PlanError) as e:
        engine.fit(P.Dataset("gpt"), batch_size=P.BATCH)
    check_cycle_message(str(e.value))
    with pytest.raises(dg.DistGraphError, match="no train program yet"):
        engine.plan()


CYCLE_SCRIPT = textwrap.dedent("""
    import sys
    import distgraph as dg
    sys.path.insert(0, {tests!r})
    import plans as P
    from test_pipeline_stages import head_back_on_stage_0

    model = head_back_on_stage_0(P.build_model("gpt"))
    engine = dg.Engine(model, P.loss_fn("gpt"), dg.optim.SGD(0.1),
                       strategy=dg.Strategy(micro_batches=4, schedule="1F1B"))
    engine.fit(P.Dataset("gpt"), batch_size=P.BATCH)
""")


def cycle_script(tmp_path):
    script = tmp_path / "cyclic.py"
    script.write_text(CYCLE_SCRIPT.format(tests=str(ROOT / "tests")))
    return script


def test_distgraph_plan_prints_the_cycle(tmp_path):
    script = cycle_script(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "distgraph.cli", "plan", str(script), "-n", "2"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.startswith(f"distgraph plan: {script} cannot be planned: PlanError: ")
    assert "Traceback" not in proc.stderr
    check_cycle_message(proc.stderr)


@pytest.mark.mpi
def test_distgraph_run_on_a_cycle_fails_at_once_on_every_rank(tmp_path):
    """Every rank plans, refuses and says why; none waits for the communication timeout.
    (The first rank to fail aborts the job, so the other is named only when it failed
    before that.)"""
    env = dict(os.environ, OMP_NUM_THREADS="1", DISTGRAPH_COMM_TIMEOUT="120", TMPDIR=str(tmp_path))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "distgraph.cli", "run", "-n", "2",
                           str(cycle_script(tmp_path))], capture_output=True, text=True,
                          timeout=240, env=env, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and time.monotonic() - start < 60, out[-3000:]
    assert re.search(r"(rank [01]|ranks 0, 1) failed: PlanError: the pipeline stages form "
                     r"a cycle", out), out[-3000:]
    check_cycle_message(out)


# ---- the stage order itself -------------------------------------------------------------

def test_stage_order_follows_the_data_not_the_program_order():
    """A stage-1 parameter read first in program order (a scale computed up front) does
    not make its mesh stage 0: the stages follow the data."""
    a, b = dg.ProcessMesh([0]), dg.ProcessMesh([1])

    class Early(dg.nn.Layer):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = dg.nn.Linear(4, 4), dg.nn.Linear(4, 4)
            dg.shard_tensor(self.fc1.weight, a, [None, None])
            dg.shard_tensor(self.fc2.weight, b, [None, None])
            dg.shard_tensor(self.fc2.bias, b, [None])

        def forward(self, x):
            w = self.fc2.weight * 2.0               # runs on b, before anything on a
            return dg.ops.relu(self.fc1(x)) @ w + self.fc2.bias

    built = build_program(Early(), [dg.InputSpec([4, 4], name="x")],
                          [dg.InputSpec([4, 4], name="y")], dg.nn.MSELoss(), dg.optim.SGD(0.1))
    plan = dg.passes.plan(built, dg.Strategy(micro_batches=2))
    assert plan.stages == (a, b)
    forward = [op for op in plan.program.ops if op.role == "forward"]
    assert [op.type for op in forward[:2]] == ["full", "multiply"]
    assert forward[1].dist_attr.mesh == b
    product = next(op for op in forward if op.type == "matmul" and not op.layer)
    assert product.dist_attr.mesh == b             # relu's result on a, w on b: the later


def test_find_cycle_names_the_edges_around_it():
    edges = {(s, d): stage_order.StageEdge(s, d, i, i + 1)
             for i, (s, d) in enumerate([(0, 1), (1, 2), (2, 1)])}
    assert [(e.src, e.dst) for e in stage_order.find_cycle(edges)] == [(1, 2), (2, 1)]
    del edges[2, 1]
    assert stage_order.find_cycle(edges) is None
    assert stage_order.order(3, [(1, 2), (2, 0)]) == [1, 2, 0]
    assert stage_order.order(3, [(1, 2), (2, 1)]) == [0, 1, 2]    # a cycle: first use


def test_meshes_that_share_processes_are_one_stage():
    """One process set under two sets of dim names, and a mesh with its sub-mesh, are one
    stage each; partly overlapping meshes stay apart."""
    a, a2 = dg.ProcessMesh([0, 1], ["dp"]), dg.ProcessMesh([0, 1], ["mp"])
    whole = dg.ProcessMesh([[2, 3], [4, 5]], ["dp", "mp"])
    row, b, c = whole.get_mesh_with_dim("dp", 1), dg.ProcessMesh([6, 7]), dg.ProcessMesh([7, 8])
    assert stage_order.groups([a, row, b, a2, whole, c]) == [[a, a2], [row, whole], [b], [c]]
