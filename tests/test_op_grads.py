"""Every differentiable op's gradient equals central finite differences (float64).

Each case makes its float inputs Parameters, traces ``sum(op(...) * R)`` with a fixed
random ``R``, appends the backward pass and compares every parameter's gradient with
central differences (see ``gradcheck.py``). Shapes are drawn per seed. ``CASES`` is keyed
by op type; ``test_every_differentiable_op_has_a_case`` fails when a registered
differentiable op has no case, and each case checks that its op really is in its trace.
Grad-only ops (``relu_grad``, ``layer_norm_grad``, ...) are covered through their forward op.
"""

from __future__ import annotations

import math
import os
import sys
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import distgraph as dg
from distgraph.ops import registered_ops, get_op
from distgraph.runtime.execution.executor import ProgramRunner
from distgraph.trace import emit1

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gradcheck import GradCheck, check_grads, run_forward  # noqa: E402

ops = dg.ops
SEEDS = (0, 1)


# -- input generators ----------------------------------------------------------------------------
def normal(rng, shape):
    return rng.standard_normal(shape)


def positive(rng, shape):
    return rng.uniform(0.5, 2.0, shape)


def away_from_zero(rng, shape, margin=0.1):
    """Values with |x| >= margin: kinks (relu) and poles (1/x) stay out of the FD step."""
    return rng.choice([-1.0, 1.0], size=shape) * rng.uniform(margin, 2.0, shape)


def dims(rng, rank, lo=1, hi=4):
    return tuple(int(n) for n in rng.integers(lo, hi + 1, size=rank))


class Case:
    """One gradient check: ``make(rng) -> (fn, params, feeds)``."""

    def __init__(self, op: str, name: str, make, **check_kw):
        self.op, self.name, self.make, self.check_kw = op, name, make, check_kw

    @property
    def id(self) -> str:
        return f"{self.op}-{self.name}"


CASES: list[Case] = []


def case(op, name, **kw):
    def wrap(make):
        CASES.append(Case(op, name, make, **kw))
        return make
    return wrap


# -- elementwise binary with broadcasting --------------------------------------------------------
BINARY = {"add": ops.add, "subtract": ops.subtract, "multiply": ops.multiply, "divide": ops.divide}
BROADCAST_PAIRS = {
    "same": lambda rng: (dims(rng, 2), None),
    "4x1x3+3": lambda rng: ((4, 1, 3), (3,)),
    "3+4x1x3": lambda rng: ((3,), (4, 1, 3)),
    "2x3+scalar": lambda rng: ((2, 3), ()),
    "scalar+2x3": lambda rng: ((), (2, 3)),
    "1x3+2x1": lambda rng: ((1, 3), (2, 1)),
    "2x1x3+4x1": lambda rng: ((2, 1, 3), (4, 1)),
    "random-rank3": lambda rng: (dims(rng, 3), "drop-and-ones"),
}


def _pair_shapes(rng, make):
    a, b = make(rng)
    if b is None:
        b = a
    elif b == "drop-and-ones":
        b = tuple(1 if rng.random() < 0.4 else n for n in a[int(rng.integers(0, 3)):])
    return a, b


for _op, _fn in BINARY.items():
    for _label, _make in BROADCAST_PAIRS.items():
        def _make_case(rng, fn=_fn, make=_make, op=_op):
            sx, sy = _pair_shapes(rng, make)
            y = away_from_zero(rng, sy, 0.5) if op == "divide" else normal(rng, sy)
            return (lambda p, f: fn(p["x"], p["y"])), {"x": normal(rng, sx), "y": y}, {}
        CASES.append(Case(_op, _label, _make_case))

    def _python_scalar(rng, fn=_fn, op=_op):
        x = away_from_zero(rng, dims(rng, 2), 0.5) if op == "divide" else normal(rng, dims(rng, 2))
        return (lambda p, f: [fn(p["x"], 1.5), fn(-2.5, p["x"])]), {"x": x}, {}
    CASES.append(Case(_op, "python-scalar", _python_scalar))


@case("add", "operators")
def _operators(rng):
    s = dims(rng, 2)

    def fn(p, f):
        x, y = p["x"], p["y"]
        return [x + y, x - y, x * y, x / y, -x, 2.0 * x, 1.0 - y, 3.0 / y]
    return fn, {"x": normal(rng, s), "y": away_from_zero(rng, s, 0.5)}, {}


