"""``Plan.explain()`` on every plan: the summary says the right things and stays small, and
``explain(full=True)`` keeps the full listing.

Plans: the plan matrix of tests/plans.py (dp, tp, dp x tp, ZeRO, MeshSlice, stages) on
``Cluster.local(n)`` and on the resource files; pipelines under every schedule (FThenB,
1F1B, ZB, interleaved virtual stages, ZBV); every search (SCIP ILP, recursive, auto;
with and without the stage search; a model of identical blocks and one not, and an
interleaved searched pipeline with recomputation); a Mixtral with its experts split
(expert parallel, all-to-alls inside moe_ffn); a context-parallel Llama; and a
1,024-process Megatron plan of a lazy bfloat16 GPT on the DGX A100 file.

The oracles are computed here from the plan, not read from the summary's code: the
largest peak of the estimate against the device's memory from the cluster, each stage's
devices as ranges, the busiest process's bytes, and the model FLOPs (the registry's
FLOPs of the forward, loss and backward ops, times the micro-batches, without
recomputation's copies), TFLOP/s per device and MFU = FLOPs / step time / the devices'
peak FLOP/s of the compute dtype.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "bench"))

import distgraph as dg  # noqa: E402
import distgraph.app.data  # noqa: E402,F401 (dg.app.data.DataLoader)
from distgraph.ir import Role  # noqa: E402
from distgraph.placement import DistAttr, ShardSpec  # noqa: E402
from distgraph.program_builder import build_program  # noqa: E402
from distgraph.registry import op_flops  # noqa: E402
from distgraph.units import fmt_bytes, fmt_ids  # noqa: E402

import plans as P  # noqa: E402
import search_cases as S  # noqa: E402

CLUSTERS = os.path.join(HERE, "..", "resources", "clusters")
WIDTH = 160            # no line of the summary is wider
PER_STAGE = 40         # lines per stage at most
BATCH = 16
ALL = {**P.PLANS, **P.PIPELINE_PLANS}
UNIT = {"": 1.0, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}


# ---- making plans ------------------------------------------------------------------------

def built_of(kind, model=None, batch=BATCH, dims=None):
    model = model or P.build_model(kind, dims=dims)
    data = P.Dataset(kind, batch=batch, dims=dims)
    ins, labels = dg.app.data.DataLoader(data, batch).specs(1)
    return build_program(model, ins, labels, P.loss_fn(kind), dg.optim.AdamW(0.01))


def planned(key, cluster=None, **strategy):
    """(plan, cluster) of plan ``key`` of tests/plans.py on ``cluster`` (default
    ``Cluster.local(n)``)."""
    kind, _, n = key
    model = P.build_model(kind)
    ALL[key].annotate(model)
    cluster = cluster or dg.Cluster.local(n)
    strategy.setdefault("sharding", ALL[key].sharding)
    return dg.passes.plan(built_of(kind, model), dg.Strategy(**strategy), cluster), cluster


# ---- oracles -------------------------------------------------------------------------------

def oracle_flops(plan, mesh=None) -> dict:
    """{dtype: model FLOPs per step} of the plan (of the ops on ``mesh``'s processes):
    the forward, loss and backward ops' registry FLOPs at global shapes, times the
    micro-batches, recomputation's copies (results named ...@RECOMPUTE) left out."""
    out: dict = {}
    for op in plan.program.ops:
        if op.role not in (Role.FORWARD, Role.LOSS, Role.BACKWARD):
            continue
        if op.outputs and all(o.name.endswith("@RECOMPUTE") for o in op.outputs):
            continue
        if mesh is not None and not set(op.dist_attr.mesh.process_ids) <= \
                set(mesh.process_ids):
            continue
        dtype = op.outputs[0].dtype
        out[dtype] = out.get(dtype, 0.0) + op_flops(op) * plan.micro_batches
    return out


def runs(ids) -> str:
    """Sorted ids as the summary writes a set that has no stride: ``a-b`` for three or
    more consecutive, else each one."""
    ids = sorted(ids)
    parts, start = [], 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or ids[k] != ids[k - 1] + 1:
            run = ids[start:k]
            parts += [f"{run[0]}-{run[-1]}"] if len(run) >= 3 else [str(i) for i in run]
            start = k
    return ", ".join(parts)


def number(text: str, unit: str) -> float:
    """``"53.19 TFLOP"`` -> 5.319e13 (``unit``: FLOP or FLOP/s)."""
    m = re.fullmatch(rf"([\d.e+-]+) ([kMGTP]?){re.escape(unit)}", text)
    assert m, text
    return float(m.group(1)) * UNIT[m.group(2)]


def sections(lines) -> dict:
    """{stage: its lines} of a summary."""
    out, current = {}, None
    for line in lines:
        m = re.match(r"  stage (\d+): mesh", line)
        if m:
            current = int(m.group(1))
            out[current] = []
        elif not line.startswith("    "):
            current = None
        if current is not None:
            out[current].append(line)
    return out


def check_summary(plan, estimate=None, cluster=None) -> str:
    """The summary's claims against the oracles; returns its text."""
    text = plan.explain(estimate=estimate, cluster=cluster)
    est = estimate if estimate is not None else plan.estimate
    cluster = cluster if cluster is not None else plan.cluster
    lines = text.splitlines()
    assert max(len(x) for x in lines) <= WIDTH, max(lines, key=len)
    assert len(lines) <= PER_STAGE * len(plan.stages)
    head = lines[0]
    assert head.startswith(f"Plan: {plan.world_size} process(es), "
                           f"{'distributed' if plan.distributed else 'serial'}, "
                           f"{len(plan.stages)} stage")
    assert f", {plan.micro_batches} micro-batch" in head
    assert f"schedule {plan.strategy.schedule}" in head
    if len(plan.graph.chunks) != len(plan.stages):
        assert f" of {len(plan.graph.chunks)} chunks" in head

    def device(q):
        return cluster.devices[plan.ranks(q)]

    def usable(q):
        """Bytes process q's device may hold: its memory less its reserve (the file's, else
        5% and 2 GB on an accelerator, at most half; none on a CPU), at most the budget."""
        d = device(q)
        reserve = d.reserved_memory
        if reserve is None:
            reserve = 0.0 if d.type == "CPU" else min(2 + 0.05 * d.memory, d.memory / 2)
        budget = plan.strategy.memory_budget_gb
        return min(d.memory - reserve, math.inf if budget is None else budget) * 1e9

    # one unit for every size: decimal bytes, as the resource file's GB
    assert not re.search(r"\d (KiB|MiB|GiB)\b", text)
    if est is None:
        assert "memory not estimated" in head
    elif cluster is None:
        peak = max(p.peak_memory for p in est.processes)
        assert f"memory not estimated against devices (no cluster); largest peak " \
            f"{fmt_bytes(peak)}" in head
    else:
        peak = max(p.peak_memory for p in est.processes)
        over = [p for p in est.processes if p.peak_memory > usable(p.process)]
        top = next(p for p in est.processes if p.peak_memory == peak)
        verdict = "fits its devices" if not over else "does NOT fit"
        assert f"; {verdict}: largest peak {fmt_bytes(peak)} of " \
            f"{fmt_bytes(usable(top.process))} usable (" in head
        memory = device(top.process).memory * 1e9
        said = [x for x in lines[1:3] if x.startswith("  usable memory ")]
        if usable(top.process) < memory:      # why less than the device's: one line says
            assert said[0].startswith(f"  usable memory {fmt_bytes(usable(top.process))}: "
                                      f"the device's {fmt_bytes(memory)} ")
        else:
            assert not said
        if over:
            assert lines[1] == "  over their device's usable memory: process" + \
                ("es " if len(over) > 1 else " ") + runs(p.process for p in over)
    by_stage = sections(lines)
    assert sorted(by_stage) == list(range(len(plan.stages)))
    figures = {} if est is None else {p.process: p for p in est.processes}
    for s, mesh in enumerate(plan.stages):
        block = "\n".join(by_stage[s])
        assert len(by_stage[s]) <= PER_STAGE
        assert block.startswith(f"  stage {s}: mesh {list(mesh.shape)} "
                                f"({', '.join(mesh.dim_names)}), process")
        devices = [device(q).global_id for q in mesh.process_ids] if cluster else []
        many = "s" if len(devices) > 1 else ""
        if cluster is not None:
            assert f" on device{many} {runs(devices)} (" in block
        for c, chunk_mesh in enumerate(plan.graph.chunks):
            assert (f"chunk {c}:" in block) == (chunk_mesh == mesh)
        for q in mesh.process_ids:
            if q in figures:
                assert f"peak {fmt_bytes(figures[q].peak_memory)}" in block
        flops = sum(oracle_flops(plan, mesh).values())
        m = re.search(r"model FLOPs (\S+ \w*FLOP) per step", block)
        assert number(m.group(1), "FLOP") == pytest.approx(flops, rel=5e-4)
    sent = plan.bytes_sent() if plan.distributed else {}
    if sent:
        busiest = max(sum(kinds.values()) for kinds in sent.values())
        assert f"sends {fmt_bytes(busiest)} per step" in text
    check_throughput(plan, text, est, cluster)
    assert text.splitlines()[-1].endswith("plan.explain(full=True)")
    return text


def check_throughput(plan, text, est, cluster) -> None:
    """Model FLOPs, TFLOP/s per device and MFU of the whole plan."""
    flops = oracle_flops(plan)
    total = sum(flops.values())
    assert plan.model_flops() == pytest.approx(total, rel=1e-12)
    m = re.search(r"\n  model FLOPs (\S+ \w*FLOP) per step(.*)", text)
    assert number(m.group(1), "FLOP") == pytest.approx(total, rel=5e-4)
    if est is None:
        assert "step time not estimated" in text
        return
    dtype = max(flops, key=flops.get)
    rate = re.match(r": (\S+ \w*FLOP/s) per device, MFU ([\d.]+|not known)", m.group(2))
    per_device = total / est.step_time / plan.world_size
    assert number(rate.group(1), "FLOP/s") == pytest.approx(per_device, rel=5e-3)
    if cluster is None:
        assert rate.group(2) == "not known"
        return
    peak = sum(cluster.devices[plan.ranks(q)].flops(dtype) for q in plan.process_ids)
    assert float(rate.group(2)) == pytest.approx(100 * total / est.step_time / peak,
                                                 abs=0.0051)
    assert f"step {est.step_time * 1e3:.4g} ms predicted" in text or \
        f"step {est.step_time:.4g} s predicted" in text


def check_full(plan, estimate=None) -> str:
    """The full listing: every rank, parameter, reshard point, the schedule, each
    process's estimate, the search's whole report."""
    full = plan.explain(full=True, estimate=estimate)
    est = estimate if estimate is not None else plan.estimate
    assert full.startswith(f"Plan: {plan.world_size} process(es), ")
    if plan.rank_of is not None:
        for p, r in plan.rank_of.items():
            assert f"process {p} -> rank {r}" in full
    for v in plan.program.parameters:
        assert f"      {v.name} {list(v.shape)} {v.dist_attr.spec}\n" in full
    for point in (plan.reshards() if plan.distributed else []):
        assert f"    {point} ({fmt_bytes(point.bytes)})" in full
    assert "  " + plan.order.pretty().replace("\n", "\n  ") in full
    if est is not None:
        for p in est.processes:
            assert f"process {p.process} (device {p.device}, stage {p.stage}): " in full
    if plan.search is not None:
        assert "  " + str(plan.search).replace("\n", "\n  ") in full
    return full


def check(plan, estimate=None, cluster=None) -> str:
    json.dumps(plan.to_dict())
    check_full(plan, estimate)
    return check_summary(plan, estimate, cluster)


# ---- the plan matrix ----------------------------------------------------------------------

@pytest.mark.parametrize("key", sorted(P.PLANS), ids=lambda k: "-".join(map(str, k)))
def test_every_plan_of_the_matrix(key):
    plan, cluster = planned(key)
    est = dg.passes.estimate(plan, cluster)
    text = check(plan, est, cluster)
    if ALL[key].sharding:       # ZeRO: the states split beyond their parameters
        assert "optimizer states also split over dp (ZeRO)" in text
    if plan.sliced:
        assert f"MeshSlice: {len(plan.sliced)} matmul(s)" in text
    # without an estimate, it says so and still counts the model FLOPs
    check_summary(plan)


PIPELINES = [(("mlp4", "four_stage", 4), s, 1) for s in ("FThenB", "1F1B", "ZB")]
PIPELINES += [(("gpt", "four_stage", 4), "1F1B", 1), (("gpt", "two_stage_tp", 4), "ZB", 1),
              (("mlp", "two_stage_tp", 4), "FThenB", 1), (("gpt", "param4_dp", 8), "1F1B", 1),
              (("gpt6", "layered", 4), "1F1B", 2), (("gpt6", "layered", 4), "ZBV", 1),
              (("mlp8", "layered", 4), "ZB", 2), (("mlp8", "layered", 4), "ZBV", 1),
              (("gpt", "layered", 2), "1F1B", 2)]


@pytest.mark.parametrize("key, schedule, virtual", PIPELINES,
                         ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_pipelines_under_every_schedule(key, schedule, virtual):
    plan, cluster = planned(key, micro_batches=8, schedule=schedule, virtual_stages=virtual)
    est = dg.passes.estimate(plan, cluster)
    text = check(plan, est, cluster)
    assert f"gradient accumulation: 8 micro-batches of {BATCH // 8} rows" in text
    if schedule == "ZBV" or virtual > 1:          # two chunks per stage
        assert f"{len(plan.stages)} stages of {2 * len(plan.stages)} chunks" in text


@pytest.mark.parametrize("name", ["local4.yaml", "emulated_2x2.yaml", "emulated_mixed_2x2.yaml",
                                  "gpu_2x8.yaml", "hetero_2gpu_2xpu.yaml", "paddle_2x8.json"])
@pytest.mark.parametrize("key, strategy", [(("gpt", "dp_tp", 4), {}),
                                           (("mlp", "two_stage", 4), {"micro_batches": 4})],
                         ids=["gpt-dp_tp", "mlp-two_stage"])
def test_plans_on_the_resource_files(name, key, strategy):
    cluster = dg.Cluster.from_file(os.path.join(CLUSTERS, name))
    plan, _ = planned(key, cluster, **strategy)
    est = dg.passes.estimate(plan, cluster)
    text = check(plan, est, cluster)
    models = {cluster.devices[plan.ranks(q)].model for q in plan.process_ids}
    assert all(m in text for m in models if m.lower() != "cpu")


def test_a_plan_over_its_devices_memory_says_so():
    plan, _ = planned(("gpt", "dp", 2))
    data = dg.Cluster.local(2).to_dict()
    for machine in data["machines"]:
        for d in machine["devices"]:
            d["memory"] = 1e-5                   # 10 kB: less than any process's peak
    small = dg.Cluster.from_dict(data)
    est = dg.passes.estimate(plan, small)
    assert min(p.peak_memory for p in est.processes) > 1e4
    lines = check_summary(plan, est, small).splitlines()
    assert "does NOT fit: largest peak" in lines[0]
    assert lines[1] == "  over their device's usable memory: processes 0, 1"
    no_cluster = check_summary(dataclasses.replace(plan, cluster=None), est)
    assert "memory not estimated against devices (no cluster)" in no_cluster
    assert "MFU not known (no cluster)" in no_cluster


def gpus_of(memory_gb: float, reserved_gb: float | None = None, n: int = 2):
    """``n`` GPUs of ``memory_gb`` on one machine, ``reserved_memory`` as given."""
    data = dg.Cluster.local(n).to_dict()
    for machine in data["machines"]:
        for d in machine["devices"]:
            d.update(type="GPU", model="G", memory=memory_gb)
            if reserved_gb is not None:
                d["reserved_memory"] = reserved_gb
    return dg.Cluster.from_dict(data)


def test_explain_says_peak_usable_and_device_memory_in_one_unit():
    """A GPU's reserve: the first line holds the peak against the usable memory and the
    next says the device's memory and what it leaves out, all in decimal bytes; a peak
    between the usable and the device's memory does not fit."""
    plan, _ = planned(("gpt", "dp", 2))
    peak = dg.passes.estimate(plan, dg.Cluster.local(2)).peak_memory
    gpus = gpus_of(80, 20)
    lines = check_summary(plan, dg.passes.estimate(plan, gpus), gpus).splitlines()
    assert lines[0].endswith(f"fits its devices: largest peak {fmt_bytes(peak)} of 60 GB usable "
                             f"({peak / 60e9:.1%})")
    assert lines[1] == ("  usable memory 60 GB: the device's 80 GB less 20 GB reserved (the "
                        "runtime's context, the communicators' buffers, the allocator's slack)")
    assert "(GPU G, 80 GB, 60 GB usable)" in "\n".join(lines)
    # the default reserve of an accelerator: 5% and 2 GB of a 40 GB GPU
    forty = gpus_of(40)
    assert " of 36 GB usable (" in check_summary(plan, dg.passes.estimate(plan, forty),
                                                  forty).splitlines()[0]
    # device memory above the peak, usable memory below it: the plan does not fit
    tight = gpus_of(2 * peak / 1e9, reserved_gb=1.5 * peak / 1e9)
    lines = check_summary(plan, dg.passes.estimate(plan, tight), tight).splitlines()
    assert "does NOT fit: largest peak" in lines[0]
    assert lines[1] == "  over their device's usable memory: processes 0, 1"
    assert lines[2].startswith(f"  usable memory {fmt_bytes(0.5 * peak)}: the device's "
                               f"{fmt_bytes(2 * peak)} less {fmt_bytes(1.5 * peak)} reserved")


def test_a_serial_plan():
    plan = dg.passes.plan(built_of("mlp"))
    text = check(plan)
    assert text.startswith("Plan: 1 process(es), serial, 1 stage, 1 micro-batch, ")
    assert "memory not estimated" in text and "reshard points" not in text


# ---- every search ---------------------------------------------------------------------------

def gpt_blocks(layers=4):
    """PlanGPT of ``layers`` identical blocks (the stage search's block layering)."""
    dims = dict(P.GPT_DIMS, n_layer=layers)
    return built_of("gpt", P.build_model("gpt", dims=dims), dims=dims)


SEARCHES = [(kind, method, pipeline) for kind in ("gpt", "mlp4")
            for method in ("ilp", "recursive", "auto") for pipeline in (False, True)]


def _search_id(v):
    return str(v) if not isinstance(v, bool) else ("pipeline" if v else "one_mesh")


@pytest.mark.parametrize("kind, method, pipeline", SEARCHES, ids=_search_id)
def test_every_search(kind, method, pipeline):
    built = gpt_blocks() if kind == "gpt" else built_of(kind)
    options = dict(pipeline=True, micro_batches=4) if pipeline else {}
    plan = dg.passes.plan(built, dg.Strategy(auto_mode="full", search=method, **options),
                          S.line_cluster(4))
    if pipeline:            # GPT's blocks are searched as identical blocks, the MLP not
        assert (plan.search.layering.blocks is not None) == (kind == "gpt")
    text = check(plan)
    reports = plan.search.stages if pipeline else (plan.search,)
    for report in reports:
        parts = getattr(report, "parts", None) or (("", 1, report),)
        for _, _, part in parts:
            assert f"chosen by {part.chosen_by}" in text
    assert ("stage search:" in text) == pipeline
    assert str(plan.search) and plan.search.to_dict()


def test_the_searched_pipeline_of_identical_blocks_of_the_issue():
    """The example of the issue: explain() raised AttributeError ('RunReport' has no
    'mesh') on every searched pipeline of identical blocks."""
    model = dg.nn.GPT(vocab_size=64, d_model=64, n_layer=4, n_head=4, max_seq_len=32)
    engine = dg.Engine(model, dg.nn.CrossEntropyLoss(), dg.optim.AdamW(1e-3),
                       cluster=dg.Cluster.local(4),
                       strategy=dg.Strategy(auto_mode="full", pipeline=True, micro_batches=4))
    plan = engine.prepare([dg.InputSpec([16, 32], "int64", "tokens")],
                          [dg.InputSpec([16, 32], "int64", "labels")])
    assert plan.search.layering.blocks is not None
    text = check(plan)
    for s, (report, stage) in enumerate(zip(plan.search.stages, plan.search.stage_plan.stages)):
        assert report.mesh == plan.stages[s]             # the stage's own processes
        assert f"stage {s} runs {report.what} on devices {list(stage.device_ids)}" in \
            str(plan.search)
        assert f"stage {s}: " in text


def test_an_interleaved_searched_pipeline_with_recomputation():
    """8 blocks on 4 devices: the search interleaves two chunks per stage; the blocks
    are recomputed, and the recomputed copies are not model FLOPs."""
    plan = dg.passes.plan(gpt_blocks(8), dg.Strategy(
        auto_mode="full", pipeline=True, micro_batches=4, recompute=True, virtual_stages=2),
        S.line_cluster(4), ranks=())
    assert plan.search.stage_plan.virtual == 2
    copies = [op for op in plan.program.ops if op.outputs[0].name.endswith("@RECOMPUTE")]
    assert copies and sum(op_flops(op) for op in copies) > 0
    text = check(plan)
    assert f"{len(plan.stages)} stages of {2 * len(plan.stages)} chunks" in text
    assert "2 chunks per stage" in text


# ---- MoE, context parallelism ---------------------------------------------------------------

def test_a_mixtral_with_its_experts_split():
    from distgraph.nn.mixtral import Mixtral, MixtralConfig, expert_parallel, megatron

    config = MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=8,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=4, num_experts_per_tok=2, initializer_range=0.2,
                           output_router_logits=True, router_aux_loss_coef=0.01)
    dg.seed(7)
    model = Mixtral(config)
    mesh = dg.ProcessMesh([[0, 1], [2, 3]], ["ep", "mp"])
    megatron(model, mesh)
    expert_parallel(model, mesh, "ep", inner="mp")
    attr = DistAttr(mesh, ShardSpec(["ep", None]))
    specs = [dg.InputSpec([4, 6], "int64", n, attr) for n in ("tokens", "labels")]
    built = build_program(model, specs[:1], specs[1:], dg.nn.CrossEntropyLoss(),
                          dg.optim.AdamW(1e-2))
    cluster = dg.Cluster.local(4)
    plan = dg.passes.plan(built, dg.Strategy(), cluster)
    text = check(plan, dg.passes.estimate(plan, cluster), cluster)
    kinds = {k for local in plan.representatives() for cs in local.op_comm.values()
             for k, _, _ in cs}
    assert kinds and all(f"{k} " in text for k in kinds)
    assert "(moe_ffn)" in text and "(moe_ffn_grad)" in text
    assert "split over ep, mp" in text                 # the experts' weights


@pytest.mark.parametrize("form", ["ring", "ulysses"])
def test_a_context_parallel_llama(form):
    from distgraph.nn.llama import Llama, LlamaConfig, megatron

    import llama_cases as L

    dg.seed(3)
    model = Llama(LlamaConfig(**L.TINY, rope_theta=500000.0, initializer_range=0.2))
    mesh = dg.ProcessMesh(np.arange(4).reshape(2, 2).tolist(), dim_names=["cp", "mp"])
    megatron(model, mesh)
    attr = DistAttr(mesh, ShardSpec([None, "cp"]))
    specs = [dg.InputSpec([4, 16], "int64", n, attr, 4) for n in ("tokens", "labels")]
    built = build_program(model, specs[:1], specs[1:], dg.nn.CrossEntropyLoss(),
                          dg.optim.AdamW(1e-2), context_parallel=form)
    cluster = dg.Cluster.local(4)
    plan = dg.passes.plan(built, dg.Strategy(), cluster)
    text = check(plan, dg.passes.estimate(plan, cluster), cluster)
    kind = "send_recv" if form == "ring" else "all_to_all"
    line = next(x for x in text.splitlines() if x.startswith("  collectives inside ops:"))
    assert f"{kind} " in line and "(attention)" in line and "(attention_grad)" in line
    assert "[None, cp, None]" in text                  # activations split over the sequence


# ---- at scale -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def megatron_1024():
    """A lazy bfloat16 GPT of 4 blocks (hidden 1024) as Megatron's t = 8, p = 4 on the
    1,024 A100s of the DGX file: 4 stages of [32, 8] (dp, mp) meshes; with its estimate."""
    from gpt_scale import DGX_FILE, megatron_plan

    cluster = dg.Cluster.from_file(DGX_FILE)
    before = dg.get_default_dtype()
    try:
        plan = megatron_plan(4, 1024, 16, 8, 4, 1024, 256, 4, cluster)
    finally:
        dg.set_default_dtype(before)      # gpt_scale plans in bfloat16 and leaves it set
    return plan, cluster, dg.passes.estimate(plan, cluster)


def test_a_1024_process_plan_fits_a_screen_per_stage(megatron_1024):
    plan, cluster, est = megatron_1024
    assert plan.world_size == 1024 and len(plan.stages) == 4
    text = check_summary(plan, est, cluster)
    lines = text.splitlines()
    assert len(lines) <= 12 * len(plan.stages) and max(map(len, lines)) <= WIDTH
    for s in range(4):
        first, last = 256 * s, 256 * s + 255
        assert (f"  stage {s}: mesh [32, 8] (dp, mp), processes {first}-{last} on devices "
                f"{first}-{last} (GPU A100-SXM4-80GB, 80 GB, 74 GB usable)") in lines
        assert f"    processes {first}-{last}: peak " in text
    assert "weights: matmul [None, mp] x2, [mp, None] x2 (split over mp)" in text
    assert "bfloat16" in text
    flops = oracle_flops(plan)
    assert max(flops, key=flops.get) == "bfloat16"
    # and its estimate's own str groups the processes: a line pair per stage
    assert len(str(est).splitlines()) == 1 + 2 * 4
    assert len(est.per_process().splitlines()) == 1 + 1024


def test_a_1024_process_plan_carries_the_estimate_it_was_checked_to_fit_by(megatron_1024):
    plan, cluster, est = megatron_1024
    assert plan.estimate is not None and plan.estimate.peak_memory == est.peak_memory
    text = check_summary(plan)                 # its own estimate and cluster
    assert "fits its devices: largest peak" in text.splitlines()[0]


def test_the_full_listing_of_a_1024_process_plan_lists_every_rank(megatron_1024):
    plan, _, est = megatron_1024
    full = check_full(plan, est)
    assert len(full) > 20 * len(plan.explain(estimate=est))


def test_ids_print_as_ranges():
    assert fmt_ids(range(64)) == "0-63"
    assert fmt_ids([*range(192, 256), *range(64, 128)]) == "64-127, 192-255"
    assert fmt_ids([5, 3]) == "3, 5"
    assert fmt_ids([0, 1, 2, 4]) == "0-2, 4"
    assert fmt_ids(range(0, 1024, 8)) == "0, 8, ..., 1016"
    assert fmt_ids(range(0, 100, 2), limit=1) == "0, 2, ..., 98"
    assert fmt_ids([1, 3, 5, 10, 20, 30, 40], limit=2) == "1, 3, ... (7 in all)"
