"""What a rank holds: the bytes of the arrays the runtime keeps, counted as it keeps them.

A :class:`Ledger` counts, for one step of one rank, the arrays of the array backend
(numpy, or CuPy on a GPU) that the runtime holds: the scope (parameters, optimizer
states), each micro-batch's environment (its fed rows, the values of the running task and
those kept between tasks: activations for the backward, gradients not yet added up), what
kernels keep for their gradients (``KernelContext.saved``), the gradient accumulation
buffers, the receive buffers posted ahead (at their declared size, from the moment they
are posted, whatever the communicator: MPI allocates them then), the tiles of sends in
flight, staging copies the runtime keeps in those places (a padded or joined copy, a
contiguous copy of a send tile), and the gathered fetched values (the loss).

**Counting once.** An array is counted by the memory it views: its owner, the end of its
``.base`` chain (as :func:`~distgraph.runtime.execution.executor.donatable` reads it), so a
view, a reshape or a donated result of an array held elsewhere adds nothing, and an
owner counts its whole ``nbytes`` as long as one view of it is held. A numpy scalar or 0-d
array counts its ``nbytes``; what has no ``nbytes`` (a Python float, None) counts
nothing; lists, tuples, dicts and plain objects (what a kernel keeps) count the arrays in
them. Memory the runtime did not allocate (the caller's batch, of which the fed rows are
views on the numpy backend) is foreign: an array viewing it counts its own bytes, once per
address, so the fed rows count as the CuPy backend's copies of them would.

**When.** The count follows the containers the runtime keeps (:class:`Counted` dicts),
hence the runtime's own free-after-last-use: a value is counted from the moment it is
stored (an op's results are stored before its dying inputs are dropped, so an op's peak
holds its inputs and its outputs) until the runtime drops its last reference to it (the
executor's ``dying`` names, a micro-batch's environment cleared when its work is done).
What a kernel keeps counts until the kernel that takes it has stored its results. What
lives only inside one call is not seen: a kernel's temporaries, a collective's internal
buffers, the communicator's host staging of device arrays (host memory, not the device's).

The peak of a step is the highest count reached, with what was running then
(:attr:`Ledger.peak_at`: the action and the instruction); :class:`StepMemory` is the
step's record, :func:`check_peak` the comparison with the plan's estimate.

**What the allocator handed out.** Beside its own count, a step records what the
machine's allocator gave out where that is measured: on the numpy backend, while
``tracemalloc`` traces (the caller started it: tracing slows every Python allocation),
the traced peak during the step above what was traced at its start
(:class:`AllocationProbe`). That sees what the count does not: kernels' temporaries,
collectives' buffers, copies made inside a call (and, as noise, the Python objects the
step makes). On CuPy it is not measured (None).

Example::

    led = Ledger(backend)
    scope = Mirrored(led, scope)                # counts the state; stores go through
    env = Counted(led, feed)
    env["y"] = x @ w                            # counted
    env.pop("x")                                # dropped (if nothing else holds it)
    led.peak, led.peak_at
"""

from __future__ import annotations

import tracemalloc
from dataclasses import dataclass
from types import ModuleType

from distgraph.registry import KernelContext
from distgraph.units import fmt_bytes

CHECK_MARGIN = 0.10        # a measured peak above the estimate by more than this is said
_DEPTH = 4                 # how deep kept structures are searched for arrays
_MISSING = object()


def arrays_in(value, depth: int = 0):
    """The arrays in ``value``: itself if it is one (it has ``nbytes`` and ``dtype``), else
    those in a list, tuple, dict or plain object's attributes, a few levels down (not
    through modules, callables or a ``KernelContext``)."""
    if isinstance(value, type):            # numpy's scalar types have nbytes too
        return
    if hasattr(value, "nbytes") and hasattr(value, "dtype"):
        yield value
    elif depth < _DEPTH:
        if isinstance(value, (list, tuple)):
            items = value
        elif isinstance(value, dict):
            items = value.values()
        elif hasattr(value, "__dict__") and not (
                callable(value) or isinstance(value, (ModuleType, KernelContext))):
            # a plain object's (what moe_ffn keeps); not through a kernel's context to
            # its communicator
            items = vars(value).values()
        else:
            return
        for item in items:
            yield from arrays_in(item, depth + 1)


