"""Callbacks: code that ``Engine.fit`` runs at fixed points of training.

The protocol (override what you need; every method gets a ``logs`` dict)::

    on_fit_start(logs)            before fit decides where it starts (a checkpoint loaded
                                  here is resumed); logs: {"epochs", "batch_size"}
    on_train_begin(logs)          logs: {"epochs" (the total fit trains to), "steps_per_epoch",
                                  "batch_size", "step"}
    on_epoch_begin(epoch, logs)
    on_step_begin(step, logs)     step: the global optimizer step about to run (0-based);
                                  logs: {"epoch", "batch", "lr", "batch_size", "tokens"
                                  (a batch of token ids' [batch, seq] count; else None)}
    on_step_end(step, logs)       logs as above plus "loss" (the global loss) and
                                  "memory" (the bytes this rank held at the step's peak)
    on_epoch_end(epoch, logs)     logs: the epoch's record: "loss" (mean), "lr", and
                                  "val_loss" / "val_<metric>" when fit validates
    on_train_end(logs)            logs: {"steps": steps run by this fit, "step": global}

Callbacks run on every rank with identical logs (but "memory": each rank's own), so a
collective inside one (``engine.save``) is safe; ``self.engine`` is the Engine and
``self.engine.rank`` the rank. Setting ``self.engine.stop_training = True`` ends ``fit``
after the current step.

Shipped: :class:`ProgressBar` (added by ``fit(verbose=1)``, the default),
:class:`ModelCheckpoint`, :class:`EarlyStopping`, :class:`CSVLogger`,
:class:`TensorBoard`. Learning-rate schedules need no callback: the optimizer's schedule
is read before every step.

Example::

    engine.fit(data, batch_size=16, epochs=10, valid_data=valid,
               callbacks=[dg.callbacks.ModelCheckpoint("ckpt", every_n_steps=100),
                          dg.callbacks.EarlyStopping("val_loss", patience=2),
                          dg.callbacks.CSVLogger("train.csv"),
                          dg.callbacks.TensorBoard("runs/gpt")])
"""

from __future__ import annotations

import csv
import math
import os
import sys
import time
from types import SimpleNamespace

from distgraph.errors import DistGraphError
from distgraph.units import fmt_bytes


class Callback:
    """Base class; every hook does nothing."""

    engine = None

    def set_engine(self, engine) -> None:
        self.engine = engine

    def on_fit_start(self, logs=None):
        pass

    def on_train_begin(self, logs=None):
        pass

    def on_train_end(self, logs=None):
        pass

    def on_epoch_begin(self, epoch, logs=None):
        pass

    def on_epoch_end(self, epoch, logs=None):
        pass

    def on_step_begin(self, step, logs=None):
        pass

    def on_step_end(self, step, logs=None):
        pass

    def close(self):
        """Release what the callback keeps open (a progress bar) when ``fit`` ends by an
        error, without the end-of-training hooks."""


class CallbackList(Callback):
    """Calls each callback in order."""

    def __init__(self, callbacks, engine):
        self.callbacks = list(callbacks or [])
        for cb in self.callbacks:
            if not isinstance(cb, Callback):
                raise DistGraphError(f"callbacks must be dg.callbacks.Callback objects, got "
                                     f"{cb!r}")
            cb.set_engine(engine)

    def on_fit_start(self, logs=None):
        for cb in self.callbacks:
            cb.on_fit_start(logs)

    def on_train_begin(self, logs=None):
        for cb in self.callbacks:
            cb.on_train_begin(logs)

    def on_train_end(self, logs=None):
        for cb in self.callbacks:
            cb.on_train_end(logs)

    def on_epoch_begin(self, epoch, logs=None):
        for cb in self.callbacks:
            cb.on_epoch_begin(epoch, logs)

    def on_epoch_end(self, epoch, logs=None):
        for cb in self.callbacks:
            cb.on_epoch_end(epoch, logs)

    def on_step_begin(self, step, logs=None):
        for cb in self.callbacks:
            cb.on_step_begin(step, logs)

    def on_step_end(self, step, logs=None):
        for cb in self.callbacks:
            cb.on_step_end(step, logs)

    def close(self):
        for cb in self.callbacks:
            cb.close()


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _fmt_bytes(n) -> str:
    """``"1.5MB"``: bytes as :func:`~distgraph.units.fmt_bytes` says them, one word
    (progress lines split on spaces)."""
    return fmt_bytes(n).replace(" ", "")


