"""What a newcomer gets wrong, from the README: each mistake is one error, the same on
every rank, that says what to change (numbers of processes, sequence lengths)."""

import sys
from pathlib import Path

import numpy as np
import pytest

import distgraph as dg
from distgraph.errors import DistGraphError
from distgraph.runtime.comm.simulated import SimulatedWorld

sys.path.insert(0, str(Path(__file__).parent))
from plans import BUILD_LOCK  # noqa: E402


class Counting:
    """The README's dataset: tokens counting up from a start; predict the next one."""

    def __init__(self, n, seq=16, vocab=32):
        self.starts, self.seq, self.vocab = np.arange(n) % vocab, seq, vocab

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        tokens = (self.starts[i] + np.arange(self.seq + 1)) % self.vocab
        return tokens[:-1], tokens[1:]


def tiny_llama():
    dg.seed(0)
    return dg.nn.Llama(vocab_size=32, hidden_size=16, intermediate_size=32,
                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)


def errors_on_ranks(n, fn) -> list:
    """Each simulated rank's DistGraphError message (None where it raised none)."""
    def rank(comm):
        try:
            fn(comm)
        except DistGraphError as e:
            return f"{type(e).__name__}: {e}"
        return None
    return SimulatedWorld(n, timeout=60).run(rank)


def test_meshes_numbered_past_the_ranks_fail_alike_on_every_rank_naming_the_fix():
    """ProcessMesh([[0, 1], [2, 4]]) on 4 ranks: rank 3 runs no process of the plan. It
    failed alone with 'process 3 has no part in this plan' while the others said 'give
    a rank mapping'; now every rank says both ways out, and the rank mapping it names
    runs."""
    def train(comm, rank_mapping=None):
        with BUILD_LOCK:          # simulated ranks share the parameter generator
            model = tiny_llama()
        mesh = dg.ProcessMesh([[0, 1], [2, 4]], dim_names=["dp", "mp"])
        dg.nn.llama.megatron(model, mesh)
        engine = dg.Engine(model, loss=dg.nn.CrossEntropyLoss(), optimizer=dg.optim.SGD(0.1),
                           communicator=comm, rank_mapping=rank_mapping)
        data = dg.shard_dataloader(Counting(8), mesh, shard_dims="dp")
        with BUILD_LOCK:
            engine.prepare(*dg.app.data.DataLoader(data, 8).specs(1))
        return engine.fit(data, batch_size=8, verbose=0).losses

    errors = errors_on_ranks(4, train)
    assert len(set(errors)) == 1, errors
    assert errors[0].startswith("PlanError: the plan's meshes number their processes "
                                "[0, 1, 2, 4]"), errors[0]
    assert "number the ProcessMesh processes 0..3" in errors[0]
    assert "rank_mapping={process: device id}" in errors[0]
    losses = SimulatedWorld(4, timeout=60).run(train, {0: 0, 1: 1, 2: 2, 4: 3})
    serial = dg.Engine(tiny_llama(), loss=dg.nn.CrossEntropyLoss(), optimizer=dg.optim.SGD(0.1))
    expected = serial.fit(Counting(8), batch_size=8, verbose=0).losses
    for x in losses:
        np.testing.assert_allclose(x, expected, rtol=1e-5)


def test_meshes_numbered_past_the_ranks_with_a_cluster_file_name_the_fix():
    """The same meshes with a resource file: the rank mapper places processes 0..n-1, so
    every rank says how to number them (it was a bare ValueError of the traffic graph)."""
    cluster = dg.Cluster.from_file(Path(__file__).parent.parent / "resources" / "clusters"
                                   / "local4.yaml")

    def plan(comm):
        with BUILD_LOCK:
            model = tiny_llama()
            mesh = dg.ProcessMesh([[0, 1], [2, 4]], dim_names=["dp", "mp"])
            dg.nn.llama.megatron(model, mesh)
            engine = dg.Engine(model, loss=dg.nn.CrossEntropyLoss(),
                               optimizer=dg.optim.SGD(0.1), communicator=comm, cluster=cluster)
            data = dg.shard_dataloader(Counting(8), mesh, shard_dims="dp")
            engine.prepare(*dg.app.data.DataLoader(data, 8).specs(1))

    errors = errors_on_ranks(4, plan)
    assert len(set(errors)) == 1, errors
    assert errors[0].startswith("PlanError: the plan's meshes number their processes "
                                "[0, 1, 2, 4], but the rank mapper"), errors[0]
    assert "number the ProcessMesh processes 0..3" in errors[0]


