"""The Plan: everything decided about one built program, as a value the runtime reads.

The planner (:func:`distgraph.passes.plan`) makes it whole: the completed program
(``plan.program``; its Values and ops carry their ``dist_attr``), the logical processes
and the rank each runs on (``plan.ranks``), the stage meshes in data-flow order, each
process's local program (``plan.local(pid)``) and compiled program
(``plan.program_of(pid)``, :class:`~distgraph.plan.program.ProcessProgram`), the task
graph, the schedule (checked to complete before any rank starts), the devices, and the
estimate where one was made. Nothing in it is computed later: it holds no caches.

Example::

    p = dg.passes.plan(built, dg.Strategy(), cluster=None)
    print(p.explain())            # per stage: devices, layout, memory, time, MFU
    print(p.explain(full=True))   # every rank, reshard point (with bytes), parameter
    p.local(1).pretty()           # what process 1 runs
    p.schedule()                  # {0: [0F0, 0B0], 1: [...]}
"""

from __future__ import annotations

import copyreg
import dataclasses
import io
import json
import pickle
from dataclasses import dataclass, field
from types import MappingProxyType

from distgraph.errors import PlanError
from distgraph.ir import Operation
from distgraph.mesh import ProcessRanks
from distgraph.ops.meshslice import LocalMeshSlice
from distgraph.plan.accumulation import Accumulation
from distgraph.plan.devices import DeviceAssignment
from distgraph.plan.explain import memory_figures, model_flops, summary
from distgraph.plan.file import Decisions
from distgraph.plan.export import export
from distgraph.plan.kinds import collective_bytes
from distgraph.plan.listing import full_listing
from distgraph.plan.protocols import (BatchSplitLike, CheckpointIntervalLike, ClusterLike,
                                      EstimateLike, SearchReportLike)
from distgraph.plan.schedule import Schedule
from distgraph.plan.tasks import TaskGraph
from distgraph.program_builder import BuiltProgram
from distgraph.spmd.meshslice import SLICED, STATIONARY
from distgraph.strategy import Strategy
from distgraph.units import fmt_bytes

_EMPTY = MappingProxyType({})


def _view_reduced(view):
    return _view, (dict(view),)


def _view(items: dict) -> MappingProxyType:
    return MappingProxyType(items)


def _unpickled(data: bytes) -> "Plan":
    plan = object.__new__(Plan)
    plan.__dict__.update(pickle.loads(data))
    return plan


@dataclass(frozen=True)
class SlicedMatmul:
    """One matmul that runs as MeshSlice: its index in the program, op, local form (on
    its mesh's first process, a :class:`~distgraph.ops.meshslice.LocalMeshSlice`)."""

    index: int
    op: Operation
    local: LocalMeshSlice

    def __str__(self) -> str:
        op, lay = self.op, self.local
        k = lay.slices
        block = f", blocks of {lay.block(k)}" if k else ""
        return (f"#{self.index} {op.type} {op.layer or '(top level)'} ({op.role}): "
                f"{lay.dataflow} over ({lay.u}, {lay.v}) keeps "
                f"{STATIONARY[lay.dataflow]} in place, K={k if k else 'not chosen'} "
                f"(slices {SLICED[lay.dataflow]} of {lay.length}{block})")

    def to_dict(self) -> dict:
        return {"op": self.index, "layer": self.op.layer, "role": self.op.role,
                "dataflow": self.local.dataflow, "mesh_dims": [self.local.u, self.local.v],
                "slices": self.local.slices}


