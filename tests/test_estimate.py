"""The cost model's estimate of a plan against closed forms: compute as the roofline plus
launch cost, communication as the alpha-beta of the rings the groups use (groups that
cross between machines at once sharing the network), stages in sequence, memory as the
executor's live set at its peak."""

import numpy as np
import pytest

import distgraph as dg
from distgraph.passes.partition import gather_points
from distgraph.program_builder import build_program

import plans  # tests/ is on the path

BW, LAT = 2.0, 5.0                       # GB/s, µs between any two devices
GFLOPS, MEM_BW, OVERHEAD = 10.0, 4.0, 7.0


def cluster(n, inter_bw=None):
    """n CPU devices on one machine (or two machines of n/2 when ``inter_bw`` is given)."""
    def dev(i):
        return {"global_id": i, "type": "CPU", "memory": 1, "gflops": {"float64": GFLOPS},
                "memory_bandwidth": MEM_BW, "op_overhead": OVERHEAD}
    if inter_bw is None:
        links = [{"group": list(range(n)), "bandwidth": BW, "latency": LAT}] if n > 1 else []
        machines = [{"hostname": "a", "devices": [dev(i) for i in range(n)], "links": links}]
        return dg.Cluster.from_dict({"machines": machines})
    half = n // 2
    machines = [{"hostname": f"m{m}", "devices": [dev(i) for i in range(m * half, (m + 1) * half)],
                 "links": [{"group": list(range(m * half, (m + 1) * half)), "bandwidth": BW,
                            "latency": LAT}]} for m in range(2)]
    links = [{"source": i, "target": i + half, "bandwidth": inter_bw, "latency": LAT}
             for i in range(half)]
    return dg.Cluster.from_dict({"machines": machines, "links": links})


class MLP(dg.nn.Layer):
    def __init__(self, mesh=None, spec=None):
        super().__init__()
        self.mesh, self.spec = mesh, spec
        self.fc1, self.fc2 = dg.nn.Linear(8, 16), dg.nn.Linear(16, 4)

    def forward(self, x):
        if self.mesh is not None:
            dg.shard_tensor(x, self.mesh, self.spec)
        return self.fc2(dg.ops.relu(self.fc1(x)))


def train_plan(model, batch=8, strategy=None, **kw):
    """The plan of ``model``'s training, its gradients reduced after the backward unless
    ``strategy`` says otherwise (the formulas below price each collective whole; with
    overlap the update's first op, the learning rate's read, runs while they finish)."""
    built = build_program(model, [dg.InputSpec([batch, 8], name="x")],
                          [dg.InputSpec([batch, 4], name="y")], dg.nn.MSELoss(),
                          dg.optim.SGD(0.1))
    return dg.passes.plan(built, strategy or dg.Strategy(overlap=False), **kw)


def test_data_parallel_communication_is_one_all_reduce_per_gradient(float64):
    p = train_plan(MLP(dg.ProcessMesh([0, 1], ["dp"]), ["dp", None]))
    kinds = {s.kind for point in p.reshards() for s in point.steps}
    assert kinds == {"all_reduce"}
    est = dg.passes.estimate(p, cluster(2))
    grads = [v for v in p.program.parameters]
    grad_bytes = sum(v.nbytes for v in grads)
    # ring of 2: each all-reduce 2 latencies + 2 (n-1)/n B / bw; the loss (a Partial
    # scalar) is one more all-reduce of 8 bytes when every process fetches it
    messages = len(grads) + 1
    expected = messages * 2 * LAT * 1e-6 + (grad_bytes + 8) / (BW * 1e9)
    for proc in est.processes:
        assert proc.communication == pytest.approx(expected, rel=1e-12)


