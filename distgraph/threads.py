"""BLAS threads: one per process, as ``distgraph run`` gives each rank, unless the user
chose.

Why: distgraph's matrices are small and its processes many. A BLAS library left to
itself starts a thread per core in every process; on a machine that other work (or the
job's other ranks) keeps busy those threads wait on each other, and tutorial 01 took
45 s as a plain ``python`` process against 5 s with one thread. ``distgraph run`` sets
``OMP_NUM_THREADS`` (and ``OPENBLAS_NUM_THREADS``, ``MKL_NUM_THREADS``) to 1 for its ranks;
``import distgraph`` does the same for a plain ``python script.py``.

The user's choice wins: when any of those variables is set (``OMP_NUM_THREADS=8 python
script.py``), nothing is changed. Otherwise :func:`limit_blas_threads`, run when
distgraph is imported, sets all three to 1 in this process's environment (so the BLAS
libraries loaded later read it, and so do the processes the script starts), and for a
BLAS library already loaded (a script that imports numpy before distgraph: numpy's
OpenBLAS read the variables when it loaded) calls the library's own
``openblas_set_num_threads`` (or MKL's) through ctypes, as threadpoolctl does, which
is not a dependency of distgraph. Only OpenBLAS and MKL builds are known; another BLAS
already loaded keeps its threads (then set the variable before Python starts).

Example::

    OMP_NUM_THREADS=4 python tutorials/01_serial_gpt.py     # four BLAS threads
"""

from __future__ import annotations

import os
import sys

BLAS_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
THREADS = 1
# set_num_threads of the builds numpy and scipy wheels bundle (64-bit ints, prefixed
# symbols), of a system OpenBLAS, and of MKL
SETTERS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
           "openblas_set_num_threads64_", "openblas_set_num_threads", "MKL_Set_Num_Threads")


def limit_blas_threads(environ=None) -> bool:
    """One BLAS thread for this process unless a BLAS thread variable is set in
    ``environ`` (default: ``os.environ``); True when it set them (module docstring)."""
    env = os.environ if environ is None else environ
    if any(var in env for var in BLAS_THREAD_VARS):
        return False
    for var in BLAS_THREAD_VARS:
        env[var] = str(THREADS)
    if environ is None and "numpy" in sys.modules:     # its BLAS read them already
        set_loaded_blas_threads(THREADS)
    return True


def loaded_blas_libraries() -> list:
    """Paths of the OpenBLAS and MKL libraries this process has loaded (Linux)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(None, 5)[-1].strip() for line in f if "/" in line}
    except OSError:
        return []
    return sorted(p for p in paths
                  if "openblas" in os.path.basename(p) or "mkl_rt" in os.path.basename(p))


def set_loaded_blas_threads(threads: int) -> list:
    """Set the threads of every loaded OpenBLAS / MKL library; returns those it set."""
    import ctypes

    done = []
    for path in loaded_blas_libraries():
        try:
            lib = ctypes.CDLL(path)       # loaded already: the same library
        except OSError:
            continue
        for name in SETTERS:
            setter = getattr(lib, name, None)
            if setter is not None:
                setter(ctypes.c_int(threads))
                done.append(path)
                break
    return done
