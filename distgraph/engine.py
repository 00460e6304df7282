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
from distgraph.errors import DistGraphError
from distgraph.program_builder import build_program
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
            yield [np.stack([np.asarray(s[k]) for s in samples]) for k in range(len(samples[0]))]

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


class _SerialBackend:
    """One process runs the whole program."""

    def __init__(self, plan):
        from distgraph.runtime.executor import ProgramRunner
        self.plan, self.runner = plan, ProgramRunner(plan.program)

    def timeline(self):
        raise DistGraphError("no timeline was recorded: use Strategy(profile=True)")

    def scope(self, global_values: dict) -> dict:
        return {v.name: global_values[v.name] for v in self.plan.program.persistables}

    def rows(self):
        return None

    def step(self, scope, feed, fetch, step):
        return self.runner.run(scope, feed, fetch, step)

    def gather(self, scope, names):
        return {n: scope[n] for n in names}


class _SpmdBackend:
    """This rank's part of a distributed plan; the other ranks run theirs. A plan with
    micro-batches (or a timeline to record) runs as actors over its task graph; a
    one-process plan of that kind runs here without a communicator."""

    def __init__(self, plan, comm, fetch):
        from distgraph.runtime.spmd import SpmdRunner, check_world
        self.plan = plan
        if plan.pipelined:
            from distgraph.runtime.pipeline import PipelineRunner
            if comm is not None:
                check_world(plan, comm.size)
            pid = plan.process_of(comm.rank) if comm is not None else 0
            self.runner = PipelineRunner(plan, pid, comm, fetch=fetch)
        else:
            check_world(plan, comm.size)
            self.runner = SpmdRunner(plan, plan.process_of(comm.rank), comm, fetch=fetch)
        self._rows = self.runner.batch_rows()

    def timeline(self):
        if not self.plan.pipelined:
            raise DistGraphError("no timeline was recorded: use Strategy(profile=True)")
        return self.runner.timeline()

    def scope(self, global_values: dict) -> dict:
        return self.runner.shard_scope(global_values)

    def rows(self):
        return self._rows

    def step(self, scope, feed, fetch, step):
        return self.runner.run(scope, feed, step, rows=self._rows)

    def gather(self, scope, names):
        return self.runner.gather(scope, names)


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
        self.cluster = cluster
        self.rank_mapping = rank_mapping
        self.strategy = strategy or Strategy()
        self._comm = communicator
        self._plans: dict = {}
        self._backends: dict = {}
        self._scopes: dict = {}
        self._state: dict | None = None          # global optimizer states between modes
        self._step = 0

    # -- building ---------------------------------------------------------------------------
    def prepare(self, inputs_spec, labels_spec=(), mode="train"):
        """Build and plan the program for ``mode``; returns the Plan. Needs no running job:
        only running needs as many ranks as the plan has processes."""
        from distgraph.passes.planner import plan
        built = build_program(self.model, list(inputs_spec), list(labels_spec), self.loss,
                              self.optimizer if mode == "train" else None, mode)
        self._plans[mode] = plan(built, self.strategy, self.cluster, self.rank_mapping)
        self._backends.pop(mode, None)
        self._scopes.pop(mode, None)
        return self._plans[mode]

    def _backend(self, mode):
        if mode not in self._backends:
            p = self._plans[mode]
            if p.distributed:
                if self._comm is None:
                    self._comm = _world_communicator()
                built = p.built
                fetch = [built.loss_name] if built.loss_name else built.output_names
                self._backends[mode] = _SpmdBackend(p, self._comm, fetch)
            elif p.pipelined:
                built = p.built
                fetch = [built.loss_name] if built.loss_name else built.output_names
                self._backends[mode] = _SpmdBackend(p, None, fetch)
            else:
                self._backends[mode] = _SerialBackend(p)
        return self._backends[mode]

    def _ensure(self, mode, loader: DataLoader):
        if mode not in self._plans:
            ins, labels = loader.specs(self._label_count(mode))
            self.prepare(ins, labels[:0] if mode == "predict" else labels, mode)
        backend = self._backend(mode)
        if mode not in self._scopes:
            self._publish()
            values = {n: p._data for n, p in self.model.named_parameters()}
            if self.optimizer is not None:
                values.update(self.optimizer.initial_state(self._plans[mode].program))
            values.update(self._state or {})
            self._scopes[mode] = backend.scope(values)
        return self._plans[mode].built, backend, self._scopes[mode]

    def _label_count(self, mode) -> int:
        """Trailing label fields of a sample: one when training or evaluating; when
        predicting, as many as the train or eval program has (so a dataset with labels
        works), else none."""
        if mode != "predict":
            return 1
        known = self._plans.get("train") or self._plans.get("eval")
        return len(known.built.label_names) if known is not None else 0

    def _publish(self) -> None:
        """Write the global values of every live scope back to the model (collective)."""
        for mode, scope in list(self._scopes.items()):
            program = self._plans[mode].program
            names = [v.name for v in program.persistables]
            values = self._backends[mode].gather(scope, names)
            params = dict(self.model.named_parameters())
            for name, value in values.items():
                if name in params:
                    params[name]._data = np.array(value, order="C")
            self._state = {n: np.array(v) for n, v in values.items() if n not in params}
            del self._scopes[mode]

    # -- running ------------------------------------------------------------------------------
    def fit(self, train_data, batch_size=1, epochs=1, steps_per_epoch=None, valid_data=None,
            shuffle=False, verbose=0) -> History:
        """Train; every rank returns the same History of global losses."""
        loader = DataLoader(train_data, batch_size, shuffle, self.strategy.seed)
        built, backend, scope = self._ensure("train", loader)
        history = History()
        for epoch in range(epochs):
            losses = []
            for b, batch in enumerate(loader.epoch(epoch, backend.rows())):
                if steps_per_epoch is not None and b >= steps_per_epoch:
                    break
                out = backend.step(scope, dict(zip(built.feed_names, batch)), [built.loss_name],
                                   self._step)
                self._step += 1
                losses.append(float(out[built.loss_name]))
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

    def evaluate(self, valid_data, batch_size=1) -> dict:
        loader = DataLoader(valid_data, batch_size)
        built, backend, scope = self._ensure("eval", loader)
        losses = [float(backend.step(scope, dict(zip(built.feed_names, batch)),
                                     [built.loss_name], self._step)[built.loss_name])
                  for batch in loader.epoch(0, backend.rows())]
        return {"loss": float(np.mean(losses))}

    def predict(self, test_data, batch_size=1) -> list:
        loader = DataLoader(test_data, batch_size)
        built, backend, scope = self._ensure("predict", loader)
        results = []
        for batch in loader.epoch(0, backend.rows()):
            out = backend.step(scope, dict(zip(built.feed_names, batch)), built.output_names,
                               self._step)
            results.append([np.asarray(out[n]) for n in built.output_names])
        return results

    def state_dict(self) -> dict:
        """Global numpy arrays of every parameter, on every rank (a collective when
        distributed: call it on all ranks)."""
        self._publish()
        return {n: p.numpy() for n, p in self.model.named_parameters()}

    def timeline(self, mode="train"):
        """The timeline of the steps run so far in ``mode``, merged over every rank (a
        collective: call it on all ranks). Needs ``Strategy(profile=True)``; see
        :class:`distgraph.runtime.timeline.Timeline` (``.events``, ``.save``, ``.plot``)."""
        if not self.strategy.profile:
            raise DistGraphError("no timeline was recorded: create the Engine with "
                                 "Strategy(profile=True)")
        if mode not in self._backends:
            raise DistGraphError(f"no {mode} step has run yet: call fit() first")
        return self._backends[mode].timeline()

    def plan(self, mode="train"):
        """The Plan of ``mode`` (``.program``: the completed serial program with dist
        attributes; ``.local(pid)``: a process's program; ``.explain()``)."""
        if mode not in self._plans:
            raise DistGraphError(f"no {mode} program yet: call prepare() or fit() first")
        return self._plans[mode]
