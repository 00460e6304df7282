"""Communication started ahead of the instruction that needs it (``Strategy(overlap=True)``).

The planner says where (:mod:`distgraph.plan.buckets`, ``ProcessProgram.starts`` and
``prefetch``); :class:`Ahead` starts the collectives there as nonblocking ones and hands
their results to the instruction that reads them:

- **Gradient buckets.** After the instruction that makes the last gradient of a bucket
  (in the step's last micro-batch) each of its reductions starts on the accumulated
  gradient (an all-reduce in place where the accumulator alone holds the array, a
  reduce-scatter into a new one); the update's reshard point of that gradient then waits
  for its request instead of running the collective.
- **Prefetched gathers** (ZeRO-3). When a task reaches a group of parameter gathers, the
  group's gathers and the next group's start; the instruction of each gather waits for
  its own request. The bytes of a gather in flight are counted from its start (at most
  one layer ahead), as a posted receive's are.

MPI moves a nonblocking collective only inside MPI calls: :meth:`Ahead.poll`, called by
the carrier between instructions, tests the oldest pending request ``PASSES`` times (one
test runs MPI's progress engine once for all of them). One pass handles what has arrived
by then, about one step of a collective's schedule, so with one pass per instruction a
backward of few, long instructions leaves the collectives behind: on the emulated 2 x 2
cluster (``bench/overlap.py``, GPT-tiny, 80 instructions in its backward) every bucket of
a dp step finished together at the backward's end, and the step with overlap was
148-152 ms against 128-139 ms with 2 to 4 passes (2026-11-28, ``dp`` rows, two runs
each; 8 and 16 passes no better). A pass with nothing arrived costs a few microseconds.
Every process of a group starts the same collectives in the same order (they run the
same program), as MPI requires.

Example::

    ahead = Ahead(program, comm, ranks, ledger)
    ahead.after(i, j, acc.values, env, scope)      # after instruction j of action i
    value = ahead.take(seq, wait)                  # in the update
"""

from __future__ import annotations

from distgraph.errors import RuntimeFault
from distgraph.plan.buckets import StartAt
from distgraph.plan.instructions import PointInstr
from distgraph.plan.kinds import StepKind
from distgraph.runtime.execution.reshard import check_local

PASSES = 4      # progress passes between two instructions (module docstring)


