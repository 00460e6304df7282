"""``distgraph plan SCRIPT``: prints the plan a script's Engine would use without
training, as text or JSON, from a script that plans itself or from a child process it
starts; a script that never plans is an error that shows its output."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import distgraph as dg

sys.path.insert(0, str(Path(__file__).parent))
from user_scripts import run_command, with_prelude, write_script  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import distgraph as dg
    sys.path.insert(0, {tests!r})
    import plans as P

    engine = dg.Engine(P.build_model("mlp"), P.loss_fn("mlp"), dg.optim.SGD(0.1),
                       strategy=dg.Strategy(auto_mode={mode!r}))
    engine.fit(P.Dataset("mlp"), batch_size=P.BATCH)
    raise SystemExit("trained: distgraph plan should have stopped before")
""")


def plan_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "distgraph.cli", "plan", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_text_report_of_a_tutorial():
    proc = plan_cli(ROOT / "tutorials" / "01_serial_gpt.py")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("Plan: 1 process(es), serial")
    assert "predicted (uncalibrated) = compute" in out and "bubble" in out and "MFU" in out
    # this machine's default figures (the tests keep no calibration): said, with the fix
    assert "uncalibrated: cluster 'local1' gives default figures" in out
    assert "distgraph cluster calibrate -n 1 -o local1.yaml" in out
    assert "forward op layouts per layer:" not in out         # --full has them


def test_the_schedule_is_printed_after_the_stages():
    """Each process's actions in torch's notation, one line per group of processes that
    run the same order, before the long lists of the full listing; which has the
    estimate and the layouts per layer."""
    proc = plan_cli(ROOT / "tutorials" / "04_pipeline.py", "--full")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[1:6] == [
        "  stage 0: ProcessMesh([0, 1], dims=[dp])",
        "  stage 1: ProcessMesh([2, 3], dims=[dp])",
        "  schedule 1F1B, 8 micro-batch(es):",
        "    processes 0, 1: 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0F4 0B3 0F5 0B4 0F6 0B5 0F7 0B6 0B7",
        "    processes 2, 3: 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3 1F4 1B4 1F5 1B5 1F6 1B6 1F7 1B7"]
    assert "  estimate: step" in proc.stdout and "  process 3 (device 3, stage 1)" in proc.stdout
    assert "forward op layouts per layer:" in proc.stdout


