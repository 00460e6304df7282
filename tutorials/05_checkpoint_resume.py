"""Tutorial 05: a training run is killed, resumes from its last checkpoint, and ends
exactly where an uninterrupted run ends.

    python tutorials/05_checkpoint_resume.py               # one process, about 3 s
    python tutorials/05_checkpoint_resume.py --nprocs 4    # 4 MPI ranks, dp x mp (6 s)
    python tutorials/05_checkpoint_resume.py --nprocs 4 --resume-nprocs 1

This script is the conductor; it starts the training runs as child processes:

1. ``train``: a tiny GPT with dropout, shuffled data and a warm-up + cosine learning
   rate, for 3 epochs; ``dg.callbacks.ModelCheckpoint`` saves every 10 steps. Once it
   has passed step ``--kill-after``, the conductor kills it with SIGKILL, as a crash or
   a preempted job would end: no cleanup runs, and the steps after the last checkpoint
   are lost.
2. ``resume``: a new process builds the model from another seed, ``engine.load``s the
   checkpoint (weights, Adam moments, step, position inside the epoch, data order,
   dropout seeds) and calls the same ``fit``, which runs only the steps not done yet.
3. ``reference``: the same training, never interrupted.

The conductor prints the resumed losses beside the reference's and fails unless they
match: exactly on the same plan (and within float32 rounding when ``--resume-nprocs``
resumes on another number of ranks, e.g. a 4-rank checkpoint on 1 process).
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile

import numpy as np

import distgraph as dg

from counting_data import CountingSequences  # tutorials/ is on the path
from gpt_plans import megatron  # tutorial 02's annotations

EPOCHS, BATCH, SEQ, VOCAB, SAMPLES = 3, 16, 32, 64, 256     # 16 steps per epoch
SAVE_EVERY = 10


MESH = dg.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])


def make_engine(seed):
    """GPT-tiny; on 4 ranks tutorial 02's plan (annotated once the Engine says how many
    ranks the job has)."""
    dg.seed(seed)
    model = dg.nn.GPT(vocab_size=VOCAB, d_model=64, n_layer=2, n_head=4, max_seq_len=SEQ,
                      dropout=0.1)
    lr = dg.optim.lr.LinearWarmup(dg.optim.lr.CosineDecay(3e-3, decay_steps=40), 8)
    engine = dg.Engine(model, loss=dg.nn.CrossEntropyLoss(), optimizer=dg.optim.AdamW(lr))
    if engine.world_size > 1:
        megatron(model, MESH)
    return engine


def dataset(engine):
    """The samples; on 4 ranks each batch split over the mesh's dp dim."""
    data = CountingSequences(SAMPLES, SEQ, VOCAB)
    return dg.shard_dataloader(data, MESH, "dp") if engine.world_size > 1 else data


class PrintSteps(dg.callbacks.Callback):
    """Rank 0 prints each step's loss, and each checkpoint once it is committed."""

    def __init__(self, saver=None):
        self.saver = saver

    def on_step_end(self, step, logs=None):
        if self.engine.rank == 0:
            print(f"STEP {step} {logs['loss']!r}", flush=True)
            if self.saver is not None and (step + 1) % SAVE_EVERY == 0:
                print(f"CHECKPOINT {step + 1}", flush=True)


def child(role, directory):
    fit = dict(batch_size=BATCH, epochs=EPOCHS, shuffle=True, verbose=0)
    path = os.path.join(directory, "ckpt")
    if role == "train":
        engine = make_engine(seed=0)
        saver = dg.callbacks.ModelCheckpoint(path, every_n_steps=SAVE_EVERY)
        engine.fit(dataset(engine), callbacks=[saver, PrintSteps(saver)], **fit)
        return
    engine = make_engine(seed=0 if role == "reference" else 123)
    if role == "resume":
        engine.load(path)
    history = engine.fit(dataset(engine), **fit)
    if engine.rank == 0:
        print("RESULT " + json.dumps({"steps": history.steps, "losses": history.losses}),
              flush=True)


def command(nprocs, role, directory):
    script = [os.path.abspath(__file__), "--role", role, "--dir", directory]
    if nprocs == 1:
        return [sys.executable, *script]
    return [sys.executable, "-m", "distgraph.cli", "run", "-n", str(nprocs), *script]


def run(nprocs, role, directory) -> dict:
    proc = subprocess.run(command(nprocs, role, directory), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the {role} run failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line.split(" ", 1)[1])


def train_and_kill(nprocs, directory, kill_after) -> int:
    """Start the training run, kill it after step ``kill_after``; the last checkpoint's step."""
    proc = subprocess.Popen(command(nprocs, "train", directory), stdout=subprocess.PIPE,
                            text=True, start_new_session=True)   # its own group: kill all ranks
    saved = 0
    try:
        for line in proc.stdout:
            if line.startswith("CHECKPOINT "):
                saved = int(line.split()[1])
            if line.startswith("STEP ") and int(line.split()[1]) >= kill_after:
                os.killpg(proc.pid, signal.SIGKILL)
                break
    finally:
        proc.wait()
    if proc.returncode != -signal.SIGKILL:
        raise RuntimeError(f"the training run ended by itself (exit code {proc.returncode})")
    return saved


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, choices=(1, 4), default=1)
    parser.add_argument("--resume-nprocs", type=int, choices=(1, 4), default=None)
    parser.add_argument("--kill-after", type=int, default=24,
                        help="kill the training run after this step (0-based)")
    parser.add_argument("--role", choices=("train", "resume", "reference"), help="(internal)")
    parser.add_argument("--dir", help="(internal)")
    args = parser.parse_args()
    if args.role:
        return child(args.role, args.dir)

    resume_nprocs = args.resume_nprocs or args.nprocs
    with tempfile.TemporaryDirectory() as directory:
        saved = train_and_kill(args.nprocs, directory, args.kill_after)
        print(f"training on {args.nprocs} process(es) killed after step {args.kill_after}; "
              f"last checkpoint at step {saved}")
        resumed = run(resume_nprocs, "resume", directory)
        reference = run(args.nprocs, "reference", directory)
    want = reference["losses"][saved:]
    print(f"resumed on {resume_nprocs} process(es) at step {resumed['steps'][0]}: "
          f"{len(resumed['losses'])} steps")
    for step in (resumed["steps"][0], resumed["steps"][-1]):
        k = step - saved
        print(f"  step {step}: resumed loss {resumed['losses'][k]:.6f}, "
              f"uninterrupted {want[k]:.6f}")
    diff = float(np.max(np.abs(np.subtract(resumed["losses"], want))))
    exact = resume_nprocs == args.nprocs
    if len(resumed["losses"]) != len(want) or diff > (0.0 if exact else 1e-4):
        raise RuntimeError(f"the resumed losses differ from the uninterrupted run's by {diff}")
    print(f"losses match: max |difference| = {diff:.3g} over {len(want)} steps"
          + ("" if exact else " (another plan: float32 rounding)"))


if __name__ == "__main__":
    main()
