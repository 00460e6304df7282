"""Neural-network ops: softmax, log_softmax, layer_norm, embedding, softmax cross-entropy.

Sharding (hand-written notations; UPPERCASE = never split):
- softmax/log_softmax over ``axis``: ``"abC->abC"``.
- layer_norm over the last dim: ``"abC,C,C->abC,ab,ab"``; its grad reduces the batch
  letters into dweight/dbias, so those come out Partial where the batch is split.
- embedding: ``"ab,vh->abh"``: a split vocabulary ``v`` gives a Partial output
  (vocabulary-parallel embedding); its grad ``"ab,abh->vh"`` is Partial over the batch.
- softmax_cross_entropy: ``"abz,ab->ab,ab"`` with ``z`` reduced inside the op: a split
  class dim gives replicated results (its distributed form communicates), not Partial.

Labels and ids are checked in the serial and the split form alike: a label outside
``[0, classes)`` that is not ``ignore_index`` (default -100, as Paddle and PyTorch), or an
id outside ``[0, vocabulary)``, raises :class:`OutOfRange` naming the value and its
position in the batch. An ignored label gives loss 0 and gradient 0.
"""

from __future__ import annotations

import numpy as np

from distgraph import dtypes
from distgraph.errors import DistGraphError
from distgraph.ops import fused_gpu
from distgraph.ops.common import (Row, dot_along, elementwise_flops, normalize_axes,
                                  reduced_bytes, register_rows)
from distgraph.ops.elementwise import divide, multiply, subtract
from distgraph.ops.reduce import mean as reduce_mean
from distgraph.ops.reduce import sum as reduce_sum
from distgraph.registry import DTypeError, ShapeError, TensorType, nbytes, register_op, size
from distgraph.spmd import LETTERS, EinsumRule, axis_rule, elementwise_rule
from distgraph.trace import emit, emit1

IGNORE_INDEX = -100
INDEX = 8          # bytes of the int64 indices the kernels make (numpy's and cupy's intp)


class OutOfRange(DistGraphError):
    """An integer input (a label, an embedding id) outside its valid range; ``position``
    is its index in the op's (local) batch, ``value`` the value."""

    def __init__(self, message: str, position: tuple, value: int):
        super().__init__(message)
        self.position, self.value = position, value


def check_range(xp, values, low: int, high: int | None, what: str, allowed=None) -> None:
    """Raise OutOfRange for the first entry of ``values`` outside ``[low, high)`` (no
    upper bound when ``high`` is None) that is not ``allowed``."""
    if values.size == 0:
        return
    if values.min() >= low and (high is None or values.max() < high):
        return
    bad = values < low
    if high is not None:
        bad |= values >= high
    if allowed is not None:
        bad &= values != allowed
    if not bad.any():
        return
    position = tuple(int(i) for i in xp.argwhere(bad)[0])
    value = int(values[position])
    valid = f"[{low}, {high})" if high is not None else f">= {low}"
    raise OutOfRange(f"{what} {value} at batch position {position} is outside {valid}", position,
                     value)


def _check_float(x, op):
    if not dtypes.is_float(x.dtype):
        raise DTypeError(f"{op} needs a floating tensor, got {x.dtype}")


def _float_only(op_type):
    """The ``infer`` of a softmax-family op: a floating operand, the same result."""
    def infer(x, axis=-1):
        _check_float(x, op_type)
        return x
    return infer


def _softmax_grad_infer(y, dy, axis=-1):
    return y


# The softmax family's kernels run in place on their result (exp after the subtraction,
# on the same array; a product summed over the axis as one einsum): as array expressions
# they allocated one or two more arrays of the result's size. log_softmax keeps one: the
# exponentials it sums.
def _shifted(xp, x, axis):
    """``x - max(x, axis)`` in a new array."""
    return xp.subtract(x, xp.max(x, axis=axis, keepdims=True), out=xp.empty_like(x))


def _softmax(ctx, x, axis=-1):
    xp = ctx.xp
    if xp is not np and axis in (-1, x.ndim - 1) and (fused_gpu.by_rows(x) or
                                                       fused_gpu.rows_bf16(x)):
        return fused_gpu.softmax(x)
    e = _shifted(xp, x, axis)
    xp.exp(e, out=e)
    e /= xp.sum(e, axis=axis, keepdims=True)
    return e


