"""Parameters: named, persistent arrays owned by Layers; they become Values when traced."""

from __future__ import annotations

import numpy as np

from distgraph import dtypes
from distgraph.errors import DistGraphError


class Parameter:
    """A trainable array. ``annotation`` holds a ``shard_tensor`` choice (a DistAttr).

    Example::

        w = Parameter(np.zeros((4, 8)))
        w.set_value(np.ones((4, 8)))
        w.numpy().sum()  # 32.0
    """

    def __init__(self, data, dtype: str | None = None, trainable: bool = True):
        dtype = dtypes.canonical(dtype or dtypes.get_default_dtype())
        # np.array, not ascontiguousarray: the latter turns a 0-d array into shape (1,).
        self._data = np.array(data, dtype=dtype, order="C")
        self.trainable = trainable
        self.annotation = None
        self.owner = None          # the Layer it was first assigned to, and as what
        self.attr_name = None

    def describe(self) -> str:
        """How errors name it: ``parameter 'weight' of Linear(16, 64)``; once its model
        was traced, by its path: ``parameter 'fc1.weight' of Linear(16, 64)``."""
        if self.owner is None:
            return "parameter"
        path = self.owner._path
        name = f"{path}.{self.attr_name}" if path else self.attr_name
        return f"parameter {name!r} of {self.owner!r}"

    @property
    def shape(self) -> tuple:
        return tuple(self._data.shape)

    @property
    def dtype(self) -> str:
        return self._data.dtype.name

    def numpy(self) -> np.ndarray:
        """A copy of the current value."""
        return self._data.copy()

    def set_value(self, value) -> None:
        value = np.asarray(value)
        if tuple(value.shape) != self.shape:
            raise DistGraphError(f"set_value: shape {list(value.shape)} does not match the "
                                 f"parameter's shape {list(self.shape)}")
        self._data = np.array(value, dtype=self.dtype, order="C")

    def __repr__(self) -> str:
        return f"Parameter(shape={list(self.shape)}, dtype={self.dtype})"
