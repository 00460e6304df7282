"""Strategy: how the Engine parallelises and plans, as one frozen record."""

from __future__ import annotations

from dataclasses import dataclass

from distgraph.errors import DistGraphError
from distgraph.keywords import keywords_checked

SCHEDULES = ("1F1B", "FThenB", "ZB", "ZBV")
SEARCHES = ("ilp", "recursive", "auto")
AMP_DTYPES = ("bfloat16", "float16")
TARGETS = ("torchtitan", "megatron")


def _layers_recomputed(given) -> tuple:
    """``Strategy.recompute`` given per layer, as the Strategy holds it: a tuple whose
    entries are a layer path (its forward recomputed whole) or a pair (path,
    "selective") (its attention scores only); a pair (path, True) is held as the path,
    so that both spellings are one strategy. A tuple, not a dict: strategies are hashed,
    and the plan file writes it as a JSON list of strings and pairs."""
    entries = () if isinstance(given, str) or not hasattr(given, "__iter__") else tuple(given)
    held = []
    for entry in entries:
        if isinstance(entry, str) and entry:
            held.append(entry)
            continue
        pair = () if isinstance(entry, str) or not hasattr(entry, "__iter__") else tuple(entry)
        if len(pair) != 2 or not isinstance(pair[0], str) or not pair[0] or \
                not (pair[1] is True or pair[1] == "selective"):
            held = None
            break
        held.append(pair[0] if pair[1] is True else (pair[0], "selective"))
    if not held:
        raise DistGraphError(f"Strategy.recompute must be True/False, 'selective' or a list "
                             f"of layer paths, each alone (recomputed whole) or paired with "
                             f"its kind, such as ['blocks.0', ('blocks.1', 'selective')], got "
                             f"{given!r}")
    return tuple(held)


class _Unset:
    """The default of an option the search decides where the user leaves it: resolved by
    ``Strategy.__post_init__`` into the option's value (None, "searched", under
    ``auto_mode="full"``; the fixed default otherwise), so no Strategy holds it."""

    def __repr__(self) -> str:
        return "unset"


UNSET = _Unset()


