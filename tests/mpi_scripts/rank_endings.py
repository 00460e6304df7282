"""One rank ends its own way while the others go on, for tests/test_rank_endings.py.

Usage: ``distgraph run -n N tests/mpi_scripts/rank_endings.py MODE RANK``; rank RANK

- ``raise``:        raises a RuntimeError at once; the others finish without any collective;
- ``raise-pmi``:    the same, told its rank by ``PMI_RANK``, without importing distgraph;
- ``exit``:         calls ``sys.exit(0)`` before its first collective; the others train;
- ``sleep``:        sleeps for an hour before its first collective; the others train;
- ``exit-in-fit``:  calls ``sys.exit(0)`` in step 2 of the training every rank runs;
- ``os-exit-in-fit``: calls ``os._exit(0)`` there;
- ``finish-early``: after the training every rank runs, returns while the others train
  again.

The others train a data-parallel MLP (fault_jobs.py's), which communicates every step. The
rank prints ``FAULT <rank> <time.time()>`` just before it does what it does, so that a test
can measure how long the job lived on after it.
"""

import os
import sys
import time

MODE, RANK = sys.argv[1], int(sys.argv[2])


def fault() -> None:
    print(f"FAULT {RANK} {time.time()}", flush=True)


def main() -> None:
    import distgraph as dg
    from fault_jobs import Regression, mlp_engine

    class EndInStep(dg.callbacks.Callback):
        """On rank RANK, end the process its way when step 2 begins."""

        def __init__(self, end):
            self.end = end

        def on_step_begin(self, step, logs=None):
            if dg.get_rank() == RANK and step == 2:
                fault()
                self.end()

    def train(callbacks=(), epochs=1, engine=None):
        engine = engine or mlp_engine(dg.get_world_size())
        engine.fit(Regression(), batch_size=8, epochs=epochs, verbose=0,
                   callbacks=list(callbacks))
        return engine

    mine = dg.get_rank() == RANK
    if MODE == "raise":
        if mine:
            fault()
            raise RuntimeError(f"boom on rank {RANK}")
    elif MODE in ("exit", "sleep"):
        if mine:
            fault()
            if MODE == "exit":
                sys.exit(0)
            time.sleep(3600)
        train()
    elif MODE == "exit-in-fit":
        train([EndInStep(lambda: sys.exit(0))])
    elif MODE == "os-exit-in-fit":
        train([EndInStep(lambda: os._exit(0))])
    elif MODE == "finish-early":
        engine = train()
        if mine:
            fault()
        else:
            train(epochs=2, engine=engine)
    else:
        raise SystemExit(f"unknown mode {MODE!r}")


if MODE == "raise-pmi":
    if os.environ["PMI_RANK"] == str(RANK):
        fault()
        raise RuntimeError(f"boom on rank {RANK}")
else:
    main()
print(f"FINISHED {os.environ['PMI_RANK']}", flush=True)
