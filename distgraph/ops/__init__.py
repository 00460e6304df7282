"""Functional ops (Paddle-named) and the op registry.

Each op's inference, kernel, gradient, sharding rule and FLOP count live together in
one registry entry; ``spmd_rule(op_type)`` returns the sharding rule.
"""

from distgraph.registry import KernelContext, OpDef, TensorType, get_op, registered_ops, spmd_rule
from distgraph.ops.elementwise import (add, cast, causal_mask, divide, dropout, exp, full, gelu, log,
                                       multiply, neg, relu, scale_ as scale, silu, sqrt, subtract,
                                       tanh, where)
from distgraph.ops.shape import broadcast_to, concat, reshape, slice_ as slice, split, transpose
from distgraph.ops.reduce import max, mean, sum
from distgraph.ops.linalg import matmul
from distgraph.ops.nn_ops import (cross_entropy, embedding, layer_norm, log_softmax, mse_loss,
                                  softmax, softmax_cross_entropy)
from distgraph.ops.transformer import rms_norm, rotary
from distgraph.ops.moe import moe_ffn, one_hot, top_k
from distgraph.ops.attention import attention
from distgraph.ops.fused_softmax import scaled_masked_softmax
from distgraph.ops import optim_ops  # noqa: F401  (registers the update ops)
from distgraph.ops import operators as _operators
from distgraph.ir import Value as _Value
from distgraph.parameter import Parameter as _Parameter

_operators.install(_Value)         # x + y, x @ w, x.T on traced values and parameters
_operators.install(_Parameter)