@pytest.mark.parametrize("seq,more", [(14, ", or balance=False"), (15, "")])
def test_a_sequence_the_context_parallel_chunks_do_not_divide_says_which_length(seq, more):
    """cp = 2 stores the sequence in 4 balanced chunks: 14 and 15 tokens do not divide.
    It said 'field 0 of shape [14] has no sequence dim that 4 chunks divide'."""
    mesh = dg.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "cp"])
    data = dg.shard_dataloader(Counting(8, seq=seq), mesh, shard_dims="dp", sequence_dim="cp")
    with pytest.raises(dg.ShardingError) as info:
        data[3]
    message = str(info.value)
    assert message.startswith(f"shard_dataloader(sequence_dim='cp'): dataset sample 3, "
                              f"field 0 has a sequence of {seq}"), message
    assert "use a sequence length divisible by 4" in message
    assert (more in message) if more else ("balance=False" not in message)


def _train_llama(comm, layout, strategy):
    with BUILD_LOCK:
        model = tiny_llama()
    mesh = dg.ProcessMesh([0, 1], dim_names=["dp"])
    data = Counting(8)
    if layout == "dp":
        data = dg.shard_dataloader(data, mesh, shard_dims="dp")
    elif layout == "mp":
        mesh = dg.ProcessMesh([0, 1], dim_names=["mp"])
        dg.nn.llama.megatron(model, mesh)
    elif layout == "cp":
        mesh = dg.ProcessMesh([0, 1], dim_names=["cp"])
        data = dg.shard_dataloader(data, mesh, sequence_dim="cp")
    engine = dg.Engine(model, loss=dg.nn.CrossEntropyLoss(), optimizer=dg.optim.SGD(0.1),
                       communicator=comm, strategy=strategy)
    with BUILD_LOCK:
        engine.prepare(*dg.app.data.DataLoader(data, 8).specs(1))
    return engine.fit(data, batch_size=8, verbose=0).losses


@pytest.mark.parametrize("layout,strategy,said", [
    ("dp", dg.Strategy(sequence_parallel=True), "Strategy(sequence_parallel=True) does nothing"),
    ("mp", dg.Strategy(sequence_parallel=True), None),
    ("dp", dg.Strategy(context_parallel="ring"), "Strategy(context_parallel='ring') does nothing"),
    ("cp", dg.Strategy(context_parallel="ring"), None),
])
def test_an_option_that_splits_nothing_says_so_once(capsys, layout, strategy, said):
    """sequence_parallel without tensor parallelism, context_parallel without a split
    sequence: the Strategy's docstring promises no option is silently ignored; they
    trained as if not given, without a word. Rank 0 says it once; the losses are the
    plan's all the same."""
    losses = SimulatedWorld(2, timeout=60).run(_train_llama, layout, strategy)
    assert losses[0] == losses[1]
    err = capsys.readouterr().err
    if said is None:
        assert "does nothing" not in err, err
    else:
        assert err.count(said) == 1, err


def test_readme_mistakes_in_options_and_models_say_what_to_give():
    """Paddle's ZeRO stage as ``sharding``, a hidden size the heads do not divide,
    expert parallelism of a dense model, a typo in ``sequence_dim``: each was silently
    taken (``sharding="zero3"``), said the wrong thing (head_dim, ``shard_dims``) or an
    AttributeError."""
    with pytest.raises(DistGraphError, match=r"Strategy.sharding must be True or False, got "
                                             r"'zero3' \(ZeRO's stages"):
        dg.Strategy(sharding="zero3")
    with pytest.raises(DistGraphError, match="Strategy.pipeline must be True or False"):
        dg.Strategy(pipeline=1)
    with pytest.raises(DistGraphError, match=r"hidden_size 30 // num_attention_heads 4, which "
                                             r"do not divide"):
        dg.nn.LlamaConfig(hidden_size=30, num_attention_heads=4)
    with pytest.raises(DistGraphError, match=r"head_dim 7 must be even \(rotary embedding "
                                             r"rotates pairs of dims\)$"):
        dg.nn.LlamaConfig(hidden_size=28, num_attention_heads=4)
    mesh = dg.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    with dg.LazyGuard():
        model = tiny_llama()
    with pytest.raises(dg.ShardingError, match="expert_parallel splits a Mixtral's experts, "
                                               "but Llama has none"):
        dg.nn.mixtral.expert_parallel(model, mesh, "mp")
    with pytest.raises(dg.ShardingError, match="sequence_dim 'mpp' is not a dim of"):
        dg.shard_dataloader(Counting(8), mesh, shard_dims="dp", sequence_dim="mpp")


