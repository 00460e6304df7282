"""The searches' outputs on a fixed corpus, pinned in tests/data/search_outputs.json for
tests/test_search_pinned.py: a change to the run DP's or the recursive search's plans
shows there, entry by entry, and a deliberate one is re-pinned with a reviewed diff.

    python tests/pin_search_outputs.py            # rewrite the file from the current code
    python tests/pin_search_outputs.py --check    # name the entries that differ (exit 1)

The corpus (each entry an answer of the code, floats as ``repr`` writes them, so a
change in the last bit shows):

* ``run_dp/random/<seed>/<fit_memory>``: :func:`~distgraph.passes.search.stages.run_dp.plan_runs`
  on the random cases of tests/test_run_dp.py (``random_case``, seeds 0-11, one and two
  device meshes, memory a limit or not): the stages (layers, mesh, shape, devices, time,
  memory), objective, caps solved (``dp_runs``) and the index of each stage's option.
* ``run_dp/twins/<seed>``: the same on those cases with a twin of every other option (as
  fast, twice the parameters, half the activations: ties for the walk, options the
  pruning keeps or drops) and the stages' transfers priced.
* ``recursive/random/<seed>``: :func:`~distgraph.passes.search.layouts.recursive.solve_recursive`
  on the random problems of tests/test_ilp.py (``random_problem``, seeds 0-149: budgets,
  aliases, ties, forbidden strategies), as drawn and under 0.8, 0.5 and 0.3 of the peak
  of its choice without a budget (the memory ladder): choice, objective, status, peak and
  note; where the ILP decided, its objective, status and note (SCIP's choice among equal
  ones is not the search's).
* ``recursive/gpt/<case>``: a 4-layer GPT planned with ``search="recursive"`` on DGX
  A100s through ``distgraph.passes.plan``: pipelined on two nodes (24 searches on meshes
  of one to three dims; the chosen stages' reports) and whole on one and two nodes,
  with and without a memory budget: the stage meshes and the search report (objectives,
  statuses, peaks, notes, every free op's layout), its timings and the planning's memo
  tables (what its session held and served: bookkeeping, not an answer) left out.

The cases are drawn by the helpers of tests/test_run_dp.py and tests/test_ilp.py: a
change there changes the corpus and needs a re-pin too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "bench"))

import distgraph as dg  # noqa: E402
from distgraph.passes.search.layouts.recursive import solve_recursive  # noqa: E402
from distgraph.passes.search.stages.run_dp import plan_runs  # noqa: E402
from distgraph.passes.search.stages.part_cost import PartCost  # noqa: E402
from distgraph.passes.search.stages.runs import RunOption  # noqa: E402

PINNED = os.path.join(HERE, "data", "search_outputs.json")
SHARES = (0.8, 0.5, 0.3)                # budgets: shares of the unbudgeted choice's peak
UNPINNED = {"seconds", "solve_time", "build_time", "memo_tables"}


def pinned(x):
    """``x`` as the file keeps it: floats as their ``repr``, tuples as lists."""
    if isinstance(x, dict):
        return {str(k): pinned(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [pinned(v) for v in x]
    if isinstance(x, (bool, str)) or x is None:
        return x
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        return repr(float(x))
    raise TypeError(f"cannot pin {type(x).__name__} {x!r}")


# the run DP

def run_dp_answer(options, count, blocks, cluster, B, fit_memory=True, p2p=None) -> dict:
    """plan_runs' plan as pinned, or the error it raised."""
    try:
        plan, chosen = plan_runs(count, blocks, options, cluster, B, fit_memory, p2p=p2p)
    except dg.PlanError:
        return {"refused": "PlanError"}
    return pinned({
        "objective": plan.objective, "dp_runs": plan.dp_runs,
        "micro_batches": plan.micro_batches,
        "options": [next(n for n, o in enumerate(options) if o is c) for c in chosen],
        "stages": [{"layers": [s.layers.start, s.layers.stop], "mesh": s.mesh,
                    "shape": s.shape, "devices": s.device_ids, "time": s.time,
                    "memory": s.memory} for s in plan.stages]})


def run_dp_random_case(seed: int) -> tuple:
    """(options, count, blocks, cluster, micro-batches) of ``run_dp/random/<seed>``."""
    from test_run_dp import random_case
    rng = np.random.default_rng(100 + seed)
    cluster, (options, count, blocks, B) = random_case(rng, seed)
    return options, count, blocks, cluster, B


def run_dp_random(seed: int, fit_memory: bool) -> dict:
    return run_dp_answer(*run_dp_random_case(seed), fit_memory)


def run_dp_twins(seed: int) -> dict:
    from test_run_dp import random_case
    rng = np.random.default_rng(1700 + seed)
    cluster, (options, count, blocks, B) = random_case(rng, seed)
    options += [RunOption(o.axis, o.sub, o.logical + (2,),
                          {k: (PartCost(c.time, c.persistent * 2, c.saved / 2, c.transient), r)
                           for k, (c, r) in o.parts.items()}) for o in options[::2]]
    return run_dp_answer(options, count, blocks, cluster, B,
                         p2p=lambda o: 0.05 * o.parts["block"][0].time)


