"""Completion (``dg.passes.complete``): from a few annotations to a DistAttr on every Value
and every operand of every op.

Oracles: the hand-derived Megatron / data-parallel layouts; Paddle's design talk's two-mesh
example; and, for every completed program, consistency — each op's specs are a fixpoint
of its own sharding rule (running the rule on what the op consumes gives back exactly
what it consumes and produces), each Value's spec is what its producer makes, and every
ShardSpec validates against its tensor's shape.
"""

import itertools
import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import distgraph as dg
from distgraph.program_builder import build_program
from distgraph.spmd import UNKNOWN, DimsSpec

DP_MP = dg.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])


class MLP(dg.nn.Layer):
    def __init__(self, d_in=8, d_hidden=16, d_out=4):
        super().__init__()
        self.fc1 = dg.nn.Linear(d_in, d_hidden)
        self.fc2 = dg.nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.fc2(dg.ops.relu(self.fc1(x)))


def train_program(model, x_shape, y_shape, optimizer=None, x_dtype="float32", loss=None):
    y_dtype = "int64" if x_dtype == "int64" else "float32"
    built = build_program(model, [dg.InputSpec(x_shape, x_dtype, "x")],
                          [dg.InputSpec(y_shape, y_dtype, "y")],
                          loss or dg.nn.MSELoss(), optimizer or dg.optim.Adam(0.01))
    return built.program


def spec(prog, name) -> str:
    return str(prog.values[name].dist_attr.spec)


def producer(prog, name):
    return next(op for op in prog.ops if any(o.name == name for o in op.outputs))


def check_complete(prog):
    """Every Value and operand has a valid, known DistAttr and the plan is consistent."""
    for v in prog.values.values():
        attr = v.dist_attr
        assert attr is not None, v.name
        assert UNKNOWN not in attr.spec.dims, v.name
        attr.spec.validate(attr.mesh, v.shape, v.name)
        if v.annotation is not None and not any(v in op.outputs for op in prog.ops):
            assert attr == v.annotation, f"annotation of {v.name} changed to {attr}"
    for k, op in enumerate(prog.ops):
        da = op.dist_attr
        assert da is not None, f"op #{k} {op.type}"
        assert len(da.input_specs) == len(op.inputs)
        assert len(da.output_specs) == len(op.outputs)
        for s, v in zip(da.input_specs + da.output_specs, op.inputs + op.outputs):
            assert UNKNOWN not in s.dims
            s.validate(da.mesh, v.shape, v.name)
        for s, o in zip(da.output_specs, op.outputs):
            assert o.dist_attr.spec == s and o.dist_attr.mesh == da.mesh, o.name
        # the op's specs are a fixpoint of its rule: no hidden reshard inside the op
        res = dg.ops.spmd_rule(op.type).infer(
            da.input_specs, [DimsSpec(s.dims) for s in da.output_specs],
            [v.shape for v in op.inputs], [o.shape for o in op.outputs], da.mesh, **op.attrs)
        assert [s.dims for s in res.in_specs] == [s.dims for s in da.input_specs], \
            f"op #{k} {op.type} consumes {list(map(str, da.input_specs))}, its rule says " \
            f"{list(map(str, res.in_specs))}"
        assert [(s.known().dims, s.partial) for s in res.out_specs] == \
            [(s.dims, s.partial) for s in da.output_specs], f"op #{k} {op.type}"


def reshard_points(prog):
    """(op index, value name) wherever a consumer's DistAttr differs from the producer's."""
    return [(k, v.name) for k, op in enumerate(prog.ops) for i, v in enumerate(op.inputs)
            if op.dist_attr.input_specs[i] != v.dist_attr.spec
            or op.dist_attr.mesh != v.dist_attr.mesh]


# -- Paddle's design example: two matmuls on two meshes ------------------------------------
def seed_program():
    model = MLP()
    m1 = dg.ProcessMesh([0, 1], ["x"])
    m2 = dg.ProcessMesh([2, 3], ["x"])
    dg.shard_tensor(model.fc1.weight, m1, [None, "x"])
    dg.shard_tensor(model.fc2.weight, m2, ["x", None])
    return dg.passes.complete(train_program(model, [4, 8], [4, 4])), m1, m2


