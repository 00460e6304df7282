"""A stop signal that reaches the launcher while mpiexec ends on its own (scancel signals
the whole job step: mpiexec, losing its proxies, may exit before the launcher's loop
sees the request) is still the job's end as the launcher reports it: received SIGTERM,
exit 128 + 15; a job that had already succeeded stays a success. Oracle: real child
processes, ended before the request is read."""

from __future__ import annotations

import os
import signal
import sys
import time

from distgraph.runtime.launch.job import Job


def _ended_job(tmp_path, code: int) -> Job:
    status, logs = tmp_path / "status", tmp_path / "logs"
    status.mkdir()
    logs.mkdir()
    job = Job([sys.executable, "-c", f"raise SystemExit({code})"], dict(os.environ),
              str(status), str(logs))
    job.start()
    deadline = time.monotonic() + 30
    while job._proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return job


def test_a_signal_while_mpiexec_fails_is_the_jobs_end(tmp_path):
    job = _ended_job(tmp_path, 255)
    job.request_stop(signal.SIGTERM)        # as the launcher's handler does
    assert job.wait() == 128 + signal.SIGTERM
    assert job.stopped_by == signal.SIGTERM


def test_a_signal_after_mpiexec_succeeded_leaves_the_success(tmp_path):
    job = _ended_job(tmp_path, 0)
    job.request_stop(signal.SIGTERM)
    assert job.wait() == 0 and job.stopped_by is None
