"""Execute reshard steps planned by :func:`distgraph.passes.reshard.plan_reshard`.

Every process runs the same list of steps on its own local array; each step touches only
the processes of its mesh (or, for send_recv, the senders and receivers of its tiles).

Example (inside a rank; ``comm`` is a Communicator, ``pid`` the logical process id)::

    steps = plan_reshard(src_attr, dst_attr, shape, dtype="float64")
    new_local = apply_reshard(steps, local, comm, pid)   # None if pid is not in dst
"""

from __future__ import annotations

import numpy as np

from distgraph.errors import RuntimeFault
from distgraph.passes.reshard import Step


def _rank_fn(rank_of):
    if rank_of is None:
        return int
    if callable(rank_of):
        return rank_of
    return rank_of.__getitem__


def apply_reshard(steps, local, comm, process_id: int, rank_of=None, tag: int = 0,
                  donate: bool = False):
    """Run ``steps`` on this process's ``local`` array (None if it is not in the source
    mesh) and return its new local array, or None if it is not in the destination mesh.

    ``rank_of`` maps a logical process id to a communicator rank: a mapping, a callable
    or None (identity). ``tag`` is the p2p tag used by send_recv steps. With ``donate``
    the caller gives ``local`` up, and an all-reduce may reduce into it in place (the
    arrays that earlier steps made are reused so in any case).
    """
    owned = donate
    for step in steps:
        out = apply_step(step, local, comm, process_id, rank_of, tag, owned)
        # Collectives and make_partial return fresh arrays; a local slice is a view of
        # its input, owned exactly when the input was.
        owned = owned if step.kind == "slice" or out is local else True
        local = out
    return local


def apply_step(step: Step, local, comm, process_id: int, rank_of=None, tag: int = 0,
               donate: bool = False):
    """Run one step; see :func:`apply_reshard` (``donate``: ``local`` may be reused)."""
    rank = _rank_fn(rank_of)
    if step.kind == "send_recv":
        return _send_recv(step, local, comm, process_id, rank, tag)
    if process_id not in step.mesh:
        return local
    _check_local(step, local, process_id)
    members = step.mesh.group_of(process_id, step.mesh_dim)
    group = tuple(rank(p) for p in members)
    me = members.index(process_id)
    if step.kind == "all_gather":
        return comm.all_gather(local, group, axis=step.tensor_dim)
    if step.kind == "all_reduce":
        return comm.all_reduce(local, group, inplace=donate)
    if step.kind == "reduce_scatter":
        return comm.reduce_scatter(local, group, axis=step.tensor_dim)
    if step.kind == "all_to_all":
        return comm.all_to_all(local, group, split_axis=step.to_tensor_dim,
                               concat_axis=step.tensor_dim)
    if step.kind == "slice":
        chunk = np.split(local, len(members), axis=step.tensor_dim)[me]
        return np.ascontiguousarray(chunk)
    if step.kind == "make_partial":
        # the value stays on coordinate 0 of the mesh dim; the others hold zeros
        return local.copy() if me == 0 else np.zeros_like(local)
    raise RuntimeFault(f"process {process_id}: no executor for reshard step {step}")


def _check_local(step: Step, local, process_id: int) -> None:
    expected = step.src_attr.local_shape(step.shape)
    if local is None or tuple(local.shape) != expected or local.dtype != np.dtype(step.dtype):
        got = "None" if local is None else f"{tuple(local.shape)} {local.dtype}"
        raise RuntimeFault(f"process {process_id}: reshard step {step} expects a local "
                           f"{expected} {step.dtype} array for {step.before} on "
                           f"{step.mesh}, got {got}; plan with the array's dtype and run "
                           f"the steps in order")


def _send_recv(step: Step, local, comm, process_id: int, rank, tag: int):
    if process_id in step.mesh:
        _check_local(step, local, process_id)
        origin = tuple(s.start for s in step.src_attr.local_slices(step.shape, process_id))
        for t in step.transfers:
            if t.src == process_id and t.dst != process_id:
                comm.send(local[t.slices(origin)], rank(t.dst), tag)
    out = None
    if process_id in step.dst_mesh:
        dst = step.dst_attr
        out = np.zeros(dst.local_shape(step.shape), dtype=step.dtype)
        origin = tuple(s.start for s in dst.local_slices(step.shape, process_id))
        src_origin = None
        if process_id in step.mesh:
            src_origin = tuple(s.start for s in step.src_attr.local_slices(step.shape,
                                                                            process_id))
        for t in step.transfers:
            if t.dst != process_id:
                continue
            if t.src == process_id:
                out[t.slices(origin)] = local[t.slices(src_origin)]
            else:
                out[t.slices(origin)] = comm.recv(t.shape, step.dtype, rank(t.src), tag)
    comm.wait_sends()
    return out
