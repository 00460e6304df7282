"""The persistable values of an Engine on this rank, across plans: the held state.

Parameters and optimizer states live as this rank's local blocks (``arrays``, the scope
every plan's runner runs on), each with the layout it was laid out in (``layouts``: a
:class:`HeldLayout`, with the plan and runner that laid it out; the same keys and
layouts on every rank). Binding another plan (evaluation, a short last batch, a new
strategy or batch size) keeps every value whose layout over ranks is unchanged as it is
and moves the others by reshard points planned like any other
(:func:`distgraph.passes.relayout.plan_relayout`) and run by the runtime
(:func:`distgraph.runtime.execution.runner.relayout`): a collective, entered alike by
every rank because layouts are global facts, in which each rank sends and receives only
blocks. Values the rank never held come from, in order: the model's parameters when the
user set them since they were last synced, a loaded checkpoint (reading only this
process's block), the model's parameters and published optimizer states, and fresh
optimizer states.

Example::

    state = HeldState(model, optimizer)
    scope = state.bind(plan, runner, comm)          # local arrays of the plan
    params, states = state.publish()                 # global arrays (collective)
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from distgraph.app.checkpoint import CheckpointError
from distgraph.optim import LR
from distgraph.passes.relayout import plan_relayout
from distgraph.runtime.execution.runner import relayout


class HeldLayout(NamedTuple):
    """How a held value is laid out: its DistAttr in ``plan``, global shape and dtype, and
    the runner of ``plan`` (which gathers it, and whose array backend holds its block);
    ``logical``: its shape without ZeRO's padding (``shape`` where it is not padded: the
    blocks of a padded value hold zeros past it)."""

    attr: object
    shape: tuple
    dtype: str
    plan: object
    runner: object
    logical: tuple


class HeldState:
    """This rank's parameters and optimizer states (module docstring)."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        self.arrays: dict = {}
        self.layouts: dict = {}
        self.states: dict = {}        # global optimizer states when not laid out
        self.pending = None           # a loaded CheckpointReader ...
        self.pending_names: set = set()   # ... and the tensors not taken from it yet
        self._seen: dict = {}
        self.bound = None             # the plan ``arrays`` is laid out for
        self.mark_synced()

    # -- the model's parameters ---------------------------------------------------------
    def mark_synced(self, names=None) -> None:
        """Remember the arrays the model's parameters hold now (set_value replaces them)."""
        params = dict(self.model.named_parameters())
        for name in params if names is None else names:
            self._seen[name] = params[name].source

    def user_changes(self) -> list:
        """Parameters given new values on the model (``set_state_dict``, ``set_value``)
        since the Engine last synced them; they replace the Engine's copies."""
        return [n for n, p in self.model.named_parameters() if p.source is not self._seen.get(n)]

    def take_user_changes(self) -> list:
        changed = self.user_changes()
        for name in changed:
            self.layouts.pop(name, None)
            self.arrays.pop(name, None)
            self.pending_names.discard(name)
        if changed:
            self.bound = None
        self.mark_synced(changed)
        return changed

    # -- binding a plan -------------------------------------------------------------------
    def bind(self, plan, runner, comm=None) -> dict:
        """Lay out every persistable of ``plan`` for ``runner`` (its process, its array
        backend: numpy, or CuPy) and return the scope; ``comm`` is the job's world
        communicator (None while no plan of the job is distributed). Cheap when ``plan``
        is the one bound last and the model was not given new values. Each value laid out
        anew is laid out by the runner (:meth:`PlanRunner.lay_out
        <distgraph.runtime.execution.runner.PlanRunner.lay_out>`), from where it is held."""
        self.take_user_changes()
        if self.bound is plan:
            return self.arrays
        want = {v.name: v for v in plan.program.persistables}
        held = sorted(n for n in want if n in self.layouts)
        # a value the plans pad otherwise (ZeRO's padding for another data-parallel
        # size, or none) is gathered whole, cut back, and laid out anew (collective:
        # layouts are the same on every rank); the others move block by block
        regathered = self.gather([n for n in held
                                  if self.layouts[n].shape != tuple(want[n].shape)])
        moved = self._move([n for n in held if n not in regathered], plan, comm)
        params = dict(self.model.named_parameters())
        self._check_pending(want)
        made, from_checkpoint = [], set()      # the values laid out anew, in name order
        for name in sorted(want):
            v = want[name]
            kept = name in self.layouts and name not in moved and name not in regathered
            self.layouts[name] = HeldLayout(v.dist_attr, tuple(v.shape), v.dtype, plan, runner,
                                            tuple(v.logical_shape))
            if kept:
                continue
            made.append(name)
            self.arrays.pop(name, None)
            if name in self.pending_names:
                from_checkpoint.add(name)
                self.pending_names.discard(name)

        def block_of(v, index):
            """(this process's block of ``v``, whether it is a new array of its own)."""
            name = v.name
            if name in moved:       # this block (past a padded value's end: cut back)
                return moved[name][tuple(slice(0, s.stop - s.start) for s in index)], False
            if name in regathered:
                return regathered[name][index], False
            if name in from_checkpoint:
                return self.pending.read(name, index), False
            if name in params:          # a lazy parameter makes only this block
                return params[name].block(index), True
            if name in self.states:
                return np.asarray(self.states[name])[index], False
            return self._fresh(v, index), False

        self.arrays.update(runner.lay_out(made, block_of))
        self.bound = plan
        return self.arrays

    def _move(self, names, plan, comm) -> dict:
        """Move the held values ``names`` whose layout over ranks ``plan`` changes:
        {name: this rank's new host block, or None where it holds none}. Grouped by the
        plan that laid them out, in the order of the names (the same on every rank)."""
        groups: dict = {}          # plans (hashed by identity) keep their first-seen order
        for name in names:
            old = self.layouts[name].plan
            if old is not plan:
                groups.setdefault(old, []).append(name)
        rank = comm.rank if comm is not None else 0
        points = [point for old, group in groups.items()
                  for point in plan_relayout(old, plan, group, rank)]
        blocks = {p.value: self._host_block(p.value) for p in points if p.reads}
        return relayout(points, blocks, comm, rank)

    def _host_block(self, name):
        return self.layouts[name].runner.backend.to_host(self.arrays[name])

    def _fresh(self, v, index):
        if v.name == LR:
            return np.array(self.optimizer.lr_at(0), dtype=v.dtype)
        return np.zeros(tuple(s.stop - s.start for s in index), dtype=v.dtype)

    def _check_pending(self, want) -> None:
        """A checkpoint with optimizer states must hold every state the plan keeps."""
        if self.pending is None or not self.pending.has_optimizer_state:
            return
        missing = sorted(n for n, v in want.items() if not v.is_parameter and n != LR
                         and n not in self.layouts and n not in self.pending_names
                         and n not in self.states)
        if missing:
            raise CheckpointError(f"checkpoint {self.pending.path} lacks the optimizer "
                                  f"state(s) {missing} that this training program keeps; "
                                  f"load a checkpoint saved with the same optimizer")

    # -- global values --------------------------------------------------------------------
    def gather(self, names) -> dict:
        """Global arrays of laid-out values ``names`` on every rank (collective: every
        rank passes the same names). Grouped by the runner that laid them out."""
        groups: dict = {}
        for name in sorted(names):
            groups.setdefault(self.layouts[name].runner, []).append(name)
        out = {}
        for runner, group in groups.items():
            out.update(runner.gather(self.arrays, group))
        return out

    def publish(self) -> tuple[dict, dict]:
        """(parameters, optimizer states) as global arrays, written back to the model's
        parameters (collective). Values that are laid out stay where they are; only the
        others are kept as global ``states``."""
        self.take_user_changes()
        values = {n: np.array(a) for n, a in self.gather(list(self.layouts)).items()}
        for name in sorted(self.pending_names):
            values[name] = self.pending.read(name)
        self.pending_names.clear()
        params = dict(self.model.named_parameters())
        for name, p in params.items():
            if name in values:
                a = values[name]
                if a.dtype != p.dtype or not a.flags.c_contiguous:
                    a = np.array(a, dtype=p.dtype, order="C")
                p._data = a
        self.mark_synced()
        states = {**self.states, **{n: a for n, a in values.items() if n not in params}}
        self.states = {n: a for n, a in states.items() if n not in self.layouts}
        return ({n: p._data for n, p in params.items()},
                {n: a for n, a in states.items() if n != LR})

    def load(self, reader) -> None:
        """Forget every value held; read them from ``reader`` when next bound."""
        self.arrays.clear()
        self.layouts.clear()
        self.states.clear()
        self.bound = None
        self.pending, self.pending_names = reader, set(reader.tensors)
        self.mark_synced()

    def set_lr(self, value: float) -> None:
        if LR in self.arrays:
            self.arrays[LR][...] = value

    def entries(self):
        """What a checkpoint holds: (name, layout or None, local block or global array,
        on the host) for every parameter and optimizer state (not the learning rate)."""
        self.take_user_changes()
        params = dict(self.model.named_parameters())
        names = set(params) | set(self.layouts) | set(self.states) | self.pending_names
        names.discard(LR)
        out = []
        for name in sorted(names):
            if name in self.layouts:
                layout, block = self.layouts[name], self.arrays.get(name)
                out.append((name, layout, None if block is None else
                            layout.runner.backend.to_host(block)))
            elif name in self.pending_names:
                out.append((name, None, _Lazy(self.pending, name)))
            elif name in params:
                out.append((name, None, params[name]._data if not params[name].is_lazy
                            else _Unmade(params[name])))
            else:
                out.append((name, None, self.states[name]))
        return out


class _Unmade:
    """A lazy parameter no plan laid out yet, made whole only when written (by rank 0)."""

    def __init__(self, param):
        self.param, self.shape, self.dtype = param, param.shape, param.dtype

    def __array__(self, dtype=None, copy=None):
        return self.param.block()


class _Lazy:
    """A tensor of a checkpoint read in full only when written (by rank 0)."""

    def __init__(self, reader, name):
        self.reader, self.name = reader, name
        self.shape, self.dtype = reader.shape(name), reader.dtype(name)

    def __array__(self, dtype=None, copy=None):
        return self.reader.read(self.name)

