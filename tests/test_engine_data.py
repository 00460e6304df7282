"""The Engine's data loader reads only what the plan feeds to each rank: a data-parallel
rank reads only its samples, a pipeline stage only the fields its program reads (the
first stage no labels, the last no inputs), and training still equals serial training.
Oracles: the dataset's own record of what was read, and the serial losses."""

import threading

import numpy as np

import distgraph as dg
from distgraph.app.data import DataLoader, FieldRead, reads_of
from distgraph.runtime.comm.simulated import SimulatedWorld


class Label:
    """Sample ``i``'s label, which records the threads that made it an array."""

    def __init__(self, i, value, seen):
        self.i, self.value, self.seen = i, value, seen

    def __array__(self, dtype=None, copy=None):
        self.seen.setdefault(threading.current_thread().name, set()).add(self.i)
        return np.asarray(self.value, dtype=dtype)


class Recorded:
    """16 samples (x [3], y [2]) that record which samples each thread read and which
    threads made a label an array."""

    def __init__(self):
        rng = np.random.default_rng(0)
        self.x, self.y = rng.normal(size=(16, 3)), rng.normal(size=(16, 2))
        self.read: dict = {}
        self.labels: dict = {}
        self.lock = threading.Lock()

    def __len__(self):
        return 16

    def __getitem__(self, i):
        with self.lock:
            self.read.setdefault(threading.current_thread().name, []).append(int(i))
        return self.x[i], Label(int(i), self.y[i], self.labels)


class Net(dg.nn.Layer):
    def __init__(self, meshes=None, dp=None):
        super().__init__()
        self.fc1, self.fc2 = dg.nn.Linear(3, 4), dg.nn.Linear(4, 2)
        self.dp = dp
        if meshes is not None:       # one stage per Linear
            dg.shard_tensor(self.fc1.weight, meshes[0], [None, None])
            dg.shard_tensor(self.fc2.weight, meshes[1], [None, None])

    def forward(self, x):
        if self.dp is not None:
            x = dg.shard_tensor(x, self.dp, ["dp", None])
        return self.fc2(dg.ops.tanh(self.fc1(x)))


def engine(make, comm=None, strategy=None):
    dg.seed(0)
    return dg.Engine(make(), dg.nn.MSELoss(), dg.optim.SGD(0.1), communicator=comm,
                     strategy=strategy)


def run(world, make, strategy=None):
    """Each rank's losses and what its thread read (engines planned before the threads
    start: tracing is not thread-safe)."""
    data = Recorded()
    engines = [engine(make, world.communicator(r), strategy) for r in range(world.size)]
    for e in engines:
        e.prepare(*DataLoader(data, 8).specs(1))
    data.read.clear()
    data.labels.clear()

    def rank(comm):
        threading.current_thread().name = f"rank{comm.rank}"
        return engines[comm.rank].fit(data, batch_size=8, epochs=1, verbose=0).losses

    return world.run(rank), data


def serial_losses():
    return engine(lambda: Net()).fit(Recorded(), batch_size=8, verbose=0).losses


def test_a_data_parallel_rank_reads_only_its_samples(float64):
    mesh = dg.ProcessMesh([0, 1], ["dp"])
    losses, data = run(SimulatedWorld(2, timeout=60), lambda: Net(dp=mesh))
    # besides sample 0 (its fields tell the batch's shapes and dtypes), each rank reads
    # only the samples of its rows, once
    assert [i for i in data.read["rank0"] if i] == [1, 2, 3, 8, 9, 10, 11]
    assert [i for i in data.read["rank1"] if i] == [4, 5, 6, 7, 12, 13, 14, 15]
    for mine in losses:
        np.testing.assert_allclose(mine, serial_losses(), rtol=1e-12)


def test_a_pipeline_stage_reads_only_the_fields_it_feeds(float64):
    meshes = [dg.ProcessMesh([0], ["s"]), dg.ProcessMesh([1], ["s"])]
    losses, data = run(SimulatedWorld(2, timeout=60), lambda: Net(meshes),
                       dg.Strategy(micro_batches=2))
    # the first stage made no label of a batch an array (sample 0's tells the fields'
    # shapes and dtypes); the last stage made every one
    assert data.labels["rank0"] <= {0} and data.labels["rank1"] == set(range(16))
    for rank in ("rank0", "rank1"):
        assert [i for i in data.read[rank] if i] == list(range(1, 16))
    for mine in losses:
        np.testing.assert_allclose(mine, serial_losses(), rtol=1e-12)


def test_reads_of_a_program_are_its_rows_per_micro_batch_in_its_order(float64):
    class Feed:
        def __init__(self, name, rows, rest=()):
            self.name, self.rows, self.rest = name, rows, rest

    reads = reads_of([Feed("label_0", ((6, 8), (2, 4))), Feed("input_0", None)],
                     ["input_0", "label_0"])
    assert list(reads) == ["label_0", "input_0"]
    assert reads["label_0"].field == 1 and list(reads["label_0"].rows) == [6, 7, 2, 3]
    assert reads["input_0"] == FieldRead(0)
    loader = DataLoader(Recorded(), 8)
    label, whole = loader.read(np.arange(8, 16), [reads["label_0"], FieldRead(0, None,
                                                                              (slice(1, 3),))])
    np.testing.assert_array_equal(label, Recorded().y[[14, 15, 10, 11]])
    np.testing.assert_array_equal(whole, Recorded().x[8:16, 1:3])
