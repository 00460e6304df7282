"""Published training runs in one table: each run's own layout priced by the planner
against the figure its authors published.

Every row is a run whose layout and speed were published; the bench gives the planner
that layout as annotations (tensor, pipeline and data parallel degrees, micro-batch,
global batch, sequence, recomputation, sequence parallelism: nothing searched) on the
machine the run used, described by one resource file, and compares the predicted
throughput with the published one, in the paper's own unit and FLOP count:

- **Narayanan et al. (SC'21), Table 1** ("Efficient Large-Scale Language Model Training
  on GPU Clusters Using Megatron-LM"): ten GPT rows, 1.7B on 32 A100s to 1T on 3,072,
  sequence 2048, vocabulary 51,200, full recomputation, one sequence per micro-batch;
  published TFLOP/s per GPU with F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) (recomputation
  counted). The rows are ``bench/megatron_table1.py``'s.
- **GPT-3 175B on 1,024 A100s, batch 1,536** (the same paper, section 5.1: 140 TFLOP/s
  per GPU, same count). The paper gives no (t, p) for it: Table 1's layout for the same
  width (145.6B, h = 12,288: t 8, p 8) is used, dp 16, one sequence per micro-batch.
- **Korthikanti et al. 2022** ("Reducing Activation Recomputation in Large Transformer
  Models", arXiv 2205.05198), configurations of its Table 3 (as recalled from the paper:
  the table itself could not be read from a source in this session, its MFU figures
  could), sequence parallelism and selective recomputation ("present work"), data
  parallel size 1 (NVIDIA/Megatron-LM's README says so of these figures): 22B (64 heads,
  h 6,144, 48 layers, t 8, p 1, 8 GPUs, batch 4, micro-batch 4), 175B (96, 12,288, 96, t
  8, p 8, 64 GPUs, batch 64), 530B (128, 20,480, 105, t 8, p 35, 280 GPUs, batch 280),
  1T (160, 25,600, 128, t 8, p 64, 512 GPUs, batch 512), micro-batch 1 for the last
  three. Published model FLOPs utilisation (MFU) 41.5%, 51.4%, 56.0%, 56.3% (the paper's
  end-to-end table, repeated in NVIDIA/Megatron-LM's README beside HFU 43.7, 52.8, 57.0,
  57.0%), with model FLOPs 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) (recomputation not
  counted) over the A100's 312 TFLOP/s bfloat16 peak (datasheet).
- **OPT-175B** (Zhang et al. 2022, "OPT: Open Pre-trained Transformer Language Models",
  section 2.4): 992 80 GB A100s, Megatron tensor parallelism 8 with fully sharded data
  parallelism (dp 124), activation checkpointing, "up to 147 TFLOP/s per GPU"; batch 2M
  tokens (Table 1): 8 sequences of 2,048 per replica, 992 in all; vocabulary 50,272. The
  paper names no micro-batch: one micro-batch of the replica's 8 sequences. Its FLOP
  count is not stated: Narayanan's (recomputation counted) is used. FSDP is asked for as
  ZeRO-3 (``sharding=True`` with the optimizer's ``sharding_level`` 3, FSDP's full
  sharding: parameters, states and updates split over dp, each parameter gathered where
  it is used); dp = 124 divides none of the weights' dims, so each is padded along one
  (FSDP pads flat buffers); FSDP reduces the gradients during the backward and gathers
  the next block's parameters ahead, and so the row is planned with
  ``Strategy(overlap=True)`` (the padded gradients, made by the update's pads, are
  reduced after it).
- **Llama 3 405B** (Meta, "The Llama 3 Herd of Models", 2024, Table 4): the three rows of
  ``bench/plan_llama3.py`` (8K and 16K H100s, sequence 8K; 16K H100s, sequence 128K
  with CP 16), published TFLOP/s per GPU 430, 400, 380, with that bench's layout (Meta's
  TP, CP, PP, DP, eight interleaved chunks per stage) and count (6 N T + 12 l d s T);
  Meta overlaps the data-parallel reductions with the backward (``Strategy(overlap=True)``,
  that bench's default).

Overlap as published: Megatron-LM as Narayanan et al. and Korthikanti et al. ran it
reduced the gradients over dp after the backward (``--overlap-grad-reduce`` came to
Megatron-LM later), so those rows are planned with ``Strategy(overlap=False)``; OPT's
FSDP and Llama 3's runs overlapped it (``overlap=True``).

MegaScale's (Jiang et al., NSDI'24) Megatron-LM baseline rows are not in the table: its
Tables 2-3 (per-row MFU, layouts and the machine's figures) could not be read from a
source here; only the abstract's 55.2% MFU for MegaScale on 12,288 GPUs, "1.34x" over
Megatron-LM, was.

The GPT rows' model is ``bench/gpt_scale.py``'s Megatron GPT with its attention scores'
scale, causal mask and softmax as one op (``ops.scaled_masked_softmax``), as Megatron-LM
runs them (FusedScaleMaskSoftmax, ``--masked-softmax-fusion``, on by default).

Machines: the A100 runs on DGX A100 nodes as ``resources/clusters/dgx_a100_1024.yaml``
describes them (Selene; OPT's Azure NDm A100 v4 nodes are the same node: eight 80 GB
A100s on NVSwitch, eight 200 Gb/s HDR HCAs), that file's node copied to the row's GPU
count (:func:`gpt_scale.dgx_cluster`); the Llama rows on ``resources/clusters/
h100_16384.yaml`` (its first 8,192 GPUs for row a).

Prints per row: the published figure (unit as published, source), the prediction, the
error (predicted / published - 1), the step split (compute, communication, bubble) and
the peak memory; then the mean |error|. Targets: each row within +-10%, mean |error| <=
5% (exit status 1 when missed). ``--searched`` also plans ``Strategy(auto_mode="full",
pipeline=True)``, nothing else set, on the same model (unannotated), batch and cluster
(the micro-batch count, recomputation, ZeRO sharding and sequence parallelism are the
search's), and prints its predicted throughput over the published layout's; the Llama
rows too (``bench/plan_llama3.py``'s own search keeps Meta's micro-batch count,
recomputation, ZeRO and chunks).

``--mtnlg-states`` prints instead what ZeRO's sharding of the optimizer states leaves on
each GPU of MT-NLG 530B's first stage (Smith et al. 2022, "Using DeepSpeed and Megatron
to Train Megatron-Turing NLG 530B": 105 layers, h 20,480, 128 heads, t 8, p 35, batch
1,920, sequence 2,048, ZeRO stage 1 over dp) at dp 8 (2,240 GPUs) and dp 12 (3,360
GPUs), with the ratio against 8/12; dp 12 divides none of the 20,480-wide dims, so those
tensors are padded (their padding's bytes are printed).

Run::

    python bench/published_runs.py [--rows 22B,OPT-175B | --sources korthikanti,opt]
                                   [--searched] [--json OUT] [--mtnlg-states]

Timings on a shared 2-core machine are noisy; the Llama rows plan 8K-16K GPUs and take
minutes each.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass

import distgraph as dg
from gpt_scale import (SEQ, VOCAB, dgx_cluster, gpt, megatron_plan, model_flops, program,
                       with_core)
from megatron_table1 import TABLE1

A100_PEAK_TFLOPS = 312.0     # A100 bfloat16 dense tensor-core peak (datasheet), for MFU
WITHIN, MEAN_WITHIN = 0.10, 0.05
RECOMPUTE_KINDS = ("full", "selective", "none")


@dataclass(frozen=True)
class Run:
    """One published run: a GPT of (heads, hidden, layers) on ``gpus`` A100s in the
    layout (t, p, dp), ``micro`` sequences per micro-batch per replica, ``batch``
    sequences a step; ``published`` in ``metric`` ("tflops": model TFLOP/s per GPU with
    Narayanan's count; "mfu": percent of the peak with Korthikanti's count)."""

    name: str
    source: str
    heads: int
    hidden: int
    layers: int
    t: int
    p: int
    dp: int
    micro: int
    batch: int
    published: float
    metric: str
    recompute: str = "full"
    sp: bool = False
    sharding: bool = False
    sharding_level: int = 0
    overlap: bool = False
    vocab: int = VOCAB
    seq: int = SEQ

    def __post_init__(self):
        if self.metric not in ("tflops", "mfu") or self.recompute not in RECOMPUTE_KINDS:
            raise ValueError(f"{self.name}: metric {self.metric!r}, recompute "
                             f"{self.recompute!r}")

    @property
    def gpus(self) -> int:
        return self.t * self.p * self.dp

    @property
    def micro_batches(self) -> int:
        """Micro-batches a step: global batch = micro x micro-batches x dp."""
        return self.batch // (self.micro * self.dp)

    @property
    def layout(self) -> str:
        saver = {"full": "full recompute", "selective": "selective recompute",
                 "none": "no recompute"}[self.recompute]
        return (f"t{self.t} p{self.p} dp{self.dp} mb{self.micro} x{self.micro_batches} "
                f"B{self.batch} s{self.seq}, {saver}{', SP' if self.sp else ''}"
                f"{', ZeRO' if self.sharding else ''}"
                f"{f'-{self.sharding_level}' if self.sharding_level else ''}"
                f"{', overlap' if self.overlap else ''}")

    def model_flops(self) -> float:
        """The FLOPs of one step as the source counts them."""
        b, s, n, h, v = self.batch, self.seq, self.layers, self.hidden, self.vocab
        if self.metric == "mfu":                      # Korthikanti: no recomputation
            return 72.0 * b * s * n * h ** 2 * (1 + s / (6 * h) + v / (12 * n * h))
        return model_flops(b, n, h, s, v)           # Narayanan: recomputation counted

    def figure(self, step_time: float) -> float:
        """The predicted figure in the published unit, for a step of ``step_time``."""
        per_gpu = self.model_flops() / step_time / self.gpus / 1e12
        return 100.0 * per_gpu / A100_PEAK_TFLOPS if self.metric == "mfu" else per_gpu


NARAYANAN = "Narayanan et al. SC'21, Table 1"
KORTHIKANTI = "Korthikanti et al. 2022, SP + selective (MFU)"
OPT = "Zhang et al. 2022 (OPT), sec. 2.4"
LLAMA3 = "Llama 3 (Meta 2024), Table 4"

GPT_RUNS = tuple(
    Run(r.name, NARAYANAN, r.heads, r.hidden, r.layers, r.t, r.p, r.dp, 1, r.batch,
        r.published, "tflops") for r in TABLE1) + (
    Run("GPT-3 175B", "Narayanan et al. SC'21, sec. 5.1", 96, 12288, 96, 8, 8, 16, 1,
        1536, 140.0, "tflops"),
    Run("22B", KORTHIKANTI, 64, 6144, 48, 8, 1, 1, 4, 4, 41.5, "mfu", "selective", True),
    Run("175B", KORTHIKANTI, 96, 12288, 96, 8, 8, 1, 1, 64, 51.4, "mfu", "selective", True),
    Run("530B", KORTHIKANTI, 128, 20480, 105, 8, 35, 1, 1, 280, 56.0, "mfu", "selective",
        True),
    Run("1T", KORTHIKANTI, 160, 25600, 128, 8, 64, 1, 1, 512, 56.3, "mfu", "selective",
        True),
    Run("OPT-175B", OPT, 96, 12288, 96, 8, 1, 124, 8, 992, 147.0, "tflops", "full",
        sharding=True, sharding_level=3, overlap=True, vocab=50272),
)
LLAMA_ROWS = {"Llama3 405B a": "a", "Llama3 405B b": "b", "Llama3 405B c": "c"}
SOURCES = {       # --sources key: the rows it names
    "narayanan": tuple(r.name for r in GPT_RUNS if r.source.startswith("Narayanan")),
    "korthikanti": tuple(r.name for r in GPT_RUNS if r.source == KORTHIKANTI),
    "opt": tuple(r.name for r in GPT_RUNS if r.source == OPT),
    "llama3": tuple(LLAMA_ROWS),
}


def estimate_of(plan):
    return plan.estimate or dg.passes.estimate(plan)


def summary(run_figure, est, wall: float, cpu: float) -> dict:
    return {"predicted": run_figure(est.step_time), "step_s": est.step_time,
            "compute_s": est.compute, "communication_s": est.communication,
            "bubble_s": est.bubble,
            "peak_gb": max(p.peak_memory for p in est.processes) / 1e9,
            "wall_s": wall, "cpu_s": cpu}


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def plan_gpt(run: Run, searched: bool, time_limit: float) -> dict:
    """The run's layout planned on its DGX A100 nodes; with ``searched`` the search's
    plan of the same program too."""
    cluster = dgx_cluster(run.gpus // 8)

    # Planned as laid out, process i on GPU i (t inside a node, as the layout's ids are),
    # then priced on the cluster: the run's placement is part of its layout, and the
    # estimate's memory is reported, not enforced (the run did fit).
    plan, wall, cpu = timed(lambda: megatron_plan(
        run.layers, run.hidden, run.heads, run.t, run.p, run.gpus, run.batch,
        run.micro_batches, None,
        recompute={"full": True, "none": False}.get(run.recompute, "selective"),
        sequence_parallel=run.sp, sharding=run.sharding, vocab=run.vocab,
        fused_softmax=True, overlap=run.overlap, sharding_level=run.sharding_level))
    est = dg.passes.estimate(plan, cluster)
    out = summary(run.figure, est, wall, cpu)
    del plan
    if searched:
        model = gpt(run.layers, run.hidden, run.heads, vocab=run.vocab)
        with_core(model, fused=True)        # the layout's model: Megatron's fused softmax
        # the strategy a user writes first: micro-batches, recomputation, ZeRO sharding
        # and sequence parallelism all left to the search
        strategy = dg.Strategy(auto_mode="full", pipeline=True, solver_time_limit=time_limit)
        built = program(model, run.batch)
        try:
            plan, wall, cpu = timed(lambda: dg.passes.plan(built, strategy, cluster,
                                                           ranks=()))
            out["searched"] = summary(run.figure, estimate_of(plan), wall, cpu)
        except dg.errors.DoesNotFit as e:      # the search's answer, printed as such
            out["searched"] = {"refused": str(e)}
    return out


def plan_llama(name: str, searched: bool, h100) -> dict:
    """A Llama 3 row through ``bench/plan_llama3.py`` (Meta's layout; the search)."""
    import plan_llama3 as ll          # heavy: only when a Llama row is asked for

    case = ll.CASES[LLAMA_ROWS[name]]
    machine = ll.machine_of(h100, case["gpus"])
    meta = ll.plan_meta(LLAMA_ROWS[name], machine, 8)
    out = {"predicted": meta["tflops_per_gpu"], "step_s": meta["step_s"],
           "compute_s": meta["compute_s"], "communication_s": meta["communication_s"],
           "bubble_s": meta["bubble_s"], "peak_gb": meta["peak_gb"],
           "wall_s": meta["plan_s"], "cpu_s": meta["plan_cpu_s"],
           "published": case["published"],
           "layout": f"t{case['tp']} cp{case['cp']} p{case['pp']} dp{case['dp']} mb1 "
                     f"x{meta['micro_batches']} s{case['seq']}, 8 chunks, full recompute, "
                     "ZeRO"}
    if searched:
        # the strategy a user writes first, as for the GPT rows (plan_llama3.py's own
        # searched plan gives Meta's micro-batches, recomputation, ZeRO and chunks)
        c, built = ll.build(case, annotate=False)
        strategy = dg.Strategy(auto_mode="full", pipeline=True)
        try:
            plan, wall, cpu = timed(lambda: dg.passes.plan(built, strategy, machine, ranks=()))
        except dg.errors.DoesNotFit as e:      # the search's answer, printed as such
            out["searched"] = {"refused": str(e)}
        else:
            found = ll.summarise(name, c, case, plan, machine, 0.0, wall, cpu, "searched")
            out["searched"] = {"predicted": found["tflops_per_gpu"], "wall_s": wall,
                               "cpu_s": cpu, "peak_gb": found["peak_gb"]}
    return out


MTNLG = dict(layers=105, hidden=20480, heads=128, t=8, p=35, batch=1920)


def first_stage_states(dp: int) -> dict:
    """MT-NLG 530B's layout at data-parallel size ``dp`` (one sequence per micro-batch,
    every block recomputed, ZeRO's sharding of the states over dp), planned and priced on
    its DGX A100 nodes: the first stage's optimizer states per GPU (the most of its
    processes), and of them the bytes of ZeRO's padding."""
    m = MTNLG
    gpus = m["t"] * m["p"] * dp
    plan = megatron_plan(m["layers"], m["hidden"], m["heads"], m["t"], m["p"], gpus,
                         m["batch"], m["batch"] // dp, None, recompute=True, sharding=True,
                         overlap=False)
    est = dg.passes.estimate(plan, dgx_cluster(gpus // 8))
    first = max((p for p in est.processes if p.stage == 0), key=lambda p: p.states)
    local = plan.local_alike(first.process).program
    padding = sum(v.nbytes * (1 - math.prod(plan.program.values[v.name].logical_shape)
                              / math.prod(plan.program.values[v.name].shape))
                  for v in local.persistables if not v.is_parameter)
    return {"dp": dp, "gpus": gpus, "states": first.states, "padding": padding,
            "peak": first.peak_memory}


def mtnlg_states() -> int:
    """Print :func:`first_stage_states` at dp 8 and 12; exit status 1 where dp 12 holds
    more than 8/12 of dp 8's."""
    eight, twelve = first_stage_states(8), first_stage_states(12)
    for r in (eight, twelve):
        print(f"MT-NLG 530B t8 p35 dp{r['dp']:<2} ({r['gpus']:,} GPUs): first stage's optimizer "
              f"states {r['states']:,} B = {r['states'] / 1e9:.4f} GB per GPU (ZeRO's padding "
              f"{r['padding'] / 1e6:.2f} MB), peak {r['peak'] / 1e9:.1f} GB")
    ratio = twelve["states"] / eight["states"]
    print(f"dp 12 / dp 8: {ratio:.6f} (8/12 = {8 / 12:.6f}); without the padding "
          f"{(twelve['states'] - twelve['padding']) / eight['states']:.6f}")
    return 0 if ratio <= 8 / 12 else 1


def row_line(name: str, source: str, layout: str, unit: str, r: dict) -> str:
    err = r["predicted"] / r["published"] - 1
    line = (f"{name:>13} | {layout:<52} | {r['published']:6.1f} {unit:<8} {source:<45} | "
            f"{r['predicted']:6.1f} | {100 * err:+6.1f}% | step {r['step_s']:7.2f} s = "
            f"{r['compute_s']:.2f} + {r['communication_s']:.2f} + {r['bubble_s']:.2f}; "
            f"peak {r['peak_gb']:5.1f} GB{'' if r['peak_gb'] <= 80 else ' (> 80)'}; "
            f"planned {r['wall_s']:.0f} s")
    found = r.get("searched")
    if found and "refused" in found:
        line += f" | searched: {found['refused']}"
    elif found:
        line += f" | searched / published layout {found['predicted'] / r['predicted']:.2f}"
    return line


def select(args) -> list:
    """The row names ``--rows`` and ``--sources`` ask for, in table order."""
    names = [r.name for r in GPT_RUNS] + list(LLAMA_ROWS)
    wanted = set(names)
    if args.rows:
        wanted = set(args.rows.split(","))
        if wanted - set(names):
            raise SystemExit(f"no rows {sorted(wanted - set(names))}; rows: "
                             f"{', '.join(names)}")
    if args.sources:
        keys = args.sources.split(",")
        if set(keys) - set(SOURCES):
            raise SystemExit(f"no sources {sorted(set(keys) - set(SOURCES))}; sources: "
                             f"{', '.join(SOURCES)}")
        wanted &= {n for k in keys for n in SOURCES[k]}
    return [n for n in names if n in wanted]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", help="comma-separated row names (default: all)")
    parser.add_argument("--sources", help=f"comma-separated, of {', '.join(SOURCES)}")
    parser.add_argument("--searched", action="store_true",
                        help="also plan Strategy(auto_mode='full', pipeline=True) per row")
    parser.add_argument("--time-limit", type=float, default=60.0,
                        help="seconds per intra-op search (--searched)")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--mtnlg-states", action="store_true",
                        help="print MT-NLG 530B's first-stage optimizer states at dp 8 and 12")
    args = parser.parse_args(argv)
    if args.mtnlg_states:
        return mtnlg_states()
    runs = {r.name: r for r in GPT_RUNS}
    h100 = None
    results = []
    print(f"{'row':>13} | {'layout (published)':<52} | published{'':<51} | "
          f"predicted | error | step = compute + comm + bubble")
    for name in select(args):
        if name in runs:
            run = runs[name]
            r = plan_gpt(run, args.searched, args.time_limit)
            r.update(published=run.published, layout=run.layout)
            source, unit = run.source, "MFU %" if run.metric == "mfu" else "TFLOP/s"
        else:
            if h100 is None:
                import plan_llama3 as ll
                h100 = dg.Cluster.from_file(ll.H100_FILE)
            r = plan_llama(name, args.searched, h100)
            source, unit = LLAMA3, "TFLOP/s"
        r.update(row=name, source=source, unit=unit,
                 error=r["predicted"] / r["published"] - 1)
        results.append(r)
        print(row_line(name, source, r["layout"], unit, r), flush=True)
    errors = [abs(r["error"]) for r in results]
    mean = sum(errors) / len(errors) if errors else 0.0
    missed = [f"{r['row']} {100 * r['error']:+.1f}%" for r in results
              if abs(r["error"]) > WITHIN]
    print(f"mean |error| {100 * mean:.1f}% over {len(results)} rows (target <= "
          f"{100 * MEAN_WITHIN:.0f}%); rows outside +-{100 * WITHIN:.0f}%: "
          + (", ".join(missed) if missed else "none"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 1 if missed or mean > MEAN_WITHIN else 0


if __name__ == "__main__":
    sys.exit(main())
