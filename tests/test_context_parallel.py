"""Context parallelism: Llama-tiny with its sequence split over a ``cp`` mesh dim trains
as it does on one process (float64, 1e-10), attention running Ulysses (all-to-alls
inside the op) or the ring — cp 2 and cp 4, cp x dp, cp x mp (Megatron's heads), cp x
mp + Megatron-SP (the norms' sequence split over cp and mp), cp
inside each of 2 pipeline stages, cp x dp recomputed — on real MPI ranks (``distgraph
run``) and on SimulatedWorld threads.
The data come in the load-balanced order of 2·cp chunks; the causal mask is right at
every chunk boundary (a query never sees a later chunk), and the serial op in that
order equals the op in natural order."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402
from distgraph.nn.llama import Llama, LlamaConfig, megatron  # noqa: E402
from distgraph.ops.attention_blocks import (block_backward, block_forward,  # noqa: E402
                                            positions, visible)
from distgraph.runtime.comm.simulated import SimulatedWorld  # noqa: E402

import llama_cases as L  # noqa: E402
import plans as P  # noqa: E402

BATCH, SEQ, STEPS = 4, 16, 2
CONFIG = LlamaConfig(**L.TINY, rope_theta=500000.0, initializer_range=0.2)


def _model(config=CONFIG):
    dg.seed(3)
    return Llama(config)


def _cp(n):
    def annotate(model):
        mesh = dg.ProcessMesh(list(range(n)), dim_names=["cp"])
        return mesh, None, "cp"
    return annotate


def _cp_dp(model):
    mesh = dg.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "cp"])
    return mesh, "dp", "cp"


def _cp_mp(model):
    mesh = dg.ProcessMesh([[0, 1], [2, 3]], dim_names=["cp", "mp"])
    megatron(model, mesh)
    return mesh, None, "cp"


def _mp_cp(model):        # mp the major mesh dim: the norms' entry (cp, mp) is not in mesh order
    mesh = dg.ProcessMesh([[0, 1], [2, 3]], dim_names=["mp", "cp"])
    megatron(model, mesh)
    return mesh, None, "cp"


def _pipeline(model):
    first, second = (dg.ProcessMesh(ids, dim_names=["cp"]) for ids in ([0, 1], [2, 3]))
    L.two_stages(model, first, second)
    return [first, second], None, "cp"


BASES = {            # name: (annotate, ranks, Strategy fields)
    "cp2": (_cp(2), 2, {}),
    "cp4": (_cp(4), 4, {}),
    "cp2_dp2": (_cp_dp, 4, {}),
    "cp2_mp2": (_cp_mp, 4, {}),
    "cp2_mp2_sp": (_cp_mp, 4, {"sequence_parallel": True}),   # sequence split (cp, mp)
    "mp2_cp2_sp": (_mp_cp, 4, {"sequence_parallel": True}),
    "cp2_2stages": (_pipeline, 4, {"micro_batches": 2}),
    "cp2_dp2_recompute": (_cp_dp, 4, {"recompute": True}),   # attention run twice
}


def layout_of(name: str) -> tuple:
    """(annotate, ranks, Strategy) of ``"base/form"`` (form: ulysses, ring, or auto:
    the cost model's)."""
    base, form = name.split("/")
    annotate, ranks, fields = BASES[base]
    return annotate, ranks, dg.Strategy(context_parallel=None if form == "auto" else form,
                                        **fields)


def layouts(forms=("ulysses", "ring")) -> list:
    """Every base layout in each form."""
    return [f"{b}/{f}" for f in forms for b in BASES]


def train(comm, layout, plans=None, config=CONFIG):
    """(losses, state) of Llama-tiny trained on ``comm`` (None: serial, natural order)."""
    with P.BUILD_LOCK:
        model = _model(config)
        meshes, dim, seq = layout_of(layout)[0](model) if layout else (None, None, None)
    strategy = layout_of(layout)[2] if layout else dg.Strategy()
    engine = dg.Engine(model, loss=dg.nn.CrossEntropyLoss(), optimizer=dg.optim.AdamW(1e-2),
                       strategy=strategy, communicator=comm)
    data = L.NextTokens(BATCH * STEPS, SEQ)
    if meshes is not None:
        data = dg.shard_dataloader(data, meshes, shard_dims=dim, sequence_dim=seq)
    with P.BUILD_LOCK:
        ins, labels = dg.app.data.DataLoader(data, BATCH).specs(1)
        engine.prepare(ins, labels)
    history = engine.fit(data, batch_size=BATCH, epochs=1, verbose=0)
    if plans is not None:
        plans.append(engine.plan())
    return history.losses, engine.state_dict()


@pytest.fixture(scope="module")
def serial():
    """Llama-tiny trained on one process, natural order, float64."""
    before = dg.get_default_dtype()
    dg.set_default_dtype("float64")
    try:
        return train(None, None)
    finally:
        dg.set_default_dtype(before)


# -- the op in the balanced order ------------------------------------------------------------------
@pytest.mark.parametrize("chunks", [4, 8, 16])
@pytest.mark.parametrize("window", [None, 3])
def test_stored_order_equals_natural_order(chunks, window):
    """The serial kernels on a sequence stored in the balanced order (positions from
    ``chunks``) give the natural-order results, stored in that order."""
    rng = np.random.default_rng(chunks)
    q, k, v, dy = (rng.standard_normal((2, 3, 16, 4)) for _ in range(4))
    pos = np.arange(16)
    y, lse = block_forward(np, q, k, v, 0.5, visible(np, pos, pos, True, window))
    grads = block_backward(np, q, k, v, y, lse, dy, 0.5, visible(np, pos, pos, True, window))
    perm = positions(np, 0, 16, 16, chunks)
    assert sorted(perm) == list(range(16)) and list(perm) != list(range(16))
    ys, lses = block_forward(np, q[:, :, perm], k[:, :, perm], v[:, :, perm], 0.5,
                             visible(np, perm, perm, True, window))
    np.testing.assert_allclose(ys, y[:, :, perm], rtol=0, atol=1e-12)
    np.testing.assert_allclose(lses, lse[:, :, perm], rtol=0, atol=1e-12)
    got = block_backward(np, *(a[:, :, perm] for a in (q, k, v)), ys, lses, dy[:, :, perm],
                         0.5, visible(np, perm, perm, True, window))
    for g, want in zip(got, grads):
        np.testing.assert_allclose(g, want[:, :, perm], rtol=0, atol=1e-12)


def test_balanced_order_gives_rank_i_chunks_i_and_mirror():
    """cp 4: 8 chunks of 2; rank i's block of the stored order is chunks i and 7 - i."""
    perm = positions(np, 0, 16, 16, 8).reshape(4, 4)
    for i in range(4):
        assert list(perm[i] // 2) == [i, i, 7 - i, 7 - i]


# -- training ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", layouts() + ["cp4/auto"])
def test_context_parallel_training_equals_serial(float64, serial, layout):
    """Simulated ranks; every attention op of the plan runs context parallel (its q
    split along the sequence over cp, its form's collectives inside it), the data in
    the balanced order of 2·cp chunks."""
    _, ranks, strategy = layout_of(layout)
    plans = []
    results = SimulatedWorld(ranks, timeout=120).run(train, layout, plans)
    L.trains_equal(results, serial)
    cp = 4 if layout.startswith("cp4") else 2
    for op in plans[0].program.ops:
        if op.type in ("attention", "attention_grad"):
            assert "cp" in op.dist_attr.input_specs[0].entry(2)
            assert op.attrs["sequence_chunks"] == 2 * cp
            local = [o for o in plans[0].local(0).program.ops if o.type == op.type][0]
            forms = (strategy.context_parallel,) if strategy.context_parallel else \
                ("ulysses", "ring")
            assert local.attrs["context_parallel"] in forms
    if strategy.sequence_parallel:      # the norms' sequence: cp's block cut over mp
        norms = [op for op in plans[0].program.ops if op.type == "rms_norm"
                 and op.layer.startswith("layers.") and str(op.role) == "forward"]
        assert norms and all(op.dist_attr.output_specs[0].entry(1) == ("cp", "mp")
                             for op in norms)


def test_sliding_window_and_one_kv_head_under_cp4_equal_serial(float64):
    """Mistral's sliding window (5, over chunks of 2) and one key/value head (copied 4
    times for Ulysses) with the sequence split 4 ways."""
    config = CONFIG.replace(sliding_window=5, num_key_value_heads=1)
    serial = train(None, None, config=config)
    L.trains_equal(SimulatedWorld(4, timeout=120).run(train, "cp4/ulysses", None, config), serial)


@pytest.mark.mpi
def test_context_parallel_on_mpi_ranks_equals_serial(float64, serial, tmp_path):
    """Real ranks (``distgraph run -n 4``): cp 4, cp x dp, cp x mp, cp x mp + SP, cp in
    2 stages; Ulysses and ring."""
    here = os.path.dirname(os.path.abspath(__file__))
    out = tmp_path / "cp"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    names = [f"{b}/{f}" for f in ("ulysses", "ring") for b in BASES if BASES[b][1] == 4]
    proc = subprocess.run([sys.executable, "-m", "distgraph.cli", "run", "-n", "4",
                           os.path.join(here, "mpi_scripts", "context_parallel.py"), str(out),
                           *names], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in names:
        got = np.load(f"{out}_{name.replace('/', '_')}.npz")
        L.trains_equal([(got["losses"], {name: got[name] for name in serial[1]})], serial)


# -- causal masking at the chunk boundaries --------------------------------------------------------
def _predict(comm, tokens):
    with P.BUILD_LOCK:
        model = _model()
        mesh = dg.ProcessMesh([0, 1], dim_names=["cp"])
    engine = dg.Engine(model, strategy=dg.Strategy(context_parallel="ulysses"),
                       communicator=comm)
    data = dg.shard_dataloader(_Tokens(tokens), mesh, sequence_dim="cp")
    return engine.predict(data, batch_size=len(tokens))[0][0]


class _Tokens:
    def __init__(self, ids):
        self.ids = ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return (self.ids[i],)


def test_no_query_sees_a_later_chunk(float64):
    """cp 2 stores 4 chunks of 4 as [0, 3 | 1, 2]: for every chunk boundary p, changing
    the tokens from p on leaves every logit before p as it was and changes those after,
    on the ranks; the logits come back in sequence order, equal to one process's."""
    ids = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (2, SEQ))
    base = SimulatedWorld(2, timeout=120).run(_predict, ids)[0]
    with P.BUILD_LOCK:
        serial = dg.Engine(_model()).predict(_Tokens(ids), batch_size=len(ids))[0][0]
    np.testing.assert_allclose(base, serial, rtol=0, atol=1e-10)
    for p in (4, 8, 12):
        changed = ids.copy()
        changed[:, p:] = (changed[:, p:] + 1) % CONFIG.vocab_size
        got = SimulatedWorld(2, timeout=120).run(_predict, changed)[0]
        np.testing.assert_allclose(got[:, :p], base[:, :p], rtol=0, atol=1e-12)
        assert np.abs(got[:, p:] - base[:, p:]).min(axis=-1).max() > 0


# -- what the plan counts ---------------------------------------------------------------------------
def _built(n: int, impl, config=CONFIG, mp: int = 1):
    """Llama-tiny built with its sequence split over ``cp`` (n); with ``mp`` > 1 on a
    [cp, mp] mesh with Megatron's heads over mp."""
    from distgraph.placement import DistAttr, ShardSpec
    from distgraph.program_builder import build_program

    ids = np.arange(n * mp).reshape(n, mp).tolist() if mp > 1 else list(range(n))
    mesh = dg.ProcessMesh(ids, dim_names=["cp", "mp"] if mp > 1 else ["cp"])
    attr = DistAttr(mesh, ShardSpec([None, "cp"]))
    specs = [dg.InputSpec([BATCH, SEQ], "int64", name, attr, 2 * n)
             for name in ("tokens", "labels")]
    model = _model(config)
    if mp > 1:
        megatron(model, mesh)
    built = build_program(model, specs[:1], specs[1:], dg.nn.CrossEntropyLoss(),
                          dg.optim.AdamW(1e-2), context_parallel=impl)
    init = {name: p.numpy() for name, p in model.named_parameters()}
    init.update(dg.optim.AdamW(1e-2).initial_state(built.program))
    return built, init


@pytest.mark.parametrize("form", ["ulysses", "ring"])
@pytest.mark.parametrize("n", [2, 4])
def test_bytes_counted_equal_the_plan_with_attention_inside(float64, n, form):
    """One training step on n ranks: the bytes each rank sends, by kind, equal the plan's
    (reshard steps and the attention ops' own all-to-alls, ``comm(site)``), and the
    all-to-alls are the ops' (Ulysses: q, then k and v, there and y back per attention;
    two there and two back per gradient; with n = 4 the 2 key/value heads are copied
    twice each so that they divide over the group: the bytes count the copies), or the
    ring's hops (only the 2 key/value heads travel)."""
    from distgraph.passes.partition import gather_points
    from distgraph.runtime.execution.runner import PlanRunner

    built, init = _built(n, form)
    plan = dg.passes.plan(built)
    ids = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (BATCH, SEQ))

    def rank(comm):
        runner = PlanRunner(plan, comm)
        scope = runner.shard_scope(init)
        comm.reset_counters()
        runner.run(scope, {"tokens": ids, "labels": ids}, 0)
        planned = runner.local.bytes_sent()
        for point in gather_points(plan.program, [built.loss_name], comm.rank):
            for step in point.steps:
                planned[step.kind] = planned.get(step.kind, 0.0) + step.bytes_sent_by(comm.rank)
        return planned, dict(comm.bytes_sent), runner.local.op_comm

    for planned, counted, op_comm in SimulatedWorld(n).run(rank):
        kinds = set(planned) | {k for k, b in counted.items() if b}
        assert {k: planned.get(k, 0.0) for k in kinds} == \
            pytest.approx({k: counted.get(k, 0.0) for k in kinds}, rel=1e-12)
        inside = [kind for c in op_comm.values() for kind, _, _ in c]
        if form == "ulysses":
            assert inside.count("all_to_all") == 7 * CONFIG.num_hidden_layers
        else:           # hops: n - 1 forward, 2n - 1 in the gradient
            assert inside.count("send_recv") == (3 * n - 2) * CONFIG.num_hidden_layers


def _mp_collectives(plan) -> dict:
    """{(role, kind): [(bytes sent, bytes of the tensor in the group), ...]} of the reshard
    steps over mp of [batch, seq, hidden] activations and their gradients."""
    from distgraph import dtypes

    found = {}
    for point in plan.reshards():
        if len(point.shape) != 3:
            continue
        role = str(plan.program.ops[point.anchor].role)
        # the tensor an mp group holds: the source's block over the other mesh dims (cp)
        others = [m for d in range(3) for m in point.src.spec.entry(d) if m != "mp"]
        held = int(np.prod(point.shape)) * dtypes.itemsize(point.dtype) // int(np.prod(
            [point.src.mesh.dim_size(m) for m in others]))
        for step in point.steps:
            if step.mesh_dim == "mp" and str(step.kind) != "slice":
                found.setdefault((role, str(step.kind)), []).append((step.bytes, held))
    return found


