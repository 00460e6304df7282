"""Run a Program's kernels in order, freeing each intermediate after its last use.

Persistable Values (parameters, optimizer states) live in a ``scope`` dict that outlives
a run; update ops write into them in place and their results are stored back under the
persistable's name (``Value.alias_of``).

Example::

    runner = ProgramRunner(prog)
    out = runner.run(scope, feed={"x": x}, fetch=["mean_0"], step=0)
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
from distgraph.runtime.launch.progress import NO_PROGRESS

from distgraph.errors import RuntimeFault
from distgraph.ir import Program
from distgraph.registry import KernelContext, get_op

DONATE_MIN_BYTES = 1 << 16   # below this a fresh buffer costs about nothing


@dataclass(frozen=True)
class OpInstr:
    """One op, compiled: its kernel and the names it reads and writes. Shared by the
    executor and the pipeline's tasks (:mod:`distgraph.runtime.execution.tasks`)."""

    kernel: object
    op_type: str
    layer: str
    ins: tuple
    outs: tuple
    attrs: dict
    writeback: tuple      # (output position, persistable name)
    ctx: dict             # KernelContext fields from partition (random ops, groups)
    donors: tuple = ()    # inputs whose buffer may become the result (see ``donate``)
    axis: int | None = None   # the result's sample dim, for random ops' micro-batch slice


def op_instr(op, ctx=None, axis=None) -> OpInstr:
    """The instruction of Operation ``op`` (``ctx``: its extra KernelContext fields)."""
    writeback = tuple((k, o.alias_of) for k, o in enumerate(op.outputs) if o.alias_of)
    return OpInstr(get_op(op.type).kernel, op.type, op.layer, tuple(v.name for v in op.inputs),
                   tuple(o.name for o in op.outputs), dict(op.attrs), writeback,
                   dict(ctx or {}), axis=axis)


