"""``distgraph plan SCRIPT``: prints the plan a script's Engine would use without
training, as text or JSON, from a script that plans itself or from a child process it
starts; a script that never plans is an error that shows its output."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

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
    assert "estimate: step" in out and "compute" in out and "bubble" in out
    assert "forward op layouts per layer:" in out and "  lm_head:" in out


def test_json_report_of_a_searched_plan(tmp_path):
    script = write(tmp_path, "auto.py", SCRIPT.format(tests=str(ROOT / "tests"), mode="full"))
    proc = plan_cli(script, "-n", 2, "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["processes"] == [0, 1]
    assert data["search"]["status"] == "optimal"
    assert data["estimate"]["step_time"] > 0
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
