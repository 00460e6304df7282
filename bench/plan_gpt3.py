"""GPT-3 175B planned for 1,024 A100 GPUs by the automatic search, on this machine.

GPT-3 (96 layers, d_model 12288, 96 heads, sequence 2048, vocabulary 51,200, global
batch 1,536, bfloat16 with AdamW's float32 master weights and moments, dropout 0.1),
built under ``dg.LazyGuard`` (no parameter memory), planned with
``Strategy(auto_mode="full", pipeline=True, micro_batches=M, recompute=True)`` on
``resources/clusters/dgx_a100_1024.yaml`` (128 DGX A100 nodes). The search chooses the
stages, each stage's submesh and its data x tensor split, and every op's layout.

Prints the seconds each phase took (building the program, planning: search,
completion and estimate), the chosen plan (tensor, pipeline and data parallel degrees,
micro-batch size and count, schedule, recomputation), its predicted step time and model
TFLOP/s per GPU with the paper's count F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)), and
the estimated peak memory of every device against its usable memory (its 80 GB less the
reserve the runtime's context, the communicators' buffers and the allocator's slack take:
by default 2 GB and 5%, 74 GB) and its memory. Targets: planning < 60 s end to end on this
machine (moonshot: < 20 s), peak <= 95% of the device's memory with the default reserve
(the reserve left free), and within the usable memory whatever the reserve
(``--reserved-memory 20``: 60 GB). Narayanan et al. (SC'21) report 140 TFLOP/s per GPU for
this model and machine.

The micro-batch count is given, as Megatron gives it: ``--micro-batches 192`` is
Megatron's micro-batch of one sequence per data-parallel replica at dp = 8; with it a
micro-batch is 8 sequences, split by the search.

``--micro-batches auto`` leaves the count to the search (``Strategy(micro_batches=None)``,
:mod:`distgraph.passes.search.stages.micro`); it is the default with ``--engine``.

``--recompute searched`` leaves recomputation to the search (``Strategy(recompute=None)``,
the default with ``auto_mode="full"``: none, the attention scores or whole blocks, the
plan of least estimated step time that fits; :mod:`distgraph.passes.fitting`); "none",
"selective" and "full" fix it. ``--memory-gb G`` gives every GPU G GB (40: the A100-40GB);
``--reserved-memory R`` gives every GPU a ``reserved_memory`` of R GB (default: the
file's, else the default for a GPU).
``--sharding`` and ``--sequence-parallel`` (searched, the default: ``Strategy(sharding=None,
sequence_parallel=None)``, chosen by price as recomputation is; on; off) set ZeRO sharding
over the data dims and sequence parallelism; off and off is the plan made before the
search chose them. ``--micro-batches auto --recompute searched`` is
``Strategy(auto_mode="full", pipeline=True)`` as a user leaves it.

With ``--engine`` the model goes through ``Engine.prepare`` as a user's script gives it
(``dg.Engine(model, CrossEntropyLoss(), AdamW, cluster=..., strategy=Strategy(
auto_mode="full", pipeline=True, micro_batches=None, recompute=True))``): the same
program and plan, and rank 0's process program compiled too.

Run::

    python bench/plan_gpt3.py [--micro-batches 192|auto] [--layers 96] [--search auto|ilp|recursive]
                              [--recompute full|selective|none|searched] [--memory-gb 40]
                              [--reserved-memory 20]
                              [--sharding searched|on|off] [--sequence-parallel searched|on|off]
                              [--engine] [--json OUT]

Timings on a shared 2-core machine are noisy: CPU seconds are printed beside wall.
"""

from __future__ import annotations

import argparse
import json
import time

import distgraph as dg
from gpt_scale import DGX_FILE, SEQ, degrees, gpt, model_flops, program