@pytest.mark.parametrize("form", ["ulysses", "ring"])
def test_sequence_parallel_cuts_the_context_parallel_block_over_mp(float64, form):
    """cp 2 x mp 2 + Strategy(sequence_parallel=True): the decoder layers' norms and
    residual adds run with the sequence split over (cp, mp) -- cp's block of the
    sequence, cut again over mp -- so SP neither gives up where cp splits the sequence
    nor moves it off cp; around each tensor-parallel region the activations are
    all-gathered over mp before q|k|v and gate|up and reduce-scattered after o and down,
    Megatron's collectives (bytes of the formula on the group's cp block; the final
    norm's input gathered: the LM head's weight is whole), with no all-reduce of an activation over
    mp left either way; attention keeps its sequence over cp and its heads over mp, its
    cp collectives inside the op, and nothing in the forward reshards over cp."""
    from distgraph.plan.kinds import collective_bytes

    layers = CONFIG.num_hidden_layers
    plan = dg.passes.plan(_built(2, form, mp=2)[0], dg.Strategy(sequence_parallel=True,
                                                                  context_parallel=form))
    forward = [op for op in plan.program.ops if str(op.role) == "forward"]
    light = [op for op in forward if op.type in ("rms_norm", "add")
             and op.layer.startswith("layers.")]
    assert len(light) == 4 * layers
    assert all(op.dist_attr.output_specs[0].entry(1) == ("cp", "mp") for op in light)
    local = [op for op in plan.local(0).program.ops if op.type == "rms_norm"
             and op.layer.startswith("layers.")]
    assert len(local) == 2 * layers
    assert all(op.outputs[0].shape == (BATCH, SEQ // 4, CONFIG.hidden_size) for op in local)
    found = _mp_collectives(plan)
    counts = {key: len(steps) for key, steps in found.items()}
    assert {k: n for k, n in counts.items() if k[0] == "forward"} == {
        ("forward", "all_gather"): 2 * layers + 1, ("forward", "reduce_scatter"): 2 * layers}
    assert counts[("backward", "reduce_scatter")] == 2 * layers
    assert ("backward", "all_reduce") not in counts
    for (_, kind), steps in found.items():
        for sent, held in steps:
            assert sent == collective_bytes(kind, 2, held), kind
    assert not any(s.mesh_dim == "cp" for p in plan.reshards() for s in p.steps
                   if plan.program.ops[p.anchor] in forward and len(p.shape) > 2)
    for op in plan.program.ops:
        if op.type in ("attention", "attention_grad"):
            assert op.dist_attr.input_specs[0].entry(1) == ("mp",)
            assert op.dist_attr.input_specs[0].entry(2) == ("cp",)
    assert all(op.attrs["context_parallel"] == form for op in plan.local(0).program.ops
               if op.type.startswith("attention"))
    inside = plan.explain(full=True)
    inside = inside[inside.index("collectives inside ops"):]
    kind = "all_to_all" if form == "ulysses" else "send_recv"
    assert f"attention [{form}] (layers.0.self_attn) over (0, 2): {kind} n=2" in inside
    assert f"attention_grad [{form}] (layers.1.self_attn) over (0, 2): {kind} n=2" in inside


def test_plan_explains_attention_collectives(float64):
    """Plan.explain(full=True) lists the attention ops' collectives among those inside ops, with
    their form: Ulysses' all-to-alls, the ring's hops (n - 1 of k, v forward; and n of
    dk, dv in the gradient). Ulysses where the heads do not divide (4 heads, cp 8) is a
    PlanError that says how to fix it."""
    built, _ = _built(2, "ulysses")
    text = dg.passes.plan(built).explain(full=True)
    inside = text[text.index("collectives inside ops"):]
    assert "attention [ulysses] (layers.0.self_attn) over (0, 1): all_to_all n=2" in inside
    assert "attention_grad [ulysses] (layers.1.self_attn) over (0, 1): all_to_all n=2" \
        in inside
    ring, _ = _built(4, "ring")
    lines = dg.passes.plan(ring).explain(full=True).splitlines()
    forward = [x for x in lines if "attention [ring] (layers.0.self_attn)" in x]
    backward = [x for x in lines if "attention_grad [ring] (layers.0.self_attn)" in x]
    assert len(forward) == 3 and all("send_recv n=2" in x for x in forward)
    assert len(backward) == 7 and all("send_recv n=2" in x for x in backward)
    with pytest.raises(dg.PlanError, match="use context_parallel='ring'"):
        dg.passes.plan(_built(8, "ulysses")[0])


def test_bad_context_parallel_settings_are_errors():
    with pytest.raises(dg.DistGraphError, match="context_parallel must be"):
        dg.Strategy(context_parallel="rings")
    mesh = dg.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "cp"])
    data = L.NextTokens(4, SEQ)
    with pytest.raises(dg.ShardingError, match="also the batch's shard_dims"):
        dg.shard_dataloader(data, mesh, shard_dims="cp", sequence_dim="cp")
    with pytest.raises(dg.ShardingError, match="no dim 1"):
        dg.shard_dataloader(_Scalars(), mesh, "dp", "cp").feed_attrs([(4,)], 0)
    natural = dg.shard_dataloader(data, mesh, "dp", "cp", balance=False)
    assert natural.sequence_chunks == 1 and (natural[0][0] == data[0][0]).all()
    balanced = dg.shard_dataloader(data, mesh, "dp", "cp")
    assert balanced.sequence_chunks == 4
    assert (balanced[0][1] == data[0][1][positions(np, 0, SEQ, SEQ, 4)]).all()


