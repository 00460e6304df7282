"""The plans of an Engine: each planned program once, and the one each mode runs now.

A plan depends on the mode (training, evaluation, prediction), on the feeds' shapes (a
short last batch, a new batch size) and on what :func:`program_key` lists; the cache
holds one :class:`Planned` per (mode, key) — the Plan, the InputSpecs it was planned
for, its runner (made when it first runs: :meth:`PlanCache.runner`) and the range check
of its feeds — and the key each mode runs now (:meth:`PlanCache.activate`).

Example::

    cache = PlanCache()
    cache.add(Mode.TRAIN, key, plan, (inputs, labels))
    cache.plan(Mode.TRAIN) is plan
    runner = cache.runner(Mode.TRAIN, comm=lambda: MPICommunicator())
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from distgraph import dtypes
from distgraph.app.checks import FeedCheck
from distgraph.app.data import reads_of
from distgraph.errors import DistGraphError
from distgraph.ir import Kind
from distgraph.nn.layers import Dropout
from distgraph.passes.transforms.sequence_parallel import tensor_parallel_dims
from distgraph.runtime.execution.runner import PlanRunner


class Mode(Kind):
    """What an Engine call runs: a training step, an evaluation or a prediction."""

    TRAIN = "train"
    EVAL = "eval"
    PREDICT = "predict"


MODES = (Mode.TRAIN, Mode.EVAL, Mode.PREDICT)


def as_mode(mode) -> Mode:
    """``mode`` ("train", "eval" or "predict") as a Mode; anything else is an error."""
    if mode not in MODES:
        raise DistGraphError(f"mode must be one of {tuple(m.value for m in MODES)}, got "
                             f"{mode!r}")
    return Mode(mode)


def program_key(mode: Mode, inputs_spec, labels_spec, model, optimizer, strategy) -> tuple:
    """What a plan depends on besides the model's structure: the feeds, the optimizer's
    settings (its learning rate is fed), the dropout seeds, the strategy (a new
    ``engine.strategy`` plans again, and the values it lays out otherwise move)."""
    feeds = tuple((s.name, tuple(s.shape), s.dtype, s.dist_attr)
                  for s in list(inputs_spec) + list(labels_spec))
    optim = repr(sorted(optimizer.hyperparameters().items())) \
        if mode is Mode.TRAIN and optimizer is not None else None
    seeds = tuple(layer.seed for _, layer in model.named_sublayers()
                  if isinstance(layer, Dropout))
    return mode, feeds, optim, seeds, strategy


@dataclass
class Planned:
    """One planned program: its ``plan``, the (inputs, labels) InputSpecs it was planned
    for, whether its search was rank 0's, sent to the others (``shared``: the same plan
    on every rank by construction), its ``runner`` once it ran, the range check of its
    feeds and what this rank reads of a batch (its program's feeds:
    :func:`~distgraph.app.data.reads_of`)."""

    plan: object
    specs: tuple
    shared: bool = False
    runner: PlanRunner | None = None
    feed_check: FeedCheck | None = None
    feed_reads: dict | None = None

    def check(self) -> FeedCheck:
        if self.feed_check is None:
            self.feed_check = FeedCheck(self.plan.built.program)
        return self.feed_check

    def reads(self) -> dict:
        """{input name: FieldRead} of what the runner's process reads of a batch."""
        if self.feed_reads is None:
            self.feed_reads = reads_of(self.runner.program.feeds, self.plan.built.feed_names)
        return self.feed_reads