BATCH, HIDDEN, HEADS, PUBLISHED = 1536, 12288, 96, 140.0
RECOMPUTE = {"full": True, "selective": "selective", "none": False, "searched": None}
SAVER = {"searched": None, "on": True, "off": False}
RECOMPUTED = {True: "full recomputation of every block", False: "no recomputation",
              "selective": "the attention scores recomputed (selective)"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", default=None,
                        help="a count, or 'auto' (the search chooses; default with --engine, "
                             "else 192)")
    parser.add_argument("--layers", type=int, default=96)
    parser.add_argument("--cluster", default=DGX_FILE)
    parser.add_argument("--time-limit", type=float, default=60.0,
                        help="seconds per intra-op search")
    parser.add_argument("--search", choices=dg.strategy.SEARCHES, default="auto",
                        help="who chooses the layouts (Strategy.search)")
    parser.add_argument("--recompute", choices=tuple(RECOMPUTE), default="full",
                        help="recomputation (Strategy.recompute): 'searched' leaves it to the "
                             "search")
    parser.add_argument("--memory-gb", type=float, default=None,
                        help="every GPU's memory in GB (default: the cluster file's)")
    parser.add_argument("--reserved-memory", type=float, default=None,
                        help="every GPU's reserved_memory in GB (default: the file's, else "
                             "the default for a GPU)")
    for saver in ("--sharding", "--sequence-parallel"):
        parser.add_argument(saver, choices=tuple(SAVER), default="searched",
                            help="left to the search (default), or given")
    parser.add_argument("--engine", action="store_true",
                        help="plan through Engine.prepare, as a user's script does")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    given = args.micro_batches or ("auto" if args.engine else "192")
    micro = None if given == "auto" else int(given)
    wall, cpu = time.perf_counter(), time.process_time()
    cluster = dg.Cluster.from_file(args.cluster)
    figures = {k: v for k, v in (("memory", args.memory_gb),
                                 ("reserved_memory", args.reserved_memory)) if v is not None}
    if figures:
        data = cluster.to_dict()
        for machine in data["machines"]:
            for device in machine["devices"]:
                device.update(figures)
        cluster = dg.Cluster.from_dict(data, f"{args.cluster} with " + ", ".join(
            f"{k} {v:g} GB" for k, v in figures.items()))
    gpus = len(cluster.devices)
    loaded = time.perf_counter() - wall
    strategy = dg.Strategy(auto_mode="full", pipeline=True, micro_batches=micro,
                           recompute=RECOMPUTE[args.recompute],
                           sharding=SAVER[args.sharding],
                           sequence_parallel=SAVER[args.sequence_parallel],
                           solver_time_limit=args.time_limit,
                           search=args.search)
    if args.engine:
        engine = dg.Engine(gpt(args.layers, HIDDEN, HEADS), dg.nn.CrossEntropyLoss(),
                           dg.optim.AdamW(1e-4), cluster=cluster, strategy=strategy)
        start = time.perf_counter()
        plan = engine.prepare([dg.InputSpec([BATCH, SEQ], "int64", "tokens")],
                              [dg.InputSpec([BATCH, SEQ], "int64", "labels")])
        build_s, plan_s = 0.0, time.perf_counter() - start     # building is in prepare
        ops = len(plan.built.program.ops)
    else:
        built = program(gpt(args.layers, HIDDEN, HEADS), BATCH)
        build_s = time.perf_counter() - wall - loaded
        ops = len(built.program.ops)
        start = time.perf_counter()
        plan = dg.passes.plan(built, strategy, cluster, ranks=())   # planned, not run
        plan_s = time.perf_counter() - start
    total_wall, total_cpu = time.perf_counter() - wall, time.process_time() - cpu
    est, search = plan.estimate, plan.search
    d = degrees(plan)
    flops = model_flops(BATCH, args.layers, HIDDEN)
    tflops = flops / est.step_time / gpus / 1e12
    peak = max(p.peak_memory for p in est.processes) / 1e9
    chosen = plan.micro_batches
    rows = BATCH // chosen
    print(f"GPT-3 {args.layers} layers on {gpus} GPUs ({cluster.name}); training program of "
          f"{ops} ops; search={args.search!r}"
          + ("; through Engine.prepare (ops counted after planning)" if args.engine else ""))
    print(f"planned in {total_wall:.1f} s wall, {total_cpu:.1f} s CPU (target < 60 s, "
          f"moonshot < 20 s): cluster file {loaded:.1f} s, program {build_s:.1f} s, plan "
          f"{plan_s:.1f} s of which stage search {search.seconds:.1f} s "
          f"({search.searches} intra-op searches)")
    print(f"plan: pipeline p = {d['p']} stages, tensor t = {d['t']}, data dp = {d['dp']}; "
          f"{chosen} micro-batches ({'chosen by the search' if micro is None else 'given'}) "
          f"of {rows} sequences "
          f"({rows // max(d['dp'])} per data-parallel replica), schedule "
          f"{plan.strategy.schedule}, "
          f"{RECOMPUTED.get(plan.strategy.recompute, 'recomputation per stage (below)')}"
          f"{' (chosen by the search)' if args.recompute == 'searched' else ''}")
    for line in (line for note in plan.savers for line in note.lines()):
        print(f"  {line}")
    print("  " + str(search.stage_plan).replace("\n", "\n  "))
    print(f"predicted step {est.step_time:.2f} s (compute {est.compute:.2f} + communication "
          f"{est.communication:.2f} + bubble {est.bubble:.2f}); {tflops:.1f} model TFLOP/s "
          f"per GPU (published: {PUBLISHED:.0f}, ratio {tflops / PUBLISHED:.2f})")
    top = max(est.processes, key=lambda p: p.peak_memory)
    device = cluster.device(top.device)
    memory, usable = device.memory, device.usable_memory(plan.strategy.memory_budget_gb)
    print(f"peak memory {peak:.1f} GB per device at most, on device {device.global_id}: "
          f"{peak / memory:.1%} of its {memory:g} GB (target <= 95%: "
          f"{'met' if peak <= 0.95 * memory else 'NOT met'}), of the {usable:.4g} GB usable "
          f"(its {device.reserve:.4g} GB reserve left free): "
          f"{'met' if peak <= usable else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"wall_s": total_wall, "cpu_s": total_cpu, "plan_s": plan_s,
                       "degrees": d, "micro_batches": chosen, "micro_batches_given": micro,
                       "step_time": est.step_time, "tflops_per_gpu": tflops,
                       "peak_gb": peak, "search_s": search.seconds, "search": args.search,
                       "engine": args.engine, "recompute": plan.strategy.recompute,
                       "sharding": plan.strategy.sharding,
                       "sequence_parallel": plan.strategy.sequence_parallel,
                       "memory_gb": memory, "usable_gb": usable,
                       "reserved_gb": device.reserve,
                       "searches": search.searches}, f, indent=2)


if __name__ == "__main__":
    main()
