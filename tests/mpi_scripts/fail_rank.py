"""Training jobs in which one rank goes wrong, for tests/test_failures.py.

Usage: ``distgraph run -n N tests/mpi_scripts/fail_rank.py MODE``, MODE one of

- ``raise``: the relu kernel raises on rank 1 in the second step (N = 4, tensor parallel);
- ``exit``:  rank 2 dies with ``os._exit(3)`` in the second step (N = 4, data parallel);
- ``skip``:  rank 1 trains one step fewer than rank 0 and leaves, so rank 0 waits for a
  message that never comes (N = 2, two stages);
- ``ok``:    the data-parallel plan trains normally; prints ``FAIL-RANK OK``;
- ``pipe_raise``, ``pipe_skip``: as ``raise`` (on rank 0) and ``skip``, with the two stages
  pipelined over 4 micro-batches (N = 2).

The plans need exactly 4 (``skip``: 2) processes, so the same script started with
another ``-n`` or as a plain ``python`` process shows the launch error.
"""

from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import distgraph as dg  # noqa: E402
from distgraph import registry  # noqa: E402

import plans as P  # noqa: E402

FAIL_STEP = 1


def patch_relu(rank: int, action) -> None:
    """On ``rank`` only, make the relu kernel call ``action()`` in step FAIL_STEP."""
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_rank() != rank:
        return
    op = registry.get_op("relu")

    def kernel(ctx, x, **attrs):
        if ctx.step == FAIL_STEP:
            action()
        return op.kernel(ctx, x, **attrs)

    registry._REGISTRY["relu"] = dataclasses.replace(op, kernel=kernel)


def injected_error():
    raise ValueError("injected failure")


def main(mode: str) -> None:
    dg.set_default_dtype("float64")
    plan = {"raise": ("tp", 4), "exit": ("dp", 4), "skip": ("two_stage", 2),
            "ok": ("dp", 4), "pipe_raise": ("two_stage", 2), "pipe_skip": ("two_stage", 2)}[mode]
    strategy = dg.Strategy(micro_batches=4) if mode.startswith("pipe_") else dg.Strategy()
    if mode == "raise":
        patch_relu(1, injected_error)
    elif mode == "pipe_raise":
        patch_relu(0, injected_error)
    elif mode == "exit":
        patch_relu(2, lambda: os._exit(3))
    model = P.build_model("mlp")
    P.PLANS[("mlp", *plan)].annotate(model)
    engine = dg.Engine(model, P.loss_fn("mlp"), P.make_optimizer("adamw"), strategy=strategy)
    callbacks = steps = None
    if mode in ("skip", "pipe_skip"):
        from mpi4py import MPI
        steps = P.STEPS - 1 if MPI.COMM_WORLD.Get_rank() == 1 else None
        # rank 1 stops itself (fit's arguments, which the ranks compare, are alike)
        callbacks = [StopAfter(steps)] if steps is not None else None
    history = engine.fit(P.Dataset("mlp"), batch_size=P.BATCH, epochs=1, callbacks=callbacks,
                         verbose=0)
    if mode in ("skip", "pipe_skip") and steps is not None:
        return  # rank 1 leaves without the last step (and without the collective gather)
    engine.state_dict()
    print(f"FAIL-RANK OK {len(history.losses)} steps", flush=True)


class StopAfter(dg.callbacks.Callback):
    """Ends this rank's fit after ``steps`` steps."""

    def __init__(self, steps: int):
        self.steps = steps

    def on_step_end(self, step, logs=None):
        if step + 1 >= self.steps:
            self.engine.stop_training = True


if __name__ == "__main__":
    main(sys.argv[1])
