"""``Plan.report(path)``: one self-contained page, opened in a real browser.

Debian's ``chromium``, headless (tests/browser.py), loads each page from disk: its script
logs nothing on the console, the screenshot is not blank, and the figures the page shows
(read from the DOM the script left) are the estimate's, compared with oracles computed
here from ``plan.estimate`` (each stage's busiest process, each group of processes with
equal memory, the model FLOPs over the step time and the devices' peak). The browser's
checks are shown to fail where they must: a page whose script breaks logs the error and
draws next to nothing.

The predicted timeline is checked against the plan: each stage's lane runs the actions of
the plan's schedule in its order, none before the actions it reads (the task graph's
deps) nor while its processes are busy, for the seconds the estimate gives its task, and
a stage of one process is busy exactly its estimated compute + communication (the
estimate's seconds by task add up to them, for every schedule).

Without chromium (and not root to install it) the browser's tests skip, saying why.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "bench"))

import distgraph as dg  # noqa: E402
from distgraph.plan.kinds import TaskKind  # noqa: E402
from distgraph.plan.report import report_data  # noqa: E402

import browser  # noqa: E402
import test_explain as E  # noqa: E402
from user_scripts import run_command, write_script  # noqa: E402

ROOT = os.path.join(HERE, "..")

needs_browser = pytest.mark.skipif(
    browser.CHROMIUM is None, reason="no chromium on PATH: the test command installs it as "
    "root (apt-get install -y chromium); elsewhere install it to run these tests")
UNITS = {"s": 1.0, "ms": 1e-3, "B": 1.0, "kB": 1e3, "MB": 1e6, "GB": 1e9,
         "FLOP": 1.0, "kFLOP": 1e3, "MFLOP": 1e6, "GFLOP": 1e9, "TFLOP": 1e12,
         "PFLOP": 1e15, "MFLOP/s": 1e6, "GFLOP/s": 1e9, "TFLOP/s": 1e12, "%": 1e-2}
SCHEDULES = ("FThenB", "1F1B", "ZB")


@pytest.fixture(scope="module")
def pipeline():
    """GPT-tiny in four stages of one process, 4 micro-batches, zero bubble (forward,
    input and weight gradients), on Cluster.local(4); and its page."""
    plan, cluster = E.planned(("gpt", "four_stage", 4), micro_batches=4, schedule="ZB")
    return plan, cluster


@pytest.fixture(scope="module")
def page(pipeline, tmp_path_factory):
    plan, _ = pipeline
    path = tmp_path_factory.mktemp("page") / "plan.html"
    plan.report(path)
    return path


def shown(text: str) -> float:
    """The number a figure's text shows, in base units ("7.679 ms" -> 0.007679)."""
    match = re.fullmatch(r"(-?[\d.e+-]+)\s*(\S*)", text)
    assert match, text
    return float(match[1]) * UNITS.get(match[2], 1.0)


def check_figure(figures, key, expected, digits=3):
    """Figure ``key`` carries ``expected`` exactly and shows it to its ``digits``
    significant digits (within half of the last one)."""
    value, text = figures[key]
    assert float(value) == pytest.approx(expected, rel=1e-12), key
    assert shown(text) == pytest.approx(expected, rel=0.5 * 10 ** (1 - digits),
                                        abs=1e-12), (key, text)


# ---- the page in the browser ----------------------------------------------------------------

@needs_browser
def test_the_page_loads_draws_and_logs_nothing(page, tmp_path):
    """Opened from disk: no network, the script runs to its end without a console line,
    and the screenshot is mostly drawn (a blank page is one colour)."""
    html = page.read_text()
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in html and "<link" not in html and " src=" not in html
    loaded = browser.dump_dom(page)
    assert loaded.console == []
    assert loaded.body.get("data-rendered") == "1"
    png = tmp_path / "plan.png"
    assert browser.screenshot(page, png) == []
    assert browser.inked(png) > 0.05


@needs_browser
def test_a_page_whose_script_breaks_is_caught(page, tmp_path):
    """The planted fault: the page's data without its totals. The script stops with a
    TypeError, which the console check sees, and the screenshot is all but blank."""
    broken = tmp_path / "broken.html"
    broken.write_text(page.read_text().replace('"totals":', '"totalz":', 1))
    loaded = browser.dump_dom(broken)
    assert any("Uncaught TypeError" in line for line in loaded.console), loaded.console
    assert "data-rendered" not in loaded.body
    png = tmp_path / "broken.png"
    browser.screenshot(broken, png)
    assert browser.inked(png) < 0.01