def test_compute_is_roofline_plus_launch_cost(float64):
    class Proj(dg.nn.Layer):
        def __init__(self):
            super().__init__()
            self.w = dg.nn.Linear(64, 32, bias=False)

        def forward(self, x):
            return self.w(x)

    built = build_program(Proj(), [dg.InputSpec([16, 64], name="x")], mode="predict")
    p = dg.passes.plan(built)
    assert [op.type for op in p.program.ops] == ["matmul"]
    est = dg.passes.estimate(p, cluster(1))
    flops = 2 * 16 * 64 * 32
    moved = (16 * 64 + 64 * 32 + 16 * 32) * 8
    feed = 16 * 64 * 8 / (MEM_BW * 1e9)          # the process copies its feed in
    expected = OVERHEAD * 1e-6 + max(flops / (GFLOPS * 1e9), moved / (MEM_BW * 1e9)) + feed
    assert est.step_time == pytest.approx(expected, rel=1e-12)
    assert est.compute == est.step_time and est.communication == 0 and est.bubble == 0


def test_activation_peak_is_the_executors_live_set(float64):
    built = build_program(MLP(), [dg.InputSpec([8, 8], name="x")], mode="predict")
    est = dg.passes.estimate(dg.passes.plan(built), cluster(1))
    (proc,) = est.processes
    # x[8,8] -> h=x@w1 [8,16] -> h+b [8,16] (h dies) -> relu [8,16] -> @w2 [8,4] -> +b:
    # at most two [8,16] float64 values live at once
    assert proc.activations == 2 * 8 * 16 * 8
    assert proc.parameters == (8 * 16 + 16 + 16 * 4 + 4) * 8
    assert proc.gradients == 0 and proc.states == 0


def test_micro_batch_gradients_are_held_once_in_their_buffers(float64):
    """With micro-batches the runtime adds each gradient to the step's buffer as it is
    made: the estimate holds the buffers, and beside them at most the largest gradient
    being made (here the [8, 16] activation gradient of ``fc1``'s output or ``fc1``'s weight
    gradient), never every micro-batch gradient until the update as well."""
    p = train_plan(MLP(), strategy=dg.Strategy(micro_batches=2, overlap=False))
    (proc,) = dg.passes.estimate(p, cluster(1)).processes
    sizes = [(8 * 16), 16, 16 * 4, 4]
    buffers = sum(sizes) * 8
    assert buffers <= proc.gradients <= buffers + max(sizes) * 8


def test_stages_run_one_after_another():
    first, second = dg.ProcessMesh([0], ["s"]), dg.ProcessMesh([1], ["s"])

    class TwoStage(dg.nn.Layer):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = dg.nn.Linear(8, 16), dg.nn.Linear(16, 4)

        def forward(self, x):
            return dg.shard_op(self.fc2, second)(dg.shard_op(self.fc1, first)(x))

    p = train_plan(TwoStage())
    est = dg.passes.estimate(p, cluster(2))
    by_stage = {proc.stage: proc for proc in est.processes}
    assert set(by_stage) == {0, 1}
    assert est.step_time == pytest.approx(by_stage[0].busy + by_stage[1].busy, rel=1e-12)
    slowest = max(by_stage.values(), key=lambda q: q.busy)
    assert est.bubble == pytest.approx(est.step_time - slowest.busy, rel=1e-12)
    assert est.bubble > 0


def test_placement_that_keeps_tensor_parallel_groups_together_is_cheaper():
    mesh = dg.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])

    class Megatron(MLP):
        def __init__(self):
            super().__init__(mesh, ["dp", None])
            dg.shard_tensor(self.fc1.weight, mesh, [None, "mp"])
            dg.shard_tensor(self.fc2.weight, mesh, ["mp", None])

    # a large batch: the activations' all-reduces inside mp groups outweigh the gradients'
    # all-reduces across dp
    slow = cluster(4, inter_bw=0.01)          # machines {0, 1} and {2, 3}
    inside = train_plan(Megatron(), 1024, cluster=slow, rank_mapping={0: 0, 1: 1, 2: 2, 3: 3})
    across = train_plan(Megatron(), 1024, cluster=slow, rank_mapping={0: 0, 1: 2, 2: 1, 3: 3})
    t_inside = dg.passes.estimate(inside).step_time
    t_across = dg.passes.estimate(across).step_time
    assert t_inside < t_across


