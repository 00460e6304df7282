"""The persistable values of an Engine on this process, across plans.

Parameters and optimizer states live as this process's local blocks (``arrays``, the
scope every plan's backend runs on), each with the layout it was laid out in
(``layouts``: DistAttr, global shape, dtype, and the plan and backend that can gather
it; the same keys and layouts on every rank). Binding another plan (evaluation, a short
last batch, a new batch size) keeps every value whose layout is unchanged as it is and
re-lays only the others, gathering them from their old layout (a collective, entered
alike by every rank because layouts are global facts); values the process never held
come from, in order: the model's parameters when the user set them since they were last
synced, a loaded checkpoint (reading only this process's block), the model's
parameters and published optimizer states, and fresh optimizer states.

Example::

    state = ProcessState(model, optimizer)
    scope = state.bind(plan, pid=0, backend=backend)      # local arrays of the plan
    params, states = state.publish()                       # global arrays (collective)
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from distgraph.app.checkpoint import CheckpointError
from distgraph.optim import LR


class Layout(NamedTuple):
    attr: object          # DistAttr of the value in ``plan``
    shape: tuple
    dtype: str
    plan: object
    backend: object


class ProcessState:
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
    def bind(self, plan, pid: int, backend) -> dict:
        """Lay out every persistable of ``plan`` for process ``pid`` as arrays of the
        runner ``backend`` (``backend.arrays``: numpy, or CuPy); returns the scope.
        Cheap when ``plan`` is the one bound last and the model was not given new values."""
        self.take_user_changes()
        if self.bound is plan:
            return self.arrays
        want = {v.name: v for v in plan.program.persistables}
        relayout = sorted(n for n, v in want.items() if n in self.layouts and
                          _moved(self.layouts[n], v, plan))
        gathered = self.gather(relayout)
        params = dict(self.model.named_parameters())
        self._check_pending(want)
        for name in sorted(want):
            v = want[name]
            layout = Layout(v.dist_attr, tuple(v.shape), v.dtype, plan, backend)
            held = pid in v.dist_attr.mesh
            if name in self.layouts and name not in gathered:
                self.layouts[name] = layout
                continue
            self.layouts[name] = layout
            self.arrays.pop(name, None)
            from_checkpoint = name in self.pending_names
            self.pending_names.discard(name)
            if not held:
                continue
            index = v.dist_attr.local_slices(v.shape, pid)
            fresh = False         # a new array of this process's own (no copy needed)
            if name in gathered:
                block = gathered[name][index]
            elif from_checkpoint:
                block = self.pending.read(name, index)
            elif name in params:         # a lazy parameter makes only this block
                block, fresh = params[name].block(index), True
            elif name in self.states:
                block = np.asarray(self.states[name])[index]
            else:
                block = self._fresh(v, index)
            self.arrays[name] = backend.arrays.from_host(
                np.array(block, dtype=v.dtype, order="C", copy=None if fresh else True))
        self.bound = plan
        return self.arrays

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
        """Global arrays of laid-out values ``names`` on every process (collective: every
        rank passes the same names). Grouped by the backend that laid them out."""
        groups: dict = {}
        for name in sorted(names):
            groups.setdefault(id(self.layouts[name].backend), []).append(name)
        out = {}
        for group in groups.values():
            backend = self.layouts[group[0]].backend
            out.update(backend.gather(self.arrays, group))
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
                            layout.backend.arrays.to_host(block)))
            elif name in self.pending_names:
                out.append((name, None, _Lazy(self.pending, name)))
            elif name in params:
                out.append((name, None, params[name]._data if not params[name].is_lazy
                            else _Unmade(params[name])))
            else:
                out.append((name, None, self.states[name]))
        return out


def _moved(old: Layout, v, plan) -> bool:
    """Whether Value ``v`` of ``plan`` lays its blocks out otherwise than ``old``: another
    layout or shape, or other ranks running its processes (the rank mapper may place the
    processes of two plans, say training's and evaluation's, differently)."""
    if old.attr != v.dist_attr or old.shape != tuple(v.shape):
        return True
    ids = v.dist_attr.mesh.process_ids
    return old.plan.ranks.of(ids) != plan.ranks.of(ids)


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

