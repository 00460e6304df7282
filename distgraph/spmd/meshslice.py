"""MeshSlice's layouts of a matmul, and the rule that offers them (Nam et al., §2.3 and §3).

A 2-D GeMM ``C[m, n] = A[m, k] B[k, n]`` on two mesh dims ``(u, v)`` keeps one matrix
where it is (stationary) and moves the other two along the mesh's rows or columns. With
every matrix split over both dims, the three dataflows are these layouts (each letter
of each operand: the mesh dim that splits it) and collectives:

======== ============ ============ ============ ==========================================
dataflow A            B            C            each process
======== ============ ============ ============ ==========================================
OS       [m:u, k:v]   [k:u, n:v]   [m:u, n:v]   all-gathers A over v and B over u (k)
LS       [m:u, k:v]   [k:v, n:u]   [m:u, n:v]   all-gathers B over u (n), reduce-scatters
                                                its product over v (n)
RS       [m:v, k:u]   [k:u, n:v]   [m:u, n:v]   all-gathers A over v (m), reduce-scatters
                                                its product over u (m)
======== ============ ============ ============ ==========================================

One letter (k, n or m: the *sliced* letter) is split over v in one operand and over u in
another, which no einsum rule makes (a letter has one split there): these layouts are
MeshSlice's. ``A`` is ``x`` (``x^T`` with ``transpose_x``; its leading dims with ``m`` are
the m-group, one of which carries m's split), ``B`` is the 2-D ``y`` (``y^T`` with
``transpose_y``). The backward GeMMs of a layer are these dataflows again on the same
layouts: the forward OS gives LS (``dA = dC B^T``) and RS (``dB = A^T dC``).

With K slices each process cuts its shard of the sliced letter into K sub-shards: sub-shard
k holds every K-th block of ``block`` consecutive indices (blocked, so each piece is
contiguous in memory). Then sub-shard k of every member of a group covers the same
global indices (those whose block number is k mod K), in order, whether the letter is
split over u or over v: gathering and reduce-scattering sub-shards keeps the product
exact. K must divide the shard of the sliced letter under both splits; ``block`` is the
largest size that makes that so.

:class:`MatmulRule` is matmul's sharding rule: the einsum rule of its notation, plus, when
the op's ``meshslice`` attribute is set (None: off; ``"auto"`` or a number of slices K),
these layouts among its strategies and in its answers (see :meth:`MeshSlicePlan.solve`).

Example::

    mesh = dg.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    layouts([(8, 6), (6, 4)], {}, mesh)[0]          # SliceLayout(OS over (x, y))
    layout_of(["x", "y"], ["x", "y"], ["x", "y"], [(8, 6), (6, 4)], {}, mesh).dataflow  # 'OS'
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from distgraph.spmd.einsum import EinsumRule
from distgraph.spmd.rule import OpStrategy, SpmdResult
from distgraph.spmd.specs import UNKNOWN, DimsSpec, SpmdRuleError

DATAFLOWS = ("OS", "LS", "RS")
# dataflow -> operand -> letter -> "u" or "v"
PATTERNS = {
    "OS": {"A": {"m": "u", "k": "v"}, "B": {"k": "u", "n": "v"}, "C": {"m": "u", "n": "v"}},
    "LS": {"A": {"m": "u", "k": "v"}, "B": {"k": "v", "n": "u"}, "C": {"m": "u", "n": "v"}},
    "RS": {"A": {"m": "v", "k": "u"}, "B": {"k": "u", "n": "v"}, "C": {"m": "u", "n": "v"}},
}
SLICED = {"OS": "k", "LS": "n", "RS": "m"}
STATIONARY = {"OS": "C", "LS": "A", "RS": "B"}


def slices_setting(value):
    """The ``meshslice`` attribute checked: None, ``"auto"`` or a number of slices >= 1."""
    if value is None or value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpmdRuleError(f"meshslice={value!r}: give None (off), 'auto' (the cost model "
                            "picks the number of slices) or a number of slices K >= 1")
    return value


@dataclass(frozen=True)
class MatmulAxes:
    """Where the letters of ``A[m, k] B[k, n] = C[m, n]`` sit in the stored tensors
    ``x``, ``y`` and the result: ``x_m`` (the m-group of x), ``x_k``, ``y_k``, ``y_n``,
    ``out_m``, ``out_n``. None when MeshSlice does not apply (``y`` not 2-D, or a
    transposed ``x`` with batch dims)."""

    x_m: tuple
    x_k: int
    y_k: int
    y_n: int
    out_m: tuple
    out_n: int

    @classmethod
    def of(cls, in_shapes, attrs) -> MatmulAxes | None:
        x, y = (tuple(s) for s in in_shapes)
        tx, ty = bool(attrs.get("transpose_x")), bool(attrs.get("transpose_y"))
        if len(y) != 2 or len(x) < 2 or (tx and len(x) != 2):
            return None
        x_m, x_k = ((1,), 0) if tx else (tuple(range(len(x) - 1)), len(x) - 1)
        y_k, y_n = (1, 0) if ty else (0, 1)
        return cls(x_m, x_k, y_k, y_n, tuple(range(len(x) - 1)), len(x) - 1)

    def out_shape(self, in_shapes) -> tuple:
        x, y = in_shapes
        return tuple(x[a] for a in self.x_m) + (y[self.y_n],)


@dataclass(frozen=True)
class SliceLayout:
    """One MeshSlice layout of a matmul: ``dataflow`` ("OS", "LS" or "RS") on mesh dims
    ``(u, v)``, with m's split on dim ``m_pos`` of the m-group (module table)."""

    dataflow: str
    u: str
    v: str
    m_pos: int = 0

    def __str__(self) -> str:
        return f"{self.dataflow} over ({self.u}, {self.v})"

    def dim(self, operand: str, letter: str) -> str:
        """The mesh dim that splits ``letter`` of ``operand`` ("A", "B" or "C")."""
        return self.u if PATTERNS[self.dataflow][operand][letter] == "u" else self.v

    def specs(self, axes: MatmulAxes, in_shapes) -> tuple:
        """(x, y, result) as DimsSpecs."""
        x_nd = len(in_shapes[0])
        x = [None] * x_nd
        x[axes.x_m[self.m_pos]] = self.dim("A", "m")
        x[axes.x_k] = self.dim("A", "k")
        y = [None, None]
        y[axes.y_k] = self.dim("B", "k")
        y[axes.y_n] = self.dim("B", "n")
        out = [None] * len(axes.out_m) + [None]
        out[axes.out_m[self.m_pos]] = self.dim("C", "m")
        out[axes.out_n] = self.dim("C", "n")
        return DimsSpec(tuple(x)), DimsSpec(tuple(y)), DimsSpec(tuple(out))

    def slicing(self, axes: MatmulAxes, in_shapes, sizes: dict) -> tuple:
        """(global length of the sliced letter, ways it is split where it is gathered
        or scattered from, ways where it lands): the two splits K must divide."""
        x, y = in_shapes
        letter = SLICED[self.dataflow]
        length = {"k": x[axes.x_k], "n": y[axes.y_n], "m": x[axes.x_m[self.m_pos]]}[letter]
        first, second = {"OS": (("A", "k"), ("B", "k")), "LS": (("B", "n"), ("C", "n")),
                         "RS": (("A", "m"), ("C", "m"))}[self.dataflow]
        return length, sizes[self.dim(*first)], sizes[self.dim(*second)]


