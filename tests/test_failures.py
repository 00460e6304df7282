"""A failing, dying or stalled rank ends the whole MPI job quickly with a non-zero exit
code and a message naming the rank; a job started with the wrong number of processes
stops at once saying how many it needs and how to launch it."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from user_scripts import run_user, with_prelude  # noqa: E402

SCRIPT = Path(__file__).parent / "mpi_scripts" / "fail_rank.py"
DEADLINE = 30.0   # the job must be over by then
TIMEOUT = 60      # subprocess guard, well past the deadline


@pytest.fixture(autouse=True)
def _job_temp(tmp_path, monkeypatch):
    """Failed jobs keep their default log folder: keep it here."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))


def run(argv, **env):
    """(exit code, stdout + stderr, seconds) of a command with one BLAS thread."""
    start = time.monotonic()
    proc = subprocess.run(argv, env=dict(os.environ, OMP_NUM_THREADS="1", **env),
                          capture_output=True, text=True, timeout=TIMEOUT)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def launch(nprocs, *args, **env):
    return run([sys.executable, "-m", "distgraph.cli", "run", "-n", str(nprocs), str(SCRIPT), *args],
               **env)


@pytest.mark.mpi
def test_the_healthy_job_trains():
    rc, out, _ = launch(4, "ok")
    assert rc == 0, out[-3000:]
    assert out.count("FAIL-RANK OK 3 steps") == 4


@pytest.mark.mpi
def test_a_kernel_error_on_one_rank_ends_the_job_naming_rank_and_op():
    rc, out, seconds = launch(4, "raise")
    assert rc != 0
    assert seconds < DEADLINE
    assert "rank 1 failed" in out, out[-3000:]
    assert "op 'relu'" in out and "injected failure" in out, out[-3000:]
    assert "FAIL-RANK OK" not in out


@pytest.mark.mpi
def test_under_a_plain_mpiexec_a_kernel_error_also_ends_the_job(job_trace):
    """No launcher watches the job: the failing rank aborts it, and removes the files MPI
    made for it, which the abort would leave (a shared-memory segment, hydra's topology
    file)."""
    from distgraph.runtime.launch.launcher import mpiexec_path
    rc, out, seconds = run([mpiexec_path(), "-n", "4", sys.executable, str(SCRIPT), "raise"])
    assert rc != 0
    assert seconds < DEADLINE
    assert "rank 1 failed" in out and "op 'relu'" in out, out[-3000:]
    job_trace.assert_nothing_left(ran_mpi=True)


@pytest.mark.mpi
def test_a_dead_rank_ends_the_job():
    rc, out, seconds = launch(4, "exit")
    assert rc != 0, out[-3000:]
    assert seconds < DEADLINE
    assert "FAIL-RANK OK" not in out
    assert "rank 2 died without reporting an error" in out, out[-3000:]


@pytest.mark.mpi
def test_a_message_from_a_rank_that_finished_ends_with_runtime_fault_naming_both():
    # Rank 1 finished its script: rank 0 gives up within seconds, not at the timeout.
    rc, out, seconds = launch(2, "skip", DISTGRAPH_COMM_TIMEOUT="60")
    assert rc != 0
    assert seconds < DEADLINE
    assert "RuntimeFault" in out, out[-3000:]
    assert "rank 0 failed" in out and "from rank 1" in out, out[-3000:]
    assert "rank 1 has finished its script" in out, out[-3000:]


def check_launch_error(out):
    assert "PlanError" in out, out[-3000:]
    assert "this plan needs 4 processes" in out, out[-3000:]
    assert "distgraph run -n 4" in out, out[-3000:]


@pytest.mark.mpi
def test_a_four_process_plan_started_as_one_plain_process_stops_at_once():
    rc, out, seconds = run([sys.executable, str(SCRIPT), "ok"])
    assert rc != 0
    assert seconds < DEADLINE
    check_launch_error(out)
    assert "job has 1" in out


@pytest.mark.mpi
def test_a_four_process_plan_under_the_wrong_n_stops_every_rank():
    rc, out, seconds = launch(2, "ok")
    assert rc != 0
    assert seconds < DEADLINE   # every rank exited: the job (mpiexec) is over
    check_launch_error(out)
    assert "job has 2" in out
    assert "FAIL-RANK OK" not in out


LATE_RANK_0 = with_prelude("""
    import time
    mesh = dg.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    engine = mlp_engine()
    engine.fit(dg.shard_dataloader(Rows(64), mesh, shard_dims="dp"), batch_size=8, verbose=0)
    if engine.rank == 0:
        time.sleep(1.5)     # rank 0 does something first (saves, plots), and fails later
    valid = dg.shard_dataloader(Rows(16), mesh, shard_dims="data")   # no such mesh dim
""")


@pytest.mark.mpi
def test_every_rank_that_failed_is_listed_even_one_that_failed_a_moment_later(tmp_path):
    """After a fit, every rank raises the same error, rank 0 1.5 s after the others: it
    is listed with them (before, the first abort killed it before it said so: 'ranks 1,
    2, 3'), and so is each of the others (before, one killed while it wrote its
    traceback was left out)."""
    rc, out = run_user(tmp_path, LATE_RANK_0, 4)
    assert rc != 0, out
    failed = [ln for ln in out.splitlines() if " failed: " in ln]
    assert len(failed) == 1 and failed[0].startswith(
        "distgraph: ranks 0, 1, 2, 3 failed: ShardingError: shard_dataloader: shard_dims "
        "'data' is not a dim of"), out
