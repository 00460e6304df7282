"""Recomputation (activation checkpointing) as a program transform.

For each segment (a layer path: every forward op whose ``layer`` is the path or below
it), the activations the segment makes for its own backward are not kept: the forward
ops that make them are copied, in order, just before the first backward op that reads
one, and every backward op reads the copies instead. The originals then die at their
last forward use (the executor frees each value after its last reader), so between the
forward and the backward a segment keeps only what leaves it (its outputs, read by the
next layer) and what enters it (its inputs, read again by the copies). An op that keeps
state for its gradient beyond its results (an op's ``saved`` hook: moe_ffn's routes and
expert activations) is copied as well, though no backward op reads its results: its
copy runs on the operands its gradient reads and keeps for it, as without recomputation.

The copies are ordinary ops with role ``backward`` and ``forward_op`` set to the op they
copy, so completion gives them the same mesh and layouts, partition the same local
form, and a random op the same numbers: dropout draws its mask from (seed, step), both
the same for the copy. Results equal the plain program's bit for bit.

Example::

    n = recompute(program, ["blocks.0", "blocks.1"])   # before completion
    peak_activation_bytes(program)                     # lower than before
"""

from __future__ import annotations

import dataclasses

from distgraph.errors import PlanError
from distgraph.ir import RECOMPUTED, Operation, Program, Role, Value
from distgraph.registry import get_op

SUFFIX = RECOMPUTED            # what the copies' Values are named with (Value + SUFFIX)
# the ops an attention core's probabilities come from: softmax, or Megatron's fused
# scale-mask-softmax kernel (distgraph.ops.scaled_masked_softmax)
SOFTMAX = ("softmax", "scaled_masked_softmax")


def _inside(layer: str, path: str) -> bool:
    return layer == path or layer.startswith(path + ".")


def segments(built, option) -> list:
    """Layer paths that ``Strategy.recompute`` names: every TransformerBlock of the
    model for True, else the given paths (each must be a layer that emitted ops)."""
    if option is True:
        if not built.block_paths:
            raise PlanError("Strategy(recompute=True) recomputes each TransformerBlock, but "
                            "the model has none; give the layer paths to recompute, e.g. "
                            "Strategy(recompute=['encoder.0', 'encoder.1'])")
        return list(built.block_paths)
    layers = {op.layer for op in built.program.ops if op.role is Role.FORWARD}
    for path in option:
        if not any(_inside(layer, path) for layer in layers):
            known = sorted({layer.rsplit(".", 1)[0] for layer in layers if layer})[:12]
            raise PlanError(f"Strategy(recompute=[..., {path!r}, ...]): no forward op of the "
                            f"model comes from layer {path!r}; layers with ops include "
                            f"{known}")
    return list(option)


def recompute(program: Program, paths, held=frozenset()) -> int:
    """Rewrite ``program`` (forward, backward and update ops, not yet completed) so the
    activations of each layer path are recomputed in the backward; returns how many ops
    were copied (:func:`recompute_ops` on each path's forward ops; ``held``: as there)."""
    by_layer: dict = {}                 # forward ops per layer path, in program order
    for i, op in enumerate(program.ops):
        if op.role is Role.FORWARD:
            by_layer.setdefault(op.layer, []).append(i)
    return recompute_ops(program, [sorted(i for layer, found in by_layer.items()
                                          if _inside(layer, path) for i in found)
                                   for path in paths], held)


def _readers(ops) -> tuple:
    """({Value name: indices of the forward and loss ops reading it}, {...: of the
    backward ops})."""
    forward_readers: dict = {}
    backward_readers: dict = {}
    for i, op in enumerate(ops):
        readers = backward_readers if op.role is Role.BACKWARD else \
            forward_readers if op.role in (Role.FORWARD, Role.LOSS) else None
        if readers is not None:
            for v in op.inputs:
                readers.setdefault(v.name, []).append(i)
    return forward_readers, backward_readers


