"""The task graph a plan's processes run: tasks per stage and kind, the B/W split of the
zero-bubble schedules, sends and receives where values cross stages, the dependencies the
schedule is made from, and plans whose processes belong to several stages."""

import collections
import itertools
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402
from distgraph.passes.partition import Partitions, partition  # noqa: E402
from distgraph.passes.pipeline.chunks import chunk_of_ops  # noqa: E402
from distgraph.passes.pipeline.task_graph import build_task_graph  # noqa: E402
from distgraph.plan.tags import MAX_TAG  # noqa: E402
from distgraph.program_builder import build_program  # noqa: E402
from distgraph.runtime.comm.simulated import SimulatedWorld  # noqa: E402

import plans as P  # noqa: E402

ALL = {**P.PLANS, **P.PIPELINE_PLANS}


def plan_of(key, model=None, **strategy):
    kind = key[0]
    if model is None:
        model = P.build_model(kind)
        ALL[key].annotate(model)
    ins, labels = dg.app.data.DataLoader(P.Dataset(kind, batch=16), 16).specs(1)
    built = build_program(model, ins, labels, P.loss_fn(kind), P.make_optimizer("adamw"))
    return dg.passes.plan(built, dg.Strategy(**strategy))


@pytest.mark.parametrize("schedule", ["FThenB", "1F1B", "ZB"])
def test_values_flow_down_the_stages_and_gradients_up(schedule):
    p = plan_of(("mlp4", "four_stage", 4), micro_batches=8, schedule=schedule)
    g = p.task_graph()
    assert len(g.stages) == 4 and g.chunks == g.stages
    forward = sorted((f.src[0], f.dst[0]) for f in g.flows if f.src[2] == "forward")
    assert forward == [(0, 1), (1, 2), (2, 3)]
    backward = sorted((f.src[0], f.dst[0]) for f in g.flows if f.src[2] != "forward")
    assert backward == [(1, 0), (2, 1), (3, 2)]
    back = "I" if schedule == "ZB" else "B"
    assert g.deps[(2, "F")] == {(1, "F")}
    assert g.deps[(2, back)] == {(2, "F"), (3, back)}      # its stash and the next gradient
    if schedule == "ZB":
        assert (2, "I") in g.deps[(2, "W")]
    assert [str(a) for a in p.schedule()[3][:4]] == \
        (["3F0", "3F1", "3F2", "3F3"] if schedule == "FThenB" else
         ["3F0", "3B0", "3F1", "3B1"] if schedule == "1F1B" else ["3F0", "3I0", "3F1", "3I1"])


def test_tasks_cut_each_local_program_by_role():
    p = plan_of(("gpt", "two_stage", 4), micro_batches=4)
    g = p.task_graph()
    for pid in range(4):
        stage = pid // 2
        tasks = g.tasks_of(pid)
        assert sorted(tasks, key=str) == sorted(
            [(stage, "forward"), (stage, "backward"), (None, "update")], key=str)
        local = p.local(pid)
        ops = [it.index for t in tasks.values() for it in t.items if it.kind == "op"]
        # each op once; the mean's count of labels is the prologue's, in no task
        prologue = [i for i, op in enumerate(local.program.ops)
                    if {o.name for o in op.outputs} <= p.accumulation.skipped]
        assert [local.program.ops[i].type for i in prologue] == \
            (["label_mask", "sum"] if pid >= 2 else [])
        # and the values the step makes once (the positions' lookup, the causal masks)
        once = p.accumulation.made_once(p.program)
        made_once = [i for i, op in enumerate(local.program.ops)
                     if op.outputs and {o.name for o in op.outputs} <= once]
        assert made_once and {local.program.ops[i].type for i in made_once} <= \
            {"slice", "embedding", "causal_mask", "full"}
        assert sorted(ops + prologue + made_once) == list(range(len(local.program.ops)))
        roles = {kind: {local.program.ops[it.index].role for it in t.items if it.kind == "op"}
                 for (_, kind), t in tasks.items()}
        assert roles["forward"] <= {"forward", "loss"}
        assert roles["backward"] == {"backward"} and roles["update"] == {"optimize"}
        items = [it.kind for it in tasks[None, "update"].items]
        assert items[-1] == "gather"                     # the loss, for every process
        grads = set(tasks[stage, "backward"].accumulates)
        assert grads and all(n.endswith("@GRAD") for n in grads)
    # the activation leaves stage 0 by a send after its forward, enters stage 1 by a recv
    assert [it.kind for it in g.tasks_of(0)[0, "forward"].items].count("send") == 1
    assert [it.kind for it in g.tasks_of(2)[1, "forward"].items][0] == "recv"
    assert "send" in [it.kind for it in g.tasks_of(2)[1, "backward"].items]
    assert "0:forward@0 -> 2:forward@1 points" in g.pretty()
    # the processes of a stage (data parallel here) run one order
    schedule = p.schedule()
    assert schedule[0] == schedule[1] and schedule[2] == schedule[3]


