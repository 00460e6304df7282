"""The op registry: one entry per op type holds everything distgraph knows about it.

An entry is written as a class and registered by a one-line decorator::

    @register_op("relu", spmd=elementwise_rule())
    class Relu:
        def infer(x):                 # TensorTypes in -> TensorType(s) out
            return x
        def kernel(ctx, x):           # arrays in (ctx.xp is numpy or cupy) -> array(s)
            return ctx.xp.maximum(x, 0)
        def grad(op, dy):             # traced: returns one gradient Value (or None) per input
            return [relu_grad(op.inputs[0], dy)]
        def flops(ins, outs, **attrs):
            return size(outs[0])

Ops alike (elementwise, reductions, softmax) are written instead as one row each of a
table, ``Row(name, kernel, grad, flops, donate)``, which
:func:`distgraph.ops.common.register_rows` registers with the family's ``infer``, rule and
FLOPs (relu is such a row, in :mod:`distgraph.ops.elementwise`). Both forms end in
:func:`register`, which takes an entry's parts.

``spmd`` (the sharding rule) is required: an op without one cannot be registered.
``grad`` may be omitted only with ``differentiable=False``.
``inplace`` lists (output index, input index) pairs whose kernel writes into the input.
``donate=True`` says the kernel writes its (single) result into ``ctx.out`` when the
executor gives one: an input buffer of the result's shape and dtype that dies at this op.
``comm(site) -> ((kind, group size, buffer bytes), ...)`` (optional) declares the
collectives an op's distributed form runs inside its kernel, so the plan counts them.
Whether it runs any is its layout's to say, not the process's: empty at one process of
the op's mesh, empty at all (completion's pricing asks the first process only).
``localize(attrs, site) -> (attrs, ctx)`` (optional) adapts an op to run on local shards:
shape attributes become local, a vocabulary shard learns its first row, a random op
learns which slice of the global tensor it draws (``site`` is a :class:`LocalSite`).
``overlap(attrs, ins) -> (Overlap, ...)`` (optional) says, for a localized op (``attrs``
as ``localize`` made them, ``ins`` local TensorTypes), that its distributed form
pipelines its own collectives with its compute in slices (MeshSlice), and how: one
:class:`Overlap` per number of slices it may run with (empty: it does not overlap), so
the cost model prices the communication it hides.
``saved(attrs, ctx, ins) -> bytes`` (optional) says how many bytes its kernel keeps in
``KernelContext.saved`` from the forward to its gradient (the op ``<type>_grad`` of the
same layer, which takes them) at the expected load, for a localized op (``attrs`` and
``ctx`` as ``localize`` made them, ``ins`` local TensorTypes), so the memory model counts
what no Value holds (``moe_ffn``'s routes, rows and expert activations).
``workspace(ins, outs, **attrs) -> bytes`` (optional; none: 0) says how many bytes its
kernel allocates beyond its results while it runs, at its most (the temporaries of an
array expression, a scratch copy), for local TensorTypes ``ins`` and ``outs``: the
memory model adds them to what is live at the op, so that the estimate is what the
allocator hands out. tests/test_workspace.py measures every op's against the allocator
(``tracemalloc``); :func:`op_workspace` reads it, adding what the runtime's float32
computation of a 16-bit op allocates. ``takes_16bit=True`` says the kernel takes 16-bit
operands as they are (it only moves values: reshape, concat, cast; or casts what it
computes itself, as ``mixed_adam_update``): the runtime then runs it without float32
copies.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from typing import Any, Callable, NamedTuple

import numpy as np

from distgraph.dtypes import HALF_DTYPES, itemsize
from distgraph.errors import DistGraphError
from distgraph.mesh import ProcessRanks
from distgraph.placement import DistAttr
from distgraph.spmd import DimsSpec, OpStrategy, Rule, SpmdRuleError


class TensorType(NamedTuple):
    shape: tuple
    dtype: str

    def __str__(self) -> str:
        return f"[{', '.join(map(str, self.shape))}]:{self.dtype}"


class ShapeError(DistGraphError):
    """Raised by an op's ``infer``; the tracer adds the op, the layer path and all shapes."""


class DTypeError(ShapeError):
    """An operand's dtype is not one the op (or loss) takes: integer labels for a
    regression loss, float labels for cross-entropy, operands of two dtypes."""


