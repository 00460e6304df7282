"""The ops of a sparse mixture-of-experts block (Mixtral's): top-k routing, one-hot
counts, and the experts' SwiGLU on the tokens routed to them.

- ``top_k(x, k)``: the ``k`` largest entries of the last dim, largest first, and their
  indices (int64). ``...Z -> ...K, ...K``: the last dim is never split. Its gradient
  ``top_k_grad`` puts each value's gradient back at its index (zeros elsewhere).
- ``one_hot(ids, n, dtype)``: ``[..., n]``, 1 at each id; no gradient (the router's
  load-balancing loss counts the tokens each expert gets with it).
- ``moe_ffn(x, ids, weights, gate, up, down, capacity)``: ``x`` [b, s, d] tokens,
  ``ids``/``weights`` [b, s, k] the experts each token goes to and the weights of their
  outputs, ``gate``/``up`` [E, d, I] and ``down`` [E, I, d] the experts' SwiGLU
  weights stacked with the expert as dim 0: ``y[t] = sum_j weights[t, j] *
  swiglu_{ids[t, j]}(x[t])``. The kernel gathers each expert's tokens and runs the
  expert on those only (its work follows the tokens each expert gets); shapes stay
  static, as the graph needs, because the gather happens inside the op.

Routing is dropless when ``capacity`` is None: every token reaches its k experts, as
Mixtral computes. ``capacity=C`` is GShard's fixed-capacity dispatch: each sequence
(one row ``b``, a GShard group) gives each expert at most ``C`` tokens, taken in
GShard's priority order — every token's first choice, in sequence order, before any
second choice — and an assignment past the capacity is dropped: it adds nothing to the
token's output (the residual connection carries the token on) and its weight is not
given to the other experts. ``capacity_of(seq, k, experts, factor)`` is GShard's
``ceil(factor * seq * k / experts)``.

Sharding of moe_ffn, ``bsD,bsK,bsK,eDi,eDi,eiD -> bsD``: tokens split over b and s
(S(b) x ... -> S(b)); the experts split over e (expert parallelism: each process runs
its own experts on the tokens routed to them, the output is Partial, summed over the
expert groups), the intermediate dim i split (tensor parallelism inside each expert,
Partial as a row-split matmul is). With a capacity the sequence dim is never split
(``bSD,...``): a group's priority order needs all its tokens. ``localize`` tells a
process's kernel which experts it holds (``expert_start``). Tokens and experts split
over one mesh dim (expert parallelism proper, :class:`~distgraph.spmd.experts.ExpertRule`)
run as all-to-alls that dispatch the tokens to their experts' processes and combine the
results (:mod:`distgraph.ops.moe_dispatch`): S(b) x ... x S(e) x S(e) x S(e) -> S(b).

FLOPs are those of the tokens the experts get, priced at the expected load: k
assignments per token (at most ``E * C`` per sequence with a capacity), each ``6 d I``
for the three products, ``5 I`` for SiLU and the gating product, ``2 d`` for the weighted
combine; a process holding a share of the experts is priced at its share (a balanced
routing). The gradient is priced at two forwards: it runs on what its forward kept in
the runtime's per-micro-batch ``ctx.saved`` (each expert's rows, pre-activations and
outputs; the all-to-all form's in :mod:`distgraph.ops.moe_dispatch`), and recomputes
them only where the runtime keeps nothing. What it keeps is priced for the memory model
at the expected load too (``saved``, :func:`kept_bytes`): per assignment a process's
experts run, the row and the two pre-activations (and, in the all-to-all form, the
output it got back; the rest of the exchange, :func:`distgraph.ops.moe_dispatch.kept_bytes`).

Example::

    probs = softmax(x @ router, -1)                 # [b, s, E]
    top, ids = top_k(probs, 2)
    y = moe_ffn(x, ids, top / sum(top, -1, keepdim=True), gate, up, down)
"""

from __future__ import annotations

import math

