"""Engine: the facade that builds, plans and runs a model.

The Engine holds three parts, each a class of its own: the plan cache
(:class:`~distgraph.app.plans.PlanCache`: each planned program once, its runner, the plan
each mode runs now), the held state (:class:`~distgraph.app.state.HeldState`: this rank's
blocks of the parameters and optimizer states, moved between plans by planned reshard
points), and the loops (:class:`~distgraph.app.loops.Loops`: fit, evaluate and predict
batch by batch, and the training position). What ``distgraph run --cluster`` and
``distgraph plan`` ask reaches it through the launch context
(:func:`distgraph.runtime.launch.context.current`), read once, when it is made.

Example::

    engine = dg.Engine(model, loss=dg.nn.CrossEntropyLoss(), optimizer=dg.optim.AdamW(1e-3))
    history = engine.fit(train_data, batch_size=8, epochs=2)
    history.losses[-1]
"""

from __future__ import annotations

import dataclasses
import pickle
import sys

import numpy as np

from distgraph.app import checkpoint, checks, plan_report, pretrained
from distgraph.app.checkpoint import CheckpointReader
from distgraph.app.checkpoint_verify import newest as newest_checkpoint
from distgraph.app.checkpoint_verify import verify
from distgraph.app.loops import History, Loops
from distgraph.app.plans import MODES, Mode, PlanCache, as_mode, idle_options, program_key
from distgraph.app.resume import check_checkpoint, checkpoint_info, restore_info
from distgraph.app.state import HeldState
from distgraph.errors import DistGraphError, PlanError
from distgraph.keywords import keywords_checked
from distgraph.metrics import as_metrics
from distgraph.passes.plan_file import load as load_plan
from distgraph.passes.planner import plan
from distgraph.plan.file import as_text as plan_text
from distgraph.plan.file import from_text as plan_from_text
from distgraph.plan.file import read as read_plan_file
from distgraph.program_builder import build_program
from distgraph.resources.cluster import Cluster
from distgraph.runtime.launch.context import current as launch_context
from distgraph.runtime.launch.status import get_rank, get_world_size, write_status
from distgraph.strategy import Strategy

__all__ = ["Engine", "History"]


