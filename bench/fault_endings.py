"""How fast a job ends when one rank ends its own way (issue 68, item 1: under 10 s from the
fault to the last process of the job gone, non-zero, naming the rank and the cause, and
nothing left behind).

Every case of ``tests/rank_faults.py`` is planted on real ranks with ``distgraph run``
(``tests/mpi_scripts/rank_endings.py``): a rank raises while the other finishes (rank 1,
rank 0, or told its rank by ``PMI_RANK`` without importing distgraph); a rank calls
``sys.exit(0)`` or sleeps before its first collective (``DISTGRAPH_COMM_TIMEOUT=5``, as a
user would set it); a rank leaves ``fit`` by ``sys.exit(0)`` or ``os._exit(0)``; a rank
finishes while the others fit again; and a rank whose interpreter hangs before MPI starts
(``DISTGRAPH_COMM_TIMEOUT=5``). Each job is followed while it runs
(``tests/job_traces.py``: the processes carrying its marker, the MPI files they hold).

Per case it prints: the seconds from the fault (the ``time.time()`` the rank printed just
before it, or wrote as it hung) to the last moment any process of the job but the
launcher was seen alive (polled every 20 ms), and to the launcher's exit; the exit code;
whether the output names the rank and the cause (the words the tests check) and, for an
exception, whether its traceback is in the rank's log; and what was left: processes of
the job, its ``/dev/shm/mpich_shm_*`` and ``/tmp/hydra_hwloc_xmlfile_*`` (of those its
processes held), its status folder. ``MISSED`` marks a case over the 10 s target, and
``FAIL`` one that was not named, ended with 0 or left something.

Run: ``python bench/fault_endings.py [-n N] [--repeats R] [--case ID ...] [--json OUT]``
(``-n``: the ranks of every case but the raises, which run on 2 as the issue's did;
default: the tests' counts).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from job_traces import Traced  # noqa: E402
from rank_faults import ENDING_CASES, ENDINGS, fault_time, stuck_before_mpi  # noqa: E402

TARGET = 10.0        # seconds from the fault to the last process of the job gone
COMM_TIMEOUT = 5     # DISTGRAPH_COMM_TIMEOUT of the cases that wait for a rank
STUCK = "stuck-before-MPI-starts"
GUARD = 120          # a job still running then is stopped and counted as never ending


def cases(nprocs: int | None) -> dict:
    """{id: (mode, ranks, the rank, environment, words)}, STUCK's mode None."""
    out = {}
    for name, (mode, n, rank, env, said) in ENDING_CASES.items():
        if nprocs is not None and not mode.startswith("raise"):
            n = nprocs
        out[name] = (mode, n, rank, env, said)
    out[STUCK] = (None, nprocs or 2, 1, {}, [])
    return out


def run_case(name: str, case: tuple, folder: Path) -> dict:
    mode, n, rank, env, said = case
    logs = folder / "logs"
    mark = None
    if mode is None:             # the hang sits in the interpreter's start, not the script
        env, said, mark = stuck_before_mpi(folder, COMM_TIMEOUT)
        mode, rank = "exit", 9
    job = Traced(folder, "run", "-n", n, "--log-dir", logs, ENDINGS, mode, rank,
                 **{**env, "TMPDIR": str(folder)})
    try:
        rc = job.wait(GUARD)
        ended = True
    except AssertionError:
        rc, ended = None, False
    out = job.output
    alive, files, folders = job.trace.leftovers()
    try:
        fault = float(mark.read_text()) if mark is not None else fault_time(out)
    except (AssertionError, OSError, ValueError):
        fault = None
    named = ended and all(words in out for words in said)
    if named and mode.startswith("raise"):
        log = (logs / f"rank-{rank}.log").read_text()
        named = "Traceback (most recent call last)" in log
    gone = None if fault is None or job.trace.last_seen is None else \
        job.trace.last_seen - fault
    return {"case": name, "ranks": n, "rc": rc, "ended": ended,
            "gone_s": gone, "exit_s": None if fault is None else job.ended - fault,
            "named": named, "processes_left": len(alive), "files_left": files,
            "folders_left": folders, "files_seen": len(job.trace.files),
            "last_line": out.rstrip().splitlines()[-1] if out.strip() else ""}


def verdict(row: dict) -> str:
    failed = (not row["ended"] or not row["rc"] or not row["named"] or row["processes_left"]
              or row["files_left"] or row["folders_left"] or not row["files_seen"])
    late = row["gone_s"] is None or row["gone_s"] >= TARGET
    return " ".join(w for w, bad in (("MISSED", late), ("FAIL", failed)) if bad) or "ok"


def seconds(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def show(rows: list) -> None:
    print(f"\n{'case':<42} {'ranks':>5} {'gone s':>7} {'exit s':>7} {'code':>5} "
          f"{'named':>5} {'left':>5}  target {TARGET:g} s")
    for row in rows:
        left = row["processes_left"] + len(row["files_left"]) + len(row["folders_left"])
        print(f"{row['case']:<42} {row['ranks']:>5} {seconds(row['gone_s']):>7} "
              f"{seconds(row['exit_s']):>7} {str(row['rc']):>5} "
              f"{'yes' if row['named'] else 'NO':>5} {left:>5}  {verdict(row)}")
    worst = max((r["gone_s"] for r in rows if r["gone_s"] is not None), default=None)
    missed = sum(verdict(r) != "ok" for r in rows)
    print(f"\nworst fault-to-gone: {'-' if worst is None else f'{worst:.2f} s'} "
          f"(target < {TARGET:g} s); {len(rows) - missed} of {len(rows)} runs ok")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, help="ranks of every case but the raises")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each case")
    parser.add_argument("--case", nargs="*", help="only these case ids")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args(argv)
    chosen = cases(args.n)
    if args.case:
        unknown = sorted(set(args.case) - set(chosen))
        if unknown:
            parser.error(f"unknown case {unknown}; the cases: {sorted(chosen)}")
        chosen = {k: v for k, v in chosen.items() if k in args.case}
    rows = []
    for repeat in range(args.repeats):
        for name, case in chosen.items():
            with tempfile.TemporaryDirectory(prefix="fault-endings-") as tmp:
                started = time.monotonic()
                row = run_case(name, case, Path(tmp))
                row["repeat"] = repeat
            rows.append(row)
            print(f"{name} (run {repeat + 1}): {verdict(row)} "
                  f"({time.monotonic() - started:.1f} s); {row['last_line']}", flush=True)
    show(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0 if all(verdict(r) == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
