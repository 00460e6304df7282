"""One process's tasks compiled to instructions that run on a micro-batch's environment.

Each task of the plan's task graph (:mod:`distgraph.passes.pipeline.task_graph`) becomes
a list of instructions — the one instruction set of the runtime: kernels
(:class:`~distgraph.runtime.execution.executor.OpInstr`), reshard points run in place
(:class:`PointInstr`: collectives inside a stage, the update's gradient reductions), the
*send half* of a point that crosses stages (:class:`SendInstr`: its steps up to the
point-to-point transfer, then the tiles to post), the *receive half*
(:class:`RecvInstr`: the tiles that arrived, assembled, then the steps after the
transfer), and the gathers that bring fetched values to every process
(:class:`GatherInstr`). Messages are tagged with the point and the micro-batch, so a
process can post a send and go on computing.

A micro-batch's values live in its own environment from the task that makes them to the
last task that reads them (the activations a forward keeps for its backward); each is
dropped after its last reader among the micro-batch's tasks, and a point or a
``donate`` op may then take its buffer. Values the update reads are accumulated over
the micro-batches as they are made (:class:`Accumulator`).
"""

from __future__ import annotations

from dataclasses import dataclass

from distgraph.errors import RuntimeFault
from distgraph.passes.pipeline.task_graph import PROLOGUE
from distgraph.registry import KernelContext
from distgraph.runtime.execution.executor import OpInstr, last_uses, op_instr, with_donors
from distgraph.runtime.execution.reshard import (apply_reshard, assemble_tiles, incoming_tiles,
                                                 outgoing_tiles, run_point)


@dataclass(frozen=True)
class PointInstr:
    """A reshard point run in place on every process it involves (blocking)."""

    point: object
    reads: tuple
    writes: tuple
    stores: tuple

    def __str__(self) -> str:
        return str(self.point)


@dataclass(frozen=True)
class SendInstr:
    """Steps before the transfer (on the source mesh), then the tiles to post."""

    point: object
    head: tuple
    transfer: object
    reads: tuple
    writes: tuple = ()

    def __str__(self) -> str:
        return f"send of {self.point}"


@dataclass(frozen=True)
class RecvInstr:
    """The tiles of ``transfer`` that arrived, assembled, then the steps after it."""

    point: object
    transfer: object
    tail: tuple
    incoming: tuple           # (source process, shape) in arrival order
    reads: tuple
    writes: tuple

    def __str__(self) -> str:
        return f"receive of {self.point}"


@dataclass(frozen=True)
class GatherInstr:
    """Bring fetched value number ``index`` to every process (in the update)."""

    point: object
    index: int
    reads: tuple
    writes: tuple = ()

    def __str__(self) -> str:
        return f"gather of {self.point.value}"


@dataclass(frozen=True)
class Block:
    """A task compiled: its instructions; ``last[i]``: the names instruction i uses for
    the last time in this task; ``others[name]``: the other tasks of the process that
    use ``name`` (it dies once they too are done for the micro-batch)."""

    task: object
    instrs: tuple
    last: tuple
    others: dict


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


def _split_at_transfer(point):
    steps = list(point.steps)
    k = next(i for i, st in enumerate(steps) if st.kind == "send_recv")
    return tuple(steps[:k]), steps[k], tuple(steps[k + 1:])


