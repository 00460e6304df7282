"""Shape ops: reshape, transpose, broadcast_to, concat, split, slice, pad.

Sharding: transpose permutes letters (``"abc->cab"``); concat/split/slice/pad never split
the axis they cut or pad (but may make their result split there from an operand whole
there); broadcast_to never splits a stretched dim; reshape gives each merged or
split group one letter on its major dims (see ``reshape_notation``).

They only move values, so they take 16-bit operands as they are (``takes_16bit``: no
float32 copies) and allocate nothing beyond their results.
"""

from __future__ import annotations

import math
import numbers

from distgraph.ops.common import normalize_axes, reduce_to_shape, same_dtype, zeros
from distgraph.registry import ShapeError, TensorType, register_op
from distgraph.spmd import LETTERS, EinsumRule, SpmdRuleError, axes_of, axis_of
from distgraph.trace import emit, emit1


# -- reshape ------------------------------------------------------------------------------------
def reshape_groups(src, dst):
    """Pair up runs of dims with equal products: [(src dims, dst dims), ...].

    Size-1 dims join the run they sit in. Example: (4, 6) -> (4, 2, 3) gives
    [((0,), (0,)), ((1,), (1, 2))].
    """
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        gi, gj = [i] if i < len(src) else [], [j] if j < len(dst) else []
        ps = src[i] if i < len(src) else 1
        pd = dst[j] if j < len(dst) else 1
        i, j = i + bool(gi), j + bool(gj)
        while ps != pd:
            if ps < pd:
                gi.append(i)
                ps *= src[i]
                i += 1
            else:
                gj.append(j)
                pd *= dst[j]
                j += 1
        while i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
            gi.append(i)
            i += 1
        while j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
            gj.append(j)
            j += 1
        groups.append((tuple(gi), tuple(gj)))
    return groups


def reshape_notation(in_shapes, attrs) -> str:
    """One letter per merge/split group, on the group's major (first non-1) dim on each
    side; the group's other dims are UPPERCASE (never split) and size-1 dims '1'.

    A split survives a reshape only on the major dims: (4, 6) -> (24,) is "aB->a", so
    [S(x), R] gives [S(x)] and a split of the minor dim is dropped on the input too;
    (24,) -> (4, 6) is "a->aB" and a split needs to divide both 24 and 4.
    """
    src = tuple(in_shapes[0])
    shape = attrs["shape"]
    if not all(isinstance(n, numbers.Integral) and not isinstance(n, bool) and n > 0
               for n in shape):
        raise SpmdRuleError(f"reshape shape={shape!r}: give positive ints (no -1 here)")
    dst = tuple(shape)
    if math.prod(src) != math.prod(dst):
        raise SpmdRuleError(f"cannot reshape {list(src)} to {list(dst)}")
    minors = iter(LETTERS.upper())
    left, right = [], []
    for g, (gi, gj) in enumerate(reshape_groups(src, dst)):
        for dims, sizes, word in ((gi, src, left), (gj, dst, right)):
            major = next((d for d in dims if sizes[d] != 1), None)
            for d in dims:
                word.append("1" if sizes[d] == 1 else LETTERS[g] if d == major else next(minors))
    return "".join(left) + "->" + "".join(right)


@register_op("reshape", spmd=EinsumRule(reshape_notation, out_shapes=lambda s, a: [a["shape"]]),
             takes_16bit=True)
class Reshape:
    def infer(x, shape):
        total = 1
        for n in x.shape:
            total *= n
        target = 1
        for n in shape:
            target *= n
        if total != target:
            raise ShapeError(f"cannot reshape {list(x.shape)} ({total} elements) to {list(shape)}")
        return TensorType(tuple(shape), x.dtype)

    def kernel(ctx, x, shape):
        return x.reshape(shape)

    def localize(attrs, site):
        return {**attrs, "shape": site.out_local_shape()}, {}

    def grad(op, dz):
        return [reshape(dz, list(op.inputs[0].shape))]


