"""Rules generated from einsum-like notation, and the notation builders op families share.

``EinsumRule(notation)`` binds the notation to shapes and a mesh (:class:`EinsumPlan`),
which merges the operands' specs letter by letter (the tie-break of
:mod:`distgraph.spmd`) and lists the op's strategies: every assignment of each mesh dim
(of size > 1) to one splittable letter or to none, in every order where one letter
takes several, that divides every dim of its letter.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from distgraph.spmd.align import align_unused
from distgraph.spmd.keep import split_most
from distgraph.spmd.rule import OpStrategy, Rule, RuleQuery, SpmdResult
from distgraph.spmd.specs import UNKNOWN, DimsSpec, SpmdRuleError, entry_dims, entry_of, entry_str

LETTERS = "abcdefghijklmnopqrstuvwxyz"
PENDING = "P"     # owner of a mesh dim a linear op's operands are pending sums over


class EinsumRule(Rule):
    """A rule generated from einsum-like notation (see :mod:`distgraph.spmd`).

    ``notation`` is a string, or a function ``(in_shapes, attrs) -> str`` for ops whose
    notation depends on ranks and attributes (it checks and normalises the attributes it
    reads). ``internal`` names letters the op reduces with its own communication when
    they are split (its distributed form): they may be split and make no output Partial.
    ``out_shapes(in_shapes, attrs)`` gives the output shapes when a call does not (an
    output whose sizes its inputs do not show, as reshape's). ``linear``: the op is a sum
    of its operands (add, subtract), so operands that are all pending sums over the same
    mesh dims are consumed as they are and the result is that pending sum
    (``P x P -> P``: the sum of pending sums is one pending sum; gradient accumulation
    then reduces once, as Megatron does, not once per contribution). ``reads``: the
    attributes a notation or ``out_shapes`` function reads (None: any; a string
    notation without ``out_shapes`` reads none). ``align``: a mesh dim an answer leaves
    unused that an operand offers splits a dim every operand has instead of being
    gathered (concat's rule, as Paddle's: :mod:`distgraph.spmd.align`). ``sliced``: an
    output may be split on a dim the notation never splits (uppercase) where it asks to
    be (its known spec, e.g. what its consumers take): the op computes that slice of its
    result from operands whole there (R -> S, moving nothing); otherwise it is whole
    there. The search is not offered such layouts (a slice after the op is free too).
    """

    def __init__(self, notation: str | Callable, internal: str = "",
                 out_shapes: Callable | None = None, linear: bool = False,
                 reads: tuple | None = None, align: bool = False, sliced: bool = False):
        self._notation = notation
        self.sliced = sliced
        self.internal = internal
        self._out_shapes = out_shapes
        self.linear = linear
        self._reads = reads
        self.align = align

    @property
    def reads(self) -> tuple | None:
        if type(self) is not EinsumRule:        # a subclass's bind may read more
            return None
        if self._reads is not None:
            return tuple(self._reads)
        return () if isinstance(self._notation, str) and self._out_shapes is None else None

    def notation(self, in_shapes: Sequence[tuple], attrs: dict) -> str:
        if callable(self._notation):
            return self._notation([tuple(s) for s in in_shapes], attrs)
        return self._notation

    def __repr__(self) -> str:
        n = self._notation if isinstance(self._notation, str) else self._notation.__name__
        return f"EinsumRule({n})"

    def bind(self, in_shapes, out_shapes, mesh, attrs: dict) -> EinsumPlan:
        """The notation parsed for these shapes, attributes and mesh: everything about a
        call that does not depend on the specs (completion reuses it across calls)."""
        notation = self.notation(in_shapes, attrs)
        if out_shapes is None and self._out_shapes is not None:
            out_shapes = self._out_shapes(in_shapes, attrs)
        return EinsumPlan(notation, in_shapes, out_shapes, mesh, self.internal, self.linear,
                          self.align, self.sliced)


class EinsumPlan:
    """An EinsumRule bound to shapes and a mesh (a :class:`~distgraph.spmd.rule.BoundRule`)."""

    def __init__(self, notation: str, in_shapes, out_shapes, mesh, internal: str = "",
                 linear: bool = False, align: bool = False, sliced: bool = False):
        self.notation = notation
        self.internal = set(internal)
        self.linear = linear
        self.align = align
        lhs, rhs = notation.split("->")
        # "" is either no operand or one 0-d operand; the operand count decides
        self.in_letters = lhs.split(",") if (lhs or len(in_shapes) == 1) else []
        self.out_letters = rhs.split(",")
        # the letters solve() reads outputs by: with ``sliced`` an output's uppercase
        # letter has a lowercase twin of its own, split only where that output asks (the
        # op then computes the slice), whole otherwise; strategies, reductions and
        # lightness keep the op's own letters
        self.twins = {c.lower(): c for w in self.out_letters for c in w
                      if sliced and c.isupper()}
        if set(self.twins) & set(lhs):
            raise SpmdRuleError(f"rule {notation!r}: a sliced letter's lowercase is taken")
        self.out_words = [w.lower() if sliced else w for w in self.out_letters]
        if len(self.in_letters) != len(in_shapes):
            raise SpmdRuleError(f"rule {notation!r} expects {len(self.in_letters)} inputs, "
                                f"got {len(in_shapes)}")
        self.mesh = mesh
        self.sizes = dict(zip(mesh.dim_names, mesh.shape))
        self.in_shapes = [tuple(s) for s in in_shapes]
        self.out_shapes = [tuple(s) for s in out_shapes] if out_shapes is not None else None
        self.dim_sizes: dict[str, set] = {}
        words = [(w, s, f"input {i}") for i, (w, s) in enumerate(zip(self.in_letters, in_shapes))]
        words += [(w, s, f"output {j}")
                  for j, (w, s) in enumerate(zip(self.out_words, out_shapes or []))]
        for word, shape, who in words:
            if len(word) != len(shape):
                raise SpmdRuleError(f"rule {notation!r}: {who} has shape {list(shape)}, the "
                                    f"notation gives it {len(word)} dims")
            for letter, n in zip(word, shape):
                self.dim_sizes.setdefault(letter, set()).add(n)
        self.order: list[str] = []             # letters in order of first appearance
        for word in self.in_letters + self.out_words:
            for letter in word:
                if letter not in self.order and letter != "1":
                    self.order.append(letter)
        contracted = set("".join(self.in_letters)) - self.internal
        self.reduced = [contracted - set(w) for w in self.out_letters]

    # -- solve: merge the operands' specs letter by letter ------------------------------
    def _ways(self, dims) -> int:
        ways = 1
        for d in dims:
            if d not in self.sizes:
                raise SpmdRuleError(f"mesh dim {d!r} is not in mesh dims {list(self.sizes)}")
            ways *= self.sizes[d]
        return ways

    def _keep(self, letter, dims, owner) -> tuple:
        """The longest-splitting part of ``dims`` (in order) whose mesh dims are free and
        whose product divides every dim of ``letter``; earlier mesh dims win ties."""
        best, best_ways = (), 0
        for r in range(len(dims), 0, -1):
            for sub in itertools.combinations(dims, r):
                ways = self._ways(sub)
                if ways > best_ways and not any(d in owner for d in sub) and \
                        not any(n % ways for n in self.dim_sizes.get(letter, ())):
                    best, best_ways = sub, ways
        return best

    def solve(self, query: RuleQuery) -> SpmdResult:
        ins = query.in_specs
        if len(ins) != len(self.in_letters):
            raise SpmdRuleError(f"rule {self.notation!r} expects {len(self.in_letters)} "
                                f"inputs, got {len(ins)}")
        words = {}
        for source in query.sources():
            side = self.in_letters if source.side == "input" else self.out_words
            if source.index >= len(side):
                raise SpmdRuleError(f"rule {self.notation!r} has {len(side)} {source.side}s, "
                                    f"got a spec for {source}")
            word, spec = side[source.index], query.spec(source)
            if len(word) != len(spec.dims):
                raise SpmdRuleError(f"rule {self.notation!r}: {source} spec {spec} has "
                                    f"{len(spec.dims)} dims, the notation gives it {len(word)}")
            words[source] = word
        pending = self.pending(ins)
        answer = self._merge(query, words, query.sources(), pending)
        if answer[3]:      # a second opinion: split more at no more resharding
            answer = split_most(self, query, words, answer[0], set(answer[3]),
                                pending) or answer
        if answer[3] and self.align:     # the mesh dims left unused split a free dim
            answer = align_unused(self, query, words, answer[0], pending) or answer
        return self._result(*answer, pending)

    def pending(self, in_specs) -> frozenset:
        """The mesh dims over which a linear op's operands are all pending sums (kept
        pending through the op); empty for other ops. A mesh dim of size 1 is no sum."""
        if not self.linear or not in_specs:
            return frozenset()
        common = frozenset.intersection(*(frozenset(s.partial) for s in in_specs))
        return frozenset(m for m in common if self.sizes.get(m, 1) > 1)

    def _merge(self, query, words, order, pending=frozenset()) -> tuple:
        """The tie-break of :mod:`distgraph.spmd` over ``order``: (decided, seen, notes,
        resharded); ``decided[letter]`` the mesh dims splitting it, ``seen`` the letters
        some operand has a known entry for."""
        notes: list[str] = []
        resharded: list = []
        # decided[letter]: the mesh dims splitting it; a letter not in it is still open
        decided: dict[str, tuple] = {c: () for c in self.order if c.isupper()}
        # mesh dim -> the letter it splits (a pending sum's mesh dims split none)
        owner: dict[str, str] = {m: PENDING for m in pending}
        seen: set = set()                     # letters some operand has a known entry for
        for source in order:
            for letter, entry in zip(words[source], query.spec(source).dims):
                if letter == "1" or entry is UNKNOWN:
                    continue
                seen.add(letter)
                dims = entry_dims(entry)
                self._ways(dims)              # every mesh dim named is in the mesh
                if letter in decided:
                    if decided[letter] != dims:
                        why = ("that dim is never split here" if letter.isupper()
                               else f"kept {entry_str(entry_of(decided[letter]))}")
                        notes.append(f"{source} dim '{letter}' wants {entry_str(entry)}, "
                                     f"{why}; {source} is resharded")
                        resharded.append(source)
                    continue
                if not dims:
                    decided[letter] = ()
                    continue
                keep = self._keep(letter, dims, owner)
                if keep:
                    decided[letter] = keep
                    owner.update((d, letter) for d in keep)
                if keep != dims:
                    notes.append(self._drop_note(source, letter, entry, keep, owner))
                    resharded.append(source)
        return decided, seen, notes, resharded

    def _result(self, decided, seen, notes, resharded, pending=frozenset()) -> SpmdResult:
        def final(letter):
            if letter in decided:
                return entry_of(decided[letter])
            if letter in self.twins:          # whole where no output asks for a slice
                return None
            return None if letter in seen else UNKNOWN

        merged = {c: final(c) for c in self.order}

        def spec_of(word, partial=frozenset()):
            return DimsSpec(tuple(None if c == "1" else merged[c] for c in word), partial)

        new_ins = tuple(spec_of(w, pending) for w in self.in_letters)
        new_outs = []
        for word, reduced in zip(self.out_words, self.reduced):
            partial = set(pending)
            for letter in reduced:
                partial.update(entry_dims(merged.get(letter)))
            new_outs.append(spec_of(word, frozenset(partial)))
        return SpmdResult(new_ins, tuple(new_outs), tuple(notes), tuple(dict.fromkeys(resharded)))

    def light(self) -> bool:
        """No letter is contracted between two operands (Alpa's "light" ops:
        elementwise, norms, reshapes, reductions of one operand)."""
        outs = set("".join(self.out_letters))
        seen: dict = {}
        for word in self.in_letters:
            for letter in set(word):
                seen[letter] = seen.get(letter, 0) + 1
        return not any(n > 1 and c not in outs and c not in self.internal and c != "1"
                       for c, n in seen.items())

    def divides(self, letter, dims) -> bool:
        """Whether ``dims`` together divide every dim of ``letter``."""
        ways = self._ways(dims)
        return not any(n % ways for n in self.dim_sizes.get(letter, ()))

    def _drop_note(self, source, letter, entry, keep, owner) -> str:
        dims = entry_dims(entry)
        taken = [d for d in dims if d in owner and owner[d] != letter]
        reasons = [f"the operands are pending sums over mesh dim {d}" if owner[d] == PENDING
                   else f"mesh dim {d} already splits dim '{owner[d]}'" for d in taken]
        free = [d for d in dims if d not in taken]
        if free and free != list(keep):
            sizes = sorted(self.dim_sizes.get(letter, ()))
            reasons.append(f"dim '{letter}' of size {sizes} cannot be split "
                           f"{self._ways(free)} ways over {entry_str(entry_of(tuple(free)))}")
        kept = f"kept {entry_str(entry_of(keep))}" if keep else "left unsplit"
        return (f"{source} dim '{letter}' wants {entry_str(entry)}: {'; '.join(reasons)}; "
                f"{kept}; {source} is resharded")

    # -- strategies ---------------------------------------------------------------------
    def strategies(self) -> list:
        """Every assignment of the mesh dims (of size > 1) to the splittable letters
        (lowercase, not '1'), each letter's mesh dims in every order, that divides every
        dim of its letter; the replicated strategy first."""
        if self.out_shapes is None:
            raise SpmdRuleError("strategies need the output shapes")
        letters = [c for c in self.order if c.islower() and c not in self.twins]
        mesh_dims = [m for m in self.sizes if self.sizes[m] > 1]
        found = []
        for choice in itertools.product([None] + letters, repeat=len(mesh_dims)):
            groups: dict[str, list] = {}
            for m, letter in zip(mesh_dims, choice):
                if letter is not None:
                    groups.setdefault(letter, []).append(m)
            if any(any(n % self._ways(ms) for n in self.dim_sizes[c]) for c, ms in groups.items()):
                continue
            names = list(groups)
            for orders in itertools.product(*(itertools.permutations(groups[c]) for c in names)):
                merged = {c: entry_of(dims) for c, dims in zip(names, orders)}
                ins = [DimsSpec(tuple(merged.get(c) for c in w)) for w in self.in_letters]
                outs = []
                for word, reduced in zip(self.out_letters, self.reduced):
                    partial = frozenset(m for c in reduced for m in entry_dims(merged.get(c)))
                    outs.append(DimsSpec(tuple(merged.get(c) for c in word), partial))
                found.append(OpStrategy.build(self.mesh, ins, outs, self.in_shapes,
                                              self.out_shapes))
                if self.linear:        # P x P -> P over the mesh dims left unsplit
                    free = [m for m in mesh_dims if m not in
                            {d for dims in orders for d in dims}]
                    for r in range(1, len(free) + 1):
                        for sums in itertools.combinations(free, r):
                            p = frozenset(sums)
                            found.append(OpStrategy.build(
                                self.mesh, [DimsSpec(s.dims, p) for s in ins],
                                [DimsSpec(s.dims, s.partial | p) for s in outs],
                                self.in_shapes, self.out_shapes))
        return found


# -- attribute checks shared by notation builders -------------------------------------------
def axis_of(value, rank: int, name: str = "axis") -> int:
    """One axis, negative counted from the end; SpmdRuleError if out of range."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpmdRuleError(f"{name}={value!r} must be an int")
    if not -rank <= value < max(rank, 1):
        raise SpmdRuleError(f"{name}={value} is out of range for a {rank}-d operand")
    return value % rank if rank else 0


