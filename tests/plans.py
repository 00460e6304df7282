"""Parallel plans of an MLP and GPT-tiny for the SPMD tests, and the training loop that
runs them on any communicator (SimulatedWorld threads or MPI ranks) through the Engine.

A plan is a name, a process count and a function that annotates a freshly built model:
``shard_tensor`` on parameters, and hooks the models' ``forward`` consults to annotate
activations (``act``) or to run a part of the model under ``shard_op`` (``wrap``).
Training the same seed serially (no annotations) gives the oracle.

Example::

    model = build_model("gpt", seed=0)
    PLANS["gpt", "dp_tp", 4].annotate(model)
    losses, params = train(model, "gpt", comm, sharding=False)
"""

from __future__ import annotations

import threading
import tracemalloc
from dataclasses import dataclass
from typing import Callable

import numpy as np

import distgraph as dg

STEPS = 3
BATCH = 8
MLP_DIMS = dict(seq=4, d_in=8, hidden=16, d_out=4)
GPT_DIMS = dict(vocab_size=64, d_model=32, n_layer=2, n_head=4, max_seq_len=8)
LEARNING_RATE = 0.01

# Tracing keeps its builder stack in module state, so ranks that share one process
# (SimulatedWorld threads) must build their programs one at a time.
BUILD_LOCK = threading.Lock()


class Hooks:
    """Plan hooks: ``acts[where](value) -> value`` annotates an activation;
    ``wraps[where](fn) -> fn`` runs a part of the model under ``shard_op``."""

    def __init__(self):
        self.acts: dict = {}
        self.wraps: dict = {}

    def act(self, where: str, value):
        fn = self.acts.get(where)
        return value if fn is None else fn(value)

    def wrap(self, where: str, fn):
        w = self.wraps.get(where)
        return fn if w is None else w(fn)


class PlanMLP(dg.nn.Layer):
    """A token-wise MLP on [batch, seq, features]: fc1 -> relu -> fc2 (``layers`` = 2),
    or fc1 -> relu -> ... -> fc{layers}; part i (a layer and its relu) is ``stage{i}``,
    the activation after part 0 ``hidden``, after part i > 0 ``hidden{i}``."""

    def __init__(self, dims=None, layers: int = 2):
        super().__init__()
        dims = dims or MLP_DIMS
        widths = [dims["d_in"]] + [dims["hidden"]] * (layers - 1) + [dims["d_out"]]
        self.layers = layers
        for i in range(layers):
            setattr(self, f"fc{i + 1}", dg.nn.Linear(widths[i], widths[i + 1]))
        self.hooks = Hooks()

    def forward(self, x):
        h = self.hooks
        y = h.act("input", x)
        for i in range(self.layers - 1):
            fc = getattr(self, f"fc{i + 1}")
            y = h.wrap(f"stage{i}", lambda v, fc=fc: dg.ops.relu(fc(v)))(y)
            y = h.act("hidden" if i == 0 else f"hidden{i}", y)
        y = h.wrap(f"stage{self.layers - 1}", getattr(self, f"fc{self.layers}"))(y)
        return h.act("output", y)


class PlanGPT(dg.nn.GPT):
    """GPT-2 with the plan hooks between its parts (parameter names as ``dg.nn.GPT``)."""

    def __init__(self, dims=None, dropout: float = 0.0):
        super().__init__(**(dims or GPT_DIMS), dropout=dropout)
        self.hooks = Hooks()

    def forward(self, idx):
        h = self.hooks
        idx = h.act("input", idx)
        x = h.wrap("embed", self.embed)(idx)
        for i, block in enumerate(self.blocks):
            x = h.act("block_in", x)
            x = h.wrap(f"block{i}", block)(x)
        x = h.act("block_out", x)
        return h.wrap("head", self.head)(x)


def build_model(kind: str, seed: int = 0, dims=None, dropout: float = 0.0):
    """A fresh model of ``kind``: ``mlp`` (2 layers), ``mlp4`` / ``mlp8`` (4 / 8 layers,
    for 4 stages and for virtual stages), ``gpt`` (with ``dropout``) or ``gpt6`` (6 blocks,
    for virtual stages); ``dims`` overrides MLP_DIMS / GPT_DIMS (benchmarks)."""
    dg.seed(seed)
    if kind.startswith("mlp"):
        return PlanMLP(dims, int(kind[3:] or 2))
    if kind == "gpt6":
        return PlanGPT({**(dims or GPT_DIMS), "n_layer": 6}, dropout)
    return PlanGPT(dims, dropout)