class _Scalars:
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return (np.float64(i),)


@pytest.mark.parametrize("chunks", [1, 4])
@pytest.mark.parametrize("window", [None, 5])
def test_row_blocks_over_visible_keys_equal_one_block(chunks, window):
    """attend/attend_grad, 3 queries at a time over only the keys those can see, equal
    one block over every key under the full mask."""
    from distgraph.ops.attention_blocks import attend, attend_grad

    rng = np.random.default_rng(5)
    q, k, v, dy = (rng.standard_normal((2, 3, 16, 4)) for _ in range(4))
    pos = positions(np, 0, 16, 16, chunks)
    mask = visible(np, pos, pos, True, window)
    y, lse = block_forward(np, q, k, v, 0.5, mask)
    got_y, got_lse = attend(np, q, k, v, 0.5, pos, pos, True, window, rows=3)
    np.testing.assert_allclose(got_y, y, rtol=0, atol=1e-12)
    np.testing.assert_allclose(got_lse, lse, rtol=0, atol=1e-12)
    want = block_backward(np, q, k, v, y, lse, dy, 0.5, mask)
    for g, w in zip(attend_grad(np, q, k, v, y, lse, dy, 0.5, pos, pos, True, window, rows=3),
                    want):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-12)


@pytest.mark.parametrize("n", [2, 4])
def test_local_attention_flops_add_up_to_the_serial_op(float64, n):
    """Each process's attention and gradient, priced on its local shapes and localized
    attributes (what the estimate and the search do), is 1/n of the serial op's FLOPs
    (causal: the pairs the mask lets through, (s + 1) s / 2 per head)."""
    from distgraph.registry import TensorType, get_op, op_flops

    built, _ = _built(n, "ulysses")
    plan = dg.passes.plan(built)
    serial = {op.layer + op.type: op_flops(op) for op in built.program.ops
              if op.type.startswith("attention")}
    h, hd = CONFIG.num_attention_heads, CONFIG.hidden_size // CONFIG.num_attention_heads
    pairs = SEQ * (SEQ + 1) // 2
    assert serial["layers.0.self_attnattention"] == BATCH * h * pairs * (4 * hd + 5)
    for pid in plan.process_ids:
        local = [op for op in plan.local(pid).program.ops if op.type.startswith("attention")]
        assert len(local) == len(serial)
        for op in local:
            got = get_op(op.type).flops([TensorType(v.shape, v.dtype) for v in op.inputs],
                                        [TensorType(o.shape, o.dtype) for o in op.outputs],
                                        **op.attrs)
            assert op.attrs["sequence_parts"] == n
            assert got * n == pytest.approx(serial[op.layer + op.type], rel=1e-12)


