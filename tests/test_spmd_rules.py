"""Per-op sharding rules called directly (``dg.ops.spmd_rule(op).infer_forward/backward``).

Oracle: the hand-derived layouts of the op's einsum notation — a split of a kept letter
follows it, a split contracted letter makes the result Partial (linear ops) or is dropped
(non-linear ones), a conflict keeps the earlier operand's split and says the other one
is resharded.
"""

import pytest

import distgraph as dg
from distgraph.spmd import UNKNOWN as U
from distgraph.spmd import DimsSpec

MESH = dg.ProcessMesh([[0, 1, 2], [3, 4, 5]], dim_names=["x", "y"])   # x: 2, y: 3
XS, YS = (64, 32), (32, 48)


def specs(res):
    """(input specs, output specs) of a rule result as strings."""
    return [str(s) for s in res.in_specs], [str(s) for s in res.out_specs]


def fwd(op, in_specs, in_shapes, **attrs):
    return dg.ops.spmd_rule(op).infer_forward(in_specs, in_shapes, MESH, **attrs)


# -- matmul ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("x, y, want_in, want_out", [
    # S(0) x R -> S(0): row split
    (["x", U], [U, U], ["[x, ?]", "[?, ?]"], ["[x, ?]"]),
    # R x S(1) -> S(1): column split
    ([U, U], [U, "y"], ["[?, ?]", "[?, y]"], ["[?, y]"]),
    # S(1) x S(0) -> P: contracted split
    ([None, "x"], ["x", None], ["[None, x]", "[x, None]"], ["[None, None] P(x)"]),
    # the contracted split of one operand reaches the other
    ([None, "x"], [U, U], ["[None, x]", "[x, ?]"], ["[None, ?] P(x)"]),
    # row and column over the two mesh dims
    (["x", None], [None, "y"], ["[x, None]", "[None, y]"], ["[x, y]"]),
], ids=["row", "column", "contracted", "contracted-propagates", "row+column"])
def test_matmul_forward_2d(x, y, want_in, want_out):
    res = fwd("matmul", [x, y], [XS, YS], transpose_x=False, transpose_y=False)
    assert specs(res) == (want_in, want_out)
    assert res.notes == ()


def test_matmul_split_over_both_mesh_dims():
    # S^{01}: one tensor dim split over the 2x3 mesh; 48 rows divide 6 ways, 64 do not:
    # the part of the split that divides (x, 2 ways) is kept, only y is gathered
    res = fwd("matmul", [[("x", "y"), None], [None, None]], [(48, 32), YS])
    assert specs(res) == (["[(x,y), None]", "[None, None]"], ["[(x,y), None]"])
    res = fwd("matmul", [[("x", "y"), None], [None, None]], [XS, YS])
    assert specs(res) == (["[x, None]", "[None, None]"], ["[x, None]"])
    assert any("cannot be split 6 ways" in n and "kept x" in n for n in res.notes)


def test_matmul_batch_split_4d():
    res = fwd("matmul", [["x", "y", None, None], [None, None]], [(4, 6, 64, 32), YS])
    assert specs(res) == (["[x, y, None, None]", "[None, None]"], ["[x, y, None, None]"])


def test_matmul_trans_x_4d_contracted_split():
    # x is [b, h, k, m] with trans_x: its dim 2 is contracted
    res = fwd("matmul", [["x", None, "y", None], [U, U]], [(4, 8, 48, 64), (48, 32)],
              transpose_x=True)
    assert specs(res) == (["[x, None, y, None]", "[y, ?]"], ["[x, None, None, ?] P(y)"])


def test_matmul_trans_y_4d_column_split():
    # y is [n, k] with trans_y: its dim 0 is the output column
    res = fwd("matmul", [[None, "x", None, U], ["y", U]], [(4, 8, 64, 32), (48, 32)],
              transpose_y=True)
    assert specs(res) == (["[None, x, None, ?]", "[y, ?]"], ["[None, x, None, y]"])


def test_matmul_trans_both_4d_batch_broadcast():
    # a broadcast batch dim of size 1 ('1' in the notation) is never split
    res = fwd("matmul", [["x", None, U, U], [None, "y", U, U]],
              [(4, 1, 32, 64), (1, 6, 48, 32)], transpose_x=True, transpose_y=True)
    assert specs(res) == (["[x, None, ?, ?]", "[None, y, ?, ?]"], ["[x, y, ?, ?]"])


def test_matmul_contracted_conflict_keeps_first_and_reshards_the_other():
    res = fwd("matmul", [[None, "x"], ["y", None]], [(64, 48), (48, 36)])
    assert specs(res) == (["[None, x]", "[x, None]"], ["[None, None] P(x)"])
    assert len(res.notes) == 1
    note = res.notes[0]
    assert "input 1" in note and "wants y" in note and "kept x" in note
    assert "resharded" in note