def test_seed_two_meshes_forward_backward_and_update():
    prog, m1, m2 = seed_program()
    check_complete(prog)
    first = {id(op) for op in prog.ops if op.role == "forward"
             and (op.layer == "fc1" or op.type == "relu")}
    second = {id(op) for op in prog.ops if op.role == "forward" and op.layer == "fc2"}
    assert len(first) == 3 and len(second) == 2
    for op in prog.ops:
        fwd = op.forward_op if op.role == "backward" else op
        if fwd is not None and id(fwd) in first:
            assert op.dist_attr.mesh == m1, op
        if fwd is not None and id(fwd) in second:
            assert op.dist_attr.mesh == m2, op
    backward_meshes = {op.forward_op.type + "/" + op.forward_op.layer: op.dist_attr.mesh
                       for op in prog.ops if op.role == "backward" and op.forward_op}
    assert backward_meshes["matmul/fc1"] == backward_meshes["add/fc1"] == m1
    assert backward_meshes["relu/"] == m1
    assert backward_meshes["matmul/fc2"] == backward_meshes["add/fc2"] == m2
    for op in prog.ops:
        if op.role == "optimize" and op.inputs[0].is_parameter:
            want = m1 if op.inputs[0].name.startswith("fc1") else m2
            assert op.dist_attr.mesh == want
            assert all(o.dist_attr.mesh == want for o in op.outputs)
    assert spec(prog, "fc1.bias") == "[x]" and prog.values["fc1.bias"].dist_attr.mesh == m1
    assert spec(prog, "fc1.weight@GRAD") == "[None, x]"
    assert spec(prog, "fc2.weight@GRAD") == "[x, None]"


def test_seed_cross_mesh_reshard_point_and_partial_output():
    prog, m1, m2 = seed_program()
    hidden = producer(prog, "relu_0").outputs[0]
    assert hidden.dist_attr.mesh == m1 and str(hidden.dist_attr.spec) == "[None, x]"
    consumers = [op for op in prog.ops if hidden in op.inputs]
    assert {op.dist_attr.mesh for op in consumers} == {m1, m2}
    assert (prog.ops.index(consumers[0]), "relu_0") in reshard_points(prog)
    mm2 = next(op for op in prog.ops if op.role == "forward" and op.layer == "fc2"
               and op.type == "matmul")
    out = mm2.outputs[0].dist_attr
    assert out.mesh == m2 and out.spec.dims == (None, None) and out.spec.partial == {"x"}
    text = dg.passes.why(prog, "relu_0")
    assert "reshard: op #3 matmul in fc2 consumes relu_0" in text
    assert str(m2) in text and "fc1.weight [None, x]: annotated by the user" in text


# -- Megatron MLP on one mp dim -------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", [dg.optim.Adam(0.01), dg.optim.AdamW(0.01)],
                         ids=["adam", "adamw"])
def test_megatron_mlp(optimizer):
    mesh = dg.ProcessMesh([0, 1, 2, 3], ["mp"])
    model = MLP(8, 16, 8)
    dg.shard_tensor(model.fc1.weight, mesh, [None, "mp"])
    dg.shard_tensor(model.fc2.weight, mesh, ["mp", None])
    prog = dg.passes.complete(train_program(model, [4, 8], [4, 8], optimizer))
    check_complete(prog)
    assert spec(prog, "fc1.bias") == "[mp]"
    assert spec(prog, producer(prog, "relu_0").outputs[0].name) == "[None, mp]"
    mm2 = next(op for op in prog.ops if op.role == "forward" and op.layer == "fc2"
               and op.type == "matmul")
    assert str(mm2.outputs[0].dist_attr.spec) == "[None, None] P(mp)"
    assert spec(prog, "fc1.weight@GRAD") == "[None, mp]"
    assert spec(prog, "fc2.weight@GRAD") == "[mp, None]"
    assert spec(prog, "fc1.bias@GRAD") == "[mp]"
    for w, want in [("fc1.weight", "[None, mp]"), ("fc2.weight", "[mp, None]"),
                    ("fc1.bias", "[mp]"), ("fc2.bias", "[None]")]:
        for state in ("@MOMENT1", "@MOMENT2"):
            assert spec(prog, w + state) == want, w + state
        update = next(op for op in prog.ops if op.role == "optimize" and op.inputs[0].name == w)
        assert [str(s) for s in update.dist_attr.output_specs] == [want] * 3


