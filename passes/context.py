"""Context parallelism in the planner: which form each attention op whose sequence is
split runs (:mod:`distgraph.ops.context_parallel`), chosen by the cost model per op
where the strategy leaves it open (``Strategy(context_parallel=None)``).

:func:`form_times` prices the forms at one op on its mesh's first process, with the
prices every other pass uses (:mod:`distgraph.passes.cost.prices`): the op's compute
(the same work either way: its share of the sequence's pairs) and its collectives on
the ring of its sequence group.

- **Ulysses** runs its all-to-alls, then the compute: ``compute + all-to-alls``.
- **Ring** computes block by block while the next k, v block travels (non-blocking
  sends): the pipeline of the op's ``overlap`` hook (n slices, a hop before each, and a
  dk, dv hop after each in the gradient), priced as MeshSlice's is
  (:func:`~distgraph.passes.cost.prices.overlap_time`): the search and the estimate
  price the ring the same way.

:func:`assign_forms` gives each such op the fastest form that can run there, once the
processes have devices (as MeshSlice's K is given). A form the strategy fixed stays.

Example::

    times = form_times(op, cluster, device_of)     # {"ulysses": 1.2e-3, "ring": 9e-4}
    assign_forms(program, cluster, device_of)      # op.attrs["context_parallel"] = ...
"""

from __future__ import annotations

from distgraph.ops import context_parallel as cp
from distgraph.passes.cost.prices import Rings, op_comm_time, op_time, overlap_time
from distgraph.placement import DistAttr
from distgraph.registry import LocalSite, TensorType

OPS = ("attention", "attention_grad")


def _site(op, pid: int) -> LocalSite:
    da = op.dist_attr
    return LocalSite(pid, tuple(v.shape for v in op.inputs),
                     tuple(DistAttr(da.mesh, s) for s in da.input_specs),
                     tuple(o.shape for o in op.outputs),
                     tuple(DistAttr(da.mesh, s) for s in da.output_specs),
                     tuple(v.dtype for v in op.inputs), tuple(sorted(op.attrs.items())))


def form_times(op, rings: Rings, pid: int | None = None) -> dict:
    """{form: seconds} of a completed attention op (or its gradient) whose sequence is
    split, on process ``pid`` (default: its mesh's first), for both forms whether they
    can run or not; {} when its sequence is whole."""
    pid = op.dist_attr.mesh.process_ids[0] if pid is None else pid
    site = _site(op, pid)
    if not cp.split(site):
        return {}
    group = site.split_group(0, 2)
    mesh = op.dist_attr.mesh
    ins = [TensorType(a.local_shape(v.shape), v.dtype) for a, v in zip(site.in_attrs, op.inputs)]
    outs = [TensorType(a.local_shape(o.shape), o.dtype)
            for a, o in zip(site.out_attrs, op.outputs)]
    device = rings.device(pid)
    grad = op.type == "attention_grad"
    times = {}
    for form in cp.IMPLEMENTATIONS:
        attrs = {**op.attrs, "context_parallel": form, "sequence_parts": len(group),
                 "sequence_dims": tuple(site.in_attrs[0].spec.entry(2))}
        ways = cp.overlap(attrs, ins)
        if ways:
            times[form] = sum(overlap_time(ways[0], device,
                                           lambda dim: rings.along(mesh, pid, dim)))
        else:
            ring = rings.of_op(mesh, pid, {"group": group})
            times[form] = op_time(op.type, ins, outs, attrs, device) + \
                op_comm_time(cp.collectives(form, site, grad), ring, device)
    return times


def assign_forms(program, cluster, device_of) -> int:
    """Give every attention op (and gradient) whose sequence is split and whose form is
    open the fastest form that can run there (module docstring); how many it gave."""
    rings = Rings(cluster, device_of)
    given = 0
    for op in program.ops:
        if op.type not in OPS or op.dist_attr is None or op.attrs.get("context_parallel"):
            continue
        times = form_times(op, rings)
        if not times:
            continue
        can = cp.runnable(_site(op, op.dist_attr.mesh.process_ids[0]))
        if len(can) < 2:
            continue          # one form (or none: localize says why): nothing to choose
        op.attrs["context_parallel"] = min(can, key=lambda f: times[f])
        given += 1
    return given
