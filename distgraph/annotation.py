"""User annotations: ``shard_tensor``, ``shard_op`` and ``shard_dataloader``, and the
per-op DistAttr record.

Example::

    mesh = dg.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    dg.shard_tensor(model.fc1.weight, mesh, [None, "mp"])      # a parameter
    data = dg.shard_dataloader(dataset, mesh, shard_dims="dp")  # the batch split over dp
    rows = dg.shard_dataloader(hf_dataset, mesh, "dp", input_keys=["input_ids", "labels"])
    def forward(self, x):
        x = dg.shard_tensor(x, mesh, ["mp", None])             # a traced activation
        return dg.shard_op(self.fc1, mesh, out_shard_specs=[[None, "mp"]])(x)
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from distgraph.errors import BatchSplitError, DistGraphError, ShardingError
from distgraph.ir import Value
from distgraph.mesh import ProcessMesh
from distgraph.ops.attention_blocks import positions
from distgraph.parameter import Parameter
from distgraph.placement import DistAttr, Partial, Replicate, Shard, ShardSpec
from distgraph.registry import takes_attr
from distgraph.trace import active_builder, current_builder, flatten_outputs


def to_shard_spec(spec, mesh: ProcessMesh, ndim: int, label: str = "tensor") -> ShardSpec:
    """Accept a ShardSpec, a list of entries, or a list of placements (one per mesh dim).
    ``label`` names the tensor in errors."""
    if isinstance(spec, ShardSpec):
        return spec
    if isinstance(spec, str):
        example = [spec] + [None] * (ndim - 1)
        raise ShardingError(f"{label}: shard spec {spec!r} is a string; pass a list with one "
                            f"entry per tensor dim ({ndim}), e.g. {example} on {mesh}")
    if not hasattr(spec, "__iter__"):
        raise ShardingError(f"{label}: shard spec {spec!r}; pass a list with one entry per "
                            f"tensor dim ({ndim}) on {mesh}")
    spec = list(spec)
    if spec and all(isinstance(p, (Shard, Replicate, Partial)) for p in spec):
        return ShardSpec.from_placements(spec, mesh, ndim)
    return ShardSpec(spec)


def _label_of(x) -> str:
    """How errors name ``x``: ``tensor 'h'`` or ``parameter 'fc1.weight' of Linear(16, 64)``."""
    return f"tensor {x.name!r}" if isinstance(x, Value) else x.describe()


def shard_tensor(x, mesh: ProcessMesh, shard_spec):
    """Annotate a Parameter or a traced Value with a mesh and spec; returns ``x``.

    Completion never changes an annotation; a conflicting consumer gets a reshard."""
    if not isinstance(mesh, ProcessMesh):
        raise ShardingError(f"shard_tensor: mesh must be a ProcessMesh, got {type(mesh).__name__}")
    if _is_layer(x):
        path = x._model_path()
        params = [name for name, _ in x.named_parameters(path)]
        what = f"the layer {path!r} ({x!r})," if path else f"a layer, {x!r},"
        raise ShardingError(f"shard_tensor: got {what} not a tensor: annotate its parameters"
                            + (f" ({', '.join(params[:3])}{', ...' if len(params) > 3 else ''})"
                               if params else "")
                            + ", or run it on a mesh with dg.shard_op(layer, mesh, ...)")
    if not isinstance(x, (Parameter, Value)):
        raise ShardingError(f"shard_tensor: expected a Parameter or a traced tensor, got "
                            f"{type(x).__name__}")
    label = _label_of(x)
    spec = to_shard_spec(shard_spec, mesh, len(x.shape), label)
    if isinstance(x, Value) and _is_feed(x):
        check_batch_split(spec, mesh, x.shape, f"input {x.name!r}")
    spec.validate(mesh, x.shape, label=label)
    x.annotation = DistAttr(mesh, spec)
    return x


def _is_feed(v: Value) -> bool:
    builder = active_builder()
    return builder is not None and any(v is i for i in builder.program.inputs)


def check_batch_split(spec: ShardSpec, mesh: ProcessMesh, shape, what: str) -> None:
    """A feed's dim 0 is the batch: when ``spec`` splits it into parts that do not divide
    it, say so in the user's terms (the batch size) as well as the tensor's."""
    if not shape or len(spec.dims) != len(shape):
        return
    parts = 1
    for name in spec.entry(0):
        if name in mesh.dim_names:
            parts *= mesh.dim_size(name)
    if shape[0] % parts:
        where = f"{what} of shape {list(shape)} with spec {spec} on {mesh}"
        dims = list(spec.entry(0))
        raise BatchSplitError(f"{where}: the batch dim 0 of size {shape[0]} is not divisible "
                              f"by {parts} (the size of mesh dims {dims}); use a batch size "
                              f"divisible by {parts}", shape[0], parts,
                              f"its split over mesh dims {dims} into {parts} parts")


@dataclass(frozen=True)
class OpAnnotation:
    """What ``shard_op`` fixes for the ops it traces: their mesh, and the consumer specs of
    the callable's arguments (``in_specs``: position -> spec)."""

    mesh: ProcessMesh
    in_specs: tuple = ()


