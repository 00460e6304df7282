"""Expert parallelism's distributed form of ``moe_ffn`` and ``moe_ffn_grad``: the tokens
and the experts split over one mesh dim ``m`` (:mod:`distgraph.spmd.experts`), every
token is sent to the process holding its expert and the result sent back, two
all-to-alls over ``m`` (dispatch and combine).

Dropless (no capacity) the loads are uneven, so a process first tells each member of
its group how many rows it sends to each of that member's experts (an all-to-all of the
counts, ``[members, local experts]`` int64), then sends the rows (``all_to_allv``:
variable counts per pair), runs its experts on the rows it received and sends the
results back with the counts reversed. With GShard's capacity ``C`` the buffers are of
fixed size, ``[members, local experts, local sequences, C]`` rows, zero where a
sequence gives an expert fewer than ``C`` tokens: the counts need no exchange and the
all-to-alls have equal chunks (the experts run on the zero rows too, as GShard does,
which adds nothing to any result or gradient).

The sender keeps what it needs to combine: the assignments it sent, in global expert
order, and it adds each token's expert outputs in that order, as the serial kernel
does. The forward keeps, in the runtime's per-micro-batch ``ctx.saved``, its exchange
(routes and counts), its experts' received rows and pre-activations and the expert
outputs it got back; the gradient then computes each assignment's weight gradient where
the token is (the kept output dotted with dy), sends ``dy * weight`` rows to the experts
(the counts are known), which run the SwiGLU backward on their kept activations, and
receives the input gradients (``d`` columns each way, no recomputation, as a
hand-written expert-parallel step does). Without ``ctx.saved`` it sends ``[x | dy |
weight]`` rows, the experts recompute their forward, and ``[dx | dweight]`` rows come
back. Each process's experts' weight gradients are whole along ``m`` (no Partial).

``kept_bytes`` prices what the forward keeps at the expected load (the memory model's
``saved`` of the op): per assignment the process sends, its route (row and slot, two
int64) and the output it gets back (``d`` items, views of one buffer); per row it
receives, the row, its two pre-activations (``d + 2 I`` items) and its place (int64);
dropless also the counts (``[members, local experts]`` sent and received, and their sums
per member). A balanced routing receives as many rows as it sends; with a capacity the
fixed buffers, ``E * b * C`` rows, and the assignments within the capacity.

``comm(site)`` declares the all-to-alls at the expected load (a balanced routing: a
process's ``tokens * k`` assignments, or its fixed buffers), as
:func:`distgraph.plan.kinds.collective_bytes` counts an all-to-all's buffer; the dropless
counts and rows as ``all_to_allv`` (:data:`~distgraph.plan.kinds.ALL_TO_ALLV`), whose
software cost ``distgraph cluster calibrate`` measures apart, as the dispatch runs them
(the counts' exchange among its sizes).

Example (what a plan's process runs; ``ctx`` carries the communicator and group)::

    y = forward(ctx, x, ids, weights, gate, up, down, None, expert_start=2, experts=4)
"""

from __future__ import annotations

from distgraph import dtypes
from distgraph.spmd.specs import entry_dims


def shared_dim(site) -> str | None:
    """The mesh dim that splits both the experts (gate's dim 0) and the tokens (x's dim
    0 or 1) at ``site``, or None: expert parallelism with an all-to-all."""
    experts = entry_dims(site.in_attrs[3].spec.entry(0))
    if len(experts) != 1:
        return None
    tokens = entry_dims(site.in_attrs[0].spec.entry(0)) + \
        entry_dims(site.in_attrs[0].spec.entry(1))
    return experts[0] if experts[0] in tokens else None


