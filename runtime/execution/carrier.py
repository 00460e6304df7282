"""The carrier: one process runs its actions in the order the plan's schedule gives.

A :class:`Carrier` holds its process's compiled program
(:class:`~distgraph.plan.program.ProcessProgram`) and runs one training step: for each
action of the program in turn (a task of one chunk and one micro-batch) it waits until
the tiles the task receives have arrived, then runs the task's instructions on the
micro-batch's environment; after the last action it runs the update on the values
accumulated over the micro-batches. The runs of consecutive weight-gradient actions the
planner batched run as one task on their micro-batches' rows joined (:mod:`.batched`):
one GEMM instead of several, recorded as the actions in order, each with an equal share
of the time. Sends are posted without
waiting; receives are posted for the next :data:`RECEIVE_AHEAD` actions that receive,
so a stage computes while its next inputs travel. There are no decisions at run time:
the order is the plan's, the same on every process of a stage, so tensor-parallel peers
meet their collectives alike, and the plan checked that it completes.

Failure contract: an error in a task is a RuntimeFault naming the rank, the task, the
chunk and the micro-batch; a message that does not arrive within the communicator's
timeout is a RuntimeFault naming what the waiting action needs and from which rank.
Under the launcher each instruction is marked in the rank's progress record, so a hung
rank is named with its step and op.
"""

from __future__ import annotations

import os
import time
from collections import deque

from distgraph.errors import DistGraphError, RuntimeFault
from distgraph.plan.buckets import AFTER_ACTION
from distgraph.plan.instructions import GatherInstr, OpInstr, PointInstr, RecvInstr, SendInstr
from distgraph.plan.kinds import AccumulationMode, ItemKind, TaskKind
from distgraph.runtime.execution.batched import run_batched
from distgraph.runtime.execution.executor import donatable, may_donate, run_op
from distgraph.runtime.execution.memory import (AllocationProbe, Counted, Kept, Ledger, Mirrored,
                                                record)
from distgraph.runtime.execution.overlap import Ahead
from distgraph.runtime.execution.tasks import Accumulator, InstrRunner, micro_batch_context
from distgraph.runtime.launch.progress import NO_PROGRESS

RECEIVE_AHEAD = 2      # actions that receive whose messages are posted for in advance
PEER_CHECK_SECONDS = 1.0   # how often a long wait looks whether its peers have finished
STEPS_KEPT = 256           # the steps whose memory record a carrier keeps


