"""Tracing: the naming contract, Program.pretty, the default dtype, and trace-time errors.

A model whose shapes do not fit must fail while it is traced, with a DistGraphError that
names the op, the layer path and the shapes, never later with a numpy traceback.
"""

from __future__ import annotations

import numpy as np
import pytest

import distgraph as dg
from distgraph.registry import ShapeError
from distgraph.program_builder import build_program

ops = dg.ops


class TwoLayer(dg.nn.Layer):
    def __init__(self, d_in=16, d_hidden=32, d_hidden2=None, d_out=8):
        super().__init__()
        self.fc1 = dg.nn.Linear(d_in, d_hidden)
        self.fc2 = dg.nn.Linear(d_hidden2 or d_hidden, d_out)

    def forward(self, x):
        return self.fc2(ops.relu(self.fc1(x)))


class Outer(dg.nn.Layer):
    """Nests TwoLayer under ``body`` so error paths have more than one component."""

    def __init__(self, **kw):
        super().__init__()
        self.body = TwoLayer(**kw)

    def forward(self, x):
        return self.body(x)


# -- naming ---------------------------------------------------------------------------------------
def test_parameters_named_by_layer_path_and_inputs_by_spec():
    model = TwoLayer()
    prog = dg.trace(model, dg.InputSpec([4, 16], name="features"))
    params = {v.name: v for v in prog.parameters}
    assert set(params) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    assert params["fc1.weight"].shape == (16, 32) and params["fc2.bias"].shape == (8,)
    assert all(v.is_parameter and v.persistable for v in params.values())
    assert [v.name for v in prog.inputs] == ["features"]
    assert prog.values["features"].shape == (4, 16)
    assert prog.values["features"] is prog.inputs[0]
    assert [tuple(v.shape) for v in prog.outputs] == [(4, 8)]
    # The first op reads the input and fc1's weight; ops record their layer path.
    first = prog.ops[0]
    assert first.type == "matmul" and [v.name for v in first.inputs] == ["features", "fc1.weight"]
    assert first.layer == "fc1"
    assert {op.layer for op in prog.ops} >= {"fc1", "fc2"}


