"""Every op's declared workspace (the registry's ``workspace`` hook) is what its kernel
allocates beyond its results, as the allocator sees it.

The training programs of a GPT (GELU, layer norm, softmax), a Llama (SiLU, RMS norm,
rotary, fused attention, grouped-query heads) and a Mixtral (experts) run op by op under
``tracemalloc``; for each op the most bytes allocated while its kernel ran, above what it
left allocated (its results, what it keeps for its gradient), is compared with
``op_workspace`` of its operands' and results' types. Shapes are large enough (results of
0.5-8 MiB) that Python's own small allocations are noise below the tolerance.

Beyond the models, ``CASES`` runs single ops as the executor runs them
(``call_kernel``: 16-bit operands computed in float32 unless the op takes them) at such
shapes, in the forms the models do not reach: other axes and broadcasts, the optimizer
updates, the attention's mask forms and blocks, the experts' capacity and shards, a
vocabulary shard, 16-bit operands; every registered op but the 0-d state ops has one.
A small program (an MLP with relu and tanh, log_softmax, concat, split, where) runs
with its gradient, and a declaration made wrong is caught.
"""

from __future__ import annotations

import collections
import tracemalloc

import numpy as np
import pytest

import distgraph as dg
from distgraph import dtypes
from distgraph.nn.llama import LlamaConfig
from distgraph.nn.mixtral import MixtralConfig
from distgraph.plan.instructions import OpInstr
from distgraph.program_builder import build_program
from distgraph.registry import KernelContext, TensorType, get_op, op_workspace
from distgraph.runtime.execution import executor

BATCH, SEQ, VOCAB = 8, 128, 512
# bytes: Python's own allocations while a kernel runs, and numpy's ufunc buffers (8192
# elements of each operand a loop casts or broadcasts: 32 KiB of float32), which no
# kernel declares but one_hot's (its whole workspace)
SLACK = 96 * 1024
RTOL = 0.05


def model(kind):
    dg.seed(0)
    if kind == "gpt":
        return dg.nn.GPT(vocab_size=VOCAB, d_model=256, n_layer=2, n_head=8, max_seq_len=SEQ)
    if kind == "llama":
        return dg.nn.Llama(LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                                       num_hidden_layers=2, num_attention_heads=8,
                                       num_key_value_heads=4, max_position_embeddings=SEQ))
    return dg.nn.Mixtral(MixtralConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                                       num_hidden_layers=1, num_attention_heads=4,
                                       num_key_value_heads=2, num_local_experts=4,
                                       num_experts_per_tok=2))


def kind_of(a):
    return TensorType(tuple(a.shape), str(a.dtype))


def measured_workspaces(monkeypatch, kind, amp=None) -> list:
    """(op type, measured bytes, declared bytes, its results' bytes) of every op of one
    training step of model ``kind``."""
    m = model(kind)
    ins = [dg.InputSpec([BATCH, SEQ], "int64", name="x")]
    labels = [dg.InputSpec([BATCH, SEQ], "int64", name="y")]
    built = build_program(m, ins, labels, dg.nn.CrossEntropyLoss(), dg.optim.AdamW(1e-3),
                          amp=amp)
    prog = built.program
    scope = {n: p.numpy() for n, p in m.named_parameters()}
    for v in prog.values.values():
        if v.persistable and v.name not in scope:
            scope[v.name] = np.zeros(v.shape, dg.dtypes.numpy_dtype(v.dtype))
    tokens = np.random.default_rng(0).integers(0, VOCAB, (BATCH, SEQ))
    return measured_program(monkeypatch, prog, scope, {"x": tokens, "y": tokens})


def measured_program(monkeypatch, prog, scope, feed) -> list:
    """(op type, measured bytes, declared bytes, its results' bytes) of every op of
    Program ``prog`` run once on ``scope`` and ``feed``."""
    rows = []
    original = executor.run_op

    def measuring(instr, env, scope, ctx, donate=()):
        ins = [kind_of(env[n] if n in env else scope[n]) for n in instr.reads]
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        original(instr, env, scope, ctx, donate)
        after, peak = tracemalloc.get_traced_memory()
        outs = [env[n] if n in env else scope[n] for n in instr.outs]
        declared = op_workspace(instr.op_type, ins, [kind_of(o) for o in outs], instr.attrs)
        rows.append((instr.op_type, peak - max(after, before), declared,
                     sum(o.nbytes for o in outs)))

    monkeypatch.setattr(executor, "run_op", measuring)
    tracemalloc.start()
    try:
        executor.ProgramRunner(prog).run(scope, feed)
    finally:
        tracemalloc.stop()
    return rows


