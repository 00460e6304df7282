"""Megatron-LM's fused scale-mask-softmax of attention scores, as one op.

``scaled_masked_softmax(x, scale, causal=True)`` is ``softmax(where(mask, scale * x,
-inf))`` over the last dim of scores ``[..., s_q, s_k]``, the causal mask keeping key j
for query i where ``j <= i + s_k - s_q``. Megatron-LM runs it as one kernel
(FusedScaleMaskSoftmax, ``--masked-softmax-fusion``, on by default): one read and one
write of the scores where ``scale``, ``where`` and ``softmax`` make three passes, which
the cost model prices at the memory's bandwidth. Its gradient is one kernel too:
``dx = scale * y * (dy - sum(dy * y))``.

Sharding, ``abQK -> abQK`` (and ``abQK,abQK -> abQK`` for the gradient): the leading dims
(batch, heads) split as any letter; the query and key dims never (the mask reads both
positions, the softmax the whole key dim).

Example::

    att = scaled_masked_softmax(ops.matmul(q, k, transpose_y=True), 1 / math.sqrt(hd))
"""

from __future__ import annotations

from distgraph import dtypes
from distgraph.ops.common import Row, dot_along, reduced_bytes, register_rows
from distgraph.registry import DTypeError, ShapeError
from distgraph.spmd import EinsumRule
from distgraph.spmd.einsum import LETTERS
from distgraph.trace import emit1


def _notation(n_in: int):
    def notation(in_shapes, attrs):
        rank = len(in_shapes[0])
        word = LETTERS[:rank - 2] + LETTERS[rank - 2:rank].upper()
        return ",".join([word] * n_in) + "->" + word
    notation.__name__ = "scores"
    return notation


def _infer(x, scale=1.0, causal=True):
    if not dtypes.is_float(x.dtype):
        raise DTypeError(f"scaled_masked_softmax needs floating scores, got {x.dtype}")
    if len(x.shape) < 2:
        raise ShapeError(f"scaled_masked_softmax needs scores [..., s_q, s_k], got shape "
                         f"{list(x.shape)}")
    return x


def _grad_infer(y, dy, scale=1.0):
    return y


# In place on the result (the mask applied with copyto, exp after the subtraction): as
# array expressions they allocated four arrays of the scores' size.
def _kernel(ctx, x, scale=1.0, causal=True):
    xp = ctx.xp
    z = xp.multiply(x, xp.asarray(scale, dtype=x.dtype), out=xp.empty_like(x))
    if causal:
        sq, sk = x.shape[-2:]
        hidden = xp.tri(sq, sk, sk - sq, dtype=bool)
        xp.logical_not(hidden, out=hidden)
        xp.copyto(z, xp.asarray(-xp.inf, dtype=x.dtype), where=hidden)
        del hidden
    z -= xp.max(z, axis=-1, keepdims=True)
    xp.exp(z, out=z)
    z /= xp.sum(z, axis=-1, keepdims=True)
    return z


def _workspace(ins, outs, scale=1.0, causal=True):
    # the mask, or a row statistic
    x = outs[0]
    return max(x.shape[-2] * x.shape[-1] if causal else 0, reduced_bytes(x))


def _grad_kernel(ctx, y, dy, scale=1.0):
    xp = ctx.xp
    out = xp.subtract(dy, dot_along(xp, dy, y), out=xp.empty_like(y))
    out *= y
    out *= xp.asarray(scale, dtype=y.dtype)
    return out


def _grad(op, dz):
    return [emit1("scaled_masked_softmax_grad", [op.outputs[0], dz],
                  {"scale": op.attrs["scale"]})]


# Row(name, kernel, grad, flops per element): scale 1, mask 1, softmax 5; gradient 5.
register_rows((Row("scaled_masked_softmax", _kernel, _grad, flops=7, workspace=_workspace),),
              infer=_infer, spmd=EinsumRule(_notation(1), reads=()))
register_rows((Row("scaled_masked_softmax_grad", _grad_kernel, flops=5,
                   workspace=lambda ins, outs, scale=1.0: reduced_bytes(outs[0])),),
              infer=_grad_infer, spmd=EinsumRule(_notation(2), reads=()), differentiable=False)


def scaled_masked_softmax(x, scale: float, causal: bool = True):
    """Megatron's fused ``softmax(where(causal mask, scale * x, -inf))`` over the last
    dim of attention scores (module docstring)."""
    return emit1("scaled_masked_softmax", [x], {"scale": float(scale), "causal": bool(causal)})