from distgraph import dtypes
from distgraph.ops import moe_dispatch
from distgraph.ops.common import elementwise_flops, ufunc_buffers
from distgraph.registry import DTypeError, ShapeError, TensorType, nbytes, register_op, size
from distgraph.spmd import LETTERS, EinsumRule
from distgraph.spmd.experts import ExpertRule
from distgraph.trace import emit, emit1


def capacity_of(seq: int, k: int, experts: int, factor: float) -> int:
    """GShard's expert capacity of a sequence of ``seq`` tokens: ``ceil(factor * seq * k
    / experts)``."""
    return max(1, math.ceil(float(factor) * seq * k / experts))


# -- top_k --------------------------------------------------------------------------------------
def _lead(rank: int) -> str:
    return LETTERS[:rank - 1]


@register_op("top_k", spmd=EinsumRule(
    lambda s, a: f"{_lead(len(s[0]))}Z->{_lead(len(s[0]))}K,{_lead(len(s[0]))}K",
    out_shapes=lambda s, a: [tuple(s[0][:-1]) + (a["k"],)] * 2))
class TopK:
    """S(b) -> S(b), S(b): the dim it selects from is never split."""

    flops = elementwise_flops(1)

    def infer(x, k):
        if not 1 <= k <= x.shape[-1]:
            raise ShapeError(f"top_k: k={k} must be in [1, {x.shape[-1]}] (the last dim)")
        shape = tuple(x.shape[:-1]) + (int(k),)
        return TensorType(shape, x.dtype), TensorType(shape, "int64")

    def kernel(ctx, x, k):
        xp = ctx.xp
        ids = xp.argsort(-x, axis=-1, kind="stable")[..., :k]
        return xp.take_along_axis(x, ids, axis=-1), ids.astype("int64")

    def workspace(ins, outs, k):
        # -x and the whole order (int64), of which the first k are kept (the results are
        # made after -x is dropped)
        order = size(ins[0]) * INDEX
        return max(nbytes(ins[0]) + order - sum(nbytes(t) for t in outs), order)

    def grad(op, dvalues, dids=None):
        return [emit1("top_k_grad", [dvalues, op.outputs[1]], {"n": op.inputs[0].shape[-1]})]


@register_op("top_k_grad", differentiable=False, spmd=EinsumRule(
    lambda s, a: f"{_lead(len(s[0]))}K,{_lead(len(s[0]))}K->{_lead(len(s[0]))}N",
    out_shapes=lambda s, a: [tuple(s[0][:-1]) + (a["n"],)]))
class TopKGrad:
    """dx = the values' gradient at their indices, 0 elsewhere. S(b) x S(b) -> S(b)."""

    flops = elementwise_flops(1)

    def infer(dvalues, ids, n):
        return TensorType(tuple(dvalues.shape[:-1]) + (int(n),), dvalues.dtype)

    def kernel(ctx, dvalues, ids, n):
        out = ctx.xp.zeros(dvalues.shape[:-1] + (n,), dtype=dvalues.dtype)
        ctx.xp.put_along_axis(out, ids, dvalues, axis=-1)
        return out

    def workspace(ins, outs, n):
        # put_along_axis's row index (int64) and numpy's per-row scratch of the setting
        return size(outs[0]) // max(n, 1) * (INDEX + 4)


@register_op("one_hot", differentiable=False, spmd=EinsumRule(
    lambda s, a: f"{LETTERS[:len(s[0])]}->{LETTERS[:len(s[0])]}N",
    out_shapes=lambda s, a: [tuple(s[0]) + (a["n"],)]), takes_16bit=True)
class OneHot:
    """S(b) -> S(b): the new last dim is never split. Written in its ``dtype`` (a
    16-bit one too) without a bool array first."""

    flops = elementwise_flops(1)

    def infer(ids, n, dtype="float32"):
        if ids.dtype not in dtypes.INT_DTYPES:
            raise DTypeError(f"one_hot ids must be integers, got {ids.dtype}")
        return TensorType(tuple(ids.shape) + (int(n),), dtypes.canonical(dtype))

    def kernel(ctx, ids, n, dtype="float32"):
        xp = ctx.xp
        return xp.equal(ids[..., None], xp.arange(n), out=xp.empty(ids.shape + (n,), dtype))

    def workspace(ins, outs, n, dtype="float32"):
        # the comparison's results cast into the result a buffer at a time (numpy)
        return ufunc_buffers(INDEX, INDEX, 1)