# -- data parallel --------------------------------------------------------------------------------
def test_data_parallel_weights_replicated_gradients_partial():
    mesh = dg.ProcessMesh([0, 1, 2, 3], ["dp"])

    class DP(MLP):
        def forward(self, x):
            return super().forward(dg.shard_tensor(x, mesh, ["dp", None]))

    prog = dg.passes.complete(train_program(DP(), [8, 8], [8, 4]))
    check_complete(prog)
    assert spec(prog, "x") == "[dp, None]"
    for p in prog.parameters:
        assert spec(prog, p.name) == str(dg.ShardSpec.replicated(p.ndim)), p.name
        grad = prog.values[p.name + "@GRAD"]
        assert grad.dist_attr.spec.partial == {"dp"}, (p.name, grad.dist_attr)
        assert all(e is None for e in grad.dist_attr.spec.dims)
        if p.name.endswith("weight"):
            assert producer(prog, grad.name).type == "matmul"
        assert spec(prog, p.name + "@MOMENT1") == spec(prog, p.name)


# -- GPT on a 2x2 dp x mp mesh --------------------------------------------------------------------
def annotate_block(block, mesh=DP_MP):
    dg.shard_tensor(block.attn.qkv.weight, mesh, [None, "mp"])
    dg.shard_tensor(block.attn.proj.weight, mesh, ["mp", None])
    dg.shard_tensor(block.mlp.fc1.weight, mesh, [None, "mp"])
    dg.shard_tensor(block.mlp.fc2.weight, mesh, ["mp", None])


