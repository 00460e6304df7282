"""Weight-gradient actions of several micro-batches run as one task (planned in
passes/pipeline/batched.py, run by runtime/execution/batched.py): consecutive W actions of
one stage in a zero-bubble schedule are grouped, a
group's result is the sum of its micro-batches' results (oracle: the task run micro-batch
by micro-batch), and training with groups (a data-parallel stage's all-reduce inside one
among them) equals serial training."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402
from distgraph.program_builder import build_program  # noqa: E402
from distgraph.registry import KernelContext  # noqa: E402
from distgraph.runtime.backend import backend_of  # noqa: E402
from distgraph.runtime.execution.batched import run_batched  # noqa: E402
from distgraph.runtime.execution.executor import run_op  # noqa: E402
from distgraph.plan.kinds import AccumulationMode  # noqa: E402

import plans as P  # noqa: E402
from test_pipeline import check_equal, run_pipeline, serial  # noqa: E402

BATCH = 16


def planned(key, micro_batches=8, schedule="ZB", virtual=1):
    kind = key[0]
    model = P.build_model(kind)
    P.PIPELINE_PLANS[key].annotate(model)
    ins, labels = dg.app.data.DataLoader(P.Dataset(kind, batch=BATCH), BATCH).specs(1)
    built = build_program(model, ins, labels, P.loss_fn(kind), P.make_optimizer("sgd"))
    return dg.passes.plan(built, dg.Strategy(micro_batches=micro_batches, schedule=schedule,
                                             virtual_stages=virtual))


def groups(plan, pid):
    program = plan.program_of(pid)
    return program, [" ".join(str(program.actions[i]) for i in g) for g in program.batched]


def test_the_weight_gradients_zero_bubble_leaves_to_the_end_are_grouped():
    plan = planned(("gpt6", "param4", 4), virtual=2)
    orders = {pid: " ".join(map(str, acts)) for pid, acts in plan.schedule().items()}
    assert "3W4 3W5 3W6 3W7" in orders[3], orders[3]
    program, found = groups(plan, 3)
    assert "3W4 3W5 3W6 3W7" in found
    assert set(program.batched_tasks) == {(3, "backward_weight"), (7, "backward_weight")}
    for names in found:                 # each group: consecutive W of one stage in the order
        assert names in orders[3] and len({a[0] for a in names.split()}) == 1
    _, first = groups(plan, 0)
    assert first == ["0W6 0W7"]
    _, one_f1b = groups(planned(("gpt6", "param4", 4), schedule="1F1B", virtual=2), 3)
    assert one_f1b == []                # whole backwards: nothing to group


@pytest.mark.parametrize("key,pid", [(("gpt", "param2", 2), 0), (("gpt", "param2", 2), 1),
                                     (("mlp8", "param4", 4), 2)], ids=str)
def test_a_group_gives_the_sum_of_its_micro_batches(float64, key, pid):
    """The group's joined run against the W task run micro-batch by micro-batch on the
    same random operands (embeddings' scatter-add, a sliced parameter's gradient, the
    Linear layers' reshape + matmul + bias sum)."""
    plan = planned(key)
    program = plan.program_of(pid)
    key_w = next(k for k in program.batched_tasks)
    block = program.blocks[key_w]
    values = plan.local(pid).program.values
    made = {n for instr in block.instrs for n in instr.writes}
    reads = [n for instr in block.instrs for n in instr.reads if n not in made]
    rng = np.random.default_rng(0)
    micro_batches = [2, 3, 5]
    envs = {m: {} for m in micro_batches}
    for m in micro_batches:
        for name in dict.fromkeys(reads):
            v = values[name]
            envs[m][name] = (rng.integers(0, P.GPT_DIMS["vocab_size"], v.shape)
                             if v.dtype == "int64" else rng.standard_normal(v.shape))
    ctx = KernelContext(np, 0)
    expected: dict = {}
    for m in micro_batches:
        env = dict(envs[m])
        for instr in block.instrs:
            run_op(instr, env, {}, ctx)
        for name in block.task.accumulates:
            expected[name] = expected.get(name, 0) + env[name]
    got = run_batched(program.batched_tasks[key_w], envs, micro_batches, {}, ctx,
                      backend_of(None), None)
    assert sorted(got) == sorted(expected) and got
    for name in got:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-12, atol=1e-12)


