"""Expert parallelism's layout of a mixture-of-experts op: tokens and experts split over
one mesh dim, which no einsum rule makes (there a mesh dim splits one letter).

In an einsum notation of an MoE op the token letters are ``b`` and ``s`` and the expert
letter is ``e`` (``bsD,bsK,bsK,eDi,eDi,eiD->bsD``). When mesh dim ``m`` splits a token
letter and ``e`` at once, each process holds its tokens and its experts; the op's
distributed form sends every token to the process holding its expert (an all-to-all
over ``m``) and the results back (another), so every output is split like its tokens or
its experts along ``m`` and none is Partial over ``m``::

    S(b) x S(b) x S(b) x S(e) x S(e) x S(e) -> S(b)       (all-to-all dispatch, combine)

:class:`ExpertRule` is the einsum rule of the notation plus these layouts: among its
strategies (each einsum strategy that splits a token letter over ``m`` and leaves ``e``
whole, with ``e`` split over ``m`` too) and in its answers (:meth:`ExpertPlan.solve`:
when the known specs split a token letter and ``e`` over the same mesh dim).

Example::

    mesh = dg.ProcessMesh([0, 1], ["dp"])
    rule = ExpertRule("bsD,eDi->bsD")
    rule.infer_forward([["dp", None, None], ["dp", None, None]], [(4, 6, 8), (2, 8, 3)],
                       mesh).out_specs[0]                  # [dp, None, None], not Partial
"""

from __future__ import annotations

from dataclasses import replace

from distgraph.spmd.einsum import EinsumRule
from distgraph.spmd.rule import OpStrategy, RuleQuery, SpmdResult
from distgraph.spmd.specs import UNKNOWN, DimsSpec, entry_dims, entry_of

TOKENS, EXPERT = "bs", "e"


class ExpertRule(EinsumRule):
    """An MoE op's rule: its einsum rule, plus expert parallelism's layouts (tokens and
    experts split over one mesh dim: the op dispatches with an all-to-all)."""

    def bind(self, in_shapes, out_shapes, mesh, attrs: dict):
        return ExpertPlan(super().bind(in_shapes, out_shapes, mesh, attrs))


def _positions(words, letters) -> list:
    """(operand index, dim) of every letter of ``letters`` in ``words``."""
    return [(i, d) for i, w in enumerate(words) for d, c in enumerate(w) if c in letters]


class ExpertPlan:
    """An einsum plan (``base``) with expert parallelism's layouts beside it (a
    :class:`~distgraph.spmd.rule.BoundRule`)."""

    def __init__(self, base):
        self.base = base
        self.mesh = base.mesh

    def _words(self, side: str) -> list:
        return self.base.in_letters if side == "input" else self.base.out_letters

    def _with_experts(self, ins, outs, m) -> tuple:
        """``ins`` / ``outs`` (DimsSpecs) with ``e`` split over ``m`` and no output Partial
        over ``m``."""
        def put(words, specs, drop):
            out = []
            for w, spec in zip(words, specs):
                dims = tuple(entry_of((m,)) if c == EXPERT else e for c, e in zip(w, spec.dims))
                partial = frozenset(spec.partial) - {m} if drop else spec.partial
                out.append(DimsSpec(dims, partial))
            return tuple(out)

        return put(self.base.in_letters, ins, False), put(self.base.out_letters, outs, True)

    # -- strategies ---------------------------------------------------------------------
    def strategies(self) -> list:
        """The einsum rule's strategies, then each one that splits a token letter over a
        mesh dim and leaves ``e`` whole, with ``e`` split over that dim too."""
        found = list(self.base.strategies())
        if EXPERT not in self.base.order:
            return found
        for s in list(found):
            ins = [DimsSpec.of(x) for x in s.in_specs]
            outs = [DimsSpec.of(x) for x in s.out_specs]
            if any(entry_dims(ins[i].dims[d]) for i, d in _positions(self.base.in_letters,
                                                                     EXPERT)):
                continue
            shared = []
            for i, d in _positions(self.base.in_letters, TOKENS):
                shared += [m for m in entry_dims(ins[i].dims[d]) if m not in shared]
            for m in shared:
                if not self.base.divides(EXPERT, (m,)):
                    continue
                new_ins, new_outs = self._with_experts(ins, outs, m)
                built = OpStrategy.build(self.mesh, new_ins, new_outs, self.base.in_shapes,
                                         self.base.out_shapes)
                found.append(replace(built, name=f"{built.name} (all-to-all over {m})"))
        return found

    # -- solve --------------------------------------------------------------------------
    def _shared_dim(self, query) -> str | None:
        """A mesh dim that a known spec gives ``e`` alone and a known spec gives a token
        letter (the first such, in the operands' priority order)."""
        expert, tokens = [], set()
        for source in query.sources():
            word = self._words(source.side)[source.index]
            for c, entry in zip(word, query.spec(source).dims):
                if entry is UNKNOWN:
                    continue
                dims = entry_dims(entry)
                if c == EXPERT and len(dims) == 1:
                    expert.append(dims[0])
                elif c in TOKENS:
                    tokens.update(dims)
        for m in expert:
            if m in tokens and self.mesh.shape[self.mesh.dim_names.index(m)] > 1 \
                    and self.base.divides(EXPERT, (m,)):
                return m
        return None

    def solve(self, query) -> SpmdResult:
        """The einsum rule's answer, unless the known specs split a token letter and
        ``e`` over one mesh dim ``m`` and the answer without ``e``'s known entries keeps
        a token letter split over ``m``: then that answer with ``e`` split over ``m``
        (the all-to-all layout)."""
        m = self._shared_dim(query)
        if m is None:
            return self.base.solve(query)

        def hide(specs, words):
            return tuple(DimsSpec(tuple(UNKNOWN if c == EXPERT else e
                                        for c, e in zip(w, s.dims)), s.partial)
                         for w, s in zip(words, specs))

        hidden = RuleQuery(hide(query.in_specs, self.base.in_letters),
                           hide(query.out_specs, self.base.out_letters), query.fixed_in,
                           query.fixed_out, query.outputs_first, query.lead)
        res = self.base.solve(hidden)
        if not any(m in entry_dims(res.in_specs[i].dims[d])
                   for i, d in _positions(self.base.in_letters, TOKENS)):
            return self.base.solve(query)
        ins, outs = self._with_experts(res.in_specs, res.out_specs, m)
        resharded = []
        for source in query.sources():
            known = query.spec(source)
            mine = (ins if source.side == "input" else outs)[source.index]
            if any(e is not UNKNOWN and e != w for e, w in zip(known.dims, mine.dims)):
                resharded.append(source)
        notes = (f"tokens and experts split over {m}: the op dispatches its tokens to their "
                 f"experts' processes with an all-to-all over {m}",)
        return SpmdResult(ins, outs, notes + res.notes,
                          tuple(resharded))
