"""Checkpoints: the format on disk, reshard-on-load across plans on real MPI ranks
(dp x mp on 4 ranks -> serial, mp on 2 ranks, ZeRO, two stages; and back), reading only
a process's blocks, clear errors for another model's checkpoint, atomic saves under a
real kill, and exact resume in a new process (serial and on 4 ranks)."""

import json
import os
import signal
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

import distgraph as dg
from distgraph.app.checkpoint import CheckpointReader

sys.path.insert(0, str(Path(__file__).parent))
import plans as P  # noqa: E402

SCRIPTS = Path(__file__).parent / "mpi_scripts"
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def run(argv, tag, nprocs=None):
    cmd = [sys.executable, *(["-m", "distgraph.cli", "run", "-n", str(nprocs)] if nprocs else []),
           *map(str, argv)]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(tag + " ")]
    assert len(lines) == 1, proc.stdout[-3000:]
    return json.loads(lines[0].split(" ", 1)[1])




def gpt_engine(seed=0, n_layer=2, optimizer=None):
    dg.seed(seed)
    return dg.Engine(dg.nn.GPT(32, 16, n_layer, 2, 8), dg.nn.CrossEntropyLoss(),
                     optimizer or dg.optim.AdamW(1e-2))


def test_a_checkpoint_is_shard_files_and_metadata(float64, tmp_path):
    engine = gpt_engine()
    engine.fit(P.Tokens(), batch_size=4, epochs=1, verbose=0)
    engine.save(tmp_path / "ckpt")
    names = sorted(os.listdir(tmp_path / "ckpt"))
    assert names[0] == ".lock" and names[2] == "metadata.json"      # the lock: no job holds it
    assert names[1].startswith("data-step4-")
    assert os.listdir(tmp_path / "ckpt" / names[1]) == ["rank-00000.bin"]
    meta = json.loads((tmp_path / "ckpt" / "metadata.json").read_text())
    assert meta["format"] == "distgraph-checkpoint" and meta["distgraph_version"]
    shard = (tmp_path / "ckpt" / names[1] / "rank-00000.bin").read_bytes()
    assert meta["files"] == {"rank-00000.bin": {"bytes": len(shard),
                                                "crc32": f"{zlib.crc32(shard):08x}"}}
    body = {k: v for k, v in meta.items() if k != "checksum"}
    assert meta["checksum"] == f"{zlib.crc32(json.dumps(body, sort_keys=True, separators=(',', ':')).encode()):08x}"
    assert meta["training"] == {"step": 4, "epoch": 1, "batch": 0, "batch_size": 4,
                                "shuffle": False, "drop_last": False,
                                "steps_per_epoch": None, "dataset_size": 16}
    assert meta["optimizer"]["type"] == "AdamW" and meta["optimizer"]["learning_rate"] == 0.01
    assert set(meta["rng"]) == {"data_seed", "dropout_seeds", "param_generator"}
    w = meta["tensors"]["blocks.0.mlp.fc1.weight@MOMENT2"]
    assert w["shape"] == [16, 64] and w["dtype"] == "<f8" and w["kind"] == "optimizer"
    assert w["spec"] == "[None, None]" and len(w["shards"]) == 1
    assert meta["tensors"]["optimizer@STEP"]["shape"] == []
    assert "optimizer@LR" not in meta["tensors"]     # a function of the step and schedule

    reader = CheckpointReader(tmp_path / "ckpt")
    params, states = engine.state_dict(), engine.optimizer_state_dict()
    assert sorted(reader.names) == sorted({**params, **states})
    block = reader.read("lm_head.weight", (slice(2, 5), slice(10, 30)))
    np.testing.assert_array_equal(block, params["lm_head.weight"][2:5, 10:30])
    assert reader.bytes_read == block.nbytes

    again = gpt_engine(seed=3)
    again.load(tmp_path / "ckpt")
    assert again.global_step == 4
    for got, want in ((again.state_dict(), params), (again.optimizer_state_dict(), states)):
        assert sorted(got) == sorted(want)
        assert all(np.array_equal(got[k], want[k]) for k in want)


