"""Machines that compute at different speeds on an emulated cluster (root only): the
slower machine's ranks run under a CPU quota, and every cgroup a job made is gone however
the job ends (normal end, a failing rank, SIGTERM/SIGINT/SIGHUP, a crash of the
launcher's own code, SIGKILL and the next start).

The GEMM rates are compared with what the same process's CPU time gives (the share of
the wall time a rank ran) and with the fast machine's rank measured at the same time; the
quota keeps the slow rank at or under half a core however loaded the box is, and the
cgroups' weights keep the ratio of the two near the file's when the box is busy.
Skipped with the reason where emulation or a cgroup cpu controller is missing.
"""

import json
import os
import signal
import time
from pathlib import Path

import pytest

from distgraph.runtime.emulate import launch as emulate_launch
from distgraph.runtime.emulate.cgroups import cpu_controller, our_groups, remove_groups
from distgraph.runtime.emulate.layout import parse_namespace, this_job
from test_emulate import REASON, Launcher

ROOT = Path(__file__).resolve().parent.parent
MIXED_2X1 = str(ROOT / "resources" / "clusters" / "emulated_mixed_2x1.yaml")
PROBE = str(ROOT / "tests" / "mpi_scripts" / "speed_probe.py")
QUOTA_SLACK = 1.15


def _cannot_throttle() -> str | None:
    if REASON is not None:
        return REASON
    if cpu_controller() is None:
        return "no cgroup cpu controller is mounted"
    return None


SKIP = _cannot_throttle()
pytestmark = [pytest.mark.mpi, pytest.mark.slow,
              pytest.mark.skipif(SKIP is not None, reason=f"emulated speeds: {SKIP}")]


def groups_of(pid: int) -> list[str]:
    return [p for p in our_groups() if parse_namespace(os.path.basename(p))[0] == pid]


@pytest.fixture
def jobs():
    launcher = Launcher()
    try:
        yield launcher
    finally:
        launcher.cleanup()
        left = [g for proc in launcher.procs for g in groups_of(proc.pid)]
        for path in left:
            remove_groups(os.path.basename(path).rsplit("-", 1)[0][len("distgraph-"):])
    assert left == [], f"the jobs left cgroups behind: {left}"


def speed_report(result) -> list:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    line = next(ln for ln in result.stdout.splitlines() if ln.startswith("SPEED-PROBE "))
    return json.loads(line.split(" ", 1)[1])


def test_a_rank_on_a_half_speed_machine_measures_half_the_gemm_rate(jobs):
    fast, slow = speed_report(jobs.run("run", "-n", "2", "--emulate", MIXED_2X1, PROBE, "3"))
    pid = jobs.procs[-1].pid
    assert fast["host"] == "node0" and slow["host"] == "node1"
    for record, machine in ((fast, "m0"), (slow, "m1")):
        assert parse_namespace(record["cgroup"].lstrip("/"))[::2] == (pid, machine), record
    ran = slow["wall_gflops"] / slow["cpu_gflops"]       # share of the wall time it ran
    assert ran <= 0.5 * QUOTA_SLACK, slow
    ratio = slow["wall_gflops"] / fast["wall_gflops"]
    assert 0.35 <= ratio <= 0.65, (fast, slow)
    assert groups_of(pid) == []


def test_the_groups_go_when_a_rank_fails(jobs):
    result = jobs.run("run", "-n", "2", "--emulate", MIXED_2X1, PROBE, "1", "--fail", "1")
    assert result.returncode != 0
    assert "rank 1 failed: RuntimeError: rank 1 fails, as asked" in result.stderr
    assert groups_of(jobs.procs[-1].pid) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_to_the_launcher_removes_the_groups(jobs, sig):
    proc = jobs.start("run", "-n", "2", "--emulate", MIXED_2X1, PROBE, "60")
    _wait_for_groups(proc, 2)
    time.sleep(2)             # the ranks are running in them
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err[-2000:]
    assert "the emulated cluster was removed" in err
    assert groups_of(proc.pid) == []


def test_a_crash_of_the_launchers_own_code_removes_the_groups(monkeypatch):
    seen = []

    def crash(*args, **kwargs):
        seen.extend(groups_of(os.getpid()))
        raise RuntimeError("the launcher broke")

    monkeypatch.setattr(emulate_launch, "launch", crash)
    with pytest.raises(RuntimeError, match="the launcher broke"):
        emulate_launch.launch_emulated(MIXED_2X1, 2, [PROBE])
    assert len(seen) == 2 and all(this_job() in s for s in seen)
    assert groups_of(os.getpid()) == []


def test_groups_of_a_killed_launcher_go_at_the_next_start(jobs):
    proc = jobs.start("run", "-n", "2", "--emulate", MIXED_2X1, PROBE, "60")
    made = _wait_for_groups(proc, 2)
    proc.kill()
    proc.communicate()
    assert groups_of(proc.pid) == made
    result = jobs.run("run", "-n", "2", "--emulate", MIXED_2X1, PROBE, "0.2")
    speed_report(result)
    assert f"left by emulated job {proc.pid}." in result.stderr
    assert groups_of(proc.pid) == []


def test_machines_of_equal_speed_run_in_no_group(jobs, tmp_path):
    path = tmp_path / "same.yaml"
    path.write_text(Path(MIXED_2X1).read_text().replace("float32: 25, float64: 12.5",
                                                        "float32: 50, float64: 25"))
    records = speed_report(jobs.run("run", "-n", "2", "--emulate", str(path), PROBE, "0.2"))
    assert all("distgraph-" not in r["cgroup"] for r in records)


def _wait_for_groups(proc, count, seconds=60) -> list[str]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = groups_of(proc.pid)
        if len(found) == count:
            return found
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.1)
    raise AssertionError(f"the job made no {count} cgroups within {seconds} s")