# -- moe_ffn ------------------------------------------------------------------------------------
def _ffn_words(capacity) -> tuple:
    tokens = "bs" if capacity is None else "bS"
    return (f"{tokens}D,{tokens}K,{tokens}K,eDi,eDi,eiD", f"{tokens}D")


def _ffn_notation(in_shapes, attrs):
    ins, out = _ffn_words(attrs.get("capacity"))
    return f"{ins}->{out}"


def _ffn_grad_notation(in_shapes, attrs):
    ins, out = _ffn_words(attrs.get("capacity"))
    tokens = out[:2]
    return f"{ins},{out}->{out},{tokens}K,eDi,eDi,eiD"


def _pairs(ins, capacity) -> int:
    """The (token, expert) assignments the experts compute: the expected load."""
    b, s, k = ins[1].shape
    experts = ins[3].shape[0]
    per_seq = s * k if capacity is None else min(s * k, experts * capacity)
    return b * per_seq


def _ffn_flops(ins, outs, capacity=None, expert_start=None, num_experts=None, members=None):
    d, inner = ins[3].shape[1], ins[3].shape[2]
    return _pairs(ins, capacity) * (6 * d * inner + 5 * inner + 2 * d)


INDEX = 8          # bytes of the int64 indices the kernels make (numpy's and cupy's intp)


def kept_bytes(attrs, ctx, ins) -> float:
    """Bytes moe_ffn's kernel keeps in ``ctx.saved`` for its gradient at the expected
    load, beyond its operands (Values the gradient reads anyway), on a process with local
    TensorTypes ``ins``: per assignment its experts run, the token's row and the two
    pre-activations ``g``, ``u`` and the expert's output (``2 d + 2 I`` items) and its
    row and top-k slot (two int64); the all-to-all form's in
    :func:`distgraph.ops.moe_dispatch.kept_bytes`."""
    if ctx.get("group") is not None:
        return moe_dispatch.kept_bytes(attrs, len(ctx["group"]), ins)
    d, inner = ins[3].shape[1:]
    return _local_pairs(attrs, ins) * ((2 * d + 2 * inner) * dtypes.itemsize(ins[0].dtype)
                                       + 2 * INDEX)


def _local_pairs(attrs, ins) -> float:
    """The assignments this process's experts run at the expected load (a balanced
    routing's share)."""
    b, s, k = ins[1].shape
    local = ins[3].shape[0]
    experts = attrs.get("num_experts") or local
    capacity = attrs.get("capacity")
    per_seq = s * k if capacity is None else min(s * k, experts * capacity)
    return b * per_seq * local / experts


ROWS = 512      # an expert's tokens computed at once: its temporaries have this many rows