def test_groups_that_cross_the_machines_at_once_share_the_network(float64):
    """One ring model: a reshard step's group is priced on the ring MeshSlice's
    collectives use. The two dp groups of a 2x2 mesh on two machines cross between them
    at once: each all-reduce gets half of the link."""
    mesh = dg.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
    p = train_plan(MLP(mesh, ["dp", None]), cluster=cluster(4, inter_bw=1.0),
                   rank_mapping={0: 0, 1: 1, 2: 2, 3: 3})
    assert {(s.kind, s.mesh_dim) for pt in p.reshards() for s in pt.steps} == \
        {("all_reduce", "dp")}
    grad_bytes = sum(v.nbytes for v in p.program.parameters)
    messages = len(p.program.parameters) + 1          # and the loss's 8 bytes
    expected = messages * 2 * LAT * 1e-6 + (grad_bytes + 8) / (1.0 / 2 * 1e9)
    for proc in dg.passes.estimate(p).processes:
        assert proc.communication == pytest.approx(expected, rel=1e-12)


def test_an_ops_own_collectives_run_on_the_group_its_kernel_names(float64):
    """The vocab-parallel cross-entropy all-gathers and all-reduces over its class-split
    group (mp, inside a machine), not over the worst ring of its whole mesh (dp crosses
    a slow network)."""
    built = plans.vocab_parallel_head()
    inter = 0.01
    p = dg.passes.plan(built, dg.Strategy(overlap=False), cluster=cluster(4, inter_bw=inter),
                       rank_mapping={0: 0, 1: 1, 2: 2, 3: 3})
    (collectives,) = p.local(0).op_comm.values()
    assert collectives == (("all_gather", 2, 4 * 2 * 8), ("all_reduce", 2, 4 * 8))
    # across: the loss's sum, the count's sum and the weight gradient, all-reduced over
    # dp (two groups at once on the slow link); inside: the op's own, over mp
    across = sum(2 * LAT * 1e-6 + b / (inter / 2 * 1e9) for b in (8, 8, 32 * 128 * 8))
    inside = (LAT * 1e-6 + 32 / (BW * 1e9)) + (2 * LAT * 1e-6 + 32 / (BW * 1e9))
    for proc in dg.passes.estimate(p).processes:
        assert proc.communication == pytest.approx(across + inside, rel=1e-12)


def test_estimate_prints_and_exports(float64):
    p = train_plan(MLP(dg.ProcessMesh([0, 1], ["dp"]), ["dp", None]))
    est = dg.passes.estimate(p, cluster(2))
    text = str(est)
    # alike processes share a line; per_process() gives each its own
    assert "compute" in text and "processes 0, 1 (devices 0, 1, stage 0)" in text
    assert "process 1 (device 1, stage 0)" not in text
    assert "process 1 (device 1, stage 0)" in est.per_process()
    data = est.to_dict()
    assert data["peak_memory"] == max(q["peak_memory"] for q in data["processes"])
    with pytest.raises(dg.PlanError, match="2 processes but the cluster has 1"):
        dg.passes.estimate(p, cluster(1))


class TwoStageMLP(dg.nn.Layer):
    def __init__(self, width):
        super().__init__()
        self.fc1, self.fc2 = dg.nn.Linear(width, width), dg.nn.Linear(width, width)
        self.meshes = (dg.ProcessMesh([0], ["dp"]), dg.ProcessMesh([1], ["dp"]))

    def forward(self, x):
        h = dg.shard_op(lambda v: dg.ops.relu(self.fc1(v)), self.meshes[0])(x)
        return dg.shard_op(self.fc2, self.meshes[1])(h)


def test_a_micro_batched_plan_counts_forward_and_backward_once_per_micro_batch(float64):
    """A micro-batched plan's local programs are one micro-batch's: its forward and
    backward ops count M times a step, its updates once, and two stages overlap."""
    from distgraph.registry import TensorType
    from distgraph.passes.cost.prices import feed_time, op_time

    def plan(m):
        built = build_program(TwoStageMLP(256), [dg.InputSpec([64, 256], name="x")],
                              [dg.InputSpec([64, 256], name="y")], dg.nn.MSELoss(),
                              dg.optim.SGD(0.1))
        return dg.passes.plan(built, dg.Strategy(micro_batches=m))

    whole, micro = plan(1), plan(4)
    c = cluster(2)
    device = c.devices[0]
    ops = micro.local(0).program.ops
    expected = sum(op_time(op.type, [TensorType(v.shape, v.dtype) for v in op.inputs],
                           [TensorType(v.shape, v.dtype) for v in op.outputs], op.attrs,
                           device) * (1 if op.role == "optimize" else 4) for op in ops)
    expected += 4 * sum(feed_time(v.nbytes, device) for v in micro.local(0).program.inputs)
    est = dg.passes.estimate(micro, c)
    assert est.processes[0].compute == pytest.approx(expected, rel=1e-12)
    assert est.step_time < dg.passes.estimate(whole, c).step_time


