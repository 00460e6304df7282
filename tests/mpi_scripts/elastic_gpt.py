"""GPT-tiny in float64 for the elastic tests and bench: the script a user would write,
unchanged by the restarts.

    distgraph run -n 4 --emulate FILE --elastic elastic_gpt.py --ckpt DIR --out W.npz
    python elastic_gpt.py --out W.npz                  # the serial reference

The mesh comes from ``engine.world_size``: dp x mp with mp = 2 where the world is even
(4 ranks: 2 x 2; 2 ranks: 1 x 2), Megatron's MLP split over mp, the batch over dp; or,
with ``--auto``, no annotation and ``Strategy(auto_mode="full")``; or, with
``--pipeline``, world // 2 pipeline stages of two processes each (4 ranks: 2 stages, 2
ranks: 1 stage), the parameters of the embeddings and block 0 on the first stage's mesh,
those of block 1, ln_f and the head on the last one's, the MLP split Megatron-style over
each stage's "mp", 2 micro-batches per batch (also on 1 stage). ``ModelCheckpoint``
saves every ``--every`` steps and, in an elastic restart, resumes from the newest one.
Rank 0 writes the final weights to ``--out``, prints ``PLAN world=W stages=S`` before
its first step and ``STEP <wall time> <step>`` at the start of every step (the bench
reads them).
"""

import argparse
import sys
import time

import numpy as np

import distgraph as dg

T0 = time.time()
VOCAB, SEQ, SAMPLES, BATCH = 32, 8, 96, 8          # 12 steps per epoch


class Tokens:
    """Fixed random sequences; the label is the sequence shifted by one."""

    def __init__(self):
        rng = np.random.default_rng(7)
        self.data = rng.integers(0, VOCAB, size=(SAMPLES, SEQ + 1))

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return self.data[i, :-1], self.data[i, 1:]


class Steps(dg.callbacks.Callback):
    """Rank 0 prints when each step begins (wall time) and the script's start-up times."""

    def on_fit_start(self, logs=None):
        self.fit_start = time.time()

    def on_step_begin(self, step, logs=None):
        if self.engine.rank == 0 and not hasattr(self, "stages"):
            schedule = self.engine.plan().schedule()
            self.stages = len({a.chunk for acts in schedule.values() for a in acts})
            print(f"PLAN world={self.engine.world_size} stages={self.stages}", flush=True)
        if self.engine.rank == 0:
            print(f"STEP {time.time():.3f} {step} world={self.engine.world_size} "
                  f"script={T0:.3f} fit={self.fit_start:.3f}", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt")
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--auto", action="store_true")
    p.add_argument("--pipeline", action="store_true")
    p.add_argument("--step-time", type=float, default=0.0,
                   help="seconds each step sleeps (gives a fault time to land mid-epoch)")
    p.add_argument("--hold-save-at", type=int, default=None, metavar="STEP",
                   help="on node1's ranks, in the first start's save after STEP steps: "
                        "print HOLD and sleep before writing (a test kills the machine then)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    dg.set_default_dtype("float64")
    dg.seed(0)
    model = dg.nn.GPT(vocab_size=VOCAB, d_model=16, n_layer=2, n_head=2, max_seq_len=SEQ)
    strategy = dg.Strategy(auto_mode="full", solver_time_limit=20) if args.auto else None
    if args.pipeline:
        strategy = dg.Strategy(micro_batches=2, schedule="1F1B")
    engine = dg.Engine(model, loss=dg.nn.CrossEntropyLoss(), optimizer=dg.optim.AdamW(1e-2),
                       strategy=strategy)
    world, data = engine.world_size, Tokens()
    if world > 1 and args.pipeline:
        pipeline_stages(model, world)
    elif world > 1 and not args.auto:
        mp = 2 if world % 2 == 0 else 1
        mesh = dg.ProcessMesh(np.arange(world).reshape(world // mp, mp), dim_names=["dp", "mp"])
        for block in model.blocks:
            dg.shard_tensor(block.mlp.fc1.weight, mesh, [None, "mp"])
            dg.shard_tensor(block.mlp.fc2.weight, mesh, ["mp", None])
        data = dg.shard_dataloader(data, mesh, shard_dims="dp")
    callbacks = [Steps()]
    if args.ckpt:
        callbacks.insert(0, dg.callbacks.ModelCheckpoint(args.ckpt, every_n_steps=args.every))
    if args.step_time:
        callbacks.append(Sleep(args.step_time))
    if args.hold_save_at is not None:
        callbacks.insert(0, HoldSave(args.hold_save_at))
    engine.fit(data, batch_size=BATCH, epochs=args.epochs, verbose=0, callbacks=callbacks)
    state = engine.state_dict()
    if engine.rank == 0 and args.out:
        np.savez(args.out, **state)
        print(f"DONE world={world} step={engine.global_step}", flush=True)


# The parameters of each of the 2 stages, by path; on 1 stage all of them go to the one mesh.
STAGES = (("wte", "wpe", "blocks.0"), ("blocks.1", "ln_f", "lm_head"))


def pipeline_stages(model, world):
    """world // 2 stages (at most 2) of two processes, Megatron's MLP split over each
    stage's "mp"; the other parameters replicated over their stage's mesh."""
    stages = min(world // 2, len(STAGES))
    meshes = [dg.ProcessMesh([2 * s, 2 * s + 1], ["mp"]) for s in range(stages)]
    for name, param in model.named_parameters():
        s = next(i for i, paths in enumerate(STAGES) if any(name.startswith(p + ".") for p in paths))
        mesh = meshes[min(s, stages - 1)]
        spec = [None] * len(param.shape)
        if ".mlp.fc1." in name:
            spec[-1] = "mp"
        elif name.endswith(".mlp.fc2.weight"):
            spec[0] = "mp"
        dg.shard_tensor(param, mesh, spec)


class Sleep(dg.callbacks.Callback):
    def __init__(self, seconds):
        self.seconds = seconds

    def on_step_end(self, step, logs=None):
        time.sleep(self.seconds)


class HoldSave(dg.callbacks.Callback):
    """Runs before ModelCheckpoint: in the first start's save after ``steps`` steps,
    node1's ranks stop before writing their shards (print HOLD and sleep), while node0's
    write theirs and wait for them: the checkpoint is half-written."""

    def __init__(self, steps):
        self.steps = steps

    def on_step_end(self, step, logs=None):
        import socket

        from distgraph.app import checkpoint
        if (step + 1 == self.steps and not self.engine.elastic_restart
                and socket.gethostname() == "node1"):
            def hold(*args):
                print(f"HOLD {step + 1}", flush=True)
                time.sleep(600)

            checkpoint._write_files = hold


if __name__ == "__main__":
    main(sys.argv[1:])
