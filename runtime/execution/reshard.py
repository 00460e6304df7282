"""Execute reshard steps (:class:`~distgraph.plan.reshard.ReshardStep`, as the planner's
:func:`distgraph.passes.reshard.plan_reshard` makes them).

Every process runs the same list of steps on its own local array; each step touches only
the processes of its mesh (or, for send_recv, the senders and receivers of its tiles).

Example (inside a rank; ``comm`` is a Communicator, ``pid`` the logical process id)::

    steps = plan_reshard(src_attr, dst_attr, shape, dtype="float64")
    new_local = apply_reshard(steps, local, comm, pid)   # None if pid is not in dst
"""

from __future__ import annotations

import numpy as np

from distgraph.errors import RuntimeFault
from distgraph.plan.kinds import StepKind
from distgraph.plan.reshard import ReshardStep
from distgraph.mesh import ProcessRanks
from distgraph.runtime.backend import backend_of


def apply_reshard(steps, local, comm, process_id: int, ranks: ProcessRanks | None = None, tag: int = 0,
                  donate: bool = False):
    """Run ``steps`` on this process's ``local`` array (None if it is not in the source
    mesh) and return its new local array, or None if it is not in the destination mesh.

    ``ranks`` maps a logical process id to a communicator rank (None: process p on rank
    p). ``tag`` is the p2p tag used by send_recv steps. With ``donate``
    the caller gives ``local`` up, and an all-reduce may reduce into it in place (the
    arrays that earlier steps made are reused so in any case).
    """
    owned = donate
    for step in steps:
        out = apply_step(step, local, comm, process_id, ranks, tag, owned)
        # Collectives and make_partial return fresh arrays; a local slice is a view of
        # its input, owned exactly when the input was.
        owned = owned if step.kind is StepKind.SLICE or out is local else True
        local = out
    return local


def run_point(point, local, comm, process_id: int, ranks: ProcessRanks | None = None, tag: int = 0,
              donate: bool = False):
    """Reshard ``point`` (a ReshardPoint) from this process's block ``local`` (None when
    it holds none): its result, None where the process receives nothing. Errors name the
    value and its two layouts."""
    try:
        out = apply_reshard(point.steps, local, comm, process_id, ranks, tag, donate)
    except RuntimeFault as e:
        raise RuntimeFault(f"process {process_id}, reshard of {point.value} "
                           f"({point.src.spec} -> {point.dst.spec}): {e}") from None
    if point.writes and out is None:
        raise RuntimeFault(f"process {process_id}: reshard of {point.value} gave no result")
    return out


def apply_step(step: ReshardStep, local, comm, process_id: int, ranks: ProcessRanks | None = None, tag: int = 0,
               donate: bool = False):
    """Run one step; see :func:`apply_reshard` (``donate``: ``local`` may be reused)."""
    rank = ProcessRanks() if ranks is None else ranks
    if step.kind is StepKind.SEND_RECV:
        return _send_recv(step, local, comm, process_id, rank, tag)
    if process_id not in step.mesh:
        return local
    check_local(step, local, process_id)
    members = step.mesh.group_of(process_id, step.mesh_dim)
    group = tuple(rank(p) for p in members)
    me = members.index(process_id)
    if step.kind is StepKind.ALL_GATHER:
        return comm.all_gather(local, group, axis=step.tensor_dim)
    if step.kind is StepKind.ALL_REDUCE:
        return comm.all_reduce(local, group, inplace=donate)
    if step.kind is StepKind.REDUCE_SCATTER:
        return comm.reduce_scatter(local, group, axis=step.tensor_dim)
    if step.kind is StepKind.ALL_TO_ALL:
        return comm.all_to_all(local, group, split_axis=step.to_tensor_dim,
                               concat_axis=step.tensor_dim)
    xb = backend_of(comm)
    if step.kind is StepKind.SLICE:
        return xb.chunk(local, len(members), step.tensor_dim, me)
    if step.kind is StepKind.MAKE_PARTIAL:
        # the value stays on coordinate 0 of the mesh dim; the others hold zeros
        return xb.copy(local) if me == 0 else xb.zeros_like(local)
    raise RuntimeFault(f"process {process_id}: no executor for reshard step {step}")


def check_local(step: ReshardStep, local, process_id: int) -> None:
    expected = step.src_attr.local_shape(step.shape)
    if local is None or tuple(local.shape) != expected or local.dtype != np.dtype(step.dtype):
        got = "None" if local is None else f"{tuple(local.shape)} {local.dtype}"
        raise RuntimeFault(f"process {process_id}: reshard step {step} expects a local "
                           f"{expected} {step.dtype} array for {step.before} on "
                           f"{step.mesh}, got {got}; plan with the array's dtype and run "
                           f"the steps in order")


def _origin(attr, shape, process_id) -> tuple:
    return tuple(s.start for s in attr.local_slices(shape, process_id))


def outgoing_tiles(step: ReshardStep, local, process_id: int) -> list:
    """The tiles ``process_id`` sends to other processes in a send_recv ``step``, as
    ``[(destination process, array)]`` in transfer order (the order a receiver expects
    them in): the send half of the step, which an actor posts without waiting."""
    if process_id not in step.mesh:
        return []
    check_local(step, local, process_id)
    origin = _origin(step.src_attr, step.shape, process_id)
    return [(t.dst, local[t.slices(origin)]) for t in step.transfers
            if t.src == process_id and t.dst != process_id]


def assemble_tiles(step: ReshardStep, process_id: int, received: list, local, xb):
    """The receive half: ``process_id``'s new local array from the ``received`` tiles
    (in ``step.incoming`` order) and, where it also holds the source, ``local``.
    A single tile that is the whole local block is used as it is, without a copy."""
    dst = step.dst_attr
    shape = dst.local_shape(step.shape)
    mine = [t for t in step.transfers if t.dst == process_id]
    if len(mine) == 1 and mine[0].src != process_id and tuple(mine[0].shape) == tuple(shape):
        return received[0]
    out = xb.zeros(shape, step.dtype)
    origin = _origin(dst, step.shape, process_id)
    src_origin = _origin(step.src_attr, step.shape, process_id) if local is not None else None
    tiles = iter(received)
    for t in mine:
        if t.src == process_id:
            out[t.slices(origin)] = local[t.slices(src_origin)]
        else:
            out[t.slices(origin)] = next(tiles)
    return out


def _send_recv(step: ReshardStep, local, comm, process_id: int, rank, tag: int):
    for dst, tile in outgoing_tiles(step, local, process_id):
        comm.send(tile, rank(dst), tag)
    out = None
    if process_id in step.dst_mesh:
        received = [comm.recv(shape, step.dtype, rank(src), tag)
                    for src, shape in step.incoming(process_id)]
        out = assemble_tiles(step, process_id, received,
                             local if process_id in step.mesh else None, backend_of(comm))
    comm.wait_sends()
    return out