def off(measured: int, declared: int) -> bool:
    return abs(measured - declared) > SLACK + RTOL * declared


@pytest.mark.parametrize("kind,amp", [("gpt", None), ("llama", None), ("mixtral", None),
                                      ("gpt", "bfloat16")])
def test_each_kernels_workspace_is_what_the_allocator_hands_out(monkeypatch, kind, amp):
    rows = measured_workspaces(monkeypatch, kind, amp)
    wrong = collections.defaultdict(list)
    for op_type, measured, declared, _ in rows:
        if off(measured, declared):
            wrong[op_type].append((measured, declared))
    assert not wrong, {t: v[:2] for t, v in wrong.items()}
    # the premise: the shapes make the workspaces that matter large beside the slack
    assert max(declared for _, _, declared, _ in rows) > 20 * SLACK


# -- single ops, as the executor runs them ------------------------------------------------------
BF16 = dtypes.numpy_dtype("bfloat16")


def measure_op(op_type: str, args, attrs=None) -> tuple:
    """(measured, declared, results' bytes) of one op's kernel on arrays ``args`` run by
    the executor's ``call_kernel``."""
    attrs = dict(attrs or {})
    ins = [kind_of(a) for a in args]
    outs = get_op(op_type).infer(*ins, **attrs)
    outs = [outs] if isinstance(outs, TensorType) else list(outs)
    instr = OpInstr(get_op(op_type).kernel, op_type, "", tuple(f"in{i}" for i in range(len(ins))),
                    tuple(f"out{j}" for j in range(len(outs))), attrs, (), {},
                    out_dtypes=tuple(dtypes.numpy_dtype(t.dtype) for t in outs))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        results = executor.call_kernel(instr, KernelContext(np), list(args))
        after, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [kind_of(r) for r in results] == outs, op_type
    return (peak - max(after, before), op_workspace(op_type, ins, outs, attrs),
            sum(r.nbytes for r in results))


def normal(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape, dtype=np.float32).astype(dtype)


def _attention(rng, grad, q_shape, kv_heads, dtype=np.float32, **attrs):
    b, h, s, d = q_shape
    q, k, v = normal(rng, *q_shape, dtype=dtype), *(normal(rng, b, kv_heads, s, d, dtype=dtype)
                                                    for _ in range(2))
    attrs = {"scale": d ** -0.5, **attrs}
    if not grad:
        return [q, k, v], attrs
    y, lse = executor.call_kernel(
        OpInstr(get_op("attention").kernel, "attention", "", (), (), attrs, (), {},
                out_dtypes=(q.dtype, q.dtype)), KernelContext(np), [q, k, v])
    return [q, k, v, y, lse, normal(rng, *q_shape, dtype=dtype)], attrs


def _moe(rng, grad, experts=4, held=4, **attrs):
    # 2 x 1024 tokens, top 2 of 4 experts: each expert's expected share (1024 rows) fills
    # a block of the kernel's (moe.ROWS), whatever the routing's imbalance
    b, s, d, inner = 2, 1024, 64, 128
    ids = np.stack([rng.permutation(experts)[:2] for _ in range(b * s)]).reshape(b, s, 2)
    args = [normal(rng, b, s, d), ids, rng.uniform(0.1, 1, (b, s, 2)).astype(np.float32),
            normal(rng, held, d, inner), normal(rng, held, d, inner), normal(rng, held, inner, d)]
    return args + [normal(rng, b, s, d)] * grad, attrs


def _update(rng, n, states=2, mixed=False):
    """A parameter, its gradient and ``states`` (the last, a second moment, positive)."""
    p = normal(rng, n, dtype=BF16 if mixed else np.float32)
    states = [normal(rng, n) for _ in range(states - 1)] + [rng.random(n, np.float32)]
    if mixed:
        states[0] = p.astype(np.float32)
    return [p, normal(rng, n, dtype=p.dtype), *states]


ADAM = {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8, "weight_decay": 0.01}
STEP, LR = np.array(3, np.int64), np.array(1e-3, np.float32)


def indices(rng, *shape, high):
    """int64 ids, labels or indices in [0, high)."""
    return rng.integers(0, high, shape)


