"""Layer construction for the stage search (Alpa, OSDI'22 §5 "operator clustering"; the
Alpa walk-through's "layer construction"): the forward ops, in program order, cut into ``L``
consecutive layers, and every other op given the layer it belongs with.

**The cut** (Alpa's DP): ``G(k, r)``, the least possible largest amount of data one
layer receives from the layers before it when ops ``0..k`` form ``r`` layers::

    G(k, r) = min over i <= k of max(G(i - 1, r - 1), C(i, k))

where ``C(i, k)`` is the bytes of the Values ops ``i..k`` read that ops before ``i``
made (activations crossing into the layer; parameters and feeds are not received).
Every layer's FLOPs stay within ``(1 + delta)`` times the average (``delta`` 0.25), and
among cuts of equal traffic the most even one (least sum of squared layer FLOPs) wins.
``L`` is the largest count up to ``max_layers`` for which such a cut exists.

**The other ops**: a backward op belongs with the forward op it differentiates; one
without (a gradient sum, the loss's unit gradient) with the earliest layer among the
producers of its operands (the last layer when it has none); an update with the layer
of its parameter's first consumer. Updates without a parameter (the learning-rate read,
the step counter) belong to every stage: they get no layer (None) and completion puts
them on the union of the stages.

Example::

    layering = cluster_layers(program, max_layers=4)
    layering.count, layering.layer_of[12]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from distgraph.errors import PlanError
from distgraph.ir import Role
from distgraph.registry import op_flops

FORWARD = (Role.FORWARD, Role.LOSS)


@dataclass(frozen=True)
class Layering:
    """``count`` layers; ``layer_of[k]``: the layer of op k (None: of every stage);
    ``flops[l]``: the forward FLOPs of layer l; ``received[l]``: bytes it receives;
    ``blocks``: the layers that are identical blocks (:func:`block_layers`), else
    None."""

    count: int
    layer_of: tuple
    flops: tuple
    received: tuple
    blocks: range | None = None

    def ops(self, layers: range) -> list:
        """Indices of the ops of ``layers`` (in program order)."""
        return [k for k, layer in enumerate(self.layer_of)
                if layer is not None and layer in layers]

    def __str__(self) -> str:
        total = sum(self.flops) or 1.0
        if self.blocks is not None:
            ends = [f"{self.flops[k] / total:.1%}" for k in range(self.count)
                    if k not in self.blocks]
            return (f"{self.count} layers: {len(self.blocks)} identical blocks of "
                    f"{self.flops[self.blocks.start] / total:.1%} of the FLOPs each"
                    + (f", and {' and '.join(ends)} before / after them" if ends else ""))
        parts = [f"{f / total:.0%}" for f in self.flops]
        return f"{self.count} layers (FLOP shares {', '.join(parts)})"


def cluster_layers(program, max_layers: int, delta: float = 0.25) -> Layering:
    """Cut ``program``'s forward ops into at most ``max_layers`` layers (module docstring)."""
    forward = [k for k, op in enumerate(program.ops) if op.role in FORWARD]
    if not forward:
        raise PlanError("the stage search cuts the forward ops into layers, but the program "
                        "has none")
    flops = np.array([op_flops(program.ops[k]) for k in forward], dtype=float)
    received = _received(program, forward)
    cut = None
    for count in range(min(max_layers, len(forward)), 0, -1):
        cut = _cut(flops, received, count, delta)
        if cut is not None:
            break
    layer_of = [None] * len(program.ops)
    for layer, (a, b) in enumerate(cut):
        for pos in range(a, b + 1):
            layer_of[forward[pos]] = layer
    _assign_rest(program, layer_of, len(cut))
    return Layering(len(cut), tuple(layer_of),
                    tuple(float(flops[a:b + 1].sum()) for a, b in cut),
                    tuple(float(received[a, b]) for a, b in cut))