# -- unary -------------------------------------------------------------------------------------
UNARY = {
    "neg": (ops.neg, normal),
    "exp": (ops.exp, normal),
    "log": (ops.log, positive),
    "sqrt": (ops.sqrt, positive),
    "tanh": (ops.tanh, normal),
    "relu": (ops.relu, away_from_zero),
    "gelu": (ops.gelu, lambda rng, s: 2.0 * normal(rng, s)),
    "silu": (ops.silu, lambda rng, s: 3.0 * normal(rng, s)),
    "cast": (lambda x: ops.cast(x, "float64"), normal),
}
for _op, (_fn, _gen) in UNARY.items():
    for _rank in (0, 1, 3):
        def _make_unary(rng, fn=_fn, gen=_gen, rank=_rank):
            return (lambda p, f: fn(p["x"])), {"x": gen(rng, dims(rng, rank))}, {}
        CASES.append(Case(_op, f"rank{_rank}", _make_unary))


@case("scale", "scale-and-bias")
def _scale(rng):
    return (lambda p, f: [ops.scale(p["x"], -0.7, 0.3), ops.scale(p["x"], 2.0)]), \
        {"x": normal(rng, dims(rng, 2))}, {}


# -- where, dropout ------------------------------------------------------------------------------
WHERE_SHAPES = {
    "cond4x1x3-x3-y4x5x3": ((4, 1, 3), (3,), (4, 5, 3)),
    "cond2x3-x2x3-yscalar": ((2, 3), (2, 3), ()),
    "cond3-x2x3-y1x3": ((3,), (2, 3), (1, 3)),
}
for _label, (_sc, _sx, _sy) in WHERE_SHAPES.items():
    def _make_where(rng, sc=_sc, sx=_sx, sy=_sy):
        cond = rng.random(sc) < 0.5
        return (lambda p, f: ops.where(f["cond"], p["x"], p["y"])), \
            {"x": normal(rng, sx), "y": normal(rng, sy)}, {"cond": cond}
    CASES.append(Case("where", _label, _make_where))


@case("where", "python-scalar-branch")
def _where_scalar(rng):
    s = dims(rng, 2)
    return (lambda p, f: ops.where(f["cond"], p["x"], -1.25)), {"x": normal(rng, s)}, \
        {"cond": rng.random(s) < 0.5}


@case("where", "causal-attention")
def _attention(rng):
    t, hd = 4, 3

    def fn(p, f):
        att = ops.matmul(p["q"], p["k"], transpose_y=True)
        att = ops.where(ops.causal_mask(t), att, float("-inf"))
        return ops.matmul(ops.softmax(att, axis=-1), p["v"])
    return fn, {n: normal(rng, (2, t, hd)) for n in "qkv"}, {}


for _step in (0, 5):
    def _make_dropout(rng, step=_step):
        return (lambda p, f: ops.dropout(p["x"], 0.3, seed=7)), {"x": normal(rng, dims(rng, 3))}, {}
    CASES.append(Case("dropout", f"step{_step}", _make_dropout, step=_step))


# -- matmul --------------------------------------------------------------------------------------
MATMUL = {
    # name: (x shape, y shape, transpose_x, transpose_y) with m=2, k=3, n=4
    "mk,kn": ((2, 3), (3, 4), False, False),
    "km,kn": ((3, 2), (3, 4), True, False),
    "mk,nk": ((2, 3), (4, 3), False, True),
    "km,nk": ((3, 2), (4, 3), True, True),
    "bmk,bkn": ((5, 2, 3), (5, 3, 4), False, False),
    "bkm,bnk": ((5, 3, 2), (5, 4, 3), True, True),
    "bmk,bnk": ((5, 2, 3), (5, 4, 3), False, True),
    "broadcast-batch": ((2, 1, 2, 3), (3, 3, 4), False, False),
    "broadcast-batch-trans": ((2, 1, 3, 2), (1, 3, 4, 3), True, True),
    "bmk,1kn": ((5, 2, 3), (1, 3, 4), False, False),
    "3d-x-2d-weight": ((5, 2, 3), (3, 4), False, False),
    "3d-x-2d-weight-trans-y": ((5, 2, 3), (4, 3), False, True),
    "3d-x-trans-2d-weight": ((5, 3, 2), (3, 4), True, False),
    "4d-x-2d-weight": ((2, 3, 2, 3), (3, 4), False, False),
    "2d-x-3d-y": ((2, 3), (5, 3, 4), False, False),
}
for _label, (_sx, _sy, _tx, _ty) in MATMUL.items():
    def _make_matmul(rng, sx=_sx, sy=_sy, tx=_tx, ty=_ty):
        return (lambda p, f: ops.matmul(p["x"], p["y"], transpose_x=tx, transpose_y=ty)), \
            {"x": normal(rng, sx), "y": normal(rng, sy)}, {}
    CASES.append(Case("matmul", _label, _make_matmul))