def reshape(x, shape):
    shape = [int(n) for n in shape]
    if shape.count(-1) > 1:
        raise ShapeError(f"reshape: at most one -1 in {shape}")
    if -1 in shape:
        total = 1
        for n in x.shape:
            total *= n
        known = 1
        for n in shape:
            known *= n if n != -1 else 1
        if known == 0 or total % known:
            raise ShapeError(f"cannot reshape {list(x.shape)} to {shape}")
        shape[shape.index(-1)] = total // known
    if tuple(shape) == tuple(x.shape):
        return x
    return emit1("reshape", [x], {"shape": tuple(shape)})


# -- transpose, broadcast_to --------------------------------------------------------------------
def _transpose_notation(in_shapes, attrs):
    rank = len(in_shapes[0])
    perm = [axis_of(p, rank, "perm") for p in attrs["perm"]]
    if sorted(perm) != list(range(rank)):
        raise SpmdRuleError(f"perm {list(attrs['perm'])} is not a permutation of {rank} dims")
    word = LETTERS[:rank]
    return word + "->" + "".join(word[p] for p in perm)


@register_op("transpose", spmd=EinsumRule(_transpose_notation), takes_16bit=True)
class Transpose:
    def infer(x, perm):
        if sorted(perm) != list(range(len(x.shape))):
            raise ShapeError(f"perm {list(perm)} is not a permutation of {len(x.shape)} dims")
        return TensorType(tuple(x.shape[p] for p in perm), x.dtype)

    def kernel(ctx, x, perm):
        return ctx.xp.ascontiguousarray(ctx.xp.transpose(x, perm))

    def grad(op, dz):
        perm = op.attrs["perm"]
        inverse = [0] * len(perm)
        for i, p in enumerate(perm):
            inverse[p] = i
        return [transpose(dz, inverse)]


def transpose(x, perm):
    perm = tuple(int(p) % len(x.shape) for p in perm)
    if perm == tuple(range(len(perm))):
        return x
    return emit1("transpose", [x], {"perm": perm})


def _broadcast_notation(in_shapes, attrs):
    src, dst = in_shapes[0], tuple(attrs["shape"])
    out = LETTERS[:len(dst)]
    off = len(dst) - len(src)
    if off < 0 or any(n not in (1, dst[off + i]) for i, n in enumerate(src)):
        raise SpmdRuleError(f"cannot broadcast {list(src)} to {list(dst)}")
    word = "".join("1" if n == 1 and dst[off + i] != 1 else out[off + i] for i, n in enumerate(src))
    return f"{word}->{out}"


@register_op("broadcast_to", spmd=EinsumRule(_broadcast_notation), takes_16bit=True)
class BroadcastTo:
    def infer(x, shape):
        off = len(shape) - len(x.shape)
        if off < 0 or any(n not in (1, shape[off + i]) for i, n in enumerate(x.shape)):
            raise ShapeError(f"cannot broadcast {list(x.shape)} to {list(shape)}")
        return TensorType(tuple(shape), x.dtype)

    def kernel(ctx, x, shape):
        return ctx.xp.ascontiguousarray(ctx.xp.broadcast_to(x, shape))

    def localize(attrs, site):
        return {**attrs, "shape": site.out_local_shape()}, {}

    def grad(op, dz):
        return [reduce_to_shape(dz, op.inputs[0].shape)]


def broadcast_to(x, shape):
    shape = tuple(int(n) for n in shape)
    if tuple(x.shape) == shape:
        return x
    return emit1("broadcast_to", [x], {"shape": shape})


# -- concat, split, slice -----------------------------------------------------------------------
def _axis_word(rank, axis):
    return "".join(LETTERS[i].upper() if i == axis else LETTERS[i] for i in range(rank))


def _concat_notation(in_shapes, attrs):
    word = _axis_word(len(in_shapes[0]), axis_of(attrs["axis"], len(in_shapes[0])))
    return ",".join([word] * len(in_shapes)) + "->" + word


# aligned as Paddle's phi concat: a split the concat dim cannot keep moves to another dim;
# sliced: an output asked for split on the concat dim is computed as that slice (R -> S)
@register_op("concat", spmd=EinsumRule(_concat_notation, align=True, sliced=True),
             takes_16bit=True)