@dataclass(frozen=True)
class OpDef:
    type: str
    infer: Callable
    kernel: Callable
    grad: Callable | None
    spmd: Any
    flops: Callable
    inplace: tuple = ()
    differentiable: bool = True
    localize: Callable | None = None
    comm: Callable | None = None
    donate: bool = False
    overlap: Callable | None = None
    saved: Callable | None = None
    workspace: Callable | None = None
    takes_16bit: bool = False


_REGISTRY: dict[str, OpDef] = {}


def register_op(op_type: str, *, spmd, inplace=(), differentiable=True, donate=False,
                takes_16bit=False):
    """Class decorator that validates and registers one op entry."""

    def wrap(cls):
        members = vars(cls)
        register(op_type, spmd=spmd, infer=members.get("infer"), kernel=members.get("kernel"),
                 grad=members.get("grad"), flops=members.get("flops"), inplace=inplace,
                 differentiable=differentiable, localize=members.get("localize"),
                 comm=members.get("comm"), donate=donate, overlap=members.get("overlap"),
                 saved=members.get("saved"), workspace=members.get("workspace"),
                 takes_16bit=takes_16bit)
        return cls

    return wrap


def register(op_type: str, *, spmd, infer, kernel, grad=None, flops=None, inplace=(),
             differentiable=True, localize=None, comm=None, donate=False,
             overlap=None, saved=None, workspace=None, takes_16bit=False) -> OpDef:
    """Validate and register one op entry from its parts (``register_op`` is the class
    form; :func:`distgraph.ops.common.register_rows` registers a table of them)."""
    if op_type in _REGISTRY:
        raise DistGraphError(f"op {op_type!r} is registered twice")
    if spmd is None:
        raise DistGraphError(f"op {op_type!r} has no sharding (spmd) rule; every op needs one")
    for needed, fn in (("infer", infer), ("kernel", kernel)):
        if fn is None:
            raise DistGraphError(f"op {op_type!r} defines no {needed}()")
    if differentiable and grad is None:
        raise DistGraphError(f"op {op_type!r} defines no grad(); pass differentiable=False "
                             "if it has no gradient")
    if not isinstance(spmd, Rule):
        raise DistGraphError(f"op {op_type!r}: its spmd rule {spmd!r} is not a "
                             f"distgraph.spmd.Rule")
    rule = OpRule(op_type, spmd, infer, comm)
    entry = OpDef(op_type, infer, kernel, grad, rule, flops or _zero_flops, tuple(inplace),
                  differentiable, localize, comm, donate, overlap, saved, workspace,
                  bool(takes_16bit))
    _REGISTRY[op_type] = entry
    return entry


def _zero_flops(ins, outs, **attrs) -> int:
    return 0


def get_op(op_type: str) -> OpDef:
    try:
        return _REGISTRY[op_type]
    except KeyError:
        raise DistGraphError(f"unknown op type {op_type!r}") from None


# Ops whose time follows their FLOPs (dense contractions, the experts' grouped ones);
# every other op's follows the elements it reads and writes.
FLOP_BOUND = ("matmul", "moe_ffn", "moe_ffn_grad", "attention", "attention_grad")
# Ops whose kernels return a view of their operand (numpy's and CuPy's reshape of a
# contiguous array, slices, broadcasts): they move no bytes, whatever their shapes.
VIEWS = ("reshape", "split", "slice", "broadcast_to")


def cast_cost_key(src: str, dst: str) -> str:
    """A device's ``op_costs`` entry (µs per call, ns per element) for turning an array of
    ``src`` into one of ``dst``: what a CPU pays to widen a 16-bit operand to float32
    and round a float32 result back (numpy has no 16-bit kernels; bfloat16's casts are
    ml_dtypes' loops, rounding about five times widening's cost per element)."""
    return f"cast {src}->{dst}"


CAST_COSTS = tuple(cast_cost_key(a, b) for h in HALF_DTYPES
                   for a, b in ((h, "float32"), ("float32", h)))


def op_work(op_type: str, ins, outs, attrs) -> float:
    """The amount a device's time for one op grows with: FLOPs for a dense contraction,
    else the elements of its operands and results (TensorTypes, local shapes). Cost
    tables per op type (``Device.op_costs``) are fitted against it."""
    if op_type in FLOP_BOUND:
        return float(get_op(op_type).flops(ins, outs, **attrs))
    return float(sum(size(t) for t in ins) + sum(size(t) for t in outs))