class Annotated(dg.nn.Layer):
    """``inner`` with its input annotated ``[dp, None, ...]``."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        dg.shard_tensor(x, DP_MP, ["dp"] + [None] * (x.ndim - 1))
        return self.inner(x)


def block_program():
    dg.seed(0)
    block = dg.nn.TransformerBlock(32, 4)
    annotate_block(block)
    return train_program(Annotated(block), [4, 8, 32], [4, 8, 32], dg.optim.AdamW(1e-3))


def gpt_program(n_layer=2):
    dg.seed(0)
    gpt = dg.nn.GPT(vocab_size=64, d_model=32, n_layer=n_layer, n_head=4, max_seq_len=8)
    for block in gpt.blocks:
        annotate_block(block)
    return train_program(Annotated(gpt), [4, 8], [4, 8], dg.optim.AdamW(1e-3), x_dtype="int64",
                         loss=dg.nn.CrossEntropyLoss())


@pytest.mark.parametrize("make", [block_program, gpt_program], ids=["block", "gpt"])
def test_gpt_completes_every_value_and_op(make):
    prog = make()
    roles = {op.role for op in prog.ops}
    assert roles == {"forward", "loss", "backward", "optimize"}
    dg.passes.complete(prog)
    check_complete(prog)
    assert all(op.dist_attr.mesh == DP_MP for op in prog.ops if op.role != "optimize"
               or op.inputs[0].is_parameter)
    prefix = "inner.blocks.0." if make is gpt_program else "inner."
    for name, want in [("attn.qkv", "[None, mp]"), ("attn.proj", "[mp, None]"),
                       ("mlp.fc1", "[None, mp]"), ("mlp.fc2", "[mp, None]")]:
        w = prefix + name + ".weight"
        assert spec(prog, w) == want
        assert spec(prog, w + "@MOMENT1") == spec(prog, w + "@MOMENT2") == want
        update = next(op for op in prog.ops if op.role == "optimize" and op.inputs[0].name == w)
        assert [str(s) for s in update.dist_attr.input_specs[:4]] == [want] * 4
        assert [str(s) for s in update.dist_attr.output_specs] == [want] * 3
    # The MLP's gradients follow its weights. The attention's do not: q|k|v are
    # contiguous in the fused qkv output, so a column split of qkv cannot survive the
    # q/k/v split (split never splits its axis), the heads run unsplit over mp, and the
    # update consumes those gradients resharded.
    for name, want in [("mlp.fc1", "[None, mp]"), ("mlp.fc2", "[mp, None]")]:
        assert spec(prog, prefix + name + ".weight@GRAD") == want + " P(dp)"
    assert spec(prog, prefix + "attn.qkv.weight@GRAD") == "[None, None] P(dp)"
    assert spec(prog, prefix + "mlp.fc1.bias") == "[mp]"
    assert spec(prog, prefix + "ln1.weight@GRAD") == "[None] P(dp)"


def test_gpt_completion_is_deterministic_and_idempotent():
    a = dg.passes.complete(gpt_program()).pretty()
    prog = dg.passes.complete(gpt_program())
    assert prog.pretty() == a
    before = {n: v.dist_attr for n, v in prog.values.items()}
    ops_before = [str(op.dist_attr) for op in prog.ops]
    explained = dg.passes.why(prog, "inner.blocks.0.mlp.fc1.bias")
    dg.passes.complete(prog)
    assert {n: v.dist_attr for n, v in prog.values.items()} == before
    assert [str(op.dist_attr) for op in prog.ops] == ops_before
    assert dg.passes.why(prog, "inner.blocks.0.mlp.fc1.bias") == explained
    assert prog.pretty() == a


def test_gpt_completion_does_not_depend_on_hash_seed():
    """Another interpreter (another string-hash seed, so other set orders) prints the
    same completed program."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import test_completion as t, distgraph as dg
        print(dg.passes.complete(t.gpt_program()).pretty())
    """)
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, check=True).stdout
    assert out.rstrip("\n") == dg.passes.complete(gpt_program()).pretty()


def randomly_annotated_gpt(seed):
    """The tiny GPT with four random parameters and the input annotated at random on the
    2x2 mesh: conflicts everywhere (these made inconsistent plans before annotated
    operands were consumed as their op's rule decides)."""
    r = random.Random(seed)
    dg.seed(0)
    gpt = dg.nn.GPT(vocab_size=64, d_model=32, n_layer=2, n_head=4, max_seq_len=8)
    for _, p in r.sample(list(gpt.named_parameters()), 4):
        choices = [[None] * len(p.shape)]
        for d, m in itertools.product(range(len(p.shape)), ("dp", "mp")):
            choices.append([m if i == d else None for i in range(len(p.shape))])
        dg.shard_tensor(p, DP_MP, r.choice(choices))
    x_spec = r.choice([["dp", None], [None, None], [None, "mp"], ["mp", "dp"]])

    class Inp(dg.nn.Layer):
        def __init__(self):
            super().__init__()
            self.inner = gpt

        def forward(self, x):
            return self.inner(dg.shard_tensor(x, DP_MP, x_spec))

    return train_program(Inp(), [4, 8], [4, 8], dg.optim.AdamW(1e-3), x_dtype="int64",
                         loss=dg.nn.CrossEntropyLoss())


@pytest.mark.parametrize("seed", range(6))
def test_random_annotations_give_consistent_plans(seed):
    prog = dg.passes.complete(randomly_annotated_gpt(seed))
    check_complete(prog)


# -- conflicts: annotations never change, the plan stays consistent -------------------------------
MESH23 = dg.ProcessMesh([[0, 1, 2], [3, 4, 5]], dim_names=["x", "y"])


def test_contracted_axis_split_over_two_mesh_dims_reshards_one_operand():
    def f(a, b):
        dg.shard_tensor(a, MESH23, [None, "x"])
        dg.shard_tensor(b, MESH23, ["y", None])
        return dg.ops.relu(dg.ops.matmul(a, b))

    prog = dg.trace(f, dg.InputSpec([64, 48], name="a"), dg.InputSpec([48, 36], name="b"))
    dg.passes.complete(prog)
    check_complete(prog)
    mm = prog.ops[0]
    assert spec(prog, "a") == "[None, x]" and spec(prog, "b") == "[y, None]"   # as annotated
    assert [str(s) for s in mm.dist_attr.input_specs] == ["[None, x]", "[x, None]"]
    assert str(mm.dist_attr.output_specs[0]) == "[None, None] P(x)"
    assert (0, "b") in reshard_points(prog) and (0, "a") not in reshard_points(prog)
    assert any("input 1" in n and "resharded" in n for n in mm.dist_attr.notes)
    text = dg.passes.why(prog, "b")
    assert "b [y, None]: annotated by the user as [y, None]" in text
    assert "reshard: op #0 matmul consumes b as [x, None]" in text
    assert "input 1 dim 'k' wants y, kept x; input 1 is resharded" in text
    assert "wants y, kept x" in dg.passes.why(prog, "matmul_0")


def test_annotated_result_is_produced_as_annotated():
    mesh = dg.ProcessMesh([0, 1], ["x"])

    def f(a):
        dg.shard_tensor(a, mesh, ["x", None])
        h = dg.shard_tensor(dg.ops.relu(a), mesh, [None, "x"])
        r = dg.shard_tensor(dg.ops.reshape(a, [24]), mesh, [None])
        return dg.ops.exp(h), r

    prog = dg.passes.complete(dg.trace(f, dg.InputSpec([4, 6], name="a")))
    check_complete(prog)
    assert spec(prog, "relu_0") == "[None, x]" and spec(prog, "reshape_0") == "[None]"
    assert [k for k, _ in reshard_points(prog)] == [0, 1]         # a, into relu and reshape
    assert "reshard: op #0 relu consumes a as [None, x]" in dg.passes.why(prog, "a")


def test_split_on_a_never_split_axis_is_resharded_not_ignored():
    mesh = dg.ProcessMesh([0, 1], ["x"])

    def f(a):
        dg.shard_tensor(a, mesh, ["x", None])
        s = dg.ops.softmax(a, axis=0)
        return dg.shard_tensor(dg.ops.softmax(s, axis=1), mesh, [None, "x"])

    prog = dg.passes.complete(dg.trace(f, dg.InputSpec([4, 6], name="a")))
    check_complete(prog)
    assert str(prog.ops[0].dist_attr.input_specs[0]) == "[None, None]"
    assert any("never split" in n for n in prog.ops[0].dist_attr.notes)
    # the second softmax cannot produce a split of its axis: it is resharded after it
    assert spec(prog, "softmax_1") == "[None, None]"
    assert "cannot make that layout" in dg.passes.why(prog, "softmax_1")


def test_shard_op_fixes_the_mesh_and_consumer_specs():
    mesh = dg.ProcessMesh([0, 1, 2, 3], ["mp"])
    model = MLP(8, 16, 8)

    class S(dg.nn.Layer):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, x):
            h = dg.shard_op(self.m.fc1, mesh, out_shard_specs=[[None, "mp"]])(x)
            return self.m.fc2(dg.ops.relu(h))

    prog = dg.passes.complete(train_program(S(), [4, 8], [4, 8]))
    check_complete(prog)
    assert spec(prog, "m.fc1.weight") == "[None, mp]" and spec(prog, "m.fc1.bias") == "[mp]"
    assert spec(prog, "m.fc2.weight") == "[mp, None]"