class Concat:
    def infer(*xs, axis, window=None):
        first = xs[0].shape
        for x in xs[1:]:
            if len(x.shape) != len(first) or any(a != b for i, (a, b) in
                                                 enumerate(zip(x.shape, first)) if i != axis):
                raise ShapeError(f"concat along axis {axis}: shapes "
                                 f"{[list(t.shape) for t in xs]} differ off that axis")
        shape = list(first)
        shape[axis] = sum(x.shape[axis] for x in xs) if window is None else \
            window[1] - window[0]
        return TensorType(tuple(shape), same_dtype(*xs))

    def kernel(ctx, *xs, axis, window=None):
        if window is None:
            return ctx.xp.concatenate(xs, axis=axis)
        # only the rows [lo, hi) of the result along the axis: the parts of each operand
        # that fall there (the whole result is never made)
        lo, hi = window
        parts, start = [], 0
        for x in xs:
            a, b = max(lo, start), min(hi, start + x.shape[axis])
            if a < b:
                index = [slice(None)] * x.ndim
                index[axis] = slice(a - start, b - start)
                parts.append(x[tuple(index)])
            start += x.shape[axis]
        return ctx.xp.concatenate(parts, axis=axis)

    def localize(attrs, site):
        # operands whole on the axis, the result split there: this process's slice of it
        whole = sum(shape[attrs["axis"]] for shape in site.in_shapes)
        if site.out_local_shape()[attrs["axis"]] == whole:
            return attrs, {}
        span = site.out_slices()[attrs["axis"]]
        return {**attrs, "window": (span.start, span.stop)}, {}

    def grad(op, dz):
        axis = op.attrs["axis"]
        return list(split(dz, [x.shape[axis] for x in op.inputs], axis))


def concat(xs, axis=0):
    axis = normalize_axes(axis, len(xs[0].shape))[0]
    return emit1("concat", list(xs), {"axis": axis})


def _split_notation(in_shapes, attrs):
    word = _axis_word(len(in_shapes[0]), axis_of(attrs["axis"], len(in_shapes[0])))
    return word + "->" + ",".join([word] * len(attrs["sections"]))


@register_op("split", spmd=EinsumRule(_split_notation), takes_16bit=True)
class Split:
    def infer(x, sections, axis):
        if sum(sections) != x.shape[axis]:
            raise ShapeError(f"split sections {list(sections)} do not add up to dim {axis} "
                             f"of size {x.shape[axis]}")
        outs = []
        for n in sections:
            shape = list(x.shape)
            shape[axis] = n
            outs.append(TensorType(tuple(shape), x.dtype))
        return outs

    def kernel(ctx, x, sections, axis):
        bounds, acc = [], 0
        for n in sections[:-1]:
            acc += n
            bounds.append(acc)
        return tuple(ctx.xp.ascontiguousarray(p) for p in ctx.xp.split(x, bounds, axis=axis))

    def grad(op, *dzs):
        parts = [dz if dz is not None else zeros(out.shape, out.dtype)
                 for dz, out in zip(dzs, op.outputs)]
        return [concat(parts, op.attrs["axis"])]