def _count(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


class Carrier:
    """The actions of ``program`` (a :class:`~distgraph.plan.program.ProcessProgram`) of
    a plan whose processes run on ``ranks``, bound to ``comm`` (None for a plan of one
    process) and the array ``backend``. Every step counts the bytes the process holds
    (:mod:`.memory`): its record, the peak and where it was reached, is appended to
    :attr:`steps` (the last :data:`STEPS_KEPT`). With ``profile``, every task, send and
    receive is recorded in :attr:`events` and, after each task, the activations kept
    between tasks and the bytes held in :attr:`memory`."""

    def __init__(self, program, ranks, comm, backend, profile: bool = False, clock=None):
        self.program = program
        self.pid, self.comm, self.xb = program.process, comm, backend
        self.ranks = ranks
        self.rank = comm.rank if comm is not None else 0
        self.runner = InstrRunner(self.pid, comm, backend, ranks)
        self.tags = program.tags
        self.m = program.env_slots
        self.actions = program.actions
        self.blocks = [program.blocks[(a.chunk, a.task)] for a in self.actions]
        self.receiving = [i for i, b in enumerate(self.blocks)
                          if any(isinstance(x, RecvInstr) for x in b.instrs)]
        self.groups = {run[0]: run for run in program.batched}
        self.first_chunk = program.first_chunk
        self.profile = profile
        self.clock = clock or time.perf_counter
        self.events: list = []
        self.memory: list = []
        self.steps = deque(maxlen=STEPS_KEPT)    # StepMemory of the last steps run
        self.probe = AllocationProbe(backend)
        self.timeout = comm.timeout if comm is not None else 60.0
        self.spin = comm.poll_spin_seconds if comm is not None else 0.0
        self.progress = getattr(comm, "progress", NO_PROGRESS)
        self._offsets, labels = {}, []
        for key, block in program.all_blocks():
            self._offsets[key] = len(labels)
            labels.extend(str(x) for x in block.instrs)
        self._table = self.progress.table(labels) if self.progress.active else -1
        self._step_dies = _step_dies(program)
        ahead = Ahead(program, comm, ranks) if comm is not None else None
        self.ahead = ahead if ahead is not None and ahead.active else None

    # -- one step ------------------------------------------------------------------------------
    def run(self, scope: dict, feeds: list, step: int) -> dict:
        """One training step on ``feeds`` (one dict of local inputs per micro-batch);
        returns the fetched values (global, on every process)."""
        # every array the step holds is held in a dict the step's ledger counts
        led = self.ledger = Ledger(self.xb)
        led.add_foreign(a for f in feeds for a in f.values())
        self.step, self.scope = step, Mirrored(led, scope)
        self.env = [Counted(led, f) for f in feeds] + [Counted(led)
                                                        for _ in range(self.m - len(feeds))]
        # what a kernel keeps for a later kernel of its micro-batch and layer
        # (KernelContext.saved), per micro-batch: {layer: {key: kept}}
        self.saved = [{} for _ in range(self.m)]
        self.feed_names = set().union(*(f.keys() for f in feeds)) if feeds else set()
        self.acc = Accumulator(self.program, self.xb, led)
        self.done = [set() for _ in range(self.m)]
        self.left = [sum(1 for a in self.actions if a.micro_batch == m) for m in range(self.m)]
        self.sends: list = []               # (request, (rank, micro-batch) or None, start, tile)
        self.pending: dict = {}             # action index -> ({instr index: [requests]},
        #                                      posted at, bytes reserved)
        self.posted = 0                     # receiving actions posted for so far
        self.fetched = Counted(led)
        start = led.bytes
        led.since()
        self.probe.begin()
        self.progress.begin_step(step, self._table)
        if self.ahead is not None:
            self.ahead.clear()
        self._made_once()
        i = 0
        while i < len(self.actions):
            group = self.groups.get(i)
            if group is not None:
                self._post_ahead(group[-1])
                self._run_group(group)
                i = group[-1] + 1
                if self.ahead is not None:
                    self.ahead.after(group[-1], AFTER_ACTION, self.acc.values)
                continue
            self._post_ahead(i)
            if i in self.pending:
                self._wait_receives(i)
            self._run_action(i, self.actions[i])
            if self.ahead is not None:
                self.ahead.after(i, AFTER_ACTION, self.acc.values)
            self._poll_sends()          # a delivered send's tile is released now
            i += 1
        self._run_update()
        self._wait_sends()
        if self.ahead is not None:
            self.ahead.clear()
        self.progress.end_step()
        fetched = dict(self.fetched)
        self.fetched.clear()            # handed to the caller: no longer the step's
        self.steps.append(record(led, step, start, self.probe.above()))
        return fetched

    def _made_once(self) -> None:
        """The step's once-made Values (``ProcessProgram.step_ops``: under amp the 16-bit
        copies of the parameters, after their operands' reshards), made from the scope
        before the first micro-batch and given to every micro-batch that runs: one array
        each, dropped by the last micro-batch that reads it, and never a donor (no
        micro-batch owns it alone). A reshard's result lives to its op's end."""
        instrs = self.program.step_ops
        if not instrs:
            return
        made = Counted(self.ledger)
        try:
            for j, instr in enumerate(instrs):
                self.ledger.at = ("step start", instr)
                if isinstance(instr, PointInstr):
                    self.runner.point(instr, made, self.scope,
                                      self.tags.tag(instr.point.seq, 0))
                    continue
                run_op(instr, made, self.scope, self.runner.context(self.step, instr.ctx), ())
                self.ledger.settle()
                for name in self._step_dies[j]:     # a gathered operand, used for the last time
                    made.pop(name, None)
        except DistGraphError as e:
            raise RuntimeFault(f"rank {self.rank} (process {self.pid}): the values made once "
                               f"in step {self.step} failed: {e}") from e
        for env, left in zip(self.env, self.left):
            if left:
                env.update(made)
        self.feed_names |= made.keys()
        made.clear()

    # -- messages ---------------------------------------------------------------------------
    def _post_ahead(self, i: int) -> None:
        while self.posted < len(self.receiving) and (
                self.receiving[self.posted] <= i or
                len([j for j in self.pending if j >= i]) < RECEIVE_AHEAD):
            j = self.receiving[self.posted]
            m = self.actions[j].micro_batch
            now = self.clock()
            reqs, reserved = {}, 0
            for k, instr in enumerate(self.blocks[j].instrs):
                if isinstance(instr, RecvInstr):
                    tag = self.tags.tag(instr.point.seq, m)
                    reqs[k] = [self.comm.irecv(shape, instr.point.dtype, self.ranks(src), tag)
                               for src, shape in instr.incoming]
                    item = self.xb.dtype(instr.point.dtype).itemsize
                    reserved += sum(item * _count(shape) for _, shape in instr.incoming)
            # a posted receive's buffer is counted from now (MPI allocates it now)
            self.ledger.reserve(reserved)
            self.pending[j] = (reqs, now, reserved)
            self.posted += 1

    def _arrived(self, i: int) -> bool:
        reqs = self.pending[i][0]
        return all(r.test() for rs in reqs.values() for r in rs)

    def _poll_sends(self) -> bool:
        if not self.sends:
            return False
        still, progressed = [], False
        for item in self.sends:
            req, what, start, tile = item
            if req.test():
                progressed = True
                self.ledger.drop(tile)
                if self.profile and what is not None:
                    self._event(ItemKind.SEND, self.first_chunk, what[1], start, self.clock(),
                                peer=what[0])
            else:
                still.append(item)
        self.sends = still
        return progressed

    def _wait(self, ready, what, describe, peers=()) -> None:
        """Poll until ``ready()``, moving sends along; past the timeout a RuntimeFault
        that ``describe()`` explains, and sooner one when ``peers`` (ranks) have finished."""
        if ready():
            return
        self.progress.wait_begin(what)
        last = check = self.clock()
        idle_since, seen = None, set()
        while not ready():
            now = self.clock()
            if self._poll_sends():
                last, idle_since = now, None
                continue
            if now - last > self.timeout:
                raise RuntimeFault(describe(), timed_out=True)
            if peers and now - check > PEER_CHECK_SECONDS:
                check = now
                seen = self.comm.finished_peers(peers, seen, what)
            idle_since = idle_since or now
            if now - idle_since < self.spin:
                os.sched_yield()
            else:
                time.sleep(min(1e-3, max(1e-5, (now - idle_since) / 8)))
        self.progress.wait_end()

    def _wait_receives(self, i: int) -> None:
        a = self.actions[i]
        reqs = self.pending[i][0]
        instrs = self.blocks[i].instrs
        peers = sorted({self.ranks(src) for k in reqs for src, _ in instrs[k].incoming})
        what = (f"messages from rank{'s' if len(peers) > 1 else ''} "
                f"{', '.join(map(str, peers))} for {a.task} micro-batch {a.micro_batch} "
                f"(action {a})")
        self._wait(lambda: self._arrived(i), what, lambda: self._stalled(i), peers)
        if self.profile:
            start = self.pending[i][1]
            self._event(ItemKind.RECV, a.chunk, a.micro_batch, start, self.clock())

    def _wait_sends(self) -> None:
        peers = sorted({what[0] for _, what, _, _ in self.sends if what is not None})
        self._wait(lambda: not self._poll_sends() and not self.sends,
                   "other ranks to receive this rank's sends",
                   lambda: f"rank {self.rank} (process {self.pid}): timed out after "
                           f"{self.timeout:g} s in step {self.step} waiting for peers to "
                           f"receive its messages", peers)

    # -- running a task ---------------------------------------------------------------------------
    def _run_action(self, i: int, action) -> None:
        start = self.clock()
        m = action.micro_batch
        block = self.blocks[i]
        self.ledger.at = (action, None)
        try:
            tiles = {}
            if i in self.pending:
                tiles, _, reserved = self.pending.pop(i)
                # the reserved bytes become the arrived tiles (counted until assembled)
                self.ledger.release(reserved)
                self.ledger.hold([r.value for rs in tiles.values() for r in rs])
            self._run_block(block, m, tiles, i)
        except DistGraphError as e:
            mb = f", micro-batch {m}" if self.m > 1 else ""
            raise RuntimeFault(f"rank {self.rank} (process {self.pid}): task "
                               f"{action.task} of chunk {action.chunk}{mb} in step "
                               f"{self.step} failed: {e}") from e
        self.done[m].add(block.task.key)
        self.left[m] -= 1
        if not self.left[m]:
            self._release(m)
        if self.profile:
            self._event(action.task, action.chunk, m, start, self.clock())
            self._record_memory(action.task, action.chunk, m)

    def _run_group(self, indices: list) -> None:
        """Run the weight-gradient actions at ``indices`` as one task (:mod:`.batched`)."""
        actions = [self.actions[i] for i in indices]
        ms = [a.micro_batch for a in actions]
        block = self.blocks[indices[0]]
        start = self.clock()
        self.progress.at(self._offsets[block.task.key])
        self.ledger.at = (actions[0], None)
        dies = {n for names in block.last for n in names}

        def release(name) -> None:
            # a micro-batch's operand the joined copy replaced, where this task is its
            # last reader: dropped now, not when the group ends
            if name in dies:
                for m in ms:
                    if all(o in self.done[m] for o in block.others[name]):
                        self.env[m].pop(name, None)

        try:
            tag = self.tags.tag
            run_batched(
                self.program.batched_tasks[block.task.key], self.env, ms, self.scope,
                self.runner.context(self.step, {}), self.xb,
                lambda instr, env: self.runner.point(instr, env, self.scope,
                                                     tag(instr.point.seq, ms[0])),
                self.ledger, emit=lambda name, value: self.acc.add(name, value, owned=True),
                release=release)
        except DistGraphError as e:
            raise RuntimeFault(f"rank {self.rank} (process {self.pid}): task "
                               f"{actions[0].task} of chunk {actions[0].chunk}, micro-batches "
                               f"{', '.join(map(str, ms))} (run as one) in step {self.step} "
                               f"failed: {e}") from e
        end = self.clock()
        share = (end - start) / len(actions)
        for k, (action, m) in enumerate(zip(actions, ms)):
            for names in block.last:
                for n in names:
                    if all(o in self.done[m] for o in block.others[n]):
                        self.env[m].pop(n, None)
            self.done[m].add(block.task.key)
            self.left[m] -= 1
            if not self.left[m]:
                self._release(m)
            if self.profile:
                self._event(action.task, action.chunk, m, start + k * share,
                            start + (k + 1) * share)
                self._record_memory(action.task, action.chunk, m)

    def _await(self, request) -> None:
        """Wait for a collective started ahead (:mod:`.overlap`), moving sends along."""
        peers = tuple(getattr(request, "group", ()))
        self._wait(request.test, request.what,
                   lambda: f"rank {self.rank} (process {self.pid}): timed out after "
                           f"{self.timeout:g} s in step {self.step} waiting for "
                           f"{request.what}, started ahead; every rank of its group must "
                           f"run the same plan", [p for p in peers if p != self.rank])

    def _run_block(self, block, m: int, tiles: dict, i: int = -1) -> None:
        env, scope, runner = self.env[m], self.scope, self.runner
        ahead, key = self.ahead, block.task.key
        if ahead is not None:
            ahead.begin_task()
        accumulates = block.task.accumulates
        offset = self._offsets[block.task.key]
        done, progress, step = self.done[m], self.progress, self.step
        saved, bases, led = self.saved[m], {}, self.ledger
        action = led.at[0]
        for j, instr in enumerate(block.instrs):
            progress.at(offset + j)
            led.at = (action, instr)
            dying = [n for n in block.last[j] if all(o in done for o in block.others[n])]
            if isinstance(instr, OpInstr):
                # one kept-values dict per layer (KernelContext.saved), none where what
                # the kernel keeps could never serve its gradient (OpInstr.keeps: the
                # original of a recomputed op, evaluation)
                kept = None
                if instr.keeps:
                    kept = saved.get(instr.layer)
                    if kept is None:
                        kept = saved[instr.layer] = Kept(led)
                if instr.ctx:
                    c = instr.ctx
                    if instr.axis is not None and "out_global_shape" in c:
                        c = micro_batch_context(c, instr.axis,
                                                self.program.batch_micro_batches,
                                                self.program.positions[m])
                    ctx = runner.context(step, c, kept)
                elif kept is None:
                    ctx = runner.context(step, {}, None)
                else:
                    ctx = bases.get(instr.layer)
                    if ctx is None:
                        ctx = bases[instr.layer] = runner.context(step, {}, kept)
                donate = tuple(n for n in instr.donors if n in dying and
                               donatable((n,), env, ledger=led))[:1]
                run_op(instr, env, scope, ctx, donate)
                led.settle()
            elif isinstance(instr, PointInstr):
                if ahead is not None and ahead.prefetches(key, j):
                    env[instr.writes[0]] = ahead.gathered(
                        key, j, block.instrs, lambda n: env[n] if n in env else scope[n],
                        led, self._await)
                else:
                    read = instr.reads[0] if instr.reads else None
                    donate = may_donate(read, dying, env, self.feed_names, ledger=led)
                    runner.point(instr, env, scope, self.tags.tag(instr.point.seq, m), donate)
            elif isinstance(instr, SendInstr):
                tag = self.tags.tag(instr.point.seq, m)
                for rank, tile in runner.send_tiles(instr, env, scope, tag):
                    led.hold(tile)          # until the send is done
                    self.sends.append((self.comm.isend(tile, rank, tag), (rank, m),
                                       self.clock(), tile))
            else:
                arrived = [r.value for r in tiles.pop(j)]
                runner.receive(instr, env, arrived, self.tags.tag(instr.point.seq, m))
                led.drop(arrived)
            for name in instr.writes:
                if name in accumulates:
                    self.acc.add(name, env[name], owned=name in dying)
            for name in dying:
                env.pop(name, None)
            if ahead is not None:
                ahead.after(i, j, self.acc.values, (env, scope))
                ahead.poll()

    def _run_update(self) -> None:
        block = self.program.update
        env, scope, runner = self.acc.take(), self.scope, self.runner
        offset = self._offsets["update"]
        start = self.clock()
        self.ledger.at = ("update", None)
        try:
            base = runner.context(self.step, {})
            for j, instr in enumerate(block.instrs):
                self.progress.at(offset + j)
                self.ledger.at = ("update", instr)
                dying = block.last[j]
                if isinstance(instr, OpInstr):
                    ctx = runner.context(self.step, instr.ctx) if instr.ctx else base
                    donate = tuple(n for n in instr.donors if n in dying and
                                   donatable((n,), env, ledger=self.ledger))[:1]
                    run_op(instr, env, scope, ctx, donate)
                elif isinstance(instr, GatherInstr):
                    self.fetched[instr.point.value] = self._gather(instr, env)
                elif self.ahead is not None and instr.point.seq in self.ahead.pending:
                    env[instr.writes[0]] = self.ahead.take(instr.point.seq, self._await)
                else:
                    read = instr.reads[0] if instr.reads else None
                    donate = may_donate(read, dying, env, (), ledger=self.ledger)
                    runner.point(instr, env, scope, self.tags.tag(instr.point.seq, 0), donate)
                for name in dying:
                    env.pop(name, None)
        except DistGraphError as e:
            raise RuntimeFault(f"rank {self.rank} (process {self.pid}): task update in step "
                               f"{self.step} failed: {e}") from e
        env.clear()
        if self.profile:
            self._event(TaskKind.UPDATE, self.first_chunk, None, start, self.clock())
            self._record_memory(TaskKind.UPDATE, self.first_chunk, None)

    def _release(self, m: int) -> None:
        """Micro-batch ``m``'s work is done: what it holds is dropped."""
        self.env[m].clear()
        for kept in self.saved[m].values():
            kept.clear()
        self.saved[m].clear()

    def _gather(self, instr: GatherInstr, env):
        """The global value of a fetched name; per-sample outputs (kept per micro-batch)
        are gathered micro-batch by micro-batch and joined along their sample dim."""
        tag = self.tags.gather_tag(instr.index)
        rows = self.program.row_gathers.get(instr.point.value)
        if rows is not None:
            return self._gather_rows(instr, env, rows, tag)
        if self.program.mode(instr.point.value) is not AccumulationMode.CONCAT:
            return self.runner.point(instr, env, self.scope, tag)
        parts = env.get(instr.reads[0]) if instr.reads else [None] * self.m
        out = []
        for part in parts:
            if instr.reads:
                env[instr.reads[0]] = part
            out.append(self.runner.point(instr, env, self.scope, tag))
        axis = self.program.split_axis(instr.point.value)
        return self.xb.concatenate(out, axis=axis)

    def _gather_rows(self, instr: GatherInstr, env, rows, tag):
        """A per-sample value under an uneven split (a ``RowGather``): this process's
        part (its micro-batches' parts joined) padded to the largest, gathered, and the
        batch's rows taken in order."""
        if instr.reads:
            part = env[instr.reads[0]]
            if isinstance(part, list):
                part = self.xb.concatenate(part, axis=rows.axis)
            short = list(part.shape)
            short[rows.axis] = rows.pad - part.shape[rows.axis]
            env[instr.reads[0]] = self.xb.concatenate(
                [part, self.xb.zeros(tuple(short), part.dtype)], axis=rows.axis)
        whole = self.runner.point(instr, env, self.scope, tag)
        return self.xb.xp.take(whole, self.xb.xp.asarray(rows.take), axis=rows.axis)

    # -- records -----------------------------------------------------------------------------------
    def _event(self, kind, chunk, m, start, end, peer=None) -> None:
        self.events.append((self.rank, chunk, kind, m, self.step, start, end, peer))

    def _record_memory(self, kind, chunk, m) -> None:
        """A memory sample after a task of ``kind`` on ``chunk`` and micro-batch ``m``:
        the activations kept between tasks (bytes, micro-batches), the bytes the rank
        holds and the most it held since the last sample."""
        live_bytes, live = 0, 0
        for env in self.env:
            held = [a for n, a in env.items() if n not in self.feed_names]
            if held:
                live += 1
                live_bytes += sum(int(getattr(a, "nbytes", 0)) for a in held)
        led = self.ledger
        self.memory.append((self.rank, chunk, self.step, self.clock(), live_bytes, live,
                            led.bytes, led.since(), kind, m))

    # -- diagnostics -------------------------------------------------------------------------------
    def _stalled(self, i: int) -> str:
        a = self.actions[i]
        reqs = self.pending[i][0]
        needs = []
        for k, rs in reqs.items():
            instr = self.blocks[i].instrs[k]
            missing = sorted({src for (src, _), r in zip(instr.incoming, rs) if not r.done})
            if missing:
                who = ", ".join(str(self.ranks(s)) for s in missing)
                needs.append(f"{instr.point.value} from rank{'s' if len(missing) > 1 else ''} "
                             f"{who} (tag {self.tags.tag(instr.point.seq, a.micro_batch)})")
        return (f"rank {self.rank} (process {self.pid}, chunk {a.chunk}): timed out after "
                f"{self.timeout:g} s in step {self.step} with no message arriving; a peer "
                f"did not send what this rank's tasks wait for:\n  {a.task} micro-batch "
                f"{a.micro_batch} waits for " + "; ".join(needs) + f" (action {a})")


def _step_dies(program) -> list:
    """For each of ``program.step_ops``, the reshard results it reads for the last time
    that no task of the micro-batches reads: a weight gathered for its 16-bit copy lives
    only to the cast."""
    read_later = {n for block in program.blocks.values() for instr in block.instrs
                  for n in getattr(instr, "reads", ()) + getattr(instr, "ins", ())}
    made = {n for instr in program.step_ops if isinstance(instr, PointInstr)
            for n in instr.writes}
    last: dict = {}
    for j, instr in enumerate(program.step_ops):
        for n in getattr(instr, "ins", ()):
            if n in made and n not in read_later:
                last[n] = j
    out: list = [[] for _ in program.step_ops]
    for n, j in last.items():
        out[j].append(n)
    return out