def test_matmul_mesh_dim_used_by_two_letters_is_dropped_from_the_later():
    res = fwd("matmul", [["x", None], [None, "x"]], [XS, YS])
    assert specs(res) == (["[x, None]", "[None, None]"], ["[x, None]"])
    assert any("already split" in n for n in res.notes)


def test_matmul_backward_outputs_first():
    rule = dg.ops.spmd_rule("matmul")
    res = rule.infer_backward([[U, U], [U, U]], [["x", "y"]], [XS, YS], [(64, 48)], MESH)
    assert specs(res) == (["[x, ?]", "[?, y]"], ["[x, y]"])
    # the output beats what is known of an input; the input is resharded
    res = rule.infer_backward([["y", U], [U, U]], [["x", None]], [XS, YS], [(64, 48)], MESH)
    assert specs(res) == (["[x, ?]", "[?, None]"], ["[x, None]"])
    assert any("input 0" in n and "resharded" in n for n in res.notes)


def test_matmul_backward_4d_trans_y():
    rule = dg.ops.spmd_rule("matmul")
    res = rule.infer_backward([[U] * 4, [U, U]], [["x", None, None, "y"]],
                              [(4, 8, 64, 32), (48, 32)], [(4, 8, 64, 48)], MESH,
                              transpose_y=True)
    assert specs(res) == (["[x, None, None, ?]", "[y, ?]"], ["[x, None, None, y]"])


def test_infer_forward_accepts_shard_specs_and_dims_specs():
    a = fwd("matmul", [dg.ShardSpec(["x", None]), DimsSpec(("?",)[:0] + (None, None))], [XS, YS])
    assert specs(a) == (["[x, None]", "[None, None]"], ["[x, None]"])


def test_rule_rejects_unknown_mesh_dim():
    with pytest.raises(ValueError, match="mesh dim 'z'"):
        fwd("matmul", [["z", None], [None, None]], [XS, YS])


# -- elementwise with broadcasting ----------------------------------------------------------------
def test_elementwise_broadcast_trailing_dims():
    res = fwd("add", [["x", None, "y"], [U]], [(4, 6, 12), (12,)])
    assert specs(res) == (["[x, None, y]", "[y]"], ["[x, None, y]"])


def test_elementwise_size_one_dim_is_never_split():
    # [6, 1] broadcasts over the last dim: its size-1 dim stays None
    res = fwd("add", [[U, U, U], [None, "y"]], [(4, 6, 12), (6, 1)])
    assert specs(res) == (["[?, None, ?]", "[None, None]"], ["[?, None, ?]"])
    res = fwd("multiply", [[U, "x", "y"], [U, U]], [(4, 6, 12), (6, 1)])
    assert specs(res) == (["[?, x, y]", "[x, None]"], ["[?, x, y]"])


def test_elementwise_conflict_first_operand_wins():
    res = fwd("add", [["x", None], ["y", None]], [(6, 4), (6, 4)])
    assert specs(res) == (["[x, None]", "[x, None]"], ["[x, None]"])
    assert any("input 1" in n and "resharded" in n for n in res.notes)


# -- reductions -----------------------------------------------------------------------------------
def test_sum_of_split_dim_is_partial():
    res = fwd("sum", [["x", "y"]], [(4, 6)], axis=(1,), keepdim=False)
    assert specs(res) == (["[x, y]"], ["[x] P(y)"])
    res = fwd("sum", [["x", "y"]], [(4, 6)], axis=(0, 1), keepdim=False)
    assert specs(res) == (["[x, y]"], ["[] P(x,y)"])
    res = fwd("sum", [["x", "y"]], [(4, 6)], axis=(1,), keepdim=True)
    assert specs(res) == (["[x, y]"], ["[x, None] P(y)"])


def test_max_never_splits_the_reduced_dim():
    res = fwd("max", [["x", "y"]], [(4, 6)], axis=(1,), keepdim=False)
    assert specs(res) == (["[x, None]"], ["[x]"])
    assert any("input 0" in n and "resharded" in n for n in res.notes)
    res = fwd("max", [[U, "y"]], [(4, 6)], axis=(0,), keepdim=True)
    assert specs(res) == (["[None, y]"], ["[None, y]"])
    assert not any("P(" in s for s in specs(res)[1])