def test_zero_bubble_splits_backward_into_input_and_weight_gradients():
    p = plan_of(("gpt", "two_stage", 2), micro_batches=4, schedule="ZB")
    g = p.task_graph()
    for pid in (0, 1):
        tasks = g.tasks_of(pid)
        assert {(pid, "backward_input"), (pid, "backward_weight")} <= set(tasks)
        ops = p.local(pid).program.ops
        made_by_w = {o.name for it in tasks[pid, "backward_weight"].items if it.kind == "op"
                     for o in ops[it.index].outputs}
        read_by_b = {v.name for it in tasks[pid, "backward_input"].items if it.kind == "op"
                     for v in ops[it.index].inputs}
        assert made_by_w and not made_by_w & read_by_b    # I never waits for W
    sends = [it for it in g.tasks_of(1)[1, "backward_input"].items if it.kind == "send"]
    assert sends and not [it for it in g.tasks_of(1)[1, "backward_weight"].items
                          if it.kind == "send"]
    weight_ops = [p.local(1).program.ops[it.index].type
                  for it in g.tasks_of(1)[1, "backward_weight"].items if it.kind == "op"]
    assert "matmul" in weight_ops           # x^T dY of the linear layers


def test_tensor_parallel_peers_share_one_order():
    p = plan_of(("gpt", "two_stage_tp", 4), micro_batches=2)
    schedule = p.schedule()
    assert schedule[0] == schedule[1] and schedule[2] == schedule[3]
    assert [str(a) for a in schedule[2]] == ["1F0", "1B0", "1F1", "1B1"]


def overlapping(n_models):
    a, b = dg.ProcessMesh([0, 1], ["dp"]), dg.ProcessMesh([1, 2], ["dp"])
    models = []
    for _ in range(n_models):
        model = P.build_model("mlp")
        model.hooks.wraps["stage0"] = lambda fn: dg.shard_op(fn, a)
        model.hooks.wraps["stage1"] = lambda fn: dg.shard_op(fn, b)
        models.append(model)
    return models


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_a_process_in_two_stages_runs_both_in_data_flow_order(float64, micro_batches):
    """Stage 0 on processes 0 and 1, stage 1 on 1 and 2: process 1 runs its actions of
    both stages in one order, and the plan trains as serial."""
    p = plan_of(("mlp", "two_stage", 2), model=overlapping(1)[0], micro_batches=micro_batches)
    order = [str(a) for a in p.schedule()[1]]
    if micro_batches == 1:
        assert order == ["0F0", "1F0", "1B0", "0B0"]
    assert [str(a) for a in p.schedule()[0] if a.chunk == 0] == \
        [a for a in order if a.startswith("0")]
    models = overlapping(3)
    strategy = dg.Strategy(micro_batches=micro_batches)

    def rank(comm):
        engine = dg.Engine(models[comm.rank], P.loss_fn("mlp"), P.make_optimizer("adamw"),
                           strategy=strategy, communicator=comm)
        with P.BUILD_LOCK:
            engine.prepare(*dg.app.data.DataLoader(P.Dataset("mlp"), P.BATCH).specs(1))
        losses = engine.fit(P.Dataset("mlp"), batch_size=P.BATCH, verbose=0).losses
        return losses, engine.state_dict()

    reference = P.serial_reference("mlp")
    for result in SimulatedWorld(3, timeout=60).run(rank):
        errors = P.compare(result, reference, "float64")
        assert errors["loss"] <= 1e-10 and errors["param"] <= 1e-10, errors


class _EachAlone(Partitions):
    """Partitions whose every process is a group of its own: the task graph cut process
    by process, the oracle for the one cut per group."""

    def groups(self):
        return tuple((pid,) for pid in self.ids)