def slice_choices(length: int, parts_a: int, parts_b: int) -> tuple:
    """Every number of slices K that divides the shard of a letter of ``length`` split
    ``parts_a`` and ``parts_b`` ways."""
    common = math.gcd(length // parts_a, length // parts_b)
    return tuple(k for k in range(1, common + 1) if common % k == 0)


def block_size(length: int, parts_a: int, parts_b: int, slices: int) -> int:
    """The contiguous block of a sub-shard: the largest size whose blocks, dealt out
    every K-th, give each member's sub-shard k the same global indices under both
    splits."""
    return math.gcd(length // (parts_a * slices), length // (parts_b * slices))


def layouts(in_shapes, attrs, mesh) -> list:
    """Every MeshSlice layout of a matmul with ``in_shapes`` and ``attrs`` on ``mesh``:
    on each ordered pair of distinct mesh dims of size > 1 (in mesh order first: every
    result then lies rows over the first dim, as the paper stores all matrices), each
    dataflow, m split on each dim of the m-group, where every split divides its dim and
    (when ``attrs`` fix K) K divides the sliced shard."""
    axes = MatmulAxes.of(in_shapes, attrs)
    if axes is None:
        return []
    slices = slices_setting(attrs.get("meshslice"))
    sizes = dict(zip(mesh.dim_names, mesh.shape))
    dims = [d for d in mesh.dim_names if sizes[d] > 1]
    shapes = [tuple(s) for s in in_shapes] + [axes.out_shape(in_shapes)]
    found = []
    for u in dims:
        for v in dims:
            if u == v:
                continue
            for dataflow in DATAFLOWS:
                for m_pos in range(len(axes.x_m)):
                    lay = SliceLayout(dataflow, u, v, m_pos)
                    specs = lay.specs(axes, in_shapes)
                    if any(n % sizes[e] for spec, shape in zip(specs, shapes)
                           for e, n in zip(spec.dims, shape) if e is not None):
                        continue
                    if isinstance(slices, int) and \
                            slices not in slice_choices(*lay.slicing(axes, in_shapes, sizes)):
                        continue
                    found.append(lay)
    return found


def layout_of(x_spec, y_spec, out_spec, in_shapes, attrs, mesh) -> SliceLayout | None:
    """The MeshSlice layout these (complete) specs are, or None."""
    axes = MatmulAxes.of(in_shapes, attrs)
    if axes is None:
        return None
    given = tuple(DimsSpec.of(s) for s in (x_spec, y_spec, out_spec))
    if getattr(out_spec, "partial", None):
        return None
    for lay in layouts(in_shapes, {k: v for k, v in attrs.items() if k != "meshslice"},
                       mesh):
        if tuple(s.dims for s in lay.specs(axes, in_shapes)) == tuple(s.dims for s in given):
            return lay
    return None


class MatmulRule(EinsumRule):
    """Matmul's rule: the einsum rule of its notation; with the ``meshslice`` attribute
    set, also MeshSlice's layouts (:class:`MeshSlicePlan`)."""

    def bind(self, in_shapes, out_shapes, mesh, attrs: dict):
        plan = super().bind(in_shapes, out_shapes, mesh, attrs)
        if slices_setting(attrs.get("meshslice")) is None:
            return plan
        found = layouts(in_shapes, attrs, mesh)
        every = layouts(in_shapes, {k: v for k, v in attrs.items() if k != "meshslice"}, mesh)
        if not every:
            return plan
        return MeshSlicePlan(plan, found, MatmulAxes.of(in_shapes, attrs), in_shapes, mesh,
                             [lay for lay in every if lay not in found],
                             attrs.get("meshslice"))


class MeshSlicePlan:
    """A matmul's einsum plan (``base``) with MeshSlice's ``found`` layouts beside it
    (a :class:`~distgraph.spmd.rule.BoundRule`); ``excluded``: the layouts the fixed
    number of slices ``slices`` does not divide."""

    def __init__(self, base, found, axes, in_shapes, mesh, excluded=(), slices=None):
        self.base, self.found, self.axes, self.mesh = base, tuple(found), axes, mesh
        self.in_shapes = [tuple(s) for s in in_shapes]
        self.out_shape = axes.out_shape(self.in_shapes)
        self.specs = [lay.specs(axes, self.in_shapes) for lay in self.found]
        self.excluded, self.slices = tuple(excluded), slices

    def _check_fixed_k(self, query) -> None:
        """SpmdRuleError when the fixed inputs are a layout the fixed K does not divide:
        the op was asked to run as MeshSlice there, and cannot."""
        if len(query.fixed_in) < 2:
            return
        given = tuple(query.spec(s).dims for s in query.sources() if s.side == "input"
                      and query.is_fixed(s))
        for lay in self.excluded:
            x, y, _ = lay.specs(self.axes, self.in_shapes)
            if sorted(map(str, given)) == sorted(map(str, (x.dims, y.dims))):
                length, a, b = lay.slicing(self.axes, self.in_shapes,
                                           dict(zip(self.mesh.dim_names, self.mesh.shape)))
                raise SpmdRuleError(f"meshslice={self.slices}: the operands are laid out for "
                                    f"MeshSlice {lay}, whose sliced dim ({length}, split "
                                    f"{a} and {b} ways) takes K in "
                                    f"{slice_choices(length, a, b)}; choose one of those")

    def strategies(self) -> list:
        """The einsum rule's strategies, then one per MeshSlice layout."""
        found = list(self.base.strategies())
        for lay, (x, y, out) in zip(self.found, self.specs):
            s = OpStrategy.build(self.mesh, [x, y], [out], self.in_shapes, [self.out_shape])
            found.append(replace(s, name=f"{s.name} (MeshSlice {lay.dataflow})"))
        return found

    def solve(self, query) -> SpmdResult:
        """The einsum rule's answer, unless the known specs show a MeshSlice layout: one
        that every fixed operand (and the ``lead``) agrees with entry for entry, whose
        agreeing known entries name both of its mesh dims, and that needs no more
        communication around the op than the einsum answer (:func:`_moves`). Ties go to
        the earlier layout (mesh dims in mesh order, then OS, LS, RS)."""
        self._check_fixed_k(query)
        base = self.base.solve(query)
        best, best_moves = None, None
        for lay, specs in zip(self.found, self.specs):
            named, fits = set(), True
            for source in query.sources():
                known = query.spec(source)
                mine = specs[source.index] if source.side == "input" else specs[2]
                firm = query.is_fixed(source) or source == query.lead
                if firm and source.side == "output" and known.partial:
                    fits = False
                for entry, want in zip(known.dims, mine.dims):
                    if entry is UNKNOWN:
                        continue
                    if entry == want:
                        if want is not None:
                            named.add(want)
                    elif firm:
                        fits = False
            if not fits or named != {lay.u, lay.v}:
                continue
            moves = _moves(query, specs[:2], specs[2:])
            if best is None or moves < best_moves:
                best, best_moves = (lay, specs), moves
        if best is None or best_moves > _moves(query, base.in_specs, base.out_specs):
            return base
        lay, (x, y, out) = best
        resharded = []
        for source in query.sources():
            known = query.spec(source)
            mine = (x, y)[source.index] if source.side == "input" else out
            if any(e is not UNKNOWN and e != w for e, w in zip(known.dims, mine.dims)):
                resharded.append(source)
        notes = (f"MeshSlice {lay}: a 2-D GeMM that keeps "
                 f"{STATIONARY[lay.dataflow]} where it is",)
        return SpmdResult((x, y), (out,), notes + tuple(
            f"{s} is resharded to the MeshSlice layout" for s in resharded), tuple(resharded))


def _moves(query, ins, outs) -> int:
    """How many reshards that communicate an answer (``ins`` consumed, ``outs``
    produced) needs against the query's known specs: per operand dim laid out otherwise
    than known, unless the change is a local slice (an input known unsplit that the op
    consumes split, an output made unsplit that its consumers want split), plus one per
    Partial output its consumers do not take as such."""
    moves = 0
    for source in query.sources():
        known = query.spec(source)
        inp = source.side == "input"
        mine = (ins if inp else outs)[source.index]
        for entry, want in zip(known.dims, mine.dims):
            if entry is UNKNOWN or entry == want:
                continue
            sliced = entry is None if inp else want is None
            moves += 0 if sliced else 1
    for j, spec in enumerate(outs):
        known = query.out_specs[j] if j < len(query.out_specs) else None
        if spec.partial and (known is None or known.partial != spec.partial):
            moves += 1
    return moves
