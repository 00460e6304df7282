"""Layouts of ``dg.parallelize`` for GPT, Llama and Mixtral (tests/test_parallelize.py and
tests/mpi_scripts/parallelize_layouts.py), the same layouts written with ``shard_tensor``
by hand, and the training loop that runs either on any communicator (None: serially).

A layout is a name, its ranks, the mesh, the config and the Strategy; ``train(kind,
layout, comm)`` builds the model of ``kind`` with the same seed, lays it out and trains
STEPS steps; the serial run (no layout) is the oracle. Pipelines run two micro-batches
(1F1B), which train as one batch does.

Example::

    losses, state = train(comm, "gpt", LAYOUTS["gpt", "dp_mp_megatron_z2"])
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

import distgraph as dg
from distgraph.nn.llama import LlamaConfig
from distgraph.nn.mixtral import MixtralConfig

BATCH, SEQ, STEPS = 8, 8, 2
CONFIGS = {
    "gpt": dict(vocab_size=64, d_model=32, n_layer=2, n_head=4, max_seq_len=SEQ),
    "llama": LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, rope_theta=500000.0,
                         initializer_range=0.2),
    "mixtral": MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=8,
                             num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                             initializer_range=0.2),
}
PIPELINE = dict(micro_batches=2, schedule="1F1B")
# tracing keeps its builder in module state: SimulatedWorld threads build one at a time
BUILD_LOCK = threading.Lock()


def build(kind: str):
    dg.seed(0)
    if kind == "gpt":
        return dg.nn.GPT(**CONFIGS[kind])
    return (dg.nn.Llama if kind == "llama" else dg.nn.Mixtral)(CONFIGS[kind])


class NextTokens:
    """``n`` random token sequences: sample i is (tokens, the next tokens)."""

    def __init__(self, kind: str, n: int = BATCH * STEPS):
        vocab = CONFIGS[kind]["vocab_size"] if kind == "gpt" else CONFIGS[kind].vocab_size
        self.ids = np.random.default_rng(1).integers(0, vocab, (n, SEQ + 1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return self.ids[i, :-1], self.ids[i, 1:]


def mesh(shape, dims) -> dg.ProcessMesh:
    return dg.ProcessMesh(np.arange(int(np.prod(shape))).reshape(shape).tolist(), dims)


@dataclass(frozen=True)
class Layout:
    """``config()`` gives parallelize's config (styles are made fresh); ``strategy``
    the Strategy's arguments."""

    name: str
    shape: tuple
    dims: tuple
    config: object
    strategy: dict = field(default_factory=dict)

    @property
    def ranks(self) -> int:
        return int(np.prod(self.shape))

    @property
    def mesh(self) -> dg.ProcessMesh:
        return mesh(self.shape, self.dims)


def _mp(plan, level=0, split=None):
    def config():
        out = {"mp_config": {"parallelize_plan": plan() if callable(plan) else plan}}
        if level:
            out["dp_config"] = {"sharding_level": level}
        if split is not None:
            out["pp_config"] = {"split_spec": split() if callable(split) else split}
        return out
    return config


def _dp(level):
    return lambda: {"dp_config": {"sharding_level": level}}


def _pp(split, level=0):
    def config():
        out = {"pp_config": {"split_spec": split() if callable(split) else split}}
        if level:
            out["dp_config"] = {"sharding_level": level}
        return out
    return config


def gpt_styles():
    """GPT's Megatron plan as Paddle's styles: the embedding's vocabulary and the head's
    classes split, the blocks' first Linears by columns, their second by rows."""
    return {"wte": dg.RowWiseParallel(), "lm_head": dg.ColWiseParallel(),
            "blocks.*.attn.qkv": dg.ColWiseParallel(), "blocks.*.attn.proj": dg.RowWiseParallel(),
            "blocks.*.mlp.fc1": dg.ColWiseParallel(), "blocks.*.mlp.fc2": dg.RowWiseParallel()}


def gpt_sequence_parallel():
    """The blocks' tensor parallelism with Megatron-SP between the regions, in Paddle's
    sequence-parallel styles: the embedding begins it, each norm runs on the sequence
    split, attention and MLP gather it and scatter it back, the head ends it."""
    plan = gpt_styles()
    plan.update({"drop": dg.SequenceParallelBegin(),      # the embedding's last layer
                 "blocks.*.ln*": dg.SequenceParallelEnable(),
                 "blocks.*.attn": dg.SequenceParallelDisable(),
                 "blocks.*.mlp": dg.SequenceParallelDisable(),
                 "ln_f": dg.SequenceParallelEnable(),
                 "lm_head": [dg.ColWiseParallel(), dg.SequenceParallelEnd()]})
    return plan


