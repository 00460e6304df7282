"""The schedule as a value: torch's notation, the rules against torch.distributed.pipelining's
schedules in the unit-cost model (each F, I and W costs one unit of a chunk's work, B two;
an action starts when its inputs are done and its process is free), and the check that
refuses a schedule that cannot complete."""

import os
import sys
from types import MappingProxyType

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402
from distgraph.passes.pipeline.schedule import chain, make_schedule  # noqa: E402
from distgraph.plan.replay import Problem, replay  # noqa: E402
from distgraph.plan.kinds import TaskKind  # noqa: E402
from distgraph.plan.schedule import Action  # noqa: E402

import torch_schedules as T  # noqa: E402


def test_actions_print_in_torchs_notation():
    assert str(Action(0, "F", 3)) == "0F3" and str(Action(1, "I", 0)) == "1I0"
    assert Action.parse("12W7") == Action(12, "W", 7)
    assert Action(1, "W", 0).task is TaskKind.BACKWARD_WEIGHT
    with pytest.raises(dg.PlanError, match="not an action"):
        Action.parse("0X1")


def _cases(S, M):
    """(our schedule name, virtual stages, torch's order) of every kind torch has here."""
    out = [("FThenB", 1, T.gpipe(S, M))]
    if M >= S:
        out.append(("1F1B", 1, T.one_f_one_b(S, M)))
    for v in (1, 2, 3):
        try:
            il, zb = T.interleaved(S, v, M), T.interleaved(S, v, M, zero_bubble=True)
        except ValueError:
            continue
        if v > 1:
            out.append(("1F1B", v, il))
        out.append(("ZB", v, zb))
    out.append(("ZBV", 2, T.zbv(S, M)))
    return out


@pytest.mark.parametrize("S", [2, 3, 4, 8])
def test_our_schedules_finish_no_later_and_hold_no_more_than_torchs(S):
    ms = sorted({1, 2, S - 1, S, S + 1, 2 * S - 1, 2 * S, 3 * S} - {0})
    for M in ms:
        for name, v, theirs in _cases(S, M):
            problem = chain(S, v, M, name)
            ours = make_schedule(problem)
            mine, ref = replay(ours.orders, problem), replay(theirs, problem)
            where = f"{name} v={v} S={S} M={M}"
            assert mine.makespan <= ref.makespan, (where, mine.makespan, ref.makespan)
            for pid in ref.peak:
                assert mine.peak[pid] <= ref.peak[pid], (where, pid, dict(mine.peak),
                                                         dict(ref.peak))


def test_one_f_one_b_is_torchs_order():
    for S, M in [(2, 4), (4, 4), (4, 8), (3, 7)]:
        ours = make_schedule(chain(S, 1, M, "1F1B"))
        assert ours.as_dict() == T.one_f_one_b(S, M)


def test_interleaved_bubble_is_megatrons():
    """(S-1)/v idle units of a micro-batch's work on every process, as Megatron's
    interleaved schedule: the pipeline fills v times faster."""
    for S, v, M in [(4, 2, 8), (4, 2, 16), (2, 3, 6)]:
        problem = chain(S, v, M, "1F1B")
        timing = replay(make_schedule(problem).orders, problem)
        work = M * v * 3          # F 1 + B 2 per chunk and micro-batch
        assert timing.makespan == work + (S - 1) * 3, (S, v, M, timing.makespan)


def test_zbv_fills_its_bubble_below_interleaved_1f1b():
    S, M = 4, 8
    il = chain(S, 2, M, "1F1B")
    zbv = chain(S, 2, M, "ZBV")
    assert replay(make_schedule(zbv).orders, zbv).makespan < \
        replay(make_schedule(il).orders, il).makespan