def axes_of(value, rank: int, name: str = "axis") -> tuple:
    """None (every axis), an int or a sequence of ints -> sorted, non-negative axes."""
    if value is None:
        return tuple(range(rank))
    values = (value,) if isinstance(value, int) else tuple(value)
    axes = [axis_of(a, rank, name) for a in values]
    if len(set(axes)) != len(axes):
        raise SpmdRuleError(f"{name}={value!r} repeats an axis")
    return tuple(sorted(axes))


# -- notation builders shared by op families -------------------------------------------------
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


def elementwise_rule(n_out: int = 1, linear: bool = False) -> EinsumRule:
    """Broadcasting elementwise op with ``n_out`` outputs of the broadcast shape;
    ``linear``: a sum of its operands (``P x P -> P``, see :class:`EinsumRule`)."""

    def notation(in_shapes, attrs):
        base = broadcast_notation(in_shapes)
        lhs, out = base.split("->")
        return lhs + "->" + ",".join([out] * n_out)

    notation.__name__ = f"elementwise{n_out}" + ("_linear" if linear else "")
    return EinsumRule(notation, linear=linear, reads=())


def axis_rule(n_in: int = 1, n_out: int = 1) -> EinsumRule:
    """Same-shape operands; the ``axis`` attribute's dim is never split (softmax, ...)."""

    def notation(in_shapes, attrs):
        rank = len(in_shapes[0])
        axis = axis_of(attrs.get("axis", -1), rank)
        word = "".join(LETTERS[i].upper() if i == axis else LETTERS[i] for i in range(rank))
        return ",".join([word] * n_in) + "->" + ",".join([word] * n_out)

    notation.__name__ = "axis"
    return EinsumRule(notation, reads=("axis",))