def llama_styles():
    """Llama's attention and MLP split as Megatron does (the key/value heads divide mp)."""
    return {"layers.*.self_attn.[qkv]_proj": dg.ColWiseParallel(),
            "layers.*.self_attn.o_proj": dg.RowWiseParallel(),
            "layers.*.mlp.gate_proj": dg.ColWiseParallel(),
            "layers.*.mlp.up_proj": dg.ColWiseParallel(),
            "layers.*.mlp.down_proj": dg.RowWiseParallel()}


def llama_sequence_parallel():
    """Llama's Megatron plan with Megatron-SP in Paddle's styles, as Paddle's Llama
    example writes it: the embedding (its vocabulary split) begins the region, the norms
    run on the sequence split, attention and MLP gather it and scatter it back, the
    head (its classes split) ends it."""
    plan = llama_styles()
    plan.update({"embed_tokens": [dg.RowWiseParallel(), dg.SequenceParallelBegin()],
                 "layers.*.input_layernorm": dg.SequenceParallelEnable(),
                 "layers.*.post_attention_layernorm": dg.SequenceParallelEnable(),
                 "layers.*.self_attn": dg.SequenceParallelDisable(),
                 "layers.*.mlp": dg.SequenceParallelDisable(),
                 "norm": dg.SequenceParallelEnable(),
                 "lm_head": [dg.ColWiseParallel(), dg.SequenceParallelEnd()]})
    return plan


_LAYOUTS = [
    # GPT: each config alone, then combined
    ("gpt", Layout("dp_z0", (4,), ("dp",), _dp(0))),
    ("gpt", Layout("dp_z1", (4,), ("dp",), _dp(1))),
    ("gpt", Layout("dp_z3", (4,), ("dp",), _dp(3))),
    ("gpt", Layout("mp_styles", (4,), ("mp",), _mp(gpt_styles))),
    ("gpt", Layout("mp_megatron", (4,), ("mp",), _mp("megatron"))),
    ("gpt", Layout("mp_sequence_parallel", (4,), ("mp",), _mp(gpt_sequence_parallel))),
    ("gpt", Layout("pp4_split_points", (4,), ("pp",),
                   _pp(lambda: {"blocks.0": dg.SplitPoint.BEGINNING, "blocks.1": 2, "ln_f": 3}),
                   PIPELINE)),
    ("gpt", Layout("dp_mp_megatron_z2", (2, 2), ("dp", "mp"), _mp("megatron", 2))),
    ("gpt", Layout("pp_dp_z2", (2, 2), ("pp", "dp"), _pp("blocks", 2), PIPELINE)),
    ("gpt", Layout("pp_mp_split_points", (2, 2), ("pp", "mp"),
                   _mp("megatron", 0, lambda: {"blocks.0": dg.SplitPoint.END}), PIPELINE)),
    ("gpt", Layout("pp_dp_mp_z3", (2, 2, 2), ("pp", "dp", "mp"),
                   _mp("megatron", 3, "blocks"), PIPELINE)),
    # Llama
    ("llama", Layout("dp_z2", (4,), ("dp",), _dp(2))),
    ("llama", Layout("dp_cp", (2, 2), ("dp", "cp"), lambda: {})),
    ("llama", Layout("cp_mp_megatron", (2, 2), ("cp", "mp"), _mp("megatron"))),
    ("llama", Layout("mp_styles", (4,), ("mp",), _mp(llama_styles))),
    ("llama", Layout("dp_mp_sequence_parallel", (2, 2), ("dp", "mp"),
                     _mp(llama_sequence_parallel))),
    ("llama", Layout("dp_mp_megatron_z1", (2, 2), ("dp", "mp"), _mp("megatron", 1))),
    ("llama", Layout("pp_mp_megatron", (2, 2), ("pp", "mp"), _mp("megatron", 0, "layers"),
                     PIPELINE)),
    ("llama", Layout("pp_dp_mp_z2", (2, 2, 2), ("pp", "dp", "mp"),
                     _mp("megatron", 2, "layers"), PIPELINE)),
    # Mixtral: the experts over ep
    ("mixtral", Layout("ep", (4,), ("ep",), lambda: {})),
    ("mixtral", Layout("ep_mp_megatron", (2, 2), ("ep", "mp"), _mp("megatron"))),
    ("mixtral", Layout("pp_ep", (2, 2), ("pp", "ep"), _pp("layers"), PIPELINE)),
    ("mixtral", Layout("dp_mp_megatron_z2", (2, 2), ("dp", "mp"), _mp("megatron", 2))),
    ("mixtral", Layout("dp_ep_z3", (2, 2), ("dp", "ep"), _dp(3))),
    ("mixtral", Layout("pp_dp_mp_z2", (2, 2, 2), ("pp", "dp", "mp"),
                       _mp("megatron", 2, "layers"), PIPELINE)),
]
LAYOUTS = {(kind, layout.name): layout for kind, layout in _LAYOUTS}


