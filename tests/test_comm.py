import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from distgraph.errors import RuntimeFault
from distgraph.passes.cost.formulas import collective_bytes, collective_time
from distgraph.runtime.comm.base import default_timeout
from distgraph.runtime.comm.simulated import SimulatedWorld
from distgraph.runtime.launch.launcher import launch_command, rank_env

SCRIPT = Path(__file__).parent / "mpi_scripts" / "comm_checks.py"


def value(rank, shape=(4, 6)):
    return np.arange(np.prod(shape), dtype=np.float64).reshape(shape) * (rank + 1)


@pytest.mark.parametrize("group", [(0, 1, 2, 3), (3, 1), (2,)])
def test_simulated_collectives_match_numpy(group):
    n = len(group)

    def body(comm):
        if comm.rank not in group:
            return None
        x = value(comm.rank)
        me = group.index(comm.rank)
        total = sum(value(g) for g in group)
        assert np.array_equal(comm.all_gather(x, group, axis=1),
                              np.concatenate([value(g) for g in group], axis=1))
        assert np.array_equal(comm.all_reduce(x, group), total)
        assert np.array_equal(comm.all_reduce(x, group, op="max"), value(max(group)))
        assert np.array_equal(comm.reduce_scatter(x, group, axis=0),
                              np.split(total, n, axis=0)[me])
        y = value(comm.rank, (4, 4))
        want = np.concatenate([np.split(value(g, (4, 4)), n, axis=1)[me] for g in group],
                              axis=0)
        assert np.array_equal(comm.all_to_all(y, group, split_axis=1, concat_axis=0), want)
        return dict(comm.bytes_sent)

    results = SimulatedWorld(4, timeout=20).run(body)
    b = value(0).nbytes
    expected = {"all_gather": collective_bytes("all_gather", n, n * b),
                "all_reduce": 2 * collective_bytes("all_reduce", n, b),
                "reduce_scatter": collective_bytes("reduce_scatter", n, b),
                "all_to_all": collective_bytes("all_to_all", n, value(0, (4, 4)).nbytes),
                "send_recv": 0.0}
    for rank in group:
        assert results[rank] == expected


def _rows(src, dst, n):
    """The rows rank ``src`` sends rank ``dst`` in the all_to_allv checks: (src + dst) % 3
    of them (none for some pairs), each naming its sender, receiver and place."""
    k = (src + dst) % 3
    return np.array([[src, dst, i] for i in range(k)], dtype=np.float64).reshape(k, 3)


@pytest.mark.parametrize("group", [(0, 1, 2, 3), (3, 1), (2,)])
def test_simulated_all_to_allv_sends_variable_counts(group):
    def body(comm):
        if comm.rank not in group:
            return None
        send = [len(_rows(comm.rank, g, 0)) for g in group]
        recv = [len(_rows(g, comm.rank, 0)) for g in group]
        arr = np.concatenate([_rows(comm.rank, g, 0) for g in group])
        out = comm.all_to_allv(arr, send, recv, group)
        assert np.array_equal(out, np.concatenate([_rows(g, comm.rank, 0) for g in group]))
        me = group.index(comm.rank)
        return comm.bytes_sent["all_to_all"], (sum(send) - send[me]) * 3 * 8

    for r in SimulatedWorld(4, timeout=20).run(body):
        if r is not None:
            assert r[0] == r[1]


def test_simulated_all_to_allv_refuses_wrong_counts():
    def body(comm):
        with pytest.raises(RuntimeFault, match="all_to_allv"):
            comm.all_to_allv(np.zeros((3, 2)), [1, 1], [1, 1], (0, 1))

    SimulatedWorld(2, timeout=20).run(body)


def test_simulated_p2p_counts_and_orders_messages():
    def body(comm):
        right, left = (comm.rank + 1) % 3, (comm.rank - 1) % 3
        comm.send(np.full((2, 2), comm.rank), right, tag=1)
        comm.send(np.full(3, 10.0 * comm.rank), right, tag=2)
        comm.send(np.full(3, 20.0 * comm.rank), right, tag=2)
        a = comm.recv((3,), np.float64, left, tag=2)
        b = comm.recv((3,), np.float64, left, tag=2)
        c = comm.recv((2, 2), np.int64, left, tag=1)
        comm.wait_sends()
        comm.barrier()
        return a[0], b[0], c[0, 0], comm.bytes_sent["send_recv"], comm.calls["send_recv"]

    out = SimulatedWorld(3, timeout=20).run(body)
    assert out[0] == (20.0, 40.0, 2, 32 + 24 + 24, 3)


