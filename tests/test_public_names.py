"""The ``distgraph`` facade: every public name resolves (it imports them on first use),
``from distgraph import X`` works, and what starts jobs imports only what it uses.

The launcher and every rank's bootstrap start before any training code; importing the
planner there (numpy, scipy, networkx) cost every rank a second of its start. The checks
below are on which modules get imported, in a fresh interpreter, never on times.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import distgraph as dg

# names the README and DESIGN.md promise on the package
PUBLIC = ("InputSpec", "trace", "Engine", "History", "Strategy", "ops", "nn", "optim",
          "passes", "callbacks", "metrics", "set_default_dtype", "get_default_dtype", "seed",
          "LazyGuard", "Parameter", "ProcessMesh", "ShardSpec", "DistAttr", "Shard",
          "Replicate", "Partial", "shard_tensor", "shard_op", "shard_dataloader", "Cluster",
          "Program", "Operation", "Value", "append_backward", "DistGraphError",
          "ShardingError", "ResourceFileError", "PlanError", "RuntimeFault",
          "CheckpointError", "DTypeError", "ShapeError", "__version__", "parallelize",
          "ColWiseParallel", "RowWiseParallel", "SequenceParallelBegin", "SequenceParallelEnd",
          "SequenceParallelEnable", "SequenceParallelDisable", "SplitPoint")
HEAVY = ("numpy", "scipy", "networkx", "yaml", "pyscipopt", "cvxpy")


def fresh_modules(code: str) -> set:
    """The modules a fresh interpreter holds after running ``code``."""
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport json, sys\n"
                          "print(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.splitlines()[-1]))


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_name_resolves(name):
    assert name in dg.__all__ and name in dir(dg)
    value = getattr(dg, name)
    namespace: dict = {}
    exec(f"from distgraph import {name} as x", namespace)
    assert namespace["x"] is value


def test_dir_shows_the_public_names_not_the_facades_helpers():
    """``dir(dg)`` (and tab completion) lists what a user may call: the public names, the
    submodules imported so far and the dunders; not the modules the facade uses itself."""
    shown = set(dir(dg))
    assert not shown & {"importlib", "sys", "types", "limit_blas_threads"}, sorted(shown)
    assert set(dg.__all__) <= shown
    others = [name for name in shown - set(dg.__all__) if not name.startswith("__")
              and not getattr(getattr(dg, name), "__name__", "").startswith("distgraph.")]
    assert not others, others


def test_submodules_are_attributes_as_before():
    assert dg.spmd.UNKNOWN is not None and dg.resources.cluster.Cluster is dg.Cluster
    assert callable(dg.passes.plan_reshard) and callable(dg.ops.matmul)
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        dg.no_such_name


def test_paths_into_submodules_find_what_they_found_before():
    """In a fresh interpreter: ``dg.app`` has its modules as when everything was imported."""
    fresh_modules("import distgraph as dg\n"
                  "assert dg.app.data.DataLoader and dg.resources.cluster.Cluster\n"
                  "assert dg.passes.meshslice.autotune and dg.optim.lr.CosineDecay")


def test_paths_into_submodules_work_after_importing_one_of_them_directly():
    """``import distgraph.app.state`` binds ``dg.app`` before anything public is imported;
    its other modules are still found as attributes (this order once failed a test file)."""
    fresh_modules("from distgraph.app.state import HeldState\n"
                  "import distgraph as dg\n"
                  "assert dg.app.data.DataLoader and dg.tools.calibrate\n"
                  "assert not hasattr(dg.app, 'no_such_module')")


def test_trace_stays_the_function_once_its_module_is_imported():
    import distgraph.trace as bound   # binds the submodule on the package; reads it back

    assert dg.trace is bound
    assert callable(dg.trace) and dg.trace.__name__ == "trace"
    from distgraph.trace import InputSpec

    assert InputSpec is dg.InputSpec


def test_parallelize_stays_the_function_once_its_module_is_imported():
    """``distgraph.parallelize`` is a module defining the function of its name, as
    ``distgraph.trace`` is: importing the module leaves the name the function."""
    import distgraph.parallelize as bound
    from distgraph.parallelize import matches

    assert dg.parallelize is bound and callable(dg.parallelize)
    assert dg.parallelize.__name__ == "parallelize" and matches("a.*", "a.b")


def test_the_public_names_work_together():
    mesh = dg.ProcessMesh([0, 1], ["dp"])
    program = dg.trace(dg.nn.Linear(4, 2), dg.InputSpec([8, 4], name="x"))
    assert list(mesh.process_ids) == [0, 1]
    assert [op.type for op in program.ops] and dg.__version__ != "unknown"


@pytest.mark.parametrize("code", [
    "import distgraph",
    "import distgraph.runtime.launch.bootstrap",
    "from distgraph.cli import main",
    "import distgraph.runtime.launch.launcher",
])
def test_starting_a_job_imports_no_numerical_library(code):
    loaded = fresh_modules(code)
    assert not [m for m in HEAVY if m in loaded], sorted(m for m in HEAVY if m in loaded)
    assert "distgraph.app.engine" not in loaded and "distgraph.passes" not in loaded


def test_resource_files_know_every_op_when_nothing_else_was_imported():
    """A file's ``op_costs`` keys are checked against the registered ops: reading one in a
    fresh interpreter (``distgraph cluster calibrate`` does) registers them all first."""
    out = subprocess.run([sys.executable, "-c", "import distgraph.resources.cluster\n"
                          "from distgraph.registry import registered_ops\n"
                          "print(sorted(registered_ops()))"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(sorted(dg.ops.registered_ops()))