class CompiledTasks:
    """The tasks of process ``pid`` of ``plan``, compiled (``blocks[(stage, kind)]``),
    with ``update`` the update's block."""

    def __init__(self, plan, pid: int):
        self.plan, self.pid = plan, pid
        graph = plan.task_graph()
        self.local = local = plan.local(pid)
        acc = plan.accumulation
        points = {p.seq: p for p in local.points()}     # with this process's names
        gathers = graph.gathers[pid]
        self.source_of: dict = {}        # local name -> the global Value it holds
        feeds = {v.name for v in local.program.inputs}
        self.persistable = {v.name for v in local.program.persistables}
        compiled: dict = {}
        for key, task in graph.tasks_of(pid).items():
            instrs = []
            for it in task.items:
                if it.kind == "op":
                    instrs.append(self._op(it.index, acc))
                elif it.kind == "point":
                    p = points[it.index]
                    instrs.append(PointInstr(p, p.reads, p.writes, p.stores))
                elif it.kind == "send":
                    p = points[it.index]
                    head, transfer, _ = _split_at_transfer(p)
                    # the source also receives (overlapping meshes): keep it for the recv
                    keep = (f"{p.value}@SRC{p.seq}",) if pid in p.dst.mesh else ()
                    instrs.append(SendInstr(p, head, transfer, p.reads, keep))
                elif it.kind == "recv":
                    p = points[it.index]
                    _, transfer, tail = _split_at_transfer(p)
                    src = (f"{p.value}@SRC{p.seq}",) if pid in p.src.mesh else ()
                    instrs.append(RecvInstr(p, transfer, tail,
                                            tuple(incoming_tiles(transfer, pid)), src, p.writes))
                else:
                    g = gathers[it.index]
                    instrs.append(GatherInstr(g, it.index, g.reads))
                instr = instrs[-1]
                for name in instr.writes:         # a point's result holds its point's Value
                    self.source_of.setdefault(name, name if isinstance(instr, OpInstr)
                                              else instr.point.value)
            compiled[key] = (task, instrs)
        self.blocks = self._blocks(compiled, feeds)
        self.update = self.blocks.pop((None, "update"))
        self.prologue = self.blocks.pop((None, PROLOGUE), None)
        self.feeds = feeds

    def _op(self, i, acc) -> OpInstr:
        op = self.local.program.ops[i]
        axis = acc.split_axis.get(op.outputs[0].name) if acc is not None and op.outputs else None
        return op_instr(op, self.local.op_context.get(i), axis)

    def _blocks(self, compiled, feeds) -> dict:
        users: dict = {}
        for key, (task, instrs) in compiled.items():
            if task.per_micro_batch:
                for instr in instrs:
                    for name in instr.reads + instr.writes:
                        users.setdefault(name, set()).add(key)
        blocks = {}
        values = self.local.program.values
        for key, (task, instrs) in compiled.items():
            keep = self.persistable if task.per_micro_batch else self.persistable | {
                n for i in instrs if isinstance(i, GatherInstr) for n in i.reads}
            last = last_uses(instrs, keep)
            # an accumulated value is held by the accumulator: never a donor
            dying_ok = [tuple(n for n in names if n not in task.accumulates) for names in last]
            instrs = [with_donors(i, dying, values, feeds) if isinstance(i, OpInstr) else i
                      for i, dying in zip(instrs, dying_ok)]
            others = {name: tuple(sorted(users.get(name, set()) - {key}, key=str))
                      for names in last for name in names}
            blocks[key] = Block(task, tuple(instrs), tuple(last), others)
        return blocks

    def mode(self, name: str) -> str:
        """How ``name`` combines over micro-batches (:meth:`Accumulation.mode`)."""
        acc = self.plan.accumulation
        if acc is None:
            return "keep"
        return acc.mode(self.source_of.get(name, name))


class Accumulator:
    """Values the update reads, accumulated over the micro-batches as they are made:
    summed (a sum over the samples, e.g. a gradient), kept from the first micro-batch (the
    same in every one), or concatenated along their sample dim (per-sample outputs)."""

    def __init__(self, tasks: CompiledTasks, backend):
        self.tasks, self.xb = tasks, backend
        self.values: dict = {}
        self.parts: dict = {}

    def add(self, name: str, value, owned: bool) -> None:
        mode = self.tasks.mode(name)
        if mode == "keep":
            self.values.setdefault(name, value)
        elif mode == "concat":
            self.parts.setdefault(name, []).append(value)
        elif name not in self.values:
            # take the first micro-batch's array when nothing else can see it
            fresh = owned and getattr(value, "base", None) is None and self.xb.writeable(value)
            self.values[name] = value if fresh else self.xb.copy(value)
        else:
            self.values[name] += value

    def result(self) -> dict:
        """The accumulated values; a concatenated one as its list of micro-batch parts
        (only fetched values are, and they are gathered part by part)."""
        out = dict(self.values)
        out.update(self.parts)
        return out


class InstrRunner:
    """Runs the communicating instructions of process ``pid``: ``comm`` and ``ranks``
    (the plan's :class:`~distgraph.mesh.ProcessRanks`) bind them; the caller supplies
    tiles and tags."""

    def __init__(self, pid: int, comm, backend, ranks):
        self.pid, self.comm, self.xb, self.ranks = pid, comm, backend, ranks

    def context(self, step: int, ctx: dict) -> KernelContext:
        return KernelContext(self.xb.xp, step, comm=self.comm, rank_of=self.ranks, **ctx)

    def point(self, instr, env, scope, tag, donate=False):
        local = _get(env, scope, instr.reads[0]) if instr.reads else None
        out = run_point(instr.point, local, self.comm, self.pid, self.ranks, tag, donate)
        if instr.writes:
            env[instr.writes[0]] = out
        for target in getattr(instr, "stores", ()):
            scope[target] = env[instr.writes[0]]
        return out

    def send_tiles(self, instr: SendInstr, env, scope, tag) -> list:
        """Run the steps before the transfer; ``[(rank, tile)]`` to post with ``tag``."""
        local = _get(env, scope, instr.reads[0])
        if instr.head:
            local = apply_reshard(instr.head, local, self.comm, self.pid, self.ranks, tag)
        if instr.writes:
            env[instr.writes[0]] = local
        return [(self.ranks(dst), self.xb.contiguous(tile))
                for dst, tile in outgoing_tiles(instr.transfer, local, self.pid)]

    def receive(self, instr: RecvInstr, env, tiles: list, tag) -> None:
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
