"""Ring attention (distgraph/ops/ring_attention.py): equal to a serial causal attention
of the whole sequence (fp64, 1e-10) on real MPI ranks (cp 2 and 4,
tests/mpi_scripts/ring_attention.py) and on the simulated world's threads (a ring whose
members are not in rank order); its message formula; which pairs of runs it computes."""

import importlib.util
import subprocess
from pathlib import Path

import numpy as np
import pytest

from distgraph.ops import ring_attention as ra
from distgraph.registry import KernelContext
from distgraph.runtime.comm.simulated import SimulatedWorld
from distgraph.runtime.launch.launcher import launch_command, rank_env

SCRIPT = Path(__file__).parent / "mpi_scripts" / "ring_attention.py"


def _script():
    spec = importlib.util.spec_from_file_location("ring_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.mpi
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_equals_serial_on_mpi_ranks(cp):
    proc = subprocess.run(launch_command(cp, [str(SCRIPT)]), env=rank_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert f"ring OK on {cp} ranks" in proc.stdout


@pytest.mark.parametrize("blocking", [False, True])
def test_a_ring_out_of_rank_order_equals_serial(blocking):
    """Members 0..3 are ranks 2, 0, 3, 1: positions and messages follow the members."""
    group, s, (b, h, g, d) = (2, 0, 3, 1), 6, (1, 4, 2, 4)
    serial, inputs = _script().serial, _script().inputs
    q, k, v, dy = inputs(3, b, h, g, len(group) * s, d)
    want = serial(q, k, v, dy, 0.5)
    positions = ra.balanced_positions(len(group), s)

    def body(comm):
        ctx = KernelContext(np, comm=comm, group=group)
        p = positions(group.index(comm.rank))
        local = [a[:, :, p] for a in (q, k, v, dy)]
        y, lse = ra.forward(ctx, *local[:3], 0.5, True, None, positions, blocking=blocking)
        grads = ra.backward(ctx, *local[:3], y, lse, local[3], 0.5, True, None, positions,
                            blocking=blocking)
        return [np.abs(a - w[:, :, p]).max() for a, w in zip((y, lse, *grads), want)]

    assert max(max(errs) for errs in SimulatedWorld(4).run(body)) < 1e-10


def test_comm_counts_hops_of_the_kv_block():
    assert ra.comm(4, 100, 10) == (("send_recv", 2, 20),) * 3
    assert ra.comm(4, 100, 10, grad=True) == (("send_recv", 2, 20),) * 7
    assert ra.comm(1, 100, 10, grad=True) == ()
    assert ra.ring_pairs((5, 2, 7)) == ((5, 2), (2, 7), (7, 5))


def test_its_tags_are_the_ones_the_plans_tag_scheme_leaves_to_kernels():
    from distgraph.plan.tags import KERNEL_TAGS, MAX_TAG
    assert all(MAX_TAG - KERNEL_TAGS <= t < MAX_TAG for t in ra.TAGS)
    assert len(set(ra.TAGS)) == len(ra.TAGS)


def test_balanced_order_gives_member_i_chunks_i_and_2n_minus_1_minus_i():
    pos = ra.balanced_positions(4, 4)
    assert pos(0).tolist() == [0, 1, 14, 15]
    assert pos(3).tolist() == [6, 7, 8, 9]
    assert sorted(np.concatenate([pos(i) for i in range(4)]).tolist()) == list(range(16))


def test_pairs_of_runs_skip_the_future_and_mask_only_the_diagonal():
    pos = ra.balanced_positions(2, 4)             # member 0: 0 1 | 6 7; member 1: 2 3 4 5
    meet = ra._meetings(np, pos(0), pos(1), True, None)
    # chunk 0 sees nothing of member 1; chunk 3 sees it all, unmasked
    assert [(qs, ks, m) for qs, ks, m in meet] == [(slice(2, 4), slice(0, 4), None)]
    diag = ra._meetings(np, pos(0), pos(0), True, None)
    assert [(qs, ks, m is None) for qs, ks, m in diag] == [
        (slice(0, 2), slice(0, 2), False), (slice(2, 4), slice(0, 2), True),
        (slice(2, 4), slice(2, 4), False)]
    # a sliding window of 3: chunk 3 (positions 6, 7) sees keys 4, 5 only partly
    assert [(qs, ks, m.tolist()) for qs, ks, m in ra._meetings(np, pos(0), pos(1), True, 3)] \
        == [(slice(2, 4), slice(0, 4), [[False, False, True, True], [False, False, False, True]])]


class _Counting:
    """A communicator that counts the messages started through it."""

    def __init__(self, inner):
        self.inner, self.started = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def isend(self, *args, **kwargs):
        self.started += 1
        return self.inner.isend(*args, **kwargs)

    def irecv(self, *args, **kwargs):
        self.started += 1
        return self.inner.irecv(*args, **kwargs)


@pytest.mark.parametrize("blocking", [False, True])
def test_a_ring_of_one_is_the_serial_kernel_and_sends_nothing(blocking):
    q, k, v, dy = _script().inputs(1, 1, 4, 2, 16, 4)
    want = _script().serial(q, k, v, dy, 0.5)
    comm = _Counting(SimulatedWorld(1).communicator(0))
    ctx = KernelContext(np, comm=comm, group=(0,))
    positions = ra.balanced_positions(4, 4)          # any order of the whole sequence
    order = np.concatenate([positions(i) for i in range(4)])
    y, lse = ra.forward(ctx, q[:, :, order], k[:, :, order], v[:, :, order], 0.5,
                        positions=lambda i: order, blocking=blocking)
    got = ra.backward(ctx, q[:, :, order], k[:, :, order], v[:, :, order], y, lse,
                      dy[:, :, order], 0.5, positions=lambda i: order, blocking=blocking)
    for a, w in zip((y, lse, *got), want):
        assert np.abs(a - w[:, :, order]).max() < 1e-10
    assert comm.started == 0
