"""The ways one rank ends its own way, planted on real ranks (issue 68, item 1), with what
the launcher must say about each: shared by tests/test_rank_endings.py, which checks the
words and what is left, and bench/fault_endings.py, which times them.

Each case runs ``distgraph run -n N tests/mpi_scripts/rank_endings.py MODE RANK``; the
rank prints ``FAULT <rank> <time.time()>`` just before it does what it does.
:func:`stuck_before_mpi` plants the one case that script cannot: a rank whose
interpreter hangs as it starts.

Example::

    mode, n, rank, env, said = ENDING_CASES["os._exit(0)-in-fit"]
    job = Traced(tmp_path, "run", "-n", n, ENDINGS, mode, rank, **env)
"""

from __future__ import annotations

import re
from pathlib import Path

ENDINGS = Path(__file__).parent / "mpi_scripts" / "rank_endings.py"

ENDING_CASES = {
    # id: (mode, ranks, the rank, environment, what the output says)
    "raises-while-the-other-finishes": ("raise", 2, 1, {},
                                        ["rank 1 failed: RuntimeError: boom on rank 1"]),
    "rank-0-raises-while-the-other-finishes": (
        "raise", 2, 0, {}, ["rank 0 failed: RuntimeError: boom on rank 0"]),
    "raises-by-PMI_RANK-without-distgraph": ("raise-pmi", 2, 0, {},
                                             ["rank 0 failed: RuntimeError: boom on rank 0"]),
    "sys.exit(0)-before-its-first-collective": (
        "exit", 4, 2, {}, ["rank 2 ended its script with sys.exit(0) before its first "
                           "collective", "Engine.fit() is collective"]),
    "sleeps-before-its-first-collective": (
        "sleep", 2, 1, {"DISTGRAPH_COMM_TIMEOUT": "5"},
        ["timed out after 5 s", "rank 1 has not started communicating"]),
    "sys.exit(0)-in-fit": ("exit-in-fit", 2, 1, {},
                           ["rank 1 ended its script with sys.exit(0) after step 1, in "
                            "Engine.fit()", "it ended inside Engine.fit(), which every rank "
                            "must run to its end"]),
    "os._exit(0)-in-fit": ("os-exit-in-fit", 2, 1, {},
                           ["rank 1 died without reporting an error (exited with code 0 "
                            "after step 1, in Engine.fit())"]),
    "finishes-while-the-others-train-again": (
        "finish-early", 2, 1, {}, ["rank 1 has finished its script after step 7",
                                   "Engine.fit() is collective: call it on every rank"]),
}

HANG_BEFORE_MPI = """
import os, time
if os.environ.get("PMI_RANK") == "1" and "HANG_MARK" in os.environ:
    with open(os.environ["HANG_MARK"], "w") as f:
        f.write(str(time.time()))
    time.sleep(3600)
"""


def stuck_before_mpi(folder: Path, timeout: float) -> tuple[dict, list, Path]:
    """Rank 1 hangs as its interpreter starts (a sitecustomize in ``folder`` that sleeps:
    a hung import of a network file system, say), before the bootstrap, so before MPI
    starts, under ``DISTGRAPH_COMM_TIMEOUT=timeout``: (the job's environment, what the
    output says, the file where the rank writes the moment it hangs). Any other rank
    may be the one that says it. Run with
    ``rank_endings.py exit 9`` (no rank exits: only the hang is planted)."""
    (folder / "sitecustomize.py").write_text(HANG_BEFORE_MPI)
    mark = folder / "hang.time"
    env = {"PYTHONPATH": str(folder), "HANG_MARK": str(mark),
           "DISTGRAPH_COMM_TIMEOUT": f"{timeout:g}"}
    said = [f"waited {timeout:g} s for MPI to start on every rank (DISTGRAPH_COMM_TIMEOUT) "
            "and rank 1 never began it"]      # said by whichever rank waited longest
    return env, said, mark


def fault_time(output: str) -> float:
    """The ``time.time()`` of the rank's ``FAULT`` line in a job's output."""
    found = re.search(r"^FAULT \d+ (\S+)$", output, re.M)
    assert found, output
    return float(found.group(1))
