"""The layouts Megatron-LM and torchtitan run, as one predicate the search and the export
share (``Strategy(target=...)``, :mod:`distgraph.plan.export`).

Both frameworks split a transformer one way: tensor parallelism over one mesh dim, in
Megatron's column / row style (a Linear weight ``[in, out]`` split over its output
features, column, or its input features, row; Megatron's ColumnParallelLinear /
RowParallelLinear, torchtitan's ColwiseParallel / RowwiseParallel), the embedding table
over its vocabulary (VocabParallelEmbedding; torchtitan's RowwiseParallel on
``tok_embeddings``), norms whole, a bias whole or split (a column Linear's with its
columns; a row Linear's sum reduce-scattered onto its features may add a split bias,
which moves the bytes Megatron's all-reduce moves: the degrees are the same); a mixture
of experts' experts split over data-parallel ranks (expert parallelism) and its router
whole; data parallelism over the other mesh dims (the batch split there, every weight
whole: the distributed optimizer / FSDP shards only what ZeRO shards after the search);
context parallelism over a mesh dim splitting the sequence. Where the tensor dim has
more than one process every Linear weight is split over it (neither framework leaves a
block's Linear whole under tensor parallelism), unless neither of its matrix dims
divides there.

Example::

    kinds = weight_kinds(program)          # {parameter: "linear" | "embedding" | ...}
    weight_problem("fc1.weight", "linear", (64, 256), spec, {"x": 2, "y": 4}, "y")
"""

from __future__ import annotations

from distgraph.ir import Role
from distgraph.spmd.specs import entry_dims

# how a weight is read in the forward: the op types that say it
_KINDS = {"matmul": "linear", "embedding": "embedding", "layer_norm": "norm",
          "rms_norm": "norm", "add": "bias", "moe_ffn": "expert"}
# ops a weight may pass through on its way to the op that reads it (amp's cast)
_THROUGH = ("cast",)


def weight_kinds(program) -> dict:
    """{parameter name: how the forward reads it}: "linear" (a matmul operand),
    "embedding" (an embedding's table), "norm" (a norm's scale or shift), "bias" (an
    add's operand), "expert" (a mixture of experts' stacked weights), "router" (a Linear
    inside a mixture of experts' layer: its gate, whole in both frameworks) or "other";
    looked up through casts, and through the slice that cuts a parameter ZeRO stored
    padded back to its shape."""
    readers: dict = {}
    moe = set()
    for op in program.ops:
        if op.role in (Role.FORWARD, Role.LOSS):
            for v in op.inputs:
                readers.setdefault(v.name, []).append(op)
            if op.type == "moe_ffn" and op.layer:
                moe.add(op.layer + ".")
    out = {}
    for p in program.parameters:
        names, kinds = [p.name], []
        while names:
            name = names.pop()
            for op in readers.get(name, ()):
                if op.type in _THROUGH or (op.type == "slice" and name == p.name
                                           and p.padded_from is not None):
                    names += [o.name for o in op.outputs]
                else:
                    kinds.append(_KINDS.get(op.type, "other"))
        # a table tied to the LM head is read both ways: its vocabulary split is the one
        kind = "embedding" if "embedding" in kinds else kinds[0] if kinds else "other"
        if kind == "linear" and any(p.name.startswith(m) for m in moe):
            kind = "router"
        out[p.name] = kind
    return out