def shard_op(fn_or_layer, mesh: ProcessMesh, in_shard_specs=None, out_shard_specs=None,
             meshslice=None):
    """Wrap a callable so the ops it traces run on ``mesh``. ``in_shard_specs`` fix how
    each argument is consumed (None entries leave one free); ``out_shard_specs`` annotate
    the results as ``shard_tensor`` would. ``meshslice`` (True, or a number of slices K)
    lets its matmuls, and their backward GeMMs, run as MeshSlice where their operands
    are 2-D sharded (as ``Strategy(meshslice=...)`` does for every matmul).

    A Layer gives a Layer: the same layer (the same sub-layers and parameters, under the
    same names) whose forward runs on ``mesh``, so it can be given to the Engine::

        engine = dg.Engine(dg.shard_op(model, mesh, in_shard_specs=[["dp", None]]), ...)

    Any other callable gives a function."""
    if not isinstance(mesh, ProcessMesh):
        raise ShardingError(f"shard_op: mesh must be a ProcessMesh, got {type(mesh).__name__}")
    slices = _meshslice_setting(meshslice)
    if _is_layer(fn_or_layer):
        clone = copy.copy(fn_or_layer)
        # its own registries (adding to one does not add to the other), the same entries
        object.__setattr__(clone, "_parameters", OrderedDict(fn_or_layer._parameters))
        object.__setattr__(clone, "_sublayers", OrderedDict(fn_or_layer._sublayers))
        object.__setattr__(clone, "forward", _on_mesh(clone.forward, mesh, in_shard_specs,
                                                      out_shard_specs, slices))
        return clone
    return _on_mesh(fn_or_layer, mesh, in_shard_specs, out_shard_specs, slices)


def _is_layer(x) -> bool:
    # duck-typed: distgraph.nn builds on this module
    return hasattr(x, "named_parameters") and hasattr(x, "_sublayers")


def _on_mesh(fn, mesh, in_shard_specs, out_shard_specs, slices):
    def wrapped(*args):
        builder = current_builder()
        values = [builder.as_value(a) if isinstance(a, (Value, Parameter)) else a for a in args]
        in_specs = []
        for k, spec in enumerate(in_shard_specs or []):
            if spec is None:
                continue
            v = values[k]
            s = to_shard_spec(spec, mesh, len(v.shape), _label_of(v))
            if _is_feed(v):
                check_batch_split(s, mesh, v.shape, f"input {v.name!r}")
            s.validate(mesh, v.shape, v.name)
            in_specs.append((v.name, s))
        first = len(builder.program.ops)
        with builder.scope(op_annotation=OpAnnotation(mesh, tuple(in_specs))):
            out = fn(*values)
        if out_shard_specs is not None:
            outs = flatten_outputs(out)
            if len(outs) != len(out_shard_specs):
                raise ShardingError(f"shard_op: {len(out_shard_specs)} out_shard_specs for "
                                    f"{len(outs)} outputs")
            for v, spec in zip(outs, out_shard_specs):
                if spec is not None:
                    shard_tensor(v, mesh, spec)
        if len(builder.program.ops) == first:
            raise ShardingError("shard_op: the wrapped callable traced no op")
        if slices is not None:
            takers = [op for op in builder.program.ops[first:] if takes_attr(op.type, "meshslice")]
            if not takers:
                raise ShardingError(f"shard_op(meshslice={slices!r}): the wrapped callable "
                                    "traced no matmul to run as MeshSlice")
            for op in takers:
                op.attrs["meshslice"] = slices
        return out

    wrapped.__wrapped__ = fn       # inspect.signature reads the callable's arguments
    return wrapped


