"""Parameter initialisers whose values are a function of (key, element index).

An :class:`Init` describes how a parameter's numbers are made (normal, uniform or
constant) and carries a 64-bit ``key`` drawn from ``dg.seed``'s generator when the
parameter is created. Element ``i`` (row-major flat index of the global tensor) takes
its value from positions ``2i`` and ``2i + 1`` (normal: Box-Muller) or ``i`` (uniform)
of the Philox stream of that key. Philox is counter-based: any position is reached
without drawing the ones before it, so :meth:`Init.block` makes any block of the tensor
alone, and the block equals the same slice of the whole tensor, bit for bit. Eager
parameters are made by the same function on the whole tensor, so a model built under
``dg.LazyGuard`` and materialised block by block on each rank holds exactly the numbers
the eagerly built model holds (same seed, same order of construction).

Example::

    init = Init("normal", 0.02, key=7)
    whole = init.block((4, 6), None, "float64")
    part = init.block((4, 6), (slice(0, 4), slice(3, 6)), "float64")
    (part == whole[:, 3:6]).all()       # True
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

KINDS = ("normal", "uniform", "constant")
# Values are made in pieces of at most this many elements, so that the temporaries of a
# large block stay small next to the block itself.
CHUNK = 1 << 16


@dataclass(frozen=True)
class Init:
    """``normal``: N(0, scale²); ``uniform``: U(-scale, scale); ``constant``: every
    element ``scale``. ``key`` selects the Philox stream (unused by ``constant``)."""

    kind: str
    scale: float
    key: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Init kind must be one of {KINDS}, got {self.kind!r}")

    def block(self, shape, index, dtype: str) -> np.ndarray:
        """The block ``index`` (a tuple of slices with step 1, or None for the whole
        tensor) of the tensor of global ``shape``, as a new C-contiguous array of
        ``dtype``."""
        shape = tuple(int(s) for s in shape)
        index = _full(shape) if index is None else tuple(index)
        local = tuple(s.stop - s.start for s in index)
        if self.kind == "constant":
            return np.full(local, self.scale, dtype=dtype)
        out = np.empty(local, dtype=dtype)
        flat = out.reshape(-1)
        written = 0
        for span, runs in _spans(_runs(shape, index)):
            values = self._values(span, runs[-1][0] + runs[-1][1] - span)
            for start, count in runs:
                flat[written:written + count] = values[start - span:start - span + count]
                written += count
        return out

    def _values(self, first: int, n: int) -> np.ndarray:
        """Elements ``first .. first + n - 1`` of the flat tensor, as float64."""
        if self.kind == "uniform":
            return (2.0 * _uniforms(self.key, first, n) - 1.0) * self.scale
        u = _uniforms(self.key, 2 * first, 2 * n).reshape(n, 2)
        radius = np.sqrt(-2.0 * np.log1p(-u[:, 0]))        # 1 - u in (0, 1]
        return radius * np.cos(2.0 * math.pi * u[:, 1]) * self.scale


def _uniforms(key: int, position: int, n: int) -> np.ndarray:
    """Positions ``position .. position + n - 1`` of key's Philox stream as doubles in
    [0, 1) (the top 53 bits of each 64-bit word)."""
    # Philox makes four 64-bit words per counter value: start at the counter of
    # ``position`` and drop the words before it.
    bits = np.random.Philox(key=key, counter=position // 4)
    skip = position % 4
    raw = bits.random_raw(n + skip)[skip:]
    return (raw >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)


def _spans(runs):
    """Runs grouped into spans of at most CHUNK elements, each made in one piece: (span
    start, runs inside it). Short runs (a column block's rows) share a span, as making
    the few values between them is cheaper than starting the stream once per run; a
    long run is cut into pieces of CHUNK."""
    group, first = [], 0
    for start, count in runs:
        while count > CHUNK:
            if group:
                yield first, group
                group = []
            yield start, [(start, CHUNK)]
            start, count = start + CHUNK, count - CHUNK
        if group and start + count - first > CHUNK:
            yield first, group
            group = []
        if not group:
            first = start
        group.append((start, count))
    if group:
        yield first, group


def _full(shape) -> tuple:
    return tuple(slice(0, s) for s in shape)


def _runs(shape, index):
    """(flat start, length) of the contiguous runs of block ``index``, in row-major
    order: the block's last dims that are whole merge into one run."""
    ndim = len(shape)
    inner = ndim                   # dims inner..ndim-1 are whole except possibly inner-1
    while inner > 0 and (index[inner - 1].start, index[inner - 1].stop) == (0, shape[inner - 1]):
        inner -= 1
    strides = [1] * ndim
    for d in range(ndim - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    if inner == 0:
        yield 0, math.prod(shape)
        return
    d = inner - 1                  # the innermost dim that is cut: runs span it
    length = (index[d].stop - index[d].start) * strides[d]
    outer = [range(index[k].start, index[k].stop) for k in range(d)]
    for coords in _product(outer):
        start = sum(c * strides[k] for k, c in enumerate(coords)) + index[d].start * strides[d]
        yield start, length


def _product(ranges):
    if not ranges:
        yield ()
        return
    for head in ranges[0]:
        for tail in _product(ranges[1:]):
            yield (head,) + tail
