"""BLAS threads (distgraph/threads.py): a plain ``python script.py`` that imports distgraph
runs BLAS on one thread, as each rank of ``distgraph run`` does, whether it imported numpy
first or not; a BLAS thread variable the user set wins, in both. The oracle is OpenBLAS's
own count (``openblas_get_num_threads``) read in the script."""

import os
import subprocess
import sys
from pathlib import Path

import numpy  # noqa: F401  (loads numpy's BLAS, which needs_cores looks for)
import pytest

import distgraph.threads as T

sys.path.insert(0, str(Path(__file__).parent))
from user_scripts import write_script  # noqa: E402

PROBE = """
    import ctypes, sys
    if sys.argv[1] == "distgraph first":
        import distgraph
    import numpy as np
    if sys.argv[1] == "numpy first":
        import distgraph
    np.ones((64, 64)) @ np.ones((64, 64))
    path = [p for p in open("/proc/self/maps").read().split() if "openblas" in p][0]
    lib = ctypes.CDLL(path)
    get = next(getattr(lib, n) for n in ("scipy_openblas_get_num_threads64_",
               "openblas_get_num_threads") if hasattr(lib, n))
    print("BLAS threads", get())
"""

needs_cores = pytest.mark.skipif((os.cpu_count() or 1) < 2 or not T.loaded_blas_libraries(),
                                 reason="one core (BLAS's default is one thread already) "
                                        "or numpy's BLAS is not OpenBLAS")


def blas_threads(argv, **env) -> int:
    clean = {k: v for k, v in os.environ.items() if k not in T.BLAS_THREAD_VARS}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                          env=dict(clean, **env))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [int(ln.split()[-1]) for ln in proc.stdout.splitlines()
            if ln.startswith("BLAS threads")]


@needs_cores
@pytest.mark.parametrize("order", ["numpy first", "distgraph first"])
def test_a_plain_python_script_gets_one_blas_thread_unless_the_user_chose(tmp_path, order):
    script = write_script(tmp_path, PROBE)
    [default] = blas_threads([sys.executable, script, "without distgraph"])
    assert default > 1                   # what the script had before: a thread per core
    assert blas_threads([sys.executable, script, order]) == [1]
    assert blas_threads([sys.executable, script, order], OMP_NUM_THREADS="2") == [2]


@needs_cores
@pytest.mark.mpi
def test_a_rank_keeps_the_users_omp_num_threads(tmp_path):
    """distgraph run gave ranks OPENBLAS_NUM_THREADS=1 beside the user's OMP_NUM_THREADS=2,
    and OpenBLAS reads its own first: the user's choice was lost."""
    script = write_script(tmp_path, PROBE)
    run = [sys.executable, "-m", "distgraph.cli", "run", "-n", "1", str(script), "numpy first"]
    assert blas_threads(run) == [1]
    assert blas_threads(run, OMP_NUM_THREADS="2") == [2]


def test_a_set_variable_is_left_alone_and_none_set_sets_all():
    env = {"MKL_NUM_THREADS": "3"}
    assert not T.limit_blas_threads(env) and env == {"MKL_NUM_THREADS": "3"}
    env = {}
    assert T.limit_blas_threads(env)
    assert env == {var: "1" for var in T.BLAS_THREAD_VARS}
