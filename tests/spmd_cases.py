"""Small call sites of every registered op, for the generated tests of the sharding rules.

Each :class:`OpCase` is an op with small input shapes, dtypes and attributes; its output
shapes come from the op's own ``infer``. The sizes (1, 2, 3, 4, 6, 12, 24) make some
splits over a 1-D mesh of 4 and a 2x3 mesh divide and others not.

Example::

    for case in CASES:
        rule = dg.ops.spmd_rule(case.op)
        rule.strategies(case.in_shapes, case.out_shapes, MESHES["2x3"], **case.attrs)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import distgraph as dg
import distgraph.ops  # noqa: F401  (registers every op: the cases are checked against them)
from distgraph.registry import TensorType, get_op

MESHES = {"4": dg.ProcessMesh([0, 1, 2, 3], ["x"]),
          "2x3": dg.ProcessMesh([[0, 1, 2], [3, 4, 5]], ["x", "y"])}


@dataclass(frozen=True)
class OpCase:
    op: str
    in_shapes: tuple
    attrs: dict = field(default_factory=dict)
    dtypes: tuple = ()

    @property
    def in_dtypes(self) -> tuple:
        return self.dtypes or ("float32",) * len(self.in_shapes)

    @property
    def out_shapes(self) -> tuple:
        ins = [TensorType(tuple(s), d) for s, d in zip(self.in_shapes, self.in_dtypes)]
        outs = get_op(self.op).infer(*ins, **self.attrs)
        outs = outs if isinstance(outs, (list, tuple)) and not isinstance(outs, TensorType) \
            else [outs]
        return tuple(tuple(t.shape) for t in outs)

    def __str__(self) -> str:
        attrs = ",".join(f"{k}={v}" for k, v in self.attrs.items())
        return f"{self.op}{list(map(list, self.in_shapes))}{'(' + attrs + ')' if attrs else ''}"


F, INT, B = "float32", "int64", "bool"
ADAM = {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8, "weight_decay": 0.0}

CASES = [
    OpCase("matmul", ((12, 6), (6, 4))),
    OpCase("matmul", ((6, 12), (4, 6)), {"transpose_x": True, "transpose_y": True}),
    OpCase("matmul", ((2, 6, 4), (4, 12))),
    OpCase("matmul", ((2, 1, 4, 6), (1, 3, 6, 4))),
    OpCase("add", ((4, 6, 12), (4, 6, 12))),
    OpCase("add", ((4, 6, 12), (12,))),
    OpCase("subtract", ((6, 12), (6, 1))),
    OpCase("multiply", ((4, 12), (4, 12))),
    OpCase("divide", ((12, 4), (4,))),
    OpCase("neg", ((4, 12),)),
    OpCase("exp", ((6, 4),)),
    OpCase("log", ((12,),)),
    OpCase("sqrt", ((4, 6),)),
    OpCase("tanh", ((2, 12),)),
    OpCase("relu", ((4, 6, 2),)),
    OpCase("gelu", ((12, 4),)),
    OpCase("tanh_grad", ((4, 12), (4, 12))),
    OpCase("relu_grad", ((6, 4), (6, 4))),
    OpCase("gelu_grad", ((12, 6), (12, 6))),
    OpCase("silu", ((12, 4),)),
    OpCase("silu_grad", ((12, 6), (12, 6))),
    OpCase("cast", ((4, 12),), {"dtype": "float64"}),
    OpCase("scale", ((4, 12),), {"scale": 2.0, "bias": 1.0}),
    OpCase("dropout", ((4, 12),), {"p": 0.1, "seed": 3}),
    OpCase("dropout_grad", ((4, 12), (4, 12)), {"p": 0.1}, (B, F)),
    OpCase("where", ((6, 12), (4, 6, 12), ()), {}, (B, F, F)),
    OpCase("full", (), {"shape": (4, 6), "value": 0.0, "dtype": "float32"}),
    OpCase("causal_mask", (), {"size": 6}),
    OpCase("causal_mask", (), {"size": 6, "window": 2}),
    OpCase("increment", ((),)),
    OpCase("increment", ((), ()), dtypes=("int64", "bool")),
    OpCase("loss_scale_of", ((),), {"initial": 65536.0}),
    OpCase("nonfinite_count", ((12, 6),)),
    OpCase("loss_scale_update", ((), (), ()), {"window": 2000}),
    OpCase("broadcast_to", ((6, 1),), {"shape": (4, 6, 12)}),
    OpCase("reshape", ((4, 6, 12),), {"shape": (24, 12)}),
    OpCase("reshape", ((24, 12),), {"shape": (4, 6, 12)}),
    OpCase("reshape", ((4, 12),), {"shape": (4, 2, 6)}),
    OpCase("reshape", ((12, 1, 6),), {"shape": (12, 6)}),
    OpCase("reshape", ((12, 24, 36),), {"shape": (288, 36)}),
    OpCase("transpose", ((4, 6, 12),), {"perm": (2, 0, 1)}),
    OpCase("concat", ((4, 6), (4, 12)), {"axis": 1}),
    OpCase("split", ((4, 12),), {"sections": (6, 6), "axis": 1}),
    OpCase("slice", ((4, 12),), {"axes": (1,), "starts": (0,), "ends": (6,)}),
    OpCase("slice_grad", ((4, 6),), {"axes": (1,), "starts": (0,), "ends": (6,), "shape": (4, 12)}),
    OpCase("pad", ((4, 5),), {"axis": 1, "size": 12}),
    OpCase("pad", ((3, 6),), {"axis": 0, "size": 4}),
    OpCase("sum", ((4, 6, 12),), {"axis": (2,), "keepdim": False}),
    OpCase("sum", ((4, 12),), {"axis": (0, 1), "keepdim": True}),
    OpCase("max", ((4, 12),), {"axis": (0,), "keepdim": True}),
    OpCase("max_grad", ((4, 12), (4, 1), (4, 1))),
    OpCase("softmax", ((4, 12),), {"axis": 1}),
    OpCase("log_softmax", ((4, 12),), {"axis": 0}),
    OpCase("softmax_grad", ((4, 12), (4, 12)), {"axis": 1}),
    OpCase("log_softmax_grad", ((6, 4), (6, 4)), {"axis": 1}),
    OpCase("scaled_masked_softmax", ((4, 6, 12, 12),), {"scale": 0.5, "causal": True}),
    OpCase("scaled_masked_softmax_grad", ((4, 6, 12, 12), (4, 6, 12, 12)), {"scale": 0.5}),
    OpCase("layer_norm", ((4, 6, 12), (12,), (12,)), {"epsilon": 1e-5}),
    OpCase("layer_norm_grad", ((4, 6, 12), (12,), (4, 6), (4, 6), (4, 6, 12))),
    OpCase("rms_norm", ((4, 6, 12), (12,)), {"epsilon": 1e-5}),
    OpCase("rms_norm_grad", ((4, 6, 12), (12,), (4, 6), (4, 6, 12))),
    OpCase("rotary", ((4, 6, 3, 4),), {"seq_axis": 1, "theta": 10000.0}),
    OpCase("rotary", ((2, 3, 12, 6),), {"seq_axis": 2, "theta": 500000.0, "inverse": True}),
    OpCase("rotary", ((2, 12, 3, 6),), {"seq_axis": 1, "theta": 10.0, "sequence_chunks": 4}),
    OpCase("attention", ((2, 6, 12, 4),) * 3, {"scale": 0.5}),
    OpCase("attention", ((2, 6, 12, 4),) * 3, {"scale": 0.5, "sliding_window": 3, "sequence_chunks": 4,
                                               "context_parallel": "ulysses"}),
    OpCase("attention_grad", ((2, 6, 12, 4),) * 4 + ((2, 6, 12), (2, 6, 12, 4)),
           {"scale": 0.5}),
    OpCase("attention", ((2, 6, 12, 4), (2, 3, 12, 4), (2, 3, 12, 4)), {"scale": 0.5}),
    OpCase("attention_grad", ((2, 6, 12, 4), (2, 3, 12, 4), (2, 3, 12, 4), (2, 6, 12, 4),
                              (2, 6, 12), (2, 6, 12, 4)), {"scale": 0.5}),
    OpCase("embedding", ((4, 6), (24, 12)), {}, (INT, F)),
    OpCase("embedding_grad", ((4, 6), (4, 6, 12)), {"vocab_size": 24}, (INT, F)),
    OpCase("softmax_cross_entropy", ((4, 6, 12), (4, 6)), {}, (F, INT)),
    OpCase("label_mask", ((4, 6),), {"ignore_index": -100, "dtype": "float32"}, (INT,)),
    OpCase("softmax_cross_entropy_grad", ((4, 6, 12), (4, 6), (4, 6), (4, 6)), {}, (F, INT, F, F)),
    OpCase("top_k", ((4, 6, 12),), {"k": 2}),
    OpCase("top_k_grad", ((4, 6, 2), (4, 6, 2)), {"n": 12}, (F, INT)),
    OpCase("one_hot", ((4, 6, 2),), {"n": 12, "dtype": "float32"}, (INT,)),
    OpCase("moe_ffn", ((4, 6, 12), (4, 6, 2), (4, 6, 2), (4, 12, 6), (4, 12, 6), (4, 6, 12)),
           {}, (F, INT, F, F, F, F)),
    OpCase("moe_ffn", ((4, 6, 12), (4, 6, 2), (4, 6, 2), (4, 12, 6), (4, 12, 6), (4, 6, 12)),
           {"capacity": 3}, (F, INT, F, F, F, F)),
    OpCase("moe_ffn_grad", ((4, 6, 12), (4, 6, 2), (4, 6, 2), (4, 12, 6), (4, 12, 6),
                            (4, 6, 12), (4, 6, 12)), {}, (F, INT, F, F, F, F, F)),
    OpCase("sgd_update", ((12, 6), (12, 6), (12, 6), ()), {"momentum": 0.9}),
    OpCase("adam_update", ((12, 6), (12, 6), (12, 6), (12, 6), (), ()), ADAM),
    OpCase("adam_update", ((12, 6),) * 4 + ((), (), ()), ADAM,
           dtypes=("float32",) * 4 + ("int64", "float64", "bool")),
    OpCase("mixed_adam_update", ((12, 6),) * 5 + ((), ()), ADAM,
           ("float16", "float16") + ("float32",) * 5),
]