# -- the same layouts written by hand with shard_tensor ------------------------------------
# GPT's Megatron specs per parameter (the name after ``blocks.{i}.``): the vocabulary of
# the embedding and the head split, each block's first Linears by columns, its second by
# rows; and with level 3 each one's first dim that is not split over dp too
GPT_MEGATRON = {
    "wte.weight": ["mp", None], "wpe.weight": [None, None], "ln_f.weight": [None],
    "ln_f.bias": [None], "lm_head.weight": [None, "mp"], "ln1.weight": [None],
    "ln1.bias": [None], "ln2.weight": [None], "ln2.bias": [None],
    "attn.qkv.weight": [None, "mp"], "attn.qkv.bias": ["mp"], "attn.proj.weight": ["mp", None],
    "attn.proj.bias": [None], "mlp.fc1.weight": [None, "mp"], "mlp.fc1.bias": ["mp"],
    "mlp.fc2.weight": ["mp", None], "mlp.fc2.bias": [None]}
GPT_MEGATRON_Z3 = {
    "wte.weight": ["mp", "dp"], "wpe.weight": ["dp", None], "ln_f.weight": ["dp"],
    "ln_f.bias": ["dp"], "lm_head.weight": ["dp", "mp"], "ln1.weight": ["dp"],
    "ln1.bias": ["dp"], "ln2.weight": ["dp"], "ln2.bias": ["dp"],
    "attn.qkv.weight": ["dp", "mp"], "attn.qkv.bias": ["mp"], "attn.proj.weight": ["mp", "dp"],
    "attn.proj.bias": ["dp"], "mlp.fc1.weight": ["dp", "mp"], "mlp.fc1.bias": ["mp"],
    "mlp.fc2.weight": ["mp", "dp"], "mlp.fc2.bias": ["dp"]}
# which stage each parameter of the 2-block GPT goes to with two stages
GPT_STAGES = (("wte", "wpe", "blocks.0"), ("blocks.1", "ln_f", "lm_head"))


def _key(name: str) -> str:
    return name.split(".", 2)[2] if name.startswith("blocks.") else name


def split_input(model, mesh, entry) -> None:
    """The model's forward annotates its tokens' batch over ``entry`` on ``mesh``, as a
    user writes it by hand."""
    forward = model.forward
    model.forward = lambda ids: forward(dg.shard_tensor(ids, mesh, [entry, None]))


def gpt_by_hand(table, meshes):
    """Every GPT parameter on its stage's mesh (GPT_STAGES with two meshes) with its spec
    in ``table``; where a spec splits a parameter over dp (ZeRO-3), the ops of its layer
    read it without that split (:func:`read_whole_over_dp`)."""
    def annotate(model):
        for path, layer in model.named_sublayers():
            stored = {}
            for leaf, p in layer._parameters.items():
                name = f"{path}.{leaf}"
                stage = 0 if len(meshes) == 1 else next(
                    s for s, parts in enumerate(GPT_STAGES)
                    if any(name.startswith(part + ".") for part in parts))
                dg.shard_tensor(p, meshes[stage], table[_key(name)])
                stored[leaf] = table[_key(name)]
            used = {leaf: [None if e == "dp" else e for e in spec]
                    for leaf, spec in stored.items() if "dp" in spec}
            if used:
                read_whole_over_dp(layer, meshes[stage], used)
    return annotate


def read_whole_over_dp(layer, mesh, specs) -> None:
    """``layer``'s ops read its parameters named in ``specs`` in those specs (gathered
    over dp before use, as ZeRO-3 does): its forward run under ``shard_op`` with the
    parameters as the callable's arguments, whose in_shard_specs they are."""
    own, leaves = layer.forward, list(specs)

    def forward(x):
        run = dg.shard_op(lambda x, *params: own(x), mesh,
                          in_shard_specs=[None] + [specs[leaf] for leaf in leaves])
        return run(x, *(layer._parameters[leaf] for leaf in leaves))

    layer.forward = forward