def _log_softmax(ctx, x, axis=-1):
    xp = ctx.xp
    out = _shifted(xp, x, axis)
    out -= xp.log(xp.sum(xp.exp(out), axis=axis, keepdims=True))
    return out


def _softmax_grad(ctx, y, dy, axis=-1):
    """dx = y (dy - sum(dy y, axis))."""
    if ctx.xp is not np and axis in (-1, y.ndim - 1) and (fused_gpu.by_rows(y, dy) or
                                                          fused_gpu.rows_bf16(y, dy)):
        return fused_gpu.softmax_grad(y, dy)
    out = ctx.xp.subtract(dy, dot_along(ctx.xp, dy, y, axis), out=ctx.xp.empty_like(y))
    out *= y
    return out


def _log_softmax_grad(ctx, y, dy, axis=-1):
    """dx = dy - exp(y) sum(dy, axis)."""
    xp = ctx.xp
    out = xp.exp(y)
    out *= xp.sum(dy, axis=axis, keepdims=True)
    return xp.subtract(dy, out, out=out)


def _rows(n: float):
    """A softmax-family ``workspace``: ``n`` arrays of the result plus a row statistic."""
    def workspace(ins, outs, axis=-1):
        return n * nbytes(outs[0]) + reduced_bytes(outs[0], axis)
    return workspace


def _grad_by(grad_type):
    """The grad of a softmax-family op: one ``grad_type`` op on its result and ``dz``."""
    def grad(op, dz):
        return [emit1(grad_type, [op.outputs[0], dz], {"axis": op.attrs["axis"]})]
    return grad


# Row(name, kernel, grad, flops per element, infer); "abC->abC" for axis=-1:
# S(0) -> S(0), the softmax axis is never split.
SOFTMAX = (
    Row("softmax", _softmax, _grad_by("softmax_grad"), flops=5, infer=_float_only("softmax"),
        workspace=_rows(0)),
    Row("log_softmax", _log_softmax, _grad_by("log_softmax_grad"), flops=5,
        infer=_float_only("log_softmax"), workspace=_rows(1)),
)
register_rows(SOFTMAX, spmd=axis_rule())

# Row(name, kernel(ctx, y, dy, axis) -> dx, flops per element); "abC,abC->abC" for axis=-1:
# S(0) x S(0) -> S(0).
SOFTMAX_GRADS = (
    Row("softmax_grad", _softmax_grad, flops=4, workspace=_rows(0)),
    Row("log_softmax_grad", _log_softmax_grad, flops=4, workspace=_rows(0)),
)
register_rows(SOFTMAX_GRADS, infer=_softmax_grad_infer, spmd=axis_rule(n_in=2),
              differentiable=False)


# -- layer norm ---------------------------------------------------------------------------------
def _ln_notation(in_shapes, attrs):
    rank = len(in_shapes[0])
    batch = LETTERS[:rank - 1]
    return f"{batch}C,C,C->{batch}C,{batch},{batch}"


def _ln_grad_notation(in_shapes, attrs):
    rank = len(in_shapes[0])
    batch = LETTERS[:rank - 1]
    return f"{batch}C,C,{batch},{batch},{batch}C->{batch}C,C,C"