@keywords_checked          # Engine(optimiser=...) names 'optimizer'
class Engine:
    """Builds the training, evaluation and prediction programs of a model and runs them.

    A model without annotations trains on one process; with ``shard_tensor`` /
    ``shard_op`` annotations every rank of the job runs its part of the completed and
    partitioned program, and the results equal serial training. With a ``cluster`` the
    logical processes are placed on its devices by the rank mapper (or as
    ``rank_mapping``, {process: device global id}, says). ``metrics`` (``dg.metrics``)
    are reported by ``evaluate`` and by the validation of ``fit``.

    The Engine keeps the parameters and optimizer states on its processes between calls;
    ``state_dict()`` and ``optimizer_state_dict()`` return them whole, ``save(path)``
    writes a checkpoint that ``load(path)`` restores under any plan. Setting new values
    on the model (``model.set_state_dict``) takes effect at the next step.

    A dataset from ``dg.shard_dataloader`` feeds each batch split over a mesh dim;
    ``evaluate``, ``predict`` and the validation of ``fit`` split plain datasets the
    way the last ``fit``'s shard_dataloader did. ``engine.rank`` and
    ``engine.world_size`` say where this script runs; ``engine.process`` which logical
    process of the plan this rank runs (``engine.plan().local(engine.process)``).

    ``plan`` (a path; default: ``distgraph run --plan PATH``'s) makes the training plan
    from a plan file (``plan.save(path)``, ``distgraph plan SCRIPT --save PATH``) without
    any search: the file is read and checked whole when the Engine is made, and checked to
    have been made for this program, cluster and world size when it plans; the file's
    Strategy is the Engine's (the runtime-only options given, ``profile``,
    ``check_finite``, ``memory_check`` and ``seed``, kept). Evaluation and prediction
    programs, which the file does not hold, are planned under that Strategy. Rank 0 says
    which file it runs and that nothing was searched; ``engine.plan_file`` is its path
    (None: the Engine plans).

    ``ensure``, ``planned_key``, ``world``, ``warn``, ``plan_request``, ``page_request``
    and ``launch_cluster`` are what its loops (:class:`~distgraph.app.loops.Loops`, made with
    the plan cache and the held state) ask of the Engine: public to the package, not
    needed by a training script.
    """

    def __init__(self, model, loss=None, optimizer=None, metrics=None, cluster=None,
                 strategy: Strategy | None = None, communicator=None, rank_mapping=None,
                 plan=None):
        self.model, self.loss, self.optimizer = model, loss, optimizer
        self.metrics = as_metrics(metrics)
        if self.metrics and loss is None:
            raise DistGraphError("metrics are computed by evaluate(), which needs a loss: "
                                 "give the Engine a loss too")
        self._launch = launch_context()    # what distgraph run / plan asked of this script
        self.cluster = cluster if cluster is not None else self.launch_cluster()
        self.rank_mapping = rank_mapping
        self.strategy = strategy or Strategy()
        self.stop_training = False
        self._comm = communicator
        path = plan if plan is not None else self._launch.plan_file
        self.plan_file = None if path is None else str(path)
        self._plan_file = None if path is None else read_plan_file(path)  # checked whole
        if self._plan_file is not None:
            try:
                self.strategy = _file_strategy(self._plan_file, strategy)
            except DistGraphError as e:
                if self._launch.plan is not None:      # distgraph run --plan's check says it
                    plan_report.write_failure(e, self._launch.plan)
                raise
            if self.world_size > 1:          # in a job: one of its size
                self._plan_file.check_world(self.world_size)
        self._plans = PlanCache()
        self._held = HeldState(model, optimizer)
        self._loops = Loops(self, self._plans, self._held)
        self._warned: set = set()          # warnings this Engine printed already

    @property
    def global_step(self) -> int:
        """Optimizer steps taken by this Engine (restored by ``load``)."""
        return self._loops.step

    @property
    def epoch(self) -> int:
        """Epochs this Engine's training has finished (restored by ``load``): ``fit``'s
        ``epochs`` is the total to reach, so ``fit(epochs=engine.epoch + 1)`` trains one
        more."""
        return self._loops.position[0]

    @property
    def rank(self) -> int:
        """This script's rank in the job: 0 to ``world_size - 1`` (0 when it runs alone).
        A rank is a running process of the job; which part of the plan it runs is
        :attr:`process`."""
        if self._comm is not None:
            return self._comm.rank
        return get_rank()

    @property
    def world_size(self) -> int:
        """How many ranks the job has (``distgraph run -n N``: N; 1 when it runs alone)."""
        if self._comm is not None:
            return self._comm.size
        return get_world_size()

    @property
    def process(self) -> int:
        """The logical process of the current plan (training's, else evaluation's or
        prediction's) that this rank runs: ``engine.plan().local(engine.process)`` is its
        program. Process ids are the ProcessMesh's; with a cluster the rank mapper may run
        process p on another rank than p."""
        for mode in MODES:
            p = self._plans.plan(mode)
            if p is not None:
                return p.ranks.process(self.rank) if p.distributed else 0
        raise DistGraphError("no plan yet: call fit(), evaluate(), predict() or prepare() "
                             "first")

    # -- what the loops ask of the Engine ---------------------------------------------------
    def warn(self, text: str, this_rank: bool = False) -> None:
        """One line on rank 0's stderr, once per Engine; ``this_rank``: a line about this
        rank alone (its measured memory), printed by this rank whichever it is."""
        if text in self._warned:
            return
        self._warned.add(text)
        if this_rank or self.rank == 0:
            print(f"distgraph: warning: {text}", file=sys.stderr, flush=True)

    # -- planning -------------------------------------------------------------------------------
    def prepare(self, inputs_spec, labels_spec=(), mode="train"):
        """Build and plan the program for ``mode``; returns the Plan. Needs no running job:
        only running needs as many ranks as the plan has processes. Called by the script,
        it plans on the rank that calls it; ``fit``, ``evaluate`` and ``predict`` plan what
        they run themselves, the search on rank 0 only (:meth:`_planned`)."""
        mode = as_mode(mode)
        inputs_spec, labels_spec = list(inputs_spec), list(labels_spec)
        s = self.strategy
        built = build_program(self.model, inputs_spec, labels_spec, self.loss,
                              self.optimizer if mode is Mode.TRAIN else None, mode.value,
                              amp=s.amp, loss_scale=s.loss_scale,
                              loss_scale_window=s.loss_scale_window,
                              context_parallel=s.context_parallel,
                              micro_batches=s.micro_batches)
        shared = False
        try:
            if self._plan_file is not None and mode is Mode.TRAIN and \
                    self._launch.plan is not None and self._launch.plan.check:
                # distgraph run --plan, before any rank starts: the file fits this script,
                # and its plan is made whole (no rank's program compiled): what the
                # ranks would refuse is refused here
                self._plan_file.check_program(built)
                self._plan_file.check_cluster(self._file_cluster())
                load_plan(self._plan_file, built, self._file_cluster(), ranks=(),
                          world_size=self._plan_file.world_size)
                plan_report.write_checked(self._launch.plan)
                raise plan_report.PlanReported()
            if self._plan_file is not None and mode is Mode.TRAIN:
                # the file's plan, made again without search; checked to be this program's
                planned = load_plan(self._plan_file, built, self._file_cluster(),
                                    ranks=(self.rank,), world_size=self.world_size
                                    if self.world_size > 1 else None)
                if self.rank == 0:
                    print(f"distgraph: running the plan in {self.plan_file} "
                          f"({_outline(planned)}): read from the file, nothing searched",
                          flush=True)
            else:
                planned, shared = self._planned(built)
        except DistGraphError as e:
            if self._launch.plan is not None:      # distgraph plan shows why
                plan_report.write_failure(e, self._launch.plan)
            raise
        self._plans.add(self._key(mode, inputs_spec, labels_spec), planned,
                        (inputs_spec, labels_spec), shared)
        return planned

    def _planned(self, built) -> tuple:
        """(the Engine's plan of ``built``, whether rank 0's search made it), each rank
        compiling its own process's program.

        Where the search chooses the plan of a job of several ranks, inside a collective
        call (``fit``, ``evaluate``, ``predict``), rank 0 searches and sends the plan's
        decisions (its plan file's text, :mod:`distgraph.plan.file`) to the others, which
        make the plan from them without searching, as from a file: the search's time
        limits are wall-clock, so ranks searching alike on loaded machines could choose
        different plans, and the job's CPUs pay for one search, not one per rank. An
        error of rank 0's planning is raised on every rank. Elsewhere (``prepare`` called
        by the script, which needs no running job; a plan of the user's annotations,
        which searches nothing) every rank plans alike."""
        cluster = self._planning_cluster()
        comm = self._comm
        if not (self.strategy.auto_mode == "full" and comm is not None and comm.size > 1
                and getattr(comm, "phase", "")):
            return plan(built, self.strategy, cluster, self.rank_mapping,
                        ranks=(self.rank,)), False
        if self.rank == 0:
            try:
                planned = plan(built, self.strategy, cluster, self.rank_mapping, ranks=(0,))
            except Exception as e:
                comm.broadcast_bytes(b"E" + _portable(e), timeout=PLAN_TIMEOUT)
                raise
            comm.broadcast_bytes(b"P" + plan_text(planned).encode(), timeout=PLAN_TIMEOUT)
            return planned, True
        got = comm.broadcast_bytes(None, timeout=PLAN_TIMEOUT)
        if got[:1] == b"E":
            raise pickle.loads(got[1:])
        return load_plan(plan_from_text(got[1:].decode(), "(the plan rank 0 searched)"),
                         built, cluster, ranks=(self.rank,)), True

    def _key(self, mode, inputs_spec, labels_spec) -> tuple:
        return program_key(mode, inputs_spec, labels_spec, self.model, self.optimizer,
                           self.strategy)

    def planned_key(self, mode, inputs_spec, labels_spec) -> tuple:
        """The key of ``mode``'s program for these feeds, planned now if it was not yet."""
        key = self._key(mode, inputs_spec, labels_spec)
        if self._plans.get(key) is None:
            self.prepare(inputs_spec, labels_spec, mode)
        return key

    def _planning_cluster(self):
        """The Engine's cluster (given, or the launch context's); for the automatic search
        without one, this machine as the job's ranks (``Cluster.local``: the
        communicator's size, or the MPI launcher's)."""
        if self.cluster is not None or self.strategy.auto_mode != "full":
            return self.cluster
        return Cluster.local(self.world_size)

    def _file_cluster(self):
        """The cluster a plan file's plan is made on: the Engine's, else this machine as
        the file's processes where the file was made for a cluster (the automatic search
        plans on ``Cluster.local``), else none."""
        if self.cluster is not None or self._plan_file.cluster is None:
            return self.cluster
        return Cluster.local(self._plan_file.world_size)

    def launch_cluster(self):
        """The Cluster of the launch context (``distgraph run/plan --cluster FILE``), or
        None."""
        path = self._launch.cluster
        return Cluster.from_file(path) if path else None

    @property
    def plan_request(self):
        """What ``distgraph plan`` asked of this script (a
        :class:`~distgraph.runtime.launch.context.PlanRequest`), or None outside it."""
        return self._launch.plan

    @property
    def page_request(self):
        """Where ``distgraph run --report PAGE`` asked rank 0 to write the training plan's
        page, or None."""
        return self._launch.report

    def world(self):
        """The job's communicator: the one given, else MPI's world (this script runs under
        ``distgraph run`` or mpiexec), made when first needed."""
        if self._comm is None:
            from distgraph.runtime.comm.mpi import MPICommunicator   # MPI starts here
            self._comm = MPICommunicator()
        return self._comm

    def ensure(self, mode, inputs_spec, labels_spec) -> tuple:
        """(Planned, runner, scope) of ``mode`` for these feeds: planned once per program
        key, its runner made once, the held values laid out for it."""
        planned = self._plans.activate(self.planned_key(mode, inputs_spec, labels_spec))
        runner = self._plans.runner(mode, self.world)
        if not planned.plan.distributed and self.world_size > 1:
            self._warn_unsplit(mode)
        if self.world_size > 1:
            for text in idle_options(planned.plan):
                self.warn(text)
        return planned, runner, self._held.bind(planned.plan, runner, self._comm)

    def _warn_unsplit(self, mode) -> None:
        verb = {Mode.TRAIN: "trains on", Mode.EVAL: "evaluates", Mode.PREDICT: "predicts"}
        self.warn(f"the model has no annotation, so each of the {self.world_size} ranks "
                  f"{verb[mode]} the whole batch (the same work {self.world_size} times); "
                  f"split the batch with dg.shard_dataloader(dataset, mesh, "
                  f"shard_dims=\"dp\") or annotate the model with dg.shard_tensor")

    # -- running ------------------------------------------------------------------------------
    @checks.collective("Engine.fit()", alike=("train_data", "batch_size", "epochs",
                                              "steps_per_epoch", "valid_data", "shuffle",
                                              "drop_last", "input_keys"))
    def fit(self, train_data, batch_size=1, epochs=1, steps_per_epoch=None, valid_data=None,
            shuffle=False, verbose=1, callbacks=None, drop_last=False,
            input_keys=None) -> History:
        """Train until the Engine has trained ``epochs`` epochs in all (of at most
        ``steps_per_epoch`` batches each); every rank returns the same History of global
        losses.

        ``epochs`` is a total over the Engine's life, as after ``load``: a fit starts
        where training stopped (the last fit's position, or the checkpoint's; an epoch
        stopped inside is finished first), so a fresh Engine's ``fit(epochs=3)`` trains
        epochs 0, 1, 2, a later ``fit(epochs=5)`` epochs 3 and 4 (with their own shuffle
        orders, the learning-rate schedule going on), and a later ``fit(epochs=3)``
        trains nothing: it says so in one line (rank 0) and returns an empty History.
        ``fit(epochs=engine.epoch + 1)`` trains one more.

        ``callbacks``: ``dg.callbacks`` objects; ``verbose`` 1 shows a progress bar
        (rank 0), 2 a line per epoch, 0 nothing. A
        short last batch trains on a plan of its own unless ``drop_last``; every batch
        shape (``valid_data``'s too) is planned before the first step, so one that the
        data-parallel split cannot divide stops the call then, saying how to fix it. A
        dataset whose length changes between epochs is followed: each epoch reads every
        sample it has when the epoch starts (said in one line, its shapes planned then).

        ``input_keys``: for a dataset whose samples are dicts (a Hugging Face
        ``datasets.Dataset``, a list of dicts), the keys of the fields to feed, in order:
        the model's inputs, then the label (``valid_data`` is read with the training
        data's, unless it is a shard_dataloader of its own). It is
        given here for a dataset fed as it is, or to ``dg.shard_dataloader(...,
        input_keys=...)`` (Paddle's place) for one split over a mesh; both are the same
        (a resumed fit needs the same keys)::

            engine.fit(hf_dataset.with_format("numpy"), batch_size=8,
                       input_keys=["input_ids", "labels"])"""
        return self._loops.fit(train_data, batch_size, epochs, steps_per_epoch, valid_data,
                               shuffle, verbose, callbacks, drop_last, input_keys)

    @checks.collective("Engine.evaluate()", alike=("valid_data", "batch_size", "drop_last",
                                                   "input_keys"))
    def evaluate(self, valid_data, batch_size=1, metrics=None, drop_last=False,
                 verbose=1, input_keys=None) -> dict:
        """{"loss": mean loss over the samples, <metric name>: value, ...}; ``metrics``
        (default: the Engine's) see the global outputs and labels of every batch.
        ``verbose`` as in ``fit``: 1 a progress bar (rank 0), 2 one line, 0 nothing.
        ``input_keys`` as in ``fit``, for dict samples."""
        return self._loops.evaluate(valid_data, batch_size, metrics, drop_last, verbose,
                                    input_keys)

    @checks.collective("Engine.predict()", alike=("test_data", "batch_size", "drop_last",
                                                  "input_keys"))
    def predict(self, test_data, batch_size=1, drop_last=False, input_keys=None) -> list:
        """The model's outputs, per batch: ``out[b]`` is the list of the outputs of batch
        ``b`` (global arrays, on every rank), so for a model of one output (a GPT's or a
        Llama's logits [batch, seq, vocab]) ``out[b][0]`` holds batch ``b``'s, and
        ``np.concatenate([o[0] for o in out])`` every sample's in dataset order.

        Samples may hold the label after the inputs, as ``fit`` takes them: it is not
        fed. Which fields are labels: those the Engine's training (or evaluation)
        program takes as labels, else, before any, a trailing field past the inputs the
        model's forward can take (a GPT's ``forward(idx)`` predicting (tokens, labels)
        samples: the labels are dropped, as Keras does). ``input_keys`` as in ``fit``,
        for dict samples (the label's key may be left out)."""
        return self._loops.predict(test_data, batch_size, drop_last, input_keys)

    # -- state -------------------------------------------------------------------------------
    @checks.collective("Engine.state_dict()")
    def state_dict(self) -> dict:
        """Global numpy arrays of every parameter, on every rank (a collective when
        distributed: call it on all ranks)."""
        self._held.publish()
        return {n: p.numpy() for n, p in self.model.named_parameters()}

    @checks.collective("Engine.optimizer_state_dict()")
    def optimizer_state_dict(self) -> dict:
        """Global numpy arrays of every optimizer state (``fc1.weight@MOMENT1``,
        ``optimizer@STEP``, ...), on every rank (collective, like ``state_dict``)."""
        _, states = self._held.publish()
        return {n: np.array(a) for n, a in states.items()}

    @checks.collective("Engine.save()", alike=("path",))
    def save(self, path) -> None:
        """Write a checkpoint directory: every parameter and optimizer state (each rank
        writes its own shards), the training position, the optimizer's settings and
        learning-rate schedule, and the random state. Collective: call it on every rank.
        Atomic: a job killed while saving leaves the previous checkpoint at ``path``.
        Each file is written with its crc32, checked when loaded. A directory that another
        job is saving into is refused (CheckpointError naming that job)."""
        entries = []
        params = {n for n, _ in self.model.named_parameters()}
        for name, layout, local in self._held.entries():
            kind = "parameter" if name in params else "optimizer"
            if layout is None:
                entries.append(checkpoint.Entry(name, tuple(local.shape), str(local.dtype),
                                                kind, local=local))
            else:
                entries.append(checkpoint.Entry(
                    name, layout.logical, layout.dtype, kind, layout.attr, layout.plan.ranks,
                    local, layout.shape if layout.shape != layout.logical else None))
        if any(p.distributed for p in self._plans.plans().values()):
            self.world()
        checkpoint.save(path, entries, checkpoint_info(self), self._comm)
        if self._launch.restart is not None and self.rank == 0:
            # an elastic launcher grows the job from a complete checkpoint (the README's
            # "Elastic training"): tell it which step this one holds
            write_status("checkpoint", str(self.global_step))

    @checks.collective("Engine.save_pretrained()", alike=("path",))
    def save_pretrained(self, path, dtype: str | None = None, max_shard_size="5GB") -> None:
        """Write the trained weights as a Hugging Face checkpoint folder (``config.json``
        and safetensors, sharded above ``max_shard_size``) that transformers'
        ``from_pretrained`` loads: gathered from their shards, cast to ``dtype`` (default:
        the checkpoint's the model came from; :mod:`distgraph.app.pretrained`). Collective:
        every rank gathers, rank 0 writes, and every rank returns once it wrote (or
        raises what went wrong)."""
        pretrained.check_savable(self.model)          # on every rank, before gathering
        state = self.state_dict()
        failure = None
        if self.rank == 0:
            try:
                pretrained.save_pretrained(self.model, path, state=state, dtype=dtype,
                                           max_shard_size=max_shard_size)
            except Exception as e:             # every rank raises it, none waits
                failure = e
        if self.world_size > 1 and any(p.distributed for p in self._plans.plans().values()):
            world = self.world()
            failed = world.all_reduce(np.array([float(failure is not None)]),
                                      list(range(world.size)), op="max")
            if failed[0] and failure is None:
                raise DistGraphError(f"rank {self.rank}: rank 0 could not write the "
                                     f"checkpoint {path}; its log says why")
        if failure is not None:
            raise failure

    @property
    def elastic_restart(self) -> int | None:
        """In an elastic job (``distgraph run --elastic``): which start of the script this
        is, 0 the first, k after the k-th failure; None outside one."""
        return self._launch.restart

    @checks.collective("Engine.resume()", alike=("path",))
    def resume(self, path) -> str | None:
        """Load the newest checkpoint at ``path`` (a folder, or a path with ``{step}`` /
        ``{epoch}``) that verifies completely (every file whole, as its checksums say);
        the path loaded, or None. Each newer one skipped (damaged, or its save cut short)
        is named with the reason, in one line on rank 0. Collective like ``load``."""
        found, skipped = newest_checkpoint(path, self._comm)
        for verdict in skipped:
            if not (verdict.absent and "{" not in str(path)):
                self.warn(f"resume: skipped checkpoint {verdict.path}: {verdict}")
        if found is not None:
            self._load(found)
        return found

    @checks.collective("Engine.load()", alike=("path",))
    def load(self, path, strip_prefix: str = "", prefix: str = "") -> None:
        """Restore a checkpoint written by ``save`` under any plan: each process reads
        only its blocks when it next runs. Restores the step, the training position (the
        next ``fit(epochs=N)`` trains on from there until N epochs are done in all), the
        data order and the dropout seeds. The optimizer's settings stay the ones given to this Engine.
        Collective like ``save``: call it on every rank. Every file is checked against
        its checksum first (the ranks share the reading): a damaged checkpoint is one
        CheckpointError naming the file, and nothing of it is loaded.

        A checkpoint of the same model nested otherwise loads with its names renamed:
        ``strip_prefix="inner."`` drops that start of the checkpoint's names (saved
        from a wrapper layer whose ``inner`` is this model), ``prefix="inner."`` adds it
        (saved from the bare model, loaded into a wrapper)."""
        verdict = verify(path, self._comm)
        if verdict.absent:
            raise checkpoint.CheckpointError(str(verdict))
        if not verdict.ok:
            raise checkpoint.CheckpointError(
                f"checkpoint {verdict.path} is damaged, nothing of it was loaded: {verdict}. "
                f"Load an older checkpoint (engine.resume(\"ck/step-{{step}}\") takes the "
                f"newest one that is whole)")
        self._load(path, strip_prefix, prefix)

    def _load(self, path, strip_prefix: str = "", prefix: str = "") -> None:
        reader = CheckpointReader(path, strip_prefix=strip_prefix, prefix=prefix)
        if reader.meta["version"] < checkpoint.VERSION:
            self.warn(f"checkpoint {reader.path} was written before checkpoints had "
                      f"checksums (format version {reader.meta['version']}): loaded "
                      f"without checking its files; save it again to have them")
        check_checkpoint(self, reader)
        self._held.load(reader)
        restore_info(self, reader.info)
        train = self._plans.active(Mode.TRAIN)
        if train is not None:    # lay the values out for the training plan now (planned
            self.ensure(Mode.TRAIN, *train.specs)   # again if the dropout seeds changed)

    def timeline(self, mode="train"):
        """The timeline of the steps run so far in ``mode``, merged over every rank (a
        collective: call it on all ranks). Needs ``Strategy(profile=True)``; see
        :class:`distgraph.runtime.execution.timeline.Timeline` (``.events``, ``.memory``,
        ``.peak_memory()``, ``.save``, ``.plot``)."""
        if not self.strategy.profile:
            raise DistGraphError("no timeline was recorded: create the Engine with "
                                 "Strategy(profile=True)")
        runner = self._plans.ran(mode)
        if runner is None:
            raise DistGraphError(f"no {mode} step has run yet: call fit() first")
        return runner.timeline()

    def plan(self, mode="train"):
        """The Plan of ``mode`` (``.program``: the completed serial program with dist
        attributes; ``.local(pid)``: a process's program; ``.explain()``)."""
        p = self._plans.plan(mode)
        if p is None:
            raise DistGraphError(f"no {mode} program yet: call prepare() or fit() first")
        return p