def test_no_mesh_anywhere_is_a_plan_error():
    prog = dg.trace(MLP(), dg.InputSpec([4, 8], name="x"))
    with pytest.raises(dg.PlanError, match="shard_tensor"):
        dg.passes.complete(prog)
    mesh = dg.ProcessMesh([0, 1], ["x"])
    dg.passes.complete(prog, default_mesh=mesh)
    check_complete(prog)
    assert all(op.dist_attr.mesh == mesh for op in prog.ops)


# -- bad annotations ------------------------------------------------------------------------------
MESH2 = dg.ProcessMesh([0, 1], ["x"])


class Holder(dg.nn.Layer):
    def __init__(self, shape):
        super().__init__()
        self.w = dg.Parameter(np.zeros(shape))


@pytest.mark.parametrize("shape, bad, words", [
    ((8, 16), ["x"], ["1 entries for a 2-d tensor"]),
    ((8, 16), ["z", None], ["unknown mesh dim 'z'"]),
    ((8, 16), ["x", "x"], ["'x' is used twice"]),
    ((9, 16), ["x", None], ["dim 0 of size 9 is not divisible by 2"]),
], ids=["wrong-length", "unknown-dim", "dim-twice", "not-divisible"])
@pytest.mark.parametrize("target", ["parameter", "traced"])
def test_bad_annotation_names_tensor_shape_spec_and_mesh(shape, bad, words, target):
    if target == "parameter":
        holder = Holder(shape)
        with pytest.raises(dg.ShardingError) as err:
            dg.shard_tensor(holder.w, MESH2, bad)
        name = "w"
        words = words + ["parameter 'w' of Holder()"]
    else:
        with pytest.raises(dg.ShardingError) as err:
            dg.trace(lambda a: dg.ops.relu(dg.shard_tensor(a, MESH2, bad)),
                     dg.InputSpec(list(shape), name="acts"))
        name = "acts"
    msg = str(err.value)
    for w in words + [f"'{name}'", str(list(shape)), str(dg.ShardSpec(bad)), str(MESH2)]:
        assert w in msg, (w, msg)


def test_errors_on_a_parameter_name_it_by_its_path_before_and_after_tracing():
    mesh = dg.ProcessMesh([0, 1, 2, 3], ["mp"])
    model = MLP(16, 64, 4)
    with pytest.raises(dg.ShardingError, match=r"^parameter 'fc1.weight' of Linear\(16, 64\) "
                                               r"of shape \[16, 64\] with spec \[x, None\]"):
        dg.shard_tensor(model.fc1.weight, mesh, ["x", None])
    dg.trace(model, dg.InputSpec([4, 16], name="x"))
    with pytest.raises(dg.ShardingError, match=r"^parameter 'fc1.bias' of Linear\(16, 64\)"):
        dg.shard_tensor(model.fc1.bias, mesh, ["mp", None])
    assert repr(dg.nn.Linear(3, 4, bias=False)) == "Linear(3, 4, bias=False)"


