"""Two calibrations of this machine in a row, compared figure by figure: does
``distgraph cluster calibrate`` give the same figures run after run on a machine that
other work loads?

Runs ``distgraph cluster calibrate -n N`` twice (2 ranks by default) and compares the two
files as the cost model prices with them (tests/calibration_agreement.py: rates and
latencies as they are; a pair of figures priced together, such as an op type's µs per
call and ns per unit of work, by the seconds it gives at the sizes the calibration
measured). Prints every figure that differs by more than 10% and how many were compared;
exit status 1 when any does. The 1-minute load average is printed before and after: the
figures are the fastest of many runs, which other processes on the machine leave alone
only some of the time.

Run::

    python bench/calibration_agreement.py [-n 2] [--repeats 3] [--within 0.10]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def calibrate(n: int, repeats: int, out: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "distgraph.cli", "cluster", "calibrate", "-n",
                    str(n), "--repeats", str(repeats), "-o", out], check=True,
                   stdout=subprocess.DEVNULL, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--repeats", type=int, default=3, help="calibrate --repeats")
    parser.add_argument("--within", type=float, default=0.10, help="relative tolerance")
    args = parser.parse_args()
    from calibration_agreement import disagreements

    import distgraph as dg

    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        files = [os.path.join(tmp, f"run{k}.yaml") for k in (1, 2)]
        seconds = [calibrate(args.n, args.repeats, f) for f in files]
        load.append(os.getloadavg()[0])
        bad, total = disagreements(*(dg.Cluster.from_file(f) for f in files), args.within)
    for line in bad:
        print(line)
    print(f"{len(bad)} of {total} priced figures differ by more than {args.within:.0%} "
          f"between two calibrations of {args.n} ranks ({seconds[0]:.0f} s and "
          f"{seconds[1]:.0f} s); load average (1 min) on {os.cpu_count()} cores: "
          f"{load[0]:.2f} before, {load[1]:.2f} after")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