class Ledger:
    """The bytes one rank holds during a step (module docstring). ``backend``: the array
    backend (its ``address`` of a foreign view). ``at``: what runs now, set by the
    carrier ((action, instruction); the action a string such as ``"0F3"`` or
    ``"update"``); :attr:`peak` / :attr:`peak_at`: the highest count and what ran then;
    :meth:`since` the highest count since it was last asked."""

    def __init__(self, backend):
        self.xb = backend
        self.owners: dict = {}          # key -> [owner, holds, bytes]
        self.foreign: dict = {}         # id -> array: memory that is not the runtime's
        self.bytes = 0
        self.peak = 0
        self.at = self.peak_at = ("step start", None)
        self._window = 0
        self._later: list = []

    # -- holding -----------------------------------------------------------------------------
    def add_foreign(self, arrays) -> None:
        """Mark the owners of ``arrays`` that are not the arrays themselves (the caller's
        batch the fed rows view) as memory the runtime did not allocate."""
        for a in arrays:
            root = _root(a)
            if root is not a:
                self.foreign[id(root)] = root

    # hold and drop run at every store and free of every value: kept lean
    def hold(self, value) -> None:
        """One more reference to each array in ``value``."""
        try:
            base = value.base                   # an array's (None: it owns its memory)
        except AttributeError:
            for a in arrays_in(value):
                self.hold(a)
            return
        if base is None:
            key, owner = id(value), value
        elif isinstance(value, type):           # a class (np.float32): no memory
            return
        else:
            key, owner = self._key(value, base)
        owners = self.owners
        entry = owners.get(key)
        if entry is not None:
            entry[1] += 1
            return
        n = owner.nbytes
        owners[key] = [owner, 1, n]
        held = self.bytes = self.bytes + n
        if held > self._window:
            self._window = held
            if held > self.peak:
                self.peak, self.peak_at = held, self.at

    def drop(self, value) -> None:
        """One reference fewer to each array in ``value``; an owner no longer held stops
        counting."""
        try:
            base = value.base
        except AttributeError:
            for a in arrays_in(value):
                self.drop(a)
            return
        if base is None:
            key = id(value)
        elif isinstance(value, type):
            return
        else:
            key = self._key(value, base)[0]
        owners = self.owners
        entry = owners.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if not entry[1]:
            del owners[key]
            self.bytes -= entry[2]

    def holds(self, a) -> int:
        """How many times the counted containers hold array ``a``'s memory, ``a`` owning
        it (each name or view of it once; 0 where none does)."""
        entry = self.owners.get(id(a))
        return 0 if entry is None or entry[0] is not a else entry[1]

    def later(self, value) -> None:
        """Drop ``value`` at the next :meth:`settle` (what a kernel takes back from what
        it kept lives until the kernel's results are stored)."""
        self._later.append(value)

    def settle(self) -> None:
        while self._later:
            self.drop(self._later.pop())

    def reserve(self, n: int) -> None:
        """``n`` bytes held that are not an array yet (a receive posted ahead)."""
        self.bytes += int(n)
        if self.bytes > self._window:
            self._window = self.bytes
            if self.bytes > self.peak:
                self.peak, self.peak_at = self.bytes, self.at

    def release(self, n: int) -> None:
        self.bytes -= int(n)

    def since(self) -> int:
        """The highest count since the last call (the current count to begin with)."""
        out, self._window = self._window, self.bytes
        return max(out, self.bytes)

    def _key(self, a, base) -> tuple:
        """(key, owner) of array ``a`` whose ``.base`` is ``base``: the owner of its memory
        by identity; for a view of foreign memory, ``a`` itself by its address."""
        root = a
        while base is not None and hasattr(base, "nbytes"):
            root, base = base, getattr(base, "base", None)
        if self.foreign and id(root) in self.foreign:
            return ("view", self.xb.address(a), int(a.nbytes)), a
        return id(root), root


def _root(a):
    """The array whose memory ``a`` views: the end of its ``.base`` chain (a base that is
    no array, such as a bytes object, ends it)."""
    base = getattr(a, "base", None)
    while base is not None and hasattr(base, "nbytes"):
        a, base = base, getattr(base, "base", None)
    return a


class Counted(dict):
    """A dict whose values ``ledger`` counts while it holds them (stored, replaced,
    popped, cleared); reads are a plain dict's. :class:`Mirrored` writes its stores
    through to another dict, :class:`Kept` drops what is popped later."""

    __slots__ = ("ledger",)

    def __init__(self, ledger: Ledger, items=()):
        super().__init__()
        self.ledger = ledger
        for key, value in dict(items).items():
            self[key] = value

    def __setitem__(self, key, value) -> None:
        if key in self:
            old = dict.__getitem__(self, key)
            dict.__setitem__(self, key, value)
            self.ledger.hold(value)
            self.ledger.drop(old)
        else:
            dict.__setitem__(self, key, value)
            self.ledger.hold(value)

    def __delitem__(self, key) -> None:
        self.pop(key)

    def pop(self, key, default=_MISSING):
        value = dict.pop(self, key, _MISSING)
        if value is _MISSING:
            if default is _MISSING:
                raise KeyError(key)
            return default
        self._release(value)
        return value

    def _release(self, value) -> None:
        """What a popped ``value`` does to the count: dropped now."""
        self.ledger.drop(value)

    def popitem(self):
        key = next(reversed(self))
        return key, self.pop(key)

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return dict.__getitem__(self, key)

    def update(self, *args, **kwargs) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def clear(self) -> None:
        for value in self.values():
            self.ledger.drop(value)
        dict.clear(self)


