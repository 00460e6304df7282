"""Scripts as a user writes them, run as a user runs them: written to a folder and started
with ``distgraph run -n N`` (or ``distgraph plan``, or plain ``python``), each rank with
one BLAS thread. The tests read what the user reads: the exit code and the output.

``PRELUDE`` is what such scripts start with: a small regression dataset (``Rows(n)``:
16 features, 4 targets) and its MLP.

Example::

    rc, out = run_user(tmp_path, with_prelude("mlp_engine().fit(Rows(66), batch_size=8)"), 4)
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

PRELUDE = textwrap.dedent("""
    import sys
    import numpy as np
    import distgraph as dg

    class Rows:
        def __init__(self, n):
            rng = np.random.default_rng(0)
            self.x = rng.normal(size=(n, 16)).astype("float32")
            self.y = rng.normal(size=(n, 4)).astype("float32")
        def __len__(self):
            return len(self.x)
        def __getitem__(self, i):
            return self.x[i], self.y[i]

    def mlp_engine(**kw):
        dg.seed(0)
        return dg.Engine(dg.nn.MLP(16, 32, 4), loss=dg.nn.MSELoss(),
                         optimizer=dg.optim.SGD(0.1), **kw)
""")


def with_prelude(body: str) -> str:
    """The script ``PRELUDE`` then ``body`` (dedented)."""
    return PRELUDE + "\n" + textwrap.dedent(body)


def write_script(folder, text: str, name: str = "user_script.py"):
    """``text`` (dedented) as ``folder/name``; returns its path."""
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def run_command(argv, timeout=120, **env) -> tuple:
    """(exit code, stdout + stderr) of ``argv`` with one BLAS thread per process."""
    base = {k: v for k, v in os.environ.items() if k != "DISTGRAPH_TERMINAL"}  # a pipe
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          env=dict(base, OMP_NUM_THREADS="1", **env))
    return proc.returncode, proc.stdout + proc.stderr


def run_user(folder, text: str, n: int, *args, timeout=120, **env) -> tuple:
    """(exit code, stdout + stderr) of the script ``text`` under ``distgraph run -n n``."""
    script = write_script(folder, text)
    return run_command([sys.executable, "-m", "distgraph.cli", "run", "-n", str(n),
                        str(script), *map(str, args)], timeout=timeout, **env)