@needs_browser
def test_the_figures_shown_are_the_estimates(pipeline, page):
    plan, cluster = pipeline
    est = plan.estimate
    figures = browser.dump_dom(page).figures
    for key in ("step_time", "compute", "communication", "bubble"):
        check_figure(figures, key, getattr(est, key), digits=4)
    check_figure(figures, "predicted_step", est.step_time, digits=4)
    top = max(est.processes, key=lambda p: p.peak_memory)
    check_figure(figures, "peak_memory", top.peak_memory)
    device = cluster.devices[plan.ranks(top.process)]      # a CPU: all of it usable
    check_figure(figures, "usable_memory", device.memory * 1e9)
    check_figure(figures, "device_memory", device.memory * 1e9)
    flops = sum(E.oracle_flops(plan).values())
    check_figure(figures, "flops", flops, digits=4)
    peak = sum(d.flops("float32") for d in cluster.devices[:plan.world_size])
    check_figure(figures, "mfu", flops / est.step_time / peak, digits=2)
    for s, mesh in enumerate(plan.stages):          # each stage's busiest process
        mine = [p for p in est.processes if p.process in mesh.process_ids]
        top = max(mine, key=lambda p: p.compute + p.communication)
        check_figure(figures, f"stage:{s}:compute", top.compute, digits=4)
        check_figure(figures, f"stage:{s}:communication", top.communication, digits=4)
        check_figure(figures, f"stage:{s}:bubble",
                     est.step_time - top.compute - top.communication, digits=4)
    # every process's memory is one row's, and every row some processes'
    rows = {i: {k: float(figures[f"memory:{i}:{k}"][0]) for k in
                ("parameters", "states", "gradients", "activations", "workspace", "peak",
                 "memory")}
            for i in range(len(est.processes)) if f"memory:{i}:peak" in figures}
    wanted = {(p.parameters, p.states, p.gradients, p.activations, p.workspace, p.peak_memory,
               cluster.devices[plan.ranks(p.process)].memory * 1e9) for p in est.processes}
    assert {tuple(r.values()) for r in rows.values()} == wanted
    for i, row in rows.items():
        for key, value in row.items():
            check_figure(figures, f"memory:{i}:{key}", value)


@needs_browser
def test_a_plan_without_estimate_or_cluster_says_so(tmp_path):
    """A serial plan made without a cluster has no estimate: the page loads clean, draws
    no timeline, memory or cluster, and says how to get them."""
    plan = dg.passes.plan(E.built_of("mlp"), dg.Strategy(), None)
    assert plan.estimate is None and plan.cluster is None
    path = tmp_path / "bare.html"
    plan.report(path)
    loaded = browser.dump_dom(path)
    assert loaded.console == [] and loaded.body.get("data-rendered") == "1"
    drawn = loaded.html.split('<main id="report">')[1].split("</main>")[0]
    assert "This plan has no estimate" in drawn
    assert "step_time" not in loaded.figures and "Pipeline schedule" not in drawn
    assert "<svg" not in drawn
    check_figure(loaded.figures, "flops", sum(E.oracle_flops(plan).values()), digits=4)


@needs_browser
def test_a_1024_process_plan_is_drawn_grouped(tmp_path):
    """A 1,024-process Megatron plan on the DGX A100 file: the cluster as a grid of its
    128 machines (no single link), memory as one bar per group of alike processes; the
    page loads clean and shows the estimate."""
    from gpt_scale import DGX_FILE, megatron_plan

    cluster = dg.Cluster.from_file(DGX_FILE)
    before = dg.get_default_dtype()
    try:
        plan = megatron_plan(4, 1024, 16, 8, 4, 1024, 256, 4, cluster)
    finally:
        dg.set_default_dtype(before)      # gpt_scale plans in bfloat16 and leaves it set
    est = dg.passes.estimate(plan, cluster)
    path = tmp_path / "big.html"
    plan.report(path, estimate=est, cluster=cluster)
    data = report_data(plan, est, cluster)
    assert data["cluster"]["links"] is None and len(data["cluster"]["machines"]) == 128
    assert sum(m["stages"].count(s) for m in data["cluster"]["machines"]
               for s in range(4)) == 1024
    assert 4 <= len(data["memory"]["groups"]) < 64
    # an 80 GB A100 leaves 74 GB usable by default (2 GB and 5% reserved): every bar's line
    assert {(g["usable"], g["memory"]) for g in data["memory"]["groups"]} == {(74e9, 80e9)}
    loaded = browser.dump_dom(path)
    assert loaded.console == [] and loaded.body.get("data-rendered") == "1"
    check_figure(loaded.figures, "step_time", est.step_time, digits=4)
    check_figure(loaded.figures, "usable_memory", 74e9)
    check_figure(loaded.figures, "device_memory", 80e9)


