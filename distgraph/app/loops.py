"""The loops of an Engine: ``fit``, ``evaluate`` and ``predict``, batch by batch.

:class:`Loops` runs the batches of a call. For each batch it asks the Engine for the
plan of the batch's shape with the held values laid out for it (``Engine.ensure``: the
plan cache, then the held state), reads this process's part of the batch (only the
fields its program reads and only its rows of each:
:func:`~distgraph.app.data.reads_of` of the program's feeds), runs the step on the
plan's runner, and tells the callbacks. It keeps the training position: the optimizer
steps taken (dropout masks and the learning-rate schedule follow them), the (epoch,
batch) training reached (by the last fit, or in a loaded checkpoint) and how that fit
read its data (:mod:`distgraph.app.resume` saves and restores them).

``fit(epochs=N)`` trains until the Engine has trained N epochs over its whole life: a
fit starts where training stopped (finishing an epoch stopped inside first), so epoch
e reads the same batches, in the same shuffled order, whether one fit reached it or
several, and a fit whose total is reached already trains nothing and says so.

Under ``distgraph plan`` the first call plans its first batch, writes the report and
stops the script (:class:`~distgraph.runtime.launch.context.PlanReported`).

It reads the Engine through its public names (those a script uses, and those the
Engine keeps for its loops: ``ensure``, ``planned_key``, ``world``, ``warn``,
``plan_request``, ``launch_cluster``), and the Engine's plan cache and held state, which
it is given.

Example::

    loops = Loops(engine, plans, held)      # the Engine's PlanCache and HeldState
    history = loops.fit(data, batch_size=8, epochs=2)
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import numpy as np

from distgraph.annotation import ShardDataloader, checked_input_keys
from distgraph.app import checks, plan_report
from distgraph.app.checkpoint import hold
from distgraph.app.data import DataLoader, FieldRead
from distgraph.app.plans import Mode
from distgraph.callbacks import CallbackList, ModelCheckpoint, ProgressBar
from distgraph.errors import BatchSplitError, DistGraphError
from distgraph.metrics import as_metrics
from distgraph.runtime.backend import backend_for
from distgraph.runtime.execution.runner import check_world


@dataclass
class History:
    """``losses``: the global loss of every optimizer step this fit ran; ``steps``: their
    global step numbers (a fit after an earlier fit or a ``load`` starts past 0);
    ``epochs``: one record per epoch this fit ran, numbered over the Engine's life
    (``epoch``, mean ``loss``, ``lr``, and ``val_loss`` / ``val_<metric>`` when
    validation data was given). Empty when the fit's total of epochs was reached
    already. ``memory``: per step, the bytes this rank held at its peak (the arrays the
    runtime holds: :mod:`distgraph.runtime.execution.memory`); each rank has its own,
    unlike ``losses``; ``memory_at``: where each peak was reached (``"action 0B1, op
    'matmul_grad' in layer 'fc1'"``); ``allocated``: per step, the peak as the allocator
    handed it out (kernels' temporaries included) where it is measured (numpy while
    ``tracemalloc`` traces: ``StepMemory.allocation_peak``), else None."""

    losses: list = field(default_factory=list)
    steps: list = field(default_factory=list)
    epochs: list = field(default_factory=list)
    memory: list = field(default_factory=list)
    memory_at: list = field(default_factory=list)
    allocated: list = field(default_factory=list)


class Loops:
    """The fit / evaluate / predict loops of ``engine`` and its training position
    (module docstring); ``plans`` and ``held`` are the Engine's plan cache
    (:class:`~distgraph.app.plans.PlanCache`) and held state
    (:class:`~distgraph.app.state.HeldState`)."""

    def __init__(self, engine, plans, held):
        self.engine, self.plans, self.held = engine, plans, held
        self.step = 0                  # optimizer steps taken (dropout and LR use it)
        self.position = (0, 0)         # (epoch, batch) training reached: the next fit's start
        self.loaded = False            # position and fit_config came from a checkpoint
        self.fit_config = None         # how the fit that reached position read its data
        self.data_seed = engine.strategy.seed
        self.sharding = None           # the last fit's shard_dataloader, for plain datasets

    # -- fit ----------------------------------------------------------------------------------
    def fit(self, train_data, batch_size, epochs, steps_per_epoch, valid_data, shuffle,
            verbose, callbacks, drop_last, input_keys=None) -> History:
        """``Engine.fit`` (see there)."""
        engine = self.engine
        if engine.optimizer is None or engine.loss is None:
            raise DistGraphError("fit needs an Engine with a loss and an optimizer")
        self.sharding = train_data if isinstance(train_data, ShardDataloader) else None
        loader = self.loader(train_data, batch_size, shuffle, drop_last, input_keys, "fit")
        self.check_data(Mode.TRAIN, loader)
        n_batches = len(loader) if steps_per_epoch is None else min(steps_per_epoch, len(loader))
        cbs = CallbackList(progress(verbose, callbacks) + list(callbacks or []), engine)
        # the directories the fit will save into: held by this job until it returns
        comm = engine.world() if engine.world_size > 1 else None
        locks = [hold(cb.path, comm) for cb in cbs.callbacks if isinstance(cb, ModelCheckpoint)]
        for lock in locks:
            if lock.unsupported:
                engine.warn(f"the filesystem of {lock.path} takes no locks "
                            f"({lock.unsupported}): nothing stops another job from saving "
                            f"there while this one does")
        try:
            return self._fit(loader, n_batches, epochs, steps_per_epoch, valid_data, cbs,
                             drop_last, input_keys)
        finally:
            for lock in locks:
                lock.release()

    def _fit(self, loader, n_batches, epochs, steps_per_epoch, valid_data, cbs, drop_last,
             input_keys) -> History:
        """``fit`` once its callbacks hold their checkpoint directories."""
        engine, callbacks = self.engine, cbs.callbacks
        cbs.on_fit_start({"epochs": epochs, "batch_size": loader.batch_size})   # may load a checkpoint
        if engine.elastic_restart and engine.global_step == 0 and not any(
                isinstance(cb, ModelCheckpoint) for cb in callbacks):
            say_starting_over(engine)
        reached = self.position[0] >= epochs     # epochs is a total: nothing left to train
        if not reached:
            first_epoch, first_batch = self._start(loader, n_batches, steps_per_epoch)
            self.fit_config = {"batch_size": loader.batch_size, "shuffle": bool(loader.shuffle),
                               "drop_last": bool(drop_last), "steps_per_epoch": steps_per_epoch,
                               "dataset_size": len(loader.dataset)}
            if loader.input_keys is not None:     # dict samples: which fields were read
                self.fit_config["input_keys"] = list(loader.input_keys)
            self.loaded = False
        self.plan_shapes(Mode.TRAIN, loader, loader.indices(0)[:n_batches])
        self.only_planning(Mode.TRAIN)
        if reached:
            self.say_reached(epochs)
            return History()
        # valid_data is read with the keys the training data is read with (unless it is a
        # shard_dataloader of its own keys)
        valid_keys = input_keys if input_keys is not None or isinstance(
            valid_data, ShardDataloader) else loader.input_keys
        if valid_data is not None:       # validated at each epoch's end: planned now
            valid = self.loader(valid_data, loader.batch_size, drop_last=drop_last,
                                input_keys=valid_keys, call="fit")
            self.check_data(Mode.EVAL, valid)
            self.plan_shapes(Mode.EVAL, valid, valid.indices(0))
        # GPUs asked for where there are none, or a job of the wrong size: one line now,
        # not after the progress bar
        train = self.plans.plan(Mode.TRAIN)
        backend_for(train.devices, engine.rank if train.distributed else 0)
        self.check_world(train)
        plan_report.write_run_page(engine, train)        # distgraph run --report
        try:
            history = self._train(loader, n_batches, first_epoch, first_batch, epochs, cbs,
                                  valid_data, drop_last, valid_keys)
        except BaseException:
            cbs.close()          # a progress bar left open prints again at interpreter exit
            raise
        plan_report.write_run_page(engine, train, measured=True)
        return history

    def _train(self, loader, n_batches, first_epoch, first_batch, epochs, cbs, valid_data,
               drop_last, valid_keys) -> History:
        """The epochs of ``fit`` from (first_epoch, first_batch); ``valid_data`` is read
        with ``valid_keys``."""
        engine = self.engine
        history = History()
        engine.stop_training = False
        cbs.on_train_begin({"epochs": epochs, "steps_per_epoch": n_batches,
                            "batch_size": loader.batch_size, "step": self.step})
        for epoch in range(first_epoch, epochs):
            start = first_batch if epoch == first_epoch else 0
            if epoch != first_epoch:
                n_batches = self.epoch_batches(loader, epoch, n_batches)
            self.position = (epoch, start)
            cbs.on_epoch_begin(epoch, {"batch": start, "steps": n_batches})
            losses, lr = [], None
            for b, idx in enumerate(loader.indices(epoch)[start:n_batches], start=start):
                planned, runner, scope = self.ensure(Mode.TRAIN, loader, len(idx))
                feed, _ = self.feed(planned, loader, idx, epoch, b)
                lr = engine.optimizer.lr_at(self.step)
                self.held.set_lr(lr)
                logs = {"epoch": epoch, "batch": b, "lr": lr, "batch_size": len(idx),
                        "tokens": tokens_of(planned.specs[0])}
                cbs.on_step_begin(self.step, logs)
                out = runner.run(scope, feed, self.step, local=True)
                loss = float(out[planned.plan.built.loss_name])
                if engine.strategy.check_finite:
                    checks.check_finite(loss, self.step, epoch, b)
                memory = self.memory_of(runner)
                self.step += 1
                self.position = (epoch, b + 1) if b + 1 < n_batches else (epoch + 1, 0)
                losses.append(loss)
                history.losses.append(loss)
                history.steps.append(self.step - 1)
                history.memory.append(memory.peak)
                history.allocated.append(memory.allocation_peak)
                history.memory_at.append(sys.intern(memory.where))   # a few distinct ones
                cbs.on_step_end(self.step - 1, {**logs, "loss": loss, "memory": memory.peak})
                if engine.stop_training:
                    break
            record = {"epoch": epoch, "loss": float(np.mean(losses)) if losses else float("nan"),
                      "lr": lr}
            if valid_data is not None and self.position[1] == 0:
                record.update({f"val_{k}": v for k, v in
                               engine.evaluate(valid_data, loader.batch_size,
                                               drop_last=drop_last, verbose=0,
                                               input_keys=valid_keys).items()})
            history.epochs.append(record)
            cbs.on_epoch_end(epoch, record)
            if engine.stop_training:
                break
        cbs.on_train_end({"steps": len(history.losses), "step": self.step})
        return history

    def epoch_batches(self, loader, epoch: int, before: int) -> int:
        """The batches epoch ``epoch`` runs (``before``: the last epoch's). A dataset
        whose length changed since the last epoch is followed: the epoch reads every
        sample it has now, its batch shapes are planned first, and rank 0 says so in one
        line. Every rank must see the same length (checked when there are several)."""
        engine, config = self.engine, self.fit_config
        n = len(loader.dataset)
        if engine.world_size > 1:
            comm = engine.world()
            lengths = np.asarray(comm.all_gather(np.array([n], dtype=np.int64),
                                                 tuple(range(comm.size)))).tolist()
            if len(set(lengths)) > 1:
                raise DistGraphError(f"at the start of epoch {epoch} the training dataset "
                                     f"has {lengths} samples on ranks 0..{comm.size - 1}: "
                                     f"every rank must read the same dataset")
        if n == config["dataset_size"]:
            return before
        changed = (f"the training dataset has {n} samples at the start of epoch {epoch}, "
                   f"{config['dataset_size']} at the start of the last")
        steps = config["steps_per_epoch"]
        batches = loader.indices(epoch)
        n_batches = len(batches) if steps is None else min(steps, len(batches))
        self.plan_shapes(Mode.TRAIN, loader, batches[:n_batches], changed)
        config["dataset_size"] = n
        engine.warn(f"{changed}: epoch {epoch} reads {n_batches} batches of it"
                    + (" (steps_per_epoch)" if n_batches == steps else ""))
        return n_batches

    def _start(self, loader, n_batches, steps_per_epoch) -> tuple:
        """(epoch, batch) to start at: where training stopped (``position``: the last
        fit's, or a loaded checkpoint's). Inside an epoch, only the batches that epoch
        began with continue it."""
        epoch, batch = self.position
        if batch:
            now = {"batch_size": loader.batch_size, "shuffle": loader.shuffle,
                   "dataset_size": len(loader.dataset), "drop_last": loader.drop_last,
                   "steps_per_epoch": steps_per_epoch,
                   "input_keys": None if loader.input_keys is None else list(loader.input_keys)}
            before = self.fit_config or {}
            source = "the checkpoint" if self.loaded else "the last fit"
            diff = [f"{k}={now[k]!r} ({source}: {before.get(k)!r})" for k in now
                    if before.get(k) != now[k]]
            if diff:
                raise DistGraphError(f"{source} stopped inside epoch {epoch} after batch "
                                     f"{batch}; continuing it needs the same batches, but "
                                     f"this fit has " + ", ".join(diff) + f": give fit "
                                     f"{source}'s settings to finish epoch {epoch}")
            if batch >= n_batches:
                return epoch + 1, 0
        return epoch, batch

    def say_reached(self, epochs) -> None:
        """One line on rank 0: a fit whose total of ``epochs`` is reached trains nothing."""
        epoch, batch = self.position
        if self.engine.rank != 0:
            return
        done = f"{epoch} epoch{'s' if epoch != 1 else ''}"
        if batch:
            done += f" (and {batch} batch{'es' if batch != 1 else ''} of the next)"
        print(f"distgraph: fit: the Engine has trained {done} already; epochs={epochs} is "
              f"the total to reach: pass epochs={epoch + 1} or more to train more",
              file=sys.stderr, flush=True)

    # -- evaluate and predict ------------------------------------------------------------------
    def evaluate(self, valid_data, batch_size, metrics, drop_last, verbose,
                 input_keys=None) -> dict:
        """``Engine.evaluate`` (see there)."""
        ms = self.engine.metrics if metrics is None else as_metrics(metrics)
        loader = self.loader(valid_data, batch_size, drop_last=drop_last,
                             input_keys=input_keys, call="evaluate")
        self.check_data(Mode.EVAL, loader)
        self.only_planning(Mode.EVAL, loader)
        self.plan_shapes(Mode.EVAL, loader, loader.indices(0))
        self.check_world(self.plans.plan(Mode.EVAL))
        bar = CallbackList(progress(verbose, None, label="evaluate"), self.engine)
        try:
            return self._evaluate(loader, ms, bar)
        finally:
            bar.close()

    def _evaluate(self, loader, ms, bar) -> dict:
        for m in ms:
            m.reset()
        bar.on_train_begin({"epochs": 1, "steps_per_epoch": len(loader)})
        bar.on_epoch_begin(0, {})
        total, count = 0.0, 0
        for b, idx in enumerate(loader.indices(0)):
            planned, runner, scope = self.ensure(Mode.EVAL, loader, len(idx))
            built = planned.plan.built
            n_in = len(built.feed_names) - len(built.label_names)
            # metrics see the global labels of every batch, read with this process's feed
            labels = range(n_in, len(built.feed_names)) if ms else ()
            feed, whole = self.feed(planned, loader, idx, 0, b, labels)
            out = runner.run(scope, feed, self.step, local=True)
            self.memory_of(runner)
            loss = float(out[built.loss_name])
            total += loss * len(idx)
            count += len(idx)
            if ms:
                outputs = [np.asarray(out[n]) for n in built.output_names]
                for m in ms:
                    m.update(outputs, whole)
            bar.on_step_end(b, {"loss": loss, "batch_size": len(idx)})
        result = {"loss": total / count, **{m.name: float(m.result()) for m in ms}}
        bar.on_epoch_end(0, result)
        return result

    def predict(self, test_data, batch_size, drop_last, input_keys=None) -> list:
        """``Engine.predict`` (see there)."""
        loader = self.loader(test_data, batch_size, drop_last=drop_last,
                             input_keys=input_keys, call="predict")
        self.check_data(Mode.PREDICT, loader)
        self.only_planning(Mode.PREDICT, loader)
        self.plan_shapes(Mode.PREDICT, loader, loader.indices(0))
        results = []
        for b, idx in enumerate(loader.indices(0)):
            planned, runner, scope = self.ensure(Mode.PREDICT, loader, len(idx))
            feed, _ = self.feed(planned, loader, idx, 0, b)
            out = runner.run(scope, feed, self.step, local=True)
            self.memory_of(runner)
            results.append([loader.restored(np.asarray(out[n]))
                            for n in planned.plan.built.output_names])
        return results

    # -- batches --------------------------------------------------------------------------------
    def loader(self, data, batch_size, shuffle=False, drop_last=False, input_keys=None,
               call="fit") -> DataLoader:
        """A DataLoader of ``data``, its dict samples read at ``input_keys`` (given to
        Engine.``call``, else the shard_dataloader's); a plain dataset is split as the
        last fit's ``shard_dataloader`` split its data (its input_keys are not taken:
        they name the fields of that dataset)."""
        return DataLoader(data, batch_size, shuffle, self.data_seed, drop_last,
                          sharding=self.sharding,
                          input_keys=checked_input_keys(input_keys, f"Engine.{call}"))

    def check_data(self, mode, loader: DataLoader) -> None:
        """The samples' fields against the model's forward; a warning for fields fed in a
        narrower dtype than the dataset's."""
        n_fields, n_labels = len(loader.fields()), self.label_count(mode, loader)
        checks.check_fields(self.engine.model, n_fields, n_labels)
        for k, have, fed in loader.casts():
            what = "the label" if k >= n_fields - n_labels else "an input"
            self.engine.warn(f"dataset field {k} ({what}) is {have} and is cast to {fed}, "
                             f"the model's dtype; dg.set_default_dtype({have!r}) computes "
                             f"in {have}, or give {fed} samples")

    def label_count(self, mode, loader) -> int:
        """Trailing label fields of ``loader``'s samples: one when training or
        evaluating; when predicting, those past the inputs of the train or eval program
        (so a dataset with labels works, and one of inputs only), else, before any,
        the one trailing field past the inputs the model's forward can take (Keras'
        predict of (x, y) samples); none where its forward takes any number."""
        if mode is not Mode.PREDICT:
            return 1
        known = self.plans.plan(Mode.TRAIN) or self.plans.plan(Mode.EVAL)
        n_fields = len(loader.fields())
        if known is None:
            most = checks.forward_inputs(self.engine.model)
            return 0 if most is None else min(1, max(0, n_fields - most))
        inputs = len(known.built.feed_names) - len(known.built.label_names)
        return min(len(known.built.label_names), max(0, n_fields - inputs))

    def specs(self, mode, loader, rows: int) -> tuple:
        """The (inputs, labels) InputSpecs of ``mode``'s program for a batch of ``rows``."""
        ins, labels = loader.specs(self.label_count(mode, loader), rows)
        return ins, labels[:0] if mode is Mode.PREDICT else labels

    def ensure(self, mode, loader, rows: int) -> tuple:
        """(Planned, runner, scope) of ``mode`` for a batch of ``rows`` samples."""
        return self.engine.ensure(mode, *self.specs(mode, loader, rows))

    def feed(self, planned, loader, idx, epoch: int, batch: int, whole=()) -> tuple:
        """(this process's feed of the batch of samples ``idx``: only the inputs its
        program reads, only its rows of each, checked; the fields ``whole`` (indices) of
        every row, read with it)."""
        reads = planned.reads()
        arrays = loader.read(idx, list(reads.values()) + [FieldRead(k) for k in whole])
        feed = dict(zip(reads, arrays))
        samples = {name: (idx if r.rows is None else idx[r.rows], r.cut)
                   for name, r in reads.items()}
        planned.check()(feed, samples, epoch, batch)
        return feed, arrays[len(reads):]

    def memory_of(self, runner):
        """The step just run's memory record on this rank (``runner.last_memory``), said
        once where ``Strategy(memory_check=True)`` finds its peak above the plan's."""
        said = runner.check_memory()
        if said is not None:
            self.engine.warn(*said)
        return runner.last_memory

    def check_world(self, plan) -> None:
        """A plan of another number of processes than the job's ranks stops now, saying
        how to launch it (before a progress bar is drawn)."""
        if plan.distributed:
            self.engine.world()    # the job's communicator first: its hook makes errors one line
            check_world(plan, self.engine.world_size)

    # -- planning only ----------------------------------------------------------------------------
    def plan_shapes(self, mode, loader, batches, changed: str = "") -> None:
        """Plan ``mode``'s program for every batch shape of ``batches`` (index arrays),
        the full batch first, before the first step: a batch that cannot be planned
        stops the call now, never at the end of an epoch. ``changed``: why the shapes
        are planned again (a dataset whose length changed), said first in an error."""
        for rows in sorted({len(idx) for idx in batches}, reverse=True):
            self.plan_batch(mode, loader, rows, changed)

    def plan_batch(self, mode, loader, rows: int, changed: str = "") -> None:
        """Plan (without running) ``mode``'s program for a batch of ``rows`` samples.

        A short last batch runs on a plan of its own, as serial training would run it;
        where the data-parallel split (or the micro-batches) cannot divide it, the error
        names the two ways out: ``drop_last=True``, or the dataset lengths nearest to
        this one whose last batch divides."""
        try:
            self.engine.planned_key(mode, *self.specs(mode, loader, rows))
        except DistGraphError as e:
            if rows == loader.batch_size:
                raise
            n, b = len(loader.dataset), loader.batch_size
            each = " of each epoch" if mode is Mode.TRAIN else ""
            last = (f"{changed}: " if changed else "") + \
                f"the last batch{each} has {rows} samples (dataset of {n}, batch_size {b})"
            if not isinstance(e, BatchSplitError):
                raise type(e)(f"{last} and cannot be planned: {e}. Pass drop_last=True, or "
                              f"use a dataset length that {b} divides") from None
            cut = rows % e.parts
            raise BatchSplitError(f"{last}, which {e.split} does not divide: pass "
                                  f"drop_last=True to skip those {rows} samples, or use a "
                                  f"dataset of {n - cut} or {n - cut + e.parts} samples "
                                  f"(then the last batch divides by {e.parts})",
                                  rows, e.parts, e.split) from None

    def only_planning(self, mode, loader=None) -> None:
        """Under ``distgraph plan`` (the request the Engine was made under): plan
        ``mode``'s first batch (with ``loader``; ``fit`` has planned already), write the
        report and stop the script (:class:`PlanReported`)."""
        engine = self.engine
        request = engine.plan_request
        if request is None:
            return
        if loader is not None:
            self.plan_batch(mode, loader, len(loader.indices(0)[0]))
        # priced on the command's --cluster / -n when it gave one (else the plan's own)
        plan_report.write_report(self.plans.plan(mode), request, engine.launch_cluster())
        raise plan_report.PlanReported()


def tokens_of(inputs) -> int | None:
    """The tokens of a batch fed as ``inputs`` (InputSpecs): the elements of its first
    input when that holds integer ids of sequences ([batch, seq, ...]); else None."""
    first = inputs[0] if inputs else None
    if first is None or len(first.shape) < 2 or not str(first.dtype).startswith(("int", "uint")):
        return None
    return int(np.prod(first.shape))


def say_starting_over(engine) -> None:
    """An elastic restart whose fit has nothing to resume from says so (rank 0), since
    every step done before the failure runs again."""
    if engine.rank == 0:
        print(f"distgraph: elastic restart {engine.elastic_restart} on {engine.world_size} "
              "ranks: no checkpoint was loaded and the fit has no ModelCheckpoint, so "
              "training starts over from step 0 (add dg.callbacks.ModelCheckpoint(path, "
              "every_n_steps=k) to resume from the last one)", file=sys.stderr, flush=True)


def progress(verbose, callbacks, label=None) -> list:
    """The progress callback ``verbose`` asks for, unless the user gave one."""
    if verbose not in (0, 1, 2, False, True):
        raise DistGraphError(f"verbose={verbose!r}: give 0 (nothing), 1 (a progress bar) or "
                             "2 (one line per epoch)")
    if not verbose or any(isinstance(cb, ProgressBar) for cb in callbacks or ()):
        return []
    return [ProgressBar(bar=verbose == 1, label=label)]