def test_saving_again_replaces_the_checkpoint_and_keeps_one_data_folder(float64, tmp_path):
    engine = gpt_engine()
    engine.save(tmp_path / "ckpt")                      # before any training: parameters
    assert not CheckpointReader(tmp_path / "ckpt").has_optimizer_state
    engine.fit(P.Tokens(), batch_size=4, verbose=0)
    engine.save(tmp_path / "ckpt")
    assert len([n for n in os.listdir(tmp_path / "ckpt") if n.startswith("data-")]) == 1
    assert CheckpointReader(tmp_path / "ckpt").info["training"]["step"] == 4


def test_another_models_checkpoint_is_a_clear_error(float64, tmp_path):
    engine = gpt_engine()
    engine.fit(P.Tokens(), batch_size=4, verbose=0)
    engine.save(tmp_path / "ckpt")
    with pytest.raises(dg.CheckpointError, match=r"missing 12 tensor\(s\) \[blocks.2.attn.proj.bias, "):
        gpt_engine(n_layer=3).load(tmp_path / "ckpt")
    with pytest.raises(dg.CheckpointError, match=r"unexpected 36 tensor\(s\) \[blocks.1.attn.proj.bias, .*more"):
        gpt_engine(n_layer=1).load(tmp_path / "ckpt")
    dg.seed(0)
    wider = dg.Engine(dg.nn.GPT(40, 16, 2, 2, 8), dg.nn.CrossEntropyLoss(),
                      dg.optim.AdamW(1e-2))
    with pytest.raises(dg.CheckpointError, match=r"lm_head.weight is \[16, 32\]:float64 in "
                                                 r"the checkpoint, \[16, 40\]:float64"):
        wider.load(tmp_path / "ckpt")
    with pytest.raises(dg.CheckpointError, match="saved with the AdamW optimizer, this Engine "
                                                 "has SGD"):
        gpt_engine(optimizer=dg.optim.SGD(0.1, momentum=0.9)).load(tmp_path / "ckpt")
    with pytest.raises(dg.CheckpointError, match="no checkpoint at .*nowhere"):
        engine.load(tmp_path / "nowhere")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(dg.CheckpointError, match="holds other files \\(notes.txt\\)"):
        engine.save(tmp_path / "mine")