@register_op("layer_norm", spmd=EinsumRule(_ln_notation))
class LayerNorm:
    """Normalise over the last dim; outputs (y, mean, rstd) — the latter two for the grad."""

    flops = elementwise_flops(8)

    def infer(x, w, b, epsilon=1e-5):
        _check_float(x, "layer_norm")
        h = x.shape[-1]
        if tuple(w.shape) != (h,) or tuple(b.shape) != (h,):
            raise ShapeError(f"weight {list(w.shape)} and bias {list(b.shape)} must both be [{h}]")
        stat = TensorType(x.shape[:-1], x.dtype)
        return x, stat, stat

    def kernel(ctx, x, w, b, epsilon=1e-5):
        # in place on the result: x - mean, its squares summed as an einsum (on a GPU one
        # kernel, distgraph.ops.fused_gpu)
        xp = ctx.xp
        if xp is not np and fused_gpu.by_rows_of(x, w, b):
            return fused_gpu.layer_norm(x, w, b, epsilon)
        mean = xp.mean(x, axis=-1)
        y = xp.subtract(x, mean[..., None], out=xp.empty_like(x))
        var = dot_along(xp, y, y)[..., 0] / x.dtype.type(x.shape[-1])
        rstd = 1.0 / xp.sqrt(var + x.dtype.type(epsilon))
        y *= rstd[..., None]
        y *= w
        y += b
        return y, mean, rstd.astype(x.dtype, copy=False)

    def workspace(ins, outs, epsilon=1e-5):
        return 2 * nbytes(outs[1])   # a row statistic's intermediates (GPU's kernel: none)

    def grad(op, dy, dmean=None, drstd=None):
        x, w, _ = op.inputs
        _, mean, rstd = op.outputs
        return emit("layer_norm_grad", [x, w, mean, rstd, dy])


@register_op("layer_norm_grad", spmd=EinsumRule(_ln_grad_notation), differentiable=False)
class LayerNormGrad:
    flops = elementwise_flops(10)

    def infer(x, w, mean, rstd, dy):
        return x, w, w

    def kernel(ctx, x, w, mean, rstd, dy):
        """dx = rstd / h (h g - sum(g) - xhat sum(g xhat)), g = dy w, in place on dx
        beside one array, xhat; the sums of products as einsums (on a GPU two kernels,
        distgraph.ops.fused_gpu, without xhat)."""
        xp = ctx.xp
        if xp is not np and fused_gpu.by_rows_of(dy, x, w, mean, rstd):
            return fused_gpu.layer_norm_grad(x, w, mean, rstd, dy)
        t, h = x.dtype.type, x.shape[-1]
        xhat = xp.subtract(x, mean[..., None], out=xp.empty_like(x))
        xhat *= rstd[..., None]
        dw = xp.einsum("ni,ni->i", dy.reshape(-1, h), xhat.reshape(-1, h))
        db = xp.sum(dy, axis=tuple(range(x.ndim - 1)))
        dx = xp.multiply(dy, w, out=xp.empty_like(x))
        g_sum = xp.sum(dx, axis=-1, keepdims=True)
        xhat *= dot_along(xp, dx, xhat)
        dx *= t(h)
        dx -= g_sum
        dx -= xhat
        dx *= rstd[..., None] / t(h)
        return dx, dw, db

    def workspace(ins, outs):
        # xhat (the GPU's kernels keep the column sums' partials instead: an upper bound)
        return nbytes(outs[0]) + 2 * reduced_bytes(outs[0])


# -- embedding ----------------------------------------------------------------------------------
def _emb_notation(in_shapes, attrs):
    batch = LETTERS[:len(in_shapes[0])]
    return f"{batch},vh->{batch}h"


def _emb_grad_notation(in_shapes, attrs):
    batch = LETTERS[:len(in_shapes[0])]
    return f"{batch},{batch}h->vh"


@register_op("embedding", spmd=EinsumRule(_emb_notation), takes_16bit=True)
class Embedding:
    """out[..., :] = table[ids[...], :]; ``vocab_start`` lets a vocabulary shard look up
    only the ids it owns (others give zeros), which is how the split form works;
    ``vocab_size`` is then the whole vocabulary, against which every shard checks the ids.
    A lookup moves rows: a 16-bit table is taken as it is."""

    def infer(ids, table, vocab_start=None, vocab_size=None):
        if ids.dtype not in dtypes.INT_DTYPES:
            raise DTypeError(f"embedding ids must be integers, got {ids.dtype}")
        if len(table.shape) != 2:
            raise ShapeError(f"embedding table must be 2-D [vocab, dim], got {list(table.shape)}")
        return TensorType(tuple(ids.shape) + (table.shape[1],), table.dtype)

    def kernel(ctx, ids, table, vocab_start=None, vocab_size=None):
        size = table.shape[0] if vocab_start is None else vocab_size
        check_range(ctx.xp, ids, 0, size, "embedding id")
        if vocab_start is None:
            return table[ids]
        local = ids - vocab_start
        inside = local >= 0
        inside &= local < table.shape[0]
        local *= inside                     # another shard's id looks up row 0, zeroed
        out = table[local]
        ctx.xp.copyto(out, 0, where=~inside[..., None])
        return out

    def workspace(ins, outs, vocab_start=None, vocab_size=None):
        ids = ins[0]
        return 0 if vocab_start is None else size(ids) * (dtypes.itemsize(ids.dtype) + 2)

    def localize(attrs, site):
        rows = site.in_slices(1)[0]
        if rows.stop - rows.start == site.in_shapes[1][0]:
            return {**attrs, "vocab_start": None}, {}
        return {**attrs, "vocab_start": rows.start, "vocab_size": site.in_shapes[1][0]}, {}

    def grad(op, dz):
        ids, table = op.inputs
        return [None, emit1("embedding_grad", [ids, dz],
                            {"vocab_size": table.shape[0],
                             "vocab_start": op.attrs.get("vocab_start")})]