# id -> (op type, make(rng) -> (operands, attributes))
CASES = {
    "softmax-axis1": ("softmax", lambda r: ([normal(r, 64, 256, 32)], {"axis": 1})),
    "add": ("add", lambda r: ([normal(r, 1024, 512), normal(r, 1024, 512)], {})),
    "subtract-broadcast": ("subtract", lambda r: ([normal(r, 512), normal(r, 1024, 512)], {})),
    "multiply-0d": ("multiply", lambda r: ([normal(r, 1024, 512), normal(r)], {})),
    "scale": ("scale", lambda r: ([normal(r, 1024, 512)], {"scale": 0.5, "bias": 1.0})),
    "relu_grad": ("relu_grad", lambda r: ([normal(r, 1024, 512), normal(r, 1024, 512)], {})),
    "silu_grad": ("silu_grad", lambda r: ([normal(r, 1024, 512), normal(r, 1024, 512)], {})),
    "max": ("max", lambda r: ([normal(r, 1024, 512)], {"axis": (0,), "keepdim": True})),
    "sum-axes": ("sum", lambda r: ([normal(r, 64, 1024, 16)], {"axis": (0, 2), "keepdim": False})),
    "matmul-rows": ("matmul", lambda r: ([normal(r, 8, 128, 512), normal(r, 8, 128, 256)],
                                         {"rows": True})),
    "matmul-transposed": ("matmul", lambda r: ([normal(r, 4, 256, 128), normal(r, 4, 512, 128)],
                                               {"transpose_y": True})),
    "reshape": ("reshape", lambda r: ([normal(r, 1024, 512)], {"shape": (512, 1024)})),
    "broadcast_to": ("broadcast_to", lambda r: ([normal(r, 512)], {"shape": (1024, 512)})),
    "slice": ("slice", lambda r: ([normal(r, 1024, 1024)], {"axes": (1,), "starts": (256,),
                                                             "ends": (768,)})),
    "pad": ("pad", lambda r: ([normal(r, 1021, 512)], {"axis": 0, "size": 1024})),
    "pad-window": ("pad", lambda r: ([normal(r, 1021, 512)], {"axis": 0, "size": 1024,
                                                               "window": (512, 1024)})),
    "full": ("full", lambda r: ([], {"shape": (1024, 512), "value": 1.0, "dtype": "float32"})),
    "label_mask-bf16": ("label_mask", lambda r: ([indices(r, 1 << 19, high=5)],
                                                 {"ignore_index": 0, "dtype": "bfloat16"})),
    "softmax_grad-axis0": ("softmax_grad", lambda r: ([normal(r, 512, 1024),
                                                       normal(r, 512, 1024)], {"axis": 0})),
    "log_softmax": ("log_softmax", lambda r: ([normal(r, 512, 1024)], {"axis": 1})),
    "log_softmax_grad": ("log_softmax_grad", lambda r: ([normal(r, 512, 1024),
                                                         normal(r, 512, 1024)], {"axis": -1})),
    "scaled_masked_softmax": ("scaled_masked_softmax",
                              lambda r: ([normal(r, 4, 512, 512)], {"scale": 0.3})),
    "scaled_masked_softmax-full": ("scaled_masked_softmax",
                                   lambda r: ([normal(r, 4, 512, 512)], {"causal": False})),
    "scaled_masked_softmax_grad": ("scaled_masked_softmax_grad",
                                   lambda r: ([normal(r, 4, 512, 512), normal(r, 4, 512, 512)],
                                              {"scale": 0.3})),
    "tanh_grad-broadcast": ("tanh_grad", lambda r: ([normal(r, 1024, 512), normal(r, 512)], {})),
    "gelu_grad-broadcast": ("gelu_grad", lambda r: ([normal(r, 512), normal(r, 1024, 512)], {})),
    "divide-broadcast": ("divide", lambda r: ([normal(r, 1024, 512), normal(r, 1024, 1)], {})),
    "max_grad": ("max_grad", lambda r: ([normal(r, 1024, 512), normal(r, 1024, 1),
                                         normal(r, 1024, 1)], {})),
    "where-0d": ("where", lambda r: ([r.random((1024, 512)) < 0.5, normal(r, 1024, 512),
                                      np.zeros((), np.float32)], {})),
    "dropout": ("dropout", lambda r: ([normal(r, 1024, 512)], {"p": 0.1, "seed": 3})),
    "dropout_grad": ("dropout_grad", lambda r: ([r.random((1024, 512)) < 0.9,
                                                 normal(r, 1024, 512)], {"p": 0.1})),
    "causal_mask-window": ("causal_mask", lambda r: ([], {"size": 2048, "window": 100})),
    "layer_norm-2d": ("layer_norm", lambda r: ([normal(r, 4096, 256), normal(r, 256),
                                                normal(r, 256)], {})),
    "layer_norm_grad-2d": ("layer_norm_grad", lambda r: (
        [normal(r, 4096, 256), normal(r, 256), normal(r, 4096), normal(r, 4096),
         normal(r, 4096, 256)], {})),
    "softmax_cross_entropy-rows": ("softmax_cross_entropy", lambda r: (
        [normal(r, 16384, 64), indices(r, 16384, high=64)], {})),
    "softmax_cross_entropy_grad-rows": ("softmax_cross_entropy_grad", lambda r: (
        [normal(r, 16384, 64), indices(r, 16384, high=64), normal(r, 16384),
         normal(r, 16384)], {})),
    "embedding-vocab-shard": ("embedding", lambda r: (
        [indices(r, 16, 512, high=1024), normal(r, 256, 256)],
        {"vocab_start": 256, "vocab_size": 1024})),
    "embedding_grad-vocab-shard": ("embedding_grad", lambda r: (
        [indices(r, 16, 256, high=2048), normal(r, 16, 256, 256)],
        {"vocab_start": 512, "vocab_size": 512})),
    "top_k": ("top_k", lambda r: ([normal(r, 8192, 64)], {"k": 2})),
    "top_k_grad": ("top_k_grad", lambda r: ([normal(r, 16384, 2), indices(r, 16384, 2, high=64)],
                                            {"n": 64})),
    "one_hot": ("one_hot", lambda r: ([indices(r, 16384, high=64)], {"n": 64})),
    "nonfinite_count": ("nonfinite_count", lambda r: ([normal(r, 1024, 1024)], {})),
    "attention-blocks": ("attention", lambda r: _attention(r, False, (1, 4, 768, 32), 4)),
    "attention_grad-blocks": ("attention_grad",
                              lambda r: _attention(r, True, (1, 4, 768, 32), 4)),
    "attention-window-gqa": ("attention", lambda r: _attention(r, False, (2, 8, 256, 32), 2,
                                                               sliding_window=100)),
    "attention_grad-window-gqa": ("attention_grad", lambda r: _attention(
        r, True, (2, 8, 256, 32), 2, sliding_window=100)),
    "attention-full": ("attention", lambda r: _attention(r, False, (2, 8, 256, 32), 8,
                                                         causal=False)),
    "attention_grad-full": ("attention_grad", lambda r: _attention(r, True, (2, 8, 256, 32), 8,
                                                                   causal=False)),
    "attention-chunks": ("attention", lambda r: _attention(r, False, (2, 8, 256, 32), 8,
                                                           sequence_chunks=4)),
    "attention_grad-chunks": ("attention_grad", lambda r: _attention(
        r, True, (2, 8, 256, 32), 8, sequence_chunks=4)),
    "moe_ffn": ("moe_ffn", lambda r: _moe(r, False)),
    "moe_ffn_grad": ("moe_ffn_grad", lambda r: _moe(r, True)),
    "moe_ffn-capacity": ("moe_ffn", lambda r: _moe(r, False, capacity=2048)),
    "moe_ffn_grad-capacity": ("moe_ffn_grad", lambda r: _moe(r, True, capacity=2048)),
    "moe_ffn-expert-shard": ("moe_ffn", lambda r: _moe(r, False, held=2, expert_start=2,
                                                       num_experts=4)),
    "moe_ffn_grad-expert-shard": ("moe_ffn_grad", lambda r: _moe(
        r, True, held=2, expert_start=2, num_experts=4)),
    "adam_update": ("adam_update", lambda r: (_update(r, 1 << 18) + [STEP, LR], ADAM)),
    "adam_update-small": ("adam_update", lambda r: (_update(r, 50_000) + [STEP, LR], ADAM)),
    "mixed_adam_update": ("mixed_adam_update", lambda r: (
        _update(r, 1 << 18, states=3, mixed=True) + [STEP, LR], ADAM)),
    "sgd_update": ("sgd_update", lambda r: (_update(r, 1 << 18, states=1) + [LR],
                                            {"momentum": 0.0})),
    "sgd_update-momentum": ("sgd_update", lambda r: (_update(r, 1 << 18, states=1) + [LR],
                                                     {"momentum": 0.9})),
    # 16-bit operands: computed in float32, or taken as they are
    "matmul-bf16": ("matmul", lambda r: ([normal(r, 512, 1024, dtype=BF16),
                                          normal(r, 1024, 1024, dtype=BF16)], {})),
    "add-bf16-broadcast": ("add", lambda r: ([normal(r, 1024, 1024, dtype=BF16),
                                              normal(r, 1024, dtype=BF16)], {})),
    "sum-bf16": ("sum", lambda r: ([normal(r, 1024, 1024, dtype=BF16)],
                                   {"axis": (0,), "keepdim": False})),
    "cast-bf16-float32": ("cast", lambda r: ([normal(r, 1024, 1024, dtype=BF16)],
                                             {"dtype": "float32"})),
    "cast-float32-bf16": ("cast", lambda r: ([normal(r, 1024, 1024)], {"dtype": "bfloat16"})),
    "rms_norm-bf16": ("rms_norm", lambda r: ([normal(r, 4096, 256, dtype=BF16),
                                              normal(r, 256, dtype=BF16)], {})),
    "rms_norm_grad-bf16": ("rms_norm_grad", lambda r: (
        [normal(r, 4096, 256, dtype=BF16), normal(r, 256, dtype=BF16), normal(r, 4096),
         normal(r, 4096, 256, dtype=BF16)], {})),
    "rotary-bf16": ("rotary", lambda r: ([normal(r, 8, 256, 8, 64, dtype=BF16)],
                                         {"seq_axis": 1, "theta": 1e4})),
    "layer_norm_grad-bf16": ("layer_norm_grad", lambda r: (
        [normal(r, 4096, 256, dtype=BF16), normal(r, 256, dtype=BF16),
         normal(r, 4096, dtype=BF16), normal(r, 4096, dtype=BF16),
         normal(r, 4096, 256, dtype=BF16)], {})),
    "attention-bf16": ("attention", lambda r: _attention(r, False, (2, 8, 256, 32), 4, BF16)),
    "concat-bf16": ("concat", lambda r: ([normal(r, 512, 1024, dtype=BF16)] * 3, {"axis": 1})),
    "split-bf16": ("split", lambda r: ([normal(r, 512, 1536, dtype=BF16)],
                                       {"sections": (512, 1024), "axis": 1})),
    "transpose-bf16": ("transpose", lambda r: ([normal(r, 512, 2048, dtype=BF16)],
                                               {"perm": (1, 0)})),
    "slice_grad-bf16": ("slice_grad", lambda r: ([normal(r, 512, 1024, dtype=BF16)],
                                                 {"axes": (1,), "starts": (512,),
                                                  "ends": (1536,), "shape": (512, 2048)})),
    "where-bf16": ("where", lambda r: ([r.random((1024, 1024)) < 0.5,
                                        normal(r, 1024, 1024, dtype=BF16),
                                        np.zeros((), BF16)], {})),
    "one_hot-bf16": ("one_hot", lambda r: ([indices(r, 16384, high=64)],
                                           {"n": 64, "dtype": "bfloat16"})),
    "embedding-bf16": ("embedding", lambda r: ([indices(r, 16, 512, high=1024),
                                                normal(r, 1024, 128, dtype=BF16)], {})),
    "embedding-bf16-vocab-shard": ("embedding", lambda r: (
        [indices(r, 16, 512, high=2048), normal(r, 512, 128, dtype=BF16)],
        {"vocab_start": 512, "vocab_size": 2048})),
    "embedding_grad-bf16": ("embedding_grad", lambda r: (
        [indices(r, 16, 256, high=1024), normal(r, 16, 256, 256, dtype=BF16)],
        {"vocab_size": 1024})),
    "nonfinite_count-bf16": ("nonfinite_count", lambda r: ([normal(r, 1024, 1024, dtype=BF16)],
                                                           {})),
}