def workspace_bytes(attrs, ins, grad: bool) -> int:
    """Bytes moe_ffn's kernel (``grad``: moe_ffn_grad's) allocates beyond its results at
    the expected load: its routes (two int64 per assignment, beside the one-hot choices
    that find them), then, serially, one block of an expert's tokens (ROWS, or an
    expert's expected share if fewer): the rows, the pre-activations and their products
    (and, for the gradient, the block's recomputed forward and a weight's gradient of
    one block). Where the runtime keeps the forward's arrays (``ctx.saved``, priced by
    :func:`kept_bytes`) the gradient recomputes none: one block is then counted twice, a
    bound. The all-to-all form (``members``: the processes of its group, set by
    :func:`~distgraph.ops.moe_dispatch.localize`) runs each local expert on every row the
    group sends it at once: the results of the rows received, and an expert's
    temporaries (the forward's SwiGLU, the gradient's from the kept pre-activations);
    its exchange buffers are counted from its ``comm`` hook
    (:func:`~distgraph.registry.comm_workspace`)."""
    b, s, k = ins[1].shape
    local, d, inner = ins[3].shape
    item = dtypes.itemsize(ins[0].dtype)
    pairs = _local_pairs(attrs, ins)
    members = attrs.get("members")
    if members:
        received = pairs * members          # this process's experts' rows, all senders'
        experts = attrs.get("num_experts") or local
        routes = 2 * INDEX * b * s * k + b * s * k * experts
        expert = received / local * item * ((8 * inner + 3 * d) if grad else (3 * inner + d))
        return int(routes + received * d * item + expert)
    choices = b * s * k * local * (1 if attrs.get("capacity") is None else 10)
    n = min(ROWS, pairs / local) if local else 0
    if grad:
        block = n * item * (2 * d + 2 * inner + max(d + 3 * inner, 3 * d + 2 * inner)) + \
            d * inner * item
    else:
        block = n * item * (2 * d + 2 * inner + max(inner, 2 * d))
    return int(2 * INDEX * pairs + max(choices, block + n * item))


def _swiglu(xp, g, u):
    """silu(g) u in one new array (sigmoid as ops.silu computes it)."""
    half = g.dtype.type(0.5)
    h = xp.multiply(g, half, out=xp.empty_like(g))
    xp.tanh(h, out=h)
    h *= half
    h += half
    h *= g
    h *= u
    return h


def _expert(xp, xf, rows, gate, up, down):
    """One expert's forward on rows ``rows`` of ``xf``: (xs, g, u, out)."""
    xs = xf[rows]
    g, u = xs @ gate, xs @ up
    return xs, g, u, _swiglu(xp, g, u) @ down


def _blocks(routes, rows: int = ROWS):
    """The routes' assignments in blocks of at most ``rows`` tokens of one expert."""
    for e, tokens, slots in routes:
        for start in range(0, tokens.size, rows):
            yield e, tokens[start:start + rows], slots[start:start + rows]


def _routes(xp, ids, capacity, start, count):
    """[(local expert, token rows, top-k slots)]: the assignments of ``ids`` [b, s, k] to
    experts ``start .. start + count - 1`` that run (all of them without a capacity;
    within each sequence's capacity in GShard's order, choice-major, with one)."""
    b, s, k = ids.shape
    experts = xp.arange(start, start + count)
    if capacity is None:
        hot = ids.reshape(b * s, k)[..., None] == experts                  # [t, k, e]
    else:
        order = ids.transpose(0, 2, 1).reshape(b, k * s)[..., None] == experts
        kept = order & (xp.cumsum(order, axis=1) <= capacity)
        hot = kept.reshape(b, k, s, count).transpose(0, 2, 1, 3).reshape(b * s, k, count)
    out = []
    for e in range(count):
        rows, slots = xp.nonzero(hot[..., e])
        if rows.size:
            out.append((e, rows, slots))
    return out


def _check(xp, ids, experts):
    if ids.size and (ids.min() < 0 or ids.max() >= experts):
        bad = int(ids.min() if ids.min() < 0 else ids.max())
        raise ShapeError(f"moe_ffn: expert id {bad} is outside [0, {experts})")