def test_without_micro_batches_each_stage_runs_one_forward_and_one_backward():
    problem = chain(3, 1, 1, "1F1B")
    sched = make_schedule(problem)
    assert {p: [str(a) for a in acts] for p, acts in sched.as_dict().items()} == \
        {0: ["0F0", "0B0"], 1: ["1F0", "1B0"], 2: ["2F0", "2B0"]}
    assert "process 1: 1F0 1B0" in sched.pretty()


def test_a_schedule_that_cannot_complete_is_refused():
    problem = chain(2, 1, 2, "1F1B")
    good = make_schedule(problem).as_dict()
    # process 1 runs its second forward before the first backward its peer waits for
    swapped = dict(good)
    swapped[0] = [Action(0, "F", 0), Action(0, "B", 0), Action(0, "F", 1), Action(0, "B", 1)]
    swapped[1] = [Action(1, "F", 1), Action(1, "F", 0), Action(1, "B", 0), Action(1, "B", 1)]
    with pytest.raises(dg.PlanError, match="cannot complete: process 0 waits at 0B0 for 1B0; "
                                           "process 1 waits at 1F1 for 0F1"):
        replay(swapped, problem)
    missing = dict(good)
    missing[1] = good[1][:-1]
    with pytest.raises(dg.PlanError, match="missing 1B1"):
        replay(missing, problem)


def test_tensor_parallel_peers_must_order_their_actions_alike():
    problem = Problem(2, ((0, 1),), (("F", "B"),),
                      MappingProxyType({(0, "F"): frozenset(), (0, "B"): frozenset({(0, "F")})}))
    sched = make_schedule(problem)
    assert sched.of(0) == sched.of(1)
    other = [Action(0, "F", 1), Action(0, "F", 0), Action(0, "B", 0), Action(0, "B", 1)]
    with pytest.raises(dg.PlanError, match="process 0 waits at 0F0 for process 1 at 0F1"):
        replay({0: list(sched.of(0)), 1: other}, problem)


def test_stages_that_exchange_data_in_a_circle_have_no_schedule():
    deps = {(0, "F"): frozenset({(1, "F")}), (1, "F"): frozenset({(0, "F")})}
    problem = Problem(1, ((0,), (1,)), (("F",), ("F",)), MappingProxyType(deps))
    with pytest.raises(dg.PlanError, match="in a circle"):
        make_schedule(problem)


def test_the_reference_orders_are_torchs():
    """tests/torch_schedules.py against torch itself (skipped without torch): the compute
    actions of each rank's ``pipeline_order``, torch's idle slots left out."""
    torch = pytest.importorskip("torch")
    from torch.distributed.pipelining import schedules as S

    class Stage:                  # what the schedules read of a pipeline stage
        def __init__(self, index, n, size, rank):
            self.stage_index, self.num_stages = index, n
            self.group_size, self.group_rank = size, rank
            self.is_first, self.is_last = index == 0, index == n - 1
            self.submod = torch.nn.Linear(1, 1)

    def torch_order(cls, size, v, M):
        out = {}
        for r in range(size):
            indices = [r, 2 * size - 1 - r] if cls is S.ScheduleZBVZeroBubble else \
                [r + i * size for i in range(v)]
            sched = cls([Stage(i, size * v, size, r) for i in indices], M,
                        loss_fn=lambda out, target: out)
            out[r] = [Action.parse(str(a)) for a in sched.pipeline_order[r]
                      if a is not None and str(a.computation_type.value) in "FBIW"]
        return out

    def same(cls, size, v, M, ours):
        try:
            expected = ours()
        except ValueError:        # torch refuses these micro-batch counts too
            with pytest.raises(ValueError):
                torch_order(cls, size, v, M)
            return
        assert torch_order(cls, size, v, M) == expected, (cls.__name__, size, v, M)

    for size in (2, 3, 4):
        for M in range(1, 3 * size + 1):
            for v in (2, 3):
                same(S.ScheduleInterleaved1F1B, size, v, M,
                     lambda: T.interleaved(size, v, M))
            for v in (1, 2):
                same(S.ScheduleInterleavedZeroBubble, size, v, M,
                     lambda: T.interleaved(size, v, M, zero_bubble=True))
            same(S.ScheduleZBVZeroBubble, size, 2, M, lambda: T.zbv(size, M))