def test_threads_trace_at_once_each_into_its_own_program():
    """Ranks simulated as threads (SimulatedWorld) trace at the same time. Here the first
    thread's trace goes on while the second's is in progress (started after it, so on
    top of any shared stack of traces): each still records only its own model's ops."""
    import threading
    first_halfway, second_halfway, first_done = (threading.Event() for _ in range(3))

    class Interleaved(TwoLayer):
        def __init__(self, first):
            super().__init__()
            self.first = first

        def forward(self, x):
            h = ops.relu(self.fc1(x))
            if self.first:
                first_halfway.set()
                assert second_halfway.wait(30)
            else:
                second_halfway.set()
                assert first_done.wait(30)
            return self.fc2(h)

    alone = dg.trace(TwoLayer(), dg.InputSpec([4, 16], name="x"))
    programs, errors = [None, None], []

    def body(i):
        try:
            if i == 1:
                assert first_halfway.wait(30)
            programs[i] = dg.trace(Interleaved(i == 0), dg.InputSpec([4, 16], name="x"))
        except BaseException as e:                 # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            (first_done if i == 0 else second_halfway).set()

    threads = [threading.Thread(target=body, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for prog in programs:
        assert [op.type for op in prog.ops] == [op.type for op in alone.ops]
        assert all(prog.values.get(v.name) is v for op in prog.ops
                   for v in op.inputs + op.outputs)       # its own values, no other trace's
        assert all(prog.values.get(v.name) is v for v in prog.outputs)


def test_gpt_parameter_names_follow_nanogpt():
    model = dg.nn.GPT(vocab_size=32, d_model=16, n_layer=2, n_head=2, max_seq_len=8)
    prog = dg.trace(model, dg.InputSpec([2, 8], "int64", "tokens"))
    names = {v.name for v in prog.parameters}
    for i in range(2):
        for suffix in ("ln1.weight", "ln1.bias", "attn.qkv.weight", "attn.qkv.bias",
                       "attn.proj.weight", "attn.proj.bias", "ln2.weight", "ln2.bias",
                       "mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias"):
            assert f"blocks.{i}.{suffix}" in names
    assert {"wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias", "lm_head.weight"} <= names
    assert "lm_head.bias" not in names
    assert names == {n for n, _ in model.named_parameters()}
    assert prog.values["blocks.0.attn.qkv.bias"].shape == (48,)
    assert prog.values["blocks.1.mlp.fc1.weight"].shape == (16, 64)
    assert prog.inputs[0].name == "tokens" and prog.inputs[0].dtype == "int64"
    assert tuple(prog.outputs[0].shape) == (2, 8, 32)


def test_gradients_are_named_name_at_grad():
    model = TwoLayer()
    built = build_program(model, [dg.InputSpec([4, 16], name="x")],
                          [dg.InputSpec([4, 8], name="y")], dg.nn.MSELoss(), dg.optim.SGD(0.1))
    prog = built.program
    expected = {n: f"{n}@GRAD" for n in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")}
    assert built.grad_names == expected
    for param, grad in expected.items():
        assert prog.values[grad].shape == prog.values[param].shape
        assert prog.values[grad].role == "backward"
    roles = [op.role for op in prog.ops]
    assert roles == sorted(roles, key=["forward", "loss", "backward", "optimize"].index)
    # the updates, and the read of the learning rate they share
    assert {op.type for op in prog.ops_by_role("optimize")} == {"sgd_update", "scale"}


def test_append_backward_names_gradients():
    w = dg.Parameter(np.ones((3, 2)), dtype="float32")
    prog = dg.trace(lambda x: ops.sum(ops.tanh(ops.matmul(x, w))), dg.InputSpec([4, 3], name="x"))
    (name,) = [v.name for v in prog.parameters]
    grads = dg.append_backward(prog, prog.outputs[0])
    assert list(grads) == [name] and grads[name].name == f"{name}@GRAD"
    assert prog.values[f"{name}@GRAD"] is grads[name]
    # The input needs no gradient, so none is computed.
    assert "x@GRAD" not in prog.values


def test_pretty_lists_inputs_parameters_and_ops():
    model = TwoLayer()
    prog = dg.trace(model, dg.InputSpec([4, 16], name="x"))
    text = prog.pretty()
    lines = text.splitlines()
    assert lines[0].startswith(f"Program: {len(prog.ops)} ops, 4 parameters")
    assert "x[4,16]:float32" in text
    for name in ("fc1.weight[16,32]:float32", "fc2.bias[8]:float32"):
        assert name in text
    op_lines = [line for line in lines if line.strip().startswith("#")]
    assert len(op_lines) == len(prog.ops)
    for line, op in zip(op_lines, prog.ops):
        assert f"{op.type}(" in line and op.role in line
    assert "transpose_x=False" in text        # attributes are shown
    assert lines[-1].startswith("  outputs: ")


# -- default dtype --------------------------------------------------------------------------------
def test_default_dtype_is_float32():
    assert dg.get_default_dtype() == "float32"
    assert dg.nn.Linear(2, 3).weight.dtype == "float32"
    assert dg.InputSpec([2]).dtype == "float32"


def test_set_default_dtype_float64_switches_parameters_and_inputs(float64):
    model = TwoLayer()
    assert all(p.dtype == "float64" for p in model.parameters())
    prog = dg.trace(model, dg.InputSpec([4, 16], name="x"))
    assert prog.values["x"].dtype == "float64"
    assert all(v.dtype == "float64" for v in prog.parameters)
    assert all(v.dtype == "float64" for op in prog.ops for v in op.outputs)
    assert dg.InputSpec([3], "float32").dtype == "float32"   # an explicit dtype wins
    assert dg.InputSpec([3], "int64").dtype == "int64"       # integer inputs keep theirs
    table = dg.nn.Embedding(10, 4)
    prog = dg.trace(table, dg.InputSpec([2, 3], "int64", "ids"))
    assert prog.values["ids"].dtype == "int64" and prog.outputs[0].dtype == "float64"


def test_set_default_dtype_rejects_non_float():
    with pytest.raises(dg.DistGraphError, match="float32 or float64"):
        dg.set_default_dtype("int64")
    assert dg.get_default_dtype() == "float32"


# -- trace-time shape errors -----------------------------------------------------------------------
def _trace_error(model, *specs) -> dg.DistGraphError:
    with pytest.raises(dg.DistGraphError) as info:
        dg.trace(model, *specs)
    err = info.value
    assert isinstance(err, ShapeError)
    # Raised by distgraph's shape inference, not by a kernel: no numpy error underneath.
    assert err.__cause__ is None and err.__suppress_context__
    assert not isinstance(err, dg.RuntimeFault)
    return err


def test_mismatched_linear_layers_fail_at_trace_time():
    err = _trace_error(TwoLayer(d_in=16, d_hidden=32, d_hidden2=64, d_out=8),
                       dg.InputSpec([4, 16], name="x"))
    msg = str(err)
    assert "'matmul'" in msg
    assert "'fc2'" in msg
    assert "[4, 32]" in msg and "[64, 8]" in msg
    assert "fc2.weight" in msg
    assert "32 vs 64" in msg


def test_error_names_the_full_layer_path():
    err = _trace_error(Outer(d_in=16, d_hidden=32, d_hidden2=64),
                       dg.InputSpec([4, 16], name="x"))
    assert "'body.fc2'" in str(err)


def test_adding_incompatible_shapes_fails_at_trace_time():
    def fn(a, b):
        return a + b

    err = _trace_error(fn, dg.InputSpec([4, 16], name="a"), dg.InputSpec([4, 8], name="b"))
    msg = str(err)
    assert "'add'" in msg
    assert "[4, 16]" in msg and "[4, 8]" in msg
    assert "do not broadcast" in msg


def test_shape_error_in_layer_add_names_layer():
    class Residual(dg.nn.Layer):
        def __init__(self):
            super().__init__()
            self.proj = dg.nn.Linear(16, 8)

        def forward(self, x):
            return x + self.proj(x)

    err = _trace_error(Residual(), dg.InputSpec([4, 16], name="x"))
    msg = str(err)
    assert "'add'" in msg and "[4, 16]" in msg and "[4, 8]" in msg


def test_mixed_dtypes_fail_at_trace_time():
    err = _trace_error(lambda a, b: a * b, dg.InputSpec([3], "float32", "a"),
                       dg.InputSpec([3], "float64", "b"))
    assert "'multiply'" in str(err) and "float32" in str(err) and "float64" in str(err)


@pytest.mark.parametrize("build,needle", [
    (lambda x: ops.reshape(x, [5, 5]), "reshape"),
    (lambda x: ops.transpose(x, [0, 0]), "perm"),
    (lambda x: ops.slice(x, [0], [3], [2]), "slice"),
    (lambda x: ops.concat([x, ops.transpose(x, [1, 0])], axis=0), "concat"),
    (lambda x: ops.softmax_cross_entropy(x, x), "labels"),
    (lambda x: ops.matmul(x, ops.sum(x, axis=0)), "rank"),
])
def test_other_shape_errors_are_distgraph_errors(build, needle):
    err = _trace_error(build, dg.InputSpec([4, 6], name="x"))
    assert needle in str(err)


# -- other errors ---------------------------------------------------------------------------------
def test_ops_outside_a_trace_raise():
    p = dg.Parameter(np.ones((2, 2)), dtype="float32")
    with pytest.raises(dg.DistGraphError, match=r"dg\.trace"):
        ops.relu(p)
    with pytest.raises(dg.DistGraphError, match=r"dg\.trace"):
        p + p
    with pytest.raises(dg.DistGraphError):
        ops.add(np.ones(2), np.ones(2))
    with pytest.raises(dg.DistGraphError):
        TwoLayer()(np.ones((4, 16), dtype=np.float32))


def test_set_value_with_wrong_shape_raises():
    layer = dg.nn.Linear(4, 3)
    with pytest.raises(dg.DistGraphError) as info:
        layer.weight.set_value(np.zeros((3, 4)))
    assert "[3, 4]" in str(info.value) and "[4, 3]" in str(info.value)
    np.testing.assert_array_equal(layer.weight.numpy().shape, (4, 3))
    with pytest.raises(dg.DistGraphError):
        layer.set_state_dict({"weight": np.zeros((4, 3))})        # bias missing


def test_set_value_keeps_dtype_and_copies():
    p = dg.Parameter(np.zeros((2, 3)), dtype="float32")
    src = np.arange(6.0).reshape(2, 3)
    p.set_value(src)
    src[0, 0] = 99.0
    assert p.dtype == "float32" and p.numpy()[0, 0] == 0.0
    scalar = dg.Parameter(np.array(2.5), dtype="float64")
    assert scalar.shape == () and scalar.numpy() == 2.5


def test_non_scalar_loss_raises():
    model = TwoLayer()
    prog = dg.trace(model, dg.InputSpec([4, 16], name="x"))
    with pytest.raises(dg.DistGraphError, match="scalar"):
        dg.append_backward(prog, prog.outputs[0])
    with pytest.raises(dg.DistGraphError, match="scalar"):
        build_program(TwoLayer(), [dg.InputSpec([4, 16], name="x")],
                      [dg.InputSpec([4, 8], name="y")],
                      loss=lambda pred, y: ops.mse_loss(pred, y, reduction="none"),
                      optimizer=dg.optim.SGD(0.1))


def test_loss_without_parameters_raises():
    prog = dg.trace(lambda x: ops.sum(x), dg.InputSpec([3], name="x"))
    with pytest.raises(dg.DistGraphError, match="does not depend on any parameter"):
        dg.append_backward(prog, prog.outputs[0])