def block_layers(program, paths) -> Layering | None:
    """The layers of a model of repeated blocks (``paths``: the TransformerBlocks' layer
    paths): each block one layer, the forward ops before the first block one layer (the
    embedding) and those after the last one (the head and the loss); every other op
    with its layer as in :func:`cluster_layers`. None unless there are at least four
    blocks, each a contiguous run of forward ops, the interior ones identical op by op
    (types, roles, shapes, attributes) once their backward and update ops are placed."""
    if len(paths) < 4:
        return None
    forward = [k for k, op in enumerate(program.ops) if op.role in FORWARD]
    block_of = [_block_of(program.ops[k].layer, paths) for k in forward]
    firsts = [block_of.index(b) if b in block_of else -1 for b in range(len(paths))]
    lasts = [len(block_of) - 1 - block_of[::-1].index(b) if b in block_of else -1
             for b in range(len(paths))]
    if -1 in firsts:
        return None
    expected = [b for b in range(len(paths)) for _ in range(lasts[b] - firsts[b] + 1)]
    if block_of[firsts[0]:lasts[-1] + 1] != expected:
        return None
    head, tail = firsts[0] > 0, lasts[-1] < len(forward) - 1
    count = len(paths) + head + tail
    layer_of = [None] * len(program.ops)
    for pos, k in enumerate(forward):
        b = block_of[pos]
        layer_of[k] = 0 if pos < firsts[0] else count - 1 if pos > lasts[-1] else b + head
    _assign_rest(program, layer_of, count)
    blocks = range(head, head + len(paths))
    # the interior blocks must be identical; the first and the last may differ in a few
    # light ops (where the sums of their input's and output's gradients fall)
    members = ops_by_layer(layer_of)
    if len({_signature(program, members.get(layer, ())) for layer in blocks[1:-1]}) != 1:
        return None
    flops, received = [0.0] * count, [0.0] * count
    made_in = {}
    for k in forward:
        op, layer = program.ops[k], layer_of[k]
        flops[layer] += op_flops(op)
        for v in {v.name: v for v in op.inputs}.values():
            if made_in.get(v.name, layer) < layer:
                received[layer] += program.values[v.name].nbytes
        for o in op.outputs:
            made_in[o.name] = layer
    return Layering(count, tuple(layer_of), tuple(flops), tuple(received), blocks)


def _block_of(layer: str, paths) -> int | None:
    for b, path in enumerate(paths):
        if layer == path or layer.startswith(path + "."):
            return b
    return None


def _signature(program, ops) -> tuple:
    # A random op's seed changes its numbers, not its shapes, layouts or cost: blocks
    # that differ only in their dropout seeds are identical here.
    return tuple((op.type, op.role, tuple(v.shape for v in op.inputs),
                  tuple(o.shape for o in op.outputs),
                  repr(sorted((a, x) for a, x in op.attrs.items() if a != "seed")))
                 for op in (program.ops[k] for k in ops))


def ops_by_layer(layer_of) -> dict:
    """{layer: the indices of its ops, in program order} (``layer_of[k]``: op k's)."""
    out: dict = {}
    for k, layer in enumerate(layer_of):
        out.setdefault(layer, []).append(k)
    return out


def _received(program, forward) -> np.ndarray:
    """C[i, k] (positions in ``forward``): bytes ops i..k read that ops before i made."""
    n = len(forward)
    made_at, readers = {}, {}
    for p, k in enumerate(forward):
        op = program.ops[k]
        for v in op.inputs:
            readers.setdefault(v.name, []).append(p)
        for o in op.outputs:
            made_at[o.name] = p
    C = np.zeros((n, n))
    for name, ps in readers.items():
        if name not in made_at:
            continue                    # parameters, feeds, states: not received
        made, nbytes = made_at[name], program.values[name].nbytes
        ps = sorted(set(ps))
        for i in range(made + 1, ps[-1] + 1):
            first = next(p for p in ps if p >= i)     # the layer starting at i reads it from here on
            C[i, first:] += nbytes
    return C


def _cut(flops, received, count, delta):
    """The cut of ``count`` layers (list of (first, last) positions), or None. Two exact
    DPs: the least largest traffic ``T``, then the most even cut whose every layer
    receives at most ``T`` (one DP on both at once would not be exact)."""
    n = len(flops)
    limit = (1 + delta) * flops.sum() / count * (1 + 1e-12)
    prefix = np.concatenate([[0.0], np.cumsum(flops)])
    least = _dp(n, count, lambda i, k: prefix[k] - prefix[i] <= limit,
                lambda prev, i, k: max(prev, received[i, k - 1]))
    if least is None:
        return None
    top = least[0]
    even = _dp(n, count, lambda i, k: prefix[k] - prefix[i] <= limit
               and received[i, k - 1] <= top,
               lambda prev, i, k: prev + (prefix[k] - prefix[i]) ** 2)
    return even[1]