def test_measured_op_costs_and_reshard_overheads_replace_the_roofline(float64, tmp_path):
    """A device's measured per-op-type costs (µs per call + ns per unit of work) and
    per-step reshard overheads are what the estimate charges; they round-trip through a
    resource file, and bad entries are errors naming the key."""
    data = {"machines": [{"hostname": "a", "devices": [
        {"global_id": i, "type": "CPU", "memory": 1, "gflops": {"float64": GFLOPS},
         "op_costs": {"matmul": [3.0, 0.5], "add": [2.0, 0.25]},
         "reshard_overhead": {"all_reduce": 11.0}} for i in range(2)],
        "links": [{"group": [0, 1], "bandwidth": BW, "latency": LAT}]}]}
    c = dg.Cluster.from_dict(data)
    c.save(tmp_path / "c.yaml")
    assert dg.Cluster.from_file(tmp_path / "c.yaml").devices == c.devices
    dev = c.devices[0]
    # a number alone is the µs per step, with nothing per byte
    assert dev.op_costs["matmul"] == (3.0, 0.5) and dev.reshard_overhead["all_reduce"] == (11.0,
                                                                                          0.0)

    class Proj(dg.nn.Layer):
        def __init__(self):
            super().__init__()
            self.w = dg.nn.Linear(64, 32)

        def forward(self, x):
            return self.w(x)

    built = build_program(Proj(), [dg.InputSpec([16, 64], name="x")], mode="predict")
    est = dg.passes.estimate(dg.passes.plan(built), c)
    matmul = 3.0e-6 + 0.5e-9 * (2 * 16 * 64 * 32)        # per call + per FLOP
    add = 2.0e-6 + 0.25e-9 * (16 * 32 + 32 + 16 * 32)      # per call + per element moved
    feed = 16 * 64 * 8 / 10e9            # x copied in at the CPU default 10 GB/s
    assert est.step_time == pytest.approx(matmul + add + feed, rel=1e-12)

    p = train_plan(MLP(dg.ProcessMesh([0, 1], ["dp"]), ["dp", None]))
    plain = dg.passes.estimate(p, cluster(2))
    fetched = gather_points(p.program, [p.built.loss_name], 0)
    steps = sum(1 for point in p.reshards() + fetched for s in point.steps
                if s.kind == "all_reduce")
    with_software = dg.passes.estimate(p, dg.Cluster.from_dict({**data, "machines": [
        {**data["machines"][0], "devices": [
            {**d, "op_costs": None, "memory_bandwidth": MEM_BW, "op_overhead": OVERHEAD}
            for d in data["machines"][0]["devices"]]}]}))
    assert with_software.processes[0].communication == pytest.approx(
        plain.processes[0].communication + steps * 11e-6, rel=1e-9)

    bad = {**data["machines"][0]["devices"][0], "op_costs": {"no_such_op": [1, 2]}}
    with pytest.raises(dg.ResourceFileError, match="op_costs.no_such_op"):
        dg.Cluster.from_dict({"machines": [{"hostname": "a", "devices": [bad]}]})
    bad = {**data["machines"][0]["devices"][0], "op_costs": {"add": [1]}}
    with pytest.raises(dg.ResourceFileError, match="two"):
        dg.Cluster.from_dict({"machines": [{"hostname": "a", "devices": [bad]}]})