@case("matmul", "rows-contracted")
def _matmul_rows(rng):       # a weight gradient's form: bsh,bso->ho (its own gradient too)
    from distgraph.ops.linalg import matmul_rows
    return (lambda p, f: matmul_rows(p["x"], p["y"])), \
        {"x": normal(rng, (2, 5, 3)), "y": normal(rng, (2, 5, 4))}, {}


@case("matmul", "operator-and-T")
def _matmul_operator(rng):
    return (lambda p, f: [p["x"] @ p["y"], p["y"].T @ p["x"].T]), \
        {"x": normal(rng, (2, 3)), "y": normal(rng, (3, 4))}, {}


# -- reductions ----------------------------------------------------------------------------------
REDUCE_AXES = {"all": None, "axis0": 0, "axis-1": -1, "axes0,2": (0, 2), "axes-1,1": (-1, 1)}
for _op, _fn in (("sum", ops.sum), ("mean", ops.mean), ("max", ops.max)):
    for _label, _axis in REDUCE_AXES.items():
        for _keep in (False, True):
            def _make_reduce(rng, fn=_fn, axis=_axis, keep=_keep):
                return (lambda p, f: fn(p["x"], axis=axis, keepdim=keep)), \
                    {"x": normal(rng, dims(rng, 3, 2, 4))}, {}
            # mean is composed of sum and scale; its cases are filed under "scale".
            CASES.append(Case("scale" if _op == "mean" else _op,
                              f"{_op}-{_label}-keepdim{int(_keep)}", _make_reduce))


# -- shape ops -----------------------------------------------------------------------------------
RESHAPES = {
    "merge": ((2, 3, 4), [6, 4]),
    "split": ((6, 4), [2, 3, 4]),
    "regroup": ((2, 3, 4), [4, 6]),
    "infer-minus-one": ((2, 3, 4), [-1, 2]),
    "flatten": ((2, 3, 4), [24]),
    "add-unit-dims": ((3, 4), [1, 3, 1, 4]),
    "to-scalar": ((1, 1), []),
}
for _label, (_src, _dst) in RESHAPES.items():
    def _make_reshape(rng, src=_src, dst=_dst):
        return (lambda p, f: ops.reshape(p["x"], dst)), {"x": normal(rng, src)}, {}
    CASES.append(Case("reshape", _label, _make_reshape))


for _rank in (2, 3, 4):
    def _make_transpose(rng, rank=_rank):
        perm = [int(i) for i in rng.permutation(rank)]
        if perm == sorted(perm):
            perm = perm[::-1]
        return (lambda p, f: ops.transpose(p["x"], perm)), {"x": normal(rng, dims(rng, rank, 2))}, {}
    CASES.append(Case("transpose", f"rank{_rank}", _make_transpose))


BROADCAST_TO = {"3->2x4x3": ((3,), (2, 4, 3)), "4x1->4x5": ((4, 1), (4, 5)),
                "scalar->2x3": ((), (2, 3)), "1x3x1->2x3x4": ((1, 3, 1), (2, 3, 4))}
for _label, (_src, _dst) in BROADCAST_TO.items():
    def _make_bcast(rng, src=_src, dst=_dst):
        return (lambda p, f: ops.broadcast_to(p["x"], dst)), {"x": normal(rng, src)}, {}
    CASES.append(Case("broadcast_to", _label, _make_bcast))