def split(x, num_or_sections, axis=0):
    axis = normalize_axes(axis, len(x.shape))[0]
    if isinstance(num_or_sections, int):
        if x.shape[axis] % num_or_sections:
            raise ShapeError(f"split: dim {axis} of size {x.shape[axis]} is not divisible "
                             f"into {num_or_sections} parts")
        sections = (x.shape[axis] // num_or_sections,) * num_or_sections
    else:
        sections = tuple(int(n) for n in num_or_sections)
    return emit("split", [x], {"sections": sections, "axis": axis})


def _slice_notation(in_shapes, attrs):
    rank = len(in_shapes[0])
    axes = axes_of(attrs["axes"], rank, "axes")
    word = "".join(LETTERS[i].upper() if i in axes else LETTERS[i] for i in range(rank))
    return f"{word}->{word}"


@register_op("slice", spmd=EinsumRule(_slice_notation), takes_16bit=True)
class Slice:
    """Paddle's slice: ``x[starts[i]:ends[i]]`` along each of ``axes``."""

    def infer(x, axes, starts, ends):
        shape = list(x.shape)
        for a, s, e in zip(axes, starts, ends):
            if not 0 <= s < e <= x.shape[a]:
                raise ShapeError(f"slice [{s}:{e}] is out of range for dim {a} of size {x.shape[a]}")
            shape[a] = e - s
        return TensorType(tuple(shape), x.dtype)

    def kernel(ctx, x, axes, starts, ends):
        index = [slice(None)] * x.ndim
        for a, s, e in zip(axes, starts, ends):
            index[a] = slice(s, e)
        return ctx.xp.ascontiguousarray(x[tuple(index)])

    def grad(op, dz):
        return [emit1("slice_grad", [dz], {**op.attrs, "shape": tuple(op.inputs[0].shape)})]


@register_op("slice_grad", spmd=EinsumRule(_slice_notation), differentiable=False,
             takes_16bit=True)
class SliceGrad:
    """Zeros of the sliced tensor's shape with ``dy`` written into the slice."""

    def infer(dy, axes, starts, ends, shape):
        return TensorType(tuple(shape), dy.dtype)

    def kernel(ctx, dy, axes, starts, ends, shape):
        out = ctx.xp.zeros(shape, dtype=dy.dtype)
        index = [slice(None)] * len(shape)
        for a, s, e in zip(axes, starts, ends):
            index[a] = slice(s, e)
        out[tuple(index)] = dy
        return out

    def localize(attrs, site):
        return {**attrs, "shape": site.out_local_shape()}, {}


def _pad_notation(in_shapes, attrs):
    rank = len(in_shapes[0])
    word = _axis_word(rank, axis_of(attrs["axis"], rank))
    return f"{word}->{word}"


# linear: zeros added to each term of a pending sum leave a pending sum (P -> P), so a
# gradient pending over dp is padded first and reduce-scattered at its padded size;
# sliced: asked for split on the padded axis, each process makes its own rows of the
# result from the operand whole there (R -> S(axis), no whole padded copy).
# S(i) -> S(i) for i not the axis; P -> P; R -> S(axis)
@register_op("pad", spmd=EinsumRule(_pad_notation, linear=True, sliced=True))
class Pad:
    """``x`` with zeros appended along ``axis`` up to ``size`` elements: ZeRO's padding of
    a parameter, its gradient and its optimizer states to a multiple of the data-parallel
    size (:mod:`distgraph.passes.transforms.zero`). No FLOPs: a copy, priced by the bytes
    it moves. ``window`` (set by ``localize``): only the rows [lo, hi) of the result.

    Example: pad of ``[[1, 2]]`` with axis 0, size 3 is ``[[1, 2], [0, 0], [0, 0]]``."""

    def infer(x, axis, size, window=None):
        if not x.shape[axis] <= size:
            raise ShapeError(f"pad to size {size} along dim {axis} of a tensor of shape "
                             f"{list(x.shape)}: the size is smaller than the dim")
        shape = list(x.shape)
        shape[axis] = size if window is None else window[1] - window[0]
        return TensorType(tuple(shape), x.dtype)

    def kernel(ctx, x, axis, size, window=None):
        lo, hi = (0, size) if window is None else window
        shape = list(x.shape)
        shape[axis] = hi - lo
        out = ctx.xp.zeros(shape, dtype=x.dtype)
        kept = min(hi, x.shape[axis]) - lo        # the rows of x in the window
        if kept > 0:
            into, src = [slice(None)] * x.ndim, [slice(None)] * x.ndim
            into[axis], src[axis] = slice(0, kept), slice(lo, lo + kept)
            out[tuple(into)] = x[tuple(src)]
        return out

    def localize(attrs, site):
        # the operand whole on the axis, the result split there: this process's rows
        axis = attrs["axis"]
        if site.out_local_shape()[axis] == attrs["size"]:
            return attrs, {}
        span = site.out_slices()[axis]
        return {**attrs, "window": (span.start, span.stop)}, {}

    def grad(op, dz):
        axis = op.attrs["axis"]
        return [slice_(dz, (axis,), (0,), (op.inputs[0].shape[axis],))]


def slice_(x, axes, starts, ends):
    axes = tuple(a % len(x.shape) for a in axes)
    starts = tuple(s % x.shape[a] if s < 0 else s for a, s in zip(axes, starts))
    ends = tuple(min(e, x.shape[a]) if e >= 0 else e % x.shape[a] for a, e in zip(axes, ends))
    return emit1("slice", [x], {"axes": axes, "starts": starts, "ends": ends})
