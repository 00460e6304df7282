"""Communication hidden behind compute (Strategy(overlap=True, bucket_mb=...)): the buckets
and where they start, the accountant's wire, the estimate's price, training equal
to serial with several buckets started mid-backward and ZeRO-3 gathers prefetched (on
threads and on real MPI ranks), and a rank that dies while its peers wait in a started
collective ending the job."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import distgraph as dg  # noqa: E402
from distgraph.ir import Role  # noqa: E402
from distgraph.plan.buckets import MB, gradient_buckets  # noqa: E402
from distgraph.passes.cost.exposed import finishes  # noqa: E402
from distgraph.runtime.comm.simulated import SimulatedWorld  # noqa: E402

import parallelize_cases as C  # noqa: E402
from user_scripts import run_user, with_prelude  # noqa: E402

TINY = 1e-6         # MB (a byte): every gradient its own bucket


def planned(kind: str, name: str, **strategy):
    layout = C.LAYOUTS[kind, name]
    model, optimizer = C.parallelized(kind, layout)
    engine = dg.Engine(model, loss=dg.nn.CrossEntropyLoss(), optimizer=optimizer,
                       strategy=dg.Strategy(**{**layout.strategy, **strategy}))
    engine.prepare(*dg.app.data.DataLoader(C.NextTokens(kind), C.BATCH).specs(1))
    return engine.plan()


@pytest.mark.parametrize("bad", [0, -1, "25", True, None])
def test_bucket_mb_must_be_a_positive_number(bad):
    with pytest.raises(dg.DistGraphError, match="bucket_mb must be a positive number"):
        dg.Strategy(bucket_mb=bad)


def test_overlap_must_be_true_or_false():
    with pytest.raises(dg.DistGraphError, match="overlap must be True or False"):
        dg.Strategy(overlap="yes")


def test_the_plan_file_keeps_overlap_and_the_bucket_size(tmp_path):
    plan = planned("gpt", "dp_z0", overlap=False, bucket_mb=3.5)
    path = tmp_path / "gpt.plan.json"
    plan.save(path)
    from distgraph.plan.file import read

    saved = read(str(path))
    assert (saved.strategy.overlap, saved.strategy.bucket_mb) == (False, 3.5)


def test_buckets_fill_in_the_order_gradients_are_made_up_to_the_cap():
    """Oracle: the reductions' producers and bytes read off the local program by hand."""
    plan = planned("gpt", "dp_z0")
    local = plan.local(0)
    ops = local.program.ops
    made = {o.name: i for i, op in enumerate(ops) for o in op.outputs}
    reductions = sorted((made[p.reads[0]], p.seq, p.steps[0].buffer_bytes)
                        for i, points in local.comm_points.items() for p in points
                        if i < len(ops) and ops[i].role is Role.OPTIMIZE
                        and [str(s.kind) for s in p.steps] == ["all_reduce"])
    assert len(reductions) > 4
    one_each = gradient_buckets(local, TINY)
    assert [b.points for b in one_each] == [(seq,) for _, seq, _ in reductions]
    assert [b.after for b in one_each] == [m for m, _, _ in reductions]
    whole = gradient_buckets(local, 1e6)
    assert len(whole) == 1 and whole[0].after == reductions[-1][0]
    assert whole[0].nbytes == sum(n for _, _, n in reductions)
    cap = sum(n for _, _, n in reductions[:3]) / MB       # the third gradient closes one
    first = gradient_buckets(local, cap)[0]
    assert first.points == tuple(seq for _, seq, _ in reductions[:3])


def test_each_bucket_starts_after_the_instruction_that_makes_its_last_gradient():
    plan = planned("gpt", "pp_dp_z2", bucket_mb=TINY)
    program = plan.program_of(0)
    assert len(program.starts) > 4
    made = {}
    for i, a in enumerate(program.actions):
        block = program.blocks[(a.chunk, a.task)]
        for j, instr in enumerate(block.instrs):
            for name in instr.writes:
                made[name] = (i, j)        # the last micro-batch's, in the end
    update = {x.point.seq: x for x in program.update.instrs if hasattr(x, "point")}
    for start in program.starts:
        assert (start.action, start.instr) == max(made[update[s].reads[0]]
                                                  for s in start.points)