EXCHANGES = ("all_to_all", "all_to_allv")


def comm_workspace(collectives) -> int:
    """Bytes an op's own all-to-alls hold while its kernel runs, for its ``comm`` hook's
    ``((kind, group size, buffer bytes), ...)``: each exchange's result is a new array the
    kernel keeps to its end (MoE's rows there and back, Ulysses' heads), and at the
    largest one the send side holds its buffer again (MPI's all_to_all packs its pieces
    into one array, a dispatch packs its rows before an all_to_allv). Point-to-point hops
    (ring attention) pass one block at a time, which the op's own ``workspace`` hook
    counts. tests/test_memory_accounted.py and bench/memory_check.py (moe_ep,
    cp_ulysses) measure it on MPI ranks."""
    sizes = [float(b) for kind, _, b in collectives if kind in EXCHANGES]
    return int(sum(sizes) + max(sizes, default=0.0))


def op_workspace(op_type: str, ins, outs, attrs, widened: bool = True) -> int:
    """Bytes op ``op_type``'s kernel allocates beyond its results while it runs, for local
    TensorTypes ``ins`` and ``outs`` (its ``workspace`` hook; 0 without one).

    ``widened``: the backend computes 16-bit operands in float32 (numpy, which has no
    16-bit kernels: a CPU device). Where it does not (a GPU's libraries compute in 16 bits,
    as the published runs did), an op's workspace is its kernel's own, in its dtypes.
    The cost model prices a GPU that way, though distgraph's CuPy path still widens as
    below (but an add, subtract, multiply or scale: one kernel, no copies): its 16-bit
    copies are not priced there.

    With ``widened``, an op with a 16-bit float operand or result that does not take them
    as they are (``takes_16bit``) runs as the runtime's executor runs it
    (``distgraph.runtime.execution.executor.call_kernel``, which this mirrors): float32
    copies of its 16-bit operands, its kernel on them (its own workspace in float32), the
    copies dropped, then its float32 results rounded to their 16-bit dtypes. So its
    workspace is the larger of the kernel's peak (copies, float32 results, the kernel's
    workspace) and the rounding's (float32 and 16-bit results, and the copies a result
    was written into), less the 16-bit results it leaves.

    Example: ``op_workspace("add", [bf16 [4096], bf16 [4096]], [bf16 [4096]], {})`` is
    2 x 16 KiB of float32 copies + the 16 KiB float32 sum, less the 8 KiB bfloat16
    result it leaves: 40 KiB.
    """
    entry = get_op(op_type)

    def own(ins, outs) -> int:
        return 0 if entry.workspace is None else int(entry.workspace(ins, outs, **attrs))

    if not widened or entry.takes_16bit or \
            not any(t.dtype in HALF_DTYPES for t in (*ins, *outs)):
        return own(ins, outs)
    wide = [TensorType(t.shape, "float32") if t.dtype in HALF_DTYPES else t
            for t in (*ins, *outs)]
    wide_ins, wide_outs = wide[:len(ins)], wide[len(ins):]
    copies = {i: nbytes(w) for i, (t, w) in enumerate(zip(ins, wide_ins))
              if t.dtype in HALF_DTYPES}
    rounded = [j for j, t in enumerate(outs) if t.dtype in HALF_DTYPES]
    into = dict(entry.inplace)          # result j written into operand i's (copy) buffer
    fresh = sum(nbytes(wide_outs[j]) for j in rounded if j not in into)
    held = sum(copies.get(into[j], 0) for j in rounded if j in into)
    narrow = sum(nbytes(outs[j]) for j in rounded)
    kernel = sum(copies.values()) + fresh + own(wide_ins, wide_outs)
    return max(kernel, fresh + held + narrow) - narrow


def op_flops(op) -> float:
    """The FLOPs of one Operation (global shapes), from its registry entry."""
    return float(get_op(op.type).flops([TensorType(v.shape, v.dtype) for v in op.inputs],
                                       [TensorType(o.shape, o.dtype) for o in op.outputs],
                                       **op.attrs))


def takes_attr(op_type: str, name: str) -> bool:
    """Whether op ``op_type`` has an attribute ``name`` (its ``infer`` signature)."""
    return name in get_op(op_type).spmd.signature.parameters