def _cluster(gflops, bandwidth):
    """4 GPUs (a CPU group's transfers are its processes' own copies, hidden by
    nothing) of ``gflops`` on links of ``bandwidth`` GB/s."""
    return dg.Cluster.from_dict({"machines": [{"hostname": "a", "devices": [
        {"global_id": i, "type": "GPU", "memory": 1, "gflops": {"float64": gflops}}
        for i in range(4)], "links": [{"group": [0, 1, 2, 3], "bandwidth": bandwidth,
                                       "latency": 1}]}]})


def test_cost_model_chooses_ring_or_ulysses_per_op(float64):
    """The per-op choice: Ulysses pays its all-to-alls after its compute; the ring hides
    its hops behind its blocks' compute (the op's overlap pipeline), so it wins where
    compute dominates (a slow device) and loses where the link does (a fast device; cp
    4, as many key/value heads as query heads: the ring sends 3 hops of k and v, Ulysses
    3/4 of q, k, v and y, half as much). The plan on each cluster runs each op in its
    faster form; a form the strategy fixes stays."""
    from distgraph.passes.context import form_times
    from distgraph.passes.cost.prices import Rings

    config = CONFIG.replace(num_key_value_heads=4)
    for gflops, bandwidth, faster in ((1e-3, 1e-2, "ring"), (1.0, 1e-2, "ulysses")):
        cluster = _cluster(gflops, bandwidth)
        plan = dg.passes.plan(_built(4, None, config)[0], cluster=cluster)
        ops = [op for op in plan.program.ops if op.type in ("attention", "attention_grad")]
        assert len(ops) == 2 * CONFIG.num_hidden_layers
        for op in ops:
            times = form_times(op, Rings(cluster, lambda p: p))
            assert min(times, key=times.get) == faster, (op.type, times)
            assert op.attrs["context_parallel"] == faster
        local = [op for op in plan.local(0).program.ops if op.type == "attention"]
        assert all(op.attrs["context_parallel"] == faster for op in local)
    fixed = dg.passes.plan(_built(4, "ulysses", config)[0], cluster=_cluster(1e-3, 1e-2))
    assert all(op.attrs["context_parallel"] == "ulysses" for op in fixed.program.ops
               if op.type.startswith("attention"))


