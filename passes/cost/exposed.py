"""What a step pays of the collectives it starts during the backward (gradient buckets
reduced during the backward, ``Strategy(overlap=True)``), the rule the estimate
(:mod:`~distgraph.passes.cost.overlap`) and the searches
(:mod:`~distgraph.passes.search.layouts.buckets`, :func:`~distgraph.passes.cost.stage.
stage_cost`) price them by, written once:

- :func:`finishes`: when collectives started during the compute are done, one wire;
- :func:`exposed`: what of them a step pays, the updates waiting for their buckets
  (:func:`bucket_terms`: a bucket's reductions as one);
- :func:`exposed_seconds` / :func:`exposed_rows`: the same rule over the parts of a
  stage (their :class:`Timeline`), the buckets cut over all of them, for every block
  count at once (what :func:`~distgraph.passes.cost.stage.stage_cost` takes off the
  reductions its parts priced whole).

Example (a backward of two 2 s ops, a bucket after each, every update op reading one)::

    >>> exposed([2.0, 2.0], [(1, [0.0], 1.0), (2, [0.0], 1.0)], [(0.5, {0}), (0.5, {1})], 1.0)
    (0.5, 1.5)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from distgraph.plan.buckets import MB


def finishes(buckets) -> list:
    """When each collective of ``buckets`` is done: (ready, wire) in the order they
    start, each one's wire time starting once it is ready (seconds into the compute: the
    compute before its start, the processor's share of the collectives before it
    included) and the one before it is done (one link, one collective at a time). The
    ops after the compute wait for the collectives they read
    (:func:`~distgraph.passes.cost.overlap.bucket_seconds`).

    >>> [round(t, 9) for t in finishes([(0.5, 0.2), (0.6, 0.3), (1.0, 0.1)])]
    [0.7, 1.0, 1.1]
    """
    done, out = 0.0, []
    for ready, wire in buckets:
        done = max(done, ready) + wire
        out.append(done)
    return out


def exposed(backward, buckets, after, hides: float, busy=()) -> tuple:
    """(seconds a step pays for the collectives it starts during the backward, seconds
    of them hidden behind it): ``backward``, the seconds of the backward's ops in order;
    ``buckets``, (ops, copies, wire) of each bucket in the order they start: after the
    first ``ops`` ops of the backward, the software of its reductions costing the
    processor ``copies`` seconds each there and the rest, ``wire`` seconds in all,
    running on the wires (:func:`finishes`:
    one collective at a time, ``busy``'s (start, wire) included, seconds into the
    backward); ``after``, (seconds, buckets read) of each op after the backward, in
    order: each waits for the buckets it reads. The step pays the buckets' copies, what
    those waits add, and the share ``1 - hides`` of the wire seconds behind the compute
    that the device does not hide (its processor moves the bytes:
    ``Device.hides``).

    >>> exposed([2.0, 2.0], [(1, [0.0], 1.0), (2, [0.0], 1.0)], [(0.5, {0}), (0.5, {1})], 1.0)
    (0.5, 1.5)
    """
    ran = [0.0, *itertools.accumulate(backward)]
    processor = 0.0
    starts = []
    for ops, copies, wire in buckets:
        for seconds in copies:
            processor += seconds
        starts.append((ran[ops] + processor, wire))
    end = ran[-1] + processor
    # one wire, in the order the collectives start (a busy one before a bucket ready at
    # the same moment), to the last bucket
    queue = sorted([(r, w, b) for b, (r, w) in enumerate(starts)] +
                   [(r, w, None) for r, w in busy], key=lambda e: (e[0], e[1], e[2] is not None))
    upto = max(k for k, (_, _, b) in enumerate(queue) if b is not None)
    done = {b: t for (_, _, b), t in zip(queue, finishes([(r, w) for r, w, _ in
                                                          queue[:upto + 1]]))
            if b is not None}
    # after the backward, the clock past its end less the ops' own seconds
    clock = work = 0.0
    for seconds, reads in after:
        clock = max(clock, max((done[b] for b in reads), default=0.0) - end) + seconds
        work += seconds
    left = clock - work
    hidden = sum(w for _, w in starts) - left
    kept = (1.0 - hides) * max(hidden, 0.0)
    return processor + left + kept, hidden - kept


def bucket_terms(reductions) -> tuple:
    """([seconds of each reduction's copies on the processor], wire seconds) of a
    bucket's ``reductions``, each (seconds, wire, waits, group) at one process
    (:func:`~distgraph.passes.cost.overlap.wire_seconds`,
    :func:`~distgraph.passes.cost.overlap.waits_seconds`): its reductions start
    together, so each group meets once for all of them, the bucket paying the largest of
    their waits per group and each reduction its own alpha-beta
    (:mod:`~distgraph.passes.cost.overlap`)."""
    copies, wire, meets = [], 0.0, {}
    for seconds, w, waits, group in reductions:
        if waits:
            meets[group] = max(meets.get(group, 0.0), waits)
        wire += w - waits
        copies.append(seconds - w)
    return copies, wire + sum(meets.values())


def exposed_seconds(timelines, bucket_mb: float, hides: float) -> float:
    """Seconds a step pays for the reductions of ``timelines`` (the parts of one process's
    backward, in the order it runs them, each a :class:`Timeline`) cut into buckets of
    ``bucket_mb`` as the runtime cuts them (:func:`~distgraph.plan.buckets.cut`) and run
    as it runs them (:func:`exposed`'s rule); ``hides``: the device's ``Device.hides``."""
    return float(exposed_rows(list(timelines), None, [], 0, bucket_mb, hides)[0])


def exposed_rows(head: list, block, tail: list, n: int, bucket_mb: float,
                 hides: float) -> np.ndarray:
    """:func:`exposed_seconds` of ``head + [block] * m + tail`` for m = 0 .. n (a stage
    of E, m blocks and H runs H's backward first). :func:`exposed`'s rule in closed
    form, its buckets in the order they are ready: the processor pays each bucket's
    copies where it starts; one wire runs them in order (``done_k = max(done_k-1,
    start_k) + wire_k``); an op after the backward waits for the buckets it reads (the
    update's ops, in the order the gradients were made), so the step pays the most a
    bucket's end passes the backward's end and the ops before its first reader
    (``before``), and the share of the wire behind the compute the device does not
    hide. The runtime's greedy cut of a prefix is the prefix of its cut: the reductions
    of ``head`` and n blocks are cut and run once, and each row goes on from the buckets
    closed before its m-th block ends with the rest cut again with ``tail``'s."""
    groups: dict = {}
    first = _flat([*head, *([block] * n if block is not None else [])], groups)
    ends = _flat(tail, groups)
    cap = bucket_mb * MB
    starts, stops, size = [], [], 0
    for r, nbytes in enumerate(first.nbytes.tolist()):
        size += nbytes
        if size >= cap:
            starts.append(stops[-1] if stops else 0)
            stops.append(r + 1)
            size = 0
    closed = _buckets(first, starts, stops)
    processor = np.cumsum(closed[1])
    wires = np.cumsum(closed[2])
    done = np.maximum.accumulate(closed[0] + processor - (wires - closed[2])) + wires
    passed = np.maximum.accumulate(done - closed[3])
    ends_at = np.asarray(stops, dtype=np.intp)
    width = len(block.reductions) if block is not None else 0
    rows = np.zeros(n + 1 if block is not None else 1)
    # the rows' own buckets in Python floats (the same sums, in the same order)
    prefix, tail = _columns(first), _columns(ends)
    closed = [x.tolist() for x in (processor, wires, done, passed)]
    backward, after, last = first.backward.tolist(), first.after.tolist(), \
        float(ends.backward[-1])
    # each row's reductions of head and m blocks, and the buckets closed by then
    mades = len(first.nbytes) - (n - np.arange(len(rows))) * width
    for m, (made, k) in enumerate(zip(mades.tolist(), np.searchsorted(
            ends_at, mades, side="right").tolist())):
        spent, wire, busy, most = (closed[0][k - 1], closed[1][k - 1], closed[2][k - 1],
                                   closed[3][k - 1]) if k else (0.0, 0.0, 0.0, -np.inf)
        back, later = backward[len(head) + m], after[len(head) + m]
        rest = [(prefix, r, 0.0, 0.0) for r in range(stops[k - 1] if k else 0, made)]
        rest += [(tail, r, back, later) for r in range(len(tail[0]))]
        if not rest and not k:
            continue
        spent, busy, most, wire = _run_rest(rest, cap, spent, busy, most, wire)
        left = max(most - (back + last + spent), 0.0)
        rows[m] = spent + left + (1.0 - hides) * max(wire - left, 0.0)
    return rows


class _Flat(NamedTuple):
    """Reductions of timelines in a row (:func:`exposed_rows`): per reduction its bytes,
    seconds of backward before it is ready, its copies, its wire less its waits, its
    waits, its group (an index) and the seconds of the ops after the backward before
    the first that reads it (inf: none); per timeline, the seconds of backward and of
    the ops after it before it (and in all, last)."""

    nbytes: np.ndarray
    ready: np.ndarray
    copies: np.ndarray
    wire: np.ndarray
    waits: np.ndarray
    group: np.ndarray
    before: np.ndarray
    backward: np.ndarray
    after: np.ndarray


def _flat(lines: list, groups: dict) -> _Flat:
    """The :class:`_Flat` of ``lines``, each distinct timeline read once and repeated;
    ``groups``: group -> index, filled."""
    known: dict = {}
    read = [known.get(id(line)) or known.setdefault(id(line), _line(line, groups))
            for line in lines]
    backward = np.cumsum([0.0] + [seconds for _, seconds, _ in read])
    after = np.cumsum([0.0] + [spent for _, _, spent in read])
    if not read:
        return _Flat(*np.zeros((5, 0)), np.zeros(0, dtype=np.intp), np.zeros(0),
                     backward, after)
    table = np.concatenate([one for one, _, _ in read])
    counts = [len(one) for one, _, _ in read]
    table[:, 1] += np.repeat(backward[:-1], counts)     # each line's from where it starts
    table[:, 6] += np.repeat(after[:-1], counts)
    return _Flat(*table.T[:5], table[:, 5].astype(np.intp), table[:, 6], backward, after)


def _line(line, groups: dict) -> tuple:
    """(rows of ``line``'s reductions as :class:`_Flat` columns, its backward's seconds,
    its after ops' seconds); ``groups``: group -> index, filled."""
    ran = [0.0, *itertools.accumulate(line.backward)]
    first_read: dict = {}
    spent = 0.0
    for seconds, reads in line.after:
        for r in reads:
            first_read.setdefault(r, spent)
        spent += seconds
    out = [(size, ran[pos], total - w, w - wait, wait, groups.setdefault(g, len(groups)),
            first_read.get(r, np.inf))
           for r, (pos, size, (total, w, wait, g)) in enumerate(line.reductions)]
    return np.asarray(out, dtype=float).reshape(-1, 7), ran[-1], spent


def _buckets(flat: _Flat, starts, stops) -> tuple:
    """(ready, copies, wire, before) arrays of the buckets ``flat[starts[k]:stops[k]]``
    (:func:`bucket_terms`: the group of a bucket's reductions meets once, at their
    largest waits)."""
    if not starts:
        return tuple(np.zeros(0) for _ in range(4))
    end = stops[-1]
    wire = np.add.reduceat(flat.wire[:end], starts)
    for g in np.unique(flat.group[:end]):
        wire = wire + np.maximum.reduceat(
            np.where(flat.group[:end] == g, flat.waits[:end], 0.0), starts)
    return (flat.ready[np.asarray(stops) - 1], np.add.reduceat(flat.copies[:end], starts),
            wire, np.minimum.reduceat(flat.before[:end], starts))


def _columns(flat: _Flat) -> tuple:
    """``flat``'s per-reduction columns as lists (bytes as ints): what :func:`_run_rest`
    reads."""
    return ([int(x) for x in flat.nbytes.tolist()], flat.ready.tolist(), flat.copies.tolist(),
            flat.wire.tolist(), flat.waits.tolist(), flat.group.tolist(), flat.before.tolist())


def _run_rest(rest: list, cap: float, spent: float, busy: float, most: float,
              wire: float) -> tuple:
    """(spent, busy, most, wire) of :func:`exposed_rows`'s recurrence gone on over the
    buckets of ``rest`` ((columns, index, backward before, ops after before) of each
    reduction, :func:`_columns`), cut greedily at ``cap`` bytes as the runtime cuts them
    (:func:`~distgraph.plan.buckets.cut`): a bucket is ready with its last reduction,
    pays its copies, wire and each group's largest waits once (:func:`bucket_terms`), and
    is read first where its first reader is."""
    copies = w = 0.0
    before = np.inf
    meets: dict = {}
    size = 0
    for i, (columns, r, back, later) in enumerate(rest):
        nbytes, ready, copied, wired, waits, group, first_read = columns
        copies += copied[r]
        w += wired[r]
        before = min(before, first_read[r] + later)
        if waits[r]:
            meets[group[r]] = max(meets.get(group[r], 0.0), waits[r])
        size += nbytes[r]
        if size >= cap or i == len(rest) - 1:
            w += sum(meets.values())
            spent += copies
            busy = max(busy, ready[r] + back + spent) + w
            most = max(most, busy - before)
            wire += w
            copies = w = 0.0
            before = np.inf
            meets, size = {}, 0
    return spent, busy, most, wire


@dataclass(frozen=True)
class Timeline:
    """A part's backward as its gradient buckets see it, at one kind of process
    (:func:`~distgraph.passes.search.layouts.buckets.timeline`): ``backward``, seconds
    of one run of its backward in segments, each
    ending where a reduction's gradient is made (the last: the rest); ``reductions``,
    (segments before it is ready, bytes, (seconds, wire, waits, group) as
    :func:`bucket_terms` takes them) of each reduction
    into an update, in the order the backward makes them; ``after``, (seconds, indices
    of the reductions it reads) of the ops after the backward in order (an op reading
    none joined to the one before it); ``reduced``: the seconds its reductions' edges
    cost once a step, priced whole, of which the search's seconds per micro-batch hold
    the ``share`` (the update's weight); ``bucket_mb`` and ``hides`` (the device's
    ``Device.hides``): how the runtime buckets them and how much of their wire the
    compute hides."""

    backward: tuple
    reductions: tuple
    after: tuple
    reduced: float = 0.0
    share: float = 1.0
    bucket_mb: float = 25.0
    hides: float = 1.0
