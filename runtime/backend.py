"""The runtime's array backend: one object that says how arrays are made, copied, cut
and brought to the host, so that communicators, reshard execution, the SPMD runner and
the pipeline actors never call numpy directly.

A backend has ``xp`` (the array namespace kernels use: numpy, or cupy on a GPU) and the
handful of operations the runtime needs around kernels. :data:`NUMPY` is the CPU backend;
:func:`get_backend` returns a backend by name (``"numpy"``, or ``"cupy"``, which needs
CuPy and a CUDA device), so a GPU backend plugs in without touching the scheduler;
:func:`backend_for` gives the backend a rank of a plan computes with (CuPy on its GPU when
the plan's devices are GPUs).

Example::

    from distgraph.runtime.backend import get_backend
    xb = get_backend("numpy")
    buf = xb.zeros((2, 3), "float64")
    host = xb.to_host(buf)                 # a numpy array whatever the backend
"""

from __future__ import annotations

import numpy as np

from distgraph.errors import RuntimeFault
from distgraph.resources.gpus import NoGPU, gpu_count, import_cupy


class ArrayBackend:
    """Array operations over the namespace ``xp`` (numpy's API; CuPy mirrors it)."""

    name = "numpy"

    def __init__(self, xp=np):
        self.xp = xp

    def __repr__(self) -> str:
        return f"<ArrayBackend {self.name}>"

    # -- making arrays ----------------------------------------------------------------
    def asarray(self, a, dtype=None):
        """``a`` as an array of this backend (no copy when it already is one)."""
        return self.xp.asarray(a, dtype=dtype)

    def from_host(self, a, dtype=None):
        """A C-contiguous array of this backend holding host array ``a``'s values (on the
        numpy backend ``a`` itself when it already is one; 0-d arrays stay 0-d)."""
        return self.contiguous(self.xp.asarray(a, dtype=dtype))

    def zeros(self, shape, dtype):
        return self.xp.zeros(tuple(shape), dtype=dtype)

    def empty(self, shape, dtype):
        return self.xp.empty(tuple(shape), dtype=dtype)

    def zeros_like(self, a):
        return self.xp.zeros_like(a)

    # -- copies and layout --------------------------------------------------------------
    def copy(self, a):
        """A C-contiguous copy (0-d arrays stay 0-d)."""
        return self.xp.array(a, copy=True, order="C")

    def contiguous(self, a):
        """``a`` itself when C-contiguous, else a C-contiguous copy (0-d stays 0-d)."""
        if a.flags.c_contiguous:
            return a
        return self.xp.array(a, copy=True, order="C")

    def to_host(self, a) -> np.ndarray:
        """A numpy array with ``a``'s values (``a`` itself on the numpy backend)."""
        return np.asarray(a)

    # -- cutting and joining ------------------------------------------------------------
    def split(self, a, n: int, axis: int) -> list:
        return self.xp.split(a, n, axis=axis)

    def chunk(self, a, n: int, axis: int, index: int):
        """The ``index``-th of ``n`` equal chunks of ``a`` along ``axis``, C-contiguous."""
        return self.contiguous(self.xp.split(a, n, axis=axis)[index])

    def concatenate(self, arrays, axis: int):
        return self.xp.concatenate(list(arrays), axis=axis)

    def stack(self, arrays):
        return self.xp.stack(list(arrays))

    def chunks(self, a, n: int, axis: int):
        """``a``'s ``n`` equal chunks along ``axis``, stacked on a new leading axis (the
        send buffer of a reduce-scatter): a view of C-contiguous ``a`` when no axis before
        ``axis`` is longer than 1, else a copy."""
        if a.flags.c_contiguous and all(d == 1 for d in a.shape[:axis]):
            shape = a.shape[:axis] + (a.shape[axis] // n,) + a.shape[axis + 1:]
            return a.reshape((n,) + shape)
        return self.stack(self.split(a, n, axis))

    def joined(self, stacked, axis: int):
        """The arrays stacked on ``stacked``'s leading axis concatenated along ``axis``
        (of each): a view when no axis before ``axis`` is longer than 1, else a copy."""
        parts = stacked.shape[1:]
        if stacked.flags.c_contiguous and all(d == 1 for d in parts[:axis]):
            return stacked.reshape(parts[:axis] + (stacked.shape[0] * parts[axis],)
                                   + parts[axis + 1:])
        return self.concatenate(list(stacked), axis=axis)

    def dtype(self, d):
        return np.dtype(d)

    def reducer(self, op: str):
        """The ufunc of a reduction (``sum``, ``max``, ``min``) with ``out=`` support."""
        try:
            return {"sum": self.xp.add, "max": self.xp.maximum, "min": self.xp.minimum}[op]
        except KeyError:
            raise RuntimeFault(f"unknown reduction {op!r}; use sum, max or min") from None

    def nbytes(self, a) -> int:
        return int(a.nbytes)

    def address(self, a) -> int:
        """Where ``a``'s first element lies in memory (two views of the same bytes share
        it; the runtime's memory count tells them apart by it)."""
        return int(a.__array_interface__["data"][0])

    def writeable(self, a) -> bool:
        """Whether ``a`` may be written (numpy marks read-only views; CuPy has none)."""
        return bool(a.flags.writeable)

    def synchronize(self) -> None:
        """Wait until the work queued on this backend's device is done (for timing)."""


class CupyBackend(ArrayBackend):
    """CuPy arrays on CUDA device ``device`` (an ordinal among the visible GPUs, a
    device's ``local_id``), made current for this process; ``to_host`` copies to numpy.
    ``what`` names who asks, for the one-line error when CuPy or the GPU is missing."""

    name = "cupy"

    def __init__(self, device: int = 0, what: str = "the cupy backend"):
        cupy = import_cupy(what)
        count = gpu_count(what)
        if not 0 <= device < count:
            raise NoGPU(f"{what} needs CUDA device {device}, but this machine has {count} "
                        f"GPU(s) (devices 0-{count - 1}); give the ranks' devices local ids "
                        f"below {count} in the cluster file")
        super().__init__(cupy)
        self.device = cupy.cuda.Device(device)
        self.device.use()

    def __repr__(self) -> str:
        return f"<ArrayBackend cupy on GPU {self.device.id}>"

    def to_host(self, a) -> np.ndarray:
        if isinstance(a, np.ndarray):
            return a
        return self.xp.asnumpy(a)

    def writeable(self, a) -> bool:
        return True

    def address(self, a) -> int:
        if isinstance(a, np.ndarray):
            return super().address(a)
        return int(a.data.ptr)

    def synchronize(self) -> None:
        self.xp.cuda.get_current_stream().synchronize()


NUMPY = ArrayBackend(np)


def get_backend(name: str = "numpy") -> ArrayBackend:
    """The backend called ``name``: ``"numpy"`` (CPU) or ``"cupy"`` (GPU)."""
    if name == "numpy":
        return NUMPY
    if name == "cupy":
        return CupyBackend()
    raise RuntimeFault(f"unknown array backend {name!r}; use 'numpy' or 'cupy'")


def backend_for(devices, rank: int) -> ArrayBackend:
    """The backend rank ``rank`` of a plan computes with: numpy, or CuPy on the GPU its
    device's ``local_id`` names (``devices``: the plan's
    :class:`~distgraph.plan.devices.DeviceAssignment`; None: numpy). Without CuPy or
    that GPU, one :class:`~distgraph.resources.gpus.NoGPU` line saying which."""
    if devices is None or devices.backend == "numpy":
        return NUMPY
    device = devices.device(rank)
    return CupyBackend(device.local_id, f"rank {rank} of this plan (on {device})")


def backend_of(obj) -> ArrayBackend:
    """The backend an object (a communicator, a runner) works with: its ``backend``
    attribute, numpy when it has none (or is None)."""
    return getattr(obj, "backend", None) or NUMPY