def test_ring_pipeline_slices_add_up_to_the_op_and_hide_its_hops(float64):
    """The ring's overlap hook: n slices whose FLOPs add up to the local op's, a k, v hop
    before each (and a dk, dv hop after each in the gradient). The estimate prices the
    ring's hops hidden behind its compute: on a compute-bound cluster the ring plan's
    communication is below the Ulysses plan's, on a link-bound one above (as
    many key/value heads as query heads: the ring sends twice Ulysses' bytes)."""
    from distgraph.registry import TensorType, get_op

    built, _ = _built(4, "ring")
    cluster = _cluster(1e-3, 1e-2)
    plan = dg.passes.plan(built, cluster=cluster)
    local = plan.local(0).program.ops
    for op in (o for o in local if o.type.startswith("attention")):
        opdef = get_op(op.type)
        ins = [TensorType(v.shape, v.dtype) for v in op.inputs]
        outs = [TensorType(o.shape, o.dtype) for o in op.outputs]
        (ov,) = opdef.overlap(op.attrs, ins)
        assert ov.slices == 4 and ov.op_type == op.type
        whole = opdef.flops(ins, outs, **op.attrs)
        assert ov.slices * get_op(ov.op_type).flops(ov.ins, ov.outs, **dict(ov.attrs)) == \
            pytest.approx(whole, rel=1e-12)
        assert [k for k, *_ in ov.before] == ["send_recv"]
        assert len(ov.after) == (1 if op.type == "attention_grad" else 0)
    config = CONFIG.replace(num_key_value_heads=4)
    for gflops, ring_wins in ((1e-3, True), (1.0, False)):
        cluster = _cluster(gflops, 1e-2)
        comm = {form: dg.passes.estimate(dg.passes.plan(_built(4, form, config)[0],
                                                        cluster=cluster),
                                         cluster).processes[0].communication
                for form in ("ring", "ulysses")}
        assert (comm["ring"] < comm["ulysses"]) == ring_wins, comm