class Mirrored(Counted):
    """A :class:`Counted` whose stores are written through to ``mirror`` (the caller's
    scope: an updated parameter replaces the old one there at once)."""

    __slots__ = ("mirror",)

    def __init__(self, ledger: Ledger, mirror: dict):
        self.mirror = mirror
        super().__init__(ledger, mirror)

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self.mirror[key] = value


class Kept(Counted):
    """What kernels keep for their gradients (``KernelContext.saved``): what a kernel
    takes back (pops) is dropped at the ledger's next :meth:`~Ledger.settle`."""

    __slots__ = ()

    def _release(self, value) -> None:
        self.ledger.later(value)


class AllocationProbe:
    """The allocator's high-water mark over one step (module docstring): ``begin()`` as
    the step starts, ``above()`` as it ends: the most bytes allocated during the step
    above what was allocated at its start, or None where nothing measures it (numpy
    without ``tracemalloc`` tracing; CuPy).

    Example::

        tracemalloc.start()
        probe = AllocationProbe(backend)
        probe.begin(); run_step(); probe.above()      # 123456
    """

    def __init__(self, backend):
        self.traced = getattr(backend, "name", "numpy") == "numpy"
        self.start: int | None = None

    def begin(self) -> None:
        if self.traced and tracemalloc.is_tracing():
            self.start = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
        else:
            self.start = None

    def above(self) -> int | None:
        if self.start is None or not tracemalloc.is_tracing():
            return None
        return int(tracemalloc.get_traced_memory()[1] - self.start)


@dataclass(frozen=True)
class StepMemory:
    """One step of one rank: ``peak`` bytes held at its highest, reached in ``action``
    (``"0B2"``, ``"update"``, or ``"step start"``: the state and the fed rows) at
    ``instruction`` (``"op 'matmul' in layer 'fc1'"``, a reshard, a send, ...; "" where
    none ran), ``start`` bytes held when the step began (state and fed rows) and
    ``resident`` bytes held once it ended (the state carried to the next step).
    ``allocated``: the allocator's most bytes during the step above its start
    (:class:`AllocationProbe`; None where not measured), so that ``start +
    allocated`` is the step's allocation peak as the machine saw it."""

    step: int
    peak: int
    action: str
    instruction: str
    start: int
    resident: int
    allocated: int | None = None

    @property
    def allocation_peak(self) -> int | None:
        """``start + allocated``: the step's peak as the allocator handed it out (None
        where not measured)."""
        return None if self.allocated is None else self.start + self.allocated

    @property
    def where(self) -> str:
        """``"action 0B2, op 'matmul_grad' in layer 'fc1'"``."""
        if self.action == "step start":
            return "at the step's start"
        head = self.action if self.action == "update" else f"action {self.action}"
        return f"{head}, {self.instruction}" if self.instruction else head


def record(ledger: Ledger, step: int, start: int, allocated: int | None = None) -> StepMemory:
    """The step's record from its ledger, once the step's values are released;
    ``allocated``: :meth:`AllocationProbe.above`."""
    action, instr = ledger.peak_at
    return StepMemory(step, int(ledger.peak), str(action), "" if instr is None else str(instr),
                      int(start), int(ledger.bytes), allocated)


def predicted_peak(plan, pid: int) -> int | None:
    """Process ``pid``'s peak bytes by the plan's estimate (``plan.estimate.processes``);
    None without an estimate."""
    estimate = getattr(plan, "estimate", None)
    if estimate is None:
        return None
    for p in estimate.processes:
        if p.process == pid:
            return int(p.peak_memory)
    return None


def check_peak(measured: StepMemory, predicted: int, who: str,
               margin: float = CHECK_MARGIN) -> str | None:
    """A line saying that ``who`` (``"rank 2"``) held more than ``predicted`` bytes (the
    plan's figure) by more than ``margin`` at its measured peak; None while it did not.

    Example::

        check_peak(runner.memory[-1], 1 << 20, "rank 0")
        # "rank 0 held 1.5 MiB (1572864 bytes) at its peak in step 3, action 0B1, op
        #  'relu' in layer 'fc1': 1.50x the plan's estimate of 1 MiB (1048576 bytes) ..."
    """
    if measured.peak <= predicted * (1.0 + margin):
        return None
    ratio = f"{measured.peak / predicted:.2f}x" if predicted else "more than"
    return (f"{who} held {fmt_bytes(measured.peak)} ({measured.peak} bytes) at its peak in "
            f"step {measured.step}, {measured.where}: {ratio} the plan's estimate of "
            f"{fmt_bytes(predicted)} ({predicted} bytes), more than {margin:.0%} over; the "
            f"estimate does not price what it holds there")