class ShardDataloader:
    """A dataset whose batches come in split over a mesh dim: what
    :func:`shard_dataloader` returns. Indexing and ``len`` are the dataset's (with a
    sequence split in the balanced order, each sample's dim 0 stored in that order:
    :meth:`ordered`); the Engine reads :meth:`feed_attrs` to annotate the feeds of
    each batch and :attr:`sequence_chunks` for their order."""

    def __init__(self, dataset, meshes: tuple, shard_dims: tuple, sequence_dims: tuple = (),
                 balance: bool = True, input_keys: tuple | None = None):
        self.dataset, self.meshes, self.shard_dims = dataset, meshes, shard_dims
        self.input_keys = input_keys
        self.sequence_dims = sequence_dims or (None,) * len(meshes)
        sizes = {m.dim_size(d) for m, d in zip(meshes, self.sequence_dims) if d is not None}
        if len(sizes) > 1:
            raise ShardingError(f"shard_dataloader: the sequence dims {list(self.sequence_dims)}"
                                f" of {list(map(str, meshes))} split it {sorted(sizes)} ways; "
                                "every mesh must split the sequence alike")
        ways = sizes.pop() if sizes else 1
        # the load-balanced order of 2 * cp chunks (rank i holds chunks i and 2cp-1-i):
        # ring attention's causal triangle is then even over the ranks
        self.sequence_chunks = 2 * ways if balance and ways > 1 else 1

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        return self.ordered(sample_fields(self.dataset[i], self.input_keys, i), i)

    def ordered(self, sample, index=None):
        """``sample`` (dataset sample ``index``)'s fields with dim 0 (a batch's dim 1) in
        the stored sequence order."""
        if self.sequence_chunks == 1:
            return sample
        fields = list(sample) if isinstance(sample, (tuple, list)) else [sample]
        out = []
        for k, f in enumerate(fields):
            f = np.asarray(f)
            if f.ndim < 1 or f.shape[0] % self.sequence_chunks:
                raise ShardingError(self._not_chunked(k, f.shape, index))
            out.append(f[positions(np, 0, f.shape[0], f.shape[0], self.sequence_chunks)])
        return tuple(out)

    def _not_chunked(self, field: int, shape, index) -> str:
        """Why field ``field`` (of ``shape``) of a sample cannot be cut into the
        balanced order's chunks, and what to change."""
        chunks, ways = self.sequence_chunks, self.sequence_chunks // 2
        dims = [d for d in self.sequence_dims if d is not None]
        where = (f"shard_dataloader(sequence_dim={dims[0]!r}): "
                 f"{'' if index is None else f'dataset sample {index}, '}field {field}")
        if not shape:
            return (f"{where} is a scalar, but context parallelism splits every field's "
                    f"dim 0 (a batch's dim 1, the sequence), labels too: give each field "
                    f"a sequence, or leave sequence_dim out")
        return (f"{where} has a sequence of {shape[0]} (its dim 0 of shape {list(shape)}; "
                f"a batch's dim 1): context parallelism over {ways} processes stores it in "
                f"{chunks} load-balanced chunks (2 per process), and {chunks} does not divide "
                f"{shape[0]}; use a sequence length divisible by {chunks}"
                + (f", or balance=False (sequence order kept, {ways} blocks, the causal work "
                   f"uneven)" if shape[0] % ways == 0 else ""))

    def restored(self, array, axis: int = 1):
        """``array`` (a batch's output) with dim ``axis`` back in sequence order."""
        if self.sequence_chunks == 1:
            return array
        n = array.shape[axis]
        back = np.argsort(positions(np, 0, n, n, self.sequence_chunks))
        return np.take(array, back, axis=axis)

    def __repr__(self) -> str:
        where = ", ".join(f"{m} by {d!r}" for m, d in zip(self.meshes, self.shard_dims))
        seq = "" if not any(self.sequence_dims) else \
            f", sequence by {list(self.sequence_dims)} in {self.sequence_chunks} chunks"
        keys = "" if self.input_keys is None else f", input_keys={list(self.input_keys)}"
        return f"shard_dataloader({type(self.dataset).__name__}, {where}{seq}{keys})"

    def feed_attrs(self, shapes: list, n_labels: int) -> list:
        """One DistAttr per field of a batch (fields of ``shapes``, the last ``n_labels``
        of them labels): dim 0 split over the shard dim of the field's mesh, dim 1 over
        its sequence dim.

        One mesh holds every field; one per field each its own; two for more fields: the
        inputs on the first, the labels on the second (Paddle's [inputs, label])."""
        n = len(shapes)
        if len(self.meshes) == 1:
            which = [0] * n
        elif len(self.meshes) == n:
            which = list(range(n))
        elif len(self.meshes) == 2:
            which = [0] * (n - n_labels) + [1] * n_labels
        else:
            raise ShardingError(f"shard_dataloader: {len(self.meshes)} meshes for samples of "
                                f"{n} fields; give one mesh, one per field, or two (inputs, "
                                "labels)")
        attrs = []
        for k, shape in enumerate(shapes):
            mesh, dim = self.meshes[which[k]], self.shard_dims[which[k]]
            seq = self.sequence_dims[which[k]]
            what = (f"dataset field {k} ({'label' if k >= n - n_labels else 'input'}, split "
                    f"by shard_dataloader)")
            if seq is not None and len(shape) < 2:
                raise ShardingError(f"shard_dataloader: {what} of shape {list(shape)} has no "
                                    f"dim 1 to split over sequence_dim {seq!r}")
            head = [dim] + ([seq] if seq is not None else [])
            spec = ShardSpec(head + [None] * (len(shape) - len(head))) if shape else \
                ShardSpec([])
            check_batch_split(spec, mesh, shape, what)
            attrs.append(DistAttr(mesh, spec))
        return attrs


