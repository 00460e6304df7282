"""The terms of a pipeline's price that the estimate and the stage searches share: how many
micro-batches a stage holds at once, what it then holds, and a stage's cost from its
parts.

- :func:`in_flight`: the micro-batches stage ``s`` of ``S`` holds under a schedule: all
  ``M`` under FThenB (every forward before any backward), ``min(M, S - s)`` under the
  others (1F1B and its kin start a micro-batch's backward once the stages after it
  have run its forward);
- :func:`held`: the memory of a stage holding that many: one micro-batch at its peak,
  each other one with what it keeps from its forward to its backward;
  :func:`held_by_order`: what the other micro-batches hold, read off a known schedule
  (per chunk, and from I to W under zero bubble);
- :func:`stage_cost` / :func:`stage_costs`: what a stage of ``[E] + m blocks + [H]``
  costs from its parts' costs (:class:`~distgraph.passes.search.stages.runs.PartCost`):
  seconds per micro-batch, GB with one micro-batch in flight, GB per further micro-batch
  in flight; :func:`stage_costs` every block count 0 .. n at once, each row the number
  :func:`stage_cost` returns (the same terms, added in the same order);
- :func:`grid`: a device mesh's shape as (machines, devices per machine).

Example::

    held(one, further, in_flight("1F1B", 8, 4, 0))     # stage 0 of 4 holds 4
    stage_cost(option.parts, True, 4, False)           # E + 4 blocks
"""

from __future__ import annotations

import numpy as np

from distgraph.errors import PlanError
from distgraph.units import GB


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


def held_by_order(order, after_forward: dict, after_input: dict) -> dict:
    """{(chunk, kind): the most bytes the other micro-batches hold while a process runs
    that action} over ``order`` (its schedule: actions with ``chunk``, ``kind`` F / B /
    I / W and ``micro_batch``): a chunk's micro-batch holds ``after_forward[chunk]``
    from its F to its backward (B, or I then) and ``after_input[chunk]`` from its I to
    its W (zero bubble: what the weight gradients read). The estimate's in-flight term
    where the schedule is known, added to what the running micro-batch holds in that
    action; under 1F1B with one chunk per stage its most is ``(in_flight - 1)`` times
    what a micro-batch keeps, the stage search's term."""
    state: dict = {}
    by_batch: dict = {}
    most: dict = {}
    for a in order:
        m, key = a.micro_batch, (a.chunk, a.kind)
        others = sum(by_batch.values()) - by_batch.get(m, 0.0)
        most[key] = max(most.get(key, 0.0), others)
        before = state.get((a.chunk, m), 0.0)
        now = (after_forward.get(a.chunk, 0.0) if a.kind == "F" else
               after_input.get(a.chunk, 0.0) if a.kind == "I" else 0.0)
        state[a.chunk, m] = now
        by_batch[m] = by_batch.get(m, 0.0) - before + now
    return most


def held(one: float, further: float, count: int) -> float:
    """Memory of a stage holding ``count`` micro-batches: ``one`` with one in flight,
    ``further`` for each other one."""
    return one + (count - 1) * further


def grid(shape) -> tuple[int, int]:
    """A device mesh's shape as (machines, devices per machine): a 1-D mesh is one row."""
    shape = tuple(int(s) for s in shape)
    if len(shape) == 1:
        return 1, shape[0]
    if len(shape) == 2:
        return shape
    raise PlanError(f"stage construction needs 1-D or 2-D device meshes, got shape "
                    f"{list(shape)}; describe the mesh as (machines, devices per machine)")


def stage_cost(parts: dict, with_first, blocks: int, with_last) -> tuple:
    """(seconds, GB with one micro-batch in flight, GB per further one) of ``[E] +
    blocks + [H]``; ``parts``: "first" / "block" / "last" -> (PartCost, search). Under
    virtual stages ``with_first`` / ``with_last`` may be the share of E or H a stage
    holds, by which its time and memory are taken (its working memory whole)."""
    used = [(parts["first"][0], float(with_first))] if with_first else []
    used += [(parts["block"][0], blocks)] if blocks else []
    used += [(parts["last"][0], float(with_last))] if with_last else []
    seconds = sum(p.time * n for p, n in used)
    # the peak of one micro-batch: at some part, the activations the parts before it
    # saved and its own working memory (its saved included), as the estimate walks it
    saved = peak = 0.0
    for p, n in used:
        saved += p.saved * n
        peak = max(peak, saved + p.transient)
    fixed = sum(p.persistent * n for p, n in used)
    return seconds, (fixed + peak) / GB, saved / GB


def stage_costs(parts: dict, with_first, n: int, with_last) -> np.ndarray:
    """(n + 1, 3): row m is :func:`stage_cost` ``(parts, with_first, m, with_last)``,
    m = 0 .. n: the same sums term by term, in the same order, over the rows m >= 1."""
    out = np.empty((n + 1, 3))
    out[0] = stage_cost(parts, with_first, 0, with_last)
    if n < 1:
        return out
    m = np.arange(1, n + 1)
    used = [(parts["first"][0], float(with_first))] if with_first else []
    used += [(parts["block"][0], m)]
    used += [(parts["last"][0], float(with_last))] if with_last else []
    seconds = fixed = 0
    saved = peak = 0.0
    for p, k in used:
        seconds = seconds + p.time * k
        fixed = fixed + p.persistent * k
        saved = saved + p.saved * k
        peak = np.maximum(peak, saved + p.transient)
    out[1:, 0] = seconds
    out[1:, 1] = (fixed + peak) / GB
    out[1:, 2] = saved / GB
    return out
