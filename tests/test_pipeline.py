"""Micro-batched pipelines on the actor runtime (SimulatedWorld threads): every plan and
schedule trains exactly as serial full-batch training does (fp64, 1e-10), the schedules
are the ones the buffers and priorities define, a stage keeps at most its share of
micro-batches alive, dropout masks equal the full batch's, every Engine mode works, and
failures name the rank and the task."""

import dataclasses
import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402
from distgraph.program_builder import build_program  # noqa: E402
from distgraph.runtime.comm.simulated import SimulatedWorld  # noqa: E402

import plans as P  # noqa: E402

BATCH = 16      # 8 micro-batches of 2 rows: one per process of a 2-way data-parallel stage
SCHEDULES = ("FThenB", "1F1B", "ZB")
ALL = {**P.PLANS, **P.PIPELINE_PLANS}


def train(model, kind, comm=None, strategy=None, batch=BATCH):
    """(losses, global parameters, engine) after P.STEPS steps."""
    engine = dg.Engine(model, P.loss_fn(kind), P.make_optimizer("adamw"),
                       strategy=strategy or dg.Strategy(), communicator=comm)
    ins, labels = dg.app.data.DataLoader(P.Dataset(kind, batch=batch), batch).specs(1)
    with P.BUILD_LOCK:
        engine.prepare(ins, labels)
    history = engine.fit(P.Dataset(kind, batch=batch), batch_size=batch, epochs=1)
    return history.losses, engine.state_dict(), engine


_SERIAL: dict = {}


def serial(kind, dropout=0.0):
    key = (kind, dropout)
    if key not in _SERIAL:
        _SERIAL[key] = train(P.build_model(kind, dropout=dropout), kind)[:2]
    return _SERIAL[key]


def run_pipeline(key, micro_batches, schedule, profile=None, dropout=0.0, virtual=1):
    """Every rank's (losses, params, engine, merged timeline or None) for plan ``key``
    under the strategy. M = 1 runs on the actor runtime too (profile=True makes a
    one-micro-batch plan record a timeline)."""
    plan = ALL[key]
    kind, n = key[0], key[2]
    models = [P.build_model(kind, dropout=dropout) for _ in range(n)]
    for m in models:
        plan.annotate(m)
    strategy = dg.Strategy(micro_batches=micro_batches, schedule=schedule,
                           profile=micro_batches == 1 if profile is None else profile,
                           virtual_stages=virtual)

    def rank(comm):
        losses, params, engine = train(models[comm.rank], kind, comm, strategy)
        return losses, params, engine, engine.timeline() if strategy.profile else None

    return SimulatedWorld(n, timeout=60).run(rank)


def check_equal(results, reference):
    for rank, (losses, params, *_) in enumerate(results):
        assert losses == results[0][0], f"rank {rank} reports other losses than rank 0"
        errors = P.compare((losses, params), reference, "float64")
        assert errors["steps"] == P.STEPS
        assert errors["loss"] <= 1e-10 and errors["param"] <= 1e-10, (rank, errors)


# ---- numerics: every pipeline equals serial full-batch training -------------------------

MATRIX = [(key, m, s) for key in [("mlp", "two_stage", 2), ("mlp", "two_stage", 4),
                                  ("mlp4", "four_stage", 4), ("gpt", "two_stage", 2)]
          for m in (1, 2, 4, 8) for s in SCHEDULES]
# the slower GPT plans: every schedule at M = 8, and one more M each
MATRIX += [(key, m, s) for key in [("gpt", "two_stage", 4), ("gpt", "four_stage", 4)]
           for m, s in [(8, "FThenB"), (8, "1F1B"), (8, "ZB")]]
MATRIX += [(("gpt", "two_stage", 4), 1, "ZB"), (("gpt", "four_stage", 4), 2, "1F1B")]
MATRIX += [(("mlp", "two_stage_tp", 4), 4, s) for s in SCHEDULES]
MATRIX += [(("gpt", "two_stage_tp", 4), m, s) for m, s in [(2, "1F1B"), (8, "ZB")]]


