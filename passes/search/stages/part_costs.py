"""What a stage of ``[E] + m blocks + [H]`` costs from its parts' costs
(:class:`~distgraph.passes.search.stages.runs.PartCost`): seconds per micro-batch, GB with one
micro-batch in flight, GB per further micro-batch in flight. :func:`stage_cost` prices
one stage; :func:`stage_costs` every block count 0 .. n at once, each row the number
:func:`stage_cost` returns (the same terms, added in the same order).

Example::

    stage_cost(option.parts, True, 4, False)         # E + 4 blocks
    stage_costs(option.parts, False, 128, False)     # rows for 0 .. 128 blocks
"""

from __future__ import annotations

import numpy as np

from distgraph.units import GB


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
