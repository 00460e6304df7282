"""Run compiled ops: the instruction every task of the runtime is made of, and a serial
interpreter of one Program.

An :class:`~distgraph.plan.instructions.OpInstr` is one op compiled: its kernel and the
names it reads and writes. :func:`run_op` runs it on an environment of named arrays;
persistables (parameters, optimizer states) live in a ``scope`` that outlives a run, and
update ops store their results back under the persistable's name (``Value.alias_of``). Ops
registered with ``donate`` get, as ``ctx.out``, a dying input of their result's shape and
dtype whose array nothing else holds (:func:`donatable`): a bias add writes into the matmul result
it consumes instead of a new buffer.

:class:`ProgramRunner` runs a whole Program in order on one process, dropping each
intermediate after its last use (tests, tools and calibration use it on bare
programs); plans run on the task runtime (:mod:`distgraph.runtime.execution.runner`),
whose tasks are lists of these instructions.

Example::

    runner = ProgramRunner(prog)
    out = runner.run(scope, feed={"x": x}, fetch=["mean_0"], step=0)
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from distgraph import dtypes
from distgraph.errors import RuntimeFault
from distgraph.ir import Program
from distgraph.ops import fused_gpu
from distgraph.plan.instructions import OpInstr, last_uses, op_instr, with_donors
from distgraph.registry import KernelContext, get_op

DONATE_MIN_BYTES = 1 << 16   # below this a fresh buffer costs about nothing
HALF = (np.dtype("float16"), dtypes.numpy_dtype("bfloat16"))
FLOAT32 = np.dtype("float32")


def gpu_16bit(instr: OpInstr, args, attrs) -> bool:
    """Whether a GPU runs ``instr``'s kernel on its 16-bit operands as they are: a GEMM
    on the matrix units, accumulating in float32 and rounding its result once, as the
    host's float32 computation rounds it (which on a GPU runs at the float32 rate,
    several times slower). A matmul of one dtype (its result in that dtype or in
    float32: its ``out_dtype``): one 2-D GEMM (a Linear layer's, its
    rows flattened and the weight 2-D, or two matrices') or a stack of them of one batch
    shape (attention's: one cuBLAS call, :func:`distgraph.ops.fused_gpu.batched_matmul`);
    not a stack against a broadcast matrix nor MeshSlice's sliced form, which accumulates
    partial products. And the row softmax and its gradient on bfloat16 rows of its
    dtype (:func:`distgraph.ops.fused_gpu.rows_bf16`: widened as read, rounded as
    written, the bits of the float32 kernel on widened copies)."""
    if instr.op_type in ("softmax", "softmax_grad"):
        return attrs.get("axis", -1) in (-1, args[0].ndim - 1) and \
            args[0].dtype == instr.out_dtypes[0] and fused_gpu.rows_bf16(*args)
    if instr.op_type != "matmul" or attrs.get("meshslice") or \
            args[0].dtype != args[1].dtype or instr.out_dtypes[0] not in (args[0].dtype,
                                                                           FLOAT32):
        return False
    return bool(attrs.get("rows")) or fused_gpu.stacked_16bit(args[0], args[1]) or (
        args[1].ndim == 2 and (args[0].ndim == 2 or not attrs.get("transpose_x")))


def run_op(instr: OpInstr, env: dict, scope: dict, ctx: KernelContext, donate=()) -> None:
    """Run ``instr`` on ``env`` (names not there are read from ``scope``), store its
    results in ``env`` and its write-backs in ``scope``. ``donate``: the donors whose
    buffer the result may take (already checked with :func:`donatable`)."""
    if donate:
        ctx = dataclasses.replace(ctx, out=env[donate[0]])
    try:
        args = [env[n] if n in env else scope[n] for n in instr.ins]
    except KeyError as e:
        raise RuntimeFault(f"op '{instr.op_type}' needs {e.args[0]!r}, which is not "
                           f"computed, received or fed") from None
    result = call_kernel(instr, ctx, args)
    for name, arr in zip(instr.outs, result):
        env[name] = arr
    for k, target in instr.writeback:
        scope[target] = result[k]


def call_kernel(instr: OpInstr, ctx, args, attrs=None) -> tuple:
    """``instr``'s kernel on ``args`` (``attrs``: its attributes, default the
    instruction's) as a tuple of results; a failure becomes a RuntimeFault naming the op
    and its layer. Operands in a 16-bit float dtype are computed in float32 (numpy has no
    16-bit kernels) and results are rounded to their declared dtypes; a 16-bit overflow
    is no warning (float16 training's loss scaling expects and handles them). An op
    registered with ``takes_16bit`` (its kernel only moves values, or casts itself) gets
    its 16-bit operands as they are, and so does a GEMM on a GPU (:func:`gpu_16bit`).
    On a GPU, an add, subtract, multiply or scale of one 16-bit dtype is that
    computation in one kernel (:func:`distgraph.ops.fused_gpu.widened`: the same bits).
    The float32 copies are dropped before the results
    are rounded: :func:`distgraph.registry.op_workspace` counts the bytes this way."""
    attrs = instr.attrs if attrs is None else attrs
    if not any(getattr(a, "dtype", None) in HALF for a in args) and \
            not any(d in HALF for d in instr.out_dtypes):
        return _call(instr, ctx, args, attrs)
    if ctx.xp is not np and instr.op_type in fused_gpu.WIDENED and \
            instr.out_dtypes[0] in HALF and all(a.dtype == instr.out_dtypes[0] for a in args):
        out = ctx.out if ctx.out is not None and ctx.out.dtype == instr.out_dtypes[0] else None
        return _call(instr, ctx, args, attrs,
                     lambda _ctx, *a, **kw: fused_gpu.widened(instr.op_type, a, kw, out))
    if get_op(instr.op_type).takes_16bit or (ctx.xp is not np and
                                             gpu_16bit(instr, args, attrs)):
        with np.errstate(over="ignore", invalid="ignore"):
            result = _call(instr, ctx, args, attrs)
        # a float32 product of 16-bit operands (matmul's out_dtype): the GPU's 16-bit
        # GEMM, widened (cuBLAS could write float32 at once)
        return tuple(r if getattr(r, "dtype", d) == d else r.astype(d)
                     for r, d in zip(result, instr.out_dtypes))
    wide = [a.astype(FLOAT32) if getattr(a, "dtype", None) in HALF else a for a in args]
    if ctx.out is not None:
        ctx = dataclasses.replace(ctx, out=None)
    with np.errstate(over="ignore", invalid="ignore"):
        result = _call(instr, ctx, wide, attrs)
        del wide
        return tuple(r.astype(d) if getattr(r, "dtype", d) != d else r
                     for r, d in zip(result, instr.out_dtypes))


def _call(instr, ctx, args, attrs, kernel=None) -> tuple:
    """``kernel`` (default the instruction's) on ``args``; a failure a RuntimeFault naming
    the op, its layer and the step."""
    try:
        result = (kernel or instr.kernel)(ctx, *args, **attrs)
    except Exception as e:
        where = f" in layer '{instr.layer}'" if instr.layer else ""
        raise RuntimeFault(f"op '{instr.op_type}'{where} failed in step {ctx.step}: "
                           f"{type(e).__name__}: {e}") from e
    return result if isinstance(result, tuple) else (result,)


def donatable(names, env, *holders, ledger=None) -> bool:
    """Whether the arrays of ``names`` in ``env`` are this step's alone: large enough for
    a saved buffer to matter, owning their memory, and neither the same object nor the
    memory owner of any other value in ``env`` or in ``holders`` (dicts of arrays: the
    scope, fetched or accumulated values). With ``ledger`` (the training executor's
    :class:`~distgraph.runtime.execution.memory.Ledger`, which counts every container
    the step keeps, views by their owner) the array's holds are read from its count,
    in place of a scan of every value held (on an H200 the scans took a fifth of the
    host's time of GPT-2 small's step at sequence 256, whose ops' launches are
    microseconds)."""
    for name in names:
        a = env[name]
        if getattr(a, "base", 0) is not None or a.nbytes < DONATE_MIN_BYTES:
            return False
        if ledger is not None:
            if ledger.holds(a) != 1:
                return False
            continue
        for values in (env,) + holders:
            for other_name, other in values.items():
                if other is a and (values is not env or other_name != name):
                    return False
                if getattr(other, "base", None) is a:
                    return False
    return True


def may_donate(name, dying, env, feeds, *holders, ledger=None) -> bool:
    """Whether an instruction that reads ``name`` may take its buffer: the value dies
    there (in ``dying``), was not fed, and its array is this step's alone
    (:func:`donatable` against ``env`` and ``holders``, or ``ledger``)."""
    return (name is not None and name in dying and name not in feeds and name in env
            and donatable((name,), env, *holders, ledger=ledger))


class ProgramRunner:
    """A Program's ops, compiled, run in order on one process (no communication).

    ``op_context`` optionally maps an op index to extra KernelContext fields (the global
    shape and local slices of a sharded random op). Each intermediate is dropped after
    its last use; fed, fetched and persistable values are kept.
    """

    def __init__(self, program: Program, xp=np, fetch_always=(), op_context=None):
        self.program, self.xp = program, xp
        self.feed_names = [v.name for v in program.inputs]
        keep = {v.name for v in program.values.values() if v.persistable}
        keep |= set(fetch_always) | set(self.feed_names)
        op_context = op_context or {}
        instrs = [op_instr(op, op_context.get(i)) for i, op in enumerate(program.ops)]
        frees = last_uses(instrs, keep)
        self.items = [(with_donors(instr, free, program.values, self.feed_names), free)
                      for instr, free in zip(instrs, frees)]

    def run(self, scope: dict, feed: dict | None = None, fetch=(), step: int = 0,
            timings: list | None = None, device_sync=None) -> dict:
        """Execute once; returns {name: array} for ``fetch``. With ``timings`` (a list),
        the seconds each op took are appended to it in program order, the executor's own
        work for the op (its context, donations, fetches and frees) included, so that
        they add up to the step; ``device_sync`` (a GPU backend's ``synchronize``) then
        ends each op's kernels, which the GPU runs after the call returns."""
        env = {}
        for name in self.feed_names:
            if feed is None or name not in feed:
                raise RuntimeFault(f"input {name!r} was not fed; feed it by name")
            env[name] = feed[name]
        fetch = set(fetch)
        fetched = {}
        ctx = KernelContext(self.xp, step)
        if timings is not None and device_sync is not None:
            device_sync()
        for instr, free in self.items:
            start = time.perf_counter() if timings is not None else 0.0
            octx = KernelContext(self.xp, step, **instr.ctx) if instr.ctx else ctx
            donate = tuple(n for n in instr.donors
                           if n not in fetch and donatable((n,), env, scope, fetched))[:1]
            run_op(instr, env, scope, octx, donate)
            if timings is not None and device_sync is not None:
                device_sync()
            for name in fetch.intersection(instr.outs):
                fetched[name] = env[name]
            for name in free:
                env.pop(name, None)
            if timings is not None:
                timings.append(time.perf_counter() - start)
        for name in fetch - set(fetched):
            if name in env:
                fetched[name] = env[name]
            elif name in scope:
                fetched[name] = scope[name]
            else:
                raise RuntimeFault(f"cannot fetch {name!r}: no such value was computed")
        return fetched