def localize(attrs, site):
    """The local attributes (first local expert, all experts; for the all-to-all form
    also ``members``, its group's size) and, for the all-to-all form, the kernel's
    ``group``: the processes holding the other expert blocks."""
    experts = site.in_slices(3)[0]
    if experts.stop - experts.start == site.in_shapes[3][0]:
        return attrs, {}
    local = {**attrs, "expert_start": experts.start, "num_experts": site.in_shapes[3][0]}
    if shared_dim(site) is None:
        return local, {}
    group = site.split_group(3, 0)
    return {**local, "members": len(group)}, {"group": group}


def comm(site, grad: bool = False) -> tuple:
    """The all-to-alls of the distributed form at ``site`` at the expected (balanced)
    load: ``((kind, members, buffer bytes), ...)``; empty when it does not dispatch."""
    if shared_dim(site) is None:
        return ()
    n = len(site.split_group(3, 0))
    b, s, d = site.in_attrs[0].local_shape(site.in_shapes[0])
    k = site.in_shapes[1][2]
    experts = site.in_shapes[3][0]
    item = dtypes.itemsize(site.in_dtypes[0])
    capacity = site.attr("capacity")
    # the gradient runs on what its forward kept: the counts are known, d columns each way.
    # The counts' exchange is the variable exchange's first half: priced as it (the
    # software cost calibrate measures where the dispatch runs, its smallest size the
    # counts'), not as a dense reshard's all_to_all run back to back
    if capacity is None:
        rows, kind = b * s * k, "all_to_allv"
        counts = () if grad else (("all_to_allv", n, experts * 8),)
    else:
        rows, kind, counts = experts * b * capacity, "all_to_all", ()
    return counts + ((kind, n, rows * d * item),) * 2


def kept_bytes(attrs, members: int, ins) -> float:
    """Bytes the all-to-all form's forward keeps in ``ctx.saved`` beyond its operands at
    the expected load, on a process of a group of ``members`` with local TensorTypes
    ``ins`` (module docstring)."""
    index = 8                         # int64 routes, places and counts
    b, s, d = ins[0].shape
    k = ins[1].shape[2]
    local, _, inner = ins[3].shape
    experts = attrs.get("num_experts") or local * members
    item = dtypes.itemsize(ins[0].dtype)
    capacity = attrs.get("capacity")
    if capacity is None:
        sent = received = b * s * k
        counts = 2 * members * local * index + 2 * members * index
    else:
        sent = b * min(s * k, experts * capacity)
        received = experts * b * capacity
        counts = members * local * index
    return (sent * (2 * index + d * item) + received * ((d + 2 * inner) * item + index)
            + counts)