@needs_browser
def test_the_savers_chosen_and_every_alternative_priced(tmp_path):
    """A searched plan that left ZeRO and sequence parallelism to the search: each saver's
    table shows the value chosen and every other value with the peak and step time the
    search priced (``Plan.savers``)."""
    from test_searched_savers import _gpt, cluster_of, planned

    plan = planned(_gpt(2), cluster_of(4, 1e12))
    assert {c.option for c in plan.savers} >= {"sharding", "sequence_parallel"}
    path = tmp_path / "savers.html"
    plan.report(path)
    loaded = browser.dump_dom(path)
    assert loaded.console == []
    for c in plan.savers:
        rows = [(c.peak, c.seconds)] + [(peak, seconds) for _, peak, seconds in c.others]
        for j, (peak, seconds) in enumerate(rows):
            if peak is not None:
                check_figure(loaded.figures, f"saver:{c.option}:{j}:peak", peak)
            if seconds is not None:
                check_figure(loaded.figures, f"saver:{c.option}:{j}:seconds", seconds, 4)
        assert c.lines()[0] in loaded.html
    zero = next(c for c in plan.savers if c.option == "sharding")
    unpriced = dataclasses.replace(zero, others=())      # a choice with nothing else priced
    notes = report_data(dataclasses.replace(plan, savers=(unpriced,)))["savers"][0]["notes"]
    assert notes == [unpriced.lines()[1].strip()] and notes[0].startswith("(weighed per update")


# ---- the predicted timeline -------------------------------------------------------------------

@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_estimates_task_seconds_add_up(schedule):
    plan, _ = E.planned(("gpt", "four_stage", 4), micro_batches=4, schedule=schedule)
    for p in plan.estimate.processes:
        assert sum(t.compute for t in p.tasks) == pytest.approx(p.compute, rel=1e-9)
        assert sum(t.communication for t in p.tasks) == pytest.approx(p.communication,
                                                                       rel=1e-9, abs=1e-15)
        kinds = {TaskKind(t.kind) for t in p.tasks}
        assert TaskKind.FORWARD in kinds and TaskKind.UPDATE in kinds


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_lane_runs_the_schedule_at_the_estimates_seconds(schedule):
    plan, _ = E.planned(("gpt", "four_stage", 4), micro_batches=4, schedule=schedule)
    est = plan.estimate
    predicted = report_data(plan)["predicted"]
    lanes = predicted["lanes"]
    slack = 1e-5 * predicted["makespan"]        # the page's figures keep 6 digits
    assert [lane["stage"] for lane in lanes] == list(range(len(plan.stages)))
    ends: dict = {}
    for lane, mesh in zip(lanes, plan.stages):
        (pid,) = mesh.process_ids
        order = plan.order.of(pid)
        spans = lane["spans"]
        assert [("FBIW"[k], c, m) for _, _, k, c, m, _ in spans] == \
            [(a.kind, a.chunk, a.micro_batch) for a in order]
        for (start, took, *_), (later, *_) in zip(spans, spans[1:]):
            assert later >= start + took - slack          # one action at a time
        p = next(q for q in est.processes if q.process == pid)
        # a stage of one process is busy exactly its estimated step's work
        assert lane["busy"] == pytest.approx(p.compute + p.communication, rel=1e-5)
        for a, (start, took, *_rest) in zip(order, spans):
            ends[a.chunk, a.kind, a.micro_batch] = (start, start + took)
    for (c, kind, m), (start, _) in ends.items():     # nothing before what it reads
        for dc, dkind in plan.graph.deps.get((c, kind), ()):
            assert start >= ends[dc, dkind, m][1] - slack