def test_a_string_spec_is_an_error_saying_to_pass_a_list():
    mesh = dg.ProcessMesh([0, 1, 2, 3], ["mp"])
    model = MLP(16, 64, 4)
    with pytest.raises(dg.ShardingError) as err:
        dg.shard_tensor(model.fc1.weight, mesh, "mp")
    msg = str(err.value)
    assert "parameter 'fc1.weight' of Linear(16, 64): shard spec 'mp' is a string" in msg
    assert "pass a list with one entry per tensor dim (2), e.g. ['mp', None]" in msg
    assert "unknown mesh dim" not in msg
    with pytest.raises(dg.ShardingError, match="tensor 'acts': shard spec 'mp' is a string"):
        dg.trace(lambda a: dg.ops.relu(dg.shard_tensor(a, mesh, "mp")),
                 dg.InputSpec([4, 8], name="acts"))


def test_duplicate_process_ids_in_a_mesh():
    with pytest.raises(dg.ShardingError, match=r"duplicate process ids \[1\]"):
        dg.ProcessMesh([[0, 1], [1, 2]], ["a", "b"])


def test_rule_answers_shared_by_ops_alike_in_all_their_rules_read():
    """Ops whose rules read the same (shapes, mesh, dtypes, the attributes the rule
    declares it reads: a GPT's dropouts differ in their seeds only) share one bound rule
    and its answers; completing so gives every spec, note and origin the plain path
    (answers kept per whole signature) gives, with fewer rules bound."""
    import plans as P
    from distgraph.passes.completion.complete import _Completion
    from distgraph.passes.completion.setup import CompletionSetup

    def program():
        model = P.build_model("gpt", dims={**P.GPT_DIMS, "n_layer": 3}, dropout=0.1)
        P.PLANS["gpt", "dp_tp", 4].annotate(model)
        ins, labels = dg.app.data.DataLoader(P.Dataset("gpt"), P.BATCH).specs(1)
        return build_program(model, ins, labels, P.loss_fn("gpt"),
                             P.make_optimizer("adamw")).program

    shared, plain = CompletionSetup(program(), None), CompletionSetup(program(), None)
    plain.rule_key = list(plain.signature)
    seeds = {op.attrs["seed"] for op in shared.ops if op.type == "dropout"}
    assert len(seeds) > 1 and len(set(shared.rule_key)) < len(set(plain.signature))
    a, b = _Completion(shared).run(), _Completion(plain).run()
    assert (a.vspec, a.ispec, a.ospec, a.notes, a.origin) == \
        (b.vspec, b.ispec, b.ospec, b.notes, b.origin)
    assert len(shared.bound) < len(plain.bound) and len(shared.memo) < len(plain.memo)


@pytest.mark.parametrize("op_type, n_in, n_out, attrs, other", [
    ("dropout", 1, 2, {"p": 0.1, "seed": 1}, {"p": 0.5, "seed": 2}),
    ("dropout_grad", 2, 1, {"p": 0.1}, {"p": 0.9}),
])
def test_a_rule_answers_alike_whatever_the_attributes_it_does_not_read(op_type, n_in,
                                                                      n_out, attrs, other):
    """A rule that declares the attributes it reads (``Rule.reads``) answers every query
    alike under other values of the others."""
    from distgraph.spmd import RuleQuery

    rule = dg.ops.spmd_rule(op_type)
    assert rule.rule.reads is not None and not set(rule.rule.reads) & set(other)
    mesh = dg.ProcessMesh([[0, 1], [2, 3]], ["x", "y"])
    shape = (4, 6, 8)
    first = rule.bind([shape] * n_in, [shape] * n_out, mesh, attrs)
    second = rule.bind([shape] * n_in, [shape] * n_out, mesh, other)
    entries = [UNKNOWN, None, "x", "y", ("x", "y")]
    rng = random.Random(0)
    asked = 0
    while asked < 200:
        specs = [DimsSpec(tuple(rng.choice(entries) for _ in shape)) for _ in range(n_in)]
        query = RuleQuery.make(specs, None, (), (), rng.random() < 0.5)
        try:
            answer = first.solve(query)
        except dg.errors.DistGraphError:    # a mesh dim used twice: refused by both
            with pytest.raises(dg.errors.DistGraphError):
                second.solve(query)
            continue
        asked += 1
        assert answer == second.solve(query)