def loss_fn(kind: str):
    return dg.nn.MSELoss() if kind.startswith("mlp") else dg.nn.CrossEntropyLoss()


class Dataset:
    """STEPS batches of BATCH samples (or ``n`` samples of a model of ``dims``): (x, y) for
    the MLP, (tokens, next tokens) for GPT."""

    def __init__(self, kind: str, seed: int = 1, n: int | None = None, dims=None,
                 batch: int = BATCH):
        rng = np.random.default_rng(seed)
        n = STEPS * batch if n is None else n
        dtype = dg.get_default_dtype()
        if kind.startswith("mlp"):
            dims = dims or MLP_DIMS
            s = dims["seq"]
            self.fields = [rng.normal(size=(n, s, dims["d_in"])).astype(dtype),
                           rng.normal(size=(n, s, dims["d_out"])).astype(dtype)]
        else:
            dims = dims or GPT_DIMS
            t, v = dims["max_seq_len"], dims["vocab_size"]
            tokens = rng.integers(0, v, size=(n, t + 1))
            self.fields = [tokens[:, :-1].astype(np.int64), tokens[:, 1:].astype(np.int64)]

    def __len__(self):
        return len(self.fields[0])

    def __getitem__(self, i):
        return tuple(f[i] for f in self.fields)


class Tokens:
    """``n`` samples of (tokens [seq], the next tokens [seq]) over a vocabulary of ``vocab``:
    the small next-token dataset of the Engine, checkpoint and recompute tests."""

    def __init__(self, n=16, seed=0, seq=8, vocab=32):
        self.t = np.random.default_rng(seed).integers(0, vocab, size=(n, seq + 1))

    def __len__(self):
        return len(self.t)

    def __getitem__(self, i):
        return self.t[i, :-1].astype(np.int64), self.t[i, 1:].astype(np.int64)


class StopAndSave(dg.callbacks.Callback):
    """Saves a checkpoint to ``path`` after step ``stop_after`` and stops training there."""

    def __init__(self, path, stop_after: int):
        self.path, self.stop_after = path, stop_after

    def on_step_end(self, step, logs=None):
        if step + 1 == self.stop_after:
            self.engine.save(self.path)
            self.engine.stop_training = True


