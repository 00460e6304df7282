"""The search restricted to what Megatron-LM runs (``Strategy(target="megatron")``) against
the unrestricted search, on GPT-3 175B / 1,024 A100s and Megatron-LM's Table 1 rows.

For each model: the unrestricted plan (``Strategy(auto_mode="full", pipeline=True,
micro_batches=M, recompute=True)``, as bench/plan_gpt3.py and bench/megatron_table1.py
plan it) and the same strategy with ``target="megatron"``; prints both predicted step
times, their ratio (restricted / unrestricted: >= 1, a restriction can only cost), the
restricted plan's ``plan.export("megatron")`` and whether the unrestricted plan exports
(and if not, why). Also Megatron's own (t, p) plan (Table 1's, and (8, 16) for GPT-3:
:func:`gpt_scale.megatron_plan`) priced and exported, as a check that the export reads
Megatron's layout back as its arguments.

Run::

    python bench/export_targets.py [--gpt3] [--rows 1.7B,39.1B] [--json OUT]

Timings on a shared 2-core machine are noisy: planning seconds are printed for scale.
"""

from __future__ import annotations

import argparse
import json
import time

import distgraph as dg
from gpt_scale import DGX_FILE, dgx_cluster, gpt, megatron_plan, program
from megatron_table1 import TABLE1


def exported(plan) -> str:
    try:
        return " ".join(plan.export("megatron"))
    except dg.DistGraphError as e:
        return f"not exportable: {str(e).split(': ', 2)[-1][:160]}"


def compare(name, layers, hidden, heads, batch, micro, cluster, time_limit, own=None) -> dict:
    out = {"model": name, "gpus": len(cluster.devices), "batch": batch, "micro_batches": micro}
    for key, target in (("unrestricted", None), ("megatron", "megatron")):
        strategy = dg.Strategy(auto_mode="full", pipeline=True, micro_batches=micro,
                               recompute=True, solver_time_limit=time_limit, target=target)
        built = program(gpt(layers, hidden, heads), batch)
        start = time.perf_counter()
        plan = dg.passes.plan(built, strategy, cluster, ranks=())
        out[key] = {"step_s": plan.estimate.step_time, "plan_s": time.perf_counter() - start,
                    "stages": [list(m.shape) for m in plan.stages],
                    "export": exported(plan)}
        del plan
    out["ratio"] = out["megatron"]["step_s"] / out["unrestricted"]["step_s"]
    if own is not None:
        plan = megatron_plan(layers, hidden, heads, *own, len(cluster.devices), batch, micro,
                             cluster)
        out["megatron_own"] = {"t": own[0], "p": own[1], "step_s": plan.estimate.step_time,
                               "export": exported(plan)}
    return out


def report(r: dict) -> str:
    u, m = r["unrestricted"], r["megatron"]
    lines = [f"{r['model']} on {r['gpus']} GPUs, batch {r['batch']}, M = {r['micro_batches']}: "
             f"target='megatron' step {m['step_s']:.3f} s / unrestricted {u['step_s']:.3f} s "
             f"= {r['ratio']:.4f} (planned in {m['plan_s']:.0f} s and {u['plan_s']:.0f} s)",
             f"  restricted ({len(m['stages'])} stages of {m['stages'][0]}): {m['export']}",
             f"  unrestricted ({len(u['stages'])} stages of {sorted(map(tuple, u['stages']))[0]}"
             f"..): {u['export']}"]
    if "megatron_own" in r:
        o = r["megatron_own"]
        lines.append(f"  Megatron's own (t={o['t']}, p={o['p']}) step {o['step_s']:.3f} s: "
                     f"{o['export']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpt3", action="store_true", help="GPT-3 175B on 1,024 A100s")
    parser.add_argument("--rows", default="", help="Table 1 rows, comma-separated")
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    results = []
    if args.gpt3:
        # Megatron's own: Narayanan et al.'s (t, p) = (8, 16) at dp = 8 for this model
        r = compare("GPT-3 175B", 96, 12288, 96, 1536, 192, dg.Cluster.from_file(DGX_FILE),
                    args.time_limit, own=(8, 16))
        results.append(r)
        print(report(r), flush=True)
    for row in [r for r in TABLE1 if r.name in args.rows.split(",")]:
        r = compare(row.name, row.layers, row.hidden, row.heads, row.batch, row.micro_batches,
                    dgx_cluster(row.gpus // 8), args.time_limit, own=(row.t, row.p))
        results.append(r)
        print(report(r), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