class ProgramRunner:
    """Compiled instruction list of one Program (serial, or one process's local part).

    ``op_context`` optionally maps an op index to extra KernelContext fields (the global
    shape and local slices of a sharded random op). ``comm_points`` maps an op index to
    communication points run before that op (index ``len(ops)``: after the last op);
    each has ``reads``, ``writes`` and ``execute(env)``, and counts in the liveness
    analysis like an op, so a value is kept until the last message that sends it.

    A point with ``can_donate`` is run as ``execute(env, donate=True)`` when the value
    it reads dies there (not fed, fetched or persistable) and its array, at least
    ``DONATE_MIN_BYTES``, is no view and has none among the live values: the point may
    then overwrite it, e.g. all-reduce a gradient in place instead of into a new buffer.
    Ops registered with ``donate`` get such a dying input of their result's shape and
    dtype as ``ctx.out`` (a bias add writes into the matmul result it consumes).

    With a communicator whose ``progress`` is watched (under the launcher), the runner
    marks each instruction it starts, so a rank that stops making progress can be named
    with the step and the op it is in.
    """

    def __init__(self, program: Program, xp=np, fetch_always=(), op_context=None,
                 comm_points=None, comm=None, rank_of=None):
        self.program = program
        self.xp = xp
        self.comm, self.rank_of = comm, rank_of
        self.feed_names = [v.name for v in program.inputs]
        keep = {v.name for v in program.values.values() if v.persistable}
        keep |= set(fetch_always)
        op_context = op_context or {}
        comm_points = comm_points or {}
        items: list = []
        for i, op in enumerate(program.ops):
            items.extend(comm_points.get(i, ()))
            items.append(op_instr(op, op_context.get(i)))
        items.extend(comm_points.get(len(program.ops), ()))
        last_use: dict[str, int] = {}
        for i, item in enumerate(items):
            for name in reads_of(item) + writes_of(item):
                last_use[name] = i
        compiled = []
        self.donatable: dict[int, tuple] = {}
        values = program.values
        for i, item in enumerate(items):
            free = tuple(sorted({n for n in reads_of(item) + writes_of(item)
                                 if last_use.get(n) == i and n not in keep}))
            if isinstance(item, OpInstr) and get_op(item.op_type).donate:
                out = values[item.outs[0]]
                donors = tuple(n for n in dict.fromkeys(item.ins)
                               if n in free and n not in self.feed_names
                               and values[n].shape == out.shape and values[n].dtype == out.dtype)
                item = dataclasses.replace(item, donors=donors)
            compiled.append((item, free))
            dying = tuple(n for n in reads_of(item) if n in free and n not in self.feed_names)
            if getattr(item, "can_donate", False) and dying:
                self.donatable[i] = dying
        self.items = compiled
        self.progress = getattr(comm, "progress", NO_PROGRESS)
        self._table = self.progress.table([_label(item) for item, _ in compiled]) \
            if self.progress.active else -1

    def run(self, scope: dict, feed: dict | None = None, fetch=(), step: int = 0,
            timings: list | None = None) -> dict:
        """Execute once; returns {name: array} for ``fetch``. With ``timings`` (a list),
        the seconds each op took are appended to it in program order."""
        env = dict(scope)
        for name in self.feed_names:
            if feed is None or name not in feed:
                raise RuntimeFault(f"input {name!r} was not fed; feed it by name")
            env[name] = feed[name]
        fetch = set(fetch)
        fetched = {}
        base = KernelContext(self.xp, step, comm=self.comm, rank_of=self.rank_of)
        progress = self.progress
        progress.begin_step(step, self._table)
        for i, (item, free) in enumerate(self.items):
            progress.at(i)
            if isinstance(item, OpInstr):
                if timings is None:
                    self._run_op(i, item, env, scope, step, base, fetch, fetched)
                else:
                    start = time.perf_counter()
                    self._run_op(i, item, env, scope, step, base, fetch, fetched)
                    timings.append(time.perf_counter() - start)
            else:
                if i in self.donatable and _donatable(self.donatable[i], env, scope, fetch,
                                                      fetched):
                    item.execute(env, donate=True)
                else:
                    item.execute(env)
                for name, target in zip(item.writes, getattr(item, "stores", ())):
                    scope[target] = env[name]
            for name in fetch.intersection(writes_of(item)):
                fetched[name] = env[name]
            for name in free:
                env.pop(name, None)
        progress.end_step()
        for name in fetch - set(fetched):
            if name not in env:
                raise RuntimeFault(f"cannot fetch {name!r}: no such value was computed")
            fetched[name] = env[name]
        return fetched

    def _run_op(self, i, ins, env, scope, step, base, fetch, fetched):
        ctx = KernelContext(self.xp, step, comm=self.comm, rank_of=self.rank_of,
                            **ins.ctx) if ins.ctx else base
        for name in ins.donors:
            if _donatable((name,), env, scope, fetch, fetched):
                ctx = dataclasses.replace(ctx, out=env[name])
                break
        try:
            args = [env[n] for n in ins.ins]
        except KeyError as e:
            raise RuntimeFault(f"op '{ins.op_type}' needs {e.args[0]!r}, which is not "
                               "computed or fed") from None
        result = call_kernel(ins.kernel, ins.op_type, ins.layer, ctx, args, ins.attrs)
        for name, arr in zip(ins.outs, result):
            env[name] = arr
        for k, target in ins.writeback:
            scope[target] = result[k]


def call_kernel(kernel, op_type: str, layer: str, ctx, args, attrs) -> tuple:
    """``kernel(ctx, *args, **attrs)`` as a tuple of results; a failure becomes a
    RuntimeFault naming the op and its layer."""
    try:
        result = kernel(ctx, *args, **attrs)
    except Exception as e:
        where = f" in layer '{layer}'" if layer else ""
        raise RuntimeFault(f"op '{op_type}'{where} failed in step {ctx.step}: "
                           f"{type(e).__name__}: {e}") from e
    return result if isinstance(result, tuple) else (result,)


def _donatable(names, env, scope, fetch, fetched) -> bool:
    """Whether the arrays of ``names`` are this step's alone: not fetched, large enough
    for a saved buffer to matter, owning their memory, and neither the same object nor
    the memory owner of any other live, stored or fetched value."""
    for name in names:
        a = env[name]
        if name in fetch or getattr(a, "base", 0) is not None or a.nbytes < DONATE_MIN_BYTES:
            return False
        for values in (env, scope, fetched):
            for other_name, other in values.items():
                if other_name != name and (other is a or getattr(other, "base", None) is a):
                    return False
    return True


def _label(item) -> str:
    """How progress reports name an instruction: the op and its layer, or the reshard."""
    if isinstance(item, OpInstr):
        return f"op '{item.op_type}'" + (f" in layer '{item.layer}'" if item.layer else "")
    return str(getattr(item, "point", item))


def reads_of(item) -> tuple:
    return item.ins if isinstance(item, OpInstr) else tuple(item.reads)


def writes_of(item) -> tuple:
    return item.outs if isinstance(item, OpInstr) else tuple(item.writes)