def test_simulated_receives_match_in_posting_order():
    """MPI's rule (and NCCL's here): the receives posted on one (source, tag) take its
    messages in the order they were posted, whichever is tested first; a blocking receive
    and a cancelled one keep their places. Ring attention polls its two receives ahead
    (k, v blocks; dk, dv sums) newest last: when a message arrived between the two
    tests, the newer receive took the older block (issue 34's flaky ring layouts)."""
    def body(comm):
        if comm.rank == 1:
            comm.barrier()
            for i in range(5):
                comm.isend(np.full(2, float(i)), 0, tag=7)
            comm.barrier()
            return None
        first, second = (comm.irecv((2,), np.float64, 1, tag=7) for _ in range(2))
        gone = comm.irecv((2,), np.float64, 1, tag=7)
        third = comm.irecv((2,), np.float64, 1, tag=7)
        gone.cancel()
        comm.barrier()
        comm.barrier()                          # every message has arrived
        assert second.test() and first.test() and third.test()
        fourth = comm.recv((2,), np.float64, 1, tag=7)
        fifth = comm.wait([comm.irecv((2,), np.float64, 1, tag=7)])[0]
        return [r.value[0] for r in (first, second, third)] + [fourth[0], fifth[0]]

    assert SimulatedWorld(2, timeout=20).run(body)[0] == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_simulated_recv_timeout_names_rank_and_message():
    world = SimulatedWorld(2, timeout=0.3)
    with pytest.raises(RuntimeFault, match=r"rank 1: timed out after 0.3 s waiting for a "
                                           r"message from rank 0 with tag 5") as info:
        world.run(lambda comm: comm.recv((2,), "float64", 0, tag=5) if comm.rank else None)
    # a rank aborting a job for it waits for no peer to fail too (bootstrap.abort_job)
    assert info.value.timed_out and not RuntimeFault("another failure").timed_out


def test_simulated_collective_timeout_names_missing_ranks():
    world = SimulatedWorld(3, timeout=0.3)
    with pytest.raises(RuntimeFault, match=r"all_reduce #0 on group \(0, 1, 2\) \(missing "
                                           r"ranks \[2\]\)"):
        world.run(lambda comm: comm.all_reduce(np.ones(2), (0, 1, 2)) if comm.rank < 2 else 0)



def test_broadcast_bytes_gives_the_roots_bytes_to_every_rank_after_a_long_wait():
    """The root's bytes (every byte value, ~0.3 MB, as a plan's text is sent) on every
    rank, uncounted; the others wait for a root slower than the communicator's timeout
    where ``timeout`` allows it, and time out where it does not."""
    data = bytes(range(256)) * 1200 + b"end"

    def body(comm, timeout):
        if comm.rank == 1:
            time.sleep(0.6)                 # the root, still planning
        got = comm.broadcast_bytes(data if comm.rank == 1 else None, root=1, timeout=timeout)
        return got, comm.total_bytes_sent

    results = SimulatedWorld(3, timeout=0.3).run(lambda comm: body(comm, 5.0))
    assert results == [(data, 0.0)] * 3
    with pytest.raises(RuntimeFault, match="timed out after 0.3 s"):
        SimulatedWorld(3, timeout=0.3).run(lambda comm: body(comm, None))

def test_simulated_mismatched_collectives_raise():
    world = SimulatedWorld(2, timeout=20)

    def body(comm):
        if comm.rank == 0:
            return comm.all_reduce(np.ones(2), (0, 1))
        return comm.all_gather(np.ones(2), (0, 1))

    with pytest.raises(RuntimeFault, match="different plans"):
        world.run(body)


def test_simulated_failure_on_one_rank_releases_the_others():
    world = SimulatedWorld(4, timeout=30)
    released = []

    def body(comm):
        if comm.rank == 2:
            raise ValueError("boom on rank 2")
        try:
            comm.barrier()
        except RuntimeFault as exc:
            released.append(str(exc))
            raise

    with pytest.raises(ValueError, match="boom on rank 2"):
        world.run(body)
    assert len(released) == 3 and all("rank 2 failed" in m for m in released)
    # the world is reusable after a failure
    assert world.run(lambda comm: comm.rank) == [0, 1, 2, 3]
    assert threading.active_count() < 20


