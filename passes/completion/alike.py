"""A completion replayed on another mesh, where it provably completes alike.

A completion run (:mod:`distgraph.passes.completion.complete`) is a deterministic walk:
from the specs the annotations fix, every step asks one op's rule a query (its operands'
known specs) and merges the answer. Where every op sits on one mesh and no conflict was
priced (the reshard pricer is the only other place a mesh's size enters), the walk
depends on the mesh only through the rules' answers. So a program alike up to that mesh
-- the same ops, Values, shapes and annotations, the mesh replaced by one of the same
dim names and any size -- completes to the same specs if every query the first run
asked gets the same answer from its op's rule bound to the new mesh: by induction over
the walk's steps, the second run asks the same queries in the same order and merges the
same answers. :func:`complete_alike` checks exactly that (each distinct query once: the
run's memo holds every query it asked) and writes the first run's layout onto the
program on the new mesh; the written DistAttrs are validated on it as a run's are.

The sample-axis analysis (:mod:`distgraph.passes.samples`) completes one program on
meshes of M micro-batches for several M: a count whose rules answer alike shares it.

Example::

    run = complete_run(copy_a, default_mesh=mesh_a)
    complete_alike(run, copy_b, mesh_b)       # True: copy_b completed as a run would
"""

from __future__ import annotations

import copy

from distgraph.mesh import ProcessMesh
from distgraph.registry import spmd_rule
from distgraph.spmd import SpmdRuleError


def complete_alike(run, program, mesh: ProcessMesh) -> bool:
    """Complete ``program`` on ``mesh`` as ``run`` (a :func:`~distgraph.passes.
    completion.complete.complete_run` of a program alike up to its one mesh; module
    docstring) completed its own, where that is shown to be what completing it would
    give: True, ``program`` completed; else False and ``program`` is untouched. Raises
    where writing the layout does (a split the mesh does not divide), as a run would."""
    static = run.static
    meshes = set(static.mesh) | set(static.vmesh.values())
    if run.conflicts or run.choices or len(meshes) != 1 or None in static.signature:
        return False
    if next(iter(meshes)).dim_names != mesh.dim_names or len(program.ops) != len(run.ops):
        return False
    first: dict = {}
    for k, sig in enumerate(static.rule_key):
        first.setdefault(sig, k)
    bound: dict = {}
    for (sig, query), answer in static.memo.items():
        rule = bound.get(sig)
        try:
            if rule is None:
                op = program.ops[first[sig]]
                rule = bound[sig] = spmd_rule(op.type).bind(
                    [v.shape for v in op.inputs], [o.shape for o in op.outputs], mesh,
                    op.attrs)
            if rule.solve(query) != answer:
                return False
        except SpmdRuleError:           # the run on ``mesh`` raises it: let it
            return False
    view = copy.copy(run)               # the run's specs, on ``program`` and ``mesh``
    view.program, view.ops = program, program.ops
    view.mesh = [mesh] * len(program.ops)
    view.vmesh = dict.fromkeys(run.vmesh, mesh)
    view.write()
    return True