@pytest.mark.parametrize("key,strategy", [
    (("gpt", "two_stage_tp", 4), dict(micro_batches=4)),
    (("gpt", "dp_tp", 4), dict(micro_batches=2, schedule="ZB")),
    (("mlp", "param2_dp", 4), dict(micro_batches=4)),
    (("gpt", "param2_mp", 4), dict(micro_batches=4, schedule="ZB")),
])
def test_processes_on_the_same_meshes_are_cut_once_and_alike(key, strategy):
    p = plan_of(key, **strategy)
    groups = p.groups
    assert sorted(q for g in groups for q in g) == list(p.process_ids)
    assert any(len(g) > 1 for g in groups)
    for group in groups:
        first = partition(p.program, group[0])
        for pid in group:
            local = partition(p.program, pid)
            assert p.local(pid).pretty() == local.pretty()
            assert [(o.type, [v.shape for v in o.inputs]) for o in local.program.ops] == \
                [(o.type, [v.shape for v in o.inputs]) for o in first.program.ops]
            assert [(q.seq, q.reads, q.writes) for q in local.points()] == \
                [(q.seq, q.reads, q.writes) for q in first.points()]
    g = p.task_graph()
    alone = build_task_graph(p, _EachAlone(p.program, p.process_ids),
                             chunk_of_ops(p.program, g.chunks, None), g.chunks)
    assert alone.tasks == g.tasks and alone.flows == g.flows
    assert dict(alone.deps) == dict(g.deps) and alone.tags == g.tags
    assert dict(alone.points) == dict(g.points) and dict(alone.gathers) == dict(g.gathers)
    assert {pid: alone.step_bytes(p.local(pid), pid, p.micro_batches)
            for pid in p.process_ids} == p.bytes_sent()


def test_points_share_a_tag_channel_only_where_no_sender_receiver_pair_meets():
    p = plan_of(("mlp8", "layered", 4), micro_batches=4)
    g = p.task_graph()
    tags_ = g.tags
    pairs = {seq: {(t.src, t.dst) for st in g.points[seq].steps if st.kind == "send_recv"
                   for t in st.transfers if t.src != t.dst} for seq in tags_.channels}
    for a, b in itertools.combinations(sorted(tags_.channels), 2):
        if pairs[a] & pairs[b]:
            assert tags_.channels[a] != tags_.channels[b]
    assert tags_.channel_count < len(tags_.channels)     # stage boundaries share channels
    tags = {tags_.tag(seq, m) for seq in tags_.channels for m in range(4)}
    assert max(tags) < tags_.gather_tag(0) and tags_.gather_tag(len(g.fetch)) <= MAX_TAG


class _ReadTwice(dg.nn.Layer):
    """fc0 on mesh ``a``; its output read on mesh ``b`` twice, split by rows (fc1) and
    whole (fc2): two layouts of one received value (serial without meshes)."""

    def __init__(self, meshes=None):
        super().__init__()
        self.fc0, self.fc1, self.fc2 = (dg.nn.Linear(8, 16), dg.nn.Linear(16, 4),
                                        dg.nn.Linear(16, 4))
        self.meshes = meshes

    def forward(self, x):
        if self.meshes is None:
            h = dg.ops.relu(self.fc0(x))
            return self.fc1(h) + self.fc2(h)
        a, b = self.meshes
        h = dg.shard_op(lambda v: dg.ops.relu(self.fc0(v)), a)(x)
        y1 = dg.shard_op(self.fc1, b, in_shard_specs=[["mp", None, None]])(h)
        y2 = dg.shard_op(self.fc2, b, in_shard_specs=[[None, None, None]])(h)
        return dg.shard_op(lambda u, w: u + w, b)(y1, y2)


def _train_read_twice(meshes, comm=None, micro_batches=1):
    with P.BUILD_LOCK:        # the seed and the parameters' draws are shared by the threads
        dg.seed(0)
        model = _ReadTwice(meshes)
    engine = dg.Engine(model, P.loss_fn("mlp"), P.make_optimizer("adamw"),
                       strategy=dg.Strategy(micro_batches=micro_batches), communicator=comm)
    with P.BUILD_LOCK:
        engine.prepare(*dg.app.data.DataLoader(P.Dataset("mlp"), P.BATCH).specs(1))
    losses = engine.fit(P.Dataset("mlp"), batch_size=P.BATCH, verbose=0).losses
    return engine, (losses, engine.state_dict())


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_a_value_sent_to_a_stage_is_sent_once_and_resharded_there(float64, micro_batches):
    """A stage reading a received value in two layouts gets it once and reshards its copy
    (a second send would keep the value on its sender until then); it trains as serial."""
    meshes = (dg.ProcessMesh([0, 1], ["mp"]), dg.ProcessMesh([2, 3], ["mp"]))
    _, reference = _train_read_twice(None)

    def rank(comm):
        engine, result = _train_read_twice(meshes, comm, micro_batches)
        points = [p for p in engine.plan().local(comm.rank).points() if p.value != "x"]
        return result, [(p.value, p.transfers, str(p.src.mesh)) for p in points]

    for pid, (result, points) in enumerate(SimulatedWorld(4, timeout=60).run(rank)):
        errors = P.compare(result, reference, "float64")
        assert errors["loss"] <= 1e-10 and errors["param"] <= 1e-10, errors
        sent = collections.Counter(value for value, transfers, _ in points if transfers)
        assert sent and max(sent.values()) == 1, points
        if pid >= 2:      # the second layout made from the copy on mesh b
            assert any(not transfers and src == str(meshes[1]) for _, transfers, src in points
                       if _ in sent), points