def test_bad_calls_raise_runtime_fault():
    def body(comm):
        with pytest.raises(RuntimeFault, match="does not contain this rank"):
            comm.all_reduce(np.ones(2), (1 - comm.rank,))
        with pytest.raises(RuntimeFault, match="cannot be split into 2"):
            comm.reduce_scatter(np.ones(3), (0, 1))
        with pytest.raises(RuntimeFault, match="distinct ranks"):
            comm.all_gather(np.ones(3), (0, 0))
        with pytest.raises(RuntimeFault, match="tag"):
            comm.send(np.ones(1), 1 - comm.rank, tag=-1)
        with pytest.raises(RuntimeFault, match="op 'mean'"):
            comm.all_reduce(np.ones(2), (0, 1), op="mean")

    SimulatedWorld(2, timeout=5).run(body)


def test_default_timeout_from_environment(monkeypatch):
    monkeypatch.delenv("DISTGRAPH_COMM_TIMEOUT", raising=False)
    assert default_timeout() == 60.0
    monkeypatch.setenv("DISTGRAPH_COMM_TIMEOUT", "2.5")
    assert default_timeout() == 2.5
    assert SimulatedWorld(1).communicator(0).timeout == 2.5
    monkeypatch.setenv("DISTGRAPH_COMM_TIMEOUT", "soon")
    with pytest.raises(RuntimeFault, match="DISTGRAPH_COMM_TIMEOUT"):
        default_timeout()


def test_cost_formulas():
    assert collective_bytes("all_gather", 4, 4096) == 3072
    assert collective_bytes("reduce_scatter", 4, 4096) == 3072
    assert collective_bytes("all_reduce", 4, 4096) == 6144
    assert collective_bytes("all_to_all", 4, 4096) == 3072
    assert collective_bytes("send_recv", 2, 100) == 100
    assert collective_bytes("slice", 4, 100) == 0
    assert collective_bytes("all_reduce", 1, 100) == 0
    t = collective_time("all_gather", 4, 4e9, bandwidth_GBps=1, latency_us=10)
    assert t == pytest.approx(3 * 10e-6 + 3.0)
    assert collective_time("all_reduce", 4, 4e9, 1, 10) == pytest.approx(2 * t)
    assert collective_time("send_recv", 2, 1e9, 2, 5) == pytest.approx(5e-6 + 0.5)


@pytest.mark.mpi
def test_mpi_communicator_on_four_ranks():
    proc = subprocess.run(launch_command(4, [str(SCRIPT)]), env=rank_env(),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "comm-mpi OK" in proc.stdout


def test_an_all_reduce_between_machines_runs_on_nccls_tree_where_that_is_faster():
    """NCCL's tuner runs a GPU all-reduce over several machines on its double binary tree
    where that beats the ring: 2 ceil(log2 n) latencies of the slowest hop and about
    2 B / bw, against the ring's 2 (n - 1) latencies and 2 (n - 1)/n B / bw. The oracle is
    the two formulas by hand on the ring's own hop figures: a small gradient's
    all-reduce over the 16 GPUs of two machines takes the tree, a large one the ring,
    and a group inside one machine (where NCCL's tree is a chain) the ring always."""
    import distgraph as dg
    from distgraph.passes.cost.prices import Rings

    cluster = dg.Cluster.from_file(Path(__file__).resolve().parents[1] / "resources" /
                                   "clusters" / "gpu_2x8.yaml")
    rings = Rings(cluster, lambda p: p)
    across = rings.along(dg.ProcessMesh([list(range(16))], ["x", "y"]), 0, "y")
    alpha, beta = across.latency * 1e-6, 1 / (across.bandwidth * 1e9)
    small, large = 8e3, 1e9
    tree = 2 * 4 * alpha + 2 * small * beta
    ring = 2 * 15 * alpha + 2 * 15 / 16 * small * beta
    assert across.tree and tree < ring
    assert across.seconds("all_reduce", 16, small) == pytest.approx(tree, rel=1e-12)
    assert across.seconds("all_reduce", 16, large) == pytest.approx(
        2 * 15 * alpha + 2 * 15 / 16 * large * beta, rel=1e-12)
    # NCCL has no tree for the other collectives
    assert across.seconds("reduce_scatter", 16, small) == pytest.approx(
        15 * alpha + 15 / 16 * small * beta, rel=1e-12)
    inside = rings.along(dg.ProcessMesh(np.arange(16).reshape(2, 8).tolist(), ["x", "y"]),
                         0, "y")
    assert not inside.tree
    assert inside.seconds("all_reduce", 8, small) == collective_time(
        "all_reduce", 8, small, inside.bandwidth, inside.latency)