def attention_cores(program: Program, blocks) -> list:
    """The segments of selective recomputation (Korthikanti et al. 2022, "Reducing
    Activation Recomputation in Large Transformer Models", section 4.2): in each block
    of ``blocks`` (layer paths), each attention's core, the forward ops from the matmul of
    queries and keys through the softmax (and its scaling, mask and dropout; or the one
    fused kernel of the three, ``scaled_masked_softmax``) to the matmul of the
    probabilities with the values, and the op making the causal mask only it
    reads: what keeps the 5 a s^2 b bytes of attention scores per layer (and the mask's
    s^2). Its inputs (q, k, v) and its output stay kept, so a
    layer keeps 34 s b h bytes (16-bit) where it kept 34 s b h + 5 a s^2 b. A list of
    forward op indices per core; PlanError where the blocks have none (a fused
    attention op keeps no scores)."""
    ops = program.ops
    forward_readers, _ = _readers(ops)
    maker = {o.name: i for i, op in enumerate(ops) if op.role is Role.FORWARD
             for o in op.outputs}
    cores = []
    for i, op in enumerate(ops):
        if op.type not in SOFTMAX or op.role is not Role.FORWARD or \
                not any(_inside(op.layer, b) for b in blocks):
            continue
        score = op.inputs[0].shape
        seg, v = [i], op.inputs[0]          # up to the matmul making the scores
        while v is not None and v.name in maker:
            k = maker[v.name]
            seg.append(k)
            v = None if ops[k].type == "matmul" else next(
                (x for x in ops[k].inputs if x.shape == score), None)
        if ops[seg[-1]].type != "matmul":
            continue
        v = op.outputs[0]                   # down to the matmul reading the probabilities
        while True:
            readers = forward_readers.get(v.name, [])
            if len(readers) != 1:
                break
            k = readers[0]
            seg.append(k)
            if ops[k].type == "matmul":
                cores.append(sorted(seg + _made_for(ops, seg, maker, forward_readers)))
                break
            v = ops[k].outputs[0]
    if not cores:
        raise PlanError("Strategy(recompute='selective') recomputes each attention's scores "
                        "(the ops from q k^T through softmax and dropout to the product with "
                        "v), but the model's blocks compute none (a fused attention op keeps "
                        "no scores); use recompute=True or a list of layer paths")
    return cores


def scores_of(program: Program, paths) -> list:
    """:func:`attention_cores` of the layers ``paths`` (``Strategy(recompute=[(path,
    "selective"), ...])``), each of which must hold one: a PlanError names a path whose
    forward has no attention scores (a layer that is not a block, a fused attention)."""
    try:
        cores = attention_cores(program, paths)
    except PlanError:               # none of the paths holds scores: named below
        cores = []
    ops = program.ops
    held = {p for p in paths for core in cores if any(_inside(ops[i].layer, p) for i in core)}
    missing = [p for p in paths if p not in held]
    if missing:
        raise PlanError(f"Strategy(recompute=[..., ({missing[0]!r}, 'selective'), ...]): layer "
                        f"{missing[0]!r} computes no attention scores to recompute (no "
                        f"softmax between two matmuls below it); name a block, or recompute "
                        f"the layer whole ({missing[0]!r} alone)")
    return cores


def _made_for(ops, seg, maker, forward_readers) -> list:
    """The ops of no operands (the causal mask) that make a Value only ``seg`` reads:
    recomputed with it rather than kept for it (s^2 bytes per layer)."""
    inside = set(seg)
    return sorted({maker[v.name] for i in seg for v in ops[i].inputs
                   if v.name in maker and not ops[maker[v.name]].inputs
                   and set(forward_readers[v.name]) <= inside} - inside)


