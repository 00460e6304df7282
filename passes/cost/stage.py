"""The accountant: a pipeline stage's price and a schedule's step, written once. The
estimate (:mod:`distgraph.passes.cost.estimate`) and every stage search (the stage DP,
runs of blocks, interleaved and even splits, the micro-batch count, the refinement)
price with these and nothing else:

- :func:`step_time`: a schedule's step from its stages' seconds per micro-batch (and
  their seconds once a step): ``sum t / v + (M - last) max t + max update``, Alpa's
  ``sum t + (M - 1) max t`` with one chunk per stage (``last`` is ``1 / v`` under
  interleaved 1F1B: the last micro-batch drains a chunk, not a stage, after the one
  before it; Narayanan et al., SC'21). Stages that run their own number of micro-batches
  (an uneven batch split) take ``max_s (M_s - last) t_s``. A zero-bubble schedule (ZB,
  ZBV) runs its weight gradients where the fill and drain would idle: given each
  stage's W seconds, every stage but the slowest fills for ``t - 2 w``.
- :func:`in_flight`: the micro-batches stage ``s`` of ``S`` holds at once under a
  schedule: all ``M`` under FThenB (every forward before any backward), ``min(M, S -
  s)`` under the others (1F1B and its kin start a micro-batch's backward once the stages
  after it have run its forward);
- :func:`held`: the memory of a stage holding that many: one micro-batch at its peak,
  each other one with what it keeps from its forward to its backward;
  :func:`held_by_action`: what the other micro-batches hold while a process runs each
  action of a known schedule (per chunk, and from I to W under zero bubble);
- :func:`transfers`: a stage's share of the sends to and from its neighbours;
- :func:`stage_cost` / :func:`stage_costs`: what a stage of ``[E] + m blocks + [H]``
  costs from its parts' costs (:class:`~distgraph.passes.search.stages.part_cost.PartCost`):
  seconds per micro-batch, GB with one micro-batch in flight, GB per further micro-batch
  in flight, and GB with one in flight where every forward runs before the first
  backward (the gradient buffers made in the backward, as the estimate counts them:
  :func:`held` takes it where a stage holds all the micro-batches); :func:`stage_costs`
  every block count 0 .. n at once, each row the number :func:`stage_cost` returns (the
  same terms, added in the same order); :func:`priced_stages`: the seconds and memory
  of a stage option's stages, each holding given parts, at their places in a pipeline;
- :func:`grid`: a device mesh's shape as (machines, devices per machine);
- what a stage's backward hides of its gradient reductions (``Strategy(overlap=True)``)
  is :mod:`~distgraph.passes.cost.exposed`'s rule, which :func:`stage_cost` takes off
  the reductions its parts priced whole.

Example::

    held(one, further, in_flight("1F1B", 8, 4, 0))     # stage 0 of 4 holds 4
    stage_cost(option.parts, True, 4, False)           # E + 4 blocks
    step_time([0.2, 0.25, 0.2], 8)                     # 0.65 + 7 x 0.25
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from distgraph.errors import PlanError
from distgraph.passes.cost.exposed import exposed_rows
from distgraph.units import GB

ZERO_BUBBLE = ("ZB", "ZBV")         # schedules that split the backward into I and W


def step_time(times, micro_batches, virtual: int = 1, schedule: str = "1F1B",
              updates=(0.0,), weights=None) -> float:
    """Seconds of a step whose stages take ``times`` per micro-batch (forward and
    backward, transfers included) and ``updates`` once a step (the update, the values
    made once): ``sum t / v + max_s (M_s - last) t_s + max update`` (module docstring);
    ``micro_batches``: M, or one count per stage (an uneven split); ``virtual``: chunks
    per stage.

    ``weights``: each stage's weight-gradient seconds per micro-batch (of ``times``),
    where a zero-bubble schedule (ZB, ZBV: the backward split into I and W) runs them in
    what would be the fill and drain's idle time: a stage other than the slowest fills
    and drains for ``t - 2 w`` instead of ``t`` (Qi et al. 2023, ZB-H1: a bubble of
    ``(S - 1)(F + I - W)``), and its last micro-batch drains a chunk (``last = 1 / v``).
    On stages alike this is the replay of the schedule distgraph runs
    (:func:`~distgraph.passes.pipeline.schedule.make_schedule`) to the last bit; on
    stages 0.7-1.3 x apart within 15% of it, as the 1F1B form is
    (tests/test_one_price.py). Without ``weights`` (the stage searches, whose prices do
    not split a backward's seconds) the form of 1F1B with one chunk draining last."""
    counts = micro_batches if isinstance(micro_batches, (list, tuple)) else \
        [micro_batches] * len(times)
    split = weights is not None and schedule in ZERO_BUBBLE
    last = 1 / virtual if schedule == "1F1B" or split else 1
    if len(set(counts)) == 1:       # as (M - last) max t: the same float as below
        drain = (counts[0] - last) * max(times)
    else:
        drain = max((m - last) * t for m, t in zip(counts, times))
    fill = sum(times)
    if split:
        slowest = max(range(len(times)), key=lambda s: times[s])
        fill = sum(max(t - 2 * w, 0.0) for t, w in zip(times, weights)) + \
            2 * weights[slowest]
    return fill / virtual + drain + max(updates)


def transfers(sends: float, at_start, at_end, virtual: int = 1) -> float:
    """A stage's share of its transfers, per micro-batch: ``sends`` (seconds a chunk
    between two others spends passing its values on and back) for each of its
    ``virtual`` chunks, half of it less where it holds the first chunk (``at_start``:
    no stage before it) and where it holds the last (``at_end``)."""
    return sends * (virtual - (at_start + at_end) / 2) if virtual > 1 else \
        sends * (2 - at_start - at_end) / 2


def in_flight(schedule: str, micro_batches: int, stages: int, stage: int,
              virtual: int = 1) -> float:
    """The micro-batches stage ``stage`` of ``stages`` holds at once (module docstring).
    With ``virtual`` chunks per stage (interleaved 1F1B) a stage runs ``2 (S - s - 1) +
    (v - 1) S`` chunk forwards before its first backward and one more in the steady
    state (Narayanan et al., SC'21, as :mod:`~distgraph.passes.pipeline.schedule` orders
    them), each holding 1/v of a micro-batch's: rank 0 of 4 stages of 2 chunks holds 11
    chunks, 5.5 micro-batches, not 4."""
    if schedule == "FThenB":
        return micro_batches
    if virtual > 1 and schedule == "1F1B":
        chunks = 2 * (stages - stage - 1) + (virtual - 1) * stages + 1
        return min(virtual * micro_batches, chunks) / virtual
    return min(micro_batches, stages - stage)


def flights(schedule: str, micro_batches: int, stages: int) -> np.ndarray:
    """:func:`in_flight` of a stage with ``s`` stages from it to the last (itself
    included) at index ``s`` = 0 .. ``stages``: how the stage DPs, which build a pipeline
    from its last stage, count a stage's micro-batches (one chunk per stage)."""
    return np.array([in_flight(schedule, micro_batches, s, 0) for s in range(stages + 1)])


def held_by_action(order, after_forward: dict, after_input: dict) -> list:
    """The bytes the other micro-batches hold while the process runs each action of
    ``order``, in order: a chunk's micro-batch holds ``after_forward[chunk]`` from its F
    to its backward (B, or I then) and ``after_input[chunk]`` from its I to its W (zero
    bubble: what the weight gradients read). The estimate's in-flight term where the
    schedule is known, added to what the running micro-batch holds in that action;
    under 1F1B with one chunk per stage its most is ``(in_flight - 1)`` times what a
    micro-batch keeps, the stage search's term."""
    state: dict = {}
    by_batch: dict = {}
    out = []
    for a in order:
        m = a.micro_batch
        out.append(sum(by_batch.values()) - by_batch.get(m, 0.0))
        before = state.get((a.chunk, m), 0.0)
        now = (after_forward.get(a.chunk, 0.0) if a.kind == "F" else
               after_input.get(a.chunk, 0.0) if a.kind == "I" else 0.0)
        state[a.chunk, m] = now
        by_batch[m] = by_batch.get(m, 0.0) - before + now
    return out


def buffers_by_action(order, made: dict) -> list:
    """(bytes of the gradient buffers the actions before it made, whether it is the first
    run of its task) for each action of ``order``; ``made``: {(chunk, kind): bytes of the
    buffers its task makes}. The runtime makes a parameter's accumulation buffer when
    its first micro-batch's gradient is made (the first run of the task that makes it)
    and holds it to the update: before the first backward none is held, which is where
    FThenB, holding every micro-batch, peaks."""
    seen: set = set()
    total = 0.0
    out = []
    for a in order:
        key = (a.chunk, a.kind)
        first = key not in seen
        out.append((total, first))
        if first:
            seen.add(key)
            total += made.get(key, 0.0)
    return out


def held(one: float, further: float, count: float, micro_batches: int | None = None,
         one_before: float | None = None) -> float:
    """Memory of a stage holding ``count`` micro-batches: ``one`` with one in flight,
    ``further`` for each other one. Where it holds all ``micro_batches`` (every forward
    runs before its first backward: FThenB, or 1F1B with ``M <= S - s``), ``one_before``
    (:func:`stage_cost`'s fourth term) instead of ``one``: its peak is then in the first
    forwards or backward, before the gradient buffers the later ones hold are made."""
    if one_before is not None and micro_batches is not None and count >= micro_batches:
        one = one_before
    return one + (count - 1) * further


def priced_stages(options, parts: list, micro_batches: int, sends: float = 0.0,
                  virtual: int = 1, schedule: str = "1F1B") -> tuple[list, list, list]:
    """([seconds per micro-batch], [GB], [update seconds once a step]) of the
    ``len(parts)`` stages of a pipeline of
    stage ``options`` (one per stage, or one for all; each with ``cost(E?, blocks,
    H?)``, :meth:`~distgraph.passes.search.stages.run_options.RunOption.cost`), stage s
    holding ``parts[s]`` = (E or its share, blocks, H or its share): its parts' seconds
    and its :func:`transfers`' share (``sends``), and its memory with the micro-batches
    ``schedule`` keeps in flight there (:func:`in_flight`)."""
    S = len(parts)
    if not isinstance(options, (list, tuple)):
        options = [options] * S
    times, memories, updates = [], [], []
    for s, (option, (first, n, last)) in enumerate(zip(options, parts)):
        price = option.cost(first, n, last)
        if virtual > 1:     # every chunk a middle one but the first chunk and the last
            times.append(price.seconds + transfers(sends, s == 0, s == S - 1, virtual))
        else:
            times.append(price.seconds + transfers(sends, first, last))
        memories.append(held(price.one, price.further, in_flight(schedule, micro_batches, S, s,
                                                                 virtual),
                             micro_batches, price.before))
        updates.append(price.update)
    return times, memories, updates


def grid(shape) -> tuple[int, int]:
    """A device mesh's shape as (machines, devices per machine): a 1-D mesh is one row."""
    shape = tuple(int(s) for s in shape)
    if len(shape) == 1:
        return 1, shape[0]
    if len(shape) == 2:
        return shape
    raise PlanError(f"stage construction needs 1-D or 2-D device meshes, got shape "
                    f"{list(shape)}; describe the mesh as (machines, devices per machine)")


class StagePrice(NamedTuple):
    """What a stage option costs holding some parts (:func:`stage_cost`): ``seconds`` per
    micro-batch (forward, backward and the update's share, ``update / M``: what the stage
    DP compares), GB with ``one`` micro-batch in flight, GB per ``further`` one, GB with one
    in flight where every forward runs ``before`` the first backward (:func:`held`'s
    ``one_before``), and the ``update``'s seconds once a step. ``one`` and ``before`` are
    at least the stage's memory at its update, when no micro-batch keeps activations:
    what persists and the largest ZeRO write-back buffer of its parts (``PartCost.
    writeback``; :func:`held` adds the further micro-batches to it too, an over-count
    only where that buffer outgrows a micro-batch's activations)."""

    seconds: float
    one: float
    further: float
    before: float
    update: float = 0.0


def stage_cost(parts: dict, with_first, blocks: int, with_last) -> StagePrice:
    """The :class:`StagePrice` of ``[E] + blocks + [H]``; ``parts``: "first" / "block" /
    "last" -> (PartCost, search). Under virtual stages ``with_first`` / ``with_last`` may
    be the share of E or H a stage holds, by which its time and memory are taken (its
    working memory whole). ``before`` is :func:`_before`."""
    used = [(parts["first"][0], float(with_first))] if with_first else []
    used += [(parts["block"][0], blocks)] if blocks else []
    used += [(parts["last"][0], float(with_last))] if with_last else []
    seconds = float(_seconds(used))
    # the peak of one micro-batch: at some part, the activations the parts before it
    # saved and its own working memory (its saved included), as the estimate walks it
    saved = peak = 0.0
    for p, n in used:
        saved += p.saved * n
        peak = max(peak, saved + p.transient)
    fixed = sum(p.persistent * n for p, n in used)
    # at the update no micro-batch keeps activations: the largest write-back buffer
    at_update = fixed + max((p.writeback for p, _ in used), default=0.0)
    hidden, share = _hidden(parts, with_first, blocks, with_last)
    return StagePrice(seconds - hidden[-1] * share, max(fixed + peak, at_update) / GB,
                      saved / GB, max(_before(used, fixed, saved), at_update) / GB,
                      sum(p.update * n for p, n in used) - hidden[-1])


def stage_costs(parts: dict, with_first, n: int, with_last) -> np.ndarray:
    """(n + 1, 5): row m is :func:`stage_cost` ``(parts, with_first, m, with_last)``,
    m = 0 .. n: the same sums term by term, in the same order, over the rows m >= 1."""
    out = np.empty((n + 1, 5))
    out[0] = stage_cost(parts, with_first, 0, with_last)
    if n < 1:
        return out
    m = np.arange(1, n + 1)
    used = [(parts["first"][0], float(with_first))] if with_first else []
    used += [(parts["block"][0], m)]
    used += [(parts["last"][0], float(with_last))] if with_last else []
    fixed = update = 0
    saved = peak = 0.0
    for p, k in used:
        fixed = fixed + p.persistent * k
        saved = saved + p.saved * k
        update = update + p.update * k
        peak = np.maximum(peak, saved + p.transient)
    at_update = fixed + max(p.writeback for p, _ in used)
    out[1:, 0] = _seconds(used)
    out[1:, 1] = np.maximum(fixed + peak, at_update) / GB
    out[1:, 2] = saved / GB
    out[1:, 3] = np.maximum(_before(used, fixed, saved), at_update) / GB
    out[1:, 4] = update
    hidden, share = _hidden(parts, with_first, n, with_last)
    out[1:, 0] -= hidden[1:] * share
    out[1:, 4] -= hidden[1:]
    return out


def _hidden(parts: dict, with_first, n: int, with_last) -> tuple:
    """([seconds once a step of the gradient reductions of a stage of ``[E] + m blocks +
    [H]`` that its backward hides, m = 0 .. n], the share of them its seconds per
    micro-batch hold): its process runs H's backward, the blocks' and E's and reduces
    their gradients in buckets cut over all of them (the parts' ``timeline``,
    :func:`exposed_rows`), its parts priced each reduction whole. Nothing hidden where
    the plan reduces nothing during the backward, or a part is a share of one (virtual
    stages)."""
    first = parts["first"][0] if with_first else None
    block = parts["block"][0] if n else None
    last = parts["last"][0] if with_last else None
    used = [p for p in (first, block, last) if p is not None]
    if any(float(k) not in (0.0, 1.0) for k in (with_first, with_last)) or n != int(n) or \
            any(p.timeline is None for p in used) or \
            not any(p.timeline.reductions for p in used):
        return np.zeros(int(n) + 1), 0.0
    line, n = used[0].timeline, int(n)
    paid = exposed_rows([last.timeline] if last else [], block and block.timeline,
                        [first.timeline] if first else [], n, line.bucket_mb, line.hides)
    ends = sum(p.timeline.reduced for p in (first, last) if p is not None)
    reduced = ends + np.arange(n + 1) * (block.timeline.reduced if block else 0.0)
    return reduced - paid, line.share


def _seconds(used: list):
    """Seconds per micro-batch of ``used`` ((PartCost, count) with counts scalars or one
    array): where the mesh's processes pay unlike (the parts' ``kinds``), the parts'
    sum at the kind of process whose sum is the largest, as the stage waits for its
    slowest process over all its parts (each part's slowest may be another process:
    their sum over-counts); else the sum of the parts' ``time``. A part without
    ``kinds`` pays its ``time`` at every kind."""
    widths = {len(p.kinds) for p, _ in used if p.kinds}
    if len(widths) != 1:
        return sum(p.time * k for p, k in used)
    (width,) = widths
    total = 0.0
    for p, k in used:
        total = total + np.multiply.outer(k, np.asarray(p.kinds or (p.time,) * width))
    return np.max(total, axis=-1)


def _before(used: list, fixed, saved):
    """Bytes of a stage of ``used`` ((PartCost, count) in forward order; ``fixed``: their
    persistent bytes, ``saved``: their saved ones) with one micro-batch in flight where
    every micro-batch runs its forward before the stage's first backward (the others'
    ``saved`` aside): the runtime makes a gradient buffer when the first backward makes
    its gradient, so the most of

    - a forward (the last): no buffer yet;
    - the first backward at a part: the buffers of the parts after it (their backward
      ran before) and its own made so far; in a run of blocks at its first or its last
      block (the saved ones fall by a block's and the buffers grow by one's);
    - a later backward (or the update): every buffer, and one micro-batch less held
      (hence ``- saved``).

    With no buffers (one micro-batch, or parts that leave them in ``persistent``) this
    is :func:`stage_cost`'s second term."""
    buffers = sum(p.buffers * k for p, k in used)
    after = buffers
    before = forward = backward = first = 0.0
    for p, k in used:
        after = after - p.buffers * k
        forward = np.maximum(forward, before + p.saved * k + p.forward)
        backward = np.maximum(backward, before + p.saved * k + p.backward)
        low = np.minimum(k, 1.0)
        for j in (low, k):
            first = np.maximum(first, before + p.saved * j + p.making + after
                               + p.buffers * (k - j))
        before = before + p.saved * k
    return fixed - buffers + np.maximum(np.maximum(forward, first),
                                        buffers + backward - saved)
