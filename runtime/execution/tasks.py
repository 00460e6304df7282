"""Run a process's compiled tasks: the accumulator and the communicating instructions.

A process's tasks come compiled in its :class:`~distgraph.plan.program.ProcessProgram`
(the planner's :mod:`distgraph.passes.pipeline.compile`): kernels, reshard points run in
place, the send and receive halves of points that cross stages, and the gathers of
fetched values. Messages are tagged with the point and the micro-batch, so a process can
post a send and go on computing. Values the update reads are accumulated over the
micro-batches as they are made (:class:`Accumulator`); :class:`InstrRunner` runs the
instructions that communicate.
"""

from __future__ import annotations

from distgraph.errors import RuntimeFault
from distgraph.plan.kinds import AccumulationMode
from distgraph.registry import KernelContext
from distgraph.runtime.execution.memory import Counted
from distgraph.runtime.execution.reshard import (apply_reshard, assemble_tiles, outgoing_tiles,
                                                 run_point)


def micro_batch_context(ctx: dict, axis: int | None, micro_batches: int, m) -> dict:
    """The kernel context of a random op for micro-batch ``m``: its ``out_global_shape``
    (a micro-batch's global tensor) grown to the full batch of ``micro_batches`` along
    ``axis`` and its ``out_slices`` moved ``m`` micro-batches on (``m``: the micro-batch's
    position, ``Plan.micro_batch_positions``, a Fraction under an uneven split). Unchanged
    when the op's result does not carry samples (``axis`` None)."""
    if axis is None or "out_global_shape" not in ctx:
        return ctx
    shape = list(ctx["out_global_shape"])
    rows = shape[axis]
    shape[axis] = rows * micro_batches
    slices = list(ctx.get("out_slices") or tuple(slice(0, n) for n in ctx["out_global_shape"]))
    s = slices[axis]
    shift = int(m * rows)
    slices[axis] = slice(s.start + shift, s.stop + shift)
    return {**ctx, "out_global_shape": tuple(shape), "out_slices": tuple(slices)}


class Accumulator:
    """Values the update reads, accumulated over the micro-batches as they are made:
    summed (a sum over the samples, e.g. a gradient), kept from the first micro-batch (the
    same in every one), or concatenated along their sample dim (per-sample outputs). The
    step's ``ledger`` (:class:`~distgraph.runtime.execution.memory.Ledger`) counts them."""

    def __init__(self, program, backend, ledger):
        self.program, self.xb, self.ledger = program, backend, ledger
        self.values = Counted(ledger)
        self.parts = Counted(ledger)

    def add(self, name: str, value, owned: bool) -> None:
        mode = self.program.mode(name)
        if mode is AccumulationMode.KEEP:
            self.values.setdefault(name, value)
        elif mode is AccumulationMode.CONCAT:
            self.parts[name] = self.parts.get(name, []) + [value]
        elif name not in self.values:
            # take the first micro-batch's array when nothing else can see it
            fresh = owned and getattr(value, "base", None) is None and self.xb.writeable(value)
            self.values[name] = value if fresh else self.xb.copy(value)
        else:
            self.values[name] += value

    def take(self) -> Counted:
        """The accumulated values, handed over (the accumulator is empty after it, so the
        update frees each one at its last use); a concatenated one as its list of
        micro-batch parts (only fetched values are, and they are gathered part by part)."""
        out = Counted(self.ledger, self.values)
        out.update(self.parts)
        self.values.clear()
        self.parts.clear()
        return out


class InstrRunner:
    """Runs the communicating instructions of process ``pid``: ``comm`` and ``ranks``
    (the plan's :class:`~distgraph.mesh.ProcessRanks`) bind them; the caller supplies
    tiles and tags."""

    def __init__(self, pid: int, comm, backend, ranks):
        self.pid, self.comm, self.xb, self.ranks = pid, comm, backend, ranks

    def context(self, step: int, ctx: dict, saved: dict | None = None) -> KernelContext:
        return KernelContext(self.xb.xp, step, comm=self.comm, ranks=self.ranks, saved=saved,
                             **ctx)

    def point(self, instr, env, scope, tag, donate=False):
        local = _get(env, scope, instr.reads[0]) if instr.reads else None
        out = run_point(instr.point, local, self.comm, self.pid, self.ranks, tag, donate)
        if instr.writes:
            env[instr.writes[0]] = out
        for target in getattr(instr, "stores", ()):
            scope[target] = env[instr.writes[0]]
        return out

    def send_tiles(self, instr, env, scope, tag) -> list:
        """Run the steps before the transfer; ``[(rank, tile)]`` to post with ``tag``."""
        local = _get(env, scope, instr.reads[0])
        if instr.head:
            local = apply_reshard(instr.head, local, self.comm, self.pid, self.ranks, tag)
        if instr.writes:
            env[instr.writes[0]] = local
        return [(self.ranks(dst), self.xb.contiguous(tile))
                for dst, tile in outgoing_tiles(instr.transfer, local, self.pid)]

    def receive(self, instr, env, tiles: list, tag) -> None:
        """Assemble the arrived ``tiles`` and run the steps after the transfer."""
        local = env.get(instr.reads[0]) if instr.reads else None
        out = assemble_tiles(instr.transfer, self.pid, tiles, local, self.xb)
        if instr.tail:
            out = apply_reshard(instr.tail, out, self.comm, self.pid, self.ranks, tag)
        env[instr.writes[0]] = out


def _get(env, scope, name):
    try:
        return env[name] if name in env else scope[name]
    except KeyError:
        raise RuntimeFault(f"a reshard needs {name!r}, which is not computed, received or "
                           f"fed") from None