TERMINAL_VAR = "DISTGRAPH_TERMINAL"   # "1" / "0": whether the job's output reaches a terminal


def is_terminal(stream) -> bool:
    """Whether output to ``stream`` reaches a terminal: as ``distgraph run`` says
    (``$DISTGRAPH_TERMINAL``; its ranks write into pipes, read by the launcher), else
    the stream's own ``isatty()``."""
    said = os.environ.get(TERMINAL_VAR)
    if said in ("0", "1"):
        return said == "1"
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:          # a closed stream
        return False


class ProgressBar(Callback):
    """A tqdm bar per epoch on rank 0: the step's loss, rank 0's measured memory peak in
    the step (``mem``; at the epoch's end ``peak_mem``, the highest of the epoch), steps/s
    and samples/s (global samples). Where the output does not reach a terminal (a file, a
    pipe into ``tee``: :func:`is_terminal`), plain lines instead of the bar's ``\r``
    updates: one about every tenth of the epoch and one at its end. With ``bar=False``,
    only the line at each epoch's end, on stdout (``fit(verbose=2)``). ``label`` names
    the bar instead of ``epoch i/n`` (``evaluate`` shows "evaluate").

    Example::

        engine.fit(data, batch_size=16, verbose=0, callbacks=[dg.callbacks.ProgressBar()])
    """

    def __init__(self, bar: bool = True, file=None, label: str | None = None):
        self.bar, self.file, self.label = bar, file, label
        self._tqdm = None
        self._lines = False          # plain lines on the bar's stream, for logs

    def _name(self, epoch) -> str:
        return self.label or f"epoch {epoch + 1}/{self.epochs}"

    def _active(self) -> bool:
        return self.engine is None or self.engine.rank == 0

    def on_train_begin(self, logs=None):
        self.epochs = logs.get("epochs")
        self.steps = logs.get("steps_per_epoch")

    def on_epoch_begin(self, epoch, logs=None):
        self._start, self._samples, self._count = time.perf_counter(), 0, 0
        self._peak = None
        self._epoch, self._done = epoch, logs.get("batch", 0) if logs else 0
        self.steps = (logs or {}).get("steps", self.steps)   # (a dataset that changed length)
        self._lines = self.bar and self._active() and \
            not is_terminal(self.file or sys.stderr)
        if self.bar and self._active() and not self._lines:
            from tqdm import tqdm
            self._tqdm = tqdm(total=self.steps, desc=self._name(epoch),
                              unit="step", file=self.file or sys.stderr, dynamic_ncols=True,
                              leave=True)
            self._tqdm.update(logs.get("batch", 0) if logs else 0)

    def _rates(self) -> dict:
        seconds = max(time.perf_counter() - self._start, 1e-9)
        return {"steps/s": f"{self._count / seconds:.3g}",
                "samples/s": f"{self._samples / seconds:.4g}"}

    def on_step_end(self, step, logs=None):
        self._count += 1
        self._done += 1
        self._samples += logs.get("batch_size", 0)
        shown = {"loss": f"{logs['loss']:.4g}"}
        if logs.get("memory") is not None:
            self._peak = max(self._peak or 0, logs["memory"])
            shown["mem"] = _fmt_bytes(logs["memory"])
        every = max(1, (self.steps or 0) // 10)
        if self._lines and self._done % every == 0 and self._done != self.steps:
            text = " ".join(f"{k}={v}" for k, v in {**shown, **self._rates()}.items())
            total = f"/{self.steps}" if self.steps else ""
            print(f"{self._name(self._epoch)} step {self._done}{total} {text}",
                  file=self.file or sys.stderr, flush=True)
        if self._tqdm is not None:
            self._tqdm.set_postfix({**shown, **self._rates()}, refresh=False)
            self._tqdm.update(1)

    def on_epoch_end(self, epoch, logs=None):
        # the epoch's record: its mean loss, shown apart from the last step's "loss"
        shown = {("mean_loss" if k == "loss" else k): v for k, v in (logs or {}).items()
                 if k != "epoch"}
        if self._peak is not None:
            shown["peak_mem"] = _fmt_bytes(self._peak)
        if self._tqdm is not None:
            self._tqdm.set_postfix({**{k: _fmt(v) for k, v in shown.items()},
                                    **self._rates()})
            self._tqdm.close()
            self._tqdm = None
        elif self._active():
            text = " ".join(f"{k}={_fmt(v)}" for k, v in {**shown, **self._rates()}.items())
            stream = (self.file or sys.stderr) if self._lines else (self.file or sys.stdout)
            print(f"{self._name(epoch)} {text}", file=stream, flush=True)

    def on_train_end(self, logs=None):
        self.close()                         # stopped inside an epoch

    def close(self):
        if self._tqdm is not None:
            self._tqdm.close()
            self._tqdm = None


class ModelCheckpoint(Callback):
    """``engine.save(path)`` every ``every_n_steps`` optimizer steps, or at the end of
    every epoch when ``every_n_steps`` is None. ``path`` may hold ``{step}`` and
    ``{epoch}`` to keep several checkpoints; otherwise each save replaces the last one
    atomically. Runs on every rank (saving is collective). From the start of ``fit`` to
    its end the job holds ``path`` (:mod:`distgraph.app.checkpoint_lock`): a path that
    cannot be written, or that another job holds, stops the fit at its start.

    In an elastic job restarted after a failure (``engine.elastic_restart`` > 0), the
    fit first loads the newest checkpoint at ``path`` that verifies completely
    (``engine.resume``: a damaged one is skipped, saying why), resharded into the new
    plan, and goes on from its step; the script is unchanged."""

    def __init__(self, path, every_n_steps: int | None = None):
        if every_n_steps is not None and int(every_n_steps) < 1:
            raise DistGraphError(f"ModelCheckpoint every_n_steps must be >= 1, got "
                                 f"{every_n_steps}")
        self.path, self.every_n_steps = str(path), every_n_steps
        self.saved: list = []

    def on_fit_start(self, logs=None):
        engine = self.engine
        if not engine.elastic_restart:
            return
        found = engine.resume(self.path)
        if engine.rank == 0:
            said = (f"resumed from {found} at step {engine.global_step}" if found else
                    f"no complete checkpoint at {self.path}: starting from step 0")
            print(f"distgraph: elastic restart {engine.elastic_restart} on "
                  f"{engine.world_size} ranks: {said}", file=sys.stderr, flush=True)

    def _save(self, epoch):
        path = self.path.format(step=self.engine.global_step, epoch=epoch)
        self.engine.save(path)
        self.saved.append(path)

    def on_step_end(self, step, logs=None):
        if self.every_n_steps and (step + 1) % self.every_n_steps == 0:
            self._save(logs.get("epoch"))

    def on_epoch_end(self, epoch, logs=None):
        if not self.every_n_steps:
            self._save(epoch)


class EarlyStopping(Callback):
    """Stop training when ``monitor`` (a key of the epoch logs, e.g. "val_loss" or
    "val_accuracy") has not improved by more than ``min_delta`` for ``patience``
    epochs. ``mode`` "min", "max", or "auto" (max for accuracies, else min)."""

    def __init__(self, monitor="val_loss", patience=0, min_delta=0.0, mode="auto"):
        if mode not in ("min", "max", "auto"):
            raise DistGraphError(f"EarlyStopping mode must be 'min', 'max' or 'auto', got "
                                 f"{mode!r}")
        if mode == "auto":
            mode = "max" if "acc" in monitor else "min"
        self.monitor, self.patience = monitor, int(patience)
        self.min_delta, self.mode = abs(float(min_delta)), mode
        self.stopped_epoch = None

    def on_train_begin(self, logs=None):
        self.best, self.wait, self.stopped_epoch = None, 0, None

    def on_epoch_end(self, epoch, logs=None):
        if self.monitor not in logs:
            raise DistGraphError(f"EarlyStopping monitors {self.monitor!r}, but the epoch "
                                 f"logs hold only {sorted(logs)}; give fit valid_data to get "
                                 f"'val_loss', or monitor 'loss'")
        value = float(logs[self.monitor])
        sign = 1.0 if self.mode == "min" else -1.0
        if self.best is None or sign * (self.best - value) > self.min_delta:
            self.best, self.wait = value, 0
            return
        self.wait += 1
        if self.wait > self.patience:
            self.stopped_epoch = epoch
            self.engine.stop_training = True


class CSVLogger(Callback):
    """Rank 0 writes one row per epoch (the epoch's logs) to ``path``; ``append`` keeps
    earlier rows (a resumed run continues the file)."""

    def __init__(self, path, append: bool = False):
        self.path, self.append = str(path), append
        self._file = self._writer = None

    def on_train_begin(self, logs=None):
        if self.engine.rank == 0:
            self._file = open(self.path, "a" if self.append else "w", newline="")
            self._writer = None

    def on_epoch_end(self, epoch, logs=None):
        if self._file is None:
            return
        row = {k: ("" if isinstance(v, float) and math.isnan(v) else v)
               for k, v in logs.items()}
        if self._writer is None:
            self._writer = csv.DictWriter(self._file, fieldnames=list(row), restval="",
                                          extrasaction="ignore")
            if self._file.tell() == 0:
                self._writer.writeheader()
        self._writer.writerow(row)
        self._file.flush()

    def on_train_end(self, logs=None):
        if self._file is not None:
            self._file.close()
            self._file = None


TENSORBOARD_EXTRA = "pip install 'distgraph[tensorboard]'"
MEMORY_RANKS = 64           # TensorBoard's memory/rank<r> series drawn, at most


def predicted_tag(plan) -> str:
    """The TensorBoard tag of a plan's predicted step time: ``step_time/predicted``, or
    ``step_time/predicted_uncalibrated`` where the plan's cluster is not calibrated
    (``Cluster.calibrated``; a plan without one is priced on ``Cluster.local``'s
    defaults)."""
    measured = plan.cluster is not None and plan.cluster.calibrated
    return "step_time/predicted" if measured else "step_time/predicted_uncalibrated"


class TensorBoard(Callback):
    """Rank 0 writes TensorBoard's event files into ``log_dir`` (``tensorboard --logdir
    log_dir``); the other ranks write nothing. Scalars, against the global step:

    - ``train/loss`` (the global loss of the step: ``History.losses``), ``train/lr``;
    - ``step_time/measured``: seconds from ``on_step_begin`` to ``on_step_end`` (the
      plan's step, the gather of the loss included; not the reading of the batch
      before it), beside ``step_time/predicted``, the plan's estimate
      (``plan.estimate.step_time``) where the plan has one (an Engine given a
      ``cluster``, or ``auto_mode="full"``), named ``step_time/predicted_uncalibrated``
      where the plan's cluster gives default figures, not measured ones
      (:func:`predicted_tag`);
    - ``throughput/samples_per_second`` and, for batches of token ids,
      ``throughput/tokens_per_second`` (the global batch over the measured step);
    - ``memory/rank<r>``: the bytes each rank held at its step's peak (``History.memory``
      of that rank, gathered to rank 0; ranks beyond the first :data:`MEMORY_RANKS` only
      in ``memory/max``, the highest of them), beside ``memory/predicted``, the plan's
      predicted peak (``plan.estimate.peak_memory``, the highest process's);

    against the epoch, ``epoch/loss`` (the epoch's mean), ``epoch/lr`` and, when fit
    validates, ``epoch/val_loss`` and ``epoch/val_<metric>``; and once, at the first
    step, the plan's ``explain()`` as the text ``plan/explain``. Scalars are written as
    ``torch.utils.tensorboard`` and tensorboardX write them (a summary value's
    ``simple_value``, float32), so every reader of scalars finds them: what
    ``EventAccumulator(log_dir).Scalars("train/loss")`` reads back is ``History.losses``
    rounded to float32.
    Needs the ``tensorboard`` package (``pip install 'distgraph[tensorboard]'``; no
    TensorFlow). A resumed run may write into the same ``log_dir``: its steps go on
    from the checkpoint's.

    Example::

        engine.fit(data, batch_size=16, callbacks=[dg.callbacks.TensorBoard("runs/gpt")])
        # then: tensorboard --logdir runs
    """

    def __init__(self, log_dir):
        self._tb = _tensorboard(f"dg.callbacks.TensorBoard({str(log_dir)!r})")
        self.log_dir = str(log_dir)
        self._writer = None
        self._explained = False
        self._started = None

    def on_train_begin(self, logs=None):
        if self.engine.rank == 0 and self._writer is None:
            self._writer = self._tb.EventFileWriter(self.log_dir)

    def on_step_begin(self, step, logs=None):
        self._started = time.perf_counter()

    def on_step_end(self, step, logs=None):
        seconds = time.perf_counter() - self._started
        peaks = self._peaks(logs.get("memory"))     # every rank takes part
        if self._writer is None:
            return
        plan = self.engine.plan("train")
        self._scalar("train/loss", logs["loss"], step)
        if logs.get("lr") is not None:
            self._scalar("train/lr", logs["lr"], step)
        self._scalar("step_time/measured", seconds, step)
        if plan.estimate is not None:
            self._scalar(predicted_tag(plan), plan.estimate.step_time, step)
        self._scalar("throughput/samples_per_second", logs["batch_size"] / seconds, step)
        if logs.get("tokens"):
            self._scalar("throughput/tokens_per_second", logs["tokens"] / seconds, step)
        if peaks is not None:
            for rank, peak in enumerate(peaks[:MEMORY_RANKS]):
                self._scalar(f"memory/rank{rank}", peak, step)
            self._scalar("memory/max", max(peaks), step)
            if plan.estimate is not None:
                self._scalar("memory/predicted", plan.estimate.peak_memory, step)
        if not self._explained:
            self._explained = True
            # a fenced block: TensorBoard renders text as Markdown
            self._event(step, self._tb.text_pb("plan/explain", f"```\n{plan.explain()}\n```"))

    def on_epoch_end(self, epoch, logs=None):
        if self._writer is None:
            return
        for key, value in (logs or {}).items():
            if key != "epoch" and isinstance(value, (int, float)) and \
                    not isinstance(value, bool):
                self._scalar(f"epoch/{key}", value, epoch)
        self._writer.flush()

    def on_train_end(self, logs=None):
        self.close()

    def close(self):
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _peaks(self, memory) -> list | None:
        """Every rank's peak bytes of the step (``memory``: this rank's), gathered to all
        ranks where there are several; None where the runtime measured none."""
        if memory is None:
            return None
        if self.engine.world_size == 1:
            return [int(memory)]
        import numpy as np          # here: a job's launcher imports this module, not numpy

        world = self.engine.world()
        mine = np.array([memory], dtype=np.int64)
        return [int(v) for v in world.all_gather(mine, tuple(range(world.size)))]

    def _scalar(self, tag: str, value, step: int) -> None:
        # simple_value, not a tensor summary: readers that ask for scalars (the
        # accumulator's Scalars(), pandas exporters, W&B's sync) see only these
        summary = self._tb.summary_pb2.Summary
        self._event(step, summary(value=[summary.Value(tag=tag, simple_value=float(value))]))

    def _event(self, step: int, summary) -> None:
        self._writer.add_event(self._tb.event_pb2.Event(wall_time=time.time(), step=int(step),
                                                        summary=summary))


def _tensorboard(who: str):
    """The parts of the ``tensorboard`` package that write event files (no TensorFlow);
    without it, one DistGraphError naming ``who`` and the extra to install."""
    try:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.plugins.text.summary_v2 import text_pb
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
    except ImportError as e:
        raise DistGraphError(f"{who} writes with the tensorboard package, which is not "
                             f"installed ({e}): {TENSORBOARD_EXTRA}") from None
    return SimpleNamespace(event_pb2=event_pb2, summary_pb2=summary_pb2, text_pb=text_pb,
                           EventFileWriter=EventFileWriter)