# ---- plans ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    """``annotate(model)`` marks a fresh model; ``sharding`` turns on ZeRO-style update
    sharding over ``dp`` (Strategy(sharding=True)); ``auto`` lets the search plan the
    unannotated model (Strategy(auto_mode="full") on ``Cluster.local(nprocs)``);
    ``sequence_parallel``: Strategy(sequence_parallel=True) (Megatron-SP); ``recompute``:
    Strategy(recompute=...)."""

    kind: str
    name: str
    nprocs: int
    annotate: Callable
    sharding: bool = False
    auto: bool = False
    sequence_parallel: bool = False
    recompute: object = False

    def __str__(self) -> str:
        return f"{self.kind}-{self.name}-n{self.nprocs}"


def _set_act(model, where, mesh, spec):
    model.hooks.acts[where] = lambda v: dg.shard_tensor(v, mesh, spec)


def _on_mesh(model, where, mesh):
    model.hooks.wraps[where] = lambda fn: dg.shard_op(fn, mesh)


def _batch_spec(kind, dim="dp"):
    return [dim, None, None] if kind.startswith("mlp") else [dim, None]


def _tensor_parallel(model, mesh, dim="mp"):
    """Megatron: column-split first matmuls, row-split second ones."""
    if isinstance(model, PlanMLP):
        dg.shard_tensor(model.fc1.weight, mesh, [None, dim])
        dg.shard_tensor(model.fc2.weight, mesh, [dim, None])
        return
    for block in model.blocks:
        dg.shard_tensor(block.attn.qkv.weight, mesh, [None, dim])
        dg.shard_tensor(block.attn.proj.weight, mesh, [dim, None])
        dg.shard_tensor(block.mlp.fc1.weight, mesh, [None, dim])
        dg.shard_tensor(block.mlp.fc2.weight, mesh, [dim, None])


class SlicedLinear(dg.nn.Layer):
    """A Linear's parameters (under its name) run under ``shard_op`` on a 2-D ``mesh``:
    input and output laid out [rows, ..., cols], the matmul as MeshSlice with ``slices``
    (True: K chosen by the cost model) — per-layer MeshSlice, as a user writes it."""

    def __init__(self, linear, mesh, slices=True):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.mesh, self.slices = mesh, slices

    def forward(self, x):
        rows, cols = self.mesh.dim_names
        spec = [rows] + [None] * (len(x.shape) - 2) + [cols]
        return dg.shard_op(self._linear, self.mesh, [spec], [spec], meshslice=self.slices)(x)

    def _linear(self, x):
        y = dg.ops.matmul(x, self.weight)
        return y + self.bias if self.bias is not None else y


def meshslice_plan(kind, n, slices=True):
    """2-D tensor parallelism on a 2 x (n/2) mesh (x, y): every weight of the FC layers
    split [x, y], the FC layers' activations [x, ..., y], their matmuls (forward and
    backward) as MeshSlice; the batch split over x."""
    def annotate(model):
        mesh = dg.ProcessMesh(np.arange(n).reshape(2, n // 2).tolist(), ["x", "y"])
        layers = [model] if isinstance(model, PlanMLP) else \
            [b.attn for b in model.blocks] + [b.mlp for b in model.blocks]
        for layer in layers:
            for name in ("fc1", "fc2", "qkv", "proj"):
                fc = getattr(layer, name, None)
                if fc is not None:
                    dg.shard_tensor(fc.weight, mesh, ["x", "y"])
                    setattr(layer, name, SlicedLinear(fc, mesh, slices))
        _set_act(model, "input", mesh, _batch_spec(kind, "x"))
    return annotate


def dp_plan(kind, n):
    def annotate(model):
        _set_act(model, "input", dg.ProcessMesh(list(range(n)), ["dp"]), _batch_spec(kind))
    return annotate


def tp_plan(kind, n):
    def annotate(model):
        _tensor_parallel(model, dg.ProcessMesh(list(range(n)), ["mp"]))
    return annotate


def dp_tp_plan(kind, n):
    assert n == 4

    def annotate(model):
        mesh = dg.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])
        _tensor_parallel(model, mesh)
        _set_act(model, "input", mesh, _batch_spec(kind))
    return annotate


def sp_plan(kind, n):
    """Activations split along the sequence between blocks (MLP: around each layer)."""
    def annotate(model):
        mesh = dg.ProcessMesh(list(range(n)), ["sp"])
        spec = [None, "sp", None]
        wheres = ("input", "hidden", "output") if kind == "mlp" else ("block_in", "block_out")
        for where in wheres:
            _set_act(model, where, mesh, spec)
    return annotate


def two_stage_plan(kind, n):
    """Stage 0 on the first half of the processes, stage 1 on the second half; each
    stage data-parallel over its processes (GPT: first half of the blocks in stage 0)."""
    half = n // 2

    def annotate(model):
        a = dg.ProcessMesh(list(range(half)), ["dp"])
        b = dg.ProcessMesh(list(range(half, n)), ["dp"])
        if kind == "mlp":
            _on_mesh(model, "stage0", a)
            _on_mesh(model, "stage1", b)
            _set_act(model, "input", a, _batch_spec(kind))
            _set_act(model, "hidden", b, _batch_spec(kind))
            return
        n_layer = len(model.blocks._items)
        _on_mesh(model, "embed", a)
        for i in range(n_layer):
            _on_mesh(model, f"block{i}", a if i < n_layer // 2 else b)
        _on_mesh(model, "head", b)
        _set_act(model, "input", a, _batch_spec(kind))
    return annotate


def four_stage_plan(kind, n):
    """Four stages, one process each: the MLP's four layers (``mlp4``), or GPT's embedding,
    block 0, block 1 and head."""
    assert n == 4
    meshes = [dg.ProcessMesh([p], ["dp"]) for p in range(4)]

    def annotate(model):
        if kind.startswith("mlp"):
            assert model.layers == 4, "four stages of the MLP need kind 'mlp4'"
            for i, mesh in enumerate(meshes):
                _on_mesh(model, f"stage{i}", mesh)
        else:
            assert len(model.blocks._items) == 2
            for where, mesh in zip(("embed", "block0", "block1", "head"), meshes):
                _on_mesh(model, where, mesh)
        _set_act(model, "input", meshes[0], _batch_spec(kind))
    return annotate


def two_stage_tp_plan(kind, n):
    """Two stages of two processes, each stage Megatron tensor parallel over its "mp"
    (its processes meet in collectives inside forward and backward)."""
    assert n == 4
    a, b = dg.ProcessMesh([0, 1], ["mp"]), dg.ProcessMesh([2, 3], ["mp"])

    def annotate(model):
        if kind.startswith("mlp"):
            dg.shard_tensor(model.fc1.weight, a, [None, "mp"])
            dg.shard_tensor(model.fc2.weight, b, [None, "mp"])
            _on_mesh(model, "stage0", a)
            _on_mesh(model, "stage1", b)
            return
        _on_mesh(model, "embed", a)
        for i, block in enumerate(model.blocks):
            mesh = a if i < len(model.blocks._items) // 2 else b
            _on_mesh(model, f"block{i}", mesh)
            dg.shard_tensor(block.attn.qkv.weight, mesh, [None, "mp"])
            dg.shard_tensor(block.attn.proj.weight, mesh, ["mp", None])
            dg.shard_tensor(block.mlp.fc1.weight, mesh, [None, "mp"])
            dg.shard_tensor(block.mlp.fc2.weight, mesh, ["mp", None])
        _on_mesh(model, "head", b)
    return annotate


def layered_plan(kind, n):
    """The model's parts in order over ``n`` one-process meshes, as evenly as they go:
    MLP layer i on mesh i n / layers; GPT's embedding on the first, block i on
    i n / blocks, the head on the last (for virtual stages, which cut them again)."""
    meshes = [dg.ProcessMesh([p], ["dp"]) for p in range(n)]

    def annotate(model):
        if isinstance(model, PlanMLP):
            for i in range(model.layers):
                _on_mesh(model, f"stage{i}", meshes[i * n // model.layers])
        else:
            blocks = len(model.blocks._items)
            _on_mesh(model, "embed", meshes[0])
            for i in range(blocks):
                _on_mesh(model, f"block{i}", meshes[i * n // blocks])
            _on_mesh(model, "head", meshes[-1])
        _set_act(model, "input", meshes[0], _batch_spec(kind))
    return annotate


# Which parameters each stage holds when only parameters are annotated: layer paths.
PARAM_STAGES = {
    ("gpt", 2): (("wte", "wpe", "blocks.0"), ("blocks.1", "ln_f", "lm_head")),
    ("gpt", 4): (("wte", "wpe"), ("blocks.0",), ("blocks.1",), ("ln_f", "lm_head")),
    ("mlp", 2): (("fc1",), ("fc2",)),
    ("mlp4", 4): (("fc1",), ("fc2",), ("fc3",), ("fc4",)),
    # enough layers for virtual stages on 4 stages (8 chunks)
    ("gpt6", 4): (("wte", "wpe", "blocks.0"), ("blocks.1", "blocks.2"), ("blocks.3", "blocks.4"),
                  ("blocks.5", "ln_f", "lm_head")),
    ("mlp8", 4): (("fc1", "fc2"), ("fc3", "fc4"), ("fc5", "fc6"), ("fc7", "fc8")),
}
# The kinds above that are there for virtual stages: one process per stage only.
VIRTUAL_KINDS = ("gpt6", "mlp8")
# Megatron inside a stage: column-split first Linears (weight and bias), row-split seconds.
_COLUMN = ("attn.qkv", "mlp.fc1", "fc1", "fc3")
_ROW = ("attn.proj", "mlp.fc2", "fc2", "fc4")


def param_stage_plan(kind, stages, inner=None):
    """The pipeline a newcomer writes: ``shard_tensor`` on every parameter, each stage's on
    its own mesh (``stages`` of them), nothing else placed; ``inner`` "dp" splits the input
    batch over each stage's two processes, "mp" splits each stage's Linears Megatron-style
    over its two processes (None: one process per stage). Ops without parameters (residual
    adds, activations, the loss) follow the data."""
    width = 1 if inner is None else 2
    meshes = [dg.ProcessMesh(list(range(s * width, (s + 1) * width)), [inner or "pp"])
              for s in range(stages)]

    def spec(name, shape):
        layer, _, leaf = name.rpartition(".")
        if inner == "mp" and layer.endswith(_COLUMN):
            return [None, "mp"] if leaf == "weight" else ["mp"]
        if inner == "mp" and layer.endswith(_ROW) and leaf == "weight":
            return ["mp", None]
        return [None] * len(shape)

    def annotate(model):
        for name, param in model.named_parameters():
            s = next(i for i, paths in enumerate(PARAM_STAGES[kind, stages])
                     if any(name.startswith(p + ".") for p in paths))
            dg.shard_tensor(param, meshes[s], spec(name, param.shape))
        if inner == "dp":
            _set_act(model, "input", meshes[0], _batch_spec(kind))
    return annotate


PLAN_FACTORIES = {
    "dp": (dp_plan, False),
    "tp": (tp_plan, False),
    "dp_tp": (dp_tp_plan, False),
    "sp": (sp_plan, False),
    "zero": (dp_plan, True),
    "zero_dp_tp": (dp_tp_plan, True),
    "two_stage": (two_stage_plan, False),
    "meshslice": (meshslice_plan, False),
}
FOUR_ONLY = ("dp_tp", "zero_dp_tp", "meshslice")

PIPELINE_FACTORIES = {"four_stage": four_stage_plan, "two_stage_tp": two_stage_tp_plan}

PLANS = {}
for _kind in ("mlp", "gpt"):
    for _n in (2, 4):
        for _name, (_factory, _sharding) in PLAN_FACTORIES.items():
            if _n == 2 and _name in FOUR_ONLY:
                continue
            PLANS[_kind, _name, _n] = Plan(_kind, _name, _n, _factory(_kind, _n), _sharding)

def _no_annotation(model):
    return None


# Megatron's tensor parallelism with Strategy(sequence_parallel=True)
# (tests/test_sequence_parallel.py): "tp_sp" on n ranks, "dp_tp_sp" on a 2 x 2 mesh.
SP_PLANS = {(_kind, "tp_sp", _n): Plan(_kind, "tp_sp", _n, tp_plan(_kind, _n),
                                       sequence_parallel=True)
            for _kind in ("gpt",) for _n in (2, 4)}
SP_PLANS["gpt", "dp_tp_sp", 4] = Plan("gpt", "dp_tp_sp", 4, dp_tp_plan("gpt", 4),
                                      sequence_parallel=True)

# Selective recomputation (Strategy(recompute="selective"), tests/test_memory_savers.py) on
# Megatron's tensor parallelism with sequence parallelism, and on a 2 x 2 dp x tp mesh.
RECOMPUTE_PLANS = {
    ("gpt", "tp_sp_selective", 4): Plan("gpt", "tp_sp_selective", 4, tp_plan("gpt", 4),
                                        sequence_parallel=True, recompute="selective"),
    ("gpt", "dp_tp_selective", 4): Plan("gpt", "dp_tp_selective", 4, dp_tp_plan("gpt", 4),
                                        recompute="selective")}

# The automatic search's plan of each model (tests/test_search_training.py).
AUTO_PLANS = {(_kind, "auto", _n): Plan(_kind, "auto", _n, _no_annotation, auto=True)
              for _kind in ("mlp", "gpt") for _n in (2, 4)}

# Plans only the pipeline tests run (more stages, tensor parallel stages, virtual stages).
PIPELINE_PLANS = {(_kind, _name, 4): Plan(_kind, _name, 4, PIPELINE_FACTORIES[_name](_kind, 4))
                  for _kind, _name in (("mlp4", "four_stage"), ("gpt", "four_stage"),
                                       ("mlp", "two_stage_tp"), ("gpt", "two_stage_tp"))}
PIPELINE_PLANS.update({(_kind, "layered", _n): Plan(_kind, "layered", _n,
                                                    layered_plan(_kind, _n))
                       for _kind, _n in (("mlp4", 2), ("gpt", 2), ("mlp8", 4), ("gpt6", 4))})
# Stages from parameter annotations alone: "param{S}" (one process per stage), "param{S}_dp"
# and "param{S}_mp" (two processes per stage).
for (_kind, _stages) in PARAM_STAGES:
    for _inner in (None,) if _kind in VIRTUAL_KINDS else (None, "dp", "mp"):
        _n = _stages * (1 if _inner is None else 2)
        _name = f"param{_stages}" + ("" if _inner is None else f"_{_inner}")
        PIPELINE_PLANS[_kind, _name, _n] = Plan(_kind, _name, _n,
                                                param_stage_plan(_kind, _stages, _inner))


# ---- training ---------------------------------------------------------------------------

def make_optimizer(name: str):
    if name == "adamw":
        return dg.optim.AdamW(LEARNING_RATE)
    if name == "sgd":
        return dg.optim.SGD(LEARNING_RATE, momentum=0.9)
    raise ValueError(f"unknown optimizer {name!r}")


def make_engine(model, kind, comm=None, sharding=False, optimizer="adamw", auto=False,
                sequence_parallel=False, recompute=False):
    strategy = dg.Strategy(sharding=sharding, auto_mode="full" if auto else "semi",
                           sequence_parallel=sequence_parallel, recompute=recompute)
    return dg.Engine(model, loss_fn(kind), make_optimizer(optimizer), strategy=strategy,
                     communicator=comm)


def prepare(engine, kind):
    """Build and plan (under the build lock, so threads may call it)."""
    ins, labels = dg.app.data.DataLoader(Dataset(kind), BATCH).specs(1)
    with BUILD_LOCK:
        engine.prepare(ins, labels)
    return engine


def train(model, kind, comm=None, sharding=False, optimizer="adamw", auto=False):
    """STEPS optimizer steps; (History.losses, global parameters) on this rank."""
    engine = prepare(make_engine(model, kind, comm, sharding, optimizer, auto), kind)
    history = engine.fit(Dataset(kind), batch_size=BATCH, epochs=1)
    return history.losses, engine.state_dict()


def traced_fit(engine, data, **fit):
    """``engine.fit(data, **fit)`` with ``tracemalloc`` tracing, so that its history's
    ``allocated`` holds each step's peak as the allocator handed it out."""
    tracemalloc.start()
    try:
        return engine.fit(data, **fit)
    finally:
        tracemalloc.stop()


