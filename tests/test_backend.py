"""The runtime's array backend: numpy semantics the runtime relies on (0-d arrays stay
0-d, contiguous arrays are not copied), and communicators and reshard execution make
their arrays through the backend object they are given."""

import numpy as np
import pytest

from distgraph.errors import RuntimeFault
from distgraph.mesh import ProcessMesh
from distgraph.passes.reshard import plan_reshard
from distgraph.placement import DistAttr, ShardSpec
from distgraph.runtime.backend import NUMPY, ArrayBackend, get_backend
from distgraph.runtime.comm.simulated import SimulatedWorld
from distgraph.runtime.execution.reshard import apply_reshard


def test_numpy_backend_keeps_zero_d_and_avoids_copies():
    xb = get_backend("numpy")
    assert xb is NUMPY and xb.xp is np
    scalar = xb.from_host(np.array(3, dtype=np.int64))
    assert scalar.shape == () and int(scalar) == 3
    a = np.arange(12.0).reshape(3, 4)
    assert xb.contiguous(a) is a
    t = xb.contiguous(a.T)
    assert t.flags.c_contiguous and np.array_equal(t, a.T)
    c = xb.copy(a)
    assert c is not a and np.array_equal(c, a)
    assert np.array_equal(xb.chunk(a, 2, 1, 1), a[:, 2:])
    assert xb.chunk(a, 2, 1, 1).flags.c_contiguous
    out = a.copy()
    xb.reducer("max")(out, -a, out=out)
    assert np.array_equal(out, a)
    assert isinstance(xb.to_host(a), np.ndarray)


def test_collective_buffers_are_views_when_the_split_axis_leads():
    """A reduce-scatter's send buffer (chunks stacked on a new axis) and an all-gather's
    result (the stacked chunks joined) need no copy when no axis before the split one is
    longer than 1; otherwise they are copies with the same values."""
    for shape, axis, view in (((8, 6), 0, True), ((1, 8, 6), 1, True),
                              ((8, 6), 1, False), ((2, 8, 6), 1, False)):
        x = np.arange(float(np.prod(shape))).reshape(shape)
        stacked = NUMPY.chunks(x, 2, axis)
        assert np.array_equal(stacked, np.stack(np.split(x, 2, axis)))
        assert np.shares_memory(stacked, x) == view
        joined = NUMPY.joined(stacked, axis)
        assert np.array_equal(joined, x)
        assert np.shares_memory(joined, stacked) == view


def test_unknown_backends_and_reductions_are_errors():
    with pytest.raises(RuntimeFault, match="unknown array backend 'tpu'"):
        get_backend("tpu")
    with pytest.raises(RuntimeFault, match="unknown reduction"):
        NUMPY.reducer("prod")


class CountingBackend(ArrayBackend):
    """The numpy backend, counting the arrays it makes: shows who allocates through it."""

    def __init__(self):
        super().__init__(np)
        self.made = 0

    def zeros(self, shape, dtype):
        self.made += 1
        return super().zeros(shape, dtype)

    def copy(self, a):
        self.made += 1
        return super().copy(a)

    def concatenate(self, arrays, axis):
        self.made += 1
        return super().concatenate(arrays, axis)


def test_communicators_and_reshards_allocate_through_their_backend():
    backends = [CountingBackend() for _ in range(4)]
    src = DistAttr(ProcessMesh([0, 1], ["x"]), ShardSpec(["x", None]))
    dst = DistAttr(ProcessMesh([2, 3], ["y"]), ShardSpec([None, "y"]))
    steps = plan_reshard(src, dst, (4, 4), "float64")
    full = np.arange(16.0).reshape(4, 4)

    def body(comm):
        comm.backend = backends[comm.rank]
        gathered = comm.all_gather(np.full(2, float(comm.rank)), (0, 1, 2, 3))
        local = full[2 * comm.rank:2 * comm.rank + 2] if comm.rank < 2 else None
        out = apply_reshard(steps, local, comm, comm.rank)
        return gathered, out

    results = SimulatedWorld(4, timeout=20).run(body)
    assert np.array_equal(results[0][0], np.repeat(np.arange(4.0), 2))
    assert np.array_equal(results[2][1], full[:, :2]) and np.array_equal(results[3][1], full[:, 2:])
    # every rank gathered through its backend; senders copied their tiles through it
    assert all(b.made >= 1 for b in backends)
    assert backends[0].made >= 2 and backends[1].made >= 2
