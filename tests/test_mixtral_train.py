"""A tiny Mixtral trains on several ranks as on one process (float64, 1e-10).

Expert parallelism proper: the tokens and the experts split over one mesh dim (2 and 4
ranks; the dp dim; ep x Megatron's tensor parallelism inside each expert; inside each of
2 pipeline stages), so ``moe_ffn`` and its gradient send every token to its expert's
rank and the results back (all-to-alls; fixed-size buffers with a GShard capacity). The
experts split while the tokens are whole runs each rank's experts on every token and
sums the Partial outputs. Routings where one rank's experts get no token and where all
tokens go to one rank run too. Ranks are SimulatedWorld threads; one test runs real MPI
ranks (``distgraph run -n 4``)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402
from distgraph.nn.mixtral import Mixtral, MixtralConfig, expert_parallel, megatron  # noqa: E402
from distgraph.runtime.comm.simulated import SimulatedWorld  # noqa: E402

import llama_cases as L  # noqa: E402
import plans as P  # noqa: E402

BATCH, SEQ, STEPS, VOCAB = 4, 6, 2, 32
CONFIG = MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=8,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       num_local_experts=4, num_experts_per_tok=2, initializer_range=0.2,
                       output_router_logits=True, router_aux_loss_coef=0.01)


class NextTokens:
    def __init__(self, n: int, seq: int, seed: int = 0):
        self.ids = np.random.default_rng(seed).integers(0, VOCAB, (n, seq + 1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return self.ids[i, :-1], self.ids[i, 1:]


class _PerMicroBatch(Mixtral):
    """The serial oracle of a micro-batched run: the load-balancing loss of each of
    ``groups`` consecutive parts of the batch, averaged, in a program of one
    micro-batch."""

    groups = 1

    def auxiliary_loss(self, micro_batches=1):
        return super().auxiliary_loss(self.groups)


def _model(config, skew, groups=None):
    dg.seed(7)
    model = Mixtral(config) if groups is None else _PerMicroBatch(config)
    if groups is not None:
        model.groups = groups
    if skew:        # a zero router: equal probabilities, every token picks experts 0 and 1
        for layer in model.layers:
            layer.mlp.gate.weight.set_value(np.zeros(layer.mlp.gate.weight.shape))
    return model


def _train(comm, config, annotate, skew=False, strategy=None, plans=None, groups=None):
    """(losses, state) of training on ``comm`` (None: serial); ``annotate(model)``
    gives the meshes and the dim the batch is split over; ``plans`` (a list) gets this
    rank's plan; ``groups``: the load-balancing loss per that many parts of the batch
    (:class:`_PerMicroBatch`)."""
    with P.BUILD_LOCK:
        model = _model(config, skew, groups)
        meshes, dim = annotate(model)
    engine = dg.Engine(model, loss=dg.nn.CrossEntropyLoss(), optimizer=dg.optim.AdamW(1e-2),
                       strategy=strategy or dg.Strategy(), communicator=comm)
    data = NextTokens(BATCH * STEPS, SEQ)
    if meshes is not None:
        data = dg.shard_dataloader(data, meshes, shard_dims=dim)
    with P.BUILD_LOCK:
        ins, labels = dg.app.data.DataLoader(data, BATCH).specs(1)
        engine.prepare(ins, labels)
    history = engine.fit(data, batch_size=BATCH, epochs=1, verbose=0)
    if plans is not None:
        plans.append(engine.plan())
    return history.losses, engine.state_dict()


def _serial(model):
    return None, None


def _ep(n, tokens="ep"):
    """Experts split over ``ep`` of n ranks, the batch over ``tokens`` (None: whole)."""
    def annotate(model):
        mesh = dg.ProcessMesh(list(range(n)), ["ep"])
        expert_parallel(model, mesh)
        return mesh, tokens
    return annotate


def _ep_dp(model):
    mesh = dg.ProcessMesh([0, 1], ["dp"])
    expert_parallel(model, mesh, "dp")
    return mesh, "dp"


def _ep_mp(model):
    mesh = dg.ProcessMesh([[0, 1], [2, 3]], ["ep", "mp"])
    megatron(model, mesh)
    expert_parallel(model, mesh, "ep", inner="mp")
    return mesh, "ep"


def _ep_pipeline(model):
    """Two stages of two ranks, each with its layer's experts split over its ranks."""
    first, second = dg.ProcessMesh([0, 1], ["ep"]), dg.ProcessMesh([2, 3], ["ep"])
    L.two_stages(model, first, second)
    for layer, mesh in zip(model.layers, (first, second)):
        e = layer.mlp.experts
        for w in (e.gate_proj, e.up_proj, e.down_proj):
            dg.shard_tensor(w, mesh, ["ep", None, None])
    return [first, second], "ep"


PIPELINE = dg.Strategy(micro_batches=2, schedule="1F1B")
# name: (annotate, ranks, strategy, whether moe_ffn dispatches with all-to-alls)
LAYOUTS = {"ep2": (_ep(2), 2, None, True), "ep4": (_ep(4), 4, None, True),
           "ep2_tokens_whole": (_ep(2, None), 2, None, False),
           "ep_dp": (_ep_dp, 2, None, True), "ep_mp": (_ep_mp, 4, None, True),
           "ep_pipeline": (_ep_pipeline, 4, PIPELINE, True),
           # gradient accumulation: the load-balancing loss per micro-batch too
           "ep2_accumulate": (_ep(2), 2, dg.Strategy(micro_batches=2), True),
           # the layers recomputed: the copies' kept activations replace the originals'
           "ep4_recompute": (_ep(4), 4, dg.Strategy(recompute=True), True)}


