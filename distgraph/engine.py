"""Engine: the facade that builds, plans and runs a model.

Example::

    engine = dg.Engine(model, loss=dg.nn.CrossEntropyLoss(), optimizer=dg.optim.AdamW(1e-3))
    history = engine.fit(train_data, batch_size=8, epochs=2)
    history.losses[-1]
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from distgraph import dtypes
from distgraph import engine_checks as checks
from distgraph.errors import DistGraphError, PlanError
from distgraph.program_builder import BuiltProgram, build_program
from distgraph.strategy import Strategy
from distgraph.trace import InputSpec


@dataclass
class History:
    """``losses``: the global loss of every optimizer step; ``epochs``: per-epoch means
    (``loss``, and ``val_loss`` when validation data was given)."""

    losses: list = field(default_factory=list)
    epochs: list = field(default_factory=list)


def _as_fields(sample) -> list:
    return list(sample) if isinstance(sample, (tuple, list)) else [sample]


def _field_dtype(arr: np.ndarray) -> str:
    if np.issubdtype(arr.dtype, np.integer):
        return "int64"
    if np.issubdtype(arr.dtype, np.bool_):
        return "bool"
    return dtypes.get_default_dtype()


class DataLoader:
    """Stacks dataset samples into fixed-size batches (a short last batch is dropped, as
    programs have static shapes). ``shuffle`` permutes with (seed, epoch)."""

    def __init__(self, dataset, batch_size, shuffle=False, seed=0):
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise DistGraphError("a dataset needs __len__ and __getitem__ returning numpy arrays")
        if batch_size < 1 or batch_size > len(dataset):
            raise DistGraphError(f"batch_size {batch_size} must be between 1 and the dataset "
                                 f"size {len(dataset)}")
        self.dataset, self.batch_size, self.shuffle, self.seed = dataset, batch_size, shuffle, seed

    def __len__(self):
        return len(self.dataset) // self.batch_size

    def epoch(self, epoch: int, rows: slice | None = None):
        """Batches of one epoch; ``rows`` keeps only those rows of each batch (a
        data-parallel rank reads only its shard of the samples)."""
        order = np.arange(len(self.dataset))
        if self.shuffle:
            order = np.random.default_rng((self.seed, epoch)).permutation(order)
        for b in range(len(self)):
            idx = order[b * self.batch_size:(b + 1) * self.batch_size]
            if rows is not None:
                idx = idx[rows]
            samples = [_as_fields(self.dataset[int(i)]) for i in idx]
            self.batch_indices = idx          # which samples the batch holds, for errors
            yield checks.stack_batch(samples, idx)

    def specs(self, n_labels: int):
        first = next(self.epoch(0))
        if len(first) <= n_labels:
            raise DistGraphError(f"dataset samples have {len(first)} fields; expected inputs "
                                 f"followed by {n_labels} label field(s)")
        cut = len(first) - n_labels
        ins = [InputSpec(a.shape, _field_dtype(a), f"input_{i}") for i, a in enumerate(first[:cut])]
        labels = [InputSpec(a.shape, _field_dtype(a), f"label_{i}")
                  for i, a in enumerate(first[cut:])]
        return ins, labels


def _is_annotated(program) -> bool:
    return (any(v.annotation is not None for v in program.values.values())
            or any(op.annotation is not None for op in program.ops))


class _SerialBackend:
    """One process runs the whole program."""

    def __init__(self, built: BuiltProgram):
        from distgraph.runtime.executor import ProgramRunner
        self.built, self.runner = built, ProgramRunner(built.program)

    def scope(self, global_values: dict) -> dict:
        return {v.name: global_values[v.name] for v in self.built.program.persistables}

    def rows(self):
        return None

    def step(self, scope, feed, fetch, step):
        return self.runner.run(scope, feed, fetch, step)

    def gather(self, scope, names):
        return {n: scope[n] for n in names}


class _SpmdBackend:
    """This rank's part of a completed program; the other ranks run theirs."""

    def __init__(self, built: BuiltProgram, comm, fetch, sharding_dim=None, cluster=None,
                 rank_mapping=None):
        from distgraph.passes.completion import complete
        from distgraph.passes.sharding import shard_updates
        from distgraph.runtime.spmd import SpmdRunner, check_world
        complete(built.program)
        if sharding_dim is not None and shard_updates(built.program, sharding_dim):
            complete(built.program)
        check_world(built.program, comm.size)
        self.built = built
        self.rank_of = _rank_of(built.program, comm.size, cluster, rank_mapping)
        pid = comm.rank
        if self.rank_of is not None:
            pid = {r: p for p, r in self.rank_of.items()}[comm.rank]
        self.runner = SpmdRunner(built.program, pid, comm, rank_of=self.rank_of, fetch=fetch)
        self._rows = self._batch_rows()

    def _batch_rows(self):
        """The rows of dim 0 this rank reads, when all inputs it holds want the same ones
        (a data-parallel rank loads only its samples; other dims are sliced after)."""
        program, pid = self.built.program, self.runner.pid
        slices = [program.values[v.name].dist_attr.local_slices(program.values[v.name].shape, pid)
                  for v in self.runner.local.program.inputs]
        if not slices or any(not s or s[0] != slices[0][0] for s in slices):
            return None
        return slices[0][0]

    def scope(self, global_values: dict) -> dict:
        return self.runner.shard_scope(global_values)

    def rows(self):
        return self._rows

    def step(self, scope, feed, fetch, step):
        return self.runner.run(scope, feed, step, rows=self._rows)

    def gather(self, scope, names):
        return self.runner.gather(scope, names)


