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

    def epoch(self, epoch: int):
        order = np.arange(len(self.dataset))
        if self.shuffle:
            order = np.random.default_rng((self.seed, epoch)).permutation(order)
        for b in range(len(self)):
            idx = order[b * self.batch_size:(b + 1) * self.batch_size]
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


class Engine:
    """Builds the training, evaluation and prediction programs of a model and runs them."""

    def __init__(self, model, loss=None, optimizer=None, metrics=None, cluster=None,
                 strategy: Strategy | None = None):
        self.model, self.loss, self.optimizer = model, loss, optimizer
        self.cluster = cluster
        self.strategy = strategy or Strategy()
        self._built: dict[str, BuiltProgram] = {}
        self._runners: dict = {}
        self._scope: dict | None = None
        self._step = 0

    # -- building ---------------------------------------------------------------------------
    def prepare(self, inputs_spec, labels_spec=(), mode="train") -> BuiltProgram:
        """Build (and plan) the program for ``mode`` without running it."""
        built = build_program(self.model, list(inputs_spec), list(labels_spec), self.loss,
                              self.optimizer if mode == "train" else None, mode)
        self._built[mode] = built
        self._runners.pop(mode, None)
        return built

    def _ensure(self, mode, loader: DataLoader):
        if mode not in self._built:
            ins, labels = loader.specs(0 if mode == "predict" else 1)
            self.prepare(ins, labels, mode)
        if mode not in self._runners:
            from distgraph.runtime.executor import ProgramRunner
            built = self._built[mode]
            self._runners[mode] = ProgramRunner(built.program)
        return self._built[mode], self._runners[mode]

    def _scope_for(self, program) -> dict:
        if self._scope is None:
            self._scope = {}
        params = dict(self.model.named_parameters())
        for v in program.persistables:
            if v.name in self._scope:
                continue
            if v.is_parameter:
                self._scope[v.name] = params[v.name]._data
            else:
                self._scope[v.name] = np.zeros(v.shape, dtype=v.dtype)
        return self._scope

    def _sync_model(self) -> None:
        """Parameters are updated in place in the scope; keep the model pointing at them."""
        if self._scope is None:
            return
        for name, p in self.model.named_parameters():
            if name in self._scope:
                p._data = self._scope[name]

    # -- running ------------------------------------------------------------------------------
    def fit(self, train_data, batch_size=1, epochs=1, steps_per_epoch=None, valid_data=None,
            shuffle=False, verbose=0) -> History:
        loader = DataLoader(train_data, batch_size, shuffle, self.strategy.seed)
        built, runner = self._ensure("train", loader)
        scope = self._scope_for(built.program)
        history = History()
        for epoch in range(epochs):
            losses = []
            for b, batch in enumerate(loader.epoch(epoch)):
                if steps_per_epoch is not None and b >= steps_per_epoch:
                    break
                feed = dict(zip(built.feed_names, batch))
                out = runner.run(scope, feed, [built.loss_name], step=self._step)
                self._step += 1
                losses.append(float(out[built.loss_name]))
            self._sync_model()
            history.losses.extend(losses)
            record = {"epoch": epoch, "loss": float(np.mean(losses)) if losses else float("nan")}
            if valid_data is not None:
                record["val_loss"] = self.evaluate(valid_data, batch_size)["loss"]
            history.epochs.append(record)
            if verbose:
                print(" ".join(f"{k}={v:.5g}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in record.items()), flush=True)
        return history

    def evaluate(self, valid_data, batch_size=1) -> dict:
        loader = DataLoader(valid_data, batch_size)
        built, runner = self._ensure("eval", loader)
        scope = self._scope_for(built.program)
        losses = [float(runner.run(scope, dict(zip(built.feed_names, batch)),
                                   [built.loss_name])[built.loss_name])
                  for batch in loader.epoch(0)]
        return {"loss": float(np.mean(losses))}

    def predict(self, test_data, batch_size=1) -> list:
        loader = DataLoader(test_data, batch_size)
        built, runner = self._ensure("predict", loader)
        scope = self._scope_for(built.program)
        results = []
        for batch in loader.epoch(0):
            feed = dict(zip(built.feed_names, batch))
            out = runner.run(scope, feed, built.output_names)
            results.append([out[n] for n in built.output_names])
        return results

    def state_dict(self) -> dict:
        """Global numpy arrays of every parameter (copies)."""
        self._sync_model()
        return {n: p.numpy() for n, p in self.model.named_parameters()}

    def plan(self, mode="train") -> BuiltProgram:
        if mode not in self._built:
            raise DistGraphError(f"no {mode} program yet: call prepare() or fit() first")
        return self._built[mode]
