"""Plans as files at scale: save and load time and file size, against the search's time.

Cases (each built lazily, planned on this machine):

- ``gpt3``: GPT-3 175B on the shipped 1,024-A100 file, searched as bench/plan_gpt3.py
  plans it (``Strategy(auto_mode="full", pipeline=True, micro_batches=192,
  recompute=True)``);
- ``llama``: Llama 3 405B on the shipped 16,384-H100 file (bench/plan_llama3.py's case
  b: sequence 8,192, 16M tokens): Meta's layout (TP 8, PP 16, DP 128, annotated, the
  identity rank mapping), and with ``--llama-search auto|recursive`` also the searched
  plan (the stage search; minutes on this machine).

Per plan it prints: the seconds planning took (the search where it searched), the
seconds ``plan.save`` took and the file's size (target < 5 MB), the seconds reading and
checking the file and making the plan from it took (:func:`distgraph.passes.plan_file.
load`: the prints checked, the program prepared, completed, partitioned, scheduled and
estimated; no search) and that time over planning's (target < 10% of the search's), and
whether the loaded plan equals the saved one (estimate, stages, micro-batches). Building
the program (the same for both) and reading the cluster file are timed apart.
``--to-json`` also prints the size of ``plan.to_json()`` (slow at 16,384 processes).

Timings on a shared 2-core machine are noisy: CPU seconds are printed beside wall.

Run: ``python bench/plan_file.py [--case gpt3|llama|all] [--llama-search auto|recursive]
[--to-json] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import distgraph as dg
from distgraph.passes.plan_file import load
from distgraph.plan.file import read

import gpt_scale                            # bench/ is on the path
import plan_llama3 as L


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def measure(name: str, build, strategy, cluster, folder: str, to_json: bool,
            rank_mapping=None) -> dict:
    """Plan (``build()`` gives the program), save, build again, load; the figures."""
    built, build_s, _ = timed(build)
    plan, plan_s, plan_cpu = timed(lambda: dg.passes.plan(
        built, strategy, cluster, rank_mapping=rank_mapping, ranks=()))
    path = os.path.join(folder, f"{name}.plan.json")
    _, save_s, _ = timed(lambda: plan.save(path))
    size = os.path.getsize(path)
    json_size = len(plan.to_json(indent=None)) if to_json else None
    again = build()                             # what a run with the file builds
    loaded, load_s, load_cpu = timed(lambda: load(read(path), again, cluster, ranks=()))
    same = (loaded.estimate.step_time == plan.estimate.step_time
            and loaded.stages == plan.stages and loaded.micro_batches == plan.micro_batches)
    searched = plan.search is not None
    row = {"case": name, "processes": plan.world_size, "ops": len(built.program.ops),
           "build_s": build_s, "plan_s": plan_s, "plan_cpu_s": plan_cpu,
           "searched": searched, "search_s": getattr(plan.search, "seconds", None),
           "save_s": save_s, "file_bytes": size, "to_json_bytes": json_size,
           "load_s": load_s, "load_cpu_s": load_cpu, "load_over_plan": load_s / plan_s,
           "same_plan": same, "stages": len(plan.stages),
           "micro_batches": plan.micro_batches, "step_time": plan.estimate.step_time}
    show(row)
    return row


def show(row: dict) -> None:
    how = "searched" if row["searched"] else "annotated (no search)"
    print(f"{row['case']}: {row['processes']:,} processes, {row['ops']:,} ops, {how}; "
          f"{row['stages']} stages, {row['micro_batches']} micro-batches, predicted step "
          f"{row['step_time']:.3f} s")
    print(f"  program built in {row['build_s']:.1f} s; planned in {row['plan_s']:.1f} s "
          f"wall ({row['plan_cpu_s']:.1f} s CPU)"
          + (f", of which the stage search {row['search_s']:.1f} s" if row["search_s"] else ""))
    print(f"  plan.save: {row['save_s']:.2f} s, file {row['file_bytes'] / 1e6:.3f} MB "
          f"(target < 5 MB: {'met' if row['file_bytes'] < 5e6 else 'NOT met'})"
          + (f"; plan.to_json() is {row['to_json_bytes'] / 1e6:.1f} MB"
             if row["to_json_bytes"] else ""))
    target = " (target < 0.10 of the search's: " + \
        ("met)" if row["load_over_plan"] < 0.10 else "NOT met)") if row["searched"] else ""
    print(f"  loaded (read, checked, planned without search) in {row['load_s']:.2f} s wall "
          f"({row['load_cpu_s']:.2f} s CPU): {row['load_over_plan']:.3f} of planning's "
          f"time{target}; the same plan: {row['same_plan']}")


def gpt3(folder: str, to_json: bool) -> list:
    cluster, load_s, _ = timed(lambda: dg.Cluster.from_file(gpt_scale.DGX_FILE))
    print(f"cluster file {os.path.basename(gpt_scale.DGX_FILE)} read in {load_s:.1f} s")
    strategy = dg.Strategy(auto_mode="full", pipeline=True, micro_batches=192,
                           recompute=True)

    def build():
        return gpt_scale.program(gpt_scale.gpt(96, 12288, 96), 1536)

    return [measure("GPT-3 175B on 1,024 A100", build, strategy, cluster, folder, to_json)]


def llama(folder: str, to_json: bool, search: str | None) -> list:
    cluster, load_s, _ = timed(lambda: dg.Cluster.from_file(L.H100_FILE))
    print(f"cluster file {os.path.basename(L.H100_FILE)} read in {load_s:.1f} s")
    case = L.CASES["b"]
    sequences = L.TOKENS // case["seq"]
    meta = dg.Strategy(micro_batches=sequences // case["dp"], recompute=True, sharding=True,
                       virtual_stages=8)
    rows = [measure("Llama 3 405B on 16,384 H100, Meta's layout",
                    lambda: L.build(case, annotate=True)[1], meta, cluster, folder, to_json,
                    rank_mapping=L.identity_mapping(cluster, case["gpus"]))]
    if search:
        searched = dg.Strategy(auto_mode="full", pipeline=True, micro_batches=sequences //
                               case["dp"], recompute=True, sharding=True,
                               sharding_mesh_dim=L.SEARCHED_DP, search=search,
                               virtual_stages=8)
        rows.append(measure("Llama 3 405B on 16,384 H100, searched",
                            lambda: L.build(case, annotate=False)[1], searched, cluster,
                            folder, to_json))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=("gpt3", "llama", "all"), default="all")
    parser.add_argument("--llama-search", choices=("auto", "recursive"), default=None,
                        help="also search Llama 3 405B's plan (minutes)")
    parser.add_argument("--to-json", action="store_true",
                        help="also measure plan.to_json()'s size")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="plan-files-") as folder:
        if args.case in ("gpt3", "all"):
            rows += gpt3(folder, args.to_json)
        if args.case in ("llama", "all"):
            rows += llama(folder, args.to_json, args.llama_search)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