@register_op("moe_ffn", spmd=ExpertRule(_ffn_notation))
class MoeFFN:
    """Tokens split: S(b) x S(b) x S(b) x R x R x R -> S(b); experts split (expert
    parallel): R x R x R x S(0) x S(0) x S(0) -> P; SwiGLU's inner dim split (tensor
    parallel): R x R x R x S(2) x S(2) x S(1) -> P."""

    flops = _ffn_flops

    def infer(x, ids, weights, gate, up, down, capacity=None, expert_start=None,
              num_experts=None, members=None):
        if len(x.shape) != 3 or tuple(ids.shape[:2]) != tuple(x.shape[:2]) or \
                tuple(weights.shape) != tuple(ids.shape):
            raise ShapeError(f"moe_ffn: x [b, s, d] and ids, weights [b, s, k] expected, got "
                             f"{list(x.shape)}, {list(ids.shape)}, {list(weights.shape)}")
        if ids.dtype not in dtypes.INT_DTYPES:
            raise DTypeError(f"moe_ffn: expert ids must be integers, got {ids.dtype}")
        e, d, inner = gate.shape
        if tuple(gate.shape) != (e, x.shape[2], inner) or tuple(up.shape) != tuple(gate.shape) \
                or tuple(down.shape) != (e, inner, d):
            raise ShapeError(f"moe_ffn: gate, up [E, {x.shape[2]}, I] and down [E, I, "
                             f"{x.shape[2]}] expected, got {list(gate.shape)}, "
                             f"{list(up.shape)}, {list(down.shape)}")
        if capacity is not None and capacity < 1:
            raise ShapeError(f"moe_ffn: capacity {capacity} must be >= 1 (or None: dropless)")
        return x

    def kernel(ctx, x, ids, weights, gate, up, down, capacity=None, expert_start=None,
               num_experts=None, members=None):
        xp = ctx.xp
        _check(xp, ids, gate.shape[0] if num_experts is None else num_experts)
        if ctx.group is not None:
            return moe_dispatch.forward(ctx, x, ids, weights, gate, up, down, capacity,
                                        expert_start, num_experts, _routes)
        b, s, d = x.shape
        xf, wf = x.reshape(b * s, d), weights.reshape(b * s, -1)
        y = xp.zeros_like(xf)
        kept = [] if ctx.saved is not None else None
        for e, rows, slots in _blocks(_routes(xp, ids, capacity, expert_start or 0,
                                              gate.shape[0])):
            xs, g, u, out = _expert(xp, xf, rows, gate[e], up[e], down[e])
            y[rows] += out * wf[rows, slots][:, None]
            if kept is not None:
                kept.append((e, rows, slots, xs, g, u, out))
            del xs, g, u, out
        if kept is not None:
            ctx.saved["moe_ffn"] = ((x, ids, weights, gate, up, down), kept)
        return y.reshape(x.shape)

    def workspace(ins, outs, **attrs):
        return workspace_bytes(attrs, ins, grad=False)

    localize = moe_dispatch.localize
    comm = moe_dispatch.comm

    def saved(attrs, ctx, ins):
        return kept_bytes(attrs, ctx, ins)

    def grad(op, dy):
        dx, dweights, dgate, dup, ddown = emit("moe_ffn_grad", [*op.inputs, dy],
                                              dict(op.attrs))
        return [dx, None, dweights, dgate, dup, ddown]


@register_op("moe_ffn_grad", spmd=ExpertRule(_ffn_grad_notation), differentiable=False)
class MoeFFNGrad:
    """Each expert's forward as moe_ffn kept it (recomputed where the runtime keeps
    nothing), then the SwiGLU chain backwards:
    dx (Partial where experts or the inner dim are split), dweights (the expert's output
    dotted with dy), and the stacked weights' gradients (Partial where tokens are split)."""

    def flops(ins, outs, capacity=None, expert_start=None, num_experts=None, members=None):
        return 2 * _ffn_flops(ins, outs, capacity)

    def infer(x, ids, weights, gate, up, down, dy, capacity=None, expert_start=None,
              num_experts=None, members=None):
        return x, weights, gate, up, down

    def kernel(ctx, x, ids, weights, gate, up, down, dy, capacity=None, expert_start=None,
               num_experts=None, members=None):
        xp = ctx.xp
        if ctx.group is not None:
            return moe_dispatch.backward(ctx, x, ids, weights, gate, up, down, dy, capacity,
                                         expert_start, num_experts, _routes)
        b, s, d = x.shape
        xf, wf, dyf = x.reshape(b * s, d), weights.reshape(b * s, -1), dy.reshape(b * s, d)
        dx, dw = xp.zeros_like(xf), xp.zeros_like(wf)
        grads = [xp.zeros_like(w) for w in (gate, up, down)]
        scratch = xp.empty(gate[0].size, dtype=gate.dtype)      # a block's weight gradient
        for e, rows, slots, xs, g, u, out in _kept_or_recomputed(
                ctx, (x, ids, weights, gate, up, down), capacity, expert_start):
            do = dyf[rows]
            dw[rows, slots] = xp.einsum("nd,nd->n", out, do)
            do *= wf[rows, slots][:, None]
            back = _expert_backward(xp, xs, g, u, do, (gate[e], up[e], down[e]),
                                    [w[e] for w in grads], scratch)
            dx[rows] += back            # (dx[rows] gathered after, not during, the block)
            del xs, g, u, out, do, back
        return (dx.reshape(x.shape), dw.reshape(weights.shape), *grads)

    def workspace(ins, outs, **attrs):
        return workspace_bytes(attrs, ins, grad=True)

    localize = moe_dispatch.localize

    def comm(site):
        return moe_dispatch.comm(site, grad=True)