def _equal(results, serial):
    for losses, params in results:
        np.testing.assert_allclose(losses, serial[0], rtol=0, atol=1e-10)
        for name, value in serial[1].items():
            np.testing.assert_allclose(params[name], value, rtol=0, atol=1e-10, err_msg=name)


def _dispatches(plan) -> bool:
    """Whether every moe_ffn of ``plan`` runs as all-to-alls: its tokens split over
    the experts' mesh dim, its output not Partial over it, and all-to-alls among the
    collectives inside ops."""
    for op in plan.program.ops:
        if op.type == "moe_ffn":
            x, gate = op.dist_attr.input_specs[0], op.dist_attr.input_specs[3]
            dim = gate.dims[0]
            if dim is None or dim not in x.dims[:2] or \
                    dim in op.dist_attr.output_specs[0].partial:
                return False
    return any("all_to_all" in line for line in plan.op_collectives())


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_expert_parallel_training_equals_serial(float64, layout):
    annotate, ranks, strategy, dispatches = LAYOUTS[layout]
    # with micro-batches the load-balancing loss is each micro-batch's, averaged
    m = strategy.micro_batches if strategy is not None else 1
    serial = _train(None, CONFIG, _serial, groups=m)
    plans = []
    _equal(SimulatedWorld(ranks, timeout=120).run(_train, CONFIG, annotate, False, strategy,
                                                  plans), serial)
    assert all(_dispatches(p) == dispatches for p in plans)


@pytest.mark.parametrize("layout", ["ep_dp", "ep4"])
def test_a_capacity_drops_the_same_tokens_as_serial(float64, layout):
    """With a capacity the all-to-alls carry fixed-size buffers (no counts exchanged)."""
    annotate, ranks, strategy, _ = LAYOUTS[layout]
    config = CONFIG.replace(capacity_factor=0.5)
    serial = _train(None, config, _serial)
    dropless = _train(None, CONFIG, _serial)
    assert not np.allclose(serial[0], dropless[0])            # some assignments dropped
    plans = []
    _equal(SimulatedWorld(ranks, timeout=120).run(_train, config, annotate, False, strategy,
                                                  plans), serial)
    assert all(_dispatches(p) for p in plans)


@pytest.mark.parametrize("layout", ["ep2", "ep4", "ep_dp", "ep2_tokens_whole"])
def test_all_tokens_on_one_ranks_experts_runs(float64, layout):
    """A zero router sends every token to experts 0 and 1: one rank holds them (all the
    tokens go there), the other ranks' experts get no token."""
    annotate, ranks, strategy, _ = LAYOUTS[layout]
    serial = _train(None, CONFIG, _serial, True)
    _equal(SimulatedWorld(ranks, timeout=120).run(_train, CONFIG, annotate, True, strategy),
           serial)


@pytest.mark.mpi
@pytest.mark.parametrize("layout", ["ep4", "ep_pipeline"])
def test_expert_parallel_on_four_mpi_ranks_equals_serial(float64, tmp_path, layout):
    """ep4 with the batch over ep on real ranks: the counts, then the rows with
    MPI's Alltoallv; and ep inside 2 pipeline stages with 2 micro-batches and the
    load-balancing loss, which equals the serial run of the same per-micro-batch loss."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    out = tmp_path / f"{layout}.npz"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "distgraph.cli", "run", "-n", "4",
                           os.path.join(here, "mpi_scripts", "moe_ep.py"), str(out), layout],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = np.load(out)
    strategy = LAYOUTS[layout][2]
    serial = _train(None, CONFIG, _serial, groups=strategy.micro_batches if strategy else 1)
    _equal([(got["losses"], {name: got[name] for name in serial[1]})], serial)


def test_the_load_balancing_loss_needs_a_count_of_micro_batches():
    """Per micro-batch, the loss needs M: the search choosing it (None) is refused with
    what to do, and a batch that M does not divide too."""
    for m, words in ((None, "give Strategy"), (3, "does not split into 3")):
        engine = dg.Engine(_model(CONFIG, False), loss=dg.nn.CrossEntropyLoss(),
                           optimizer=dg.optim.AdamW(1e-2),
                           strategy=dg.Strategy(micro_batches=m, auto_mode="full",
                                                pipeline=m is None))
        ins, labels = dg.app.data.DataLoader(NextTokens(BATCH, SEQ), BATCH).specs(1)
        with pytest.raises(dg.DistGraphError, match=words):
            engine.prepare(ins, labels)


def test_llama_megatron_of_a_mixtral_splits_its_experts():
    """A newcomer reads ``dg.nn.llama.megatron(model, mesh)`` in the README and calls it
    on a Mixtral: it splits each expert's intermediate dim as
    ``dg.nn.mixtral.megatron`` does (it was an AttributeError: no ``gate_proj``)."""
    mesh = dg.ProcessMesh([[0, 1], [2, 3]], dim_names=["ep", "mp"])
    config = dict(vocab_size=32, hidden_size=16, intermediate_size=8, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
    with dg.LazyGuard():
        via_llama, via_mixtral = dg.nn.Mixtral(**config), dg.nn.Mixtral(**config)
    dg.nn.llama.megatron(via_llama, mesh)
    dg.nn.mixtral.megatron(via_mixtral, mesh)
    ours = {n: p.annotation for n, p in via_llama.named_parameters()}
    assert ours == {n: p.annotation for n, p in via_mixtral.named_parameters()}
    assert str(ours["layers.0.mlp.experts.down_proj"].spec) == "[None, mp, None]"