def _dp(n, count, allowed, extend):
    """min over cuts of ops 0..n-1 into ``count`` layers of the value ``extend`` builds
    layer by layer (from 0), over the layers (i..k-1) ``allowed`` admits: (value, cut)
    or None."""
    G = np.full((n + 1, count + 1), np.inf)
    back = np.full((n + 1, count + 1), -1, dtype=np.intp)
    G[0, 0] = 0.0
    for k in range(1, n + 1):
        for r in range(1, min(k, count) + 1):
            for i in range(r - 1, k):             # the last layer is ops i..k-1
                if np.isinf(G[i, r - 1]) or not allowed(i, k):
                    continue
                value = extend(G[i, r - 1], i, k)
                if value < G[k, r]:
                    G[k, r], back[k, r] = value, i
    if np.isinf(G[n, count]):
        return None
    cut, k = [], n
    for r in range(count, 0, -1):
        i = int(back[k, r])
        cut.append((i, k - 1))
        k = i
    return float(G[n, count]), cut[::-1]


def _assign_rest(program, layer_of, count) -> None:
    ops = program.ops
    index = {id(op): k for k, op in enumerate(ops)}
    producer = {o.name: k for k, op in enumerate(ops) for o in op.outputs}
    first_use: dict = {}
    for k, op in enumerate(ops):
        for v in op.inputs:
            first_use.setdefault(v.name, k)
    for k, op in enumerate(ops):
        if op.role == Role.BACKWARD:
            if op.forward_op is not None and layer_of[index[id(op.forward_op)]] is not None:
                layer_of[k] = layer_of[index[id(op.forward_op)]]
            else:
                known = [layer_of[producer[v.name]] for v in op.inputs if v.name in producer
                         and layer_of[producer[v.name]] is not None]
                layer_of[k] = min(known) if known else count - 1
    for k, op in enumerate(ops):
        if op.role == Role.OPTIMIZE and op.inputs and op.inputs[0].is_parameter:
            first = first_use.get(op.inputs[0].name)
            layer_of[k] = layer_of[first] if first is not None else None


def op_keys(program, layer_of, layer, path, ops=None) -> dict:
    """{key: op index} of layer ``layer``'s ops: ``("forward", n)``, ``("backward",
    forward key, m)`` (the m-th op made for that forward op: its recomputed copy, its
    gradients), ``("update", parameter path below the block)``, ``("other", n)``.
    ``ops``: the layer's op indices in program order, where known (:func:`ops_by_layer`)."""
    keys: dict = {}
    forward: dict = {}
    count: dict = {}
    if ops is None:
        ops = [k for k in range(len(program.ops)) if layer_of[k] == layer]
    for k in ops:
        op = program.ops[k]
        if op.role in FORWARD:
            key = ("forward", len(forward))
            forward[id(op)] = key
        elif op.role == Role.BACKWARD and op.forward_op is not None \
                and id(op.forward_op) in forward:
            f = forward[id(op.forward_op)]
            count[f] = count.get(f, 0) + 1
            key = ("backward", f, count[f] - 1)
        elif op.role == Role.OPTIMIZE and op.inputs and op.inputs[0].is_parameter and \
                op.inputs[0].name.startswith(path + "."):
            key = ("update", op.inputs[0].name[len(path) + 1:])
        else:
            count["other"] = count.get("other", 0) + 1
            key = ("other", count["other"] - 1)
        keys[key] = k
    return keys


def same_op(a, b) -> bool:
    """Whether ops ``a`` and ``b`` do the same thing on the same shapes."""
    return (a.type, a.role, [v.shape for v in a.inputs], [o.shape for o in a.outputs]) == \
        (b.type, b.role, [v.shape for v in b.inputs], [o.shape for o in b.outputs])