class Wrapper(dg.nn.Layer):
    """A user's layer around the model: its parameters are named ``inner.*``."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, idx):
        return self.inner(idx)


def test_a_wrapped_models_checkpoint_loads_into_the_bare_model_and_back(float64, tmp_path):
    wrapped = dg.Engine(Wrapper(gpt_engine().model), dg.nn.CrossEntropyLoss(),
                        dg.optim.AdamW(1e-2))
    wrapped.fit(P.Tokens(), batch_size=4, verbose=0)
    wrapped.save(tmp_path / "wrapped")
    bare = gpt_engine(seed=1)
    with pytest.raises(dg.CheckpointError, match=r"missing 29 tensor.*The names differ by a "
                       r"common prefix: the checkpoint's start with 'inner.'. Load it with "
                       r"engine.load\(path, strip_prefix='inner.'\)"):
        bare.load(tmp_path / "wrapped")
    bare.load(tmp_path / "wrapped", strip_prefix="inner.")
    want = {k.removeprefix("inner."): v for k, v in wrapped.optimizer_state_dict().items()}
    assert {k: v.tolist() for k, v in bare.optimizer_state_dict().items()} == \
        {k: v.tolist() for k, v in want.items()}
    assert all(np.array_equal(bare.state_dict()[k.removeprefix("inner.")], v)
               for k, v in wrapped.state_dict().items())
    bare.save(tmp_path / "bare")
    again = dg.Engine(Wrapper(gpt_engine(seed=2).model), dg.nn.CrossEntropyLoss(),
                      dg.optim.AdamW(1e-2))
    with pytest.raises(dg.CheckpointError, match=r"the model's start with 'inner.'. Load it "
                       r"with engine.load\(path, prefix='inner.'\)"):
        again.load(tmp_path / "bare")
    again.load(tmp_path / "bare", prefix="inner.")
    assert all(np.array_equal(again.state_dict()[k], v)
               for k, v in wrapped.state_dict().items())
    # the loaded one trains on as the wrapped one does (the same batches; no shuffle)
    assert again.fit(P.Tokens(), batch_size=4, epochs=2, verbose=0).losses == \
        wrapped.fit(P.Tokens(), batch_size=4, epochs=2, verbose=0).losses


def test_weights_only_checkpoint_starts_fresh_optimizer_states(float64, tmp_path):
    gpt_engine(seed=4).save(tmp_path / "weights")
    engine = gpt_engine(seed=5)
    engine.load(tmp_path / "weights")
    engine.fit(P.Tokens(), batch_size=4, verbose=0)
    reference = gpt_engine(seed=4)
    reference.fit(P.Tokens(), batch_size=4, verbose=0)
    want = reference.state_dict()
    assert all(np.array_equal(v, want[k]) for k, v in engine.state_dict().items())


def test_model_checkpoint_and_fit_after_load_runs_only_what_is_left(float64, tmp_path):
    engine = gpt_engine()
    saver = dg.callbacks.ModelCheckpoint(tmp_path / "every2-{step}", every_n_steps=2)
    per_epoch = dg.callbacks.ModelCheckpoint(tmp_path / "epoch")
    full = engine.fit(P.Tokens(), batch_size=4, epochs=3, callbacks=[saver, per_epoch],
                      verbose=0)
    assert [Path(p).name for p in saver.saved] == [f"every2-{s}" for s in (2, 4, 6, 8, 10, 12)]
    assert CheckpointReader(tmp_path / "epoch").info["training"]["epoch"] == 3

    resumed = gpt_engine(seed=1)
    resumed.load(tmp_path / "every2-4")            # the end of epoch 0 (4 batches of 4)
    history = resumed.fit(P.Tokens(), batch_size=4, epochs=3, verbose=0)
    assert history.steps == list(range(4, 12)) and [e["epoch"] for e in history.epochs] == [1, 2]
    assert history.losses == full.losses[4:]
    # epochs is the total, from the checkpoint's position as from a fit's
    assert resumed.fit(P.Tokens(), batch_size=4, epochs=3, verbose=0).losses == []
    assert resumed.fit(P.Tokens(), batch_size=4, epochs=4, verbose=0).steps == \
        list(range(12, 16))

    inside = gpt_engine(seed=1)
    inside.load(tmp_path / "every2-6")              # inside epoch 1
    with pytest.raises(dg.DistGraphError, match="inside epoch 1 after batch 2.*batch_size=2"):
        inside.fit(P.Tokens(), batch_size=2, epochs=3, verbose=0)


@pytest.mark.slow
@pytest.mark.mpi
def test_load_reshards_to_any_plan(float64, tmp_path):
    """Saved on 4 ranks under dp x mp, ZeRO and two stages; loaded under the others, on
    2 ranks (mp, two stages) and serially: every parameter and state equal, bit for bit,
    and a rank of a sharded plan reads only its part of the files."""
    four = run([SCRIPTS / "checkpoint_plans.py", tmp_path, "save:gpt:dp_tp", "save:gpt:zero",
                "save:gpt:two_stage", "load:gpt:zero:dp_tp", "load:gpt:two_stage:dp_tp",
                "load:gpt:dp_tp:zero", "load:gpt:dp_tp:two_stage"], "CKPT-RESULT", nprocs=4)
    two = run([SCRIPTS / "checkpoint_plans.py", tmp_path, "load:gpt:tp:dp_tp",
               "load:gpt:two_stage:dp_tp", "load:gpt:tp:zero"], "CKPT-RESULT", nprocs=2)
    for action, ranks in list(four.items()) + list(two.items()):
        if action.startswith("load"):
            for rank, r in enumerate(ranks):
                assert r["same_names"] and r["diff"] == 0.0, (action, rank, r)
    for action in ("load:gpt:zero:dp_tp", "load:gpt:tp:dp_tp", "load:gpt:two_stage:dp_tp"):
        ranks = four.get(action) or two[action]
        assert all(r["bytes_read"] < 0.6 * r["checkpoint_bytes"] for r in ranks), ranks

    # serially, from the dp x mp checkpoint
    model = P.build_model("gpt", seed=2)
    engine = P.prepare(P.make_engine(model, "gpt"), "gpt")
    engine.load(tmp_path / "gpt-dp_tp")
    want = dict(np.load(tmp_path / "gpt-dp_tp.npz"))
    got = {**engine.state_dict(), **engine.optimizer_state_dict()}
    assert sorted(got) == sorted(want)
    assert all(np.array_equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("point, committed", [("shards", False), ("metadata", False),
                                              ("cleanup", True)])
def test_a_save_killed_midway_leaves_a_loadable_checkpoint(float64, tmp_path, point,
                                                           committed):
    proc = subprocess.Popen([sys.executable, str(SCRIPTS / "kill_during_save.py"), point,
                             str(tmp_path)], env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line.strip())
            if line.startswith("PAUSED"):
                break
        assert lines == ["SAVED 4", "PAUSED"], lines
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    step = 8 if committed else 4
    engine = gpt_engine(seed=9)
    engine.load(tmp_path / "ckpt")
    assert engine.global_step == step
    want = dict(np.load(tmp_path / f"step{step}.npz"))
    got = {**engine.state_dict(), **engine.optimizer_state_dict()}
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)
    # one more epoch (epochs is the total), and the next save cleans up
    engine.fit(P.Tokens(), batch_size=4, epochs=engine.epoch + 1, verbose=0)
    assert engine.global_step == step + 4
    engine.save(tmp_path / "ckpt")
    assert sorted(n[:5] for n in os.listdir(tmp_path / "ckpt")) == [".lock", "data-", "metad"]


def resume_check(directory, plan, serial_too=False):
    first = run([SCRIPTS / "resume_run.py", plan, "first", directory], "RESUME-RESULT",
                nprocs=4 if plan != "serial" else None)
    resumed = run([SCRIPTS / "resume_run.py", plan, "resume", directory], "RESUME-RESULT",
                  nprocs=4 if plan != "serial" else None)
    full = first["full"]
    assert len(full) == 18 and len(first["first"]) == 9
    assert first["first"] == full[:9]
    assert resumed["steps"] == list(range(9, 18))
    assert max(abs(a - b) for a, b in zip(resumed["resumed"], full[9:])) <= 1e-12
    want = np.load(directory / "full.npz")
    got = np.load(directory / f"resumed-{plan}.npz")
    assert sorted(got.files) == sorted(want.files)
    assert max(float(np.max(np.abs(got[k] - want[k]))) for k in want.files) <= 1e-12
    return full


@pytest.mark.slow
@pytest.mark.mpi
def test_exact_resume_in_a_new_process(tmp_path):
    """Mid-epoch, shuffled, with dropout and a warm-up + cosine schedule: losses and
    every parameter and optimizer state equal the uninterrupted run (fp64, <= 1e-12);
    serially, and on 4 ranks under dp x mp (whose checkpoint also resumes serially,
    equal to distributed training to 1e-10)."""
    (tmp_path / "serial").mkdir()
    (tmp_path / "dp_tp").mkdir()
    serial = resume_check(tmp_path / "serial", "serial")
    distributed = resume_check(tmp_path / "dp_tp", "dp_tp")
    assert max(abs(a - b) for a, b in zip(serial, distributed)) <= 1e-10
    crossed = run([SCRIPTS / "resume_run.py", "serial", "resume", tmp_path / "dp_tp"],
                  "RESUME-RESULT")
    assert max(abs(a - b) for a, b in zip(crossed["resumed"], distributed[9:])) <= 1e-10
