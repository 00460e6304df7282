"""Executable tasks: one process's task items compiled to steps that run on a
micro-batch's environment.

Each task of :mod:`distgraph.passes.pipeline.task_graph` becomes a list of steps: kernels,
reshard points run in place (collectives inside a stage, the update's gradient
reductions), the *send half* of a point that crosses stages (its steps up to the
point-to-point transfer, then the tiles to post), the *receive half* (assemble the
tiles that arrived, then the steps after the transfer), and the gathers that bring
fetched values to every process. Sends and receives are separate steps, and their
messages are tagged with the point and the micro-batch, so an actor can post a send and
go on computing.

A micro-batch's values live in its own environment from the task that makes them to the
last task that reads them (the activations a forward keeps for its backward are this
"stash"); each is dropped after its last reader. Values the update reads are
accumulated over the micro-batches as they are made (:class:`Accumulator`).
"""

from __future__ import annotations

from dataclasses import dataclass

from distgraph.errors import RuntimeFault
from distgraph.registry import KernelContext, rank_lookup
from distgraph.passes.pipeline.accumulate import micro_batch_context
from distgraph.passes.partition import gather_points
from distgraph.passes.pipeline.task_graph import PER_MICRO_BATCH
from distgraph.runtime.execution.executor import OpInstr, call_kernel, op_instr, reads_of, writes_of
from distgraph.runtime.execution.reshard import (apply_reshard, assemble_tiles, incoming_tiles,
                                            outgoing_tiles, run_point)


@dataclass(frozen=True)
class PointStep:
    """A reshard point run in place on every process it involves (blocking)."""
    point: object
    reads: tuple
    writes: tuple
    stores: tuple


@dataclass(frozen=True)
class SendStep:
    """Steps before the transfer (on the source mesh), then the tiles to post."""
    point: object
    head: tuple
    transfer: object
    reads: tuple
    writes: tuple = ()


@dataclass(frozen=True)
class RecvStep:
    """The tiles of ``transfer`` that arrived, assembled, then the steps after it."""
    point: object
    transfer: object
    tail: tuple
    incoming: tuple           # (source process, shape) in arrival order
    reads: tuple
    writes: tuple


@dataclass(frozen=True)
class GatherStep:
    """Bring fetched value number ``index`` to every process (in the update)."""
    point: object
    index: int
    reads: tuple
    writes: tuple
    stores: tuple = ()


def _split_at_transfer(point):
    steps = list(point.steps)
    k = next(i for i, st in enumerate(steps) if st.kind == "send_recv")
    return tuple(steps[:k]), steps[k], tuple(steps[k + 1:])


class ProcessTasks:
    """The compiled tasks of process ``pid`` of ``plan`` (with its ``graph``)."""

    def __init__(self, plan, graph, pid: int):
        self.plan, self.graph, self.pid = plan, graph, pid
        self.local = local = plan.local(pid)
        self.tasks = graph.tasks_of(pid)
        acc = plan.accumulation
        points = {p.seq: p for p in local.points()}
        gathers = gather_points(plan.program, graph.fetch, pid)
        self.source_of: dict = {}        # local name -> the global Value it holds
        self.steps: dict = {}
        for kind, task in self.tasks.items():
            steps = []
            for it in task.items:
                if it.kind == "op":
                    steps.append(self._op_step(it.index, acc))
                elif it.kind == "point":
                    p = points[it.index]
                    steps.append(PointStep(p, p.reads, p.writes, p.stores))
                elif it.kind == "send":
                    p = points[it.index]
                    head, transfer, _ = _split_at_transfer(p)
                    # the source also receives (overlapping meshes): keep it for the recv
                    keep = (f"{p.value}@SRC{p.seq}",) if pid in p.dst.mesh else ()
                    steps.append(SendStep(p, head, transfer, p.reads, keep))
                elif it.kind == "recv":
                    p = points[it.index]
                    _, transfer, tail = _split_at_transfer(p)
                    src = (f"{p.value}@SRC{p.seq}",) if pid in p.src.mesh else ()
                    steps.append(RecvStep(p, transfer, tail,
                                          tuple(incoming_tiles(transfer, pid)), src, p.writes))
                else:
                    g = gathers[it.index]
                    steps.append(GatherStep(g, it.index, g.reads, g.writes))
                st = steps[-1]
                for name in writes_of(st):         # a point's result holds its point's Value
                    self.source_of.setdefault(name, name if isinstance(st, OpInstr)
                                              else st.point.value)
            self.steps[kind] = steps
        self.persistable = {v.name for v in local.program.persistables}
        self.order = [k for k in PER_MICRO_BATCH if k in self.tasks]
        self.frees = self._liveness()

    def _op_step(self, i, acc) -> OpInstr:
        op = self.local.program.ops[i]
        axis = acc.split_axis.get(op.outputs[0].name) if acc is not None and op.outputs else None
        return op_instr(op, self.local.op_context.get(i), axis)

    def _liveness(self) -> dict:
        """{(kind, step index): names to drop from the micro-batch's environment after
        that step}: each name after its last reader among the per-micro-batch tasks."""
        last: dict = {}
        for kind in self.order:
            for j, st in enumerate(self.steps[kind]):
                for name in reads_of(st) + writes_of(st):
                    last[name] = (kind, j)
        frees: dict = {}
        for name, at in last.items():
            if name not in self.persistable:
                frees.setdefault(at, []).append(name)
        return {at: tuple(names) for at, names in frees.items()}

    def mode(self, name: str) -> str:
        acc = self.plan.accumulation
        if acc is None:
            return "keep"
        return acc.mode(self.source_of.get(name, name))


