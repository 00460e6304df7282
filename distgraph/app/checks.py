"""Checks the Engine makes on what users give it and on what training produces.

- :func:`check_fields`: a sample's fields (inputs, then labels) must match the
  arguments of the model's forward (:func:`forward_inputs`: how many it can take);
- :func:`stack_batch` / :func:`stack_field`: samples of a batch must have the same
  fields of equal shapes (the error names the sample indices and shapes, not numpy's
  bare message);
- :class:`FeedCheck`: labels and embedding ids fed straight to the loss / an embedding
  must be in range (the error names the dataset sample, the position, the value and the
  range), the same on every rank as in a serial run;
- :func:`check_finite`: a NaN or infinite loss stops training with a RuntimeFault
  naming the step (the loss is global, so every rank stops at the same step);
- :func:`collective`: Engine methods that are collective check that every rank is in
  the same call (see ``Communicator.collective_call``).

Example::

    check = FeedCheck(built.program)
    check({"label_0": labels}, {"label_0": ([8, 9, 10, 11], ())}, epoch=0, batch=1)
"""

from __future__ import annotations

import functools
import inspect
import math
import os

import numpy as np

from distgraph.errors import DistGraphError, RuntimeFault
from distgraph.ops.nn_ops import IGNORE_INDEX, OutOfRange, check_range
from distgraph.runtime.comm.base import DETAIL_SEP


