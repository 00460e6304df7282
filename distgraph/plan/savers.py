"""What the search chose for a memory saver the strategy left to it, as a value the plan
carries (``Plan.savers``) and ``explain()`` says in words.

Under ``Strategy(auto_mode="full")`` an option left unset is the search's: recomputation
(none, "selective" or whole blocks), ZeRO sharding and sequence parallelism
(:func:`distgraph.passes.fitting.with_savers`) and, with ``pipeline=True``, the
micro-batch count (:mod:`distgraph.passes.search.stages.micro`).
Each choice is one :class:`SaverChoice`: the option, the value chosen, the plan's peak and
step time with it, what a device may hold (its usable memory: its memory less its
reserve, at most the strategy's budget), and every other value priced: its peak and
step time, or its closest plan's peak where it did not fit (what the choice saved).
Recomputation chosen per stage (:mod:`distgraph.passes.search.stages.recompute_stages`)
names each layer and says, per stage, what its blocks got.

Example::

    SaverChoice("recompute", "selective", 38.6e9, 40e9, 21.8,
                ((False, 39.3e9, 26.0), (True, 39.3e9, None))).lines()
    # recompute='selective' chosen by the search: peak 38.6 GB of the 40 GB usable on a
    #     device, 21.8 s per step
    #   without recomputation: peak 39.3 GB, 26 s per step
    #   recomputing whole blocks: does not fit (its closest plan needs 39.3 GB)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from distgraph.ir import Role
from distgraph.units import fmt_bytes

_SPELLED = {
    "recompute": {False: "without recomputation", True: "recomputing whole blocks",
                  "selective": "recomputing the attention scores"},
    "sharding": {False: "without ZeRO sharding", True: "with ZeRO sharding"},
    "sequence_parallel": {False: "without sequence parallelism",
                          True: "with sequence parallelism"}}
# why a choice of these was made with no other value priced (with_savers)
_UNPRICED = {
    ("sharding", True): "not planned without: the plan recomputes, memory binds, and without "
                        "the states split it holds more on every layout",
    ("sharding", False): "no update left to shard over a data-parallel dim"}


@dataclass(frozen=True)
class SaverChoice:
    """``option`` (a Strategy field) set to ``value`` by the search; ``peak``: the plan's
    largest peak in bytes with it (None: not estimated), ``limit`` what that device may
    hold (inf: no limit known), ``seconds`` its estimated step time (None: not
    estimated); ``others``: (value, peak bytes or None, seconds or None) of each other
    value priced, in the order tried: seconds None where it did not fit, the peak then
    its closest plan's; the peak None where only the search's first micro-batch count
    was priced (no recomputation, memory binding there, slower than the plan:
    :func:`~distgraph.passes.fitting.with_savers`); ``stages``: for recomputation chosen
    per stage (:mod:`distgraph.passes.search.stages.recompute_stages`), what each stage's
    blocks got (:func:`stage_recomputation`); ``why``: why no other value was priced, where the
    search says (else the usual reason for the option and value, if there is one)."""

    option: str
    value: bool | str | int | tuple   # recompute: False, True, "selective" or per layer;
    #                                   micro_batches: a count; sharding,
    #                                   sequence_parallel: True or False
    peak: float | None
    limit: float
    seconds: float | None
    others: tuple = ()
    stages: tuple = ()          # recompute: per stage, its blocks' (False, "selective", True)
    why: str = ""

    def __str__(self) -> str:
        return "; ".join(line.strip() for line in self.lines())

    def lines(self) -> list:
        """The choice in words: the value chosen and its peak and step time, then each
        other value priced, one a line."""
        text = f"{self.option}={_short(self.value)} chosen by the search"
        if self.option == "micro_batches":
            return [text + " (the stage search's least latency among the counts it priced)"]
        why = (self.why or _UNPRICED.get((self.option, self.value))) if not self.others \
            else None
        if self.peak is not None:
            text += f": peak {fmt_bytes(self.peak)}" + (
                "" if math.isinf(self.limit) else
                f" of the {fmt_bytes(self.limit)} usable on a device") + (
                "" if self.seconds is None else f", {self.seconds:.3g} s per step")
        out = [text] + ([f"  ({why})"] if why else [])
        if self.stages:
            runs = _runs(self.stages)
            out.append("  per stage, as the stage search chose: " + "; ".join(
                f"{_stages(a, b)} {_SPELLED['recompute'][kind]}" for a, b, kind in runs))
        for value, peak, seconds in self.others:
            name = _SPELLED.get(self.option, {}).get(value) if not isinstance(value, tuple) \
                else None
            name = name or _short(value)
            if self.stages and value in ("selective", True):
                name += " on every stage"
            if seconds is not None and peak is None:
                out.append(f"  {name}: {seconds:.3g} s per step at the first micro-batch "
                           f"count priced, memory holding it back there; not planned on")
            elif seconds is not None:
                out.append(f"  {name}: peak {fmt_bytes(peak)}, {seconds:.3g} s per step")
            elif peak is not None:
                out.append(f"  {name}: does not fit (its closest plan needs "
                           f"{fmt_bytes(peak)})")
            else:
                out.append(f"  {name}: does not fit")
        return out

    def to_dict(self) -> dict:
        return {"option": self.option, "value": self.value, "peak": self.peak,
                "limit": None if math.isinf(self.limit) else self.limit,
                "seconds": self.seconds,
                "others": [{"value": v, "peak": p, "seconds": s} for v, p, s in self.others],
                "stages": list(self.stages), "why": self.why}


def _short(value) -> str:
    """A value as the choice's line shows it: a per-layer recomputation by its count and
    kinds (the stages line says where), anything else as its repr."""
    if not isinstance(value, tuple):
        return repr(value)
    scores = sum(isinstance(e, tuple) for e in value)
    kinds = [f"the attention scores of {scores} layers"] if scores else []
    kinds += [f"{len(value) - scores} layers whole"] if len(value) > scores else []
    return f"per layer ({' and '.join(kinds)})"


def _runs(kinds) -> list:
    """[(first stage, last stage, kind)] of the runs of equal kinds in ``kinds``."""
    out = []
    for s, kind in enumerate(kinds):
        if out and out[-1][2] == kind:
            out[-1] = (out[-1][0], s, kind)
        else:
            out.append((s, s, kind))
    return out


def _stages(a: int, b: int) -> str:
    return f"stage {a}" if a == b else f"stages {a}-{b}"


def stage_recomputation(plan) -> tuple:
    """Per stage of a completed ``plan``, the recomputation of the blocks its forward ops
    run there: False, "selective" or True (a stage whose blocks differ: the most any of
    them gets), as its strategy names them per layer or all alike."""
    asked, stages = plan.strategy.recompute, plan.stages
    first = {}
    for op in plan.built.program.ops:
        if op.role is Role.FORWARD and op.layer and op.dist_attr is not None:
            first.setdefault(op.layer, op.dist_attr.mesh.process_ids[0])
    order = (False, "selective", True)
    kinds = [False] * len(stages)
    for block in plan.built.block_paths:
        pid = next((p for layer, p in first.items()
                    if layer == block or layer.startswith(block + ".")), None)
        if pid is None:
            continue
        s = next(s for s, mesh in enumerate(stages) if pid in mesh.process_ids)
        kind = asked if not isinstance(asked, tuple) else \
            True if block in asked else "selective" if (block, "selective") in asked else False
        kinds[s] = max(kinds[s], kind, key=order.index)
    return tuple(kinds)
