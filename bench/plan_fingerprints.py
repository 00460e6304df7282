"""Fingerprints of the plans the planning benches make: to show that a change to the
planner leaves its plans as they were (or which parts of which plans it changed).

    python bench/plan_fingerprints.py --save before.json [--cases megatron,gpt3,llama3]
    ... change the planner ...
    python bench/plan_fingerprints.py --check before.json

A case is planned as its bench plans it: every row of Megatron-LM's Table 1 searched with
``search="auto"`` (bench/megatron_table1.py) and planned with Megatron's own layout,
GPT-3 175B through ``Engine.prepare`` with the micro-batch count searched
(``bench/plan_gpt3.py --engine``), Llama 3 405B's three cases searched
(bench/plan_llama3.py), and a 4-layer GPT pipeline searched on the shipped 4-rank file
(``resources/clusters/local4.yaml``: fixed figures, where ``Cluster.local(4)`` would read
this machine's calibration and print another estimate on every machine). Each plan is
cut into parts, each hashed (SHA-256 of a canonical text): the stage meshes, every op's
layout (mesh and specs), the micro-batch count and schedule, the rank mapping, the
estimate (every process's figures, floats as ``repr`` writes them: a change in the last
bit shows), and the local program of one process of each group of alike processes.
``--check`` prints, per case, "same" or the parts that differ, with the estimated step
before and after where the saved file has it (kept in clear beside the hashes), and exits
1 when any part differs.
Planning every case takes about 4 minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import distgraph as dg


# the plan's estimated seconds per step, kept as they are beside the hashes (not a part):
# what --check prints of a plan that changed, so that "none is slower" is read off
STEP = "step_time"
LOCAL4 = Path(__file__).resolve().parents[1] / "resources" / "clusters" / "local4.yaml"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def fingerprint(plan) -> dict:
    """{part: hash} of ``plan`` (module docstring)."""
    prog = plan.program
    layouts = "\n".join(
        f"{op.type} {op.layer} {list(op.dist_attr.mesh.process_ids)} "
        f"{[str(s) for s in op.dist_attr.input_specs]} "
        f"{[str(s) for s in op.dist_attr.output_specs]}" for op in prog.ops)
    est = plan.estimate or dg.passes.estimate(plan)     # a plan without one: as it would be
    estimate = json.dumps(
        {"step": repr(est.step_time), "compute": repr(est.compute),
         "communication": repr(est.communication), "bubble": repr(est.bubble),
         "processes": [[repr(x) for x in (p.process, p.device, p.stage, p.compute,
                                          p.communication, p.parameters, p.states,
                                          p.gradients, p.activations, p.saved_activations)]
                       for p in est.processes]})
    locals_ = "\n\n".join(plan.local_alike(g[0]).program.pretty() for g in plan.groups)
    return {"stages": _digest(repr([str(m) for m in plan.stages])),
            "layouts": _digest(layouts),
            "schedule": _digest(f"{plan.micro_batches} {plan.strategy.virtual_stages} "
                                + json.dumps({str(p): [str(a) for a in acts] for p, acts
                                              in plan.schedule().items()})),
            "ranks": _digest(repr(None if plan.rank_of is None
                                  else sorted(plan.rank_of.items()))),
            "estimate": _digest(estimate),
            "programs": _digest(locals_),
            STEP: est.step_time}


def _megatron_cases() -> dict:
    from megatron_table1 import TABLE1
    from gpt_scale import dgx_cluster, gpt, megatron_plan, program

    def searched(row):
        strategy = dg.Strategy(auto_mode="full", pipeline=True, micro_batches=row.micro_batches,
                               recompute=True, search="auto")
        built = program(gpt(row.layers, row.hidden, row.heads), row.batch)
        return dg.passes.plan(built, strategy, dgx_cluster(row.gpus // 8), ranks=())

    def megatron(row):
        return megatron_plan(row.layers, row.hidden, row.heads, row.t, row.p, row.gpus,
                             row.batch, row.micro_batches, dgx_cluster(row.gpus // 8))

    cases = {f"megatron {row.name} searched": (lambda row=row: searched(row)) for row in TABLE1}
    cases.update({f"megatron {row.name} megatron": (lambda row=row: megatron(row))
                  for row in TABLE1})
    return cases


def _gpt3_cases() -> dict:
    from gpt_scale import DGX_FILE, SEQ, gpt
    from plan_gpt3 import BATCH, HEADS, HIDDEN

    def engine():
        strategy = dg.Strategy(auto_mode="full", pipeline=True, micro_batches=None,
                               recompute=True)
        e = dg.Engine(gpt(96, HIDDEN, HEADS), dg.nn.CrossEntropyLoss(), dg.optim.AdamW(1e-4),
                      cluster=dg.Cluster.from_file(DGX_FILE), strategy=strategy)
        return e.prepare([dg.InputSpec([BATCH, SEQ], "int64", "tokens")],
                         [dg.InputSpec([BATCH, SEQ], "int64", "labels")])
    return {"gpt3 engine": engine}


def _llama3_cases() -> dict:
    import plan_llama3 as L

    def searched(name):
        case = L.CASES[name]
        cluster = L.machine_of(dg.Cluster.from_file(L.H100_FILE), case["gpus"])
        _, built = L.build(case, annotate=False)
        strategy = dg.Strategy(auto_mode="full", pipeline=True,
                               micro_batches=L.TOKENS // case["seq"] // case["dp"],
                               recompute=True, sharding=True,
                               sharding_mesh_dim=L.SEARCHED_DP, search="auto", virtual_stages=8)
        return dg.passes.plan(built, strategy, cluster, ranks=())
    return {f"llama3 {name}": (lambda name=name: searched(name)) for name in sorted(L.CASES)}


def _small_cases() -> dict:
    def gpt4():
        dg.set_default_dtype("float32")
        dg.seed(0)
        model = dg.nn.GPT(vocab_size=64, d_model=64, n_layer=4, n_head=4, max_seq_len=32)
        engine = dg.Engine(model, dg.nn.CrossEntropyLoss(), dg.optim.AdamW(1e-3),
                           cluster=dg.Cluster.from_file(LOCAL4),
                           strategy=dg.Strategy(auto_mode="full", pipeline=True, micro_batches=4))
        return engine.prepare([dg.InputSpec([16, 32], "int64", "tokens")],
                              [dg.InputSpec([16, 32], "int64", "labels")])
    return {"gpt 4 layers pipeline": gpt4}


GROUPS = {"small": _small_cases, "megatron": _megatron_cases, "gpt3": _gpt3_cases,
          "llama3": _llama3_cases}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--save", help="write the fingerprints to this JSON file")
    what.add_argument("--check", help="compare with the fingerprints in this JSON file")
    parser.add_argument("--cases", default=",".join(GROUPS),
                        help=f"groups of cases (default all: {','.join(GROUPS)})")
    parser.add_argument("--only", help="only the cases whose name contains this")
    args = parser.parse_args(argv)
    saved = {}
    if args.check:
        with open(args.check) as f:
            saved = json.load(f)
    found, differ = {}, 0
    for group in args.cases.split(","):
        for name, make in GROUPS[group]().items():
            if args.only and args.only not in name:
                continue
            start = time.process_time()
            dg.seed(0)          # a model's dropout seeds come from this generator: per case
            found[name] = fingerprint(make())
            seconds = time.process_time() - start
            if args.check:
                before = saved.get(name)
                if before is None:
                    verdict = "not in the saved file"
                else:
                    parts = [k for k in found[name]
                             if k != STEP and found[name][k] != before.get(k)]
                    verdict = "same" if not parts else "DIFFERS in " + ", ".join(parts)
                    if parts and STEP in before:
                        was, now = before[STEP], found[name][STEP]
                        verdict += (f"; step {was:.6g} -> {now:.6g} s "
                                    f"({(now - was) / was:+.2%})")
                    differ += bool(parts)
                print(f"{name}: {verdict} ({seconds:.1f} s CPU)", flush=True)
            else:
                print(f"{name}: {seconds:.1f} s CPU", flush=True)
    if args.save:
        with open(args.save, "w") as f:
            json.dump(found, f, indent=1, sort_keys=True)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