def test_a_cpu_pays_the_casts_around_every_op_on_16_bit_operands():
    """On a CPU the executor widens each bfloat16 operand to float32 and rounds each
    bfloat16 result back, around every op that does not take them as they are: an amp
    plan's compute is priced with those casts at the device's measured cost of each
    direction (without one, at their bytes' memory bandwidth), a cast op by its
    direction, and a GPU (which computes in 16 bits) pays none of them."""
    from distgraph.passes.cost.prices import op_time
    from distgraph.registry import TensorType, cast_cost_key, get_op

    widen, round_ = [1.5, 0.25], [2.5, 0.75]         # µs per call, ns per element

    def device(kind, casts):
        costs = {cast_cost_key("bfloat16", "float32"): widen,
                 cast_cost_key("float32", "bfloat16"): round_} if casts else {}
        return dg.Cluster.from_dict({"machines": [{"hostname": "a", "devices": [
            {"global_id": 0, "type": kind, "memory": 1, "gflops": {"float32": GFLOPS},
             "memory_bandwidth": MEM_BW, "op_overhead": OVERHEAD,
             "op_costs": {"matmul": [3.0, 0.5], **costs}}]}]})

    built = build_program(MLP(), [dg.InputSpec([8, 8], name="x")],
                          [dg.InputSpec([8, 4], name="y")], dg.nn.MSELoss(), dg.optim.SGD(0.1),
                          amp="bfloat16")
    p = dg.passes.plan(built, dg.Strategy(amp="bfloat16"))
    ops = p.local(0).program.ops
    expected = 0.0
    for op in ops:
        if op.type == "cast" or get_op(op.type).takes_16bit:
            continue
        for values, (a, b) in ((op.inputs, widen), (op.outputs, round_)):
            # measured, against the 2 + 4 bytes an element at the memory bandwidth
            expected += sum(a * 1e-6 + (b * 1e-9 - 6 / (MEM_BW * 1e9)) * np.prod(v.shape)
                            for v in values if v.dtype == "bfloat16")
    assert expected > 0
    casts = [op for op in ops if op.type == "cast" and {op.inputs[0].dtype,
                                                         op.outputs[0].dtype} ==
             {"float32", "bfloat16"}]
    assert casts
    cast_ops = {"CPU": 0.0, "GPU": 0.0}     # what the cast ops' measured costs change
    for op in casts:
        cost = widen if op.inputs[0].dtype == "bfloat16" else round_
        tt = [TensorType(v.shape, v.dtype) for v in (op.inputs[0], op.outputs[0])]
        elements = int(np.prod(op.outputs[0].shape))
        assert op_time("cast", tt[:1], tt[1:], op.attrs, device("CPU", True).devices[0]) \
            == pytest.approx(OVERHEAD * 1e-6 + cost[0] * 1e-6 + cost[1] * 1e-9 * elements,
                             rel=1e-12)
        for kind in cast_ops:
            cast_ops[kind] += op_time("cast", tt[:1], tt[1:], op.attrs,
                                      device(kind, True).devices[0]) - op_time(
                "cast", tt[:1], tt[1:], op.attrs, device(kind, False).devices[0])
    compute = {(kind, casts): dg.passes.estimate(p, device(kind, casts)).processes[0].compute
               for kind in ("CPU", "GPU") for casts in (True, False)}
    assert compute["CPU", True] - compute["CPU", False] == pytest.approx(
        expected + cast_ops["CPU"], rel=1e-9)
    assert compute["GPU", True] - compute["GPU", False] == pytest.approx(cast_ops["GPU"],
                                                                         rel=1e-9)


