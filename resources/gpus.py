"""This machine's CUDA GPUs, as CuPy sees them: how many, and what each is.

:func:`detect_gpus` is the one place that asks; :meth:`Cluster.local(n, device="GPU")
<distgraph.resources.cluster.Cluster.local>` describes the GPUs it finds and the runtime's
CuPy backend checks a rank's GPU against it. Without CuPy, or without a GPU CuPy can use
(no driver, a driver too old for CuPy's CUDA, no device), it raises one
:class:`NoGPU` line saying which and how to fix it.

Example::

    >>> [g.name for g in detect_gpus()]          # doctest: +SKIP
    ['NVIDIA H100 80GB HBM3']
"""

from __future__ import annotations

from dataclasses import dataclass

from distgraph.errors import DistGraphError

GPU_EXTRA = "pip install 'distgraph[gpu]' (CUDA 12; 'distgraph[gpu-cuda13]' for CUDA 13)"


class NoGPU(DistGraphError):
    """GPUs were asked for where CuPy or a usable CUDA GPU is missing."""


@dataclass(frozen=True)
class GPUInfo:
    """One CUDA device: its ordinal (``local_id``), name, memory in GB, compute
    capability (major, minor) and streaming multiprocessors (``sms``: 0 where not
    known)."""

    local_id: int
    name: str
    memory_gb: float
    capability: tuple
    sms: int = 0


def import_cupy(what: str):
    """The cupy module; NoGPU naming ``what`` needed it when CuPy is not installed."""
    try:
        import cupy
    except ImportError as e:
        raise NoGPU(f"{what} needs CuPy, which is not installed ({e}): {GPU_EXTRA}") from None
    return cupy


def gpu_count(what: str) -> int:
    """How many GPUs CuPy can use here; NoGPU (saying why, for ``what``) when none."""
    cupy = import_cupy(what)
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:  # noqa: BLE001 - CUDA reports a missing driver in several types
        raise NoGPU(f"{what} needs a CUDA GPU, but this machine has no usable one "
                    f"({type(e).__name__}: {_first_line(e)})") from None
    if count < 1:
        raise NoGPU(f"{what} needs a CUDA GPU, but CUDA finds none on this machine")
    return count


def detect_gpus(what: str = "GPU detection") -> list:
    """A :class:`GPUInfo` per GPU of this machine (NoGPU when there is none)."""
    cupy = import_cupy(what)
    out = []
    for i in range(gpu_count(what)):
        props = cupy.cuda.runtime.getDeviceProperties(i)
        name = props.get("name", b"GPU")
        out.append(GPUInfo(i, name.decode() if isinstance(name, bytes) else str(name),
                           round(props.get("totalGlobalMem", 0) / 1e9, 3),
                           (int(props.get("major", 0)), int(props.get("minor", 0))),
                           int(props.get("multiProcessorCount", 0))))
    return out


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "no message"