class Ahead:
    """The nonblocking collectives of one process's steps (module docstring):
    ``program`` its :class:`~distgraph.plan.program.ProcessProgram`, ``comm`` and
    ``ranks`` its communicator and the plan's process ranks."""

    def __init__(self, program, comm, ranks):
        self.pid, self.comm, self.ranks = program.process, comm, ranks
        self.update = {instr.point.seq: instr for instr in program.update.instrs
                       if isinstance(instr, PointInstr)}
        self.at: dict = {}
        for start in program.starts:
            self.at.setdefault((start.action, start.instr), []).append(start)
        self.groups = {key: ({j: g for g, group in enumerate(groups) for j in group}, groups)
                       for key, groups in program.prefetch.items()}
        self.pending: dict = {}     # update point seq -> request
        self.gathers: dict = {}     # instruction position -> (request, bytes reserved)
        self.started: set = set()   # the positions started in the running task
        self._order: list = []      # requests in the order they started

    @property
    def active(self) -> bool:
        return bool(self.at or self.groups)

    def clear(self) -> None:
        """Forget every request (a step starts or has ended): a request holds its
        buffers, which would otherwise outlive the step."""
        self.pending.clear()
        self.gathers.clear()
        self._order = []

    def begin_task(self) -> None:
        """A task starts: its gathers are started anew (every one is taken in the task)."""
        self.started.clear()

    def _group(self, step) -> tuple:
        members = step.mesh.group_of(self.pid, step.mesh_dim)
        return tuple(self.ranks(p) for p in members)

    # -- gradient buckets ----------------------------------------------------------------
    def after(self, action: int, instr: int, accumulated, holders=()) -> None:
        """Start the buckets due after instruction ``instr`` of action number ``action``
        (``instr`` -1: after the action) on the ``accumulated`` gradients; ``holders``:
        the other dicts that may hold an array (a reduction in place needs it alone)."""
        for start in self.at.get((action, instr), ()):
            self._start(start, accumulated, holders)

    def _start(self, start: StartAt, accumulated, holders) -> None:
        for seq in start.points:
            instr = self.update[seq]
            step = instr.point.steps[0]
            if self.pid not in step.mesh:
                continue
            name = instr.reads[0]
            arr = accumulated.get(name)
            if arr is None:
                raise RuntimeFault(f"process {self.pid}: the gradient bucket starting after "
                                   f"action {start.action} needs {name!r}, which was not "
                                   f"accumulated; please report it")
            check_local(step, arr, self.pid)
            if step.kind is StepKind.ALL_REDUCE:
                req = self.comm.iall_reduce(arr, self._group(step),
                                            inplace=_alone(name, arr, accumulated, holders))
            else:
                req = self.comm.ireduce_scatter(arr, self._group(step), axis=step.tensor_dim)
            self.pending[seq] = req
            self._order.append(req)

    def take(self, seq: int, wait):
        """The result of the update's reduction point ``seq`` when it was started ahead
        (``wait(request)`` waits for it), else None."""
        req = self.pending.pop(seq, None)
        if req is None:
            return None
        wait(req)
        self._forget(req)
        return req.value

    # -- prefetched gathers --------------------------------------------------------------
    def prefetches(self, key, j: int) -> bool:
        """Whether instruction ``j`` of task ``key`` is a prefetched gather."""
        found = self.groups.get(key)
        return found is not None and j in found[0]

    def gathered(self, key, j: int, instrs, read, ledger, wait):
        """The gathered value of instruction ``j`` (a prefetched gather) of task ``key``
        whose instructions are ``instrs``: its group and the next one started if not yet
        (``read(name)``: a stored value), then its own request waited for."""
        index, groups = self.groups[key]
        g = index[j]
        for group in groups[g:g + 2]:
            for k in group:
                if k not in self.started:
                    self.started.add(k)
                    self._gather(k, instrs[k], read, ledger)
        req, reserved = self.gathers.pop(j)
        wait(req)
        ledger.release(reserved)
        self._forget(req)
        return req.value

    def _gather(self, k: int, instr, read, ledger) -> None:
        step = instr.point.steps[0]
        local = read(instr.reads[0])
        check_local(step, local, self.pid)
        req = self.comm.iall_gather(local, self._group(step), axis=step.tensor_dim)
        # the gathered array is counted from now, as MPI fills it from now
        reserved = local.nbytes * step.group_size
        ledger.reserve(reserved)
        self.gathers[k] = (req, reserved)
        self._order.append(req)

    # -- progress ------------------------------------------------------------------------
    def _forget(self, req) -> None:
        """Stop polling ``req`` (its result was taken): nothing keeps its buffers then."""
        self._order = [r for r in self._order if r is not req]

    def poll(self) -> None:
        """Let MPI move the pending collectives: test the oldest one not done, ``PASSES``
        times (each test runs MPI's progress engine once for all of them)."""
        order = self._order
        for _ in range(PASSES):
            while order and order[0].test():
                order.pop(0)
            if not order:
                return


def _alone(name, arr, accumulated, holders) -> bool:
    """Whether ``arr`` (``accumulated[name]``) may take its reduction in place: it owns
    its memory and no other name or dict holds it or a view of it."""
    if getattr(arr, "base", 0) is not None:
        return False
    for values in (accumulated,) + tuple(holders):
        for other_name, other in values.items():
            if (other is arr and (values is not accumulated or other_name != name)) or \
                    getattr(other, "base", None) is arr:
                return False
    return True