@keywords_checked          # Strategy(auto_mod=...) names 'auto_mode'
@dataclass(frozen=True)
class Strategy:
    """``auto_mode``: "semi" completes from annotations; "full" searches the layouts
    (Alpa's intra-op ILP, within ``solver_time_limit`` seconds per search and
    ``memory_budget_gb`` per device; :mod:`distgraph.passes.search.layouts.intra_op`), and with
    ``pipeline=True`` the stages too (:mod:`distgraph.passes.search.stages.pipeline`). ``search``
    picks who chooses the layouts there: "ilp" (SCIP), "recursive" (the double-recursive
    search, linear in the graph: :mod:`distgraph.passes.search.layouts.recursive`) or "auto" (the
    recursive search prices what the stage DP compares, SCIP refines the chosen stages;
    the default, None, means "auto": ``search_method`` is the one in effect).
    ``micro_batches`` > 1 enables gradient accumulation / pipelining with ``schedule``
    (None, with ``auto_mode="full"`` and ``pipeline=True``: the stage search chooses it,
    :mod:`distgraph.passes.search.stages.micro`; left unset it is None there and 1
    elsewhere, a count given is kept)
    ("1F1B", "FThenB", "ZB" or "ZBV"); ``virtual_stages`` v > 1 cuts the forward into
    ``v`` chunks per stage mesh, chunk c on stage c mod S (interleaved 1F1B or zero
    bubble; "ZBV" places two chunks per stage in a V; with ``auto_mode="full"`` and
    ``pipeline=True`` it is the most the stage search may use: it chooses 1, 2, 4 ..
    up to v, and the plan's strategy names its choice); ``recompute`` frees the forward activations inside every
    ``TransformerBlock`` or Llama decoder layer (True) or inside the given layer paths (e.g.
    ``["blocks.0", "blocks.1.mlp"]``) and recomputes them in the backward pass, or
    ("selective") only each attention's scores, q k^T to softmax and dropout (Korthikanti
    et al. 2022; :func:`distgraph.passes.transforms.recompute.attention_cores`); per layer,
    a list entry may pair a path with its kind (``[("blocks.0", "selective"), "blocks.1"]``:
    block 0's scores, block 1 whole); None, the default under ``auto_mode="full"`` (False
    otherwise): the planner chooses among False, "selective" and True the plan of least
    estimated step time that fits (:func:`distgraph.passes.fitting.with_savers`), then,
    with stages, the stage search recomputes only on the stages that need it where that
    is faster (:mod:`distgraph.passes.search.stages.recompute_stages`; the plan's
    strategy names each layer);
    ``sharding`` splits optimizer states and updates over
    ``sharding_mesh_dim`` (ZeRO-style; under ``auto_mode="full"`` the default means the
    search's data-parallel dim); None, the default under ``auto_mode="full"`` (False
    otherwise): the planner chooses it by price, as it chooses recomputation
    (:func:`distgraph.passes.fitting.with_savers`), and the plan's strategy says what it
    chose (False where no data-parallel dim is left to shard over); ``profile`` records a timeline; ``check_finite``
    stops training with a RuntimeFault at a NaN or infinite loss (False: train on);
    ``seed`` seeds shuffling. ``memory_check``: each rank compares its measured peak
    bytes (the arrays the runtime holds, :mod:`distgraph.runtime.execution.memory`) with
    its process's figure in the plan's estimate and says once, naming where the peak
    was reached, when it exceeds it by more than 10 % (a plan without an estimate says
    that, once). ``meshslice`` lets every matmul run as MeshSlice where
    its operands are 2-D sharded (True: the cost model picks each one's number of
    slices K; a number: that K; :mod:`distgraph.passes.meshslice`); completion and the
    search (auto_mode="full") may then choose MeshSlice's layouts. ``balance`` splits the
    batch of a data-parallel plan over its groups in proportion to their speed, within
    each device's memory (rows, or whole micro-batches; :mod:`distgraph.passes.balance`,
    ``Plan.batch_split``); with ``auto_mode="full"`` the search prices data-parallel
    groups balanced. ``amp`` ("bfloat16" or "float16") computes the forward and backward
    in that precision with float32 master weights, gradients and optimizer states
    (:mod:`distgraph.optim.amp`); under "float16" the loss is scaled, from ``loss_scale``,
    halved after a step whose gradients overflow (that step is skipped) and doubled after
    ``loss_scale_window`` good steps in a row. ``sequence_parallel`` (Megatron-SP): with
    tensor parallelism, the norms, residual adds and dropout between the tensor-parallel
    regions run split over the sequence on the tensor-parallel mesh dim, their all-reduces
    becoming all-gathers and reduce-scatters
    (:mod:`distgraph.passes.transforms.sequence_parallel`; under ``auto_mode="full"`` on
    the searched layouts); None, the default under ``auto_mode="full"`` (False
    otherwise): the planner turns it on where the plan does not fit without it
    (``with_savers``: the search weighs splitting the light ops over the sequence
    itself). The planner
    (:func:`distgraph.passes.plan`) raises PlanError for an option that is not available
    yet: none is silently ignored. ``context_parallel`` ("ring" or "ulysses") is how
    attention runs where the sequence is split over a mesh dim (``shard_dataloader(...,
    sequence_dim=...)``); None: per attention op, the form that moves fewer bytes
    (:mod:`distgraph.ops.context_parallel`). ``target`` ("torchtitan" or "megatron";
    None: no restriction) keeps the automatic search (``auto_mode="full"``) to plans
    that framework runs, so that ``plan.export(target)`` gives its configuration
    (:mod:`distgraph.plan.styles`, :mod:`distgraph.plan.export`): every Linear weight
    split column- or row-wise over one tensor-parallel mesh dim, data parallel over the
    rest, stages of the same mesh shape holding the same number of blocks, no
    interleaving, a schedule the framework has. ``overlap`` (default True) hides
    communication behind compute: the gradients' reductions over data parallel start
    during the backward, a bucket of about ``bucket_mb`` MB at a time (PyTorch DDP's
    default, 25) as soon as its gradients are final, and are waited for in the update
    that reads them; under ZeRO-3 the next layer's parameter gathers start while the
    current layer computes (one layer ahead at most); the estimate prices what stays
    exposed (:mod:`distgraph.plan.buckets`; the layout search still prices the reductions
    as run after the backward). ``overlap=False`` runs every collective
    where it is issued, for measurement and debugging."""

    auto_mode: str = "semi"
    pipeline: bool = False
    schedule: str = "1F1B"
    micro_batches: int | None = UNSET
    recompute: bool | str | tuple | None = UNSET
    sharding: bool | None = UNSET
    sharding_mesh_dim: str = "dp"
    solver_time_limit: float = 60.0
    memory_budget_gb: float | None = None
    profile: bool = False
    check_finite: bool = True
    seed: int = 0
    virtual_stages: int = 1
    meshslice: bool | int = False
    balance: bool = False
    amp: str | None = None
    loss_scale: float = 2.0 ** 16
    loss_scale_window: int = 2000
    search: str | None = None
    mtbf_hours: float | None = None
    checkpoint_write_gbps: float = 1.0
    sequence_parallel: bool | None = UNSET
    context_parallel: str | None = None
    memory_check: bool = False
    target: str | None = None
    overlap: bool = True
    bucket_mb: float = 25.0

    @property
    def search_method(self) -> str:
        """The search in effect with auto_mode="full": ``search``, "auto" if left None."""
        return "auto" if self.search is None else self.search

    def __post_init__(self):
        full = self.auto_mode == "full"
        if self.micro_batches is UNSET:         # searched with the stages, else one
            object.__setattr__(self, "micro_batches", None if full and self.pipeline else 1)
        for saver in ("recompute", "sharding", "sequence_parallel"):
            if getattr(self, saver) is UNSET:   # searched under auto_mode="full"
                object.__setattr__(self, saver, None if full else False)
        if self.context_parallel not in (None, "ring", "ulysses"):
            raise DistGraphError(f"Strategy.context_parallel must be 'ring', 'ulysses' or None "
                                 f"(the cost model chooses per attention op), got "
                                 f"{self.context_parallel!r}")
        if self.target is not None and self.target not in TARGETS:
            raise DistGraphError(f"Strategy.target must be None or one of "
                                 f"{', '.join(map(repr, TARGETS))} (the framework whose "
                                 f"layouts the search keeps to), got {self.target!r}")
        if self.target is not None and self.auto_mode != "full":
            raise DistGraphError(f"Strategy.target={self.target!r} restricts the automatic "
                                 f"search: use it with auto_mode='full' (under 'semi' the "
                                 f"annotations decide; plan.export({self.target!r}) says "
                                 f"whether the plan is one {self.target} runs)")
        if self.auto_mode not in ("semi", "full"):
            raise DistGraphError(f"Strategy.auto_mode must be 'semi' or 'full', got {self.auto_mode!r}")
        if self.search is not None and self.search not in SEARCHES:
            raise DistGraphError(f"Strategy.search must be one of {', '.join(map(repr, SEARCHES))} "
                                 f"(who chooses the layouts with auto_mode='full'), got "
                                 f"{self.search!r}")
        if self.micro_batches is not None and not (isinstance(self.micro_batches, int)
                                                   and self.micro_batches >= 1):
            raise DistGraphError(f"Strategy.micro_batches must be an integer >= 1, or None (the "
                                 f"stage search chooses it), got {self.micro_batches!r}")
        if not isinstance(self.virtual_stages, int) or self.virtual_stages < 1:
            raise DistGraphError(f"Strategy.virtual_stages must be an integer >= 1, got "
                                 f"{self.virtual_stages!r}")
        if self.recompute is not None and not isinstance(self.recompute, bool) and \
                self.recompute != "selective":
            object.__setattr__(self, "recompute", _layers_recomputed(self.recompute))
        if not isinstance(self.meshslice, bool) and not (
                isinstance(self.meshslice, int) and self.meshslice >= 1):
            raise DistGraphError(f"Strategy.meshslice must be True/False or a number of "
                                 f"slices K >= 1, got {self.meshslice!r}")
        if self.amp is not None and self.amp not in AMP_DTYPES:
            raise DistGraphError(f"Strategy.amp must be None, 'bfloat16' or 'float16', got "
                                 f"{self.amp!r}")
        if not self.loss_scale > 0 or not (isinstance(self.loss_scale_window, int)
                                           and self.loss_scale_window >= 1):
            raise DistGraphError(f"Strategy.loss_scale must be > 0 and loss_scale_window an "
                                 f"integer >= 1, got {self.loss_scale!r} and "
                                 f"{self.loss_scale_window!r}")
        if self.amp != "float16" and (self.loss_scale != 2.0 ** 16
                                      or self.loss_scale_window != 2000):
            raise DistGraphError("Strategy.loss_scale and loss_scale_window scale the loss of "
                                 "float16 training: use them with amp='float16' (bfloat16 "
                                 "keeps float32's range and needs no scaling)")
        if (self.mtbf_hours is not None and not self.mtbf_hours > 0) or \
                not self.checkpoint_write_gbps > 0:
            raise DistGraphError(f"Strategy.mtbf_hours (the job's mean time between "
                                 f"failures) and checkpoint_write_gbps must be positive, got "
                                 f"{self.mtbf_hours!r} and {self.checkpoint_write_gbps!r}")
        if isinstance(self.bucket_mb, bool) or not isinstance(self.bucket_mb, (int, float)) \
                or not self.bucket_mb > 0:
            raise DistGraphError(f"Strategy.bucket_mb must be a positive number of MB (the "
                                 f"gradients reduced together while the backward runs; "
                                 f"PyTorch DDP's default is 25), got {self.bucket_mb!r}")
        for flag in ("sharding", "pipeline", "balance", "profile", "check_finite",
                     "memory_check", "overlap"):
            if flag == "sharding" and self.sharding is None:    # the search's to choose
                continue
            if not isinstance(getattr(self, flag), bool):
                raise DistGraphError(f"Strategy.{flag} must be True or False, got "
                                     f"{getattr(self, flag)!r}" + (
                                         " (ZeRO's stages: True shards the optimizer states "
                                         "and updates over sharding_mesh_dim; auto_mode="
                                         "'full' also weighs splitting the parameters; "
                                         "None: the search chooses)"
                                         if flag == "sharding" else ""))
        if self.sequence_parallel is not None and not isinstance(self.sequence_parallel, bool):
            raise DistGraphError(f"Strategy.sequence_parallel must be True, False or None "
                                 f"(the search chooses, auto_mode='full'), got "
                                 f"{self.sequence_parallel!r}")
        if self.schedule not in SCHEDULES:
            raise DistGraphError(f"Strategy.schedule must be one of {SCHEDULES}, got "
                                 f"{self.schedule!r}")