@register_op("embedding_grad", spmd=EinsumRule(_emb_grad_notation), differentiable=False)
class EmbeddingGrad:
    def infer(ids, dy, vocab_size, vocab_start=None):
        return TensorType((vocab_size, dy.shape[-1]), dy.dtype)

    def kernel(ctx, ids, dy, vocab_size, vocab_start=None):
        xp = ctx.xp
        rows = dy.reshape(-1, dy.shape[-1])
        if vocab_start is None:             # the ids the forward checked: all rows
            out = xp.zeros((vocab_size, dy.shape[-1]), dtype=dy.dtype)
            xp.add.at(out, ids.reshape(-1), rows)
            return out
        # another shard's id adds into one row past this shard's, left out of the result
        # (the rows are not copied to drop them)
        local = ids.reshape(-1) - vocab_start
        outside = local < 0
        outside |= local >= vocab_size
        local[outside] = vocab_size
        out = xp.zeros((vocab_size + 1, dy.shape[-1]), dtype=dy.dtype)
        xp.add.at(out, local, rows)
        return out[:vocab_size]

    def workspace(ins, outs, vocab_size, vocab_start=None):
        ids, dy = ins
        if vocab_start is None:
            return 0
        return size(ids) * (dtypes.itemsize(ids.dtype) + 2) + nbytes(dy) // size(ids) \
            if size(ids) else 0

    def localize(attrs, site):
        rows = site.out_slices(0)[0]
        split = rows.stop - rows.start != site.out_shapes[0][0]
        return {**attrs, "vocab_size": rows.stop - rows.start,
                "vocab_start": rows.start if split else None}, {}


# -- softmax cross-entropy ----------------------------------------------------------------------
def _sce_notation(in_shapes, attrs):
    batch = LETTERS[:len(in_shapes[1])]
    return f"{batch}z,{batch}->{batch},{batch}"


def _sce_grad_notation(in_shapes, attrs):
    batch = LETTERS[:len(in_shapes[1])]
    return f"{batch}z,{batch},{batch},{batch}->{batch}z"


def _logsumexp(xp, x, axis=-1):
    """log(sum(exp(x), axis)), beside one array of ``x``'s size (the exponentials)."""
    m = xp.max(x, axis=axis, keepdims=True)
    e = xp.subtract(x, m, out=xp.empty_like(x))
    total = xp.sum(xp.exp(e, out=e), axis=axis)
    del e
    return xp.log(total) + m[..., 0]


def _class_split(site):
    """(first class this shard holds, its group) when the class dim is split, else None."""
    cols = site.in_slices(0)[-1]
    if cols.stop - cols.start == site.in_shapes[0][-1]:
        return None
    return cols.start, site.split_group(0, -1)