@pytest.mark.parametrize("lazy", [False, True])
def test_a_checkpoint_whose_config_does_not_fit_its_weights_says_which_fields(tmp_path, lazy):
    """config.json says intermediate_size 48 for weights of 32: the shape is given in
    the checkpoint's own [out, in] layout beside the stored one, and the config fields
    to check are named (it compared [64, 32] with distgraph's [32, 48])."""
    import json

    from distgraph.app.pretrained import PretrainedError

    dg.save_pretrained(tiny_llama(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 48
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(PretrainedError) as info:
        dg.from_pretrained(tmp_path, lazy=lazy)
    message = str(info.value)
    assert "gate_proj.weight has shape [32, 16], but config.json makes it [48, 16]" in message
    assert "check its vocab_size, hidden_size, intermediate_size" in message, message


@pytest.mark.parametrize("lazy", [False, True])
def test_a_checkpoint_whose_index_names_a_missing_shard_says_the_index_lists_it(tmp_path,
                                                                                 lazy):
    """A sharded checkpoint copied without one of its shards: one DistGraphError that
    names the index, the shard it lists and a tensor it holds (it was a bare
    FileNotFoundError from safetensors, naming only the shard's path)."""
    import json

    dg.save_pretrained(tiny_llama(), tmp_path, max_shard_size="2KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    gone = shards[1]
    (tmp_path / gone).unlink()
    with pytest.raises(DistGraphError) as info:
        dg.from_pretrained(tmp_path, lazy=lazy)
    message = str(info.value)
    held = sorted(k for k, f in index["weight_map"].items() if f == gone)
    assert f"model.safetensors.index.json lists {gone}" in message, message
    assert held[0] in message and "is not in the folder" in message, message


@pytest.mark.parametrize("change,said", [
    (dict(batch_size=4), "rank 0 batch_size=8, rank 1 batch_size=4"),
    (dict(samples=12), "rank 0 train_data=8 samples, rank 1 train_data=12 samples"),
    (dict(epochs=2), "rank 0 epochs=1, rank 1 epochs=2"),
])
def test_ranks_that_call_fit_differently_fail_at_once_naming_the_argument(change, said):
    """A batch size, dataset or epoch count that depends on the rank: the ranks trained
    together on mismatched steps until one finished (then 'waiting for all_reduce')."""
    def train(comm):
        with BUILD_LOCK:
            model = tiny_llama()
        mesh = dg.ProcessMesh([0, 1], dim_names=["dp"])
        mine = change if comm.rank == 1 else {}
        data = dg.shard_dataloader(Counting(mine.get("samples", 8)), mesh, shard_dims="dp")
        engine = dg.Engine(model, loss=dg.nn.CrossEntropyLoss(), optimizer=dg.optim.SGD(0.1),
                           communicator=comm)
        engine.fit(data, batch_size=mine.get("batch_size", 8), epochs=mine.get("epochs", 1),
                   verbose=0)

    def rank(comm):
        try:
            train(comm)
        except dg.RuntimeFault as e:
            return str(e)
    errors = SimulatedWorld(2, timeout=30).run(rank)
    for r, error in enumerate(errors):
        assert error == (f"rank {r}: every rank must call Engine.fit() with the same "
                         f"arguments (each does its share of the same work); here {said}")


def test_a_megatron_split_the_mesh_does_not_divide_names_the_parameter_by_its_path():
    """3 processes for 2 heads: the error named "parameter 'weight' of Linear(16, 16)",
    one of eight such Linears; now its path in the model."""
    with dg.LazyGuard():
        model = tiny_llama()
    with pytest.raises(dg.ShardingError, match=r"parameter 'layers\.0\.self_attn\.q_proj\."
                                               r"weight' of Linear\(16, 16"):
        dg.nn.llama.megatron(model, dg.ProcessMesh([0, 1, 2], dim_names=["mp"]))


def readme_gpt_and_mesh():
    model = dg.nn.GPT(vocab_size=64, d_model=64, n_layer=2, n_head=4, max_seq_len=32)
    return model, dg.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])


@pytest.mark.parametrize("spec, said", [
    ([None, "mpp"], "unknown mesh dim 'mpp'"),
    ("mp", "shard spec 'mp' is a string"),
    ([None, None, "mp"], "the spec has 3 entries for a 2-d tensor"),
])
def test_a_wrong_spec_on_a_parameter_names_it_by_its_path_before_any_trace(spec, said):
    """The README's annotation with a mistake, before the Engine traced anything: the
    error named "parameter 'weight' of Linear(64, 256)", one of four such Linears."""
    model, mesh = readme_gpt_and_mesh()
    with pytest.raises(dg.ShardingError) as info:
        dg.shard_tensor(model.blocks[1].mlp.fc1.weight, mesh, spec)
    message = str(info.value)
    assert message.startswith("parameter 'blocks.1.mlp.fc1.weight' of Linear(64, 256)"), message
    assert said in message, message


def test_a_layer_given_to_shard_tensor_is_named_by_its_path_with_its_parameters():
    model, mesh = readme_gpt_and_mesh()
    with pytest.raises(dg.ShardingError) as info:
        dg.shard_tensor(model.blocks[0].mlp.fc1, mesh, [None, "mp"])
    assert str(info.value) == (
        "shard_tensor: got the layer 'blocks.0.mlp.fc1' (Linear(64, 256)), not a tensor: "
        "annotate its parameters (blocks.0.mlp.fc1.weight, blocks.0.mlp.fc1.bias), or run "
        "it on a mesh with dg.shard_op(layer, mesh, ...)")


def test_a_value_of_the_wrong_shape_names_the_parameter_by_its_path():
    model, _ = readme_gpt_and_mesh()
    with pytest.raises(dg.DistGraphError) as info:
        model.blocks[1].mlp.fc2.weight.set_value(np.zeros((64, 256)))
    assert str(info.value) == ("set_value: shape [64, 256] does not match the shape "
                               "[256, 64] of parameter 'blocks.1.mlp.fc2.weight' of "
                               "Linear(256, 64)")


def test_predict_takes_samples_of_inputs_only_after_fit(float64):
    """After fit, predict of samples without labels said "samples have 1 field(s) (the
    last is the label), so the model gets 0 input(s)"; now they are the inputs, and
    samples with labels predict the same, serially and on 2 data-parallel ranks."""
    def run(comm=None):
        with BUILD_LOCK:
            model = tiny_llama()
        data = Counting(8)
        if comm is not None:
            data = dg.shard_dataloader(data, dg.ProcessMesh([0, 1], dim_names=["dp"]), "dp")
        engine = dg.Engine(model, loss=dg.nn.CrossEntropyLoss(), optimizer=dg.optim.SGD(0.1),
                           communicator=comm)
        with BUILD_LOCK:
            engine.prepare(*dg.app.data.DataLoader(data, 4).specs(1))
        engine.fit(data, batch_size=4, verbose=0)
        samples = [Counting(8)[i] for i in range(4)]
        (with_labels,) = engine.predict(samples, batch_size=4)[0]
        (bare,) = engine.predict([s[0] for s in samples], batch_size=4)[0]
        (one_field,) = engine.predict([(s[0],) for s in samples], batch_size=4)[0]
        assert with_labels.shape == (4, 16, 32)
        np.testing.assert_array_equal(bare, with_labels)
        np.testing.assert_array_equal(one_field, with_labels)
        return with_labels

    serial = run()
    for out in SimulatedWorld(2, timeout=60).run(run):
        np.testing.assert_allclose(out, serial, rtol=0, atol=1e-10)


def test_a_checkpoint_path_per_rank_and_save_pretrained_of_a_gpt_say_what_to_do(tmp_path):
    """tempfile.mkdtemp() on each rank gives each its own folder: saving failed with a
    FileNotFoundError on one rank. save_pretrained of a GPT was an AttributeError
    ('config') on rank 0 and "rank 0 could not write" on the others."""
    def save(comm, how):
        with BUILD_LOCK:
            dg.seed(0)
            model = dg.nn.GPT(vocab_size=32, d_model=16, n_layer=1, n_head=2, max_seq_len=16)
        engine = dg.Engine(model, loss=dg.nn.CrossEntropyLoss(), optimizer=dg.optim.SGD(0.1),
                           communicator=comm)
        data = dg.shard_dataloader(Counting(8), dg.ProcessMesh([0, 1], dim_names=["dp"]), "dp")
        with BUILD_LOCK:
            engine.prepare(*dg.app.data.DataLoader(data, 4).specs(1))
        engine.fit(data, batch_size=4, verbose=0)
        getattr(engine, how)(tmp_path / (f"rank{comm.rank}" if how == "save" else "hf"))

    errors = errors_on_ranks(2, lambda comm: save(comm, "save"))
    for r, error in enumerate(errors):
        assert error == (f"RuntimeFault: rank {r}: every rank must call Engine.save() with the "
                         f"same arguments (each does its share of the same work); here "
                         f"rank 0 path='{tmp_path}/rank0', rank 1 path='{tmp_path}/rank1'")
    errors = errors_on_ranks(2, lambda comm: save(comm, "save_pretrained"))
    assert len(set(errors)) == 1 and errors[0].startswith(
        "DistGraphError: save_pretrained writes a transformers checkpoint of a Llama-family "
        "model"), errors
    assert "a GPT is not one: use engine.save(path)" in errors[0]


def test_micro_batches_the_data_parallel_split_does_not_divide_name_the_batch_size():
    """Batch 6, 2 micro-batches of 3 rows, split over dp = 2: it failed planning a
    reshard ("tensor 'reshard source' of shape [3, 16] ... pad the tensor"); now it asks
    for a batch size that both divide."""
    with dg.LazyGuard():
        model = tiny_llama()
    mesh = dg.ProcessMesh([0, 1], dim_names=["dp"])
    engine = dg.Engine(model, loss=dg.nn.CrossEntropyLoss(), optimizer=dg.optim.SGD(0.1),
                       strategy=dg.Strategy(micro_batches=2))
    data = dg.shard_dataloader(Counting(12), mesh, shard_dims="dp")
    with pytest.raises(dg.errors.BatchSplitError) as info:
        engine.prepare(*dg.app.data.DataLoader(data, 6).specs(1))
    assert str(info.value) == ("Strategy(micro_batches=2) splits the batch of 6 into "
                               "micro-batches of 3 rows, and input input_0 is split over mesh "
                               "dims ['dp'] into 2 parts, which 3 rows do not divide; use a "
                               "batch size divisible by 4")
    assert engine.prepare(*dg.app.data.DataLoader(data, 4).specs(1)).world_size == 2


RANK_BEFORE_ENGINE = """
import distgraph as dg
from mpi4py import MPI
before = (dg.get_rank(), dg.get_world_size())
world = MPI.COMM_WORLD
print("rank", before, (world.Get_rank(), world.Get_size()), flush=True)
assert before == (world.Get_rank(), world.Get_size())
"""


@pytest.mark.mpi
def test_the_rank_is_known_before_an_engine_exists(tmp_path, monkeypatch):
    """dg.get_rank() / dg.get_world_size() read the launcher's rank before MPI or an Engine
    starts (rank 0 writes a file the others read), equal to MPI's; alone: 0 and 1."""
    from user_scripts import run_user
    rc, out = run_user(tmp_path, RANK_BEFORE_ENGINE, 2)
    assert rc == 0, out
    assert "rank (0, 2) (0, 2)" in out and "rank (1, 2) (1, 2)" in out, out
    for var in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert (dg.get_rank(), dg.get_world_size()) == (0, 1)