def registered_ops() -> list[str]:
    return sorted(_REGISTRY)


def spmd_rule(op_type: str) -> OpRule:
    """The sharding rule of an op: ``spmd_rule("matmul").infer_forward(...)`` (the calls
    are listed in :mod:`distgraph.spmd`)."""
    return get_op(op_type).spmd


class OpRule(Rule):
    """An op's sharding rule as the registry hands it out: the attributes a call passes
    are checked against the op's (its ``infer`` signature: an unknown or missing one is
    an SpmdRuleError), and its strategies carry the collectives of the op's distributed
    form (its ``comm`` hook)."""

    def __init__(self, op_type: str, rule: Rule, infer: Callable, comm: Callable | None):
        self.op_type, self.rule, self.comm = op_type, rule, comm
        self.signature = inspect.signature(infer)

    def __repr__(self) -> str:
        return f"spmd_rule({self.op_type!r}) = {self.rule!r}"

    @property
    def linear(self) -> bool:
        """Whether the op is a sum of its operands: it keeps their common pending sum
        (``P x P -> P``; :class:`~distgraph.spmd.EinsumRule`)."""
        return getattr(self.rule, "linear", False)

    def check_attrs(self, n_inputs: int, attrs: dict) -> None:
        unknown = sorted(set(attrs) - set(self.signature.parameters))
        problem = f"unknown attribute(s) {unknown}" if unknown else None
        if problem is None:
            try:
                self.signature.bind(*[None] * n_inputs, **attrs)
            except TypeError as e:
                problem = str(e)
        if problem is not None:
            raise SpmdRuleError(f"rule of {self.op_type!r} with {n_inputs} inputs and "
                                f"attributes {sorted(attrs)}: {problem}; {self.op_type} "
                                f"takes {self.signature}")

    def bind(self, in_shapes, out_shapes, mesh, attrs: dict):
        self.check_attrs(len(in_shapes), attrs)
        try:
            return self.rule.bind(in_shapes, out_shapes, mesh, attrs)
        except SpmdRuleError as e:
            raise SpmdRuleError(f"rule of {self.op_type!r}: {e}") from None

    def strategies(self, in_shapes, out_shapes, mesh, in_dtypes=None, **attrs) -> list:
        found = self.bind(in_shapes, out_shapes, mesh, attrs).strategies()
        return [self.with_comm(s, in_shapes, out_shapes, mesh, in_dtypes, attrs)
                for s in found]

    def strategy(self, in_specs, out_specs, in_shapes, out_shapes, mesh, in_dtypes=None,
                 attrs=None):
        """The strategy record of complete ``in_specs`` / ``out_specs`` (e.g. a rule's
        answer with every entry known), as :meth:`strategies` lists them."""
        s = OpStrategy.build(mesh, [DimsSpec.of(x) for x in in_specs],
                             [DimsSpec.of(x) for x in out_specs], in_shapes, out_shapes)
        return self.with_comm(s, in_shapes, out_shapes, mesh, in_dtypes, attrs)

    def with_comm(self, s: OpStrategy, in_shapes, out_shapes, mesh, in_dtypes=None,
                  attrs=None):
        """``s`` with the collectives the op's distributed form runs (its ``comm`` hook)."""
        if self.comm is None:
            return s
        dtypes = tuple(in_dtypes) if in_dtypes is not None else ("float32",) * len(in_shapes)
        pid = mesh.process_ids[0]         # every process of a strategy communicates alike
        site = LocalSite(pid, tuple(map(tuple, in_shapes)),
                         tuple(DistAttr(mesh, x) for x in s.in_specs),
                         tuple(map(tuple, out_shapes)),
                         tuple(DistAttr(mesh, x) for x in s.out_specs), dtypes,
                         tuple(sorted((attrs or {}).items())))
        comm = tuple(self.comm(site))
        return replace(s, comm=comm) if comm else s



