"""Shape ops: reshape, transpose, broadcast_to, concat, split, slice.

Sharding: transpose permutes letters (``"abc->cab"``); concat/split/slice never split the
axis they cut; broadcast_to never splits a stretched dim; reshape has its own rule (a
split moves between the major dims of a merged or split group, see ReshapeRule).
"""

from __future__ import annotations

from distgraph.ops.common import normalize_axes, same_dtype
from distgraph.ops.registry import ShapeError, TensorType, register_op
from distgraph.spmd import LETTERS, UNKNOWN, DimsSpec, EinsumRule, SpmdResult, entry_dims, entry_str
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
                gi.append(i); ps *= src[i]; i += 1
            else:
                gj.append(j); pd *= dst[j]; j += 1
        while i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
            gi.append(i); i += 1
        while j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
            gj.append(j); j += 1
        groups.append((tuple(gi), tuple(gj)))
    return groups


class ReshapeRule:
    """A split survives a reshape only on the major (first) dim of a merged/split group:
    [S(x), R] (4, 6) -> (24,) gives [S(x)]; (24,) [S(x)] -> (4, 6) gives [S(x), R] when the
    mesh dim divides 4. Splits on minor dims of a group are dropped (input resharded)."""

    def __repr__(self) -> str:
        return "ReshapeRule()"

    def _map(self, spec, src, dst, mesh, notes):
        sizes = dict(zip(mesh.dim_names, mesh.shape))
        out = [None] * len(dst)
        for gi, gj in reshape_groups(src, dst):
            if not gi or not gj:
                continue
            major = next((d for d in gi if src[d] != 1), gi[0])
            for d in gi:
                if d != major and spec.dims[d] not in (None, UNKNOWN):
                    notes.append(f"dim {d} split {entry_str(spec.dims[d])} is not the major dim "
                                 f"of its reshape group; left unsplit")
            entry = spec.dims[major]
            target = next((d for d in gj if dst[d] != 1), gj[0])
            for d in gj:
                out[d] = UNKNOWN if entry is UNKNOWN else None
            if entry not in (None, UNKNOWN):
                ways = 1
                for m in entry_dims(entry):
                    ways *= sizes[m]
                if dst[target] % ways == 0:
                    out[target] = entry
                else:
                    notes.append(f"split {entry_str(entry)} of {src[major]} does not divide "
                                 f"{dst[target]} after reshape; left unsplit")
                    out[target] = None
        return DimsSpec(tuple(out))

    def infer_forward(self, in_specs, in_shapes, mesh, fixed=(), shape=None, **attrs):
        return self.infer(in_specs, None, in_shapes, None, mesh, fixed, (), False, shape=shape)

    def infer_backward(self, in_specs, out_specs, in_shapes, out_shapes, mesh, fixed=(),
                       shape=None, **attrs):
        return self.infer(in_specs, out_specs, in_shapes, out_shapes, mesh, fixed, (), True,
                          shape=shape)

    def infer(self, in_specs, out_specs, in_shapes, out_shapes, mesh, fixed_in=(), fixed_out=(),
              outputs_first=False, shape=None, **attrs) -> SpmdResult:
        """Known entries of the input and of the output both constrain the other side;
        the input wins unless the output is fixed or ``outputs_first``."""
        src, dst = tuple(in_shapes[0]), tuple(shape)
        notes: list[str] = []
        x = DimsSpec.of(in_specs[0])
        out = DimsSpec.of(out_specs[0]) if out_specs else DimsSpec.unknown(len(dst))
        out_first = (outputs_first or 0 in fixed_out) and 0 not in fixed_in
        if out_first:
            x = _fill(self._map(out, dst, src, mesh, notes), x)
        else:
            out = _fill(self._map(x, src, dst, mesh, notes), out)
            x = _fill(x, self._map(out, dst, src, mesh, []))
        new_out = self._map(x, src, dst, mesh, notes)
        back = self._map(new_out, dst, src, mesh, [])
        return SpmdResult((_fill(back, x),), (new_out,), tuple(notes))


def _fill(spec: DimsSpec, other: DimsSpec) -> DimsSpec:
    """Known entries of ``spec``, unknown ones taken from ``other``."""
    return DimsSpec(tuple(b if a is UNKNOWN else a for a, b in zip(spec.dims, other.dims)),
                    spec.partial)


@register_op("reshape", spmd=ReshapeRule())
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
    word = LETTERS[:len(in_shapes[0])]
    return word + "->" + "".join(word[p] for p in attrs["perm"])


@register_op("transpose", spmd=EinsumRule(_transpose_notation))
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
    src, dst = in_shapes[0], attrs["shape"]
    out = LETTERS[:len(dst)]
    off = len(dst) - len(src)
    word = "".join("1" if n == 1 and dst[off + i] != 1 else out[off + i] for i, n in enumerate(src))
    return f"{word}->{out}"


@register_op("broadcast_to", spmd=EinsumRule(_broadcast_notation))
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
        from distgraph.ops.common import reduce_to_shape
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
    word = _axis_word(len(in_shapes[0]), attrs["axis"])
    return ",".join([word] * len(in_shapes)) + "->" + word


@register_op("concat", spmd=EinsumRule(_concat_notation))
class Concat:
    def infer(*xs, axis):
        first = xs[0].shape
        for x in xs[1:]:
            if len(x.shape) != len(first) or any(a != b for i, (a, b) in
                                                 enumerate(zip(x.shape, first)) if i != axis):
                raise ShapeError(f"concat along axis {axis}: shapes "
                                 f"{[list(t.shape) for t in xs]} differ off that axis")
        shape = list(first)
        shape[axis] = sum(x.shape[axis] for x in xs)
        return TensorType(tuple(shape), same_dtype(*xs))

    def kernel(ctx, *xs, axis):
        return ctx.xp.concatenate(xs, axis=axis)

    def grad(op, dz):
        axis = op.attrs["axis"]
        return list(split(dz, [x.shape[axis] for x in op.inputs], axis))


def concat(xs, axis=0):
    axis = normalize_axes(axis, len(xs[0].shape))[0]
    return emit1("concat", list(xs), {"axis": axis})


def _split_notation(in_shapes, attrs):
    word = _axis_word(len(in_shapes[0]), attrs["axis"])
    return word + "->" + ",".join([word] * len(attrs["sections"]))


@register_op("split", spmd=EinsumRule(_split_notation))
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
        from distgraph.ops.elementwise import full
        parts = [dz if dz is not None else full(out.shape, 0.0, out.dtype)
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
    word = "".join(LETTERS[i].upper() if i in attrs["axes"] else LETTERS[i] for i in range(rank))
    return f"{word}->{word}"


@register_op("slice", spmd=EinsumRule(_slice_notation))
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


@register_op("slice_grad", spmd=EinsumRule(_slice_notation), differentiable=False)
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


def slice_(x, axes, starts, ends):
    axes = tuple(a % len(x.shape) for a in axes)
    starts = tuple(s % x.shape[a] if s < 0 else s for a, s in zip(axes, starts))
    ends = tuple(min(e, x.shape[a]) if e >= 0 else e % x.shape[a] for a, e in zip(axes, ends))
    return emit1("slice", [x], {"axes": axes, "starts": starts, "ends": ends})