# seconds the other ranks wait for rank 0's search (Engine._planned), as long as any
# planning takes: a rank 0 that fails or ends meanwhile ends the wait sooner
PLAN_TIMEOUT = 3600.0


def _portable(error: Exception) -> bytes:
    """``error`` pickled for the other ranks to raise as it is: itself where it pickles
    and unpickles, else a PlanError saying it."""
    try:
        payload = pickle.dumps(error)
        pickle.loads(payload)
        return payload
    except Exception:
        return pickle.dumps(PlanError(f"rank 0 could not plan: {type(error).__name__}: "
                                      f"{error}"))


# options that change how a plan runs, not the plan: kept from the Engine's Strategy
_RUNTIME_ONLY = ("profile", "check_finite", "memory_check", "seed")


def _file_strategy(saved, given: Strategy | None) -> Strategy:
    """The Strategy of a plan file's Engine: the file's, with ``given``'s runtime-only
    options. A planning option ``given`` sets otherwise than the file is an error (the
    file's plan runs as saved, never silently another); one it leaves to the search
    (None) takes the file's, the search's choice then."""
    if given is None:
        return saved.strategy
    for f in dataclasses.fields(Strategy):
        mine, theirs = getattr(given, f.name), getattr(saved.strategy, f.name)
        if f.name not in _RUNTIME_ONLY and mine is not None and mine != theirs:
            raise DistGraphError(
                f"the Engine's Strategy({f.name}={mine!r}) is not the plan file's "
                f"({f.name}={theirs!r}, {saved.path}): the file's plan runs as it was "
                f"saved; leave {f.name} out of the Strategy or plan again without the file")
    return dataclasses.replace(saved.strategy, **{k: getattr(given, k) for k in _RUNTIME_ONLY})


def _outline(plan) -> str:
    """A plan in a few words: processes, stages, micro-batches, the predicted step."""
    words = [f"{plan.world_size} process{'es' if plan.world_size != 1 else ''}",
             f"{len(plan.stages)} stage{'s' if len(plan.stages) != 1 else ''}",
             f"{plan.micro_batches} micro-batch{'es' if plan.micro_batches != 1 else ''}"]
    if plan.estimate is not None:
        words.append(f"predicted step {plan.estimate.step_time * 1e3:.3g} ms")
    return ", ".join(words)