def test_the_collectives_finish_one_wire_in_the_order_they_start():
    assert finishes([]) == []
    assert finishes([(0.2, 0.3)]) == pytest.approx([0.5])
    # one wire: the second waits for the first (0.1 + 0.5, then + 0.5)
    assert finishes([(0.1, 0.5), (0.2, 0.5)]) == pytest.approx([0.6, 1.1])
    assert finishes([(0.1, 0.1), (0.9, 0.1)]) == pytest.approx([0.2, 1.0])


def test_the_first_update_reads_the_first_bucket_reduced():
    """The update runs in the order the backward makes the gradients, so with overlap
    its first reduction is the first bucket's, which started first, and each later
    update reads a bucket started no earlier than the one before."""
    plan = planned("gpt", "dp_z0", bucket_mb=TINY)
    local = plan.locals[0]
    buckets = gradient_buckets(local, TINY)
    bucket_of = {seq: b for b, bucket in enumerate(buckets) for seq in bucket.points}
    read = [bucket_of[p.seq] for i in sorted(local.comm_points)
            for p in local.comm_points[i] if p.seq in bucket_of]
    assert len(read) == len(bucket_of) > 4
    assert read[0] == 0 and read == sorted(read)


def test_the_estimate_pays_what_overlap_leaves_exposed():
    """On a slow link the step with overlap is cheaper than without, by at most the
    reductions' wire time; one bucket made at the backward's end hides next to nothing."""
    cluster = dg.Cluster.from_file(os.path.join(HERE, "..", "resources", "clusters",
                                                "emulated_2x2.yaml"))
    off = dg.passes.estimate(planned("gpt", "dp_z0", overlap=False), cluster)
    on = dg.passes.estimate(planned("gpt", "dp_z0", bucket_mb=TINY), cluster)
    late = dg.passes.estimate(planned("gpt", "dp_z0", bucket_mb=1e6), cluster)
    assert on.step_time < off.step_time
    assert on.compute == pytest.approx(off.compute)
    assert late.step_time <= off.step_time
    assert late.step_time > on.step_time


def test_a_buckets_reductions_meet_once(monkeypatch):
    """The reductions of a bucket start together, so their group meets once: a measured
    per-step software cost (the meeting) adds one group's wait to a bucket of many
    reductions, and one to each of as many one-reduction buckets."""
    from distgraph.passes.cost import estimate as E
    from distgraph.passes.cost.overlap import bucket_seconds

    base = dg.Cluster.from_file(os.path.join(HERE, "..", "resources", "clusters",
                                             "emulated_2x2.yaml"))
    meeting = 5000.0                 # µs per 2-process step: 3 rounds over the 4 ranks

    def priced(bucket_mb, software):
        asked = []
        monkeypatch.setattr(E, "bucket_seconds",
                            lambda *args: asked.append(args) or bucket_seconds(*args))
        overhead = {"all_reduce": (meeting, 0.0)} if software else None
        cluster = dataclasses.replace(base, machines=tuple(
            dataclasses.replace(m, devices=tuple(
                dataclasses.replace(d, reshard_overhead=overhead) for d in m.devices))
            for m in base.machines))
        dg.passes.estimate(planned("gpt", "dp_z0", bucket_mb=bucket_mb), cluster)
        paid, hidden, seqs = bucket_seconds(*asked[0][:5], {})
        buckets = gradient_buckets(asked[0][1], bucket_mb)
        return paid + hidden, len(buckets), len(seqs)

    for mb in (1e6, TINY):
        with_software, buckets, reductions = priced(mb, True)
        without, _, _ = priced(mb, False)
        assert reductions > 4 and buckets == (1 if mb == 1e6 else reductions)
        assert with_software - without == pytest.approx(buckets * 3 * meeting * 1e-6)