def _rank_of(program, world_size, cluster, rank_mapping):
    """Logical process -> MPI rank: process p runs on the rank that owns its device, rank r
    owning the cluster's r-th device. Without a cluster or mapping: process p on rank p."""
    if cluster is None and rank_mapping is None:
        return None
    from distgraph.resources.cluster import Cluster
    cluster = cluster or Cluster.local(world_size)
    if rank_mapping is None:
        from distgraph.passes.plan_traffic import process_graph
        from distgraph.passes.rank_mapping import map_ranks
        rank_mapping = map_ranks(process_graph(program), cluster,
                                 devices=[d.global_id for d in cluster.devices[:world_size]])
    to_device = dict(getattr(rank_mapping, "process_to_device", rank_mapping))
    owner = {d.global_id: r for r, d in enumerate(cluster.devices[:world_size])}
    missing = sorted(d for d in to_device.values() if d not in owner)
    if missing:
        raise PlanError(f"the rank mapping uses devices {missing}, but this job's "
                        f"{world_size} ranks own devices {sorted(owner)}")
    rank_of = {p: owner[d] for p, d in to_device.items()}
    if sorted(rank_of.values()) != list(range(world_size)):
        raise PlanError(f"the rank mapping {to_device} does not give each of the "
                        f"{world_size} ranks exactly one process")
    return rank_of


def _world_communicator():
    """MPI's world when this script runs under mpiexec (or `distgraph run`)."""
    from distgraph.runtime.mpi_comm import MPICommunicator
    return MPICommunicator()