@pytest.mark.parametrize("key,strategy", [
    (("gpt", "two_stage_tp", 4), dict(micro_batches=4)),
    (("gpt", "dp_tp", 4), dict(micro_batches=2)),
])
def test_a_process_lists_every_group_of_its_steps_once(key, strategy):
    """compile_process finds a collective's group once per (mesh, mesh dim) and scans a
    shared p2p step once: the groups equal those of every step of every point, found
    one by one."""
    from distgraph.passes.partition import gather_points
    from distgraph.plan.devices import COLLECTIVE, CommGroup, step_groups

    p = plan_of(key, **strategy)
    persist = sorted(v.name for v in p.program.persistables)
    for pid in p.process_ids:
        local = p.local(pid)
        found: dict = {}
        for point in (list(local.points()) + list(p.task_graph().gathers[pid])
                      + gather_points(p.program, persist, pid)):
            for step in point.steps:
                for g in step_groups(step, pid, p.ranks):
                    found.setdefault(g.key, g)
        for index, members in local.op_groups():
            if pid in members and len(members) > 1:
                g = CommGroup(COLLECTIVE, p.ranks.of(members),
                              f"op {local.program.ops[index].type}")
                found.setdefault(g.key, g)
        assert p.program_of(pid).comm_groups == tuple(found[k] for k in sorted(found))
        assert any(g.kind == COLLECTIVE for g in found.values())


def test_local_shapes_found_once_equal_each_layouts_own():
    """Partitions finds each (layout, shape)'s local shape once for all processes: every
    local value's shape is its layout's local shape of the global one."""
    p = plan_of(("gpt", "two_stage_tp", 4), micro_batches=4)
    for pid in p.process_ids:
        local = p.local(pid)
        for v in local.program.values.values():
            if v.name in p.program.values:
                g = p.program.values[v.name]
                assert tuple(v.shape) == g.dist_attr.local_shape(g.shape)
        for point in local.points():
            for name in point.writes:
                assert tuple(local.program.values[name].shape) == \
                    point.dst.local_shape(point.shape)


def _local_of(local) -> tuple:
    """Everything a local program holds, comparable."""
    prog = local.program
    return ([(v.name, tuple(v.shape), v.dtype, v.alias_of, v.dist_attr)
             for v in prog.values.values()],
            [v.name for v in prog.inputs],
            [(o.type, [v.name for v in o.inputs], [v.name for v in o.outputs],
              sorted(map(repr, o.attrs.items())), o.role, o.dist_attr) for o in prog.ops],
            {i: list(ps) for i, ps in local.comm_points.items()},
            {i: repr(c) for i, c in local.op_context.items()}, dict(local.op_comm))


@pytest.mark.parametrize("key,strategy", [
    (("gpt", "two_stage_tp", 4), dict(micro_batches=4, recompute=True)),
    (("gpt", "zero_dp_tp", 4), dict(micro_batches=2, sharding=True)),
    (("gpt", "four_stage", 4), dict(micro_batches=4, schedule="ZB")),
    (("mlp8", "layered", 4), dict(micro_batches=4)),
])
def test_partitions_from_one_skeleton_equal_each_process_partitioned_alone(key, strategy):
    """Partitions does the reshard bookkeeping alike for every process once and visits
    only a process's own ops: every local program equals partition()'s, which visits
    every op (points, their numbers and anchors, values, ops, contexts)."""
    p = plan_of(key, **strategy)
    parts = Partitions(p.program)
    for pid in p.process_ids:
        assert _local_of(parts[pid]) == _local_of(partition(p.program, pid))