def shard_dataloader(dataset, meshes, shard_dims=None, sequence_dim=None,
                     balance: bool = True, input_keys=None) -> ShardDataloader:
    """Paddle's ``shard_dataloader``: the Engine feeds each batch of ``dataset`` split
    over mesh dim ``shard_dims`` (a dim name or index; None: not split, whole on the
    mesh), the labels too, so any model trains data parallel without annotating its
    inputs. ``meshes``: one ProcessMesh for every field; a list with one per field; or
    two, the inputs' and the labels' (a pipeline's first and last stage).
    ``shard_dims`` may be a list, one per mesh.

    ``sequence_dim`` (a dim name or index, or a list, one per mesh) splits dim 1 of every
    field (tokens and labels: the sequence) over that mesh dim: context parallelism.
    With ``balance`` (the default) the sequence is stored in the load-balanced order of
    2·cp chunks, rank i holding chunks i and 2·cp−1−i, so ring attention's causal work
    is even over the ranks; rotary positions and the causal mask follow the chunks
    (``InputSpec.sequence_chunks``), a loss over tokens does not see the order, and
    ``Engine.predict`` puts its outputs back in sequence order.

    ``input_keys`` (Paddle's): a dataset whose samples are dicts (a Hugging Face
    ``datasets.Dataset``, a list of dicts) names the fields it feeds, in order: the
    model's inputs in the order of its forward's arguments, then the label. Other keys
    of a sample are not read.

    Example::

        mesh = dg.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
        engine = dg.Engine(dg.nn.MLP(16, 64, 4), loss=dg.nn.MSELoss(),
                           optimizer=dg.optim.SGD(0.1))
        engine.fit(dg.shard_dataloader(dataset, mesh, shard_dims="dp"), batch_size=16)
        # context parallel: dg.shard_dataloader(tokens, mesh, "dp", sequence_dim="cp")
        # dict samples: dg.shard_dataloader(hf_dataset, mesh, "dp",
        #                                   input_keys=["input_ids", "labels"])
    """
    if isinstance(dataset, ShardDataloader):
        dataset = dataset.dataset
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise ShardingError("shard_dataloader: the dataset needs __len__ and __getitem__ "
                            f"returning numpy arrays, got {type(dataset).__name__}")
    meshes = (meshes,) if isinstance(meshes, ProcessMesh) else tuple(meshes)
    if not meshes or not all(isinstance(m, ProcessMesh) for m in meshes):
        raise ShardingError(f"shard_dataloader: meshes must be a ProcessMesh or a list of "
                            f"them, got {meshes!r}")
    dims = shard_dims if isinstance(shard_dims, (list, tuple)) else [shard_dims] * len(meshes)
    seqs = sequence_dim if isinstance(sequence_dim, (list, tuple)) else \
        [sequence_dim] * len(meshes)
    for given, what in ((dims, "shard_dims"), (seqs, "sequence_dim")):
        if len(given) != len(meshes):
            raise ShardingError(f"shard_dataloader: {len(given)} {what} for {len(meshes)} "
                                "meshes; give one, or one per mesh")
    dims = tuple(_mesh_dim(m, d) for m, d in zip(meshes, dims))
    seqs = tuple(_mesh_dim(m, d, "sequence_dim") for m, d in zip(meshes, seqs))
    for d, q in zip(dims, seqs):
        if q is not None and q == d:
            raise ShardingError(f"shard_dataloader: sequence_dim {q!r} is also the batch's "
                                "shard_dims; split the sequence over another mesh dim")
    return ShardDataloader(dataset, meshes, dims, seqs, balance,
                           checked_input_keys(input_keys, "shard_dataloader"))


