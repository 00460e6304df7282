"""Aligning the mesh dims an answer leaves unused (an :class:`EinsumRule` with ``align``:
concat's rule, as Paddle's phi concat aligns its inputs' dims).

A concat answer can drop a mesh dim that an operand offers: the operand splits the concat
dim by it, which is never split, or it splits a dim another operand leaves whole and the
tie-break keeps that operand's ``None``. Gathering that operand then moves the most bytes
of all: an all-gather. Here each such mesh dim (in the order operands offer them) splits
instead a dim of every operand that the answer leaves free for it and that it divides,
the dim where some operand offers it first (that operand stays as it is), else the first
in the notation: an operand that held the mesh dim elsewhere moves by an all-to-all, one
replicated there is sliced, which moves nothing, and the op is split more ways. Letters
of an annotated (fixed) operand are left as the answer has them.

Example: concat along axis 1 on a mesh of 4 of ``[None, None]`` and ``[None, x]``: the
tie-break gathers the second (``[None, None]``, an all-gather of it); aligned, both are
consumed as ``[x, None]`` (the first sliced, the second moved by an all-to-all), which
is Paddle's answer.
"""

from __future__ import annotations

from distgraph.spmd.keep import known_entries, resharded_notes
from distgraph.spmd.specs import entry_dims


def align_unused(plan, query, words, decided: dict, pending=frozenset()):
    """(decided, seen, notes, resharded) of ``decided`` (an answer's letters -> mesh dims)
    with the mesh dims it leaves unused that some operand offers moved onto letters that
    every operand has (module docstring), or None when none moves."""
    order = query.sources()
    used = {d for dims in decided.values() for d in dims} | set(pending)
    offered: list = []                     # unused mesh dims, in the order offered
    where: dict = {}                       # mesh dim -> letters it is offered for
    seen: set = set()
    fixed: set = set()                     # letters an annotated operand has an entry for
    for source in order:
        for letter, entry in known_entries(query, words, source):
            seen.add(letter)
            if query.is_fixed(source):
                fixed.add(letter)
            for d in entry_dims(entry):
                if d not in used and plan.sizes[d] > 1:
                    if d not in offered:
                        offered.append(d)
                    where.setdefault(d, []).append(letter)
    common = set.intersection(*(set(w) for w in words.values())) if words else set()
    free = [c for c in plan.order if c.islower() and c in common and c not in fixed
            and c not in plan.internal]
    aligned = dict(decided)
    moves = []
    for d in offered:
        for letter in sorted(free, key=lambda c: c not in where[d]):
            dims = aligned.get(letter, ()) + (d,)
            if plan.divides(letter, dims):
                aligned[letter] = dims
                moves.append((d, letter))
                break
    if not moves:
        return None
    notes = [f"mesh dim {d}, which the answer left unused, splits dim '{letter}' of every "
             f"operand: an operand that held it elsewhere moves by an all-to-all, one "
             f"whole there is sliced, none is gathered" for d, letter in moves]
    more, resharded = resharded_notes(query, words, order, aligned)
    return aligned, seen, notes + more, resharded