# the recursive search

def recursive_answer(problem) -> dict:
    """solve_recursive's answer as pinned (the ILP's objective alone where it decided),
    or the error it raised."""
    try:
        sol, note = solve_recursive(problem, None, [])
    except dg.PlanError:
        return {"refused": "PlanError"}
    if note:
        return pinned({"objective": sol.objective, "status": sol.status, "note": note})
    return pinned({"choice": sol.choice, "objective": sol.objective, "status": sol.status,
                   "peak": sol.peak_memory, "note": note})


def recursive_random(seed: int) -> dict:
    from test_ilp import random_problem
    problem = random_problem(seed)
    out = {"as drawn": recursive_answer(problem)}
    free = dataclasses.replace(problem, memory_budget=None)
    try:
        peak = solve_recursive(free, None, [])[0].peak_memory
    except dg.PlanError:
        peak = 0.0
    if problem.liveness and peak > 0:
        for share in SHARES:
            out[f"{share} of the peak"] = recursive_answer(
                dataclasses.replace(problem, memory_budget=share * peak))
    return out


GPT_CASES = {       # name: (DGX nodes, Strategy options)
    "pipeline on 2 nodes": (2, {"pipeline": True, "micro_batches": 4}),
    "whole on 1 node": (1, {}),
    "whole on 1 node, 0.92 GB": (1, {"memory_budget_gb": 0.92}),
    "whole on 2 nodes": (2, {}),
    "whole on 2 nodes, 0.6 GB": (2, {"memory_budget_gb": 0.6}),
    "whole on 2 nodes, 0.5 GB": (2, {"memory_budget_gb": 0.5}),
}


def recursive_gpt_plan(case: str) -> tuple:
    """(the plan of GPT case ``case``, the cluster it is planned on)."""
    from gpt_scale import dgx_cluster, gpt, program
    nodes, options = GPT_CASES[case]
    before = dg.get_default_dtype()
    cluster = dgx_cluster(nodes)
    try:
        return dg.passes.plan(program(gpt(4, 256, 4), 8),
                              dg.Strategy(auto_mode="full", search="recursive",
                                          recompute=False, sharding=False,
                                          sequence_parallel=False, **options),
                              cluster, ranks=()), cluster
    finally:
        dg.set_default_dtype(before)        # gpt() plans in bfloat16


def recursive_gpt(case: str) -> dict:
    try:
        plan, _ = recursive_gpt_plan(case)
    except dg.PlanError:
        return {"refused": "PlanError"}
    return pinned({"stages": [str(m) for m in plan.stages],
                   "search": _untimed(plan.search.to_dict())})


def _untimed(x):
    if isinstance(x, dict):
        return {k: _untimed(v) for k, v in x.items() if k not in UNPINNED}
    if isinstance(x, list):
        return [_untimed(v) for v in x]
    return x


def corpus() -> dict:
    """{entry name: a function of no arguments that computes it}."""
    out = {}
    for seed in range(12):
        for fit in (True, False):
            out[f"run_dp/random/{seed}/{'fit' if fit else 'unlimited'}"] = \
                lambda seed=seed, fit=fit: run_dp_random(seed, fit)
    for seed in range(12):
        out[f"run_dp/twins/{seed}"] = lambda seed=seed: run_dp_twins(seed)
    for seed in range(150):
        out[f"recursive/random/{seed}"] = lambda seed=seed: recursive_random(seed)
    for case in GPT_CASES:
        out[f"recursive/gpt/{case}"] = lambda case=case: recursive_gpt(case)
    return out


def load() -> dict:
    with open(PINNED) as f:
        return json.load(f)


def dumps(x, indent: int = 0) -> str:
    """JSON with one line per list of scalars (a layout, a choice) and per dict of
    scalars and such lists (a stage, an answer), so a re-pin's diff shows what changed."""
    pad = " " * (indent + 1)

    def scalar(v):
        return not isinstance(v, (dict, list))
    if scalar(x) or isinstance(x, list) and all(map(scalar, x)) or \
            isinstance(x, dict) and all(scalar(v) or isinstance(v, list) and
                                        all(map(scalar, v)) for v in x.values()):
        return json.dumps(x)
    if isinstance(x, dict):
        items = [f"{pad}{json.dumps(k)}: {dumps(v, indent + 1)}" for k, v in x.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    return "[\n" + ",\n".join(pad + dumps(v, indent + 1) for v in x) + "\n" + \
        " " * indent + "]"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="compare with the pinned file instead of rewriting it")
    args = parser.parse_args(argv)
    found = {name: make() for name, make in corpus().items()}
    if args.check:
        kept = load()
        differ = sorted(set(found) ^ set(kept)) + [n for n in found if n in kept and
                                                   found[n] != kept[n]]
        print("\n".join(differ) or "same")
        return 1 if differ else 0
    os.makedirs(os.path.dirname(PINNED), exist_ok=True)
    with open(PINNED, "w") as f:
        f.write(dumps(found) + "\n")
    print(f"wrote {len(found)} entries to {os.path.relpath(PINNED)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
