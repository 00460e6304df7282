"""Tutorial 09 on 4 ranks with no cluster file, out of the box: its predicted step
against its measured one.

Runs ``distgraph run -n 4 tutorials/09_text_to_llama.py --tensorboard DIR`` as a user
would, without ``--cluster``: the launcher measures this machine for 4 ranks the first
time (kept under ``$DISTGRAPH_CACHE_DIR``, default ``~/.cache/distgraph``; ``--cache DIR``
keeps this bench's apart, ``--recalibrate`` measures again) and the job's Engine plans on
it. TensorBoard's events then hold the plan's predicted step (``step_time/predicted``, or
``step_time/predicted_uncalibrated`` where the figures are defaults) and every measured
step; the bench prints the predicted step against the fastest and the median measured
step (the first steps, which warm up, left out) and the relative errors. Target:
within 25% of the measured step. The 1-minute load average is printed too: other work on
the machine slows the measured steps, not the prediction.

Run::

    python bench/tutorial09_prediction.py [--cache DIR] [--recalibrate] [--epochs 1]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
TUTORIAL = os.path.join(HERE, "..", "tutorials", "09_text_to_llama.py")
WITHIN = 0.25
WARM_UP = 3          # first steps left out of the measured ones


def events(folder: str) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(folder, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", help="DISTGRAPH_CACHE_DIR for this bench (default: the "
                                        "user's)")
    parser.add_argument("--recalibrate", action="store_true", help="measure the machine again")
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    env = dict(os.environ)
    env.pop("DISTGRAPH_CALIBRATE", None)
    if args.cache:
        env["DISTGRAPH_CACHE_DIR"] = os.path.abspath(args.cache)
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="distgraph-bench-09-") as tmp:
        board = os.path.join(tmp, "tb")
        command = [sys.executable, "-m", "distgraph.cli", "run", "-n", "4",
                   *(["--recalibrate"] if args.recalibrate else []), TUTORIAL,
                   "--tensorboard", board, "--epochs", str(args.epochs)]
        proc = subprocess.run(command, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            print(proc.stdout[-2000:], proc.stderr[-3000:], file=sys.stderr)
            return 2
        got = events(board)
    load.append(os.getloadavg()[0])
    tag = next(t for t in got if t.startswith("step_time/predicted"))
    predicted = got[tag][0]
    measured = np.array(got["step_time/measured"][WARM_UP:])
    fastest, median = float(measured.min()), float(np.median(measured))
    print(f"tutorial 09 on 4 ranks, no cluster file: predicted {predicted * 1e3:.1f} ms "
          f"({tag}); measured over {len(measured)} steps: fastest {fastest * 1e3:.1f} ms, "
          f"median {median * 1e3:.1f} ms")
    errors = {"fastest": predicted / fastest - 1, "median": predicted / median - 1}
    print("error (predicted / measured - 1): " + ", ".join(
        f"{k} {v:+.1%}" for k, v in errors.items()) + f" (target within {WITHIN:.0%})")
    print(f"load average (1 min) on {os.cpu_count()} cores: {load[0]:.2f} before, "
          f"{load[1]:.2f} after")
    return 0 if abs(errors["median"]) <= WITHIN else 1


if __name__ == "__main__":
    sys.exit(main())
