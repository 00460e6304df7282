"""Sequence parallelism (Megatron-SP, Korthikanti et al. 2022), expressed only as
annotations on a completed program.

With tensor parallelism over a mesh dim ``t`` (the dims that split parameters), the
light ops between the tensor-parallel regions (norms, residual adds, dropout) run whole
on every process of ``t``. Here the activations of those regions are annotated split over
``t`` along their sequence dim (dim 1 of a ``[batch, seq, hidden]`` activation), keeping
their other entries. Completing again then yields, with no special code path: an
all-gather where a region enters a column-split matmul, a reduce-scatter (P -> S) where a
row-split matmul's pending sum leaves it, and the light ops and their saved activations
split t ways; the backward mirrors it (gradients reduce-scattered, activations gathered
again where a weight gradient reads them).

The regions are found from the completed layout, for any model:

- a *seed* is a forward activation whole over ``t`` that an op reading a parameter split
  over ``t`` consumes (a tensor-parallel region's input), or that an op reading a pending
  sum over ``t`` makes (a region's output after its reduction);
- a region grows from its seeds through *light* ops (no letter contracted between two
  operands: elementwise ops, norms, dropout) over activations of the same
  ``[batch, seq]`` whose sequence dim is not split over ``t`` and whose blocks divide
  over ``t``;
- an activation of a region that an op outside tensor parallelism makes or reads (the
  embedding, an LM head whose weight is whole) is *fenced*: annotated with its layout as
  it is, so the sequence split stops there (an all-gather or a local slice at the edge);
- the heavy ops (matmuls) reading a region's activation, or its recomputed copy,
  consume it whole over the sequence (pinned as a ``shard_op`` in_spec would): the
  all-gather into a column-split matmul, forward and for the weight gradient;
- an activation a later pipeline stage reads stays out of every region, unannotated:
  an annotation would pin the next stage's first ops (its norm, its residual add) to
  this stage's mesh, a cycle between the stages; the transfer between the stages sends
  tiles from every process and gathers them in the next stage (reshard's local
  all-gather), as Megatron's scatter-gather of the pipeline's messages does.

With context parallelism the sequence is already split over another mesh dim (``cp``);
the region's activations are then split over ``(cp, t)``, cp major: each cp block of
the sequence (the load-balanced chunks attention expects) cut again ``t`` ways, so the
collectives at the regions' edges run over ``t`` only and attention's stay inside it.

Example::

    complete(prog); sequence_parallel(prog); complete(prog)
"""

from __future__ import annotations

from collections import deque

import numpy as np

from distgraph import dtypes
from distgraph.annotation import OpAnnotation
from distgraph.ir import RECOMPUTED, Program, Role
from distgraph.placement import DistAttr, ShardSpec
from distgraph.registry import spmd_rule
from distgraph.spmd import EinsumPlan

SEQ = 1          # the sequence dim of a [batch, seq, hidden] activation


def tensor_parallel_dims(program: Program) -> dict:
    """{mesh: mesh dims of size > 1 that split a parameter a forward op reads}."""
    found: dict = {}
    for op in program.ops:
        if op.role is not Role.FORWARD:
            continue
        mesh = op.dist_attr.mesh
        for v in op.inputs:
            if v.is_parameter and v.dist_attr.mesh == mesh:
                for m in v.dist_attr.spec.mesh_dims():
                    if mesh.dim_size(m) > 1:
                        found.setdefault(mesh, set()).add(m)
    return found


def sequence_parallel(program: Program, searched: bool = False) -> int:
    """Annotate the sequence-parallel regions of a completed program (module docstring);
    returns how many activations were split. Complete the program again afterwards.

    ``searched``: the program's layouts are the automatic search's, written as
    annotations on every op and activation (``auto_mode="full"``), not a user's
    constraints: its activations may join a region, and the pins that would hold the
    region whole are released (:func:`_released`) so that completion lays out the light
    ops, and the gradients flowing back through them, as it does for a user's plan."""
    producer = {o.name: op for op in program.ops for o in op.outputs}
    consumers: dict = {}
    for op in program.ops:
        for v in op.inputs:
            consumers.setdefault(v.name, []).append(op)
    split = 0
    for mesh, dims in sorted(tensor_parallel_dims(program).items(), key=lambda kv: str(kv[0])):
        for m in sorted(dims):
            region, fenced = _region(program, mesh, m, producer, consumers, searched)
            whole = {}                      # name -> its layout before the split
            for v in region - fenced:
                whole[v.name] = whole[v.name + RECOMPUTED] = v.dist_attr.spec
                dims_ = list(v.dist_attr.spec.dims)
                dims_[SEQ] = v.dist_attr.spec.entry(SEQ) + (m,)
                v.annotation = DistAttr(mesh, ShardSpec(dims_))
                split += 1
            for v in fenced:
                v.annotation = v.annotation or v.dist_attr
            if searched:
                _released(program, {v.name for v in region - fenced})
            _gather_into_heavy_ops(program, mesh, whole)
    return split


def gather_into_matmuls(program: Program) -> int:
    """Pin, as :func:`sequence_parallel` does for its own regions, the heavy ops reading
    an activation whose annotation splits its sequence over a tensor-parallel mesh dim
    (a sequence-parallel style of ``dg.parallelize``): they consume it whole over that
    dim. Returns how many ops were pinned; complete the program again afterwards."""
    pinned = 0
    for mesh, dims in sorted(tensor_parallel_dims(program).items(), key=lambda kv: str(kv[0])):
        whole = {}
        for v in program.values.values():
            ann = v.annotation
            if ann is None or ann.mesh != mesh or len(v.shape) != 3:
                continue
            entry = ann.spec.entry(SEQ)
            kept = tuple(d for d in entry if d not in dims)
            if kept != entry:
                spec = list(ann.spec.dims)
                spec[SEQ] = kept if len(kept) > 1 else (kept[0] if kept else None)
                whole[v.name] = whole[v.name + RECOMPUTED] = ShardSpec(spec)
        pinned += _gather_into_heavy_ops(program, mesh, whole)
    return pinned