UNARY = ("neg", "exp", "log", "sqrt", "tanh", "relu", "gelu", "silu")
CASES.update({op: (op, lambda r: ([r.uniform(0.5, 2.0, (1024, 512)).astype(np.float32)], {}))
              for op in UNARY})
# 0-d state ops: nothing of theirs is large enough to measure
SCALAR_OPS = {"increment", "loss_scale_of", "loss_scale_update"}


def test_every_op_has_a_case():
    from distgraph.ops import registered_ops
    assert set(registered_ops()) - SCALAR_OPS == {op for op, _ in CASES.values()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_ops_workspace_in_its_other_forms(case):
    op_type, make = CASES[case]
    args, attrs = make(np.random.default_rng(0))
    measured, declared, results = measure_op(op_type, args, attrs)
    assert not off(measured, declared), (measured, declared)
    # the premise: a temporary the size of an operand or the results would show above
    # the slack
    assert max([results, declared] + [a.nbytes for a in args]) > 4 * SLACK


def test_ops_taking_16bit_operands_equal_their_float32_computation():
    """An op registered with ``takes_16bit`` gets its 16-bit operands as they are; its
    results equal, bit for bit, the executor's rule for every other op (the operands
    widened to float32, the kernel, the results rounded to their dtypes)."""
    checked = set()
    for case, (op_type, make) in sorted(CASES.items()):
        args, attrs = make(np.random.default_rng(0))
        entry = get_op(op_type)
        outs = entry.infer(*[kind_of(a) for a in args], **attrs)
        outs = [outs] if isinstance(outs, TensorType) else list(outs)
        if not entry.takes_16bit or not any(t.dtype in dtypes.HALF_DTYPES
                                            for t in [*map(kind_of, args), *outs]):
            continue
        instr = OpInstr(entry.kernel, op_type, "", (), (), attrs, (), {},
                        out_dtypes=tuple(dtypes.numpy_dtype(t.dtype) for t in outs))
        got = executor.call_kernel(instr, KernelContext(np), [a.copy() for a in args])
        wide = [a.astype(np.float32) if a.dtype == BF16 else a.copy() for a in args]
        want = entry.kernel(KernelContext(np), *wide, **attrs)
        want = want if isinstance(want, tuple) else (want,)
        for g, w, t in zip(got, want, outs):
            assert g.dtype == dtypes.numpy_dtype(t.dtype), case
            np.testing.assert_array_equal(g, np.asarray(w).astype(g.dtype), err_msg=case)
        checked.add(op_type)
    assert {"concat", "split", "transpose", "slice_grad", "cast", "where", "embedding",
            "one_hot", "label_mask", "nonfinite_count", "mixed_adam_update"} <= checked


def _mlp(p, f):
    ops = dg.ops
    h = ops.relu(ops.matmul(p["x"], p["w1"]))
    a, b = ops.split(ops.tanh(ops.matmul(h, p["w2"])), 2, axis=1)
    z = ops.concat([ops.where(f["keep"], a, 0.0), b], axis=1)
    return ops.log_softmax(ops.add(z, p["bias"]), axis=-1)


def test_a_small_programs_ops_with_their_gradients(monkeypatch):
    """An MLP (relu, tanh, split, where, concat, log_softmax) and its gradient, run by
    the ProgramRunner (which donates dying operands to the ops that take them)."""
    from gradcheck import GradCheck
    rng = np.random.default_rng(0)
    params = {"x": normal(rng, 1024, 256), "w1": normal(rng, 256, 512),
              "w2": normal(rng, 512, 512), "bias": normal(rng, 512)}
    case = GradCheck(_mlp, params, {"keep": rng.random((1024, 256)) < 0.5})
    rows = measured_program(monkeypatch, case.program, dict(case.params), case.feeds)
    seen = {t for t, *_ in rows}
    assert {"relu_grad", "tanh_grad", "split", "concat", "where", "log_softmax",
            "log_softmax_grad"} <= seen
    wrong = [(t, m, d) for t, m, d, _ in rows if off(m, d)]
    assert not wrong


def test_a_wrong_declaration_fails(monkeypatch):
    """The comparison catches a workspace declared one result short (log_softmax keeps
    one array of its result's size, its exponentials) and one declared a result too many."""
    from dataclasses import replace

    from distgraph import registry
    entry = get_op("log_softmax")
    args, attrs = CASES["log_softmax"][1](np.random.default_rng(0))
    measured, declared, results = measure_op("log_softmax", args, attrs)
    assert not off(measured, declared)
    for wrong in (lambda ins, outs, **a: 0, lambda ins, outs, **a: 2 * results):
        monkeypatch.setitem(registry._REGISTRY, "log_softmax", replace(entry, workspace=wrong))
        measured, declared, _ = measure_op("log_softmax", args, attrs)
        assert off(measured, declared)