def test_json_report_of_a_searched_plan(tmp_path):
    script = write(tmp_path, "auto.py", SCRIPT.format(tests=str(ROOT / "tests"), mode="full"))
    proc = plan_cli(script, "-n", 2, "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["processes"] == [0, 1] and "text" not in data and "full_text" not in data
    assert data["search"]["status"] == "optimal"
    assert data["estimate"]["step_time"] > 0 and data["calibrated"] is False
    assert len(data["estimate"]["processes"]) == 2
    assert set(data["layers"]) >= {"fc1", "fc2"}
    for point in data["reshards"]:
        assert point["bytes"] >= 0 and point["steps"] is not None


def test_a_plan_made_in_a_child_process_is_reported(tmp_path):
    child = write(tmp_path, "child.py", SCRIPT.format(tests=str(ROOT / "tests"), mode="semi"))
    parent = write(tmp_path, "parent.py", textwrap.dedent(f"""
        import subprocess, sys, time
        subprocess.run([sys.executable, {str(child)!r}])
        time.sleep(600)          # a conductor that would go on: it is stopped
    """))
    proc = plan_cli(parent, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Plan: 1 process(es), serial")


def test_a_script_that_never_plans_is_an_error(tmp_path):
    script = write(tmp_path, "nothing.py", "print('hello from the script')\n")
    proc = plan_cli(script)
    assert proc.returncode == 1
    assert "without planning a step" in proc.stderr and "hello from the script" in proc.stderr


DP_SCRIPT = textwrap.dedent("""
    import sys
    import distgraph as dg
    sys.path.insert(0, {tests!r})
    import plans as P

    data = P.Dataset("mlp")
    if {split}:
        data = dg.shard_dataloader(data, dg.ProcessMesh([0, 1], ["dp"]), shard_dims="dp")
    engine = dg.Engine(P.build_model("mlp"), P.loss_fn("mlp"), dg.optim.SGD(0.1))
    engine.fit(data, batch_size=P.BATCH)
""")


def test_the_process_count_asked_for_is_checked_against_the_plan(tmp_path):
    split = write(tmp_path, "split.py", DP_SCRIPT.format(tests=str(ROOT / "tests"), split=True))
    proc = plan_cli(split, "-n", 3)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == (f"distgraph plan: this plan needs 2 processes (process ids [0, 1]) "
                           f"but -n 3 was given; plan it with -n 2 and launch it with "
                           f"`distgraph run -n 2 {split}`\n")
    proc = plan_cli(split, "-n", 2)
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout.startswith("Plan: 2 process(es), distributed")
    whole = write(tmp_path, "whole.py", DP_SCRIPT.format(tests=str(ROOT / "tests"), split=False))
    proc = plan_cli(whole, "-n", 2)
    assert proc.returncode == 0 and proc.stdout.startswith("Plan: 1 process(es), serial")
    assert proc.stderr == ("distgraph plan: warning: the model has no annotation, so under "
                           "`distgraph run -n 2` each of the 2 ranks would train on the whole "
                           "batch (the same work 2 times); split the batch with "
                           "dg.shard_dataloader(dataset, mesh, shard_dims=\"dp\") or annotate "
                           "the model with dg.shard_tensor\n")


OWN_NPROCS = with_prelude("""
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument("--nprocs", type=int, default=2)     # the script's own option
    n = parser.parse_args().nprocs
    mesh = dg.ProcessMesh(list(range(n)), dim_names=["dp"])
    mlp_engine().fit(dg.shard_dataloader(Rows(64), mesh, shard_dims="dp"), batch_size=8)
""")


def test_the_scripts_own_options_after_two_dashes_are_the_scripts(tmp_path):
    """``distgraph plan SCRIPT -- --nprocs 4``: --nprocs 4 goes to the script (a 4-process
    plan), not to the command; the command's -n may come before or after the script, and
    a wrong one says which -n to plan with and how to launch, with the script's options."""
    script = write_script(tmp_path, OWN_NPROCS)
    plan = [sys.executable, "-m", "distgraph.cli", "plan"]
    rc, out = run_command([*plan, script, "--", "--nprocs", "4"])
    assert rc == 0 and out.startswith("Plan: 4 process(es), distributed"), out
    rc, out = run_command([*plan, "-n", "4", script, "--", "--nprocs", "4"])
    assert rc == 0 and out.startswith("Plan: 4 process(es), distributed"), out
    rc, out = run_command([*plan, script, "-n", "2", "--", "--nprocs", "4"])
    assert rc == 1 and out == (
        "distgraph plan: this plan needs 4 processes (process ids [0, 1, 2, 3]) but -n 2 was "
        "given; plan it with -n 4 and launch it with "
        f"`distgraph run -n 4 {script} --nprocs 4`\n"), out
    rc, out = run_command([*plan, script, "--nproc", "4"])    # no abbreviation of -n's
    assert rc == 0 and out.startswith("Plan: 4 process(es), distributed"), out
    rc, out = run_command([*plan, "--"])
    assert rc == 2 and out == ("distgraph plan: give the training script: distgraph plan "
                               "SCRIPT.py [-n N] [-- ARGS]\n"), out


ECHO_ARGV = """
    import json, sys
    import distgraph as dg
    if dg.Engine(dg.nn.MLP(2, 2, 2)).rank == 0:
        print("argv:", json.dumps(sys.argv[1:]))
"""


@pytest.mark.mpi
def test_distgraph_run_gives_the_script_its_words_as_python_does(tmp_path):
    """``distgraph run -n N SCRIPT ARGS``: the script gets ARGS exactly as after ``python
    SCRIPT ARGS``, a ``--`` among them included (it was swallowed); a ``--`` before the
    script ends distgraph's options and is distgraph's."""
    script = str(write_script(tmp_path, ECHO_ARGV))
    run = [sys.executable, "-m", "distgraph.cli", "run", "-n", "2"]
    for words in (["--", "--steps", "3"], ["--steps", "3", "--", "x"], ["-n", "4"], ["--"],
                  []):
        rc, plain = run_command([sys.executable, script, *words])
        assert rc == 0, plain
        rc, out = run_command([*run, script, *words])
        assert rc == 0, out
        assert [ln for ln in out.splitlines() if ln.startswith("argv:")] == \
            [plain.strip()] == [f"argv: {json.dumps(words)}"], (words, out)
    rc, out = run_command([*run, "--", script, "--steps", "3"])
    assert rc == 0 and 'argv: ["--steps", "3"]' in out, out
    rc, out = run_command([*run])
    assert rc == 2 and out == ("distgraph run: give the script to run: distgraph run -n N "
                               "SCRIPT.py [ARGS]\n"), out


def test_a_bad_cluster_file_or_script_is_one_line(tmp_path):
    bad = write(tmp_path, "bad.yaml", "machines: [\n")
    proc = plan_cli("--cluster", bad, ROOT / "tutorials" / "01_serial_gpt.py")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"distgraph plan: {bad}")
    proc = plan_cli(tmp_path / "missing.py")
    assert proc.returncode == 2 and proc.stderr == f"distgraph plan: {tmp_path}/missing.py: " \
        "no such file\n"


def test_version_and_help_are_plain_text():
    version = subprocess.run([sys.executable, "-m", "distgraph.cli", "--version"],
                             capture_output=True, text=True, check=True).stdout
    assert version.strip() == f"distgraph {dg.__version__}" and dg.__version__ != "unknown"
    for command in (["plan"], ["run"], ["cluster", "calibrate"], ["cluster", "show"]):
        out = subprocess.run([sys.executable, "-m", "distgraph.cli", *command, "--help"],
                             capture_output=True, text=True, check=True).stdout
        usage, description = out.split("\n\n")[:2]
        assert description[0].isupper() and len(description) > 40, out   # says what it does
        for markup in ("``", ":func:", ":mod:", ".. ", ".py)"):
            assert markup not in out, (command, out)


def test_a_device_too_small_for_any_process_is_named_with_why(tmp_path):
    """local4 with device 3 given 1e-6 GB (issue 68): tutorial 02's four processes have
    three devices that hold one. The plan names that device, its memory, and what the
    smallest process needs: its parameters and optimizer states, as the estimate of the
    same plan on local4 counts them."""
    import yaml

    local4 = ROOT / "resources" / "clusters" / "local4.yaml"
    data = yaml.safe_load(local4.read_text())
    data["name"] = "tiny3"
    data["machines"][0]["devices"][3]["memory"] = 1e-6
    tiny = write(tmp_path, "tiny.yaml", yaml.safe_dump(data))
    script = ROOT / "tutorials" / "02_spmd_gpt.py"
    proc = plan_cli(script, "-n", 4, "--cluster", local4, "--json")
    assert proc.returncode == 0, proc.stderr
    held = min(p["parameters"] + p["states"]
               for p in json.loads(proc.stdout)["estimate"]["processes"])
    proc = plan_cli(script, "-n", 4, "--cluster", tiny)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert (f"the plan has 4 processes, but only 3 of the 4 devices of cluster 'tiny3' can "
            f"hold one: device 3 (CPU cpu, 1e-06 GB) has less memory than the {held / 1e9:g} "
            "GB the smallest process needs. Correct the resource file, or plan for fewer "
            "processes") in proc.stderr, proc.stdout + proc.stderr
