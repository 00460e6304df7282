"""Run a Program's kernels in order, freeing each intermediate after its last use.

Persistable Values (parameters, optimizer states) live in a ``scope`` dict that outlives
a run; update ops write into them in place and their results are stored back under the
persistable's name (``Value.alias_of``).

Example::

    runner = ProgramRunner(prog)
    out = runner.run(scope, feed={"x": x}, fetch=["mean_0"], step=0)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from distgraph.errors import RuntimeFault
from distgraph.ir import Program
from distgraph.ops.registry import KernelContext, get_op


@dataclass(frozen=True)
class _Instr:
    kernel: object
    op_type: str
    layer: str
    ins: tuple
    outs: tuple
    attrs: dict
    writeback: tuple      # (output position, persistable name)
    free: tuple           # names whose last use is this op
    ctx_extra: dict


class ProgramRunner:
    """Compiled instruction list of one Program (serial, or one process's local part).

    ``op_context`` optionally maps an op index to extra KernelContext fields (the global
    shape and local slices of a sharded random op).
    """

    def __init__(self, program: Program, xp=np, fetch_always=(), op_context=None):
        self.program = program
        self.xp = xp
        self.feed_names = [v.name for v in program.inputs]
        keep = {v.name for v in program.values.values() if v.persistable}
        keep |= set(fetch_always)
        last_use: dict[str, int] = {}
        for i, op in enumerate(program.ops):
            for v in op.inputs:
                last_use[v.name] = i
        op_context = op_context or {}
        instrs = []
        for i, op in enumerate(program.ops):
            for o in op.outputs:
                last_use.setdefault(o.name, i)
        for i, op in enumerate(program.ops):
            free = tuple(sorted({v.name for v in op.inputs + op.outputs
                                 if last_use.get(v.name) == i and v.name not in keep}))
            writeback = tuple((k, o.alias_of) for k, o in enumerate(op.outputs) if o.alias_of)
            instrs.append(_Instr(get_op(op.type).kernel, op.type, op.layer,
                                 tuple(v.name for v in op.inputs), tuple(o.name for o in op.outputs),
                                 dict(op.attrs), writeback, free, dict(op_context.get(i, {}))))
        self.instrs = instrs

    def run(self, scope: dict, feed: dict | None = None, fetch=(), step: int = 0,
            hook=None) -> dict:
        """Execute once; returns {name: array} for ``fetch``. ``hook(i, instr, env)`` runs
        before each op (the distributed runner uses it for communication steps)."""
        env = dict(scope)
        for name in self.feed_names:
            if feed is None or name not in feed:
                raise RuntimeFault(f"input {name!r} was not fed; feed it by name")
            env[name] = feed[name]
        fetch = list(fetch)
        fetched = {}
        base = KernelContext(self.xp, step)
        for i, ins in enumerate(self.instrs):
            if hook is not None:
                hook(i, ins, env)
            ctx = KernelContext(self.xp, step, **ins.ctx_extra) if ins.ctx_extra else base
            try:
                result = ins.kernel(ctx, *[env[n] for n in ins.ins], **ins.attrs)
            except KeyError as e:
                raise RuntimeFault(f"op #{i} '{ins.op_type}' needs {e.args[0]!r}, which is not "
                                   "computed or fed") from None
            except Exception as e:
                where = f" in layer '{ins.layer}'" if ins.layer else ""
                raise RuntimeFault(f"op #{i} '{ins.op_type}'{where} failed: "
                                   f"{type(e).__name__}: {e}") from e
            if not isinstance(result, tuple):
                result = (result,)
            for name, arr in zip(ins.outs, result):
                env[name] = arr
            for k, target in ins.writeback:
                scope[target] = result[k]
            for name in fetch:
                if name in ins.outs:
                    fetched[name] = env[name]
            for name in ins.free:
                env.pop(name, None)
        for name in fetch:
            if name not in fetched:
                if name not in env:
                    raise RuntimeFault(f"cannot fetch {name!r}: no such value was computed")
                fetched[name] = env[name]
        return fetched