def weight_problem(name: str, kind: str, shape, spec, sizes: dict, tensor: str | None,
                   data_ok: bool = False, experts_ok: bool = True) -> str | None:
    """What is not Megatron's / torchtitan's in weight ``name`` (of ``kind``, ``shape``)
    laid out as ``spec`` on a mesh of ``sizes`` ({dim: size}) whose tensor-parallel dim
    is ``tensor`` (None: none), or None where nothing is. ``data_ok``: a split over
    another mesh dim is FSDP's (torchtitan's ``data_parallel_shard_degree``).
    ``experts_ok``: experts may be split
    over a data dim (expert parallelism; the search under torchtitan does not, as its
    expert parallelism needs FSDP's ranks)."""
    over = [(d, m) for d, e in enumerate(spec.dims) for m in entry_dims(e)
            if sizes.get(m, 1) > 1]
    # experts split over a data dim on their expert dim: expert parallelism
    other = [(d, m) for d, m in over
             if m != tensor and not (kind == "expert" and d == 0 and experts_ok)]
    if other and not data_ok:
        d, m = other[0]
        return (f"{name} {list(shape)} is split over mesh dim {m!r} (its dim {d}), which is "
                f"not the tensor-parallel dim: both frameworks keep weights whole over the "
                f"data-parallel dims (only ZeRO's distributed optimizer / FSDP shards them)")
    on_t = [d for d, m in over if m == tensor]
    t = sizes.get(tensor, 1) if tensor is not None else 1
    n = len(shape)
    if kind == "linear":
        if on_t and on_t[0] < n - 2:
            return (f"Linear weight {name} {list(shape)} is split over the tensor dim "
                    f"{tensor!r} along its dim {on_t[0]}, neither its input features (row "
                    f"parallel) nor its output features (column parallel)")
        if not on_t and t > 1 and any(shape[d] % t == 0 for d in range(max(n - 2, 0), n)):
            return (f"Linear weight {name} {list(shape)} is whole over the tensor dim "
                    f"{tensor!r} of {t} processes: both frameworks split every Linear "
                    f"column- or row-wise under tensor parallelism")
        return None
    if kind == "expert":
        if on_t and on_t[0] < n - 2:
            return (f"expert weights {name} {list(shape)} are split over the tensor dim "
                    f"{tensor!r} along their dim {on_t[0]}: both frameworks split each "
                    f"expert's matrix over it (expert tensor parallelism), the experts over "
                    f"data-parallel ranks (expert parallelism)")
        return None
    if kind == "embedding":
        if on_t and on_t[0] != 0:
            return (f"embedding table {name} {list(shape)} is split over the tensor dim "
                    f"{tensor!r} along its dim {on_t[0]}: both frameworks split the "
                    f"vocabulary (dim 0)")
        return None
    if kind == "bias" and n == 1:
        return None
    if on_t:
        what = {"norm": "norm weight", "bias": "weight"}.get(kind, "weight")
        return (f"{what} {name} {list(shape)} is split over the tensor dim {tensor!r} (its "
                f"dim {on_t[0]}): both frameworks keep it whole there")
    return None


def feed_problem(name: str, shape, spec, sizes: dict, tensor: str | None,
                 sequence: str | None = None, data: tuple = ()) -> str | None:
    """What is not the frameworks' in feed ``name`` laid out as ``spec``: a feed is split
    over the data dims along its batch (dim 0) and over the context-parallel dim
    ``sequence`` along the sequence (dim 1), never over the tensor dim. ``data``: the
    data dims it must be split over where they divide its batch (each data-parallel rank
    reads its own samples), and then over ``sequence`` where it divides the sequence
    (the search's rule)."""
    wanted = [m for m in data if sizes.get(m, 1) > 1]
    count = 1
    for m in wanted:
        count *= sizes[m]
    have = set(entry_dims(spec.dims[0])) if spec.dims else set()
    if wanted and shape and shape[0] % count == 0 and not set(wanted) <= have:
        return (f"feed {name} {list(shape)} is not split over the data-parallel dims "
                f"{wanted} along its batch")
    cp = sizes.get(sequence, 1) if data and sequence else 1
    if cp > 1 and len(shape) > 1 and shape[1] % cp == 0 and \
            sequence not in entry_dims(spec.dims[1]):
        return (f"feed {name} {list(shape)} is not split over the context-parallel dim "
                f"{sequence!r} along its sequence")
    for d, e in enumerate(spec.dims):
        for m in entry_dims(e):
            if sizes.get(m, 1) < 2:
                continue
            if m == tensor:
                return (f"feed {name} {list(shape)} is split over the tensor dim {m!r}: "
                        f"every tensor-parallel rank reads the same samples")
            if d != (1 if m == sequence else 0):
                return (f"feed {name} {list(shape)} is split over mesh dim {m!r} along its "
                        f"dim {d}, not its batch (data parallel) or sequence (context "
                        f"parallel)")
    return None


def search_roles(mesh) -> tuple:
    """(tensor dim, context-parallel dim) of a mesh the search plans on under a target:
    its last dim is tensor parallel (``y`` of the search's (dp, tp) and (dp, cp, tp)
    meshes, inside a machine; a 1-D mesh has none), ``cp`` splits the sequence, the
    other dims are data parallel."""
    names = list(mesh.dim_names)
    tensor = names[-1] if len(names) > 1 and names[-1] != "cp" else None
    return tensor, ("cp" if "cp" in names else None)
