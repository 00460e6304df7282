"""Evaluation metrics: accumulate over the batches of an evaluation, then report.

A metric sees each batch's *global* model outputs and labels (the same on every rank),
so its result is identical on every rank whatever the plan. ``Engine(metrics=[...])``
makes ``evaluate`` (and the validation of ``fit``, as ``val_<name>``) report them beside
the loss; ``evaluate(data, metrics=[...])`` overrides them for one call.

Example::

    engine = dg.Engine(model, dg.nn.CrossEntropyLoss(), dg.optim.AdamW(1e-3),
                       metrics=[dg.metrics.Accuracy()])
    engine.evaluate(valid_data, batch_size=16)      # {"loss": 0.41, "accuracy": 0.88}
"""

from __future__ import annotations

import numpy as np

from distgraph.errors import DistGraphError


class Metric:
    """Base: ``name``; ``reset()``; ``update(outputs, labels)`` with lists of global
    arrays (the model's outputs, the label fields); ``result() -> float``."""

    name = "metric"

    def reset(self) -> None:
        raise NotImplementedError

    def update(self, outputs: list, labels: list) -> None:
        raise NotImplementedError

    def result(self) -> float:
        raise NotImplementedError


class Accuracy(Metric):
    """Fraction of positions whose label is among the ``topk`` largest entries of the
    first output's last axis. Labels are class ids (one fewer axis than the output) or
    one-hot / probability rows (same shape as the output; their argmax is the class).

    Example::

        acc = Accuracy(); acc.reset()
        acc.update([np.array([[0.1, 0.9], [0.8, 0.2]])], [np.array([1, 1])])
        acc.result()      # 0.5
    """

    def __init__(self, topk: int = 1, name: str | None = None):
        if int(topk) < 1:
            raise DistGraphError(f"Accuracy topk must be >= 1, got {topk}")
        self.topk = int(topk)
        self.name = name or ("accuracy" if self.topk == 1 else f"top{self.topk}_accuracy")
        self.reset()

    def reset(self):
        self.correct, self.total = 0, 0

    def update(self, outputs, labels):
        scores, label = np.asarray(outputs[0]), np.asarray(labels[0])
        if label.shape == scores.shape:
            label = np.argmax(label, axis=-1)
        if label.shape != scores.shape[:-1]:
            raise DistGraphError(f"Accuracy: labels of shape {list(label.shape)} fit neither "
                                 f"the output's shape {list(scores.shape)} without its last "
                                 f"axis (class ids) nor the output's shape (one-hot)")
        if self.topk == 1:
            hit = np.argmax(scores, axis=-1) == label
        else:
            top = np.argpartition(-scores, self.topk - 1, axis=-1)[..., :self.topk]
            hit = np.any(top == label[..., None], axis=-1)
        self.correct += int(np.count_nonzero(hit))
        self.total += int(hit.size)

    def result(self):
        if self.total == 0:
            raise DistGraphError("Accuracy.result() before any update()")
        return self.correct / self.total


def as_metrics(metrics) -> list:
    """A list of Metric objects from None, one Metric or a sequence of them."""
    if metrics is None:
        return []
    if isinstance(metrics, Metric):
        return [metrics]
    out = list(metrics)
    for m in out:
        if not isinstance(m, Metric):
            raise DistGraphError(f"metrics must be dg.metrics.Metric objects (e.g. "
                                 f"dg.metrics.Accuracy()), got {m!r}")
    names = [m.name for m in out]
    if len(set(names)) != len(names) or "loss" in names:
        raise DistGraphError(f"metric names must be distinct and not 'loss', got {names}")
    return out
