"""Paddle's tensor- and sequence-parallel styles: what ``dg.parallelize``'s ``mp_config``
does to the layer (or parameter) a pattern of its ``parallelize_plan`` names.

Each style is a frozen value. Two split parameters over the ``mp`` mesh dim
(distgraph's ``Linear.weight`` is ``[in, out]`` as Paddle's is, and an ``Embedding``'s
``[vocab, hidden]``):

============================  =====================================  ===================
style                         weight (2-d; stacked experts: the last  bias
                              two dims)
============================  =====================================  ===================
``ColWiseParallel()``         output features: ``[None, "mp"]``       ``["mp"]``
                              (an Embedding: its hidden dim)
``RowWiseParallel()``         input features: ``["mp", None]``        whole
                              (an Embedding: its vocabulary)
============================  =====================================  ===================

Four say how the activations between tensor-parallel layers are laid out: Megatron's
sequence parallelism, the sequence (dim 1 of ``[batch, seq, hidden]``) split over
``mp`` where the layers between the tensor-parallel regions run (norms, residual adds):

- ``SequenceParallelBegin()``: on the last layer before that region (an embedding): its
  output split over the sequence.
- ``SequenceParallelEnd()``: on the first layer after it (the LM head): its input
  gathered whole.
- ``SequenceParallelEnable()``: on a layer inside it (a norm): its input and output
  split over the sequence.
- ``SequenceParallelDisable()``: on a tensor-parallel layer inside it (an attention or
  MLP block): its input gathered whole, its output split over the sequence again (its
  row-split layer's pending sum is then reduce-scattered, not all-reduced).

Paddle transposes activations to ``[seq, batch, hidden]`` for its kernels
(``need_transpose``); distgraph's stay ``[batch, seq, hidden]`` and the split is of dim 1,
so the styles take no such argument. The batch dim stays split over the data-parallel
mesh dims (``dp``, ``ep``) in every annotation a style makes.

Example::

    plan = {"blocks.*.mlp.fc1": dg.ColWiseParallel(), "blocks.*.mlp.fc2": dg.RowWiseParallel(),
            "blocks.*.ln2": dg.SequenceParallelEnable()}
    dg.parallelize(model, mesh, {"mp_config": {"parallelize_plan": plan}})
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from distgraph.errors import DistGraphError

# what a style asks of a layer's first input or output (None: nothing):
SEQUENCE = "sequence"       # dim 1 split over mp
WHOLE = "whole"             # not split over mp
FEATURES = "features"       # the last dim split over mp (a row-split layer's input)


@dataclass(frozen=True)
class ParallelStyle:
    """The base of the styles. ``param_spec`` gives a parameter's spec over the mesh dim
    ``dim`` (None: the style leaves parameters alone); ``input``/``output`` what the
    style asks of a layer's first input and output (:data:`SEQUENCE`, :data:`WHOLE`,
    :data:`FEATURES` or None)."""

    input = None
    output = None
    splits = False          # whether it splits the parameters of what it names
    # how the output gets its layout: moved there after the layer (a reshard, Paddle's
    # post-hook), or made so by the layer's own ops (it runs on the split it reads)
    output_moved = True

    def param_spec(self, shape, dim: str):
        return None

    def __str__(self) -> str:
        return f"{type(self).__name__}()"


@dataclass(frozen=True)
class ColWiseParallel(ParallelStyle):
    """Split a Linear's output features (weight ``[None, "mp"]``, bias ``["mp"]``), an
    Embedding's hidden dim, a stacked ``[E, in, out]`` weight's ``out``.
    ``gather_output``: the layer's output gathered whole over ``mp`` (Paddle's)."""

    gather_output: bool = False
    splits = True

    def __post_init__(self):
        if not isinstance(self.gather_output, bool):
            raise DistGraphError(f"ColWiseParallel(gather_output={self.gather_output!r}): "
                                 "give True or False")

    @property
    def output(self):
        return WHOLE if self.gather_output else None

    def param_spec(self, shape, dim: str):
        # S(out): the output features; a bias (1-d) is split as they are
        return [None] * (len(shape) - 1) + [dim]

    def __str__(self) -> str:
        return "ColWiseParallel(gather_output=True)" if self.gather_output else \
            "ColWiseParallel()"


@dataclass(frozen=True)
class RowWiseParallel(ParallelStyle):
    """Split a Linear's input features (weight ``["mp", None]``, the bias whole), an
    Embedding's vocabulary, a stacked ``[E, in, out]`` weight's ``in``.
    ``is_input_parallel`` (Paddle's): True, the input comes split over its features
    (from a column-split layer before it); False, it comes whole and is split on its
    last dim where the layer reads it (a local slice, no message)."""

    is_input_parallel: bool = True
    splits = True

    def __post_init__(self):
        if not isinstance(self.is_input_parallel, bool):
            raise DistGraphError(f"RowWiseParallel(is_input_parallel="
                                 f"{self.is_input_parallel!r}): give True or False")

    @property
    def input(self):
        return None if self.is_input_parallel else FEATURES

    def param_spec(self, shape, dim: str):
        if len(shape) < 2:          # a row-split layer's bias is added once: whole
            return [None] * len(shape)
        return [None] * (len(shape) - 2) + [dim, None]

    def __str__(self) -> str:
        return "RowWiseParallel()" if self.is_input_parallel else \
            "RowWiseParallel(is_input_parallel=False)"


@dataclass(frozen=True)
class SequenceParallelBegin(ParallelStyle):
    """The last layer before the sequence-parallel region: its output split over the
    sequence on ``mp``."""

    output = SEQUENCE


@dataclass(frozen=True)
class SequenceParallelEnd(ParallelStyle):
    """The first layer after the sequence-parallel region: its input gathered whole."""

    input = WHOLE


@dataclass(frozen=True)
class SequenceParallelEnable(ParallelStyle):
    """A layer run on the sequence split over ``mp`` (a norm): its input split over the
    sequence, and so its output, which it makes so."""

    input = SEQUENCE
    output = SEQUENCE
    output_moved = False


@dataclass(frozen=True)
class SequenceParallelDisable(ParallelStyle):
    """A tensor-parallel layer inside the sequence-parallel region: its input gathered
    whole, its output split over the sequence again."""

    input = WHOLE
    output = SEQUENCE


class SplitPoint(enum.Enum):
    """Paddle's split points of ``pp_config["split_spec"]`` as a dict: ``{layer path:
    SplitPoint.END}`` ends a stage after that layer, ``SplitPoint.BEGINNING`` begins one
    at it."""

    BEGINNING = 0
    END = 1
