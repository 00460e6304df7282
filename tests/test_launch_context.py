"""The launch context: what ``distgraph run --cluster`` and ``distgraph plan`` ask reaches
the Engine as the bootstrap's arguments, through one function; a context opened
in-process wins over the environment; processes a script starts inherit it; the
plan-only stop ends a script with exit code 0 and no ``except Exception`` swallows it."""

import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

import distgraph as dg
from distgraph.runtime.launch.context import (CLUSTER_VAR, PLAN_OUT, LaunchContext,
                                              PlanReported, PlanRequest, current, opened)
from distgraph.runtime.launch.launcher import launch_command

ROOT = Path(__file__).resolve().parent.parent
LOCAL4 = ROOT / "resources" / "clusters" / "local4.yaml"


@pytest.mark.mpi
def test_the_bootstrap_arguments_carry_the_context_and_the_script_follows(tmp_path):
    context = LaunchContext(str(LOCAL4), PlanRequest(str(tmp_path / "p.json"), "x.png"))
    argv = context.argv()
    assert argv[:2] == ["--cluster", str(LOCAL4)] and argv[2] == "--plan-out"
    parsed, rest = LaunchContext.parse(argv + ["--", "train.py", "--cluster", "mine"])
    assert rest == ["train.py", "--cluster", "mine"]       # the script's own options stay
    assert parsed.cluster == str(LOCAL4) and parsed.plan.out == str(tmp_path / "p.json")
    assert parsed.plan.plot.endswith("x.png")
    command = launch_command(2, ["train.py"], context=LaunchContext(str(LOCAL4)))
    assert command[-4:] == ["--cluster", str(LOCAL4), "--", "train.py"]


def test_what_the_options_leave_out_is_inherited_and_a_plan_request_is_whole():
    inherited = LaunchContext("a.yaml", PlanRequest("old.json", "old.png"))
    parsed, _ = LaunchContext.parse(["--plan-out", "new.json", "s.py"], inherited)
    assert parsed == LaunchContext("a.yaml", PlanRequest("new.json"))
    assert LaunchContext.inherited({CLUSTER_VAR: "b.yaml"}) == LaunchContext("b.yaml")
    assert LaunchContext.inherited({PLAN_OUT: "o.json"}).environ() == {PLAN_OUT: "o.json"}


def test_the_pages_asked_for_travel_as_arguments_and_in_the_environment(tmp_path):
    """``distgraph run --report PAGE`` (the context's ``report``) and ``distgraph plan
    --report PAGE`` (the request's ``page``) come back whole from the bootstrap's
    arguments and from the environment a script's children inherit; a request of its
    own does not inherit another's page."""
    page, plan_page = str(tmp_path / "run.html"), str(tmp_path / "plan.html")
    context = LaunchContext(str(LOCAL4), PlanRequest(str(tmp_path / "p.json"), page=plan_page),
                            report=page)
    parsed, rest = LaunchContext.parse(context.argv() + ["--", "s.py"])
    assert parsed == context and rest == ["s.py"]
    assert LaunchContext.inherited(context.environ()) == context
    parsed, _ = LaunchContext.parse(["--plan-out", "new.json", "s.py"], context)
    assert parsed.plan == PlanRequest("new.json") and parsed.report == page


def test_an_opened_context_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv(CLUSTER_VAR, str(ROOT / "no-such-file.yaml"))
    assert current().cluster.endswith("no-such-file.yaml")
    with opened(LaunchContext(str(LOCAL4))):
        engine = dg.Engine(dg.nn.Linear(2, 2), dg.nn.MSELoss(), dg.optim.SGD(0.1))
        assert engine.cluster.name == dg.Cluster.from_file(LOCAL4).name
    monkeypatch.delenv(CLUSTER_VAR)
    assert current() == LaunchContext()
    assert dg.Engine(dg.nn.Linear(2, 2)).cluster is None


def test_a_plan_only_stop_is_no_exception_and_no_exit():
    assert not issubclass(PlanReported, (Exception, SystemExit))
    with pytest.raises(PlanReported):
        try:
            raise PlanReported()
        except Exception:          # what a script's own handler catches
            pytest.fail("a script's except Exception caught the plan-only stop")


SCRIPT = textwrap.dedent("""
    import os, subprocess, sys
    import distgraph as dg
    from distgraph.runtime.launch.context import PlanReported
    engine = dg.Engine(dg.nn.Linear(2, 2), dg.nn.MSELoss(), dg.optim.SGD(0.1))
    print("CLUSTER", engine.cluster.name, os.environ["DISTGRAPH_CLUSTER"], flush=True)
    child = "import distgraph as dg; print('CHILD', dg.Engine(dg.nn.Linear(2, 2)).cluster.name)"
    subprocess.run([sys.executable, "-c", child], check=True)
    raise PlanReported()
    print("after the stop")
""")


def test_the_bootstrap_opens_the_context_for_the_script_and_its_children(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "distgraph.runtime.launch.bootstrap",
                           *LaunchContext(str(LOCAL4)).argv(), "--", str(script)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    name = dg.Cluster.from_file(LOCAL4).name
    assert proc.stdout.splitlines() == [f"CLUSTER {name} {LOCAL4}", f"CHILD {name}"]


@pytest.mark.mpi
def test_the_suite_keeps_a_failed_jobs_logs_in_its_own_temporary_folder_not_in_tmp():
    """Issue #52: the suite left some 24 distgraph-logs-* folders in /tmp. A failed job
    keeps its logs (right for a user), here in the temporary folder tests/conftest.py
    gives the run (TMPDIR), which the run removes at its end."""
    run_folder = Path(os.environ["TMPDIR"])
    assert run_folder.name.startswith("dgtest-") and run_folder == Path(tempfile.gettempdir())
    before = set(run_folder.glob("distgraph-logs-*"))
    script = Path(__file__).parent / "mpi_scripts" / "fault_jobs.py"
    proc = subprocess.run([sys.executable, "-m", "distgraph.cli", "run", "-n", "2",
                           str(script), "lines"], capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=90)
    assert proc.returncode != 0
    kept = set(run_folder.glob("distgraph-logs-*")) - before
    assert len(kept) == 1 and f"{kept.pop()}{os.sep}rank-<r>.log" in proc.stderr, proc.stderr