@register_op("softmax_cross_entropy", spmd=EinsumRule(_sce_notation, internal="z"))
class SoftmaxCrossEntropy:
    """Per-sample loss ``logsumexp(logits) - logits[label]`` over the last (class) dim,
    0 where the label is ``ignore_index``; the second output is the logsumexp, which the
    gradient reuses.

    Distributed form (class dim split, S(c) x R -> R, R): each shard's logsumexp is
    all-gathered and combined, and the picked logit all-reduced, inside the op;
    ``class_start`` is the shard's first class and ``num_classes`` all of them."""

    flops = elementwise_flops(6)

    def infer(logits, labels, ignore_index=IGNORE_INDEX, class_start=None, num_classes=None):
        _check_float(logits, "softmax_cross_entropy")
        if labels.dtype not in dtypes.INT_DTYPES:
            raise DTypeError(f"labels must be integers, got {labels.dtype}")
        if tuple(labels.shape) != tuple(logits.shape[:-1]):
            raise ShapeError(f"labels {list(labels.shape)} must match logits "
                             f"{list(logits.shape)} without the class dim")
        out = TensorType(labels.shape, logits.dtype)
        return out, out

    def kernel(ctx, logits, labels, ignore_index=IGNORE_INDEX, class_start=None,
               num_classes=None):
        xp = ctx.xp
        classes = logits.shape[-1] if class_start is None else num_classes
        check_range(xp, labels, 0, classes, f"label (ignore_index={ignore_index})",
                    allowed=ignore_index)
        lse = _logsumexp(xp, logits)
        local = labels - (class_start or 0)
        inside = (local >= 0) & (local < logits.shape[-1])
        picked = xp.take_along_axis(logits, xp.where(inside, local, 0)[..., None], axis=-1)[..., 0]
        if class_start is not None:
            ranks = ctx.group_ranks()
            lse = _logsumexp(xp, ctx.comm.all_gather(lse[..., None], ranks, axis=-1))
            picked = ctx.comm.all_reduce(picked * inside, ranks)
        loss = lse - picked
        loss *= labels != ignore_index
        return loss, lse

    def workspace(ins, outs, ignore_index=IGNORE_INDEX, class_start=None, num_classes=None):
        return nbytes(ins[0])               # the exponentials of the logits

    def localize(attrs, site):
        split = _class_split(site)
        if split is None:
            return attrs, {}
        return ({**attrs, "class_start": split[0], "num_classes": site.in_shapes[0][-1]},
                {"group": split[1]})

    def comm(site):
        split = _class_split(site)
        if split is None:
            return ()
        n = len(split[1])
        rows = 1
        for d in site.out_attrs[0].local_shape(site.out_shapes[0]):
            rows *= d
        item = dtypes.itemsize(site.in_dtypes[0])
        return (("all_gather", n, rows * n * item), ("all_reduce", n, rows * item))

    def grad(op, dz, dlse=None):
        logits, labels = op.inputs
        ignore = op.attrs.get("ignore_index", IGNORE_INDEX)
        return [emit1("softmax_cross_entropy_grad", [logits, labels, op.outputs[1], dz],
                      {"ignore_index": ignore}), None]


@register_op("softmax_cross_entropy_grad", spmd=EinsumRule(_sce_grad_notation),
             differentiable=False)
class SoftmaxCrossEntropyGrad:
    """dlogits = (exp(logits - logsumexp) - onehot(label)) * dloss, 0 for an ignored
    label; with the class dim split each shard does its own columns, no communication
    (S(c) x R x R x R -> S(c))."""

    flops = elementwise_flops(6)

    def infer(logits, labels, lse, dloss, ignore_index=IGNORE_INDEX, class_start=None):
        return logits

    def kernel(ctx, logits, labels, lse, dloss, ignore_index=IGNORE_INDEX, class_start=None):
        xp = ctx.xp
        p = xp.subtract(logits, lse[..., None], out=xp.empty_like(logits))
        xp.exp(p, out=p)
        local = labels - (class_start or 0)
        inside = (local >= 0) & (local < logits.shape[-1])
        index = xp.where(inside, local, 0)[..., None]
        xp.put_along_axis(p, index, xp.take_along_axis(p, index, axis=-1) - inside[..., None],
                          axis=-1)
        p *= (dloss * (labels != ignore_index))[..., None]
        return p

    def workspace(ins, outs, ignore_index=IGNORE_INDEX, class_start=None):
        # per row: the label's column (int64, twice), take_along_axis's and
        # put_along_axis's row index (int64), the picked value, a bool
        labels = ins[1]
        return size(labels) * (3 * INDEX + dtypes.itemsize(ins[0].dtype) + 1)

    def localize(attrs, site):
        cols = site.in_slices(0)[-1]
        split = cols.stop - cols.start != site.in_shapes[0][-1]
        return ({**attrs, "class_start": cols.start} if split else attrs), {}


