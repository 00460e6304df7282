"""Engine: the facade that builds, plans and runs a model.

Example::

    engine = dg.Engine(model, loss=dg.nn.CrossEntropyLoss(), optimizer=dg.optim.AdamW(1e-3))
    history = engine.fit(train_data, batch_size=8, epochs=2)
    history.losses[-1]
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import numpy as np

from distgraph.annotation import ShardDataloader
from distgraph.app import checkpoint, checks, plan_report
from distgraph.app.checkpoint import CheckpointReader
from distgraph.app.data import DataLoader
from distgraph.app.resume import check_checkpoint, checkpoint_info, restore_info
from distgraph.app.state import ProcessState
from distgraph.callbacks import CallbackList, ProgressBar
from distgraph.errors import DistGraphError
from distgraph.metrics import as_metrics
from distgraph.nn.layers import Dropout
from distgraph.passes.planner import plan
from distgraph.program_builder import build_program
from distgraph.resources.cluster import Cluster
from distgraph.runtime.backend import backend_for
from distgraph.runtime.execution.runner import PlanRunner
from distgraph.strategy import Strategy


@dataclass
class History:
    """``losses``: the global loss of every optimizer step this fit ran; ``steps``: their
    global step numbers (a fit resumed from a checkpoint starts past 0); ``epochs``: one
    record per epoch (``epoch``, mean ``loss``, ``lr``, and ``val_loss`` /
    ``val_<metric>`` when validation data was given)."""

    losses: list = field(default_factory=list)
    steps: list = field(default_factory=list)
    epochs: list = field(default_factory=list)


class _Runner:
    """This rank's part of a plan (the whole plan on one process); the other ranks run
    theirs. Every plan runs on the one runtime (:class:`PlanRunner`)."""

    def __init__(self, plan, comm):
        self.plan = plan
        self.runner = PlanRunner(plan, comm)
        self._rows = self.runner.batch_rows() if plan.distributed else None

    @property
    def arrays(self):
        """The array backend the runner computes with (numpy, or CuPy on a GPU)."""
        return self.runner.backend

    def timeline(self):
        return self.runner.timeline()

    def rows(self):
        return self._rows

    def step(self, scope, feed, step):
        return self.runner.run(scope, feed, step, rows=self._rows)

    def gather(self, scope, names):
        return self.runner.gather(scope, names)


def _world_communicator():
    """MPI's world when this script runs under mpiexec (or `distgraph run`)."""
    from distgraph.runtime.comm.mpi import MPICommunicator
    return MPICommunicator()