for _axis in (0, 1, -1):
    def _make_concat(rng, axis=_axis):
        base = list(dims(rng, 3, 2, 3))
        shapes = []
        for _ in range(3):
            s = list(base)
            s[axis] = int(rng.integers(1, 4))
            shapes.append(tuple(s))
        ps = {f"x{i}": normal(rng, s) for i, s in enumerate(shapes)}
        return (lambda p, f: ops.concat([p["x0"], p["x1"], p["x2"]], axis=axis)), ps, {}
    CASES.append(Case("concat", f"axis{_axis}", _make_concat))


@case("split", "equal-parts")
def _split_equal(rng):
    return (lambda p, f: ops.split(p["x"], 3, axis=1)), {"x": normal(rng, (2, 6, 3))}, {}


@case("split", "sections-last-axis")
def _split_sections(rng):
    return (lambda p, f: ops.split(p["x"], [1, 3, 2], axis=-1)), {"x": normal(rng, (3, 6))}, {}


@case("split", "unused-outputs")
def _split_unused(rng):
    # Only the middle part reaches the loss: the others' gradients are zeros.
    return (lambda p, f: ops.split(p["x"], [2, 1, 3], axis=0)[1]), {"x": normal(rng, (6, 4))}, {}


SLICES = {
    "one-axis": ((5, 4), [0], [1], [4]),
    "two-axes": ((5, 4, 3), [0, 2], [2, 1], [5, 3]),
    "negative-start-and-axis": ((5, 6), [-1], [-4], [6]),
}
for _label, (_s, _axes, _starts, _ends) in SLICES.items():
    def _make_slice(rng, s=_s, axes=_axes, starts=_starts, ends=_ends):
        return (lambda p, f: ops.slice(p["x"], axes, starts, ends)), {"x": normal(rng, s)}, {}
    CASES.append(Case("slice", _label, _make_slice))


# pad: ZeRO's zeros past a dim's end (inserted by the planner, never traced by a model)
for _label, (_s, _axis, _size) in {"rows": ((5, 4), 0, 6), "last-axis": ((3, 2, 5), 2, 8),
                                   "nothing-added": ((4, 3), 1, 3)}.items():
    def _make_pad(rng, s=_s, axis=_axis, size=_size):
        return (lambda p, f: emit1("pad", [p["x"]], {"axis": axis, "size": size})), \
            {"x": normal(rng, s)}, {}
    CASES.append(Case("pad", _label, _make_pad))

# -- nn ops --------------------------------------------------------------------------------------
for _op, _fn in (("softmax", ops.softmax), ("log_softmax", ops.log_softmax)):
    for _rank, _axis in ((2, -1), (2, 0), (3, 1), (3, -1)):
        def _make_softmax(rng, fn=_fn, rank=_rank, axis=_axis):
            return (lambda p, f: fn(p["x"], axis=axis)), \
                {"x": 2.0 * normal(rng, dims(rng, rank, 2, 5))}, {}
        CASES.append(Case(_op, f"rank{_rank}-axis{_axis}", _make_softmax))


for _shape, _causal in (((2, 3, 4, 4), True), ((3, 2, 5), False), ((2, 3, 5), True)):
    def _make_sms(rng, shape=_shape, causal=_causal):
        return (lambda p, f: ops.scaled_masked_softmax(p["x"], 0.7, causal)), \
            {"x": 2.0 * normal(rng, shape)}, {}
    CASES.append(Case("scaled_masked_softmax", f"{len(_shape)}d-causal{_causal}-{_shape[-2]}x"
                      f"{_shape[-1]}", _make_sms))


for _shape in ((3, 5), (2, 3, 6)):
    def _make_ln(rng, shape=_shape):
        h = shape[-1]
        ps = {"x": normal(rng, shape) * 2 + 0.5, "w": 1 + 0.3 * normal(rng, (h,)),
              "b": 0.3 * normal(rng, (h,))}
        return (lambda p, f: ops.layer_norm(p["x"], h, p["w"], p["b"], 1e-5)), ps, {}
    CASES.append(Case("layer_norm", "x".join(map(str, _shape)), _make_ln))


for _shape in ((3, 5), (2, 3, 6)):
    def _make_rms(rng, shape=_shape):
        ps = {"x": normal(rng, shape) * 2 + 0.5, "w": 1 + 0.3 * normal(rng, (shape[-1],))}
        return (lambda p, f: ops.rms_norm(p["x"], p["w"], 1e-5)), ps, {}
    CASES.append(Case("rms_norm", "x".join(map(str, _shape)), _make_rms))


