"""Parameters: named, persistent arrays owned by Layers; they become Values when traced.

A parameter made from an :class:`~distgraph.initializer.Init` under ``dg.LazyGuard()``
is *lazy*: it has a shape and a dtype but no memory. Tracing, planning and estimating
read only those; training materialises each process's own block of it
(:meth:`Parameter.block`), with the numbers eager initialisation gives that block.

Example::

    w = Parameter(np.zeros((4, 8)))
    w.set_value(np.ones((4, 8)))
    w.numpy().sum()  # 32.0

    with LazyGuard():
        big = Parameter.initialized((50_000, 12_288), Init("normal", 0.02, key=1))
    big.shape, big.is_lazy            # ((50000, 12288), True)
    big.block((slice(0, 2), slice(0, 3)))      # a 2 x 3 block, nothing else made
"""

from __future__ import annotations

from contextvars import ContextVar

import numpy as np

from distgraph import dtypes
from distgraph.errors import DistGraphError
from distgraph.initializer import Init

# How many LazyGuard blocks are open in this context. A context variable, like PyTorch's
# and Paddle's guards: what a `with` block sets holds inside it only (threads included).
_LAZY_DEPTH: ContextVar[int] = ContextVar("distgraph_lazy_depth", default=0)


class LazyGuard:
    """Inside ``with dg.LazyGuard():`` layers create shape-only parameters (Paddle's
    LazyGuard): a model too big for one process can be planned, and trained on ranks
    that each materialise only their blocks. The values equal eager initialisation's.

    Example::

        with dg.LazyGuard():
            model = dg.nn.GPT(vocab_size=51200, d_model=12288, n_layer=96, n_head=96,
                              max_seq_len=2048)
    """

    def __enter__(self):
        self._token = _LAZY_DEPTH.set(_LAZY_DEPTH.get() + 1)
        return self

    def __exit__(self, *exc):
        _LAZY_DEPTH.reset(self._token)
        return False


def lazy_mode() -> bool:
    """Whether parameters made now from an initialiser are lazy."""
    return _LAZY_DEPTH.get() > 0


class Parameter:
    """A trainable array. ``annotation`` holds a ``shard_tensor`` choice (a DistAttr).
    See the module docstring for lazy parameters."""

    def __init__(self, data, dtype: str | None = None, trainable: bool = True):
        dtype = dtypes.canonical(dtype or dtypes.get_default_dtype())
        # np.array, not ascontiguousarray: the latter turns a 0-d array into shape (1,).
        self._value = np.array(data, dtype=dtype, order="C")
        self._shape, self._dtype = tuple(self._value.shape), dtype
        self.init = None
        self.trainable = trainable
        self.annotation = None
        self.owner = None          # the Layer it was first assigned to, and as what
        self.attr_name = None

    @classmethod
    def initialized(cls, shape, init: Init, dtype: str | None = None,
                    trainable: bool = True) -> "Parameter":
        """A parameter of ``shape`` made by ``init``: lazy inside ``dg.LazyGuard()``,
        else with its values."""
        dtype = dtypes.canonical(dtype or dtypes.get_default_dtype())
        shape = tuple(int(s) for s in shape)
        if not lazy_mode():
            return cls(init.block(shape, None, dtype), dtype, trainable)
        p = cls.__new__(cls)
        p._value, p._shape, p._dtype, p.init = None, shape, dtype, init
        p.trainable, p.annotation, p.owner, p.attr_name = trainable, None, None, None
        return p

    def describe(self) -> str:
        """How errors name it: by its path in the model and its layer,
        ``parameter 'blocks.0.mlp.fc1.weight' of Linear(64, 256)`` (the path is known
        once the layer is assigned into its model, before any trace)."""
        if self.owner is None:
            return "parameter"
        path = self.owner._model_path()
        name = f"{path}.{self.attr_name}" if path else self.attr_name
        return f"parameter {name!r} of {self.owner!r}"

    @property
    def shape(self) -> tuple:
        return self._shape

    @property
    def dtype(self) -> str:
        return self._dtype

    @property
    def is_lazy(self) -> bool:
        """True while the parameter has no values (made under LazyGuard, not set since)."""
        return self._value is None

    @property
    def source(self):
        """What the values come from now: the array, or the initialiser of a lazy
        parameter (a new object whenever ``set_value`` gives new values)."""
        return self.init if self._value is None else self._value

    @property
    def _data(self) -> np.ndarray:
        if self._value is None:
            raise DistGraphError(
                f"{self.describe()} {list(self._shape)} is lazy (made under dg.LazyGuard()) "
                f"and has no values yet: each rank materialises its own block when the "
                f"Engine trains; read it after training with engine.state_dict(), or "
                f"build the model outside LazyGuard")
        return self._value

    @_data.setter
    def _data(self, array) -> None:
        self._value = array

    def block(self, index=None) -> np.ndarray:
        """The block ``index`` (a tuple of slices; None: everything) as a new array; a
        lazy parameter makes only that block, with eager initialisation's numbers."""
        if self._value is None:
            return self.init.block(self._shape, index, self._dtype)
        return np.array(self._value if index is None else self._value[index], order="C")

    def numpy(self) -> np.ndarray:
        """A copy of the current value."""
        return self._data.copy()

    def set_value(self, value) -> None:
        value = np.asarray(value)
        if tuple(value.shape) != self.shape:
            raise DistGraphError(f"set_value: shape {list(value.shape)} does not match the "
                                 f"shape {list(self.shape)} of {self.describe()}")
        self._value = np.array(value, dtype=self.dtype, order="C")

    def __repr__(self) -> str:
        lazy = ", lazy" if self.is_lazy else ""
        return f"Parameter(shape={list(self.shape)}, dtype={self.dtype}{lazy})"