@register_op("label_mask", spmd=elementwise_rule(), differentiable=False, takes_16bit=True)
class LabelMask:
    """1 where a label is not ``ignore_index``, else 0, as ``dtype`` (a 16-bit one
    too): the positions a mean cross-entropy averages over."""

    flops = elementwise_flops(1)

    def infer(labels, ignore_index=IGNORE_INDEX, dtype="float32"):
        if labels.dtype not in dtypes.INT_DTYPES:
            raise DTypeError(f"labels must be integers, got {labels.dtype}")
        return TensorType(labels.shape, dtypes.canonical(dtype))

    def kernel(ctx, labels, ignore_index=IGNORE_INDEX, dtype="float32"):
        xp = ctx.xp
        return xp.not_equal(labels, ignore_index, out=xp.empty(labels.shape, dtype))


# -- functional API -----------------------------------------------------------------------------
def softmax(x, axis=-1):
    return emit1("softmax", [x], {"axis": normalize_axes(axis, len(x.shape))[0]})


def log_softmax(x, axis=-1):
    return emit1("log_softmax", [x], {"axis": normalize_axes(axis, len(x.shape))[0]})


def layer_norm(x, normalized_shape=None, weight=None, bias=None, epsilon=1e-5):
    """Paddle's layer_norm; distgraph normalises over the last dim with weight and bias."""
    h = x.shape[-1]
    if normalized_shape is not None:
        ns = [normalized_shape] if isinstance(normalized_shape, int) else list(normalized_shape)
        if ns != [h]:
            raise ShapeError(f"layer_norm normalises over the last dim only; got "
                             f"normalized_shape={ns} for input {list(x.shape)}")
    if weight is None or bias is None:
        raise ShapeError("layer_norm needs weight and bias (use nn.LayerNorm to create them)")
    return emit("layer_norm", [x, weight, bias], {"epsilon": float(epsilon)})[0]


def embedding(x, weight):
    return emit1("embedding", [x, weight])


def softmax_cross_entropy(logits, labels, ignore_index=IGNORE_INDEX):
    """Per-sample softmax cross-entropy with integer labels over the last dim (0 where a
    label is ``ignore_index``)."""
    return emit("softmax_cross_entropy", [logits, labels], {"ignore_index": int(ignore_index)})[0]


# Added to the count of labels a mean averages over: exact for any count >= 1 (far below
# half an ulp of 1 in float32 and float64), and a batch whose labels are all ignored
# gets loss 0 / TINY = 0, as Paddle gives, instead of 0 / 0.
TINY = 1e-30


def cross_entropy(input, label, reduction="mean", ignore_index=IGNORE_INDEX):  # noqa: A002
    """Softmax cross-entropy with integer labels (Paddle's names); ``reduction`` is mean,
    sum or none. Positions whose label is ``ignore_index`` count for nothing: "mean"
    averages over the other positions."""
    loss = softmax_cross_entropy(input, label, ignore_index)
    if reduction == "mean":
        count = reduce_sum(emit1("label_mask", [label], {"ignore_index": int(ignore_index),
                                                         "dtype": input.dtype}))
        return divide(reduce_sum(loss), count + TINY)
    if reduction == "sum":
        return reduce_sum(loss)
    if reduction == "none":
        return loss
    raise ShapeError(f"cross_entropy: reduction must be mean, sum or none, got {reduction!r}")


def mse_loss(input, label, reduction="mean"):  # noqa: A002
    """Mean squared error, composed from subtract, multiply and mean."""
    d = subtract(input, label)
    sq = multiply(d, d)
    if reduction == "mean":
        return reduce_mean(sq)
    if reduction == "sum":
        return reduce_sum(sq)
    if reduction == "none":
        return sq
    raise ShapeError(f"mse_loss: reduction must be mean, sum or none, got {reduction!r}")