def test_software_cost_of_a_step_grows_with_its_buffer(float64):
    """A device's reshard software cost ``[µs per step, ns per byte]`` is charged per
    step as ``µs + ns x B`` (B: the step's buffer of the cost formula) on top of the
    links' alpha-beta; a collective over one process costs what a local step does."""
    per_step, per_byte, local = 11.0, 0.5, 3.0

    def with_software(overhead):
        c = cluster(2)
        return dg.Cluster.from_dict({"machines": [{"hostname": "a", "devices": [
            {"global_id": d.global_id, "type": "CPU", "memory": 1,
             "gflops": {"float64": GFLOPS}, "memory_bandwidth": MEM_BW,
             "op_overhead": OVERHEAD, "reshard_overhead": overhead} for d in c.devices],
            "links": [{"group": [0, 1], "bandwidth": BW, "latency": LAT}]}]})

    p = train_plan(MLP(dg.ProcessMesh([0, 1], ["dp"]), ["dp", None]))
    plain = dg.passes.estimate(p, cluster(2))
    charged = dg.passes.estimate(p, with_software({"all_reduce": [per_step, per_byte]}))
    steps = [s for point in p.local(0).points() + gather_points(p.program, [p.built.loss_name],
                                                                 0) for s in point.steps]
    assert {s.kind for s in steps} == {"all_reduce"}
    expected = sum(per_step * 1e-6 + per_byte * 1e-9 * s.buffer_bytes for s in steps)
    assert charged.processes[0].communication == pytest.approx(
        plain.processes[0].communication + expected, rel=1e-9)

    # the same model on a mesh of one process per stage: its all-reduces meet no one
    one = dg.ProcessMesh([0], ["dp"])
    q = train_plan(MLP(one, ["dp", None]))
    groups = [s for point in q.local(0).points() for s in point.steps]
    assert groups and all(s.group_size == 1 for s in groups)
    alone = dg.passes.estimate(q, with_software({"all_reduce": [per_step, per_byte],
                                                 "slice": local}))
    base = dg.passes.estimate(q, cluster(2))
    assert alone.processes[0].communication == pytest.approx(
        base.processes[0].communication + len(groups) * local * 1e-6, rel=1e-9)


def test_interleaved_chunks_fill_the_pipeline_one_chunk_at_a_time(float64):
    """With v chunks per stage the fill Σ u_s of Alpa's formula is Σ u_s / v (Megatron's
    interleaved bubble): the same plan priced as v = 1, 2 and 4 loses Σ u_s (1 - 1/v)."""
    from dataclasses import replace

    built = build_program(TwoStageMLP(256), [dg.InputSpec([64, 256], name="x")],
                          [dg.InputSpec([64, 256], name="y")], dg.nn.MSELoss(),
                          dg.optim.SGD(0.1))
    plan = dg.passes.plan(built, dg.Strategy(micro_batches=4))
    c = cluster(2)
    step = {v: dg.passes.estimate(replace(plan, strategy=replace(plan.strategy,
                                                                 virtual_stages=v)), c)
            .step_time for v in (1, 2, 4)}
    fill = 2 * (step[1] - step[2])                      # Σ u_s
    assert fill > 0
    assert step[1] - step[4] == pytest.approx(0.75 * fill, rel=1e-9)


def test_step_times_kept_per_process_are_priced_afresh(float64):
    """estimate keeps each process's reshard step times per (step, scale): every kept
    answer equals reshard_step_time asked afresh, on a plan whose layers reshard equal
    steps (two stages of identical data-parallel layers, a send between them)."""
    from distgraph.passes.cost.estimate import _StepTimes
    from distgraph.passes.cost.prices import Rings, reshard_step_time

    first = dg.ProcessMesh([0, 1], ["dp"])
    second = dg.ProcessMesh([2, 3], ["dp"])

    class Stack(dg.nn.Layer):
        def __init__(self):
            super().__init__()
            self.layers = dg.nn.LayerList([dg.nn.Linear(8, 8) for _ in range(4)])
            self.head = dg.nn.Linear(8, 4)

        def forward(self, x):
            dg.shard_tensor(x, first, ["dp", None])
            for i, layer in enumerate(self.layers):
                x = dg.shard_op(layer, first if i < 2 else second)(x)
            return dg.shard_op(self.head, second)(x)

    p = train_plan(Stack())
    c = cluster(4, inter_bw=0.5)
    rings = Rings(c, lambda q: c.devices[q].global_id)
    asked = 0
    for pid in p.process_ids:
        kept = _StepTimes(pid, rings)
        for _ in range(2):
            for point in p.local_alike(pid).points():
                for step in point.steps:
                    for scale in (1.0, 0.5):
                        asked += 1
                        assert kept(step, scale) == reshard_step_time(step, pid, rings, scale)
        assert 0 < len(kept.known) < asked
    assert dg.passes.estimate(p, c).step_time > 0
