"""Damaged and contested checkpoints, planted for real: a bit flipped in, or a piece cut
from, a shard file of the newest checkpoint of a 4-rank job (resume takes the one before
and ends bit for bit where a clean resume from it ends; an explicit load names the file);
a damaged metadata.json; a second job started on a directory the first one holds (refused
at its fit's start, the first one unharmed); a checkpoint path that cannot be written
(refused at fit's start, before any step)."""

import glob
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import distgraph as dg
from distgraph.app.checkpoint_verify import verify

sys.path.insert(0, str(Path(__file__).parent))
import plans as P  # noqa: E402

SCRIPTS = Path(__file__).parent / "mpi_scripts"


def launch(nprocs, script, *args, **kwargs):
    """``distgraph run`` in this environment as it is now (a test's job_trace marker
    included), with one BLAS thread."""
    cmd = [sys.executable, "-m", "distgraph.cli", "run", "-n", str(nprocs), str(script),
           *map(str, args)]
    return subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def result(proc, tag, timeout=240):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    lines = [ln for ln in out.splitlines() if ln.startswith(tag + " ")]
    assert len(lines) == 1, out[-3000:]
    return json.loads(lines[0].split(" ", 1)[1]), err


def shard(folder, rank):
    (found,) = glob.glob(str(folder / "data-*" / f"rank-{rank:05d}.bin"))
    return Path(found)


@pytest.mark.slow
@pytest.mark.mpi
def test_resume_skips_a_damaged_newest_checkpoint_and_ends_as_a_clean_resume(tmp_path,
                                                                             job_trace):
    """The newest of four checkpoints (step 12) damaged in rank 1's shard file: one bit
    flipped, or its last 100 bytes cut. resume returns step 9, says why it skipped step
    12, and the run ends with every parameter and optimizer state equal, bit for bit, to
    a run that loaded step 9 of the undamaged series; a load of step 12 names the file."""
    saved, _ = result(launch(4, SCRIPTS / "damaged_resume.py", "train", tmp_path),
                      "DAMAGED-RESULT")
    assert saved["saved"] == [str(tmp_path / "ck" / f"step-{s}") for s in (3, 6, 9, 12)]
    for kind in ("flip", "cut"):
        shutil.copytree(tmp_path / "ck", tmp_path / kind / "ck")
    flipped = shard(tmp_path / "flip" / "ck" / "step-12", 1)
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 1                           # one bit of one float
    flipped.write_bytes(bytes(data))
    cut = shard(tmp_path / "cut" / "ck" / "step-12", 1)
    os.truncate(cut, cut.stat().st_size - 100)

    series = {kind: str(tmp_path / kind / "ck" / "step-{step}") for kind in ("flip", "cut")}
    got, err = result(launch(4, SCRIPTS / "damaged_resume.py", "check", tmp_path,
                             tmp_path / "ck" / "step-9", *series.values()), "DAMAGED-RESULT")
    assert got["clean"] == list(range(9, 18))
    clean = np.load(tmp_path / "clean.npz")
    for kind, said in (("flip", "does not match its recorded crc32"),
                       ("cut", f"is {len(data) - 100} bytes, the metadata records "
                               f"{len(data)}: cut short")):
        r = got[series[kind]]
        assert r["resumed"] == series[kind].format(step=9)
        assert r["steps"] == list(range(9, 18))
        final = np.load(tmp_path / kind / "ck" / "final.npz")
        assert sorted(final.files) == sorted(clean.files)
        assert all(np.array_equal(final[k], clean[k]) for k in clean.files)
        damaged = str(shard(tmp_path / kind / "ck" / "step-12", 1))
        assert r["load_error"].startswith(f"checkpoint {series[kind].format(step=12)} is "
                                          f"damaged, nothing of it was loaded: {damaged} {said}")
        assert (f"resume: skipped checkpoint {series[kind].format(step=12)}: {damaged} {said}"
                in err)
    job_trace.assert_nothing_left(ran_mpi=True)


def gpt_engine(seed=0):
    dg.seed(seed)
    return dg.Engine(dg.nn.GPT(32, 16, 2, 2, 8), dg.nn.CrossEntropyLoss(),
                     dg.optim.AdamW(1e-2))