@pytest.mark.parametrize("name", ["1F1B", "ZB", "FThenB"])
def test_peers_with_one_order_replay_as_one_process(name):
    """Replay moves processes that hold the same chunks and run the same order as one:
    a stage of four tensor-parallel peers replays like a stage of one."""
    alone = chain(3, 1, 6, name)
    peers = {0: (0, 1, 2, 3), 1: (4, 5, 6, 7), 2: (8, 9, 10, 11)}
    wide = Problem(6, tuple(peers[c] for c in range(3)), alone.kinds, alone.deps, name, 3)
    orders = make_schedule(wide).orders
    one = replay({c: orders[peers[c][0]] for c in range(3)}, alone)
    many = replay(orders, wide)
    assert many.makespan == one.makespan and dict(many.finish) == dict(one.finish)
    assert dict(many.peak) == {q: one.peak[c] for c, qs in peers.items() for q in qs}
    late = dict(orders)
    late[5] = list(orders[5][1:]) + [orders[5][0]]      # one peer out of step: refused
    with pytest.raises(dg.PlanError, match="cannot complete"):
        replay(late, wide)


def _finish_times(orders, problem, seconds=None) -> dict:
    """Each action's finish on the unit-cost clock (or with ``seconds`` per (chunk,
    kind)), from its definition: it starts when the previous action of every process
    that holds its chunk and its inputs are done."""
    from distgraph.plan.replay import COST

    before = {}
    for acts in orders.values():
        for prev, a in zip([None] + list(acts), acts):
            before.setdefault(a, set()).add(prev)
    finish: dict = {}
    while len(finish) < len(before):
        for a, prevs in before.items():
            deps = [Action(c, k, a.micro_batch)
                    for c, k in problem.deps.get((a.chunk, a.kind), ())]
            needs = [p for p in prevs if p is not None] + deps
            if a not in finish and all(n in finish for n in needs):
                finish[a] = max([finish[n] for n in needs], default=0.0) + (
                    COST[a.kind] if seconds is None else seconds[a.chunk, a.kind])
    return finish


@pytest.mark.parametrize("S", [2, 3, 4])
def test_replay_times_every_action_as_its_definition_does(S):
    """replay's times are those of the definition; processes that share one order
    object (a schedule's group) are grouped as those with equal copies are."""
    for M in (1, S, 2 * S + 1):
        for name, v, theirs in _cases(S, M):
            problem = chain(S, v, M, name)
            for orders in (make_schedule(problem).orders, theirs):
                timing = replay(orders, problem)
                assert dict(timing.finish) == _finish_times(orders, problem)
                assert replay({p: list(a) for p, a in orders.items()}, problem) == timing


@pytest.mark.parametrize("name", ["1F1B", "FThenB", "ZB", "ZBV"])
def test_replay_with_seconds_times_every_action_as_its_definition_does(name):
    """Each action lasting the seconds given for its (chunk, kind), as a plan's report
    lays a schedule out: the times are the definition's; with every stage's F taking f
    and B taking b, 1F1B and FThenB on S stages end at (M + S - 1)(f + b)."""
    rng = np.random.default_rng(0)
    S, M = 4, 6
    problem = chain(S, 1, M, name)
    seconds = {(c, k): float(rng.uniform(0.5, 3.0))
               for c in range(problem.chunks) for k in problem.kinds[c]}
    orders = make_schedule(problem).orders
    timing = replay(orders, problem, seconds)
    assert dict(timing.finish) == pytest.approx(_finish_times(orders, problem, seconds))
    if name in ("1F1B", "FThenB"):
        even = {(c, k): 0.3 if k == "F" else 0.7 for c, k in seconds}
        assert replay(orders, problem, even).makespan == pytest.approx((M + S - 1) * 1.0)