def _add_product(xp, a, b, into, scratch) -> None:
    """``into += a @ b`` by way of ``scratch`` (the product of one block of rows)."""
    into += xp.matmul(a, b, out=scratch[:into.size].reshape(into.shape))


def _expert_backward(xp, xs, g, u, do, weights, grads, scratch):
    """One block's SwiGLU backward from its pre-activations ``g``, ``u`` and the
    gradient ``do`` of its weighted output: adds to the expert's weight gradients
    ``grads`` (gate, up, down) and returns the rows' dx, beside three arrays of the
    block's pre-activations' size."""
    gate, up, down = weights
    half = g.dtype.type(0.5)
    sig = xp.multiply(g, half, out=xp.empty_like(g))       # sigmoid, as ops.silu
    xp.tanh(sig, out=sig)
    sig *= half
    sig += half
    act = xp.multiply(g, sig, out=xp.empty_like(g))
    h = xp.multiply(act, u, out=xp.empty_like(g))
    _add_product(xp, h.T, do, grads[2], scratch)
    del h
    dg = do @ down.T                                        # dh
    du = xp.multiply(dg, act, out=act)
    dg *= u                                                 # dh u sig (1 + g (1 - sig))
    dg *= sig
    xp.subtract(1, sig, out=sig)
    sig *= g
    sig += 1
    dg *= sig
    del sig
    _add_product(xp, xs.T, dg, grads[0], scratch)
    _add_product(xp, xs.T, du, grads[1], scratch)
    dx = dg @ gate.T
    dx += du @ up.T
    return dx


def _kept_or_recomputed(ctx, operands, capacity, expert_start):
    """moe_ffn's forward by blocks, ``(e, rows, slots, xs, g, u, out)``: as its kernel
    kept it in ``ctx.saved`` for these very operands, else recomputed a block at a time."""
    xp = ctx.xp
    x, ids, _, gate, up, down = operands
    kept = ctx.saved.pop("moe_ffn", None) if ctx.saved is not None else None
    if kept is not None and all(a is b for a, b in zip(kept[0], operands)):
        yield from kept[1]
        return
    xf = x.reshape(-1, x.shape[-1])
    for e, rows, slots in _blocks(_routes(xp, ids, capacity, expert_start or 0,
                                          gate.shape[0])):
        yield (e, rows, slots, *_expert(xp, xf, rows, gate[e], up[e], down[e]))


# -- functional API -----------------------------------------------------------------------------
def top_k(x, k: int):
    """(values, indices) of the ``k`` largest entries of the last dim, largest first."""
    return tuple(emit("top_k", [x], {"k": int(k)}))


def one_hot(ids, n: int, dtype: str = "float32"):
    return emit1("one_hot", [ids], {"n": int(n), "dtype": dtypes.canonical(dtype)})


def moe_ffn(x, ids, weights, gate, up, down, capacity: int | None = None):
    """The experts' SwiGLU on the tokens routed to them, weighted and summed per token
    (module docstring); ``capacity``: GShard's per-sequence expert capacity, None:
    dropless."""
    return emit1("moe_ffn", [x, ids, weights, gate, up, down],
                 {"capacity": None if capacity is None else int(capacity)})