def recompute_ops(program: Program, segs, held=frozenset()) -> int:
    """Rewrite ``program`` so the activations each segment of ``segs`` (lists of forward
    op indices) makes for its own backward are recomputed there; returns how many ops
    were copied. ``held``: Values the step holds whatever is recomputed (those a micro-
    batched step makes once, :func:`~distgraph.plan.accumulation.made_once`): read, not
    recomputed. The segments are independent (a copy reads only its own segment's
    copies and what enters the segment), so every one is planned on the program as
    given and all are applied in one pass."""
    ops = program.ops
    forward_readers, backward_readers = _readers(ops)
    outputs = {v.name for v in program.outputs} | set(held)
    inserts: dict = {}
    renames: dict = {}
    for seg in segs:
        planned = _plan_segment(program, seg, forward_readers, backward_readers, outputs)
        if planned is None:
            continue
        first, clones, needed, copies = planned
        inserts.setdefault(first, []).extend(clones)
        for name in needed:
            for i in backward_readers[name]:
                if i >= first:
                    renames.setdefault(i, {})[name] = copies[name]
    for i, mapping in renames.items():
        ops[i].inputs = [mapping.get(v.name, v) for v in ops[i].inputs]
    rewritten = []
    for i, op in enumerate(ops):
        rewritten += inserts.get(i, [])
        rewritten.append(op)
    program.ops = rewritten
    return sum(len(c) for c in inserts.values())


def _plan_segment(program, seg, forward_readers, backward_readers, outputs):
    """(index of the first backward op that reads the segment, the copies to put before
    it, the Values whose readers from there on read copies, {name: copy}), or None."""
    if not seg:
        return None
    ops = program.ops
    members = set(seg)
    produced = {o.name for i in seg for o in ops[i].outputs}
    # What leaves the segment in the forward is live anyway: read it, do not recompute it.
    leaving = {n for n in produced if any(i not in members for i in forward_readers.get(n, ()))}
    leaving |= produced & outputs
    needed = {n for n in produced if n in backward_readers and n not in leaving}
    if not needed:
        return None
    # The segment's ops that make the needed values, and the segment values they read;
    # and an op that keeps state for its gradient beyond its results (moe_ffn): copied
    # too, so that its copy runs on the operands the gradient reads and keeps for it
    # (the original keeps nothing: its state could not serve the gradient).
    wanted, todo = set(), set(needed)
    keeping = {i for i in seg if get_op(ops[i].type).saved is not None}
    for i in reversed(seg):
        if i in keeping or any(o.name in todo for o in ops[i].outputs):
            wanted.add(i)
            todo |= {v.name for v in ops[i].inputs if v.name in produced and v.name not in leaving}
    first = min(i for n in needed for i in backward_readers[n])
    copies: dict = {}
    clones = []
    for i in sorted(wanted):
        op = ops[i]
        outs = [program.add_value(Value(o.name + SUFFIX, o.shape, o.dtype, role=Role.BACKWARD,
                                        annotation=o.annotation)) for o in op.outputs]
        clones.append(Operation(op.type, [copies.get(v.name, v) for v in op.inputs], outs,
                                dict(op.attrs), "backward", op.layer, op,
                                _renamed(op.annotation, copies)))
        copies.update({o.name: c for o, c in zip(op.outputs, outs)})
    return first, clones, needed, copies


def _renamed(annotation, copies):
    """A shard_op annotation whose operand names follow the copies."""
    if annotation is None or not getattr(annotation, "in_specs", None):
        return annotation
    specs = tuple((copies[n].name if n in copies else n, s) for n, s in annotation.in_specs)
    return dataclasses.replace(annotation, in_specs=specs)


def peak_activation_bytes(program: Program) -> int:
    """The most bytes of values that are neither fed nor persistable alive at once while
    ``program`` runs, each freed after its last reader as the executor does: the
    activations, gradients and temporaries of one step."""
    skip = {v.name for v in program.inputs} | {v.name for v in program.persistables}
    keep = {v.name for v in program.outputs}
    last: dict = {}
    for i, op in enumerate(program.ops):
        for v in op.inputs + op.outputs:
            last[v.name] = i
    live, peak, total = {}, 0, 0
    for i, op in enumerate(program.ops):
        for o in op.outputs:
            if o.name not in skip and o.alias_of is None and o.name not in live:
                live[o.name] = o.nbytes
                total += o.nbytes
        peak = max(peak, total)
        for name in [n for n in live if last[n] <= i and n not in keep]:
            total -= live.pop(name)
    return peak
