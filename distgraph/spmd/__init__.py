"""Sharding (SPMD) rules: which shard specs an op consumes and produces.

Completion works on specs whose entries may still be unknown (``UNKNOWN``, printed
``?``: "no preference"), so rules take and return :class:`DimsSpec` — the
completion-time form of a ShardSpec. Every op's rule is generated from an einsum-like
notation (reshape's too: each merge/split group is one letter on its major dims)::

    "mk,kn->mn"        matmul: k is contracted, so a split k makes the output Partial
    "abc->abc"         elementwise
    "abC->abC"         softmax over the last axis: UPPERCASE letters are never split
    "a1c,abc->abc"     broadcasting: '1' is a size-1 dim stretched, never split

Called directly::

    rule = dg.ops.spmd_rule("add")
    rule.infer_forward(in_specs, in_shapes, mesh, **attrs)
    rule.infer_backward(in_specs, out_specs, in_shapes, out_shapes, mesh, **attrs)
    rule.strategies(in_shapes, out_shapes, mesh, **attrs)      # -> [OpStrategy, ...]

Specs are lists (or ShardSpecs / DimsSpecs) with one entry per dim: None, a mesh dim, a
tuple of mesh dims, or ``UNKNOWN``. Unknown attributes, a wrong operand count and axes
out of range are errors (:class:`SpmdRuleError`); negative axes count from the end.

Tie-break: how a rule settles operands that disagree
-----------------------------------------------------
1. Operands are taken in priority order: fixed (annotated) outputs, fixed inputs, then
   the other inputs and outputs — inputs first forward (``infer_forward``), outputs
   first backward (``infer_backward``) — and each operand's dims left to right.
   (Completion may put one operand first, ``lead``, to price keeping it.)
2. Each letter takes the first known entry offered for it (None, a mesh dim or a tuple:
   None is a value, as on completion's semilattice unknown < {None, x, ...}). A later
   operand that wants another entry for that letter is resharded: ``input 1 dim 'k'
   wants y, kept x``.
3. A mesh dim splits one letter only: the letter whose offer comes first in that order
   (by operand, then by dim) gets it — not the letter that comes first in the notation.
   An offer keeps the largest part of it that is still free and divides every dim of
   its letter (``(x, y)`` becomes ``y`` when ``x`` is taken, ``x`` when only ``x``
   divides); if nothing is left, the letter stays open and takes the next operand's
   offer.
4. UPPERCASE and '1' letters are never split; a split offered there is resharded.
5. For each output, the mesh dims of the letters it lacks (contracted, reduced) make it
   Partial, except the letters an op reduces with its own communication (``internal``).
6. A second opinion where that reshards an operand (:mod:`distgraph.spmd.keep`): with the
   operands it keeps as they are, the other letters take the splits of the resharded
   operands' offers that divide the op the most ways; that answer wins when it splits
   more ways. So no answer reshards only operands ours reshards and is more split:
   ``concat`` of ``[None, x, y]``, ``[None, x, y]`` and ``[y, None, x]`` along axis 1
   gives ``[y, None, x]`` (the third kept), not ``[None, None, y]``.
7. ``concat`` aligns, as Paddle's phi concat does (:mod:`distgraph.spmd.align`): a mesh
   dim the answer leaves unused that an operand offers (on the concat dim, which is never
   split, or against another operand's None) splits a dim every operand has, the one
   where an operand offers it first, else the first it divides: ``[None, None]`` and
   ``[None, x]`` along axis 1 give ``[x, None]`` (the first sliced, the second moved by
   an all-to-all), not ``[None, None]`` (the second all-gathered). And an output asked
   for split on the concat dim (its known spec: an annotation, what its consumers take)
   keeps that split where the mesh dims are free: the op computes its slice from inputs
   whole there (``EinsumRule(sliced=True)``; backward, ``[None, x]`` gives inputs
   ``[None, None]`` and the output ``[None, x]``, as Paddle's reverse rule does).

Paddle's phi rules agree on 1 and 3 (the first tensor axis to claim a mesh dim keeps
it). They differ where an operand leaves a dim unsplit and another splits it: Paddle
merges replicated with sharded into sharded, ours keeps the earlier operand's None (the
other operand is gathered) — completion prices such conflicts by the bytes they move —
except for concat (7). tests/test_spmd_generated.py holds concat's generated cases to
Paddle's recorded answers and names the cases where ours differs, and why.

So ``add`` of x ``[None, None, x]`` and y ``[x, None, None]`` keeps x's layout (both are
consumed as ``[None, None, x]``, as Paddle does); an annotated bias ``[x]`` keeps its
split against an activation that wants ``x`` for its batch dim. Every answer is a
fixpoint: fed its own specs, a rule gives them back.
"""

from distgraph.spmd.einsum import (
                                   LETTERS,
                                   EinsumPlan,
                                   EinsumRule,
                                   axes_of,
                                   axis_of,
                                   axis_rule,
                                   broadcast_notation,
                                   elementwise_rule,
)
from distgraph.spmd.rule import BoundRule, OpStrategy, Rule, RuleQuery, Source, SpmdResult
from distgraph.spmd.specs import UNKNOWN, DimsSpec, SpmdRuleError, entry_dims, entry_of, entry_str

__all__ = ["LETTERS", "UNKNOWN", "BoundRule", "DimsSpec", "EinsumPlan", "EinsumRule",
           "OpStrategy", "Rule", "RuleQuery", "Source", "SpmdResult", "SpmdRuleError",
           "axes_of", "axis_of", "axis_rule", "broadcast_notation", "elementwise_rule",
           "entry_dims", "entry_of", "entry_str"]