def checked_input_keys(input_keys, where: str) -> tuple | None:
    """``input_keys`` as a tuple of the field names (None stays None); ``where`` (the
    call that was given them) names them in the error."""
    if input_keys is None:
        return None
    try:
        keys = None if isinstance(input_keys, str) else tuple(input_keys)
    except TypeError:
        keys = None
    if not keys or not all(isinstance(k, str) for k in keys) or len(set(keys)) < len(keys):
        raise DistGraphError(f"{where}: input_keys={input_keys!r}; give a list of the dict "
                             "keys that hold the fields, each once, the model's inputs then "
                             "the label, e.g. input_keys=['input_ids', 'labels']")
    return keys


def sample_fields(sample, input_keys=None, index=None) -> list:
    """A dataset sample's fields in order: a tuple or list as it is, one array alone as
    one field, a dict's values at ``input_keys`` (which a dict sample needs)."""
    where = "a dataset sample" if index is None else f"dataset sample {index}"
    if isinstance(sample, Mapping):
        keys = list(sample)
        if input_keys is None:
            raise DistGraphError(
                f"{where} is a dict (keys {', '.join(map(repr, keys))}); say which keys "
                f"to feed, in order: the model's inputs as its forward takes them, then the "
                f"label: dg.shard_dataloader(data, mesh, \"dp\", input_keys=[...]) or "
                f"engine.fit(data, input_keys=[...]) (evaluate and predict take input_keys "
                f"too)")
        missing = [k for k in input_keys if k not in sample]
        if missing:
            raise DistGraphError(f"input_keys {list(input_keys)}: {where} has no "
                                 f"{', '.join(map(repr, missing))} (its keys: "
                                 f"{', '.join(map(repr, keys))})")
        return [sample[k] for k in input_keys]
    if input_keys is not None:
        raise DistGraphError(f"input_keys {list(input_keys)} name the fields of dict "
                             f"samples, but {where} is a {type(sample).__name__}: its fields "
                             "are fed in their order; leave input_keys out")
    return list(sample) if isinstance(sample, (tuple, list)) else [sample]


def _mesh_dim(mesh: ProcessMesh, dim, what: str = "shard_dims"):
    """A mesh dim given by name or index (as argument ``what``), as its name (None stays
    None)."""
    if dim is None:
        return None
    if isinstance(dim, int) and not isinstance(dim, bool):
        if not -mesh.ndim <= dim < mesh.ndim:
            raise ShardingError(f"shard_dataloader: {what} {dim} is out of range for "
                                f"{mesh} ({mesh.ndim} dims)")
        return mesh.dim_names[dim]
    if dim not in mesh.dim_names:
        raise ShardingError(f"shard_dataloader: {what} {dim!r} is not a dim of {mesh}; "
                            f"its dims are {list(mesh.dim_names)}")
    return dim


def _meshslice_setting(value):
    """shard_op's ``meshslice`` as the op attribute: None, "auto" (True) or K."""
    if value is None or value is False:
        return None
    if value is True:
        return "auto"
    if isinstance(value, int) and value >= 1:
        return value
    raise ShardingError(f"shard_op(meshslice={value!r}): give True (the cost model picks the "
                        "number of slices K) or a number of slices K >= 1")


@dataclass
class OpDistAttr:
    """Completion's result for one op: its mesh, the spec of each operand as consumed,
    the spec of each result as produced, and notes on conflicts it resolved."""

    mesh: ProcessMesh
    input_specs: list
    output_specs: list
    notes: list = field(default_factory=list)

    def __str__(self) -> str:
        ins = ", ".join(map(str, self.input_specs))
        outs = ", ".join(map(str, self.output_specs))
        return f"mesh={list(self.mesh.process_ids)} in=({ins}) out=({outs})"