def forward_inputs(model) -> int | None:
    """The most inputs the model's forward takes positionally; None where it takes any
    number (``*args``, a ``shard_op`` wrapper) or its signature cannot be read."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None
    kinds = inspect.Parameter
    if any(p.kind == kinds.VAR_POSITIONAL for p in sig.parameters.values()):
        return None
    return sum(p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
               for p in sig.parameters.values())


def check_fields(model, n_fields: int, n_labels: int) -> None:
    """Raise DistGraphError unless the model's forward takes the ``n_fields - n_labels``
    inputs a sample gives (the last ``n_labels`` fields are labels)."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):      # a forward inspect cannot read: nothing to check
        return
    kinds = inspect.Parameter
    positional = [p for p in sig.parameters.values()
                  if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    varargs = any(p.kind == kinds.VAR_POSITIONAL for p in sig.parameters.values())
    n_in = n_fields - n_labels
    if len(required) <= n_in and (varargs or n_in <= len(positional)):
        return
    names = ", ".join(p.name for p in positional) + (", *args" if varargs else "")
    takes = (f"{len(required)} to {len(positional)}" if len(required) < len(positional)
             else str(len(positional)))
    labels = ("the last is the label" if n_labels == 1 else
              f"the last {n_labels} are labels" if n_labels else "none is a label")
    want = len(required) or 1
    raise DistGraphError(f"dataset samples have {n_fields} field(s) ({labels}), so the model "
                         f"gets {n_in} input(s), but {type(model).__name__}.forward({names}) "
                         f"takes {takes}: return samples of {want} input{'s' * (want > 1)}"
                         f"{', then the label' if n_labels else ''}")


def stack_batch(samples: list, indices, integer=()) -> list:
    """Stack the fields of ``samples`` (dataset items ``indices``) into batch arrays;
    ``integer``: the fields that hold integers (see :func:`stack_field`)."""
    fields = [[np.asarray(f) for f in s] for s in samples]
    check_field_counts(fields, indices)
    return [stack_field([s[k] for s in fields], indices, k, k in integer)
            for k in range(len(fields[0]))]


def check_field_counts(samples: list, indices) -> None:
    """Every sample (its fields, dataset item ``indices[i]``) has the first one's fields."""
    first = samples[0]
    for i, s in zip(indices, samples):
        if len(s) != len(first):
            raise DistGraphError(f"dataset sample {int(i)} has {len(s)} fields but sample "
                                 f"{int(indices[0])} has {len(first)}; every sample needs the "
                                 "same fields (inputs, then labels)")


def stack_field(arrays: list, indices, k: int, integer: bool = False):
    """Field ``k`` of the samples ``indices`` (``arrays``, one per sample) as one batch
    array; they must have equal shapes. ``integer``: the field holds integers (ids,
    labels: the dataset's first sample has them so), so every value must be a whole
    finite number, whatever dtype a sample gives it in."""
    first = arrays[0]
    for i, a in zip(indices, arrays):
        if a.shape != first.shape:
            raise DistGraphError(f"dataset sample {int(i)} field {k} has shape "
                                 f"{list(a.shape)} but sample {int(indices[0])} has "
                                 f"{list(first.shape)}; samples of a batch must have equal "
                                 "shapes (pad or crop them)")
    batch = np.stack(arrays)
    if integer and np.issubdtype(batch.dtype, np.inexact):
        bad = ~np.isfinite(batch) | (batch != np.round(batch))
        if bad.any():
            row, *at = (int(x) for x in np.argwhere(bad)[0])
            raise DistGraphError(f"dataset sample {int(indices[row])} field {k}"
                                 f"{f' at position {at}' if at else ''} is "
                                 f"{batch[(row, *at)]}, but field {k} holds integers (ids or "
                                 f"labels, as in dataset sample 0): fix or drop that sample")
    return batch


class FeedCheck:
    """The valid ranges of the integer feeds of ``program`` that an embedding or the
    softmax cross-entropy consumes directly; calling it checks a batch."""

    def __init__(self, program):
        self.ranges: dict[str, list] = {}
        feeds = {v.name for v in program.inputs}
        for op in program.ops:
            if op.type == "embedding" and op.inputs[0].name in feeds:
                where = f"embedding{_layer(op)} with {op.inputs[1].shape[0]} rows"
                self._add(op.inputs[0].name, "id", op.inputs[1].shape[0], None, where)
            elif op.type == "softmax_cross_entropy" and op.inputs[1].name in feeds:
                ignore = op.attrs.get("ignore_index", IGNORE_INDEX)
                where = (f"cross-entropy{_layer(op)} over {op.inputs[0].shape[-1]} classes "
                         f"(ignore_index={ignore})")
                self._add(op.inputs[1].name, "label", op.inputs[0].shape[-1], ignore, where)

    def _add(self, feed, what, high, allowed, where):
        self.ranges.setdefault(feed, []).append((what, high, allowed, where))

    def __call__(self, feed: dict, samples: dict, epoch: int, batch: int) -> None:
        """Check the inputs of ``feed`` this process reads. ``samples[name]`` says what
        ``feed[name]`` holds: (the dataset items of its rows, in order; its slices of
        each sample's dims, whose starts place a position in the sample)."""
        for name, checks in self.ranges.items():
            if name not in feed:
                continue
            values, (sample_indices, cut) = np.asarray(feed[name]), samples[name]
            for what, high, allowed, where in checks:
                try:
                    check_range(np, values, 0, high, what, allowed)
                except OutOfRange as e:
                    row, rest = e.position[0], list(e.position[1:])
                    for d, part in enumerate(cut[:len(rest)]):
                        rest[d] += part.start or 0
                    at = f" at position {rest}" if rest else ""
                    raise RuntimeFault(
                        f"epoch {epoch}, batch {batch}: dataset sample "
                        f"{int(sample_indices[row])}: {name}{at} is {e.value}, outside "
                        f"[0, {high}) for the {where}") from None


def _layer(op) -> str:
    return f" '{op.layer}'" if op.layer else ""


def check_finite(loss: float, step: int, epoch: int, batch: int) -> None:
    """Stop training on a NaN or infinite loss (the same global loss on every rank)."""
    if not math.isfinite(loss):
        raise RuntimeFault(f"step {step} (epoch {epoch}, batch {batch}): the loss is {loss}; "
                           "training stopped after this step's update. Look for the cause "
                           "(inputs, learning rate, a log or division of 0), or pass "
                           "Strategy(check_finite=False) to train on")


def collective(name: str, alike: tuple = ()):
    """Decorate an Engine method that every rank must call: when the Engine runs
    distributed, the ranks check that they are all in ``name``, with the same values of
    the arguments named in ``alike`` (a dataset stands for its length), before it runs."""

    def wrap(method):
        signature = inspect.signature(method)

        def detail(engine, args, kwargs) -> str:
            bound = signature.bind(engine, *args, **kwargs)
            bound.apply_defaults()
            return DETAIL_SEP.join(f"{a}={_alike(bound.arguments[a])}" for a in alike)

        @functools.wraps(method)
        def run(engine, *args, **kwargs):
            # the first call of a job makes its communicator: it is checked too
            comm = engine._comm if engine._comm is not None or engine.world_size == 1 \
                else engine.world()
            if comm is None or not hasattr(comm, "collective_call"):
                return method(engine, *args, **kwargs)
            with comm.collective_call(name, detail(engine, args, kwargs) if alike else ""):
                return method(engine, *args, **kwargs)
        return run
    return wrap


def _alike(value) -> str:
    """How the collective check shows an argument: a dataset by its length."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return repr(list(value))              # input_keys
    try:
        return f"{len(value)} samples"
    except TypeError:
        return type(value).__name__
