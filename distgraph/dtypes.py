"""Data types: names, the default floating dtype, and the seeded parameter generator.

``dg.set_default_dtype("float64")`` switches new parameters and floating inputs to
float64; it is the one process-wide setting distgraph has, as in PyTorch and Paddle.
``dg.seed(n)`` re-seeds the generator that initialises parameters.
"""

from __future__ import annotations

import numpy as np

from distgraph.errors import DistGraphError

FLOAT_DTYPES = ("float16", "float32", "float64")
INT_DTYPES = ("int32", "int64")
DTYPES = FLOAT_DTYPES + INT_DTYPES + ("bool", "uint8")

_settings = {"dtype": "float32", "rng": np.random.default_rng(0)}


# Half-precision names people reach for when they want mixed precision.
_HALF = ("float16", "half", "fp16", "bfloat16", "bf16")


def set_default_dtype(dtype: str) -> None:
    """Set the floating dtype of new parameters and of InputSpecs that name none."""
    if str(dtype).lower() in _HALF:
        raise DistGraphError(f"set_default_dtype({dtype!r}): mixed / half precision is not "
                             f"offered: the numpy backend computes in float32 or float64 "
                             f"only; use 'float32' (or 'float64' for exact comparisons)")
    dtype = canonical(dtype)
    if dtype not in ("float32", "float64"):
        raise DistGraphError(f"default dtype must be float32 or float64, got {dtype!r}")
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
    if isinstance(dtype, str) and dtype.lower() in ("bfloat16", "bf16"):
        raise DistGraphError(f"unsupported dtype {dtype!r}: numpy has no bfloat16, and mixed "
                             f"precision is not offered; use float32 or float64")
    name = np.dtype(dtype).name if not isinstance(dtype, str) else str(np.dtype(dtype))
    if name not in DTYPES:
        raise DistGraphError(f"unsupported dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    return name


def is_float(dtype: str) -> bool:
    return dtype in FLOAT_DTYPES


def is_integer(dtype: str) -> bool:
    return np.issubdtype(np.dtype(dtype), np.integer)


def itemsize(dtype: str) -> int:
    return np.dtype(dtype).itemsize