class Engine:
    """Builds the training, evaluation and prediction programs of a model and runs them.

    A model without annotations trains on one process; with ``shard_tensor`` /
    ``shard_op`` annotations every rank of the job runs its part of the completed and
    partitioned program, and the results equal serial training. With a ``cluster`` the
    logical processes are placed on its devices by the rank mapper (or as
    ``rank_mapping``, {process: device global id}, says). ``metrics`` (``dg.metrics``)
    are reported by ``evaluate`` and by the validation of ``fit``.

    The Engine keeps the parameters and optimizer states on its processes between calls;
    ``state_dict()`` and ``optimizer_state_dict()`` return them whole, ``save(path)``
    writes a checkpoint that ``load(path)`` restores under any plan. Setting new values
    on the model (``model.set_state_dict``) takes effect at the next step.

    A dataset from ``dg.shard_dataloader`` feeds each batch split over a mesh dim;
    ``evaluate``, ``predict`` and the validation of ``fit`` split plain datasets the
    way the last ``fit``'s shard_dataloader did. ``engine.rank`` and
    ``engine.world_size`` say where this script runs; ``engine.process`` which logical
    process of the plan this rank runs (``engine.plan().local(engine.process)``).
    """

    def __init__(self, model, loss=None, optimizer=None, metrics=None, cluster=None,
                 strategy: Strategy | None = None, communicator=None, rank_mapping=None):
        self.model, self.loss, self.optimizer = model, loss, optimizer
        self.metrics = as_metrics(metrics)
        if self.metrics and loss is None:
            raise DistGraphError("metrics are computed by evaluate(), which needs a loss: "
                                 "give the Engine a loss too")
        self.cluster = cluster if cluster is not None else checks.launcher_cluster()
        self.rank_mapping = rank_mapping
        self.strategy = strategy or Strategy()
        self._comm = communicator
        self._plans: dict = {}
        self._backends: dict = {}
        self._scopes: dict = {}
        self._plan_cache: dict = {}        # (mode, program key) -> Plan
        self._feed_checks: dict = {}       # id(BuiltProgram) -> its FeedCheck
        self._backend_cache: dict = {}     # id(Plan) -> its runner
        self._active: dict = {}            # mode -> key of the plan in _plans[mode]
        self._held = ProcessState(model, optimizer)
        self._step = 0                     # optimizer steps taken (dropout and LR use it)
        self._position = (0, 0)            # (epoch, batch) the last fit reached
        self._resume = None                # training position a loaded checkpoint gives
        self._fit_config = None            # how the last fit read its data
        self._data_seed = self.strategy.seed
        self._feed_specs: dict = {}        # plan key -> the (inputs, labels) InputSpecs planned
        self._sharding = None              # the last fit's shard_dataloader, for plain datasets
        self._warned: set = set()          # warnings this Engine printed already
        self._plan_request = plan_report.requested()   # under `distgraph plan`: what to write
        self.stop_training = False

    @property
    def global_step(self) -> int:
        """Optimizer steps taken by this Engine (restored by ``load``)."""
        return self._step

    @property
    def rank(self) -> int:
        """This script's rank in the job: 0 to ``world_size - 1`` (0 when it runs alone).
        A rank is a running process of the job; which part of the plan it runs is
        :attr:`process`."""
        if self._comm is not None:
            return self._comm.rank
        return int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", 0)))

    @property
    def world_size(self) -> int:
        """How many ranks the job has (``distgraph run -n N``: N; 1 when it runs alone)."""
        if self._comm is not None:
            return self._comm.size
        return int(os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", 1)))

    @property
    def process(self) -> int:
        """The logical process of the current plan (training's, else evaluation's or
        prediction's) that this rank runs: ``engine.plan().local(engine.process)`` is its
        program. Process ids are the ProcessMesh's; with a cluster the rank mapper may run
        process p on another rank than p."""
        for mode in ("train", "eval", "predict"):
            if mode in self._plans:
                p = self._plans[mode]
                return p.ranks.process(self.rank) if p.distributed else 0
        raise DistGraphError("no plan yet: call fit(), evaluate(), predict() or prepare() "
                             "first")

    def _warn(self, text: str) -> None:
        """One line on rank 0's stderr, once per Engine."""
        if text in self._warned:
            return
        self._warned.add(text)
        if self.rank == 0:
            print(f"distgraph: warning: {text}", file=sys.stderr, flush=True)

    # -- building ---------------------------------------------------------------------------
    def _program_key(self, mode, inputs_spec, labels_spec) -> tuple:
        """What a plan depends on besides the model's structure: the feeds, the
        optimizer's settings (its learning rate is fed), the dropout seeds, the strategy
        (a new ``engine.strategy`` plans again and re-lays the values it moves)."""
        feeds = tuple((s.name, tuple(s.shape), s.dtype, s.dist_attr)
                      for s in list(inputs_spec) + list(labels_spec))
        optim = repr(sorted(self.optimizer.hyperparameters().items())) \
            if mode == "train" and self.optimizer is not None else None
        seeds = tuple(layer.seed for _, layer in self.model.named_sublayers()
                      if isinstance(layer, Dropout))
        return feeds, optim, seeds, self.strategy

    def prepare(self, inputs_spec, labels_spec=(), mode="train"):
        """Build and plan the program for ``mode``; returns the Plan. Needs no running job:
        only running needs as many ranks as the plan has processes."""
        inputs_spec, labels_spec = list(inputs_spec), list(labels_spec)
        key = (mode, self._program_key(mode, inputs_spec, labels_spec))
        built = build_program(self.model, inputs_spec, labels_spec, self.loss,
                              self.optimizer if mode == "train" else None, mode)
        try:
            # every rank plans alike and compiles its own process's program
            self._plan_cache[key] = plan(built, self.strategy, self._planning_cluster(),
                                         self.rank_mapping, ranks=(self.rank,))
        except DistGraphError as e:
            if self._plan_request is not None:      # distgraph plan shows why
                plan_report.write_failure(e, self._plan_request)
            raise
        self._feed_specs[key] = (inputs_spec, labels_spec)
        self._active.pop(mode, None)
        self._activate(mode, key)
        return self._plans[mode]

    def _planning_cluster(self):
        """The Engine's cluster (given, or the file ``distgraph run/plan --cluster``
        exports); for the automatic search without one, this machine as the job's ranks
        (``Cluster.local``: the communicator's size, or the MPI launcher's)."""
        if self.cluster is not None or self.strategy.auto_mode != "full":
            return self.cluster
        return Cluster.local(self.world_size)

    def _activate(self, mode, key) -> None:
        if self._active.get(mode) == key:
            return
        self._plans[mode] = self._plan_cache[key]
        self._backends.pop(mode, None)
        self._scopes.pop(mode, None)
        self._active[mode] = key

    def _backend(self, mode):
        """The runner of ``mode``'s plan (made once per plan)."""
        p = self._plans[mode]
        if id(p) not in self._backend_cache:
            checks.check_runnable(p.program)
            if p.distributed:
                if self._comm is None:
                    self._comm = _world_communicator()
                if p.search is not None:
                    _check_same_search(p, self._comm)
            self._backend_cache[id(p)] = _Runner(p, self._comm if p.distributed else None)
        self._backends[mode] = self._backend_cache[id(p)]
        return self._backends[mode]

    def _ensure(self, mode, loader: DataLoader, batch_rows: int | None = None):
        """The built program, backend and scope of ``mode`` for a batch of ``batch_rows``
        samples: planned once per batch shape, with the held values laid out for it."""
        ins, labels = loader.specs(self._label_count(mode), batch_rows)
        return self._bind(mode, ins, labels[:0] if mode == "predict" else labels)

    def _loader(self, data, batch_size, shuffle=False, drop_last=False) -> DataLoader:
        """A DataLoader of ``data``; a plain dataset is split as the last fit's
        ``shard_dataloader`` split its data."""
        return DataLoader(data, batch_size, shuffle, self._data_seed, drop_last,
                          sharding=self._sharding)

    def _check_data(self, mode, loader: DataLoader) -> None:
        """The samples' fields against the model's forward; a warning for fields fed in a
        narrower dtype than the dataset's."""
        n_fields, n_labels = len(loader.fields()), self._label_count(mode)
        checks.check_fields(self.model, n_fields, n_labels)
        for k, have, fed in loader.casts():
            what = "the label" if k >= n_fields - n_labels else "an input"
            self._warn(f"dataset field {k} ({what}) is {have} and is cast to {fed}, the "
                       f"model's dtype; dg.set_default_dtype({have!r}) computes in {have}, "
                       f"or give {fed} samples")

    def _bind(self, mode, ins, labels):
        key = (mode, self._program_key(mode, ins, labels))
        if key not in self._plan_cache:
            self.prepare(ins, labels, mode)
        self._activate(mode, key)
        backend = self._backend(mode)
        p = self._plans[mode]
        if not p.distributed and self.world_size > 1:
            self._warn_unsplit(mode)
        pid = backend.runner.pid
        self._scopes = {mode: self._held.bind(p, pid, backend)}
        return p.built, backend, self._scopes[mode]

    def _warn_unsplit(self, mode) -> None:
        verb = {"train": "trains on", "eval": "evaluates", "predict": "predicts"}[mode]
        self._warn(f"the model has no annotation, so each of the {self.world_size} ranks "
                   f"{verb} the whole batch (the same work {self.world_size} times); split "
                   f"the batch with dg.shard_dataloader(dataset, mesh, shard_dims=\"dp\") "
                   f"or annotate the model with dg.shard_tensor")

    def _label_count(self, mode) -> int:
        """Trailing label fields of a sample: one when training or evaluating; when
        predicting, as many as the train or eval program has (so a dataset with labels
        works), else none."""
        if mode != "predict":
            return 1
        known = self._plans.get("train") or self._plans.get("eval")
        return len(known.built.label_names) if known is not None else 0

    def _publish(self):
        """The global parameters and optimizer states, written back to the model
        (collective)."""
        return self._held.publish()

    # -- running ------------------------------------------------------------------------------
    @checks.collective("Engine.fit()")
    def fit(self, train_data, batch_size=1, epochs=1, steps_per_epoch=None, valid_data=None,
            shuffle=False, verbose=1, callbacks=None, drop_last=False) -> History:
        """Train for ``epochs`` epochs (of at most ``steps_per_epoch`` batches); every rank
        returns the same History of global losses. After ``load``, runs only the epochs
        and steps the checkpoint had not done. ``callbacks``: ``dg.callbacks`` objects;
        ``verbose`` 1 shows a progress bar (rank 0), 2 a line per epoch, 0 nothing. A
        short last batch trains on a plan of its own unless ``drop_last``."""
        if self.optimizer is None or self.loss is None:
            raise DistGraphError("fit needs an Engine with a loss and an optimizer")
        self._sharding = train_data if isinstance(train_data, ShardDataloader) else None
        loader = self._loader(train_data, batch_size, shuffle, drop_last)
        self._check_data("train", loader)
        n_batches = len(loader) if steps_per_epoch is None else min(steps_per_epoch, len(loader))
        first_epoch, first_batch = self._start(loader, n_batches, steps_per_epoch)
        self._fit_config = {"batch_size": batch_size, "shuffle": bool(shuffle),
                            "drop_last": bool(drop_last), "steps_per_epoch": steps_per_epoch,
                            "dataset_size": len(train_data)}
        for rows in sorted({len(idx) for idx in loader.indices(0)[:n_batches]}, reverse=True):
            self._plan_batch("train", loader, rows)      # plan every batch shape up front
        self._only_planning("train")
        # GPUs asked for where there are none: one line now, not after the progress bar
        train = self._plans["train"]
        backend_for(train.devices, self.rank if train.distributed else 0)
        cbs = CallbackList(_progress(verbose, callbacks) + list(callbacks or []), self)
        try:
            return self._train(loader, n_batches, first_epoch, first_batch, epochs, cbs,
                               valid_data, drop_last)
        except BaseException:
            cbs.close()          # a progress bar left open prints again at interpreter exit
            raise

    def _train(self, loader, n_batches, first_epoch, first_batch, epochs, cbs, valid_data,
               drop_last) -> History:
        """The epochs of ``fit`` from (first_epoch, first_batch)."""
        history = History()
        self.stop_training = False
        cbs.on_train_begin({"epochs": epochs, "steps_per_epoch": n_batches,
                            "batch_size": loader.batch_size, "step": self._step})
        for epoch in range(first_epoch, epochs):
            start = first_batch if epoch == first_epoch else 0
            self._position = (epoch, start)
            cbs.on_epoch_begin(epoch, {"batch": start})
            losses, lr = [], None
            for b, idx in enumerate(loader.indices(epoch)[start:n_batches], start=start):
                built, backend, scope = self._ensure("train", loader, len(idx))
                feed = self._feed(built, loader, idx, backend.rows(), epoch, b)
                lr = self.optimizer.lr_at(self._step)
                self._held.set_lr(lr)
                logs = {"epoch": epoch, "batch": b, "lr": lr, "batch_size": len(idx)}
                cbs.on_step_begin(self._step, logs)
                out = backend.step(scope, feed, self._step)
                loss = float(out[built.loss_name])
                if self.strategy.check_finite:
                    checks.check_finite(loss, self._step, epoch, b)
                self._step += 1
                self._position = (epoch, b + 1) if b + 1 < n_batches else (epoch + 1, 0)
                losses.append(loss)
                history.losses.append(loss)
                history.steps.append(self._step - 1)
                cbs.on_step_end(self._step - 1, {**logs, "loss": loss})
                if self.stop_training:
                    break
            record = {"epoch": epoch, "loss": float(np.mean(losses)) if losses else float("nan"),
                      "lr": lr}
            if valid_data is not None and self._position[1] == 0:
                record.update({f"val_{k}": v for k, v in
                               self.evaluate(valid_data, loader.batch_size, drop_last=drop_last,
                                             verbose=0).items()})
            history.epochs.append(record)
            cbs.on_epoch_end(epoch, record)
            if self.stop_training:
                break
        cbs.on_train_end({"steps": len(history.losses), "step": self._step})
        return history

    def _feed(self, built, loader, idx, rows, epoch: int, batch: int) -> dict:
        """The feed of one batch (this rank's ``rows`` of samples ``idx``), checked."""
        return self._checked(built, loader.load(idx, rows), idx if rows is None else idx[rows],
                             epoch, batch)

    def _checked(self, built, arrays, samples, epoch: int, batch: int) -> dict:
        """``arrays`` as a feed of ``built``, its labels and ids checked against their
        ranges (the error names dataset sample ``samples[row]``)."""
        if id(built) not in self._feed_checks:
            self._feed_checks[id(built)] = checks.FeedCheck(built.program)
        feed = dict(zip(built.feed_names, arrays))
        self._feed_checks[id(built)](feed, samples, epoch, batch)
        return feed

    def _start(self, loader, n_batches, steps_per_epoch) -> tuple:
        """(epoch, batch) to start at: (0, 0), or where a loaded checkpoint stopped."""
        resume, self._resume = self._resume, None
        if resume is None:
            return 0, 0
        epoch, batch = resume["epoch"], resume["batch"]
        if batch:     # inside an epoch: only the same batches continue it
            now = {"batch_size": loader.batch_size, "shuffle": loader.shuffle,
                   "dataset_size": len(loader.dataset), "drop_last": loader.drop_last,
                   "steps_per_epoch": steps_per_epoch}
            diff = [f"{k}={now[k]!r} (checkpoint: {resume.get(k)!r})" for k in now
                    if resume.get(k) != now[k]]
            if diff:
                raise DistGraphError(f"the checkpoint stopped inside epoch {epoch} after "
                                     f"batch {batch}; continuing it needs the same batches, "
                                     f"but this fit has " + ", ".join(diff))
            if batch >= n_batches:
                return epoch + 1, 0
        return epoch, batch

    def _only_planning(self, mode, loader=None) -> None:
        """Under ``distgraph plan`` (the request this Engine was created with): plan
        ``mode``'s first batch (with ``loader``; ``fit`` has planned already), write the
        report and end this process (see :mod:`distgraph.app.plan_report`)."""
        if self._plan_request is None:
            return
        if loader is not None:
            self._plan_batch(mode, loader, len(loader.indices(0)[0]))
        # priced on the command's --cluster / -n when it gave one (else the plan's own)
        plan_report.write_report(self._plans[mode], self._plan_request,
                                 checks.launcher_cluster())
        raise plan_report.PlanReported()

    def _plan_batch(self, mode, loader, rows):
        """Plan (without running) the program of a batch of ``rows`` samples."""
        ins, labels = loader.specs(self._label_count(mode), rows)
        try:
            if (mode, self._program_key(mode, ins, labels)) not in self._plan_cache:
                self.prepare(ins, labels, mode)
        except DistGraphError as e:
            if rows == loader.batch_size:
                raise
            raise type(e)(f"the last batch has {rows} samples (dataset of "
                          f"{len(loader.dataset)}, batch_size {loader.batch_size}) and "
                          f"cannot be planned: {e}. Pass drop_last=True, or a batch size "
                          f"that divides the dataset") from None

    @checks.collective("Engine.evaluate()")
    def evaluate(self, valid_data, batch_size=1, metrics=None, drop_last=False,
                 verbose=1) -> dict:
        """{"loss": mean loss over the samples, <metric name>: value, ...}; ``metrics``
        (default: the Engine's) see the global outputs and labels of every batch.
        ``verbose`` as in ``fit``: 1 a progress bar (rank 0), 2 one line, 0 nothing."""
        ms = self.metrics if metrics is None else as_metrics(metrics)
        loader = self._loader(valid_data, batch_size, drop_last=drop_last)
        self._check_data("eval", loader)
        self._only_planning("eval", loader)
        progress = CallbackList(_progress(verbose, None, label="evaluate"), self)
        try:
            return self._evaluate(loader, ms, progress)
        finally:
            progress.close()

    def _evaluate(self, loader, ms, progress) -> dict:
        for m in ms:
            m.reset()
        progress.on_train_begin({"epochs": 1, "steps_per_epoch": len(loader)})
        progress.on_epoch_begin(0, {})
        total, count = 0.0, 0
        for b, idx in enumerate(loader.indices(0)):
            built, backend, scope = self._ensure("eval", loader, len(idx))
            rows = backend.rows()
            if ms:       # metrics see every row of the batch
                batch = loader.load(idx)
                feed = self._checked(built, batch if rows is None else [a[rows] for a in batch],
                                     idx if rows is None else idx[rows], 0, b)
            else:
                feed = self._feed(built, loader, idx, rows, 0, b)
            out = backend.step(scope, feed, self._step)
            loss = float(out[built.loss_name])
            total += loss * len(idx)
            count += len(idx)
            if ms:
                n_in = len(built.feed_names) - len(built.label_names)
                outputs = [np.asarray(out[n]) for n in built.output_names]
                for m in ms:
                    m.update(outputs, batch[n_in:])
            progress.on_step_end(b, {"loss": loss, "batch_size": len(idx)})
        result = {"loss": total / count, **{m.name: float(m.result()) for m in ms}}
        progress.on_epoch_end(0, result)
        return result

    @checks.collective("Engine.predict()")
    def predict(self, test_data, batch_size=1, drop_last=False) -> list:
        """Per batch, the list of the model's outputs (global arrays)."""
        loader = self._loader(test_data, batch_size, drop_last=drop_last)
        self._check_data("predict", loader)
        self._only_planning("predict", loader)
        results = []
        for b, idx in enumerate(loader.indices(0)):
            built, backend, scope = self._ensure("predict", loader, len(idx))
            out = backend.step(scope, self._feed(built, loader, idx, backend.rows(), 0, b),
                               self._step)
            results.append([np.asarray(out[n]) for n in built.output_names])
        return results

    # -- state -------------------------------------------------------------------------------
    @checks.collective("Engine.state_dict()")
    def state_dict(self) -> dict:
        """Global numpy arrays of every parameter, on every rank (a collective when
        distributed: call it on all ranks)."""
        self._publish()
        return {n: p.numpy() for n, p in self.model.named_parameters()}

    @checks.collective("Engine.optimizer_state_dict()")
    def optimizer_state_dict(self) -> dict:
        """Global numpy arrays of every optimizer state (``fc1.weight@MOMENT1``,
        ``optimizer@STEP``, ...), on every rank (collective, like ``state_dict``)."""
        _, states = self._publish()
        return {n: np.array(a) for n, a in states.items()}

    @checks.collective("Engine.save()")
    def save(self, path) -> None:
        """Write a checkpoint directory: every parameter and optimizer state (each rank
        writes its own shards), the training position, the optimizer's settings and
        learning-rate schedule, and the random state. Collective: call it on every rank.
        Atomic: a job killed while saving leaves the previous checkpoint at ``path``."""
        entries = []
        params = {n for n, _ in self.model.named_parameters()}
        for name, layout, local in self._held.entries():
            kind = "parameter" if name in params else "optimizer"
            if layout is None:
                entries.append(checkpoint.Entry(name, tuple(local.shape), str(local.dtype),
                                                kind, local=local))
            else:
                entries.append(checkpoint.Entry(name, layout.shape, layout.dtype, kind,
                                                layout.attr, layout.plan.ranks, local))
        if self._comm is None and any(p.distributed for p in self._plans.values()):
            self._comm = _world_communicator()
        checkpoint.save(path, entries, checkpoint_info(self), self._comm)

    @checks.collective("Engine.load()")
    def load(self, path, strip_prefix: str = "", prefix: str = "") -> None:
        """Restore a checkpoint written by ``save`` under any plan: each process reads
        only its blocks when it next runs. Restores the step, the training position (the
        next ``fit`` runs only the epochs and batches not done yet), the data order and
        the dropout seeds. The optimizer's settings stay the ones given to this Engine.
        Collective like ``save``: call it on every rank.

        A checkpoint of the same model nested otherwise loads with its names renamed:
        ``strip_prefix="inner."`` drops that start of the checkpoint's names (saved
        from a wrapper layer whose ``inner`` is this model), ``prefix="inner."`` adds it
        (saved from the bare model, loaded into a wrapper)."""
        reader = CheckpointReader(path, strip_prefix=strip_prefix, prefix=prefix)
        check_checkpoint(self, reader)
        self._held.load(reader)
        self._scopes = {}
        restore_info(self, reader.info)
        if "train" in self._plans:    # lay the values out for the training plan now
            self._bind_again("train")

    def _bind_again(self, mode) -> None:
        """Bind the held values to ``mode``'s current feeds (planning again when the
        program key changed, e.g. dropout seeds restored by ``load``)."""
        self._bind(mode, *self._feed_specs[self._active[mode]])

    def timeline(self, mode="train"):
        """The timeline of the steps run so far in ``mode``, merged over every rank (a
        collective: call it on all ranks). Needs ``Strategy(profile=True)``; see
        :class:`distgraph.runtime.execution.timeline.Timeline` (``.events``, ``.save``, ``.plot``)."""
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


def _check_same_search(plan, comm) -> None:
    """Every rank searched its plan itself: make sure all chose the same (a search that
    ran out of time may stop at other choices on other ranks)."""
    import hashlib
    digest = hashlib.sha256(repr(plan.search.layouts).encode()).digest()
    mine = np.array([int.from_bytes(digest[:6], "big")], dtype=np.float64)
    ranks = list(range(comm.size))
    low = comm.all_reduce(mine, ranks, op="min")
    high = comm.all_reduce(mine, ranks, op="max")
    if low[0] != high[0]:
        raise DistGraphError(f"rank {comm.rank}: the ranks' searches chose different plans "
                             f"(search status {plan.search.status}, gap {plan.search.gap:.3g}): "
                             "raise Strategy.solver_time_limit so that the search finishes, or "
                             "annotate more tensors")


def _progress(verbose, callbacks, label=None) -> list:
    """The progress callback ``verbose`` asks for, unless the user gave one."""
    if verbose not in (0, 1, 2, False, True):
        raise DistGraphError(f"verbose={verbose!r}: give 0 (nothing), 1 (a progress bar) or "
                             "2 (one line per epoch)")
    if not verbose or any(isinstance(cb, ProgressBar) for cb in callbacks or ()):
        return []
    return [ProgressBar(bar=verbose == 1, label=label)]