@dataclass(frozen=True)
class Overlap:
    """How an op's distributed form pipelines its collectives with its compute (an
    op's ``overlap`` hook): ``slices`` identical slices, each running ``before`` (the
    collectives whose results its compute needs), the compute ``op_type`` on ``ins`` ->
    ``outs`` (local TensorTypes, with ``attrs`` as sorted pairs), then ``after`` (the
    collectives on its result). A collective is ``(kind, mesh dim, group size, buffer
    bytes)`` as :func:`distgraph.plan.kinds.collective_bytes` defines the buffer; collectives on
    different mesh dims run at once, and slice k's compute overlaps slice k+1's
    ``before`` and slice k-1's ``after``. ``reread``: the bytes each slice moves through
    memory beyond its share of the unsliced op's (an operand that every slice reads
    whole, a result that the slices after the first read and write again to accumulate
    into), averaged over the slices."""

    slices: int
    op_type: str
    ins: tuple
    outs: tuple
    before: tuple
    after: tuple
    attrs: tuple = ()
    reread: float = 0.0


def size(t: TensorType) -> int:
    n = 1
    for d in t.shape:
        n *= d
    return n


def nbytes(t: TensorType) -> int:
    """Bytes of an array of TensorType ``t``."""
    return size(t) * itemsize(t.dtype)


@dataclass
class KernelContext:
    """What a kernel may know beyond its operands: the array namespace (numpy or cupy),
    the training step (seeds random ops), and, for a shard of a distributed tensor, the
    global shape and the slices this process holds of the op's first output (so random
    ops draw the same global numbers whatever the partition). An op whose distributed
    form communicates inside its kernel gets the communicator, the map from process ids
    to ranks and its ``group`` of process ids, or several ``groups`` (set by its
    ``localize``). ``out`` is a buffer a ``donate`` op may write its result into (None:
    allocate). ``saved`` is a dict in which a kernel may keep arrays for a later kernel
    of the same micro-batch and layer on this process (a forward's dispatched rows and
    activations for its gradient, as ``moe_ffn`` keeps them, under a fixed key, so that
    a recomputed copy of the op replaces what the original kept), which the runtime
    clears when the micro-batch's work is done; None where the runtime keeps none (the
    kernel then recomputes)."""

    xp: Any
    step: int = 0
    out_global_shape: tuple | None = None
    out_slices: tuple | None = None
    comm: Any = None
    ranks: ProcessRanks | None = None     # None: process p on rank p
    group: tuple | None = None
    out: Any = None
    groups: tuple | None = None
    saved: dict | None = None

    def group_ranks(self, group: tuple | None = None) -> tuple:
        """The ranks of ``group`` (process ids; default this op's ``group``)."""
        group = self.group if group is None else group
        if self.comm is None or group is None:
            raise RuntimeError("this kernel communicates but was given no communicator/group")
        return (ProcessRanks() if self.ranks is None else self.ranks).of(group)


@dataclass(frozen=True)
class LocalSite:
    """Where one op runs in a partitioned program: the process, and the global shape and
    DistAttr of each operand (as consumed) and result (as produced); ``attrs`` the op's
    (global) attributes as sorted (name, value) pairs."""

    process_id: int
    in_shapes: tuple
    in_attrs: tuple
    out_shapes: tuple
    out_attrs: tuple
    in_dtypes: tuple = ()
    attrs: tuple = ()

    def attr(self, name: str, default=None):
        return dict(self.attrs).get(name, default)

    def out_local_shape(self, j: int = 0) -> tuple:
        return self.out_attrs[j].local_shape(self.out_shapes[j])

    def out_slices(self, j: int = 0) -> tuple:
        return self.out_attrs[j].local_slices(self.out_shapes[j], self.process_id)

    def in_slices(self, i: int) -> tuple:
        return self.in_attrs[i].local_slices(self.in_shapes[i], self.process_id)

    def split_group(self, i: int, dim: int) -> tuple:
        """The processes holding the other blocks of operand i's ``dim`` (this process
        included), in block order: the group an op's own collective over that dim uses."""
        attr = self.in_attrs[i]
        entry = attr.spec.entry(dim % len(self.in_shapes[i]))
        mesh, me = attr.mesh, attr.mesh.coord(self.process_id)
        # this process's coordinates on the other mesh dims, the entry's dims in entry
        # order (major first, as block_index counts): the ids in block order, without
        # a scan of every process of the mesh
        axes = [mesh.dim_index(name) for name in entry]
        ids = mesh.mesh[tuple(slice(None) if k in axes else c for k, c in enumerate(me))]
        order = sorted(range(len(axes)), key=lambda j: axes[j])    # ids' axes: mesh order
        ids = ids.transpose([order.index(j) for j in range(len(axes))]) if axes else ids
        return tuple(int(q) for q in np.asarray(ids).reshape(-1))
