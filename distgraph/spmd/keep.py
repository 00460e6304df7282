"""A second opinion for an einsum rule whose tie-break reshards an operand: with the
operands it keeps as they are, split the other letters as many ways as the resharded
operands' offers allow.

The tie-break (:mod:`distgraph.spmd`) takes operands in priority order, letter by
letter, so an early operand that is resharded anyway (it splits a dim that is never
split, such as concat's axis) still decides the letters it offers first, and may leave
the op less split than it could be at no more resharding. Here the letters of the
operands the tie-break keeps stay as they are; every other letter takes a part of an
entry some resharded operand offers for it (in order), or none, choosing the answer that
splits the op the most ways (then the one that keeps the most operands as they are,
then the earliest offers). It replaces the tie-break's answer when it splits more ways:
it reshards no operand the tie-break keeps, and no answer that keeps those splits more.

Example: concat along axis 1 on a 2 x 3 mesh of ``[None, x, y]``, ``[None, x, y]`` and
``[y, None, x]``: the tie-break takes the first operand's ``None`` and ``y`` and
reshards all three to ``[None, None, y]`` (3 ways); the second opinion gives
``[y, None, x]`` (6 ways), which keeps the third as it is.
"""

from __future__ import annotations

import itertools

from distgraph.spmd.specs import UNKNOWN, entry_dims, entry_of, entry_str

MAX_ANSWERS = 4096      # answers tried for the letters the kept operands leave open


def split_most(plan, query, words, greedy: dict, moved: set, pending=frozenset()):
    """(decided, seen, notes, resharded) of an answer that keeps the operands the
    tie-break keeps and splits the op more ways than ``greedy`` (the tie-break's decided
    letters; ``moved`` the operands it reshards; ``pending`` the mesh dims a linear op
    keeps its operands' pending sums over, which split no letter), or None."""
    order = query.sources()
    kept = [s for s in order if s not in moved]
    decided: dict = {c: () for c in plan.order if c.isupper()}
    seen: set = set()
    for source in order:
        for letter, entry in known_entries(query, words, source):
            seen.add(letter)
            if source in kept:
                decided[letter] = entry_dims(entry)
    owner = {d: c for c, dims in decided.items() for d in dims}
    owner.update((m, "") for m in pending)
    others = [s for s in order if s in moved]
    best = _fill(plan, query, words, others, decided, owner)
    if best is None or _ways(plan, best) <= _ways(plan, greedy):
        return None
    notes, resharded = resharded_notes(query, words, order, best)
    return best, seen, [f"splitting the op {_ways(plan, best)} ways instead of "
                        f"{_ways(plan, greedy)} reshards no operand the operands' order "
                        f"keeps", *notes], resharded


def resharded_notes(query, words, order, decided: dict) -> tuple:
    """(notes, operands) of every operand in ``order`` whose known dims ``decided``
    (letter -> mesh dims) does not keep: each is resharded, a note per dim saying why."""
    notes, resharded = [], []
    for source in order:
        for letter, entry in known_entries(query, words, source):
            have = decided.get(letter, ())
            if entry_dims(entry) != have:
                why = ("that dim is never split here" if letter.isupper()
                       else f"kept {entry_str(entry_of(have))}")
                notes.append(f"{source} dim '{letter}' wants {entry_str(entry)}, {why}; "
                             f"{source} is resharded")
                resharded.append(source)
    return notes, resharded


def _ways(plan, decided: dict) -> int:
    ways = 1
    for letter, dims in decided.items():
        if letter.islower():
            ways *= plan._ways(dims)
    return ways


def known_entries(query, words, source):
    """(letter, entry) of each dim of operand ``source`` whose entry the query knows."""
    for letter, entry in zip(words[source], query.spec(source).dims):
        if letter != "1" and entry is not UNKNOWN:
            yield letter, entry


def _fill(plan, query, words, others, decided: dict, owner: dict) -> dict | None:
    """``decided`` with the open letters split as many ways as the ``others``' offers
    allow (then keeping the most of them whole, then the earliest offers); None when
    there are too many answers to try."""
    offers: dict = {}
    for source in others:
        for letter, entry in known_entries(query, words, source):
            if letter not in decided and letter.islower():
                options = offers.setdefault(letter, [])
                dims = entry_dims(entry)
                for r in range(len(dims), 0, -1):
                    for sub in itertools.combinations(dims, r):
                        if sub not in options:
                            options.append(sub)
    letters = list(offers)
    choices = [offers[c] + [()] for c in letters]
    count = 1
    for c in choices:
        count *= len(c)
    if count > MAX_ANSWERS:
        return None
    best, best_score = None, None
    for combo in itertools.product(*choices):
        used = [d for dims in combo for d in dims]
        if len(used) != len(set(used)) or any(d in owner for d in used):
            continue
        if not all(plan.divides(c, dims) for c, dims in zip(letters, combo)):
            continue
        answer = {**decided, **{c: dims for c, dims in zip(letters, combo) if dims}}
        whole = sum(all(answer.get(letter, ()) == entry_dims(entry)
                        for letter, entry in known_entries(query, words, s)) for s in others)
        score = (_ways(plan, answer), whole)
        if best_score is None or score > best_score:
            best, best_score = answer, score
    return best