@pytest.mark.parametrize("name", ["dp_z0", "dp_z3", "pp_dp_z2"])
def test_many_buckets_and_prefetch_train_equal_to_serial_on_threads(float64, name):
    serial = C.train(None, "gpt")
    layout = C.LAYOUTS["gpt", name]
    layout = dataclasses.replace(layout, strategy={**layout.strategy, "bucket_mb": TINY})
    for result in SimulatedWorld(layout.ranks, timeout=120).run(C.train, "gpt", layout):
        C.trains_equal(result, serial)


OVERLAPPED = [("gpt", "dp_z0"), ("gpt", "dp_z3"), ("gpt", "dp_mp_megatron_z2"),
              ("gpt", "pp_dp_z2"), ("llama", "dp_z2"), ("mixtral", "dp_ep_z3")]


@pytest.mark.mpi
def test_many_buckets_and_prefetch_train_equal_to_serial_on_mpi_ranks(float64, tmp_path):
    """Every gradient its own bucket, started where it is made, on real ranks: losses
    and parameters equal the serial run's (fp64, 1e-10)."""
    names = [f"{kind}:{name}@{TINY}" for kind, name in OVERLAPPED]
    proc = subprocess.run([sys.executable, "-m", "distgraph.cli", "run", "-n", "4",
                           os.path.join(HERE, "mpi_scripts", "parallelize_layouts.py"),
                           str(tmp_path), *names],
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    serial = {kind: C.train(None, kind) for kind in {k for k, _ in OVERLAPPED}}
    for kind, name in OVERLAPPED:
        for rank in range(4):
            got = np.load(tmp_path / f"{kind}_{name}@{TINY}_rank{rank}.npz")
            state = {k: got[k] for k in got.files if k != "losses"}
            C.trains_equal((got["losses"], state), serial[kind])


DIES = """
    import os

    class Dies(Rows):
        def __getitem__(self, i):
            # rank 1 reads the second batch, then ends: its peers run that step's
            # backward and wait in the gradients' reductions they started
            if dg.runtime.launch.status.get_rank() == 1 and i >= 16:
                os._exit(3)
            return super().__getitem__(i)

    mesh = dg.ProcessMesh([0, 1, 2, 3], ["dp"])
    engine = mlp_engine(strategy=dg.Strategy(bucket_mb=0.0001))
    data = dg.shard_dataloader(Dies(64), mesh, shard_dims="dp")
    engine.fit(data, batch_size=8, epochs=1, verbose=0)
    print("finished", flush=True)
"""


@pytest.mark.mpi
def test_a_rank_that_dies_while_its_peers_wait_in_a_started_reduction_ends_the_job(
        tmp_path):
    rc, out = run_user(tmp_path, with_prelude(DIES), 4, timeout=120,
                       DISTGRAPH_COMM_TIMEOUT="30")
    assert rc != 0, out
    assert "finished" not in out
    assert "rank 1" in out, out


def test_prefetched_gathers_pay_what_the_layer_before_leaves_exposed(monkeypatch):
    """ZeRO-3's gathers started a block ahead (prefetch_seconds, as the estimate calls it
    on a slow link): with no compute between them every gather is waited for whole, so
    they pay what the plain pricing of their steps sums to; with a second of compute per
    op only a pass's first gather waits for its wire, the others pay their copies. The
    gradient buckets share the wires with the backward's gathers."""
    from distgraph.passes.cost import estimate as E
    from distgraph.passes.cost.overlap import _wire, bucket_seconds, prefetch_seconds
    from distgraph.passes.cost.prices import reshard_step_time
    from distgraph.plan.buckets import prefetch_unit

    assert [prefetch_unit(x) for x in ("blocks.3.attn.qkv", "h.12", "wte", "")] == \
        ["blocks.3", "h.12", "wte", ""]
    asked = []
    monkeypatch.setattr(E, "prefetch_seconds",
                        lambda *args: asked.append(args) or prefetch_seconds(*args))
    cluster = dg.Cluster.from_file(os.path.join(HERE, "..", "resources", "clusters",
                                                "emulated_2x2.yaml"))
    dg.passes.estimate(planned("gpt", "dp_z3"), cluster)
    plan, local, pid, rings, scale, op_seconds = asked[0]
    points = {p.seq: p for p in local.points()}

    def full(seq):
        p = points[seq]
        return reshard_step_time(p.steps[0], pid, rings, scale.of_step(p, p.steps[0]))

    def wire(seq):
        p = points[seq]
        return _wire(p.steps[0], pid, rings, scale.of_step(p, p.steps[0]))

    free, busy = prefetch_seconds(plan, local, pid, rings, scale, {})
    assert busy and all(start >= 0 and seconds > 0 for start, seconds in busy)
    assert len(free) > 4
    assert sum(free.values()) == pytest.approx(sum(full(s) for s in free))
    slow, _ = prefetch_seconds(plan, local, pid, rings, scale,
                               dict.fromkeys(range(len(local.program.ops)), 1.0))
    waited = [s for s in slow if slow[s] > full(s) - wire(s) + 1e-12]
    assert 1 <= len(waited) <= 2                    # the forward's first, the backward's
    assert all(slow[s] == pytest.approx(full(s)) for s in waited)
    # (the clock runs to tens of seconds here: its rounding is some 1e-15 s)
    assert all(0 <= slow[s] <= full(s) + 1e-12 for s in slow)
    real, busy = prefetch_seconds(plan, local, pid, rings, scale, op_seconds)
    assert sum(slow.values()) <= sum(real.values()) <= sum(free.values())
    # the backward's buckets queue behind the gathers started before them on the wires
    alone = bucket_seconds(plan, local, pid, rings, scale, op_seconds)[0]
    assert bucket_seconds(plan, local, pid, rings, scale, op_seconds, busy)[0] >= alone
    assert bucket_seconds(plan, local, pid, rings, scale, op_seconds,
                          ((0.0, 100.0),))[0] > alone + 99.0


def test_a_device_that_hides_part_of_the_wire_pays_the_rest(monkeypatch):
    """``overlap_efficiency`` (what ``distgraph cluster calibrate`` measures on CPUs, whose
    cores move the bytes too): a device that hides nothing pays every prefetched ZeRO-3
    gather whole and hides none of the gradient buckets' wire; one that hides half pays
    half of what the other hides; the file's share reaches the devices."""
    from distgraph.passes.cost import estimate as E
    from distgraph.passes.cost.overlap import bucket_seconds, prefetch_seconds
    from distgraph.passes.cost.prices import reshard_step_time

    base = dg.Cluster.from_file(os.path.join(HERE, "..", "resources", "clusters",
                                             "emulated_2x2.yaml"))

    def hiding(share):
        return dataclasses.replace(base, machines=tuple(
            dataclasses.replace(m, devices=tuple(
                dataclasses.replace(d, overlap_efficiency=share) for d in m.devices))
            for m in base.machines))

    def priced(share):
        asked = []
        monkeypatch.setattr(E, "prefetch_seconds",
                            lambda *args: asked.append(args) or prefetch_seconds(*args))
        step = dg.passes.estimate(planned("gpt", "dp_z3"), hiding(share)).step_time
        return step, asked[0]

    whole, (plan, local, pid, rings, scale, op_seconds) = priced(None)
    none, args = priced(0.0)
    assert args[3].device(pid).hides == 0.0 and rings.device(pid).hides == 1.0
    points = {p.seq: p for p in local.points()}
    paid, _ = prefetch_seconds(*args)
    assert paid and all(paid[s] >= reshard_step_time(
        points[s].steps[0], pid, args[3], scale.of_step(points[s], points[s].steps[0]))
        * (1 - 1e-12) for s in paid)
    half, half_args = priced(0.5)
    buckets = {share: bucket_seconds(*a) for share, a in
               ((1.0, (plan, local, pid, rings, scale, op_seconds)), (0.0, args),
                (0.5, half_args))}
    assert buckets[1.0][1] > 0 and buckets[0.0][1] == pytest.approx(0.0, abs=1e-15)
    assert buckets[0.5][0] == pytest.approx(buckets[1.0][0] + 0.5 * buckets[1.0][1])
    assert whole < half < none