for _label, _shape, _axis, _scaling in (
        ("bshd", (2, 5, 3, 4), 1, None), ("bhsd", (2, 3, 6, 8), 2, None),
        ("llama3", (1, 7, 2, 8), 1, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 4})):
    def _make_rotary(rng, shape=_shape, axis=_axis, scaling=_scaling):
        return (lambda p, f: ops.rotary(p["x"], axis, 10.0, scaling)), \
            {"x": normal(rng, shape)}, {}
    CASES.append(Case("rotary", _label, _make_rotary))


for _label, _attrs, _kv in (("causal", {}, 4), ("window3", {"sliding_window": 3}, 4),
                            ("chunks4", {"sequence_chunks": 4}, 4),
                            ("full", {"causal": False}, 4), ("gqa2", {}, 2),
                            ("mqa-window3-chunks4", {"sliding_window": 3,
                                                     "sequence_chunks": 4}, 1)):
    def _make_attention(rng, attrs=_attrs, kv=_kv):
        # q [b, h, s, d] = [2, 4, 8, 3], k and v with kv heads (grouped-query: 2, 1);
        # "chunks4": the sequence stored in the balanced order of 4 chunks
        ps = {"q": normal(rng, (2, 4, 8, 3)), "k": normal(rng, (2, kv, 8, 3)),
              "v": normal(rng, (2, kv, 8, 3))}
        return (lambda p, f: emit1("attention", [p["q"], p["k"], p["v"]],
                                   {"scale": 0.7, **attrs})), ps, {}
    CASES.append(Case("attention", _label, _make_attention))


@case("top_k", "renormalised")
def _top_k(rng):
    # Mixtral's router: softmax, the top 2 of 5, renormalised (distinct values: no ties)
    def fn(p, f):
        top, _ = ops.top_k(ops.softmax(p["logits"]), 2)
        return ops.divide(top, ops.sum(top, axis=-1, keepdim=True))
    return fn, {"logits": normal(rng, (2, 3, 5))}, {}


for _label, _capacity, _start in (("dropless", None, None), ("capacity2", 2, None),
                                  ("expert-shard", None, 2)):
    def _make_moe(rng, capacity=_capacity, start=_start):
        # 4 experts (2 held from expert 2 on, for the shard), hidden 5, inner 3, top 2
        ids = np.stack([rng.permutation(4)[:2] for _ in range(8)]).reshape(2, 4, 2)
        held = 4 if start is None else 2
        ps = {"x": normal(rng, (2, 4, 5)), "w": rng.uniform(0.2, 1.0, (2, 4, 2)),
              "gate": normal(rng, (held, 5, 3)), "up": normal(rng, (held, 5, 3)),
              "down": normal(rng, (held, 3, 5))}
        attrs = {"capacity": capacity}
        if start is not None:
            attrs.update(expert_start=start, num_experts=4)
        return (lambda p, f: emit1("moe_ffn", [p["x"], f["ids"], p["w"], p["gate"], p["up"],
                                               p["down"]], attrs)), ps, {"ids": ids}
    CASES.append(Case("moe_ffn", _label, _make_moe))


for _label, _ids_shape in (("ids2x5", (2, 5)), ("ids8", (8,))):
    def _make_emb(rng, ids_shape=_ids_shape):
        ids = rng.integers(0, 5, ids_shape).astype(np.int64)   # repeats: gradient rows add up
        return (lambda p, f: ops.embedding(f["ids"], p["table"])), {"table": normal(rng, (7, 4))}, \
            {"ids": ids}
    CASES.append(Case("embedding", _label, _make_emb))


@case("embedding", "vocab-shard")
def _emb_shard(rng):
    # The vocabulary-parallel form: this shard owns ids 3..6; other ids give zero rows.
    ids = rng.integers(0, 9, (3, 4)).astype(np.int64)
    return (lambda p, f: emit1("embedding", [f["ids"], p["table"]], {"vocab_start": 3})), \
        {"table": normal(rng, (4, 5))}, {"ids": ids}


for _label, _shape in (("5x7", (5, 7)), ("2x3x6", (2, 3, 6))):
    def _make_sce(rng, shape=_shape):
        labels = rng.integers(0, shape[-1], shape[:-1]).astype(np.int64)
        return (lambda p, f: ops.softmax_cross_entropy(p["logits"], f["labels"])), \
            {"logits": 2.0 * normal(rng, shape)}, {"labels": labels}
    CASES.append(Case("softmax_cross_entropy", _label, _make_sce))

