"""What the tutorials' docstrings say about their plans, checked against the plans
``distgraph plan`` prints for them (a newcomer compares the two)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
N_LAYER = 2                      # tutorial 02's GPT


def plan_json(script: str, n: int) -> dict:
    proc = subprocess.run([sys.executable, "-m", "distgraph.cli", "plan", "-n", str(n), "--json",
                           str(ROOT / "tutorials" / script)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_tutorial_02_runs_the_mlp_megatron_style_and_the_attention_whole():
    """The docstring: fc2's partial outputs are all-reduced over mp in the forward (one
    per block, none for proj); the qkv output and proj.weight are all-gathered before
    use, qkv.weight in the backward; the LayerNorm output before fc1 has its gradient
    all-reduced over mp."""
    reshards = plan_json("02_spmd_gpt.py", 4)["reshards"]

    def kinds(r):
        return [s.split()[0] for s in r["steps"]]

    forward_partials = [r for r in reshards if " P(mp) " in r["src"]
                        and not r["value"].endswith("@GRAD")]
    assert [kinds(r) for r in forward_partials] == [["all_reduce(mp)"]] * N_LAYER
    backward_partials = [r for r in reshards if " P(mp) " in r["src"]
                         and r["value"].endswith("@GRAD")]
    assert len(backward_partials) == N_LAYER
    assert all(r["value"].startswith("layer_norm_") for r in backward_partials)
    for i in range(N_LAYER):
        for name in (f"blocks.{i}.attn.proj.weight", f"blocks.{i}.attn.qkv.weight"):
            (gathered,) = [r for r in reshards if r["value"] == name]
            assert kinds(gathered) == ["all_gather(mp)"], gathered
        assert not any(r["value"] == f"blocks.{i}.mlp.fc1.weight" for r in reshards)
        assert not any(r["value"] == f"blocks.{i}.mlp.fc2.weight" for r in reshards)


@pytest.mark.mpi
def test_the_readmes_first_script_runs_as_is_and_says_what_the_readme_says(tmp_path):
    """The README's first script, copied as it stands, trains on 4 ranks and prints the
    loss the README quotes."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## A first script"):]
    script = section[section.index("```python\n") + 10:section.index("```\n", 10)]
    assert len(script.splitlines()) <= 30
    (tmp_path / "first.py").write_text(script)
    proc = subprocess.run([sys.executable, "-m", "distgraph.cli", "run", "-n", "4", "first.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (line,) = [s for s in proc.stdout.splitlines() if s.startswith("loss ")]
    quoted = re.search(r"`(loss [0-9.]+ -> [0-9.]+)`", section).group(1)
    got, said = ([float(x) for x in s.split()[1::2]] for s in (line, quoted))
    assert got == pytest.approx(said, abs=0.01), (line, quoted)   # BLAS may round apart


def readme_block(heading: str, page: str = "README.md") -> str:
    """The first python block of the section ``heading`` of the README (or of ``page``,
    a path from the repository's root: the docs pages of its map)."""
    readme = (ROOT / page).read_text()
    section = readme[readme.index(heading):]
    return section[section.index("```python\n") + 10:section.index("```\n", 10)]


@pytest.mark.slow
@pytest.mark.mpi
def test_the_readmes_automatic_plan_snippet_runs_after_the_first_scripts_dataset(tmp_path):
    """The "Automatic plans" snippet (docs/automatic.md), after the first script's
    dataset (as its comment says), runs from the repository's root on 4 ranks: every name it uses is defined
    (it used an undefined ``loss``, ``optimizer``, ``built`` and ``my4.yaml``) and it
    prints the search's report."""
    first = readme_block("## A first script")
    script = first[:first.index("dg.seed(0)")] + readme_block("## Automatic plans",
                                                              "docs/automatic.md")
    (tmp_path / "auto.py").write_text(script)
    proc = subprocess.run([sys.executable, "-m", "distgraph.cli", "run", "-n", "4",
                           str(tmp_path / "auto.py")], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert re.search(r"chosen by (recursive bisection|SCIP ILP)", proc.stdout), \
        proc.stdout[-2000:]


def _tutorial_06():
    import importlib.util

    sys.path.insert(0, str(ROOT / "tutorials"))
    spec = importlib.util.spec_from_file_location("tutorial_06",
                                                  ROOT / "tutorials" / "06_emulated_cluster.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _plan_of(t06, name, cluster):
    import distgraph as dg
    from distgraph.app.data import DataLoader
    from counting_data import CountingSequences

    dg.seed(0)
    model, mesh = t06.hand_plans()[name]()
    samples = CountingSequences(t06.BATCH, t06.GPT["max_seq_len"], t06.GPT["vocab_size"])
    data = samples if mesh is None else dg.shard_dataloader(samples, mesh, "dp")
    strategy = dg.Strategy(auto_mode="full" if name == "searched" else "semi")
    engine = dg.Engine(model, loss=dg.nn.CrossEntropyLoss(), optimizer=dg.optim.AdamW(3e-3),
                       cluster=cluster, strategy=strategy)
    return engine.prepare(*DataLoader(data, t06.BATCH).specs(1))


def _collectives(plan) -> int:
    return sum(1 for p in plan.local_alike(0).points() for s in p.steps
               if s.kind.is_collective and s.group_size > 1)


@pytest.mark.slow
def test_tutorial_06_a_step_that_costs_makes_the_search_take_fewer_steps():
    """Tutorial 06's account: on the file as written (10 Gbit/s) a step costs its bytes
    only, and the search picks a plan of more collectives than dp x mp; where each step
    of two processes costs 1 ms of software (what these time-shared ranks measure, the
    per-round cost of a collective over more), it picks one of no more collectives than
    dp x mp, and its predicted step is no slower than dp x mp's on the same file."""
    import distgraph as dg

    t06 = _tutorial_06()
    written = dg.Cluster.from_file(t06.CLUSTER).to_dict()
    for link in written["links"]:
        link["bandwidth"] *= 10
    costly = json.loads(json.dumps(written))
    for machine in costly["machines"]:
        for device in machine["devices"]:
            device["reshard_overhead"] = {k: 1000.0 for k in
                                          ("all_gather", "all_reduce", "reduce_scatter",
                                           "all_to_all")}
    written, costly = dg.Cluster.from_dict(written), dg.Cluster.from_dict(costly)
    hand = _plan_of(t06, "dp x mp", written)
    assert _collectives(_plan_of(t06, "searched", written)) > _collectives(hand)
    searched = _plan_of(t06, "searched", costly)
    hand = _plan_of(t06, "dp x mp", costly)
    assert _collectives(searched) <= _collectives(hand)
    assert (dg.passes.estimate(searched, costly).step_time
            <= dg.passes.estimate(hand, costly).step_time * (1 + 1e-9))


def docstring_commands(tutorials: str = "0[1-5]_*.py"):
    """Every command the ``tutorials`` (a glob; default 01-05) tell a user to run (the
    indented ``python tutorials/...`` and ``distgraph run ... tutorials/...`` lines of
    their docstrings) that needs no file of the user's own."""
    commands = []
    for path in sorted((ROOT / "tutorials").glob(tutorials)):
        doc = path.read_text().split('"""')[1]
        for line in doc.splitlines():
            words = line.split("#")[0].split()
            if words[:1] in (["python"], ["distgraph"]) and any(
                    w.startswith("tutorials/") for w in words):
                if all(not w.endswith(".yaml") or (ROOT / w).exists() for w in words):
                    commands.append(" ".join(words))
    return commands


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("command", docstring_commands())
def test_each_command_a_tutorial_gives_runs(command, tmp_path):
    """What a newcomer does first: copy a command from a tutorial's docstring and run it
    from the repository's root. Each one ends well (``--steps 20`` of tutorial 04 once
    failed its own loss check)."""
    words = command.split()
    if "--out" in words:                     # written under the test's folder, not the repo
        words[words.index("--out") + 1] = str(tmp_path / words[words.index("--out") + 1])
    argv = ([sys.executable] + words[1:] if words[0] == "python"
            else [sys.executable, "-m", "distgraph.cli"] + words[1:])
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


def test_the_readmes_prepare_snippet_plans_the_first_script_from_one_process():
    """"What happens, stage by stage" (docs/programs.md): its snippet continues the first
    script (a GPT on a 2 x 2 mesh) and plans the 4-process job from one process. It gave the GPT float
    inputs of an MLP's shapes (a DTypeError in 'wte') and printed ``p.local(1)``, which
    an Engine on rank 0 does not compile (a PlanError)."""
    import distgraph as dg

    first = readme_block("## A first script")
    section = (ROOT / "docs" / "programs.md").read_text()
    section = section[section.index("What happens, stage by stage"):]
    snippet = section[section.index("```python\n") + 10:section.index("```\n", 10)]
    snippet = "\n".join(line for line in snippet.splitlines() if ".plot(" not in line)
    scope: dict = {}
    exec(first[:first.index("data = ")] + snippet, scope)       # noqa: S102 - the README's
    plan = scope["p"]
    assert plan.world_size == 4 and "reshard" in plan.explain()
    assert plan.local_alike(1).pretty().startswith("process ")
    with pytest.raises(dg.PlanError, match=r"local_alike\(1\) gives its ops and shapes"):
        plan.local(1)


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("command", docstring_commands("09_*.py"))
def test_each_command_of_tutorial_09_runs_and_the_loss_falls(command, tmp_path):
    """Tutorial 09's commands, its output under the test's folder: the user's text files
    are two of the repository's documents, ``--tensorboard`` writes where the test reads
    it back. Each prints the loss every quarter epoch: on the tutorial's own corpus
    falling quarter after quarter, the last printed loss under half the first step's
    (its exit code says the same of the last 10 steps), and the held-out guesses mostly
    right; on the user's files (this repository's README and design, which every change
    to them reshuffles) each quarter under the first step's loss and the last under the
    first quarter's: a later quarter may read harder text (4.690 then 4.824 once the
    README's counts changed)."""
    pytest.importorskip("datasets")
    pytest.importorskip("tokenizers")
    words = command.split() + ["--out", str(tmp_path / "out")]
    own = "--files" in words
    if own:
        at = words.index("--files")
        words[at + 1:at + 3] = [str(ROOT / "README.md"), str(ROOT / "docs" / "DESIGN.md")]
    if "--tensorboard" in words:
        pytest.importorskip("tensorboard")
        words[words.index("--tensorboard") + 1] = str(tmp_path / "tb")
    proc = subprocess.run([sys.executable, "-m", "distgraph.cli"] + words[1:], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    printed = [float(m) for m in re.findall(r"^step +\d+  loss ([0-9.]+)$", proc.stdout, re.M)]
    first, last = (float(x) for x in re.search(r"loss ([0-9.]+) -> ([0-9.]+) in \d+ steps",
                                               proc.stdout).groups())
    assert len(printed) >= 4, proc.stdout
    if own:
        assert max(printed) < first and printed[-1] < printed[0], proc.stdout
    else:
        assert printed == sorted(printed, reverse=True), proc.stdout
    assert "trained on 4 ranks (2 dp x 2 mp)" in proc.stdout
    if not own:
        assert printed[-1] < first / 2 and last < first / 2, proc.stdout
        right = int(re.search(r"(\d+)% right", proc.stdout).group(1))
        assert right > 50, proc.stdout
    if "--tensorboard" in words:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
        acc.Reload()
        assert len(acc.Scalars("train/loss")) == int(re.search(r"in (\d+) steps",
                                                                proc.stdout).group(1))


@pytest.mark.slow
@pytest.mark.mpi
def test_tutorial_03_under_run_plan_says_which_file_runs_and_that_nothing_was_searched(
        tmp_path, job_trace):
    """Tutorial 03's plan saved by ``distgraph plan --save``, then run by ``distgraph run
    --plan FILE``: rank 0 says once which file runs, with the step the file predicts, and
    that nothing was searched; no search report follows (it once printed one that looked
    like a fresh search), and the tutorial trains with the file's plan. Neither command
    leaves a process or a file of its jobs."""
    script = ROOT / "tutorials" / "03_auto_parallel.py"
    plan = tmp_path / "t03.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "distgraph.cli", "plan", str(script), "-n",
                           "4", "--save", str(plan)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    step = json.loads(plan.read_text())["result"]["step_time"]
    proc = subprocess.run([sys.executable, "-m", "distgraph.cli", "run", "-n", "4", "--plan",
                           str(plan), str(script), "--steps", "10"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    said = [ln for ln in out.splitlines() if ln.startswith("distgraph: running the plan")]
    assert said == [f"distgraph: running the plan in {plan} (4 processes, 1 stage, 1 "
                    f"micro-batch, predicted step {step * 1e3:.3g} ms): read from the file, "
                    "nothing searched"], out
    for searched in ("search on ", "cluster local4", "hand-written plans"):
        assert searched not in out, out
    assert f"trained 10 steps on 4 ranks with the plan in {plan}: loss" in out, out
    job_trace.assert_nothing_left(ran_mpi=True)