@dataclass(frozen=True, eq=False)
class Plan:
    """A planned program. ``built`` is a completed copy of the BuiltProgram given to the
    planner (same feed, output, loss and gradient names); ``distributed`` says whether it
    runs as an SPMD job (it carries annotations) or on one process; ``ranks`` (a
    :class:`~distgraph.mesh.ProcessRanks`) says which rank runs each logical process;
    ``stages`` are the meshes of the forward program in data-flow order; ``cluster`` the
    cluster it was planned on (None: this machine); ``estimate`` is the cost model's
    estimate, where one was made; ``checkpoint`` the checkpoint interval proposed under
    ``Strategy(mtbf_hours=...)``, else None; ``search`` the report of the automatic
    search, else None; ``batch_split`` the rows of a global batch each process reads
    under ``Strategy(balance=True)``, else None; ``devices`` each rank's device, hence
    the array backend and each group's communicator
    (:class:`~distgraph.plan.devices.DeviceAssignment`). Those five made above the
    contract (by the resources and the planner) are typed with what is read of them,
    the Protocols of :mod:`distgraph.plan.protocols`.

    ``groups`` are the processes alike up to their coordinates (on the same meshes);
    ``locals`` holds the local program of one process of each group and of every
    process compiled, ``programs`` the compiled program of every process the planner
    was asked for (all, unless it was given ``ranks``). ``micro_batch_counts`` the
    micro-batches each process runs where an uneven split gives them their own;
    ``row_gathers`` how fetched per-sample values come back in the batch's order under
    an uneven split (:class:`~distgraph.plan.program.RowGather`); ``sample_axes`` the
    dim that carries the samples of each Value, where the batch split needed them;
    ``sliced`` the matmuls that run as MeshSlice; ``savers`` what the search chose for the
    memory savers the strategy left to it (:class:`~distgraph.plan.savers.SaverChoice`);
    ``graph`` the task graph and ``order`` the schedule (None only while the planner
    builds them); ``decisions`` what the plan was made from, as :meth:`save` writes it
    (:class:`~distgraph.plan.file.Decisions`).

    With ``Strategy(micro_batches=M)``, M > 1, ``program`` is the *micro-batch* program
    and ``accumulation`` says how the step accumulates over the micro-batches
    (:class:`~distgraph.plan.accumulation.Accumulation`)."""

    built: BuiltProgram
    strategy: Strategy
    distributed: bool
    process_ids: tuple
    ranks: ProcessRanks
    stages: tuple
    cluster: ClusterLike | None = None
    estimate: EstimateLike | None = None
    checkpoint: CheckpointIntervalLike | None = None
    accumulation: Accumulation | None = None
    search: SearchReportLike | None = None
    batch_split: BatchSplitLike | None = None
    devices: DeviceAssignment | None = None
    groups: tuple = ()
    locals: MappingProxyType = field(default_factory=lambda: _EMPTY, repr=False)
    graph: TaskGraph | None = field(default=None, repr=False)
    order: Schedule | None = field(default=None, repr=False)
    programs: MappingProxyType = field(default_factory=lambda: _EMPTY, repr=False)
    micro_batch_counts: MappingProxyType = field(default_factory=lambda: _EMPTY, repr=False)
    row_gathers: MappingProxyType = field(default_factory=lambda: _EMPTY, repr=False)
    sample_axes: MappingProxyType | None = field(default=None, repr=False)
    sliced: tuple = ()
    savers: tuple = ()
    decisions: Decisions | None = field(default=None, repr=False)

    def __reduce__(self):
        """Pickled whole: its read-only mapping views (here and in the programs, task
        graph, schedule it holds), which pickle cannot copy, go as dicts and come back
        as views (a pickler of its own: nothing process-wide changes)."""
        buffer = io.BytesIO()
        pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.dispatch_table = {**copyreg.dispatch_table, MappingProxyType: _view_reduced}
        pickler.dump(dict(self.__dict__))
        return _unpickled, (buffer.getvalue(),)

    @property
    def program(self):
        """The completed serial program (forward, backward, update, with dist attrs)."""
        return self.built.program

    @property
    def world_size(self) -> int:
        return len(self.process_ids)

    @property
    def micro_batches(self) -> int:
        return 1 if self.accumulation is None else self.accumulation.micro_batches

    def micro_batches_of(self, process_id: int) -> int:
        """How many micro-batches ``process_id`` runs per step: the plan's count, or
        under an uneven split by micro-batches its own."""
        return self.micro_batch_counts.get(process_id, self.micro_batches)

    @property
    def rank_of(self):
        """{process: rank}, or None where process p runs on rank p."""
        mapping = self.ranks.mapping
        return None if mapping is None else MappingProxyType(mapping)

    @property
    def fetch(self) -> tuple:
        """The values a step brings to every process (the loss when training, the loss
        and the outputs when evaluating, the outputs when predicting)."""
        return self.graph.fetch

    def task_graph(self):
        """The per-process tasks and what flows between them
        (:class:`~distgraph.plan.tasks.TaskGraph`)."""
        return self.graph

    def schedule(self) -> dict:
        """{process id: [Action, ...]}: each process's compute actions in the order it
        runs them (``str(action)`` in torch.distributed.pipelining's notation, "0F3");
        without micro-batches one F and one B per stage. The update is not an action."""
        return self.order.as_dict()

    def group_of(self, process_id: int) -> tuple:
        """The group of ``process_id`` (see ``groups``)."""
        for group in self.groups:
            if process_id in group:
                return group
        raise PlanError(f"process {process_id} has no part in this plan (processes "
                        f"{list(self.process_ids)})")

    def local(self, process_id: int):
        """The local program of ``process_id``
        (:class:`~distgraph.plan.local.LocalProgram`)."""
        if process_id not in self.locals:
            self.group_of(process_id)
            raise PlanError(f"process {process_id}'s program was not compiled: this plan "
                            f"was made for processes {sorted(self.programs)} (an Engine "
                            f"compiles its own rank's); local_alike({process_id}) gives its "
                            f"ops and shapes, and dg.passes.plan(built, strategy, cluster) "
                            f"without ranks= every process's program")
        return self.locals[process_id]

    def local_alike(self, process_id: int):
        """The local program of ``process_id`` where it was compiled, else of the first
        process of its group: alike in ops, shapes and reshard points (what depends on
        the coordinates, such as an op's shard offsets, may differ)."""
        if process_id in self.locals:
            return self.locals[process_id]
        return self.locals[self.group_of(process_id)[0]]

    def program_of(self, process_id: int):
        """The compiled program of ``process_id``
        (:class:`~distgraph.plan.program.ProcessProgram`)."""
        if process_id not in self.programs:
            self.local(process_id)
            raise PlanError(f"process {process_id}'s program was not compiled")
        return self.programs[process_id]

    def representatives(self) -> list:
        """One local program per group: what every process of it does in kind."""
        return [self.locals[g[0]] for g in self.groups]

    def op_collectives(self) -> list:
        """The collectives ops run inside their kernels (``comm`` hooks: MoE's
        all-to-alls, a vocabulary-parallel loss's, context-parallel attention's, named
        with its form), once per group of processes alike:
        ``"moe_ffn (layers.0.mlp) over (0, 1): all_to_all n=2 sends 1 KiB"``."""
        out = []
        for local in self.representatives():
            ops = local.program.ops
            for index in sorted(local.op_comm):
                op, ctx = ops[index], local.op_context.get(index, {})
                where = f" over {tuple(ctx['group'])}" if ctx.get("group") else ""
                form = op.attrs.get("context_parallel")       # attention's: ring/ulysses
                name = f"{op.type} [{form}]" if form else op.type
                for kind, n, nbytes in local.op_comm[index]:
                    sent = collective_bytes(kind, n, nbytes)
                    out.append(f"{name} ({op.layer}){where}: {kind} n={n} sends "
                               f"{fmt_bytes(sent)}")
        return out

    def reshards(self) -> list:
        """Every reshard point of the plan once (in global order), whoever runs it (as
        the first process that runs it holds it)."""
        points: dict = {}
        for local in self.representatives():
            for point in local.points():
                points.setdefault(point.seq, point)
        return [points[s] for s in sorted(points)]

    def bytes_sent(self) -> dict:
        """Bytes each process sends per step: {process id: {kind: bytes}} (with
        micro-batches, a micro-batch's reshards once per micro-batch)."""
        rep = {q: g[0] for g in self.groups for q in g}
        return {pid: self.graph.step_bytes(self.locals[rep[pid]], pid,
                                           self.micro_batches_of(pid))
                for pid in self.process_ids}

    # -- printing ---------------------------------------------------------------------------
    def explain(self, full: bool = False, estimate=None, cluster=None) -> str:
        """The plan in words. By default a summary that stays small whatever the process
        count (:mod:`distgraph.plan.explain`): a first line with the processes, stages,
        micro-batches, schedule and whether the plan fits its devices; per stage its
        mesh, processes and devices as ranges, layout, layers, a line per group of alike
        processes (peak memory against the device's, compute and communication per
        step), model TFLOP/s per device and MFU; then the predicted step time, the
        plan's TFLOP/s and MFU, and the reshards, collectives and search summarised.
        Model FLOPs are the forward, loss and backward ops' FLOPs from the op registry
        (times the micro-batches), recomputation's copies not counted (:func:`~distgraph.
        plan.explain.model_flops`). ``full=True``: the full listing instead, every rank,
        reshard point, parameter, the schedule and each process's estimate
        (:mod:`distgraph.plan.listing`). ``estimate`` / ``cluster``: those to use where
        the plan has none (``distgraph plan`` prices plans made without an estimate)."""
        if full:
            return full_listing(self, estimate)
        return summary(self, estimate, cluster)

    def model_flops(self) -> float:
        """FLOPs of one training step the model does: the forward, loss and backward ops'
        (op registry, global shapes, times the micro-batches), not the update's, not
        recomputation's copies (:func:`~distgraph.plan.explain.model_flops`)."""
        return sum(model_flops(self).values())

    def to_dict(self) -> dict:
        """The plan as plain data (what :meth:`to_json` writes); ``memory``: the bytes of
        the largest peak, of what its device may hold and of its memory
        (:func:`~distgraph.plan.explain.memory_figures`)."""
        prog = self.program
        out = {
            "distributed": self.distributed,
            "processes": list(self.process_ids),
            "rank_of": None if self.rank_of is None else
            {str(p): r for p, r in sorted(self.rank_of.items())},
            "schedule": {str(pid): [str(a) for a in acts]
                         for pid, acts in self.schedule().items()},
            "stages": [m.to_dict() for m in self.stages],
            "strategy": dataclasses.asdict(self.strategy),
            "micro_batches": self.micro_batches,
            "accumulation": None if self.accumulation is None else
            {name: self.accumulation.mode(name) for name in self.accumulation.boundary},
            "parameters": {v.name: {"shape": list(v.shape), "dtype": v.dtype,
                                    "mesh": v.dist_attr.mesh.to_dict(),
                                    "spec": str(v.dist_attr.spec)}
                           for v in prog.parameters},
            "ops": [{"type": op.type, "layer": op.layer, "role": op.role,
                     "mesh": list(op.dist_attr.mesh.process_ids),
                     "inputs": [str(s) for s in op.dist_attr.input_specs],
                     "outputs": [str(s) for s in op.dist_attr.output_specs]}
                    for op in prog.ops],
            "reshards": [],
            "bytes_sent": {},
            "meshslice": [use.to_dict() for use in self.sliced],
            "savers": [c.to_dict() for c in self.savers],
            "memory": memory_figures(self),
        }
        if self.distributed:
            out["reshards"] = [{"value": p.value, "src": str(p.src), "dst": str(p.dst),
                                "steps": [str(s) for s in p.steps], "bytes": p.bytes}
                               for p in self.reshards()]
            out["bytes_sent"] = {str(pid): kinds for pid, kinds in self.bytes_sent().items()}
        for name in ("devices", "estimate", "checkpoint", "search", "batch_split"):
            value = getattr(self, name)
            if value is not None:
                out["placement" if name == "devices" else name] = value.to_dict()
        return out

    def export(self, target: str):
        """This plan as ``target``'s configuration: "torchtitan" gives a dict (its
        ParallelismConfig fields, activation-checkpoint mode, batch sizes), "megatron" an
        argv list of Megatron-LM's arguments; DistGraphError saying what the framework
        cannot express (:mod:`distgraph.plan.export`)."""
        return export(self, target)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, path) -> None:
        """Write the plan's decisions and what they were made for (the program, the
        cluster, the world size) to ``path`` as a versioned JSON plan file
        (:mod:`distgraph.plan.file`); ``dg.Engine(..., plan=path)`` and
        ``distgraph run --plan path`` make the same plan from it without searching."""
        from distgraph.plan.file import save

        save(self, path)

    def report(self, path, estimate=None, cluster=None, timeline=None) -> None:
        """Write the plan as one self-contained HTML page to ``path`` (styles, script and
        data inline; a browser opens it from disk): the cluster's resource graph with each
        stage's processes on their devices, the schedule as a timeline per stage at the
        estimate's seconds (and as measured: ``timeline``, a run's ``engine.timeline()``
        or the file ``Timeline.save`` wrote), memory per group of alike processes against
        the devices', each stage's step as compute, communication and bubble, TFLOP/s and
        MFU, the memory savers and their priced alternatives, the strategy and cluster
        (:mod:`distgraph.plan.report`). ``estimate`` / ``cluster``: those to show where
        the plan has none, as in :meth:`explain`."""
        from distgraph.plan.report import write_report    # here: a plan rarely reports

        write_report(self, path, estimate, cluster, timeline)

    def plot(self, path) -> None:
        """Draw the plan into ``path`` (PNG, SVG or PDF by its suffix): a column per
        stage with its mesh, the layers on it, how each weight is split per mesh dim, the
        reshards in each layer and between stages with their bytes. Needs matplotlib
        (``pip install 'distgraph[plot]'``); see :mod:`distgraph.plan.plot`."""
        from distgraph.plan.plot import plot_plan    # here: a plan rarely draws

        plot_plan(self, path)