def _operands(plan, pid, micro_batches):
    """(W block, its BatchedTask, {m: random operands}) of ``pid``'s first batchable task."""
    program = plan.program_of(pid)
    key_w = next(k for k in program.batched_tasks)
    block = program.blocks[key_w]
    values = plan.local(pid).program.values
    made = {n for instr in block.instrs for n in instr.writes}
    reads = [n for instr in block.instrs for n in instr.reads if n not in made]
    rng = np.random.default_rng(0)
    envs = {m: {} for m in micro_batches}
    for m in micro_batches:
        for name in dict.fromkeys(reads):
            v = values[name]
            envs[m][name] = (rng.integers(0, P.GPT_DIMS["vocab_size"], v.shape)
                             if v.dtype == "int64" else rng.standard_normal(v.shape))
    return block, program.batched_tasks[key_w], envs


@pytest.mark.parametrize("key,pid", [(("gpt", "param2", 2), 0), (("gpt", "param2", 2), 1),
                                     (("mlp8", "param4", 4), 2)], ids=str)
def test_a_group_holds_its_micro_batches_and_one_joined_copy(float64, key, pid):
    """Oracle: the W task run micro-batch by micro-batch, each operand dropped at its
    last use and each gradient added to its buffer as it is made (what the carrier does
    with one action). The group, handing its sums over as they are made (``emit``) and
    letting go of the operands it has joined (``release``), holds at its peak no more
    than that plus the copies one op joins; it held every gradient of the chunk and the
    joined operands' originals to its end before (ZB's last stage held 15% more than
    the estimate's figure in bench/memory_check.py)."""
    from distgraph.plan.instructions import last_uses
    from distgraph.runtime.execution.memory import Counted, Ledger

    micro_batches = [2, 3, 5]
    block, task, operands = _operands(planned(key), pid, micro_batches)
    ctx = KernelContext(np, 0)

    def add(acc, name, value):
        if name in acc:
            acc[name] += value
        else:
            acc[name] = value

    one = Ledger(backend_of(None))
    envs = {m: Counted(one, operands[m]) for m in micro_batches}
    serial = Counted(one)
    frees = last_uses(block.instrs, ())
    for m in micro_batches:
        for instr, names in zip(block.instrs, frees):
            run_op(instr, envs[m], {}, ctx)
            one.settle()
            for name in names:
                value = envs[m].pop(name, None)
                if name in block.task.accumulates:
                    add(serial, name, value)

    joined = Ledger(backend_of(None))
    envs = {m: Counted(joined, operands[m]) for m in micro_batches}
    sums = Counted(joined)
    copies = max(sum(len(micro_batches) * operands[micro_batches[0]][name].nbytes
                     for name, (mode, _) in zip(op.instr.reads, op.joins)
                     if mode is not AccumulationMode.KEEP and name in operands[2])
                 for op in task.ops)
    released = []

    def release(name):
        released.append(name)
        for m in micro_batches:
            envs[m].pop(name)

    left = run_batched(task, envs, micro_batches, {}, ctx, backend_of(None), None, joined,
                       emit=lambda name, value: add(sums, name, value), release=release)
    assert left == {} and sorted(sums) == sorted(serial) and released
    for name in sums:
        np.testing.assert_allclose(sums[name], serial[name], rtol=1e-12, atol=1e-12)
    assert joined.peak <= one.peak + copies, (joined.peak, one.peak, copies)
    # what remains is the buffers and the operands the task keeps reading from the first
    # micro-batch
    assert joined.bytes == one.bytes + sum(envs[m][n].nbytes for m in micro_batches
                                           for n in envs[m])


@pytest.mark.slow
def test_training_with_grouped_weight_gradients_equals_serial(float64):
    """GPT on two data-parallel stages, interleaved zero bubble: stage 0's group holds the
    all-reduce of the position embedding's gradient, run once for the group."""
    key = ("gpt", "param2_dp", 4)
    assert groups(planned(key, virtual=2), 0)[1] == ["0W6 0W7"]
    results = run_pipeline(key, 8, "ZB", profile=True, virtual=2)
    check_equal(results, serial("gpt"))
    events = [e for e in results[0][3].events if e.rank == 0 and e.step == 0
              and e.kind == "backward_weight"]
    assert [(e.stage, e.micro_batch) for e in events][-2:] == [(0, 6), (0, 7)]