def test_a_damaged_metadata_file_is_named_and_skipped(float64, tmp_path):
    engine = gpt_engine()
    for epochs in (1, 2):
        engine.fit(P.Tokens(), batch_size=4, epochs=epochs, verbose=0)
        engine.save(tmp_path / f"step-{engine.global_step}")
    meta = tmp_path / "step-8" / "metadata.json"
    text = meta.read_text()
    meta.write_text(text.replace('"step": 8', '"step": 9'))     # still JSON: one bit
    (problem,) = verify(tmp_path / "step-8").problems
    assert problem.startswith(f"{meta} is damaged: its content does not match its checksum "
                              f"(recorded {json.loads(text)['checksum']}, content ")
    with pytest.raises(dg.CheckpointError, match=f"checkpoint {tmp_path / 'step-8'} is "
                                                 f"damaged, nothing of it was loaded: {meta} "
                                                 f"is damaged: its content does not match"):
        gpt_engine(1).load(tmp_path / "step-8")
    fresh = gpt_engine(1)
    assert fresh.resume(str(tmp_path / "step-{step}")) == str(tmp_path / "step-4")
    assert fresh.global_step == 4
    meta.write_text(text[: len(text) // 2])                     # cut short: not JSON
    with pytest.raises(dg.CheckpointError, match=f"{meta} is damaged: it does not parse"):
        gpt_engine(1).load(tmp_path / "step-8")


def test_a_checkpoint_of_format_version_1_loads_unverified_and_says_so(float64, tmp_path,
                                                                       capsys):
    engine = gpt_engine()
    engine.fit(P.Tokens(), batch_size=4, epochs=1, verbose=0)
    engine.save(tmp_path / "old")
    meta_path = tmp_path / "old" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    for key in ("files", "checksum"):
        del meta[key]
    meta_path.write_text(json.dumps({**meta, "version": 1}))
    again = gpt_engine(1)
    again.load(tmp_path / "old")
    assert again.global_step == 4
    assert "written before checkpoints had checksums (format version 1)" in \
        capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.mpi
def test_a_second_job_on_a_held_directory_is_refused_at_its_fit_start(tmp_path, float64,
                                                                       job_trace):
    """Job A (2 ranks) fits with ModelCheckpoint(ck) and waits after its second step; job
    B, started on the same ck, ends at its fit's start, non-zero, naming A's rank 0; a
    save from a third process is refused the same way; A finishes unharmed and its
    checkpoint verifies; once A is gone, B runs."""
    ck, release = tmp_path / "ck", tmp_path / "release"
    a = launch(2, SCRIPTS / "checkpoint_dirs.py", ck, release)
    lines = []
    for line in a.stdout:
        lines.append(line.strip())
        if line.startswith("STEP 1"):
            break
    assert lines[:2] == ["FITTING", "STEP 0"], lines
    holder = json.loads((ck / ".lock").read_text())
    start = time.monotonic()
    b = launch(2, SCRIPTS / "checkpoint_dirs.py", ck)
    out, err = b.communicate(timeout=120)
    assert b.returncode != 0 and "FITTING" not in out, out + err
    assert time.monotonic() - start < 30
    assert (f"checkpoint directory {ck} is held by another job (process {holder['pid']} on "
            f"host {holder['host']}, since {holder['since']})" in err), err
    with pytest.raises(dg.CheckpointError, match="is held by another job"):
        gpt_engine().save(ck)
    release.touch()
    out, err = a.communicate(timeout=120)
    assert a.returncode == 0 and "DONE 4" in out, out + err
    assert verify(ck).ok and verify(ck).meta["training"]["step"] == 4
    out, err = launch(2, SCRIPTS / "checkpoint_dirs.py", ck).communicate(timeout=120)
    assert "DONE 4" in out, out + err
    job_trace.assert_nothing_left(ran_mpi=True)


@pytest.mark.mpi
def test_an_unwritable_checkpoint_path_is_refused_at_fit_start(tmp_path, job_trace):
    """A ModelCheckpoint path under a file: both ranks stop before the first step."""
    (tmp_path / "afile").write_text("not a folder")
    path = tmp_path / "afile" / "ck-{step}"
    out, err = launch(2, SCRIPTS / "checkpoint_dirs.py", path).communicate(timeout=120)
    assert "STEP" not in out and "FITTING" not in out, out + err
    assert (f"cannot write checkpoints to {path}: {tmp_path / 'afile'} is a file, where a "
            f"folder is needed" in err), err
    job_trace.assert_nothing_left(ran_mpi=True)


def test_an_unwritable_folder_is_refused_at_fit_start_not_at_the_first_save(tmp_path):
    """A read-only folder (where this user cannot write: not as root) and a path under
    a file: fit raises before its first step."""
    (tmp_path / "afile").write_text("x")
    paths = [tmp_path / "afile" / "ck"]
    if os.geteuid() != 0:
        (tmp_path / "ro").mkdir(mode=0o555)
        paths.append(tmp_path / "ro" / "ck-{step}")
    for path in paths:
        engine = gpt_engine()
        with pytest.raises(dg.CheckpointError, match=f"cannot write checkpoints to {path}"):
            engine.fit(P.Tokens(), batch_size=4, verbose=0,
                       callbacks=[dg.callbacks.ModelCheckpoint(path, every_n_steps=3)])
        assert engine.global_step == 0


def test_a_saves_cleanup_keeps_the_folder_the_metadata_on_disk_names(float64, tmp_path):
    """Whatever folder a save believes it committed, the one metadata.json names stays: a
    reader of that metadata finds its files (two writers used to delete each other's)."""
    from distgraph.app import checkpoint

    engine = gpt_engine()
    engine.save(tmp_path / "ckpt")
    named = json.loads((tmp_path / "ckpt" / "metadata.json").read_text())["data"]
    (tmp_path / "ckpt" / "data-step0-other").mkdir()
    checkpoint._cleanup(str(tmp_path / "ckpt"), "data-step0-other")
    assert sorted(os.listdir(tmp_path / "ckpt")) == sorted([".lock", "data-step0-other", named,
                                                             "metadata.json"])
    assert verify(tmp_path / "ckpt").ok