class Engine:
    """Builds the training, evaluation and prediction programs of a model and runs them.

    A model without annotations trains on one process; with ``shard_tensor`` /
    ``shard_op`` annotations every rank of the job runs its part of the completed and
    partitioned program, and the results equal serial training. With a ``cluster`` the
    logical processes are placed on its devices by the rank mapper (or as
    ``rank_mapping``, {process: device global id}, says).
    """

    def __init__(self, model, loss=None, optimizer=None, metrics=None, cluster=None,
                 strategy: Strategy | None = None, communicator=None, rank_mapping=None):
        self.model, self.loss, self.optimizer = model, loss, optimizer
        self.cluster = cluster if cluster is not None else checks.launcher_cluster()
        self.rank_mapping = rank_mapping
        self.strategy = strategy or Strategy()
        self._comm = communicator
        self._built: dict[str, BuiltProgram] = {}
        self._backends: dict = {}
        self._scopes: dict = {}
        self._state: dict | None = None          # global optimizer states between modes
        self._step = 0

    # -- building ---------------------------------------------------------------------------
    def prepare(self, inputs_spec, labels_spec=(), mode="train") -> BuiltProgram:
        """Build the program for ``mode`` (completed and partitioned when annotated)."""
        built = build_program(self.model, list(inputs_spec), list(labels_spec), self.loss,
                              self.optimizer if mode == "train" else None, mode)
        self._built[mode] = built
        self._backends.pop(mode, None)
        self._scopes.pop(mode, None)
        self._backend(mode)
        return built

    def _backend(self, mode):
        if mode not in self._backends:
            built = self._built[mode]
            fetch = [built.loss_name] if built.loss_name else built.output_names
            if _is_annotated(built.program):
                if self._comm is None:
                    self._comm = _world_communicator()
                dim = self.strategy.sharding_mesh_dim if self.strategy.sharding else None
                self._backends[mode] = _SpmdBackend(built, self._comm, fetch, dim, self.cluster,
                                                    self.rank_mapping)
            else:
                self._backends[mode] = _SerialBackend(built)
        return self._backends[mode]

    def _ensure(self, mode, loader: DataLoader):
        if mode not in self._built:
            ins, labels = loader.specs(self._label_count(mode))
            self.prepare(ins, labels[:0] if mode == "predict" else labels, mode)
        backend = self._backend(mode)
        if mode not in self._scopes:
            self._publish()
            values = {n: p._data for n, p in self.model.named_parameters()}
            if self.optimizer is not None:
                values.update(self.optimizer.initial_state(self._built[mode].program))
            values.update(self._state or {})
            self._scopes[mode] = backend.scope(values)
        return self._built[mode], backend, self._scopes[mode]

    def _label_count(self, mode) -> int:
        """Trailing label fields of a sample: one when training or evaluating; when
        predicting, as many as the train or eval program has (so a dataset with labels
        works), else none."""
        if mode != "predict":
            return 1
        known = self._built.get("train") or self._built.get("eval")
        return len(known.label_names) if known is not None else 0

    def _publish(self) -> None:
        """Write the global values of every live scope back to the model (collective)."""
        for mode, scope in list(self._scopes.items()):
            program = self._built[mode].program
            names = [v.name for v in program.persistables]
            values = self._backends[mode].gather(scope, names)
            params = dict(self.model.named_parameters())
            for name, value in values.items():
                if name in params:
                    params[name]._data = np.array(value, order="C")
            self._state = {n: np.array(v) for n, v in values.items() if n not in params}
            del self._scopes[mode]

    # -- running ------------------------------------------------------------------------------
    @checks.collective("Engine.fit()")
    def fit(self, train_data, batch_size=1, epochs=1, steps_per_epoch=None, valid_data=None,
            shuffle=False, verbose=0) -> History:
        """Train; every rank returns the same History of global losses."""
        loader = DataLoader(train_data, batch_size, shuffle, self.strategy.seed)
        built, backend, scope = self._ensure("train", loader)
        check_feed = checks.FeedCheck(built.program)
        history = History()
        for epoch in range(epochs):
            losses = []
            for b, batch in enumerate(loader.epoch(epoch, backend.rows())):
                if steps_per_epoch is not None and b >= steps_per_epoch:
                    break
                feed = dict(zip(built.feed_names, batch))
                check_feed(feed, loader.batch_indices, epoch, b)
                out = backend.step(scope, feed, [built.loss_name], self._step)
                self._step += 1
                losses.append(float(out[built.loss_name]))
                if self.strategy.check_finite:
                    checks.check_finite(losses[-1], self._step - 1, epoch, b)
            history.losses.extend(losses)
            record = {"epoch": epoch, "loss": float(np.mean(losses)) if losses else float("nan")}
            if valid_data is not None:
                record["val_loss"] = self.evaluate(valid_data, batch_size)["loss"]
                built, backend, scope = self._ensure("train", loader)
            history.epochs.append(record)
            if verbose:
                print(" ".join(f"{k}={v:.5g}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in record.items()), flush=True)
        return history

    @checks.collective("Engine.evaluate()")
    def evaluate(self, valid_data, batch_size=1) -> dict:
        loader = DataLoader(valid_data, batch_size)
        built, backend, scope = self._ensure("eval", loader)
        check_feed = checks.FeedCheck(built.program)
        losses = []
        for b, batch in enumerate(loader.epoch(0, backend.rows())):
            feed = dict(zip(built.feed_names, batch))
            check_feed(feed, loader.batch_indices, 0, b)
            losses.append(float(backend.step(scope, feed, [built.loss_name],
                                             self._step)[built.loss_name]))
        return {"loss": float(np.mean(losses))}

    @checks.collective("Engine.predict()")
    def predict(self, test_data, batch_size=1) -> list:
        loader = DataLoader(test_data, batch_size)
        built, backend, scope = self._ensure("predict", loader)
        check_feed = checks.FeedCheck(built.program)
        results = []
        for b, batch in enumerate(loader.epoch(0, backend.rows())):
            feed = dict(zip(built.feed_names, batch))
            check_feed(feed, loader.batch_indices, 0, b)
            out = backend.step(scope, feed, built.output_names, self._step)
            results.append([np.asarray(out[n]) for n in built.output_names])
        return results

    @checks.collective("Engine.state_dict()")
    def state_dict(self) -> dict:
        """Global numpy arrays of every parameter, on every rank (a collective when
        distributed: call it on all ranks)."""
        self._publish()
        return {n: p.numpy() for n, p in self.model.named_parameters()}

    def plan(self, mode="train") -> BuiltProgram:
        if mode not in self._built:
            raise DistGraphError(f"no {mode} program yet: call prepare() or fit() first")
        return self._built[mode]