# -- softmax, layer_norm, embedding --------------------------------------------------------------
def test_softmax_axis_is_never_split():
    res = fwd("softmax", [["x", "y"]], [(4, 6)], axis=-1)
    assert specs(res) == (["[x, None]"], ["[x, None]"])
    assert any("resharded" in n for n in res.notes)
    res = fwd("softmax", [["x", "y"]], [(4, 6)], axis=0)
    assert specs(res) == (["[None, y]"], ["[None, y]"])
    res = fwd("softmax", [[U, "y"]], [(4, 6)], axis=1)
    assert specs(res) == (["[?, None]"], ["[?, None]"])


def test_layer_norm_keeps_batch_splits_and_never_splits_hidden():
    res = fwd("layer_norm", [["x", "y", None], [U], [U]], [(4, 6, 12), (12,), (12,)])
    assert specs(res) == (["[x, y, None]", "[None]", "[None]"],
                          ["[x, y, None]", "[x, y]", "[x, y]"])
    res = fwd("layer_norm", [["x", None, "y"], [U], [U]], [(4, 6, 12), (12,), (12,)])
    assert specs(res)[1][0] == "[x, None, None]"
    assert res.notes


def test_embedding_split_vocabulary_gives_partial_output():
    res = fwd("embedding", [[U, U], ["x", None]], [(4, 6), (128, 12)])
    assert specs(res) == (["[?, ?]", "[x, None]"], ["[?, ?, None] P(x)"])
    res = fwd("embedding", [["x", None], [None, "y"]], [(4, 6), (128, 12)])
    assert specs(res) == (["[x, None]", "[None, y]"], ["[x, None, y]"])


# -- reshape, transpose ---------------------------------------------------------------------------
@pytest.mark.parametrize("spec, src, dst, want", [
    (["x", None, "y"], (4, 6, 12), (24, 12), "[x, y]"),            # merge: major dim split moves
    ([None, "x", "y"], (4, 6, 12), (24, 12), "[None, y]"),         # minor dim of a merge: dropped
    (["x", "y"], (24, 12), (4, 6, 12), "[x, None, y]"),            # split: goes to the major dim
    ([None, "x"], (4, 12), (4, 2, 6), "[None, x, None]"),
    (["y", None], (24, 12), (4, 6, 12), "[None, None, None]"),     # 3 does not divide 4
], ids=["merge", "merge-minor", "split", "split-2", "not-divisible"])
def test_reshape_merging_and_splitting(spec, src, dst, want):
    res = fwd("reshape", [spec], [src], shape=dst)
    assert str(res.out_specs[0]) == want
    if want.count("None") > sum(e is None for e in spec) + len(dst) - len(src):
        assert res.notes


def test_reshape_backward_maps_output_split_to_input():
    rule = dg.ops.spmd_rule("reshape")
    res = rule.infer_backward([[U, U]], [[None, "x", None]], [(4, 12)], [(4, 2, 6)], MESH,
                              shape=(4, 2, 6))
    assert specs(res) == (["[None, x]"], ["[None, x, None]"])


def test_transpose_permutes_splits_both_ways():
    res = fwd("transpose", [["x", None, "y"]], [(4, 6, 12)], perm=(2, 0, 1))
    assert specs(res) == (["[x, None, y]"], ["[y, x, None]"])
    rule = dg.ops.spmd_rule("transpose")
    res = rule.infer_backward([[U, U, U]], [["y", "x", None]], [(4, 6, 12)], [(12, 4, 6)],
                              MESH, perm=(2, 0, 1))
    assert specs(res) == (["[x, None, y]"], ["[y, x, None]"])


def _filled_by_definition(spec, other):
    """DimsSpec.filled_from by its definition: each unknown entry, in dim order, takes
    ``other``'s known one unless a mesh dim it uses is taken already."""
    used = {m for e in spec.dims if e is not U and e is not None
            for m in ((e,) if isinstance(e, str) else e)} | set(spec.partial)
    out = list(spec.dims)
    for i, (a, b) in enumerate(zip(spec.dims, other.dims)):
        if a is U and b is not U:
            new = () if b is None else (b,) if isinstance(b, str) else tuple(b)
            if not used & set(new):
                out[i] = b
                used |= set(new)
    return DimsSpec(tuple(out), spec.partial)


def test_filled_from_is_its_definition_on_random_specs():
    import random

    rng = random.Random(0)
    entries = [U, None, "x", "y", "z", ("x", "y"), ("y", "z")]
    for _ in range(3000):
        ndim = rng.randint(0, 3)
        spec = DimsSpec(tuple(rng.choice(entries) for _ in range(ndim)),
                        frozenset(rng.sample(["x", "y", "z"], rng.randint(0, 1))))
        other = DimsSpec(tuple(rng.choice(entries) for _ in range(rng.randint(0, 3))))
        assert spec.filled_from(other) == _filled_by_definition(spec, other), (spec, other)