def serial_reference(kind, seed=0, optimizer="adamw"):
    return train(build_model(kind, seed), kind, optimizer=optimizer)


def compare(result, reference, dtype) -> dict:
    """Largest errors of one rank's (losses, params) against the serial ones: absolute
    for float64, relative to the tensor's largest entry for float32."""
    losses, params = result
    ref_losses, ref_params = reference
    rel = dtype == "float32"

    def err(a, b):
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        scale = max(float(np.max(np.abs(b))), 1e-30) if rel else 1.0
        return float(np.max(np.abs(a - b))) / scale

    if sorted(params) != sorted(ref_params):
        raise AssertionError(f"parameters differ: {sorted(params)} vs {sorted(ref_params)}")
    return {"loss": max(err(a, b) for a, b in zip(losses, ref_losses)) if losses else np.inf,
            "param": max(err(params[k], ref_params[k]) for k in params),
            "worst_param": max(params, key=lambda k: err(params[k], ref_params[k])),
            "steps": len(losses)}


TOLERANCE = {"float64": 1e-10, "float32": 1e-5}


def vocab_parallel_head():
    """A Linear head of 256 classes column-split over mp of a 2 x 2 (dp, mp) mesh, the
    batch over dp, trained on cross-entropy with SGD: the built program of the
    vocab-parallel cross-entropy, whose kernel runs its own collectives over mp."""
    from distgraph.program_builder import build_program

    mesh = dg.ProcessMesh([[0, 1], [2, 3]], ["dp", "mp"])

    class Head(dg.nn.Layer):
        def __init__(self):
            super().__init__()
            self.fc = dg.nn.Linear(32, 256, bias=False)
            dg.shard_tensor(self.fc.weight, mesh, [None, "mp"])

        def forward(self, x):
            return self.fc(dg.shard_tensor(x, mesh, ["dp", None]))

    return build_program(Head(), [dg.InputSpec([8, 32], name="x")],
                         [dg.InputSpec([8], "int64", name="y")], dg.nn.CrossEntropyLoss(),
                         dg.optim.SGD(0.1))
