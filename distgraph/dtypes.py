"""Data types: names, the default floating dtype, and the seeded parameter generator.

``dg.set_default_dtype("float64")`` switches new parameters and floating inputs to
float64; it is the one process-wide setting distgraph has, as in PyTorch and Paddle.
``dg.seed(n)`` re-seeds the generator that draws each new parameter's initialiser key
(:mod:`distgraph.initializer`) and each Dropout layer's seed.

The 16-bit dtypes ``bfloat16`` (numpy's through ``ml_dtypes``) and ``float16`` hold
values as any other; the runtime computes a kernel whose operands are 16-bit in float32
and rounds its results back (numpy has no 16-bit BLAS). Mixed-precision training is
``Strategy(amp=...)`` (float32 master weights, :mod:`distgraph.optim.amp`); a lazy model
built with ``set_default_dtype("bfloat16")`` plans 16-bit parameters with float32 master
copies in the optimizer, as large-scale training stores them.
"""

from __future__ import annotations

import ml_dtypes  # noqa: F401  (registers numpy's "bfloat16")
import numpy as np

from distgraph.errors import DistGraphError

HALF_DTYPES = ("bfloat16", "float16")
FLOAT_DTYPES = HALF_DTYPES + ("float32", "float64")
INT_DTYPES = ("int32", "int64")
DTYPES = FLOAT_DTYPES + INT_DTYPES + ("bool", "uint8")

_settings = {"dtype": "float32", "rng": np.random.default_rng(0)}


# Other names people give the 16-bit dtypes.
_ALIASES = {"half": "float16", "fp16": "float16", "bf16": "bfloat16"}
# Bytes per element of the dtypes numpy does not have.
_ITEMSIZE = {"bfloat16": 2}


def set_default_dtype(dtype: str) -> None:
    """Set the floating dtype of new parameters and of InputSpecs that name none:
    float32, float64, or for planning lazy models bfloat16 / float16."""
    dtype = canonical(dtype)
    if dtype not in FLOAT_DTYPES:
        raise DistGraphError(f"default dtype must be float32 or float64 (or bfloat16 / "
                             f"float16 to plan lazy models), got {dtype!r}")
    _settings["dtype"] = dtype


def get_default_dtype() -> str:
    return _settings["dtype"]


def seed(value: int) -> None:
    """Re-seed the generator used to initialise parameters (``dg.seed(0)``)."""
    _settings["rng"] = np.random.default_rng(value)


def param_rng() -> np.random.Generator:
    return _settings["rng"]


def canonical(dtype) -> str:
    """Normalise a dtype given as str, numpy dtype or type to its name, e.g. 'float32'."""
    if isinstance(dtype, str):
        key = _ALIASES.get(dtype.lower(), dtype.lower())
        if key in _ITEMSIZE:
            return key
    try:
        name = np.dtype(dtype).name if not isinstance(dtype, str) else str(np.dtype(dtype))
    except TypeError:
        raise DistGraphError(f"unsupported dtype {dtype!r}; expected one of "
                             f"{', '.join(DTYPES)}") from None
    if name not in DTYPES:
        raise DistGraphError(f"unsupported dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    return name


def is_float(dtype: str) -> bool:
    return dtype in FLOAT_DTYPES


def is_integer(dtype: str) -> bool:
    return np.issubdtype(np.dtype(dtype), np.integer)


def itemsize(dtype: str) -> int:
    return _ITEMSIZE.get(dtype) or np.dtype(dtype).itemsize


def numpy_dtype(dtype: str) -> np.dtype:
    """numpy's dtype of a dtype name (``bfloat16`` too)."""
    return np.dtype(dtype)