class _Exchange:
    """One process's dispatch: the assignments it sends (global expert order), the rows
    of each, and the all-to-alls that carry rows there and back."""

    def __init__(self, ctx, ids, capacity, experts, local, routes):
        self.ctx, self.xp = ctx, ctx.xp
        self.ranks = ctx.group_ranks()
        self.n, self.local, self.capacity = len(self.ranks), local, capacity
        self.batch, self.seq = ids.shape[:2]
        self.routes = routes(self.xp, ids, capacity, 0, experts)
        counts = self.xp.zeros((self.n, local), dtype="int64")
        for e, rows, _ in self.routes:
            counts[e // local, e % local] = rows.size
        self.counts = counts
        if capacity is None:
            self.received = ctx.comm.all_to_all(counts, self.ranks, 0, 0)
            self.sends = counts.sum(axis=1)
            self.recvs = self.received.sum(axis=1)

    def _place(self, rows):
        """Positions of ``rows`` (one expert's) in its fixed buffer: sequence, then the
        assignment's place among that sequence's."""
        xp = self.xp
        seq = rows // self.seq
        place = xp.arange(rows.size) - xp.searchsorted(seq, seq, side="left")
        return seq * self.capacity + place

    def there(self, data, width: int, dtype):
        """Send each assignment's row of ``data(rows, slots)`` ([assignments, width]) to
        its expert's process; the rows received (an array) and, per local expert, the
        indices of its rows in it: [(local expert, indices)]."""
        xp, comm, n, local = self.xp, self.ctx.comm, self.n, self.local
        parts = [data(rows, slots) for _, rows, slots in self.routes]
        if self.capacity is None:
            buf = xp.concatenate(parts) if parts else xp.zeros((0, width), dtype=dtype)
            got = comm.all_to_allv(buf, self.sends, self.recvs, self.ranks)
            starts = xp.concatenate([xp.zeros(1, "int64"),
                                     xp.cumsum(self.received.reshape(-1))])
            groups = [(e, xp.concatenate([xp.arange(starts[q * local + e],
                                                    starts[q * local + e + 1])
                                          for q in range(n)])) for e in range(local)]
            return groups, got
        slab = self.batch * self.capacity
        buf = xp.zeros((n * local * slab, width), dtype=dtype)
        for (e, rows, _), part in zip(self.routes, parts):
            buf[e * slab + self._place(rows)] = part
        got = comm.all_to_all(buf, self.ranks, 0, 0)
        groups = [(e, xp.concatenate([xp.arange((q * local + e) * slab,
                                                (q * local + e + 1) * slab)
                                      for q in range(n)])) for e in range(local)]
        return groups, got

    def back(self, results):
        """Send the results (rows as received) back; [(expert, rows, slots, result
        rows)] in global expert order."""
        comm = self.ctx.comm
        if self.capacity is None:
            got = comm.all_to_allv(results, self.recvs, self.sends, self.ranks)
            out, at = [], 0
            for e, rows, slots in self.routes:
                out.append((e, rows, slots, got[at:at + rows.size]))
                at += rows.size
            return out
        got = comm.all_to_all(results, self.ranks, 0, 0)
        slab = self.batch * self.capacity
        return [(e, rows, slots, got[e * slab + self._place(rows)])
                for e, rows, slots in self.routes]


def forward(ctx, x, ids, weights, gate, up, down, capacity, expert_start, experts, routes):
    """moe_ffn's all-to-all form on this process's tokens and experts. Where the runtime
    gives ``ctx.saved``, what the gradient needs is kept there (:func:`backward`)."""
    xp = ctx.xp
    b, s, d = x.shape
    xf, wf = x.reshape(b * s, d), weights.reshape(b * s, -1)
    ex = _Exchange(ctx, ids, capacity, experts, gate.shape[0], routes)
    groups, got = ex.there(lambda rows, slots: xf[rows], d, x.dtype)
    results = xp.zeros_like(got)
    kept = []
    for e, index in groups:
        if index.size:
            xs = got[index]
            g, u = xs @ gate[e], xs @ up[e]
            half = g.dtype.type(0.5)
            results[index] = ((g * (half + half * xp.tanh(half * g))) * u) @ down[e]
            kept.append((e, index, xs, g, u))
    y = xp.zeros_like(xf)
    outs = ex.back(results)
    for _, rows, slots, out in outs:
        y[rows] += out * wf[rows, slots][:, None]
    if ctx.saved is not None:
        ctx.saved["moe_dispatch"] = _Kept(x, ids, weights, gate, up, down, ex, kept, outs)
    return y.reshape(x.shape)


class _Kept:
    """What moe_ffn's forward keeps for its gradient on this process: its operands (the
    gradient uses the kept rest only for these very arrays), the exchange (routes and
    counts), its experts' received rows and pre-activations, and the expert outputs it
    got back per assignment."""

    def __init__(self, *args):
        (self.x, self.ids, self.weights, self.gate, self.up, self.down, self.ex, self.kept,
         self.outs) = args

    def serves(self, *operands) -> bool:
        return all(a is b for a, b in zip(operands, (self.x, self.ids, self.weights,
                                                     self.gate, self.up, self.down)))


def backward(ctx, x, ids, weights, gate, up, down, dy, capacity, expert_start, experts,
             routes):
    """moe_ffn_grad's all-to-all form: (dx, dweights, dgate, dup, ddown). With what its
    forward kept (``ctx.saved``): each assignment's weight gradient is the expert output
    it got back dotted with dy, computed where the token is; ``dy * weight`` rows go to
    the experts, which run the SwiGLU backward on their kept activations, and the input
    gradients come back (``d`` columns each way). Without: ``[x | dy | weight]`` rows go,
    the experts recompute their forward, and ``[dx | dweight]`` rows come back."""
    kept = ctx.saved.pop("moe_dispatch", None) if ctx.saved is not None else None
    if kept is not None and kept.serves(x, ids, weights, gate, up, down):
        return _backward_kept(ctx, kept, dy)
    xp = ctx.xp
    b, s, d = x.shape
    xf, wf, dyf = x.reshape(b * s, d), weights.reshape(b * s, -1), dy.reshape(b * s, d)
    ex = _Exchange(ctx, ids, capacity, experts, gate.shape[0], routes)
    groups, got = ex.there(lambda rows, slots: xp.concatenate(
        [xf[rows], dyf[rows], wf[rows, slots][:, None]], axis=1), 2 * d + 1, x.dtype)
    grads = [xp.zeros_like(w) for w in (gate, up, down)]
    results = xp.zeros((got.shape[0], d + 1), dtype=x.dtype)
    for e, index in groups:
        if not index.size:
            continue
        xs, dys, ws = got[index, :d], got[index, d:2 * d], got[index, 2 * d]
        g, u = xs @ gate[e], xs @ up[e]
        h, dxs = _swiglu_backward(xp, xs, g, u, dys * ws[:, None], gate[e], up[e], down[e],
                                  grads, e)
        results[index, d] = xp.sum((h @ down[e]) * dys, axis=-1)
        results[index, :d] = dxs
    dx, dw = xp.zeros_like(xf), xp.zeros_like(wf)
    for _, rows, slots, out in ex.back(results):
        dx[rows] += out[:, :d]
        dw[rows, slots] = out[:, d]
    return (dx.reshape(x.shape), dw.reshape(weights.shape), *grads)


def _backward_kept(ctx, kept, dy):
    xp, x, weights = ctx.xp, kept.x, kept.weights
    b, s, d = x.shape
    wf, dyf = weights.reshape(b * s, -1), dy.reshape(b * s, d)
    dw = xp.zeros_like(wf)
    for _, rows, slots, out in kept.outs:
        dw[rows, slots] = xp.sum(out * dyf[rows], axis=-1)
    _, got = kept.ex.there(lambda rows, slots: dyf[rows] * wf[rows, slots][:, None], d,
                           x.dtype)
    grads = [xp.zeros_like(w) for w in (kept.gate, kept.up, kept.down)]
    results = xp.zeros_like(got)
    for e, index, xs, g, u in kept.kept:
        _, results[index] = _swiglu_backward(xp, xs, g, u, got[index], kept.gate[e],
                                             kept.up[e], kept.down[e], grads, e)
    dx = xp.zeros((b * s, d), dtype=x.dtype)
    for _, rows, slots, out in kept.ex.back(results):
        dx[rows] += out
    return (dx.reshape(x.shape), dw.reshape(weights.shape), *grads)


def _swiglu_backward(xp, xs, g, u, do, gate, up, down, grads, e):
    """One expert's SwiGLU backward from its pre-activations ``g``, ``u`` and the
    gradient ``do`` of its weighted output: fills ``grads[.][e]``; (h, dxs)."""
    half = g.dtype.type(0.5)
    sig = half + half * xp.tanh(half * g)
    act = g * sig
    h = act * u
    grads[2][e] = h.T @ do
    dh = do @ down.T
    du = dh * act
    dg = dh * u * sig * (1 + g * (1 - sig))
    grads[0][e], grads[1][e] = xs.T @ dg, xs.T @ du
    return h, dg @ gate.T + du @ up.T