for _label, _ignore in (("ignored-labels", -100), ("ignore-index-2", 2)):
    def _make_sce_ignored(rng, ignore=_ignore):
        # every other label is ignore_index: those positions get loss 0 and gradient 0
        labels = rng.integers(0, 6, (4, 3)).astype(np.int64)
        labels[::2] = ignore
        return (lambda p, f: ops.softmax_cross_entropy(p["logits"], f["labels"], ignore)), \
            {"logits": normal(rng, (4, 3, 6))}, {"labels": labels}
    CASES.append(Case("softmax_cross_entropy", _label, _make_sce_ignored))

for _label, _fraction in (("cross_entropy-mean-ignored", 0.5), ("cross_entropy-mean-all-ignored", 1)):
    def _make_ce_ignored(rng, fraction=_fraction):
        # the mean is over the labels that are not ignored (all ignored: loss and grads 0)
        labels = rng.integers(0, 6, (2, 4)).astype(np.int64)
        labels[rng.random((2, 4)) < fraction] = -100
        return (lambda p, f: ops.cross_entropy(p["logits"], f["labels"])), \
            {"logits": normal(rng, (2, 4, 6))}, {"labels": labels}
    CASES.append(Case("softmax_cross_entropy", _label, _make_ce_ignored))

for _reduction in ("mean", "sum", "none"):
    def _make_ce(rng, reduction=_reduction):
        labels = rng.integers(0, 6, (2, 3)).astype(np.int64)
        return (lambda p, f: ops.cross_entropy(p["logits"], f["labels"], reduction=reduction)), \
            {"logits": normal(rng, (2, 3, 6))}, {"labels": labels}
    CASES.append(Case("softmax_cross_entropy", f"cross_entropy-{_reduction}", _make_ce))

for _reduction in ("mean", "sum", "none"):
    def _make_mse(rng, reduction=_reduction):
        return (lambda p, f: ops.mse_loss(p["pred"], f["target"], reduction=reduction)), \
            {"pred": normal(rng, (4, 3))}, {"target": normal(rng, (4, 3))}
    CASES.append(Case("multiply", f"mse_loss-{_reduction}", _make_mse))


# -- the tests -----------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("c", CASES, ids=lambda c: c.id)
def test_gradient_matches_finite_differences(c: Case, seed: int):
    rng = np.random.default_rng([seed, zlib.crc32(c.id.encode())])
    fn, params, feeds = c.make(rng)
    checked = check_grads(fn, params, feeds, seed=seed, **c.check_kw)
    assert c.op in checked.forward_types, f"case {c.id} does not emit '{c.op}'"


def test_every_differentiable_op_has_a_case():
    covered = {c.op for c in CASES}
    differentiable = {t for t in registered_ops() if get_op(t).differentiable}
    missing = sorted(differentiable - covered)
    assert not missing, f"differentiable ops without a finite-difference case: {missing}"
    assert covered <= set(registered_ops())


def _broadcast_pair(draw):
    base = draw(st.lists(st.integers(1, 3), min_size=0, max_size=3))
    shapes = []
    for _ in range(2):
        drop = draw(st.integers(0, len(base)))
        shapes.append(tuple(1 if draw(st.booleans()) else n for n in base[drop:]))
    return shapes


@settings(max_examples=15, deadline=None)
@given(data=st.data(), op=st.sampled_from(sorted(BINARY)))
def test_broadcasting_binary_ops_hypothesis(data, op):
    sx, sy = _broadcast_pair(data.draw)
    rng = np.random.default_rng(len(sx) * 7 + len(sy))
    y = away_from_zero(rng, sy, 0.5) if op == "divide" else normal(rng, sy)
    check_grads(lambda p, f: BINARY[op](p["x"], p["y"]), {"x": normal(rng, sx), "y": y})