class PlanCache:
    """{program key: Planned} and the key each mode runs now (module docstring)."""

    def __init__(self):
        self._planned: dict = {}
        self._active: dict = {}         # mode -> the key of the plan it runs now

    def get(self, key) -> Planned | None:
        return self._planned.get(key)

    def add(self, key, plan, specs, shared: bool = False) -> Planned:
        """Hold ``plan`` under ``key`` (a new plan of a key replaces the old one) and make
        it the one its mode runs."""
        self._planned[key] = Planned(plan, (list(specs[0]), list(specs[1])), shared)
        return self.activate(key)

    def activate(self, key) -> Planned:
        """Make the plan of ``key`` the one its mode (``key[0]``) runs."""
        self._active[key[0]] = key
        return self._planned[key]

    def active(self, mode) -> Planned | None:
        """The Planned that ``mode`` runs now (None before its first plan)."""
        key = self._active.get(mode)
        return None if key is None else self._planned[key]

    def active_key(self, mode):
        return self._active.get(mode)

    def plan(self, mode):
        """The Plan ``mode`` runs now, or None."""
        planned = self.active(mode)
        return None if planned is None else planned.plan

    def plans(self) -> dict:
        """{mode: the Plan it runs now} of every mode planned so far."""
        return {mode: self._planned[key].plan for mode, key in self._active.items()}

    def runner(self, mode, comm) -> PlanRunner:
        """The runner of ``mode``'s plan, made the first time (``comm()`` gives the world
        communicator, for a distributed plan)."""
        planned = self.active(mode)
        if planned.runner is None:
            planned.runner = make_runner(planned.plan, comm,
                                         searched_apart=not planned.shared)
        return planned.runner

    def ran(self, mode) -> PlanRunner | None:
        """The runner of ``mode``'s plan where it ran already, else None."""
        planned = self.active(mode)
        return None if planned is None else planned.runner


def make_runner(plan, comm, searched_apart: bool = True) -> PlanRunner:
    """The runner of ``plan`` on this rank; a plan each rank searched itself
    (``searched_apart``) must be the one every rank's search chose. 16-bit parameters (a
    16-bit default dtype) are planned with master copies the optimizer does not
    initialise, never run: mixed-precision training is a float32 model with
    ``Strategy(amp=...)``."""
    for v in plan.program.parameters:
        if v.dtype in dtypes.HALF_DTYPES:
            raise DistGraphError(f"running the program: parameter {v.name!r} is {v.dtype}; "
                                 f"16-bit parameters are for planning. Train in mixed "
                                 f"precision with a float32 model and "
                                 f"dg.Strategy(amp={v.dtype!r}) (float32 master weights)")
    if not plan.distributed:
        return PlanRunner(plan, None)
    world = comm()
    if plan.search is not None and searched_apart:
        check_same_search(plan, world)
    return PlanRunner(plan, world)


def check_same_search(plan, comm) -> None:
    """Every rank searched its plan itself: make sure all chose the same (a search that
    ran out of time may stop at other choices on other ranks)."""
    digest = hashlib.sha256(repr(plan.search.layouts).encode()).digest()
    mine = np.array([int.from_bytes(digest[:6], "big")], dtype=np.float64)
    ranks = list(range(comm.size))
    low = comm.all_reduce(mine, ranks, op="min")
    high = comm.all_reduce(mine, ranks, op="max")
    if low[0] != high[0]:
        raise DistGraphError(f"rank {comm.rank}: the ranks' searches chose different plans "
                             f"(search status {plan.search.status}, gap {plan.search.gap:.3g}): "
                             "raise Strategy.solver_time_limit so that the search finishes, or "
                             "annotate more tensors")


def idle_options(plan) -> list[str]:
    """Why each Strategy option that splits nothing in ``plan`` has no effect (an
    Engine shows each once): ``sequence_parallel`` where no parameter is split over a
    mesh dim (no tensor parallelism), ``context_parallel`` where no attention has its
    sequence split."""
    program, strategy, said = plan.program, plan.strategy, []
    if strategy.sequence_parallel and not tensor_parallel_dims(program):
        said.append("Strategy(sequence_parallel=True) does nothing here: it splits the "
                    "activations between tensor-parallel regions over the tensor-parallel "
                    "mesh dim, but no parameter is split over a mesh dim; annotate the "
                    "tensor parallelism (e.g. dg.nn.llama.megatron(model, mesh))")
    attention = [op for op in program.ops if op.type == "attention"]
    if strategy.context_parallel and attention and not any(
            op.dist_attr.input_specs[0].entry(2) for op in attention):
        said.append(f"Strategy(context_parallel={strategy.context_parallel!r}) does nothing "
                    f"here: no attention has its sequence split; split it with "
                    f"dg.shard_dataloader(data, mesh, shard_dims=\"dp\", sequence_dim=\"cp\")")
    return said