def test_a_measured_timeline_from_its_trace_file(pipeline, tmp_path):
    """A Chrome trace as Timeline.save writes it: one lane per rank, its last step; a file
    that is not one is a DistGraphError naming it."""
    plan, _ = pipeline
    events = [{"name": f"{kind} {m}", "ph": "X", "pid": r, "tid": 0, "ts": 0, "dur": 0,
               "args": {"rank": r, "stage": r, "kind": kind, "micro_batch": m, "step": step,
                        "start": 10.0 * step + 0.1 * m + (0.05 if kind == "backward" else 0),
                        "end": 10.0 * step + 0.1 * m + 0.04 + (0.05 if kind == "backward"
                                                               else 0), "peer": None}}
              for step in (0, 1) for r in range(4) for m in range(4)
              for kind in ("forward", "backward")]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    data = report_data(plan, timeline=str(trace))["measured"]
    assert data["step"] == 1 and [lane["rank"] for lane in data["lanes"]] == [0, 1, 2, 3]
    assert len(data["lanes"][0]["spans"]) == 8
    assert data["makespan"] == pytest.approx(0.3 + 0.05 + 0.04)
    bad = tmp_path / "not-a-trace.json"
    bad.write_text("{}")
    with pytest.raises(dg.DistGraphError, match="not-a-trace.json"):
        report_data(plan, timeline=str(bad))


def test_an_unwritable_page_is_one_error(pipeline, tmp_path):
    plan, _ = pipeline
    with pytest.raises(dg.DistGraphError, match="cannot write the plan's report to"):
        plan.report(tmp_path / "no-such-folder" / "plan.html")


# ---- the commands -------------------------------------------------------------------------------

@needs_browser
def test_distgraph_plan_writes_the_page_of_the_estimate_it_prints(tmp_path):
    """``distgraph plan SCRIPT -n 4 --report PAGE``: the page shows the estimate the
    command reports (priced on this machine as 4 processes), and loads clean."""
    page = tmp_path / "plan.html"
    proc = subprocess.run([sys.executable, "-m", "distgraph.cli", "plan",
                           os.path.join(ROOT, "tutorials", "04_pipeline.py"), "-n", "4",
                           "--json", "--report", str(page)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["page"]["path"] == str(page) and data["page"]["bytes"] == page.stat().st_size
    loaded = browser.dump_dom(page)
    assert loaded.console == [] and loaded.body.get("data-rendered") == "1"
    check_figure(loaded.figures, "step_time", data["estimate"]["step_time"], digits=4)
    busiest = max(data["estimate"]["processes"],
                  key=lambda p: p["compute"] + p["communication"])
    check_figure(loaded.figures, "compute", busiest["compute"], digits=4)


RUN_SCRIPT = """
    import os
    import sys
    import distgraph as dg
    sys.path.insert(0, {tests!r})
    import plans as P

    page = {page!r}

    class PageFirst(dg.callbacks.Callback):
        def on_train_begin(self, logs=None):
            if self.engine.rank == 0:
                print(f"page before training: {{os.path.exists(page)}}", flush=True)

    model = P.build_model("mlp4")
    P.PIPELINE_PLANS["mlp4", "layered", 2].annotate(model)
    engine = dg.Engine(model, P.loss_fn("mlp4"), dg.optim.SGD(0.1),
                       strategy=dg.Strategy(micro_batches=4, profile=True))
    engine.fit(P.Dataset("mlp4"), batch_size=P.BATCH, callbacks=[PageFirst()], verbose=0)
"""


@needs_browser
@pytest.mark.mpi
def test_distgraph_run_writes_the_page_before_training_and_what_it_measured(tmp_path):
    """``distgraph run -n 2 --report PAGE`` on a two-stage pipeline: rank 0 writes the page
    before the first step, and again after the fit (``Strategy(profile=True)``) with the
    run's timeline: a lane per rank of its last step, beside the prediction."""
    page = tmp_path / "run.html"
    script = write_script(tmp_path, RUN_SCRIPT.format(tests=HERE, page=str(page)))
    rc, out = run_command([sys.executable, "-m", "distgraph.cli", "run", "-n", "2",
                           "--report", str(page), str(script)], timeout=300)
    assert rc == 0, out
    assert "page before training: True" in out
    loaded = browser.dump_dom(page)
    assert loaded.console == [] and loaded.body.get("data-rendered") == "1"
    assert {"predicted_step", "replayed_step", "measured_step"} <= set(loaded.figures)
    assert 0 < float(loaded.figures["measured_step"][0]) < 60



def test_distgraph_run_refuses_a_page_it_cannot_write_before_any_rank_starts(tmp_path):
    script = write_script(tmp_path, "raise SystemExit('started: the page was not checked')")
    rc, out = run_command([sys.executable, "-m", "distgraph.cli", "run", "-n", "2",
                           "--report", str(tmp_path / "missing" / "run.html"), str(script)])
    assert rc == 2 and "started" not in out
    assert f"--report {tmp_path / 'missing' / 'run.html'}: {tmp_path / 'missing'} is not a " \
           "folder this user can write" in out