def _gather_into_heavy_ops(program: Program, mesh, whole: dict) -> int:
    """Pin how the heavy ops (matmuls) on ``mesh`` consume a split activation, or its
    recomputed copy: whole over the sequence, as before the split, so the activation is
    all-gathered into them, forward and backward (Megatron-SP gathers it again for the
    weight gradient). Left to completion's tie-break, the operand met first claims the
    tensor-parallel dim for its sequence letter: the weight was all-gathered instead
    (h x 3h elements for b x s x h), or the weight gradient made whole over the sequence
    split and reduce-scattered, a weight's bytes per micro-batch. Returns how many ops
    were pinned."""
    pinned = 0
    for op in program.ops:
        if op.annotation is not None or op.dist_attr is None or op.dist_attr.mesh != mesh:
            continue
        pins = tuple((v.name, whole[v.name]) for v in op.inputs if v.name in whole)
        if pins and not _light(op):
            op.annotation = OpAnnotation(mesh, pins)
            pinned += 1
    return pinned


def _region(program, mesh, m, producer, consumers, searched=False) -> tuple:
    """(activations to split over m, those of them fenced) on ``mesh``; ``searched``: an
    activation the search annotated may join (:func:`sequence_parallel`)."""
    size = mesh.dim_size(m)

    def forward(op):
        return op is not None and op.role is Role.FORWARD and op.dist_attr.mesh == mesh

    def tensor_parallel(op):         # reads a parameter split over m, or a pending sum
        return any(m in v.dist_attr.spec.mesh_dims() for v in op.inputs
                   if v.is_parameter or m in v.dist_attr.spec.partial)

    def eligible(v, rows):
        spec = v.dist_attr.spec
        return (forward(producer.get(v.name)) and (searched or v.annotation is None)
                and len(v.shape) == 3
                and dtypes.is_float(v.dtype) and tuple(v.shape[:2]) == rows
                and m not in spec.mesh_dims() and v.shape[SEQ] % (parts(spec) * size) == 0
                and not leaves(v))

    def leaves(v):                   # read by a forward op of another (pipeline) stage
        return any(c.role is Role.FORWARD and c.dist_attr.mesh != mesh
                   for c in consumers.get(v.name, ()))

    def parts(spec):                 # the sequence's split so far (context parallelism)
        return int(np.prod([mesh.dim_size(d) for d in spec.entry(SEQ)], dtype=np.int64))

    seeds = []
    for op in program.ops:
        if not forward(op) or not tensor_parallel(op):
            continue
        reads_sum = any(m in v.dist_attr.spec.partial for v in op.inputs)
        seeds += [v for v in op.inputs if not v.is_parameter and len(v.shape) == 3]
        if reads_sum:
            seeds += list(op.outputs)
    region, fenced = set(), set()
    if not seeds:
        return region, fenced
    rows = tuple(seeds[0].shape[:2])
    todo = deque(v for v in seeds if eligible(v, rows))
    while todo:
        v = todo.popleft()
        if v in region:
            continue
        region.add(v)
        near = []
        p = producer[v.name]
        if _light(p):
            near += p.inputs
        elif not tensor_parallel(p):
            fenced.add(v)
        for c in consumers.get(v.name, ()):
            if not forward(c):
                continue
            if _light(c):
                near += c.outputs + c.inputs
            elif not tensor_parallel(c):
                fenced.add(v)
        todo.extend(u for u in near if u not in region and eligible(u, rows))
    return region, fenced


def _released(program: Program, split: set) -> None:
    """Release the search's pins around the activations ``split`` (names) now annotated
    split over the sequence: the light ops reading or making one of them, or its
    gradient or recomputed copy (``name@...``), keep only their op annotation's mesh
    (the stage the search put them on: an op released whole at a stage boundary took
    the mesh of its first operand, a residual add the stage before its dropout's, and
    the stages formed a cycle on GPT-3 at 40 GB) and those copies and gradients lose
    their layout, so completion gives the light ops the split layouts (forward and
    backward) instead of gathering into the search's whole ones; the heavy
    ops keep theirs, which consume the activation whole, as Megatron-SP's all-gather
    into a matmul does (:func:`_gather_into_heavy_ops`)."""
    def base(v):
        return v.name.split("@", 1)[0]

    if not split:
        return
    for op in program.ops:
        # the names first: binding an op's rule (_light) is the costly test, and most ops
        # touch no split activation (binding every annotated op for each tensor-parallel
        # dim of each stage was a seventh of GPT-3 175B's planning, profiled)
        if op.annotation is not None and any(
                base(v) in split for v in (*op.inputs, *op.outputs)) and _light(op):
            op.annotation = OpAnnotation(op.annotation.mesh)
        for v in op.outputs:
            if v.name != base(v) and base(v) in split:
                v.annotation = None


def _light(op) -> bool:
    """No letter contracted between two operands (the search's light ops)."""
    bound = spmd_rule(op.type).bind([v.shape for v in op.inputs],
                                    [o.shape for o in op.outputs], op.dist_attr.mesh, op.attrs)
    return isinstance(bound, EinsumPlan) and bound.light()