def test_dropout_mask_is_deterministic_in_seed_and_step():
    x = np.ones((64, 32))

    def kept(seed, step):
        prog = dg.trace(lambda v: ops.dropout(v, 0.5, seed=seed),
                        dg.InputSpec(x.shape, "float64", "x"))
        out = ProgramRunner(prog).run({}, {"x": x}, [prog.outputs[0].name], step=step)
        return out[prog.outputs[0].name] != 0

    a = kept(3, 0)
    np.testing.assert_array_equal(a, kept(3, 0))
    assert not np.array_equal(a, kept(3, 1))
    assert not np.array_equal(a, kept(4, 0))
    assert 0.4 < a.mean() < 0.6


def test_cast_down_gives_float64_gradient_of_rounded_weights():
    # loss = sum(cast(x, f32) * R32): dloss/dx is R32 cast back to float64, exactly.
    rng = np.random.default_rng(0)
    case = GradCheck(lambda p, f: ops.cast(p["x"], "float32"), {"x": normal(rng, (3, 4))})
    _, grads = case.analytic()
    assert grads["x"].dtype == np.float64
    np.testing.assert_array_equal(grads["x"], case.feeds["R@0"].astype(np.float64))


# -- float32 forward equals numpy ------------------------------------------------------------------
def _np_layer_norm(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def _np_gelu(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _np_softmax(x, axis):
    e = np.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


FLOAT32_CASES = {
    "matmul": (lambda v: ops.matmul(v["a"], v["b"], transpose_y=True), lambda v: v["a"] @ v["b"].T),
    # a Linear layer over stacked rows: the kernel runs it as one GEMM
    "matmul-rows-2d-weight": (lambda v: ops.matmul(v["r"], v["b"], transpose_y=True),
                              lambda v: np.einsum("bmk,nk->bmn", v["r"], v["b"])),
    "add-broadcast": (lambda v: ops.add(v["x"], v["bias"]), lambda v: v["x"] + v["bias"]),
    "softmax": (lambda v: ops.softmax(v["x"], axis=0), lambda v: _np_softmax(v["x"], 0)),
    "log_softmax": (lambda v: ops.log_softmax(v["x"]),
                    lambda v: np.log(_np_softmax(v["x"].astype(np.float64), -1))),
    "layer_norm": (lambda v: ops.layer_norm(v["x"], None, v["w"], v["bias"]),
                   lambda v: _np_layer_norm(v["x"].astype(np.float64), v["w"], v["bias"])),
    "gelu": (lambda v: ops.gelu(v["x"]), lambda v: _np_gelu(v["x"].astype(np.float64))),
    "relu-exp-tanh": (lambda v: ops.tanh(ops.exp(ops.relu(v["x"]))),
                      lambda v: np.tanh(np.exp(np.maximum(v["x"], 0)))),
    "sum-mean-max": (lambda v: [ops.sum(v["x"], 0), ops.mean(v["x"], -1), ops.max(v["x"])],
                     lambda v: [v["x"].sum(0), v["x"].mean(-1), v["x"].max()]),
}


@pytest.mark.parametrize("name", sorted(FLOAT32_CASES))
def test_float32_forward_equals_numpy(name):
    rng = np.random.default_rng(0)
    f32 = lambda s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    values = {"a": f32((5, 8)), "b": f32((6, 8)), "x": f32((5, 6)), "bias": f32((6,)),
              "w": f32((6,)), "r": f32((3, 5, 8))}
    fn, ref = FLOAT32_CASES[name]
    got = run_forward(fn, values)
    want = ref(values)
    want = list(want) if isinstance(want, list) else [want]
    for g, w in zip(got, want):
        assert g.dtype == np.float32
        np.testing.assert_allclose(g, w, rtol=2e-6, atol=2e-6)


def test_float32_gradients_match_float64():
    rng = np.random.default_rng(0)
    x, w, b = normal(rng, (4, 6)), normal(rng, (6, 3)), normal(rng, (3,))

    def fn(p, f):
        return ops.softmax(ops.gelu(ops.matmul(p["x"], p["w"]) + p["b"]), axis=-1)

    params = {"x": x, "w": w, "b": b}
    g64 = GradCheck(fn, params).analytic()[1]
    # Same seed: R of the float32 case is the float64 R rounded to float32.
    g32 = GradCheck(fn, {n: a.astype(np.float32) for n, a in params.items()}).analytic()[1]
    for n in g64:
        assert g32[n].dtype == np.float32
        np.testing.assert_allclose(g32[n], g64[n], rtol=1e-4, atol=1e-5, err_msg=n)

