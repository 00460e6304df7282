"""Plan reports at scale: the page's size and how long a headless browser takes to draw it.

Cases (each built lazily and planned on this machine, as bench/plan_file.py plans them):

- ``gpt3``: GPT-3 175B on the shipped 1,024-A100 file, searched
  (``Strategy(auto_mode="full", pipeline=True, micro_batches=192, recompute=True)``;
  a minute or two of planning here);
- ``llama``: Llama 3 405B on the shipped 16,384-H100 file in Meta's layout (TP 8, PP 16,
  DP 128, 8 chunks a stage, annotated, the identity rank mapping; bench/plan_llama3.py's
  case b).

Per plan it prints the seconds ``plan.report`` took and the page's size (target < 5 MB),
then opens the page in Debian's ``chromium`` headless (``--dump-dom``) and prints: the
browser's wall time from start to the dumped page (its own start-up included); the
page's time from navigation to the end of its script (``data-ready-ms``: reading and
parsing the file, the data, drawing every SVG; target < 3 s), and the drawing alone
(``data-render-ms``); and whether the console stayed empty. With ``--screenshot DIR`` it
also writes each page's screenshot there.

Timings on a shared 2-core machine are noisy: CPU seconds are printed beside wall.

Run: ``python bench/plan_report.py [--case gpt3|llama|all] [--out DIR] [--screenshot DIR]
[--json OUT]`` (needs ``chromium``: ``apt-get install -y chromium``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import distgraph as dg  # noqa: E402

import browser  # noqa: E402    tests/browser.py: the headless chromium the tests use
import gpt_scale  # noqa: E402
import plan_llama3 as L  # noqa: E402
from plan_file import timed  # noqa: E402

SIZE_TARGET, READY_TARGET = 5e6, 3000.0


def measure(name: str, plan, folder: str, shots: str | None) -> dict:
    path = os.path.join(folder, f"{name.split()[0].lower()}.html")
    _, write_s, write_cpu = timed(lambda: plan.report(path))
    size = os.path.getsize(path)
    page = browser.dump_dom(path)
    row = {"case": name, "processes": plan.world_size, "stages": len(plan.stages),
           "micro_batches": plan.micro_batches, "report_s": write_s,
           "report_cpu_s": write_cpu, "bytes": size, "browser_s": page.seconds,
           "ready_ms": float(page.body["data-ready-ms"]),
           "render_ms": float(page.body["data-render-ms"]), "console": page.console}
    if shots:
        png = os.path.join(shots, os.path.basename(path).replace(".html", ".png"))
        browser.screenshot(path, png)
        row["screenshot"] = png
    show(row)
    return row


def show(row: dict) -> None:
    print(f"{row['case']}: {row['processes']:,} processes, {row['stages']} stages, "
          f"{row['micro_batches']} micro-batches")
    print(f"  plan.report: {row['report_s']:.2f} s wall ({row['report_cpu_s']:.2f} s CPU), "
          f"{row['bytes'] / 1e6:.2f} MB (target < 5 MB: "
          f"{'met' if row['bytes'] < SIZE_TARGET else 'NOT met'})")
    print(f"  chromium --headless --dump-dom: {row['browser_s']:.2f} s wall (start-up "
          f"included); the page ready {row['ready_ms'] / 1e3:.2f} s after navigation "
          f"(target < 3 s: {'met' if row['ready_ms'] < READY_TARGET else 'NOT met'}), of "
          f"which drawing {row['render_ms'] / 1e3:.2f} s; console "
          f"{'empty' if not row['console'] else row['console']}")


def gpt3(folder: str, shots) -> dict:
    cluster = dg.Cluster.from_file(gpt_scale.DGX_FILE)
    strategy = dg.Strategy(auto_mode="full", pipeline=True, micro_batches=192,
                           recompute=True)
    built = gpt_scale.program(gpt_scale.gpt(96, 12288, 96), 1536)
    plan, plan_s, plan_cpu = timed(lambda: dg.passes.plan(built, strategy, cluster, ranks=()))
    print(f"GPT-3 175B planned in {plan_s:.1f} s wall ({plan_cpu:.1f} s CPU)")
    return measure("GPT-3 175B on 1,024 A100", plan, folder, shots)


def llama(folder: str, shots) -> dict:
    cluster = dg.Cluster.from_file(L.H100_FILE)
    case = L.CASES["b"]
    sequences = L.TOKENS // case["seq"]
    meta = dg.Strategy(micro_batches=sequences // case["dp"], recompute=True, sharding=True,
                       virtual_stages=8)
    built = L.build(case, annotate=True)[1]
    plan, plan_s, plan_cpu = timed(lambda: dg.passes.plan(
        built, meta, cluster, rank_mapping=L.identity_mapping(cluster, case["gpus"]),
        ranks=()))
    print(f"Llama 3 405B planned in {plan_s:.1f} s wall ({plan_cpu:.1f} s CPU)")
    return measure("Llama 3 405B on 16,384 H100, Meta's layout", plan, folder, shots)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=("gpt3", "llama", "all"), default="all")
    parser.add_argument("--out", help="keep the pages in this folder (default: a temporary one)")
    parser.add_argument("--screenshot", metavar="DIR", help="also write screenshots there")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    if browser.CHROMIUM is None:
        sys.exit("plan_report: no chromium on PATH (apt-get install -y chromium)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="plan-reports-") as tmp:
        folder = args.out or tmp
        os.makedirs(folder, exist_ok=True)
        if args.screenshot:
            os.makedirs(args.screenshot, exist_ok=True)
        if args.case in ("gpt3", "all"):
            rows.append(gpt3(folder, args.screenshot))
        if args.case in ("llama", "all"):
            rows.append(llama(folder, args.screenshot))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