@pytest.mark.parametrize("mp", [1, 2])
@pytest.mark.parametrize("form", ["ulysses", "ring"])
def test_backward_keeps_the_sequence_split(float64, form, mp):
    """cp 2 (and cp 2 x mp 2 + SP): the weight gradients contract batch and sequence
    where they lie (``bsh,bso->ho``), so the backward gathers no activation or activation
    gradient over cp; cp's only collectives in the backward and update are the pending
    sums of the weight gradients (and the loss), all-reduced with the formula's bytes."""
    from distgraph import dtypes
    from distgraph.plan.kinds import collective_bytes

    plan = dg.passes.plan(_built(2, form, mp=mp)[0], dg.Strategy(
        sequence_parallel=mp > 1, context_parallel=form))
    weights = {v.name for v in plan.program.values.values() if v.is_parameter}
    reduced = set()
    for point in plan.reshards():
        role = str(plan.program.ops[point.anchor].role)
        for step in point.steps:
            if step.mesh_dim != "cp" or str(step.kind) == "slice":
                continue
            assert role != "forward" and len(point.shape) <= 2, (role, point.reads, step)
            assert str(step.kind) == "all_reduce", (point.reads, step)
            others = [m for d in range(len(point.shape)) for m in point.src.spec.entry(d)]
            held = int(np.prod(point.shape, dtype=np.int64)) * dtypes.itemsize(point.dtype) \
                // int(np.prod([point.src.mesh.dim_size(m) for m in others]))
            assert step.bytes == collective_bytes("all_reduce", 2, held)
            reduced.update(point.reads)
    # every matrix's gradient is reduced over cp once (the embedding's, the 7 Linear
    # layers' of each decoder layer, the LM head's)
    matrices = [w for w in weights if len(plan.program.values[w].shape) == 2]
    assert len([n for n in reduced if "@GRAD" in n and len(plan.program.values[n].shape) == 2]) \
        == len(matrices) == 7 * CONFIG.num_hidden_layers + 2


def test_memory_estimate_credits_context_parallel_activations(float64):
    """The estimate's activations per rank: saved for the backward ÷ cp, and the peak's
    ÷ cp too (the backward gathers none over cp)."""
    from distgraph.program_builder import build_program

    cluster = _cluster(1.0, 1.0)
    specs = [dg.InputSpec([BATCH, SEQ], "int64", name) for name in ("tokens", "labels")]
    serial = dg.passes.estimate(dg.passes.plan(build_program(
        _model(), specs[:1], specs[1:], dg.nn.CrossEntropyLoss(), dg.optim.AdamW(1e-2))),
        cluster).processes[0]
    for n in (2, 4):
        proc = dg.passes.estimate(dg.passes.plan(_built(n, "ring")[0]), cluster).processes[0]
        assert proc.saved_activations == pytest.approx(serial.saved_activations / n, rel=0.01)
        assert proc.activations <= serial.activations / n * 1.01