class Accumulator:
    """Values the update reads, accumulated over the micro-batches as they are made:
    summed (a sum over the samples, e.g. a gradient), kept from the first micro-batch (the
    same in every one), or concatenated along their sample dim (per-sample outputs)."""

    def __init__(self, tasks: ProcessTasks, backend, micro_batches: int):
        self.tasks, self.xb, self.m = tasks, backend, micro_batches
        self.values: dict = {}
        self.parts: dict = {}

    def add(self, name: str, value, micro_batch: int, owned: bool) -> None:
        mode = self.tasks.mode(name)
        if mode == "keep":
            self.values.setdefault(name, value)
        elif mode == "concat":
            self.parts.setdefault(name, []).append(value)
        elif name not in self.values:
            # take the first micro-batch's array when nothing else can see it
            fresh = owned and getattr(value, "base", None) is None and value.flags.writeable
            self.values[name] = value if fresh else self.xb.copy(value)
        else:
            self.values[name] += value

    def result(self) -> dict:
        """The accumulated values; a concatenated one as its list of micro-batch parts
        (only fetched values are, and they are gathered part by part)."""
        out = dict(self.values)
        out.update(self.parts)
        return out


class StepRunner:
    """Runs compiled steps of one process: ``scope`` (persistables), ``comm``, the
    array backend and the ``step`` number bind a run; the carrier supplies tiles."""

    def __init__(self, tasks: ProcessTasks, comm, backend, rank_of):
        self.t, self.comm, self.xb = tasks, comm, backend
        self.rank_of = rank_of
        self.rank = rank_lookup(rank_of)
        self.micro_batches = tasks.graph.micro_batches

    def run_op(self, st: OpInstr, env, scope, step, micro_batch):
        try:
            args = [env[n] if n in env else scope[n] for n in st.ins]
        except KeyError as e:
            raise RuntimeFault(f"op '{st.op_type}' needs {e.args[0]!r}, which is not "
                               f"computed, received or fed") from None
        ctx = st.ctx
        if st.axis is not None and "out_global_shape" in ctx:
            ctx = micro_batch_context(ctx, st.axis, self.micro_batches, micro_batch)
        kctx = KernelContext(self.xb.xp, step, comm=self.comm, rank_of=self.rank_of, **ctx)
        result = call_kernel(st.kernel, st.op_type, st.layer, kctx, args, st.attrs)
        for name, arr in zip(st.outs, result):
            env[name] = arr
        for k, target in st.writeback:
            scope[target] = result[k]

    def run_point(self, st, env, scope, tag):
        out = run_point(st.point, _get(env, scope, st.reads[0]) if st.reads else None,
                        self.comm, self.t.pid, self.rank_of, tag)
        if st.writes:
            env[st.writes[0]] = out
        for target in st.stores:
            scope[target] = env[st.writes[0]]
        return out

    def send_tiles(self, st: SendStep, env, scope, tag) -> list:
        """Run the steps before the transfer; ``[(rank, tile)]`` to post with ``tag``."""
        local = _get(env, scope, st.reads[0])
        if st.head:
            local = apply_reshard(st.head, local, self.comm, self.t.pid, self.rank_of, tag)
        if st.writes:
            env[st.writes[0]] = local
        return [(self.rank(dst), self.xb.contiguous(tile))
                for dst, tile in outgoing_tiles(st.transfer, local, self.t.pid)]

    def receive(self, st: RecvStep, env, tiles: list, tag) -> None:
        """Assemble the arrived ``tiles`` and run the steps after the transfer."""
        local = env.get(st.reads[0]) if st.reads else None
        out = assemble_tiles(st.transfer, self.t.pid, tiles, local, self.xb)
        if st.tail:
            out = apply_reshard(st.tail, out, self.comm, self.t.pid, self.rank_of, tag)
        env[st.writes[0]] = out


def _get(env, scope, name):
    return env[name] if name in env else scope[name]