def llama_by_hand(meshes):
    """Llama or Mixtral on ``meshes`` (one, or two stages: the embedding and the first
    layer on the first, the rest on the second), each layer split by dg.nn.llama's
    Megatron helper on its stage, the embedding's and the head's vocabulary over mp."""
    def annotate(model):
        first, last = meshes[0], meshes[-1]
        dg.shard_tensor(model.embed_tokens.weight, first, ["mp", None])
        for i, layer in enumerate(model.layers):
            mesh = meshes[i * len(meshes) // len(model.layers)]
            for _, p in layer.named_parameters():
                dg.shard_tensor(p, mesh, [None] * len(p.shape))
            layer.megatron(mesh, "mp")
        dg.shard_tensor(model.norm.weight, last, [None])
        dg.shard_tensor(model.lm_head.weight, last, [None, "mp"])
    return annotate


def _both(*annotates):
    def annotate(model):
        for a in annotates:
            a(model)
    return annotate


_DP_MP = mesh((2, 2), ("dp", "mp"))
_STAGES_MP = [dg.ProcessMesh([0, 1], ["mp"]), dg.ProcessMesh([2, 3], ["mp"])]
_STAGES_DP_MP = [mesh((2, 2), ("dp", "mp")),
                 dg.ProcessMesh([[4, 5], [6, 7]], ["dp", "mp"])]
# (kind, layout name): (annotate by hand, the input's batch split: mesh and entry, the
# Strategy's arguments)
BY_HAND = {
    ("gpt", "dp_mp_megatron_z2"): (gpt_by_hand(GPT_MEGATRON, [_DP_MP]), (_DP_MP, "dp"),
                                   dict(sharding=True)),
    ("gpt", "pp_mp_split_points"): (gpt_by_hand(GPT_MEGATRON, _STAGES_MP), None, PIPELINE),
    ("gpt", "dp_z3"): (gpt_by_hand({k: ["dp"] + [None] * (len(v) - 1)
                                    for k, v in GPT_MEGATRON.items()}, [mesh((4,), ("dp",))]),
                       (mesh((4,), ("dp",)), "dp"), dict(sharding=True)),
    ("gpt", "pp_dp_mp_z3"): (gpt_by_hand(GPT_MEGATRON_Z3, _STAGES_DP_MP),
                             (_STAGES_DP_MP[0], "dp"), dict(sharding=True, **PIPELINE)),
    ("llama", "dp_mp_megatron_z1"): (llama_by_hand([_DP_MP]), (_DP_MP, "dp"),
                                     dict(sharding=True)),
    ("llama", "pp_mp_megatron"): (llama_by_hand(_STAGES_MP), None, PIPELINE),
    ("mixtral", "ep_mp_megatron"): (
        _both(llama_by_hand([mesh((2, 2), ("ep", "mp"))]),
              lambda m: dg.nn.mixtral.expert_parallel(m, mesh((2, 2), ("ep", "mp")), "ep",
                                                      inner="mp")),
        (mesh((2, 2), ("ep", "mp")), "ep"), {}),
}


def parallelized(kind: str, layout: Layout | None):
    """(model, optimizer) of ``kind``, laid out by ``layout`` (None: serial)."""
    model, optimizer = build(kind), dg.optim.AdamW(1e-2)
    if layout is None:
        return model, optimizer
    return dg.parallelize(model, layout.mesh, layout.config(), optimizer=optimizer)


def train(comm, kind: str, layout: Layout | None = None, loader=None) -> tuple:
    """(History.losses, engine.state_dict()) of STEPS steps of ``kind`` laid out by
    ``layout`` on ``comm`` (None: MPI's world under ``distgraph run``, or serially
    without a layout); SimulatedWorld.run(train, kind, layout) gives it its threads'.
    ``loader``: keyword arguments of a dg.shard_dataloader over the layout's mesh that
    feeds the data (None: the dataset as it is)."""
    with BUILD_LOCK:
        model, optimizer = parallelized(kind, layout)
    strategy = dg.Strategy(**(layout.strategy if layout is not None else {}))
    engine = dg.Engine(model, loss=dg.nn.CrossEntropyLoss(), optimizer=optimizer,
                       strategy=strategy, communicator=comm)
    data = NextTokens(kind)
    if loader is not None:
        data = dg.shard_dataloader(data, layout.mesh, **loader)
    with BUILD_LOCK:
        engine.prepare(*dg.app.data.DataLoader(data, BATCH).specs(1))
    history = engine.fit(data, batch_size=BATCH, epochs=1, verbose=0)
    return history.losses, engine.state_dict()


def trains_equal(result, serial) -> None:
    """``(losses, state)`` equals the serial one (float64, 1e-10)."""
    losses, state = result
    np.testing.assert_allclose(losses, serial[0], rtol=0, atol=1e-10)
    assert sorted(state) == sorted(serial[1])
    for name, value in serial[1].items():
        np.testing.assert_allclose(state[name], value, rtol=0, atol=1e-10, err_msg=name)
