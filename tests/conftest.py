"""Fixtures shared by the test modules."""

import os
import shutil
import tempfile

import pytest

import distgraph as dg
from job_traces import Trace, new_marker

# Nothing of the tests' reaches the user's cache (distgraph.resources.local_cache): this
# machine's kept calibration is looked for, and kept, in a folder of this run's, and
# `distgraph run` without --cluster measures nothing (DISTGRAPH_CALIBRATE=never) unless a
# test asks for it: Cluster.local(n) gives its default figures to every other test.
CACHE = tempfile.mkdtemp(prefix="dgcache-")
os.environ["DISTGRAPH_CACHE_DIR"] = CACHE
os.environ["DISTGRAPH_CALIBRATE"] = "never"


@pytest.fixture
def float64():
    """Run a test with float64 as the default dtype, restoring the one before afterwards."""
    before = dg.get_default_dtype()
    dg.set_default_dtype("float64")
    try:
        yield
    finally:
        dg.set_default_dtype(before)


@pytest.fixture
def job_trace(monkeypatch):
    """A :class:`job_traces.Trace` of every process the test starts: its marker is in
    the test's environment while it runs, so every command started from it carries it.
    The test ends with ``job_trace.assert_nothing_left(ran_mpi=...)``; whatever of its
    jobs is still alive afterwards is killed."""
    trace = Trace(new_marker())
    for key, value in trace.env.items():
        monkeypatch.setenv(key, value)
    try:
        yield trace
    finally:
        trace.leftovers()


@pytest.fixture(autouse=True)
def _default_dtype_restored():
    """Each test starts from the default dtype the one before it found (a bench helper
    that plans in bfloat16 sets it for its caller and leaves it set)."""
    before = dg.get_default_dtype()
    try:
        yield
    finally:
        dg.set_default_dtype(before)


@pytest.fixture(scope="session", autouse=True)
def _temporary_files_of_this_run(tmp_path_factory):
    """Every temporary file of the run, the jobs' included, in one folder removed at its
    end: a job that fails keeps its logs (``distgraph-logs-*``, right for a user), an
    emulated launcher killed on purpose its folder; tests leave neither in /tmp. The
    folder is short, as ssh's control sockets live in it (a Unix socket's path holds 107
    bytes), so it is not pytest's tmp_path."""
    tmp_path_factory.getbasetemp()      # pytest's own folders stay where they were
    before = os.environ.get("TMPDIR")
    folder = tempfile.mkdtemp(prefix="dgtest-")
    os.environ["TMPDIR"] = folder
    tempfile.tempdir = None                  # this process's gettempdir() reads it again
    try:
        yield folder
    finally:
        if before is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before
        tempfile.tempdir = None
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(CACHE, ignore_errors=True)
