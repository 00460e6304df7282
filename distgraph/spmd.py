"""Sharding (SPMD) rules: which shard specs an op consumes and produces.

Completion works on specs whose entries may still be unknown (``UNKNOWN``, printed
``?``), so rules take and return :class:`DimsSpec` — the completion-time form of a
ShardSpec. Almost every op's rule is generated from an einsum-like notation::

    "mk,kn->mn"        matmul: k is contracted, so a split k makes the output Partial
    "abc->abc"         elementwise
    "abC->abC"         softmax over the last axis: UPPERCASE letters are never split
    "a1c,abc->abc"     broadcasting: '1' is a size-1 dim stretched, never split

Per letter the entries of all operands are merged on the semilattice
unknown < {None, 'x', ('x','y'), ...}: the first known entry (fixed annotations first —
an annotated result before annotated operands — then operand order) wins and any
different known entry is reported as a conflict ("input 1 dim 'k' wants y, kept x;
input 1 is resharded"): the rule's spec for that operand is what the op consumes, and
the reshard pass moves the operand there. A mesh dim that would split two letters is
dropped from the later one; a split that does not divide every dim of its letter is
dropped too.
For each output, the mesh dims of letters it lacks (contracted, reduced) become Partial.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence


class _Unknown:
    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "?"

    def __reduce__(self):
        return (_Unknown, ())


UNKNOWN = _Unknown()


def entry_dims(entry) -> tuple:
    """The mesh dims an entry uses: None -> (), 'x' -> ('x',), ('x','y') -> ('x','y')."""
    if entry is None or entry is UNKNOWN:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def entry_str(entry) -> str:
    if entry is None or entry is UNKNOWN:
        return repr(entry) if entry is UNKNOWN else "None"
    return entry if isinstance(entry, str) else "(" + ",".join(entry) + ")"


@dataclass(frozen=True, slots=True)
class DimsSpec:
    """A shard spec during completion: entries may be UNKNOWN. ``str``: ``[x, ?] P(y)``."""

    dims: tuple
    partial: frozenset = frozenset()

    @staticmethod
    def unknown(ndim: int) -> "DimsSpec":
        return DimsSpec((UNKNOWN,) * ndim)

    @staticmethod
    def of(spec) -> "DimsSpec":
        """Accept a DimsSpec, a ShardSpec, or a plain list of entries."""
        if isinstance(spec, DimsSpec):
            return spec
        if hasattr(spec, "dims") and hasattr(spec, "partial"):
            return DimsSpec(tuple(spec.dims), frozenset(spec.partial))
        return DimsSpec(tuple(_normalise(e) for e in spec))

    @property
    def is_complete(self) -> bool:
        return UNKNOWN not in self.dims

    def known(self) -> "DimsSpec":
        """Unknown entries become None (what completion does at the end)."""
        if UNKNOWN not in self.dims:
            return self
        return DimsSpec(tuple(None if e is UNKNOWN else e for e in self.dims), self.partial)

    def __str__(self) -> str:
        s = "[" + ", ".join(entry_str(e) for e in self.dims) + "]"
        if self.partial:
            s += " P(" + ",".join(sorted(self.partial)) + ")"
        return s


def _normalise(entry):
    if isinstance(entry, (list, tuple)):
        entry = tuple(entry)
        return entry[0] if len(entry) == 1 else entry
    return entry


@dataclass(frozen=True, slots=True)
class SpmdResult:
    """What a rule decided: consumer specs of the inputs, producer specs of the outputs,
    and human-readable notes on conflicts and dropped splits (for the explain view)."""

    in_specs: tuple
    out_specs: tuple
    notes: tuple = ()


def _mesh_sizes(mesh) -> dict:
    return dict(zip(mesh.dim_names, mesh.shape))


class EinsumRule:
    """A rule generated from einsum-like notation (see the module docstring).

    ``notation`` is a string, or a function ``(in_shapes, attrs) -> str`` for ops whose
    notation depends on ranks and attributes. ``linear`` says whether contracted letters
    may be split (the output is then Partial); when False they are never split.
    ``internal`` names letters the op reduces with its own communication when they are
    split (its distributed form): they may be split and make no output Partial.
    """

    def __init__(self, notation: str | Callable, linear: bool = True, internal: str = ""):
        self._notation = notation
        self.linear = linear
        self.internal = internal

    def notation(self, in_shapes: Sequence[tuple], attrs: dict) -> str:
        if callable(self._notation):
            return self._notation([tuple(s) for s in in_shapes], attrs)
        return self._notation

    def __repr__(self) -> str:
        n = self._notation if isinstance(self._notation, str) else self._notation.__name__
        return f"EinsumRule({n})"

    def infer_forward(self, in_specs, in_shapes, mesh, fixed=(), **attrs) -> SpmdResult:
        """Inputs -> outputs. ``fixed`` lists operand indices whose specs are annotations."""
        return self.infer(in_specs, None, in_shapes, None, mesh, fixed, (), False, **attrs)

    def infer_backward(self, in_specs, out_specs, in_shapes, out_shapes, mesh, fixed=(),
                       **attrs) -> SpmdResult:
        """Outputs (and what is known of inputs) -> inputs; outputs take priority."""
        return self.infer(in_specs, out_specs, in_shapes, out_shapes, mesh, fixed, (), True,
                          **attrs)

    def infer(self, in_specs, out_specs, in_shapes, out_shapes, mesh, fixed_in=(), fixed_out=(),
              outputs_first=False, **attrs) -> SpmdResult:
        """The general form used by completion: sources in priority order are the fixed
        outputs (an annotated result is produced as annotated), the fixed inputs, then the
        other inputs and outputs (outputs first when ``outputs_first``)."""
        ins = [DimsSpec.of(s) for s in in_specs]
        outs = [DimsSpec.of(s) for s in (out_specs or [])]
        plan = self.compile(in_shapes, out_shapes, mesh, attrs)
        return plan.solve(ins, outs, set(fixed_in), set(fixed_out), outputs_first)

    def compile(self, in_shapes, out_shapes, mesh, attrs: dict) -> "EinsumPlan":
        """The notation parsed for these shapes, attributes and mesh: everything about a
        call that does not depend on the specs (completion reuses it across calls)."""
        return EinsumPlan(self.notation(in_shapes, attrs), in_shapes, out_shapes, mesh,
                          self.linear, self.internal)


class EinsumPlan:
    """An EinsumRule's notation parsed for one set of shapes and one mesh; ``solve``
    merges specs (the semilattice merge of the module docstring)."""

    def __init__(self, notation: str, in_shapes, out_shapes, mesh, linear: bool,
                 internal: str = ""):
        self.notation = notation
        self.linear = linear
        self.internal = set(internal)
        lhs, rhs = notation.split("->")
        self.lhs = lhs
        self.out_letters = rhs.split(",")
        self.sizes = _mesh_sizes(mesh)
        self.dim_sizes: dict[str, set] = {}
        in_letters = lhs.split(",") if lhs else []
        for letters, shapes in ((in_letters, in_shapes), (self.out_letters, out_shapes or [])):
            for word, shape in zip(letters, shapes):
                for letter, n in zip(word, shape):
                    self.dim_sizes.setdefault(letter, set()).add(n)
        self.order: list[str] = []             # letters in order of first appearance
        for word in in_letters + self.out_letters:
            for letter in word:
                if letter not in self.order and letter != "1":
                    self.order.append(letter)

    def solve(self, ins, outs, fixed_in, fixed_out, outputs_first) -> SpmdResult:
        notation, out_letters, sizes = self.notation, self.out_letters, self.sizes
        lhs = self.lhs
        # "" is either no operand or one 0-d operand; the operand count decides
        in_letters = lhs.split(",") if (lhs or len(ins) == 1) else []
        if len(in_letters) != len(ins):
            raise ValueError(f"rule {notation!r} expects {len(in_letters)} inputs, got {len(ins)}")
        notes: list[str] = []

        in_sources = [(in_letters[i], ins[i], f"input {i}") for i in range(len(ins))]
        out_sources = [(out_letters[j], outs[j], f"output {j}") for j in range(len(outs))]
        fixed = [out_sources[j] for j in sorted(fixed_out) if j < len(out_sources)]
        fixed += [in_sources[i] for i in sorted(fixed_in)]
        rest = [s for i, s in enumerate(in_sources) if i not in fixed_in]
        rest_out = [s for j, s in enumerate(out_sources) if j not in fixed_out]
        sources = fixed + (rest_out + rest if outputs_first else rest + rest_out)

        order = self.order
        merged: dict[str, object] = {c: None for c in order if c.isupper()}
        for word, spec, who in sources:
            if len(word) != len(spec.dims):
                raise ValueError(f"rule {notation!r}: {who} has {len(spec.dims)} dims, "
                                 f"notation says {len(word)}")
            for letter, entry in zip(word, spec.dims):
                if letter == "1" or entry is UNKNOWN:
                    continue
                if letter not in merged:
                    merged[letter] = entry
                elif merged[letter] != entry:
                    why = "that dim is never split here" if letter.isupper() \
                        else f"kept {entry_str(merged[letter])}"
                    notes.append(f"{who} dim '{letter}' wants {entry_str(entry)}, {why}; "
                                 f"{who} is resharded")

        # Drop splits that do not divide their dims, then mesh dims used by two letters.
        used: set = set()
        dim_sizes = self.dim_sizes
        for letter in order:
            entry = merged.get(letter, UNKNOWN)
            if entry is UNKNOWN or entry is None:
                continue
            dims = entry_dims(entry)
            ways = 1
            for d in dims:
                if d not in sizes:
                    raise ValueError(f"mesh dim {d!r} is not in mesh dims {list(sizes)}")
                ways *= sizes[d]
            if any(n % ways for n in dim_sizes.get(letter, ())):
                notes.append(f"dim '{letter}' of size {sorted(dim_sizes[letter])} cannot be "
                             f"split {ways} ways over {entry_str(entry)}; left unsplit")
                merged[letter] = None
            elif used & set(dims):
                notes.append(f"mesh dim(s) {entry_str(entry)} already split another dim; "
                             f"dim '{letter}' left unsplit")
                merged[letter] = None
            else:
                used |= set(dims)
        if not self.linear:
            contracted = set("".join(in_letters)) - set("".join(out_letters)) - self.internal
            for letter in sorted(contracted):
                if merged.get(letter) not in (None, UNKNOWN):
                    notes.append(f"dim '{letter}' is reduced non-linearly; left unsplit")
                merged[letter] = None

        def spec_of(word, partial=frozenset()):
            return DimsSpec(tuple(None if c == "1" else merged.get(c, UNKNOWN) for c in word),
                            partial)

        new_ins = tuple(spec_of(w) for w in in_letters)
        all_in = set("".join(in_letters)) - self.internal
        new_outs = []
        for word in out_letters:
            partial = set()
            for letter in all_in - set(word):
                partial |= set(entry_dims(merged.get(letter)))
            new_outs.append(spec_of(word, frozenset(partial)))
        return SpmdResult(new_ins, tuple(new_outs), tuple(notes))


# -- notation builders shared by op families -------------------------------------------------
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def broadcast_notation(in_shapes, attrs=None, upper_axes=()) -> str:
    """Elementwise with numpy broadcasting: 'a1c,bc->abc' style; ``upper_axes`` (output
    axes, negative allowed) are never split."""
    rank = max((len(s) for s in in_shapes), default=0)
    out_shape = [1] * rank
    for s in in_shapes:
        for i, n in enumerate(s):
            j = rank - len(s) + i
            out_shape[j] = max(out_shape[j], n)
    upper = {a % rank for a in upper_axes} if rank else set()
    out = "".join(LETTERS[i].upper() if i in upper else LETTERS[i] for i in range(rank))
    words = []
    for s in in_shapes:
        off = rank - len(s)
        words.append("".join("1" if n == 1 and out_shape[off + i] != 1 else out[off + i]
                             for i, n in enumerate(s)))
    return ",".join(words) + "->" + out


def elementwise_rule(n_out: int = 1) -> EinsumRule:
    """Broadcasting elementwise op with ``n_out`` outputs of the broadcast shape."""

    def notation(in_shapes, attrs):
        base = broadcast_notation(in_shapes)
        lhs, out = base.split("->")
        return lhs + "->" + ",".join([out] * n_out)

    notation.__name__ = f"elementwise{n_out}"
    return EinsumRule(notation)


def axis_rule(n_in: int = 1, n_out: int = 1) -> EinsumRule:
    """Same-shape operands; the ``axis`` attribute's dim is never split (softmax, ...)."""

    def notation(in_shapes, attrs):
        rank = len(in_shapes[0])
        axis = attrs.get("axis", -1) % rank
        word = "".join(LETTERS[i].upper() if i == axis else LETTERS[i] for i in range(rank))
        return ",".join([word] * n_in) + "->" + ",".join([word] * n_out)

    notation.__name__ = "axis"
    return EinsumRule(notation)