@pytest.mark.slow
@pytest.mark.parametrize("key,micro_batches,schedule", MATRIX,
                         ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_pipeline_trains_like_serial(float64, key, micro_batches, schedule):
    check_equal(run_pipeline(key, micro_batches, schedule), serial(key[0]))


# interleaved (virtual_stages=2) and V-shaped (ZBV) pipelines: GPT and MLP, 2 and 4 stages
VIRTUAL = [(("gpt", "layered", 2), 4, "1F1B", 2), (("gpt", "layered", 2), 4, "ZB", 2),
           (("gpt", "layered", 2), 4, "ZBV", 1), (("mlp4", "layered", 2), 8, "1F1B", 2),
           (("mlp4", "layered", 2), 8, "ZBV", 1), (("mlp8", "layered", 4), 8, "1F1B", 2),
           (("mlp8", "layered", 4), 8, "ZB", 2), (("mlp8", "layered", 4), 8, "ZBV", 1),
           (("gpt6", "layered", 4), 8, "1F1B", 2), (("gpt6", "layered", 4), 8, "ZBV", 1),
           # stages from parameter annotations alone (tests/test_pipeline_stages.py)
           (("gpt", "param2", 2), 4, "1F1B", 2), (("gpt", "param2", 2), 4, "ZBV", 1),
           (("mlp8", "param4", 4), 2, "ZB", 2)]


@pytest.mark.slow
@pytest.mark.parametrize("key,micro_batches,schedule,virtual", VIRTUAL,
                         ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_virtual_stages_train_like_serial(float64, key, micro_batches, schedule, virtual):
    results = run_pipeline(key, micro_batches, schedule, profile=True, virtual=virtual)
    check_equal(results, serial(key[0]))
    S = key[2]
    plan = results[0][2].plan()
    assert len(plan.stages) == S and len(plan.task_graph().chunks) == 2 * S
    events = results[0][3].events
    labels = {t["pid"]: t["args"]["name"] for t in results[0][3].to_chrome()["traceEvents"]
              if t["name"] == "process_name"}
    for rank in range(S):       # the timeline shows each rank's two chunks (stages)
        stages = {e.stage for e in events if e.rank == rank and e.kind == "forward"}
        assert stages == ({rank, 2 * S - 1 - rank} if schedule == "ZBV" else
                          {rank, rank + S}), (rank, stages)
        assert labels[rank] == f"rank {rank} (chunks {', '.join(map(str, sorted(stages)))})"


@pytest.mark.slow
def test_one_micro_batch_runs_under_every_schedule_and_virtual_stages(float64):
    """Without micro-batches the schedule still orders the one micro-batch (ZB splits its
    backward, virtual stages and ZBV place two chunks per stage) and training equals serial."""
    first_process = {("ZB", 1): "0F0 0I0 0W0", ("1F1B", 2): "0F0 2F0 2B0 0B0",
                     ("ZBV", 1): "0F0 3F0 3I0 3W0 0I0 0W0"}
    for (schedule, virtual), order in first_process.items():
        results = run_pipeline(("gpt", "param2", 2), 1, schedule, profile=False,
                               virtual=virtual)
        check_equal(results, serial("gpt"))
        assert " ".join(map(str, results[0][2].plan().schedule()[0])) == order


def test_virtual_stages_that_make_no_sense_are_refused():
    def plan(key, **strategy):
        model = P.build_model(key[0])
        ALL[key].annotate(model)
        ins, labels = dg.app.data.DataLoader(P.Dataset(key[0], batch=BATCH), BATCH).specs(1)
        built = build_program(model, ins, labels, P.loss_fn(key[0]), P.make_optimizer("sgd"))
        return dg.passes.plan(built, dg.Strategy(**strategy))

    with pytest.raises(dg.PlanError, match="exactly two chunks on each stage mesh"):
        plan(("gpt", "layered", 2), micro_batches=4, schedule="ZBV", virtual_stages=3)
    with pytest.raises(dg.PlanError, match="into 8 chunks at layer boundaries, but the model "
                                           "has only 4 layers"):
        plan(("mlp4", "four_stage", 4), micro_batches=4, virtual_stages=2)
    with pytest.raises(dg.PlanError, match="this plan has one stage"):
        plan(("gpt", "dp", 2), micro_batches=4, virtual_stages=2)
    with pytest.raises(dg.PlanError, match="auto_mode='full' are supported with the stage search only"):
        plan(("gpt", "dp", 2), micro_batches=4, schedule="ZBV", auto_mode="full")
    with pytest.raises(dg.DistGraphError, match="virtual_stages must be an integer >= 1"):
        dg.Strategy(virtual_stages=0)


SINGLE_MESH = [("mlp", "dp", 2), ("gpt", "tp", 2), ("gpt", "dp_tp", 4), ("mlp", "zero", 2),
               ("gpt", "zero_dp_tp", 4), ("gpt", "sp", 2)]


@pytest.mark.parametrize("key", SINGLE_MESH, ids=lambda k: "-".join(map(str, k)))
def test_gradient_accumulation_on_one_mesh_equals_serial(float64, key):
    check_equal(run_pipeline(key, 4, "1F1B"), serial(key[0]))


def test_gradient_accumulation_on_one_process_equals_serial(float64):
    for kind in ("mlp", "gpt"):
        for m in (2, 8):
            losses, params, engine = train(P.build_model(kind), kind,
                                           strategy=dg.Strategy(micro_batches=m))
            assert engine.plan().micro_batches == m and not engine.plan().distributed
            errors = P.compare((losses, params), serial(kind), "float64")
            assert errors["loss"] <= 1e-10 and errors["param"] <= 1e-10, (kind, m, errors)


def test_dropout_masks_equal_the_full_batch(float64):
    reference = serial("gpt", dropout=0.1)
    no_dropout = serial("gpt")
    assert P.compare(no_dropout, reference, "float64")["param"] > 1e-3   # dropout matters
    losses, params, _ = train(P.build_model("gpt", dropout=0.1), "gpt",
                              strategy=dg.Strategy(micro_batches=4))
    assert P.compare((losses, params), reference, "float64")["param"] <= 1e-10
    check_equal(run_pipeline(("gpt", "two_stage", 4), 4, "ZB", dropout=0.1), reference)


class IgnoredLabels(P.Dataset):
    """GPT samples whose labels are ignore_index more often in the first rows of a batch:
    the micro-batches average over different numbers of labels."""

    def __init__(self):
        super().__init__("gpt", batch=BATCH)
        labels = self.fields[1].copy()
        rows = np.arange(len(labels)) % BATCH
        labels[rows < BATCH // 2, 1:] = -100
        labels[rows == BATCH - 1, 0] = -100
        self.fields[1] = labels


def test_ignored_labels_average_over_the_whole_batch(float64):
    """The mean cross-entropy divides by the whole batch's count of labels that are not
    ignored: the micro-batches' prologue sums the count first, so micro-batching equals
    the full batch (one process, and two stages x dp 2 on four)."""
    def fit(model, comm=None, strategy=None):
        engine = dg.Engine(model, P.loss_fn("gpt"), P.make_optimizer("adamw"),
                           strategy=strategy or dg.Strategy(), communicator=comm)
        ins, labels = dg.app.data.DataLoader(IgnoredLabels(), BATCH).specs(1)
        with P.BUILD_LOCK:
            engine.prepare(ins, labels)
        history = engine.fit(IgnoredLabels(), batch_size=BATCH, verbose=0)
        return history.losses, engine.state_dict(), engine

    reference = fit(P.build_model("gpt"))[:2]
    losses, params, engine = fit(P.build_model("gpt"), strategy=dg.Strategy(micro_batches=4))
    assert len(engine.plan().accumulation.prologue) == 1           # the count
    errors = P.compare((losses, params), reference, "float64")
    assert errors["loss"] <= 1e-10 and errors["param"] <= 1e-10, errors
    models = [P.build_model("gpt") for _ in range(4)]
    for m in models:
        ALL["gpt", "two_stage", 4].annotate(m)       # two stages, each data parallel
    results = SimulatedWorld(4, timeout=60).run(
        lambda comm: fit(models[comm.rank], comm, dg.Strategy(micro_batches=4)))
    check_equal(results, reference)


# ---- vocabulary-parallel cross-entropy, micro-batched ----------------------------------------

def test_split_vocabulary_with_micro_batches_equals_serial(float64):
    mesh = dg.ProcessMesh([0, 1], ["mp"])

    def model(annotate):
        m = P.build_model("gpt")
        if annotate:
            dg.shard_tensor(m.lm_head.weight, mesh, [None, "mp"])
            dg.shard_tensor(m.wte.weight, mesh, ["mp", None])
        return m

    models = [model(True) for _ in range(2)]
    results = SimulatedWorld(2, timeout=60).run(
        lambda comm: train(models[comm.rank], "gpt", comm, dg.Strategy(micro_batches=4)))
    plan = results[0][2].plan()
    schedule = plan.schedule()             # the loss communicates inside: one order for both
    assert schedule[0] == schedule[1]
    check_equal(results, serial("gpt"))


# ---- the plan's schedules, followed ---------------------------------------------------------------

def task_order(timeline, rank, step=0):
    return [(e.kind, e.micro_batch) for e in timeline.events
            if e.rank == rank and e.step == step and e.kind not in ("send", "recv")]


def in_flight_never_exceeds(order, cap):
    """Forwards started minus micro-batches fully done (their last backward) <= cap."""
    last = "backward_weight" if any(k == "backward_weight" for k, _ in order) else "backward"
    if last == "backward" and any(k == "backward_input" for k, _ in order):
        last = "backward_input"
    live = peak = 0
    for kind, _ in order:
        live += kind == "forward"
        peak = max(peak, live)
        live -= kind == last
    return peak <= cap, peak


@pytest.mark.parametrize("key", [("mlp", "two_stage", 2), ("mlp4", "four_stage", 4)],
                         ids=lambda k: k[1])
def test_every_rank_runs_the_plans_schedule(key):
    m, stages = 8, key[2]
    for schedule in SCHEDULES:
        results = run_pipeline(key, m, schedule, profile=True)
        timelines = [r[3] for r in results]
        tl = timelines[0]
        for other in timelines[1:]:          # the merged timeline, the same on every rank
            assert other.events == tl.events
        plan = results[0][2].plan()
        for rank in range(stages):
            order = task_order(tl, rank)
            assert order == [(a.task, a.micro_batch) for a in plan.schedule()[rank]] + \
                [("update", None)]
            kinds = {k for k, _ in order[:-1]}
            if schedule == "FThenB":
                assert kinds == {"forward", "backward"}
                assert [k for k, _ in order[:m]] == ["forward"] * m        # GPipe: all F first
                assert in_flight_never_exceeds(order, m) == (True, m)
            else:      # zero bubble keeps S in flight everywhere, as torch's ZB1P
                ok, peak = in_flight_never_exceeds(order, stages - rank if schedule == "1F1B"
                                                   else stages)
                assert ok, (schedule, rank, order)
                if schedule == "1F1B":
                    assert kinds == {"forward", "backward"} and peak == stages - rank
                    if rank == stages - 1:                             # last stage: F B F B ...
                        assert [k for k, _ in order[:-1]] == ["forward", "backward"] * m
                else:
                    assert "backward_weight" in kinds
            for kind in kinds:                        # each kind runs micro-batches in order
                assert [mb for k, mb in order if k == kind] == list(range(m))


def test_live_activations_stay_within_the_stage_share():
    """At most S - s micro-batches alive on stage s under 1F1B (the last stage exactly
    one), S under zero bubble (its weight gradients wait to fill the bubbles), all M under
    GPipe."""
    m = 8
    for schedule, caps in (("1F1B", [4, 3, 2, 1]), ("FThenB", [m] * 4), ("ZB", [4, 4, 4, 4])):
        results = run_pipeline(("mlp4", "four_stage", 4), m, schedule, profile=True)
        peaks = results[0][3].peak_activations(step=0)
        for rank, (nbytes, live) in peaks.items():
            assert live == caps[rank], (schedule, rank, live)   # the schedule is the plan's
            assert nbytes > 0


# ---- every Engine mode with micro-batches ----------------------------------------------------------

def test_fit_evaluate_predict_with_micro_batches(float64):
    def session(model, comm, strategy):
        losses, params, engine = train(model, "gpt", comm, strategy)
        data = P.Dataset("gpt", batch=BATCH)
        evaluated = engine.evaluate(data, BATCH)["loss"]
        predicted = [out[0] for out in engine.predict(data, BATCH)]
        return losses, evaluated, predicted

    ref_losses, ref_eval, ref_pred = session(P.build_model("gpt"), None, dg.Strategy())
    models = [P.build_model("gpt") for _ in range(4)]
    for m in models:
        ALL["gpt", "two_stage", 4].annotate(m)
    strategy = dg.Strategy(micro_batches=4, schedule="ZB")
    for losses, evaluated, predicted in SimulatedWorld(4, timeout=60).run(
            lambda comm: session(models[comm.rank], comm, strategy)):
        assert np.allclose(losses, ref_losses, rtol=1e-12, atol=0)
        assert abs(evaluated - ref_eval) < 1e-12
        assert all(np.allclose(a, b, rtol=0, atol=1e-12) for a, b in zip(predicted, ref_pred))


# ---- timeline ---------------------------------------------------------------------------------

def test_timeline_records_every_task_and_message(tmp_path):
    results = run_pipeline(("mlp", "two_stage", 2), 4, "ZB", profile=True)
    tl = results[1][3]
    assert tl.ranks == [0, 1] and tl.steps == list(range(P.STEPS))
    kinds = {e.kind for e in tl.events}
    assert kinds == {"forward", "backward_input", "backward_weight", "update", "send", "recv"}
    for e in tl.events:
        assert e.end >= e.start >= 0 and e.stage == e.rank
        assert (e.micro_batch is None) == (e.kind == "update")
    sends = [e for e in tl.events if e.kind == "send" and e.rank == 0 and e.step == 0]
    assert sorted(e.micro_batch for e in sends) == list(range(4)) and sends[0].peer == 1
    path = tmp_path / "t.json"
    tl.save(path)
    trace = json.loads(path.read_text())["traceEvents"]
    assert [t["args"]["name"] for t in trace if t["name"] == "process_name"] == \
        ["rank 0 (chunk 0)", "rank 1 (chunk 1)"]
    spans = [t for t in trace if t["ph"] == "X"]
    assert len(spans) == len(tl.events)
    assert {t["pid"] for t in spans} == {0, 1}
    assert any(t["ph"] == "C" for t in trace)          # the activations counter
    idle = tl.idle_fraction()
    assert set(idle) == {0, 1} and all(0 <= f < 1 for f in idle.values())
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(dg.DistGraphError, match="pip install"):
            tl.plot(tmp_path / "t.png")
    else:
        tl.plot(tmp_path / "t.png")
        assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_timeline_needs_profile():
    _, _, engine = train(P.build_model("mlp"), "mlp", strategy=dg.Strategy(micro_batches=2))
    with pytest.raises(dg.DistGraphError, match="profile=True"):
        engine.timeline()


# ---- failures -----------------------------------------------------------------------------------

def test_a_failing_task_names_rank_task_and_micro_batch(monkeypatch):
    from distgraph import registry
    op = registry.get_op("relu")

    def kernel(ctx, x, **attrs):
        if ctx.step == 1:
            raise ValueError("injected failure")
        return op.kernel(ctx, x, **attrs)

    monkeypatch.setitem(registry._REGISTRY, "relu", dataclasses.replace(op, kernel=kernel))
    with pytest.raises(dg.RuntimeFault) as info:
        run_pipeline(("mlp", "two_stage", 2), 4, "1F1B")
    text = str(info.value)
    assert "rank 0 (process 0): task forward of chunk 0, micro-batch 0 in step 1" in text
    assert "op 'relu'" in text and "injected failure" in text


def test_a_message_that_never_arrives_is_a_runtime_fault():
    plan = ALL["mlp", "two_stage", 2]
    models = [P.build_model("mlp") for _ in range(2)]
    for m in models:
        plan.annotate(m)

    def rank(comm):
        if comm.rank == 1:                # enters fit with rank 0, then its stage never
            with comm.collective_call("Engine.fit()"):      # runs: no gradient comes back
                return None
        train(models[0], "mlp", comm, dg.Strategy(micro_batches=4))

    with pytest.raises(dg.RuntimeFault) as info:
        SimulatedWorld(2, timeout=1).run(rank)
    text = str(info.value)
    assert "rank 0 (process 0, chunk 0): timed out after 1 s" in text
    assert "backward micro-batch 0 waits for" in text and "from rank 1" in text


# ---- bytes: what the communicators count = the plan's per-step bytes ------------------------

@pytest.mark.parametrize("key,micro_batches", [(("mlp", "two_stage", 4), 4),
                                               (("gpt", "two_stage_tp", 4), 2)],
                         ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_counted_bytes_equal_the_plans_step_bytes(float64, key, micro_batches):
    from distgraph.passes.partition import gather_points
    plan = ALL[key]
    kind, n = key[0], key[2]
    models = [P.build_model(kind) for _ in range(n)]
    for m in models:
        plan.annotate(m)
    strategy = dg.Strategy(micro_batches=micro_batches, schedule="ZB")

    def rank(comm):
        engine = dg.Engine(models[comm.rank], P.loss_fn(kind), P.make_optimizer("adamw"),
                           strategy=strategy, communicator=comm)
        data = P.Dataset(kind, batch=BATCH)
        with P.BUILD_LOCK:
            engine.prepare(*dg.app.data.DataLoader(data, BATCH).specs(1))
        engine.fit(data, batch_size=BATCH, epochs=1, steps_per_epoch=1)   # set-up, warm
        comm.reset_counters()
        engine.fit(data, batch_size=BATCH, epochs=2, steps_per_epoch=1)
        p = engine.plan()
        planned = dict(p.bytes_sent()[comm.rank])
        for point in gather_points(p.program, [p.built.loss_name], comm.rank):
            for step in point.steps:
                planned[step.kind] = planned.get(step.kind, 0.0) + step.bytes_sent_by(comm.rank)
        return planned, dict(comm.bytes_sent)

    for planned, counted in SimulatedWorld(n, timeout=60).run(rank):
        assert planned.get("send_recv", 0) > 0
        for kind, b in counted.items():
            assert b == pytest.approx(planned.get(kind, 0.0), rel=1e-12, abs=0), (kind, planned,
                                                                                counted)


# ---- a parameter used on two stages ------------------------------------------------------------

class Tied(dg.nn.Layer):
    """y = relu(x W + b) W^T, the second use of W on another stage (tied weights): W goes
    to stage 1 with every micro-batch and its gradient share comes back."""

    def __init__(self, stages=None):
        super().__init__()
        self.fc, self.stages = dg.nn.Linear(8, 16), stages

    def forward(self, x):
        first = lambda v: dg.ops.relu(self.fc(v))   # noqa: E731
        second = lambda v: v @ self.fc.weight.T     # noqa: E731
        if self.stages is None:
            return second(first(x))
        return dg.shard_op(second, self.stages[1])(dg.shard_op(first, self.stages[0])(x))


class Pairs:
    def __init__(self):
        rng = np.random.default_rng(0)
        self.x, self.y = rng.normal(size=(48, 8)), rng.normal(size=(48, 8))

    def __len__(self):
        return 48

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def test_a_parameter_shared_by_two_stages(float64):
    def fit(model, comm=None, strategy=None):
        engine = dg.Engine(model, dg.nn.MSELoss(), dg.optim.AdamW(0.01), strategy=strategy,
                           communicator=comm)
        with P.BUILD_LOCK:          # tracing is one thread's at a time
            engine.prepare(*dg.app.data.DataLoader(Pairs(), 16).specs(1))
        return engine.fit(Pairs(), batch_size=16).losses, engine.state_dict()

    dg.seed(0)
    reference = fit(Tied())
    stages = (dg.ProcessMesh([0], ["dp"]), dg.ProcessMesh([1], ["dp"]))
    for schedule in SCHEDULES:
        models = []
        for _ in range(2):
            dg.seed(0)
            models.append(Tied(stages))
        strategy = dg.Strategy(micro_batches=4, schedule=schedule)
        for losses, params in SimulatedWorld(2, timeout=60).run(
                lambda comm: fit(models[comm.rank], comm, strategy)):
            assert np.allclose(losses, reference[0], rtol=1e-12, atol=0), schedule
            assert all(np.max(np.abs(params[k] - reference[1][k])) < 1e-12 for k in params)
